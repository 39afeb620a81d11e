//! [`CocoonProvider`]: the [`vnode::Provider`] that gives each Pod bound to this node one
//! microVM of its own (`virtual-node.md` §3.4–§3.7), through a [`VmBackend`].
//!
//! # Expected flow
//! * **CreatePod** (key `ns/name`): a tracked entry of an older Pod under the key is retired
//!   first (its VM kept for adoption when the new Pod names the same VM, else deleted as in
//!   DeletePod) → 1. parse the annotations (`vm.cocoonstack.io/name` required; CPU-class gate;
//!   hypervisor check) → 3. *unmanaged*: track the pre-assigned `id`/`ip`, no backend call →
//!   2. *adopt* a live VM: from the start-up map by `vm.cocoonstack.io/id`, then by name, else a
//!   VM of this name in a fresh listing (a create whose answer was lost; a failed listing fails
//!   the create rather than boot a duplicate); a stopped one is started, a `Creating` leftover
//!   removed → 4. *managed*: `run` the image or `clone` the snapshot (`repo[:tag]`, bare =
//!   `latest`), pushing `lifecycle-state=creating` first; a failure records Warning
//!   `CreateBringUpFailed`, pushes `lifecycle-state=failed` and returns the error (retried) →
//!   6. `id`/`ip` written back on every push → 7. clones (and adopted clones not yet `ready`):
//!   guest network configuration every 3 s for ≤ 180 s, exhaustion → `post-clone-hint`,
//!   Warning `PostCloneExecExhausted`, lifecycle `failed` → 8. one synchronous probe, `Running`
//!   + `startTime` pushed, the probe loop started.
//! * **Probe** ([`crate::probe`]): TCP to `probe-port`, else the agent's `info`; unmanaged
//!   without a port: "has an IP". 100 ms ×1.5 → 1 s until Ready, then every 5 s; 3 consecutive
//!   failures flip Ready off. Every flip is pushed.
//! * **UpdatePod**: another UID under the key → CreatePod; else the Pod is stored (probe port
//!   and snapshot policy follow it). Hibernation is not supported: `hibernate: "true"` gets a
//!   Warning `HibernateUnsupported` and a `lifecycle-state-message`, the VM keeps running.
//! * **DeletePod**: unmanaged → forget. Managed: [`annotations::delete_policy`] says whether to
//!   save `<vm-name>:latest`; if so and the VM runs, `snapshot_save` (failure → the VM and the
//!   entry stay, the error is returned and the runtime retries); `remove` (absent = OK);
//!   `release_ip` (best effort); when the policy saves no snapshot and `keep-snapshot-on-delete`
//!   is not `"true"`, `<vm-name>:latest` is dropped (best effort); forget. (A VM that is not
//!   running when a policy wants a snapshot is removed without one, and its earlier snapshot
//!   is kept.)
//! * **VM watcher** ([`crate::watcher`]) and **start-up reconcile** ([`crate::reconcile`]).
//!
//! # Decisions
//! * **Snapshot naming.** DeletePod saves under `<vm-name>:latest`, where `<vm-name>` is the
//!   Pod's `vm.cocoonstack.io/name`; a later Pod clones it with `mode: clone` and
//!   `image: <vm-name>`. (Not under the image repo: the image library names images and
//!   snapshots in one namespace, and a snapshot tagged `latest` under the image's repo would
//!   shadow the image every other Pod boots.)
//! * **Spec §3.7 step 4 vs "a later clone boots from it".** The snapshot a policy asked for is
//!   the deliverable of the delete, so it is kept (upstream pushes it to a registry before
//!   dropping its *local* copies; here the library is the registry). Step 4 applies when no
//!   snapshot was saved (`never`, or `main-only` on a sub-agent): the VM's stale
//!   `<vm-name>:latest` is dropped unless `keep-snapshot-on-delete: "true"`.
//! * **Owner authority (§2.7).** Not adopted: as upstream vk-cocoon, deleting a managed Pod
//!   *is* the VM's end (`managed: "true"` hands the lifecycle to this provider), and continuity
//!   across Pods goes through the snapshot policy, not through a preserved VM. What keeps §5
//!   pitfall 1: DeletePod only runs for a Pod the API deleted; a failed snapshot keeps the VM;
//!   unmanaged VMs are never touched; orphans are destroyed only after a complete VM listing
//!   *and* a complete Pod listing name no Pod for them (`VK_ORPHAN_POLICY` can turn that off).
//! * **Two Pods, one VM name.** As upstream and as the seed documents: a Pod naming the running
//!   VM of another Pod adopts that VM instead of booting its own (Warning `VMNameShared` on the
//!   Pod). Both Pods then share one VM, and deleting either removes it (the other is evicted
//!   with `VMGone`) — the reason a SandboxTemplate cannot carry `vm.cocoonstack.io/name`. While
//!   the first Pod is still creating its VM, the second Pod's create fails and is retried.
//! * **Namespaces** ([`crate::namespaces`]). The adoption above, the start-up map, a fresh
//!   listing, a clone's snapshot, the `<vm-name>:latest` a delete saves over or drops, and the
//!   VM an untracked DeletePod would remove are each checked against the Pod's namespace: the
//!   owner recorded with the VM or snapshot must be that namespace or share a
//!   `VK_SHARED_NAMESPACES` group with it. A refusal fails the create (Warning
//!   `NamespaceRefused`, lifecycle `failed`, retried like every create error); on delete the
//!   VM stays (the Pod goes) and a snapshot that cannot be saved keeps the VM, as a failed save
//!   does. A name held by another namespace (its VM, or its `<name>:latest`) is refused rather
//!   than shadowed: names stay unique on the node.
//! * **State.** Nothing is persisted by the provider: what a restart needs is derived from the
//!   backend's VM list (durable names, ids, states) and the Pods' annotations (`id`,
//!   `lifecycle-state`); see [`crate::reconcile`]. Restart cooldowns and probe state start
//!   afresh.
//!
//! # Caveats
//! A Pod deleted while its status shows no running container is force-deleted by the runtime
//! without a DeletePod call (§1.2 rule 1); a VM booted at that moment is left to the next
//! start-up reconcile (orphan policy).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use tokio::task::AbortHandle;
use vnode::{PodKey, PodNotifier, Provider, ProviderError};

use crate::annotations::{self, AnnotationError, Mode, VmSpec};
use crate::backend::{BackendError, CloneRequest, Hypervisor, RunRequest, SnapshotRef, VmBackend, VmInfo, VmState};
use crate::config::OrphanPolicy;
use crate::events::{self, EventSink, RecordedEvents};
use crate::namespaces::{NamespacePolicy, Use};
use crate::status::{self, VmView};

/// Timings and node facts of a [`CocoonProvider`].
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    /// Reported as every Pod's `hostIP`.
    pub node_ip: String,
    /// The node's `VK_SNAPSHOT_CPU_CLASS`.
    pub cpu_class: Option<String>,
    /// `VK_ORPHAN_POLICY`.
    pub orphan_policy: OrphanPolicy,
    /// `VK_SHARED_NAMESPACES` / `VK_LEGACY_NAMESPACE`: who may use whose VMs and snapshots.
    pub namespaces: NamespacePolicy,
    /// First pre-Ready probe delay (100 ms), growth factor (1.5) and cap (1 s).
    pub probe_initial: Duration,
    pub probe_factor: f64,
    pub probe_max: Duration,
    /// Probe period once Ready (5 s).
    pub probe_ready_interval: Duration,
    /// Consecutive failures that flip Ready off (3).
    pub probe_failures: u32,
    /// One probe's time limit (2 s).
    pub probe_timeout: Duration,
    /// VM watcher period (2 s).
    pub watch_interval: Duration,
    /// A VM that stops again within this long after a restart is removed (30 s).
    pub restart_cooldown: Duration,
    /// Post-clone network configuration: retry period (3 s) and deadline (180 s).
    pub net_retry_interval: Duration,
    pub net_deadline: Duration,
}

impl ProviderConfig {
    /// The spec's timings.
    pub fn new(node_ip: impl Into<String>) -> ProviderConfig {
        ProviderConfig {
            node_ip: node_ip.into(),
            cpu_class: None,
            orphan_policy: OrphanPolicy::Destroy,
            namespaces: NamespacePolicy::isolated(),
            probe_initial: Duration::from_millis(100),
            probe_factor: 1.5,
            probe_max: Duration::from_secs(1),
            probe_ready_interval: Duration::from_secs(5),
            probe_failures: 3,
            probe_timeout: Duration::from_secs(2),
            watch_interval: Duration::from_secs(2),
            restart_cooldown: Duration::from_secs(30),
            net_retry_interval: Duration::from_secs(3),
            net_deadline: Duration::from_secs(180),
        }
    }
}

/// Why a provider call failed. The chain becomes the Pod's `ProviderFailed` message.
#[derive(Debug, thiserror::Error)]
pub enum CocoonProviderError {
    #[error("pod {key}")]
    Annotation {
        key: String,
        #[source]
        source: AnnotationError,
    },
    #[error(
        "pod {key} selects snapshot CPU class {wanted:?} but this node's class is {node:?}: \
         schedule it onto a node of that class"
    )]
    CpuClass { key: String, wanted: String, node: Option<String> },
    #[error("pod {key}: hypervisor {wanted} is unsupported on this node (it runs: {available})")]
    Hypervisor { key: String, wanted: Hypervisor, available: String },
    #[error(
        "pod {key}: pod {other} is still creating VM {name}; retrying (give each pod its own vm.cocoonstack.io/name)"
    )]
    VmNameTaken { key: String, name: String, other: String },
    /// A Pod tried to use a VM or snapshot of another namespace ([`crate::namespaces`]). The
    /// owner is not named (it is in the node's log).
    #[error(
        "pod {key}: {what} belongs to another namespace; a pod may adopt, clone or delete only the VMs and \
         snapshots of its own namespace ({namespace}), so this pod may not {verb} it: {fix}",
        verb = .action.verb(),
        fix = .action.fix()
    )]
    Namespace { key: String, namespace: String, what: String, action: Use },
    #[error("pod {key}: the VMs cannot be listed, so a VM named {name} may exist; not booting a duplicate")]
    List {
        key: String,
        name: String,
        #[source]
        source: BackendError,
    },
    #[error(
        "pod {key}: snapshot {snapshot} is not in the image library: delete a pod whose \
         vm.cocoonstack.io/name is {repo} with snapshot-policy always to create it, or use mode run",
        repo = .snapshot.repo
    )]
    SnapshotMissing { key: String, snapshot: SnapshotRef },
    /// `what`: the VM and the step, e.g. `VM vm-a (run of image ubuntu)`.
    #[error("pod {key}: bringing up {what}")]
    BringUp {
        key: String,
        what: String,
        #[source]
        source: BackendError,
    },
    #[error("pod {key}: starting the stopped VM {id} to adopt it")]
    Adopt {
        key: String,
        id: String,
        #[source]
        source: BackendError,
    },
    #[error("pod {key}: cannot tell whether VM {id} runs, so cannot decide on its snapshot; the VM is kept")]
    Inspect {
        key: String,
        id: String,
        #[source]
        source: BackendError,
    },
    #[error("pod {key}: saving snapshot {snapshot} of VM {id} failed; the VM is kept and the delete retried")]
    Snapshot {
        key: String,
        id: String,
        snapshot: SnapshotRef,
        #[source]
        source: Box<BackendError>,
    },
    #[error("pod {key}: removing VM {id}")]
    Remove {
        key: String,
        id: String,
        #[source]
        source: BackendError,
    },
    #[error("start-up reconcile: the VMs cannot be listed")]
    Reconcile(#[source] BackendError),
}

/// The provider error the runtime shows: the whole chain as one message.
fn report(e: &dyn std::error::Error) -> ProviderError {
    ProviderError::reported(e)
}

pub use vnode::provider::error_chain;

/// `vm.cocoonstack.io/lifecycle-state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Creating,
    Ready,
    Failed,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Creating => "creating",
            Lifecycle::Ready => "ready",
            Lifecycle::Failed => "failed",
        }
    }
}

/// Why a tracked Pod is `Failed`.
#[derive(Debug, Clone)]
pub(crate) struct Terminal {
    pub reason: String,
    pub message: String,
    pub at: Time,
}

/// One tracked Pod and its VM.
pub(crate) struct Entry {
    /// The latest Pod from the API (its status is replaced on every push).
    pub pod: Pod,
    pub uid: String,
    pub spec: VmSpec,
    pub vm: VmInfo,
    pub started_at: Time,
    pub lifecycle: Lifecycle,
    pub message: Option<String>,
    pub hint: Option<String>,
    /// The probe's verdict; Ready = this ∧ lifecycle `ready`.
    pub probe_ok: bool,
    /// Consecutive probe failures while `probe_ok`.
    pub failures: u32,
    /// Evicted: the Pod is `Failed` and the VM gone.
    pub terminal: Option<Terminal>,
    /// When the watcher last started this VM again.
    pub last_restart: Option<tokio::time::Instant>,
    /// Distinguishes this entry from an earlier one under the same key (background tasks
    /// check it after every await).
    pub gen: u64,
    /// A provider call is working on the VM (create finishing, delete): the watcher and the
    /// probe loop leave it alone.
    pub busy: bool,
    /// The probe loop's task.
    pub probe: Option<AbortHandle>,
    /// The hibernate request was already answered.
    pub hibernate_noted: bool,
}

impl Entry {
    pub fn ready(&self) -> bool {
        self.probe_ok && self.lifecycle == Lifecycle::Ready && self.terminal.is_none()
    }

    /// The annotations vk-cocoon writes back (none for unmanaged Pods: their VM is not ours).
    fn out_annotations(&self) -> BTreeMap<String, String> {
        if !self.spec.managed {
            return BTreeMap::new();
        }
        let mut a = lifecycle_annotations(self.lifecycle, self.message.as_deref());
        a.insert(annotations::VM_ID.into(), self.vm.id.clone());
        if let Some(ip) = &self.vm.ip {
            a.insert(annotations::VM_IP.into(), ip.clone());
        }
        if let Some(h) = &self.hint {
            a.insert(annotations::POST_CLONE_HINT.into(), h.clone());
        }
        a
    }

    /// The Pod as pushed: status from the VM, annotations written back.
    pub fn view(&self, node_ip: &str) -> Pod {
        let v = VmView {
            vm_id: &self.vm.id,
            ip: self.vm.ip.as_deref(),
            node_ip,
            started_at: &self.started_at,
            ready: self.ready(),
        };
        let st = match &self.terminal {
            Some(t) => status::failed(&self.pod, &v, &t.reason, &t.message, &t.at),
            None => status::running(&self.pod, &v),
        };
        status::pushed(&self.pod, st, &self.out_annotations())
    }

    fn stop_probe(&mut self) {
        if let Some(h) = self.probe.take() {
            h.abort();
        }
    }
}

/// `lifecycle-state` and `lifecycle-state-message`. The message is written empty when there
/// is none: a push can add or change annotations but never remove one (the runtime merges
/// them into `pods/status`), so an empty value is how an earlier message is cleared.
fn lifecycle_annotations(l: Lifecycle, message: Option<&str>) -> BTreeMap<String, String> {
    BTreeMap::from([
        (annotations::LIFECYCLE_STATE.to_owned(), l.as_str().to_owned()),
        (annotations::LIFECYCLE_MESSAGE.to_owned(), message.unwrap_or_default().to_owned()),
    ])
}

#[derive(Default)]
pub(crate) struct Inner {
    /// Key → tracked Pod.
    pub entries: BTreeMap<String, Entry>,
    /// VM id → a live VM found at start-up that a Pod references and no Pod has adopted yet.
    pub adoptable: BTreeMap<String, VmInfo>,
    /// Ids in `adoptable` that outlived a provider restart (found by the start-up reconcile),
    /// as opposed to a VM handed from an older Pod to a newer one under the same key.
    pub restarted: BTreeSet<String>,
    /// VM name → the key creating it (between the name check and the entry).
    pub reserved: BTreeMap<String, String>,
    pub next_gen: u64,
}

/// The provider's shared state (background tasks hold it too).
pub(crate) struct Shared {
    pub backend: Arc<dyn VmBackend>,
    pub cfg: ProviderConfig,
    inner: Mutex<Inner>,
    notifier: Mutex<Option<PodNotifier>>,
    events: Mutex<Arc<dyn EventSink>>,
}

/// Releases a VM-name reservation when the create ends, however it ends.
struct Reservation {
    shared: Arc<Shared>,
    name: String,
    key: String,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        if g.reserved.get(&self.name) == Some(&self.key) {
            g.reserved.remove(&self.name);
        }
    }
}

fn uid_of(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// The Pod's namespace (empty when it has none: such a Pod owns nothing and shares nothing).
pub(crate) fn namespace_of(pod: &Pod) -> String {
    pod.metadata.namespace.clone().unwrap_or_default()
}

/// The namespace part of a key `ns/name`.
fn key_namespace(key: &str) -> &str {
    key.split_once('/').map(|(ns, _)| ns).unwrap_or_default()
}

fn now() -> Time {
    Time(Timestamp::now())
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // No await under the lock: the tables are whole at every unlock, so a poisoned lock
        // (a panic elsewhere) still guards valid data.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn notify(&self, pod: Pod) {
        let n = self.notifier.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        match n {
            Some(n) => n.notify(pod),
            None => tracing::debug!("no notifier yet; status push dropped"),
        }
    }

    pub fn event(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        if warning {
            tracing::warn!(reason, message, "pod event");
        } else {
            tracing::info!(reason, message, "pod event");
        }
        let sink = self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        sink.record(pod, warning, reason, message);
    }

    /// Pushes the entry at `key` if it is still generation `gen`.
    pub fn push_entry(&self, key: &str, gen: u64) {
        let view = self.lock().entries.get(key).filter(|e| e.gen == gen).map(|e| e.view(&self.cfg.node_ip));
        if let Some(v) = view {
            self.notify(v);
        }
    }

    /// A Pending push carrying a lifecycle state (before a VM exists, or after a failed bring-up).
    fn push_pending(&self, pod: &Pod, l: Lifecycle, message: Option<&str>) {
        self.notify(status::pushed(pod, status::pending(pod), &lifecycle_annotations(l, message)));
    }

    fn insert_entry(&self, key: &str, pod: &Pod, spec: VmSpec, vm: VmInfo, lifecycle: Lifecycle) -> u64 {
        let mut g = self.lock();
        g.next_gen += 1;
        let gen = g.next_gen;
        let started_at = pod.status.as_ref().and_then(|s| s.start_time.clone()).unwrap_or_else(now);
        let entry = Entry {
            pod: pod.clone(),
            uid: uid_of(pod),
            spec,
            vm,
            started_at,
            lifecycle,
            message: None,
            hint: None,
            probe_ok: false,
            failures: 0,
            terminal: None,
            last_restart: None,
            gen,
            busy: true,
            probe: None,
            hibernate_noted: false,
        };
        if let Some(mut old) = g.entries.insert(key.to_owned(), entry) {
            old.stop_probe();
        }
        gen
    }

    // ------------------------------------------------------------------ CreatePod

    #[tracing::instrument(name = "create_pod", skip_all, fields(pod = %PodKey::of(pod), vm = tracing::field::Empty))]
    async fn create(self: &Arc<Self>, pod: &Pod) -> Result<(), CocoonProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        let same = self.lock().entries.get(&key).map(|e| e.uid == uid);
        match same {
            Some(true) => return self.update(pod).await,
            Some(false) => self.retire(&key, pod).await?,
            None => {}
        }
        // 1. The spec.
        let spec =
            annotations::parse(pod).map_err(|source| CocoonProviderError::Annotation { key: key.clone(), source })?;
        if let Some(wanted) = annotations::selected_cpu_class(pod) {
            if self.cfg.cpu_class.as_deref() != Some(wanted) {
                return Err(CocoonProviderError::CpuClass {
                    key,
                    wanted: wanted.to_owned(),
                    node: self.cfg.cpu_class.clone(),
                });
            }
        }
        // 3. Unmanaged: only tracked.
        if !spec.managed {
            return self.track_unmanaged(&key, pod, spec).await;
        }
        let hypervisor = self.hypervisor_for(&key, &spec)?;
        self.create_managed(&key, pod, spec, hypervisor).await.map_err(|e| self.refused(pod, e, true))
    }

    /// Steps 2 and 4 of a managed Pod; every VM and snapshot it touches passes the namespace
    /// rule ([`crate::namespaces`]) first.
    async fn create_managed(
        self: &Arc<Self>,
        key: &str,
        pod: &Pod,
        spec: VmSpec,
        hypervisor: Hypervisor,
    ) -> Result<(), CocoonProviderError> {
        let ns = namespace_of(pod);
        // 2a. The seed's documented constraint: a Pod naming the live VM of another Pod adopts
        // that VM instead of booting its own (upstream behaviour; shown, not hidden) — when
        // that VM is of its namespace, or of one sharing with it.
        if let Some((other, vm)) = self.live_vm_named(key, &spec.vm_name) {
            self.check_namespace(key, &ns, vm.namespace.as_deref(), || format!("VM {}", spec.vm_name), Use::Adopt)?;
            let msg = format!(
                "VM name {} is already used by pod {other}: this pod adopts VM {} instead of booting its own \
                 (give each Sandbox its own vm.cocoonstack.io/name)",
                spec.vm_name, vm.id
            );
            tracing::warn!(vm = %vm.id, other = %other, "{msg}");
            self.event(pod, true, events::VM_NAME_SHARED, &msg);
            return self.adopt(key, pod, spec, hypervisor, vm, false).await;
        }
        // 2. Adopt a live VM.
        let _reservation = self.reserve(key, &ns, &spec.vm_name)?;
        if let Some((vm, from_startup)) = self.find_adoptable(key, pod, &spec).await? {
            return self.adopt(key, pod, spec, hypervisor, vm, from_startup).await;
        }
        // 4. Boot — under a name no other namespace holds through its saved state: the
        // deletion of this VM saves or drops `<name>:latest`.
        let own = SnapshotRef::latest(&spec.vm_name);
        match self.backend.snapshot_inspect(&own).await {
            Ok(Some(info)) => self.check_namespace(
                key,
                &ns,
                info.namespace.as_deref(),
                || format!("the name {} (its snapshot {own} exists)", spec.vm_name),
                Use::Name,
            )?,
            Ok(None) => {}
            Err(source) => {
                let what = format!("VM {} (looking up snapshot {own})", spec.vm_name);
                let e = CocoonProviderError::BringUp { key: key.to_owned(), what, source };
                return Err(self.bring_up_failed(pod, e));
            }
        }
        self.boot(key, pod, spec, hypervisor).await
    }

    fn hypervisor_for(&self, key: &str, spec: &VmSpec) -> Result<Hypervisor, CocoonProviderError> {
        let available = self.backend.hypervisors();
        let wanted = spec.hypervisor.or_else(|| available.first().copied()).unwrap_or(Hypervisor::Qemu);
        if !available.contains(&wanted) {
            return Err(CocoonProviderError::Hypervisor {
                key: key.to_owned(),
                wanted,
                available: available.iter().map(|h| h.as_str()).collect::<Vec<_>>().join(", "),
            });
        }
        Ok(wanted)
    }

    /// Another live, managed Pod's running VM called `name`, with that Pod's key.
    fn live_vm_named(&self, key: &str, name: &str) -> Option<(String, VmInfo)> {
        let g = self.lock();
        g.entries
            .iter()
            .find(|(k, e)| {
                k.as_str() != key
                    && e.terminal.is_none()
                    && e.spec.managed
                    && e.spec.vm_name == name
                    && e.vm.state == VmState::Running
            })
            .map(|(k, e)| (k.clone(), e.vm.clone()))
    }

    /// Claims `name` for `key`, refusing a name another Pod is still creating (retried with
    /// backoff; once that VM runs, this Pod adopts it).
    /// A name another namespace is creating is refused at once (without naming that Pod).
    fn reserve(self: &Arc<Self>, key: &str, ns: &str, name: &str) -> Result<Reservation, CocoonProviderError> {
        let mut g = self.lock();
        let other = g
            .entries
            .iter()
            .find(|(k, e)| k.as_str() != key && e.terminal.is_none() && e.spec.managed && e.spec.vm_name == name)
            .map(|(k, e)| (k.clone(), e.vm.namespace.clone()))
            .or_else(|| {
                g.reserved
                    .get(name)
                    .filter(|k| k.as_str() != key)
                    .map(|k| (k.clone(), Some(key_namespace(k).to_owned())))
            });
        if let Some((other, owner)) = other {
            self.check_namespace(key, ns, owner.as_deref(), || format!("VM {name}"), Use::Name)?;
            return Err(CocoonProviderError::VmNameTaken { key: key.to_owned(), name: name.to_owned(), other });
        }
        g.reserved.insert(name.to_owned(), key.to_owned());
        Ok(Reservation { shared: self.clone(), name: name.to_owned(), key: key.to_owned() })
    }

    /// Step 2's candidates: the adoptable map by id, then by name; else a VM of this name in a
    /// fresh listing that no entry tracks. `true` = the VM outlived a provider restart.
    async fn find_adoptable(
        &self,
        key: &str,
        pod: &Pod,
        spec: &VmSpec,
    ) -> Result<Option<(VmInfo, bool)>, CocoonProviderError> {
        let ns = namespace_of(pod);
        {
            let mut g = self.lock();
            let by_id = annotations::value(pod, annotations::VM_ID)
                .and_then(|id| g.adoptable.get(id))
                .map(|v| (v.clone(), format!("VM {}", v.id)));
            let found = by_id.or_else(|| {
                g.adoptable.values().find(|v| v.name == spec.vm_name).map(|v| (v.clone(), format!("VM {}", v.name)))
            });
            if let Some((vm, what)) = found {
                // A refused VM stays adoptable for a Pod of its own namespace.
                self.check_namespace(key, &ns, vm.namespace.as_deref(), || what, Use::Adopt)?;
                g.adoptable.remove(&vm.id);
                let restarted = g.restarted.remove(&vm.id);
                return Ok(Some((vm, restarted)));
            }
        }
        let vms = self.backend.list().await.map_err(|source| CocoonProviderError::List {
            key: key.to_owned(),
            name: spec.vm_name.clone(),
            source,
        })?;
        let g = self.lock();
        let tracked: BTreeSet<&str> =
            g.entries.values().filter(|e| e.terminal.is_none()).map(|e| e.vm.id.as_str()).collect();
        let Some(vm) = vms.into_iter().find(|v| v.name == spec.vm_name) else { return Ok(None) };
        let action = if tracked.contains(vm.id.as_str()) { Use::Name } else { Use::Adopt };
        self.check_namespace(key, &ns, vm.namespace.as_deref(), || format!("VM {}", spec.vm_name), action)?;
        Ok((!tracked.contains(vm.id.as_str())).then_some((vm, false)))
    }

    async fn adopt(
        self: &Arc<Self>,
        key: &str,
        pod: &Pod,
        spec: VmSpec,
        hypervisor: Hypervisor,
        vm: VmInfo,
        from_startup: bool,
    ) -> Result<(), CocoonProviderError> {
        tracing::Span::current().record("vm", vm.id.as_str());
        let vm = match vm.state {
            VmState::Running => vm,
            VmState::Creating => {
                // A create that never finished: nothing is creating it any more.
                tracing::info!(vm = %vm.id, "removing a VM left half-created; booting afresh");
                self.backend.remove(&vm.id).await.map_err(|source| CocoonProviderError::Remove {
                    key: key.to_owned(),
                    id: vm.id.clone(),
                    source,
                })?;
                if let Err(e) = self.backend.release_ip(&vm.id).await {
                    tracing::warn!(vm = %vm.id, error = %error_chain(&e), "releasing the half-created VM's lease failed");
                }
                return self.boot(key, pod, spec, hypervisor).await;
            }
            VmState::Stopped => match self.backend.start(&vm.id).await {
                Ok(v) => v,
                Err(source) => {
                    let e = CocoonProviderError::Adopt { key: key.to_owned(), id: vm.id.clone(), source };
                    let msg = error_chain(&e);
                    self.event(pod, true, events::RESUME_START_FAILED, &msg);
                    self.push_pending(pod, Lifecycle::Failed, Some(&msg));
                    let mut g = self.lock();
                    if from_startup {
                        g.restarted.insert(vm.id.clone());
                    }
                    g.adoptable.insert(vm.id.clone(), vm);
                    return Err(e);
                }
            },
        };
        let owed_network =
            spec.mode == Mode::Clone && annotations::value(pod, annotations::LIFECYCLE_STATE) != Some("ready");
        let lifecycle = if owed_network { Lifecycle::Creating } else { Lifecycle::Ready };
        let gen = self.insert_entry(key, pod, spec, vm.clone(), lifecycle);
        tracing::info!(vm = %vm.id, name = %vm.name, from_startup, "adopted a live VM");
        if from_startup {
            self.event(
                pod,
                false,
                events::RESUMED_AFTER_RESTART,
                &format!("adopted VM {} after a provider restart", vm.id),
            );
        }
        if owed_network {
            self.post_clone(key, gen).await;
        }
        self.finish(key, gen).await;
        Ok(())
    }

    async fn boot(
        self: &Arc<Self>,
        key: &str,
        pod: &Pod,
        spec: VmSpec,
        hypervisor: Hypervisor,
    ) -> Result<(), CocoonProviderError> {
        self.push_pending(pod, Lifecycle::Creating, None);
        let result = match (spec.mode, &spec.snapshot, &spec.image) {
            (Mode::Clone, Some(snapshot), _) => match self.backend.snapshot_inspect(snapshot).await {
                Ok(Some(info)) => {
                    self.check_namespace(
                        key,
                        &namespace_of(pod),
                        info.namespace.as_deref(),
                        || format!("snapshot {snapshot}"),
                        Use::Clone,
                    )?;
                    self.backend
                        .clone_vm(&CloneRequest {
                            name: spec.vm_name.clone(),
                            namespace: namespace_of(pod),
                            snapshot: snapshot.clone(),
                            network: spec.network.clone(),
                            shared_network: spec.shared_network.clone(),
                            hypervisor,
                        })
                        .await
                        .map_err(|source| (format!("clone of {snapshot}"), source))
                }
                Ok(None) => {
                    let e = CocoonProviderError::SnapshotMissing { key: key.to_owned(), snapshot: snapshot.clone() };
                    return Err(self.bring_up_failed(pod, e));
                }
                Err(source) => Err((format!("looking up snapshot {snapshot}"), source)),
            },
            (Mode::Run, _, Some(image)) => {
                let (vcpus, memory_mib) = annotations::run_resources(pod);
                self.backend
                    .run(&RunRequest {
                        name: spec.vm_name.clone(),
                        namespace: namespace_of(pod),
                        image: image.clone(),
                        vcpus,
                        memory_mib,
                        storage_bytes: spec.storage_bytes,
                        network: spec.network.clone(),
                        shared_network: spec.shared_network.clone(),
                        hypervisor,
                    })
                    .await
                    .map_err(|source| (format!("run of image {image}"), source))
            }
            // `annotations::parse` gives every managed spec its source; keep the error typed anyway.
            _ => Err((
                "no source".to_owned(),
                BackendError::NotFound { what: format!("the image or snapshot of VM {}", spec.vm_name) },
            )),
        };
        let vm = match result {
            Ok(vm) => vm,
            Err((what, source)) => {
                let what = format!("VM {} ({what})", spec.vm_name);
                let e = CocoonProviderError::BringUp { key: key.to_owned(), what, source };
                return Err(self.bring_up_failed(pod, e));
            }
        };
        tracing::Span::current().record("vm", vm.id.as_str());
        tracing::info!(vm = %vm.id, ip = ?vm.ip, mode = ?spec.mode, "VM up");
        let clone = spec.mode == Mode::Clone;
        let gen = self.insert_entry(key, pod, spec, vm, if clone { Lifecycle::Creating } else { Lifecycle::Ready });
        if clone {
            self.post_clone(key, gen).await;
        }
        self.finish(key, gen).await;
        Ok(())
    }

    /// `Ok` when a Pod of `ns` may use what `recorded` owns; else the refusal (the owner goes
    /// to the node's log, never into the Pod's message).
    fn check_namespace(
        &self,
        key: &str,
        ns: &str,
        recorded: Option<&str>,
        what: impl FnOnce() -> String,
        action: Use,
    ) -> Result<(), CocoonProviderError> {
        if self.cfg.namespaces.permits(ns, recorded) {
            return Ok(());
        }
        let mut what = what();
        let owner = self.cfg.namespaces.owner(recorded);
        tracing::warn!(pod = key, namespace = ns, owner, recorded = recorded.is_some(), %what, action = action.verb(), "refused: another namespace's VM or snapshot (VK_SHARED_NAMESPACES does not let them share)");
        if recorded.is_none() {
            what.push_str(" (recorded without a namespace, so it belongs to VK_LEGACY_NAMESPACE's)");
        }
        Err(CocoonProviderError::Namespace { key: key.to_owned(), namespace: ns.to_owned(), what, action })
    }

    /// Warning `NamespaceRefused` for a namespace refusal (+ lifecycle `failed` when `creating`);
    /// any other error passes through untouched.
    fn refused(&self, pod: &Pod, e: CocoonProviderError, creating: bool) -> CocoonProviderError {
        if matches!(e, CocoonProviderError::Namespace { .. }) {
            let msg = error_chain(&e);
            self.event(pod, true, events::NAMESPACE_REFUSED, &msg);
            if creating {
                self.push_pending(pod, Lifecycle::Failed, Some(&msg));
            }
        }
        e
    }

    /// Warning `CreateBringUpFailed` + lifecycle `failed`; returns the error for the caller.
    fn bring_up_failed(&self, pod: &Pod, e: CocoonProviderError) -> CocoonProviderError {
        let msg = error_chain(&e);
        self.event(pod, true, events::CREATE_BRING_UP_FAILED, &msg);
        self.push_pending(pod, Lifecycle::Failed, Some(&msg));
        e
    }

    /// Step 7: configure the clone's network, every `net_retry_interval` until `net_deadline`.
    async fn post_clone(&self, key: &str, gen: u64) {
        let Some(id) = self.lock().entries.get(key).filter(|e| e.gen == gen).map(|e| e.vm.id.clone()) else {
            return;
        };
        let deadline = tokio::time::Instant::now() + self.cfg.net_deadline;
        let mut attempts = 0u32;
        let last_error = loop {
            attempts += 1;
            match self.backend.configure_network(&id).await {
                Ok(()) => {
                    let pod = {
                        let mut g = self.lock();
                        let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
                        e.lifecycle = Lifecycle::Ready;
                        e.message = None;
                        e.pod.clone()
                    };
                    self.event(&pod, false, events::POST_CLONE_SUCCEEDED, &format!("network of VM {id} configured"));
                    return;
                }
                Err(e) => {
                    tracing::debug!(vm = %id, attempts, error = %error_chain(&e), "post-clone network configuration failed");
                    if tokio::time::Instant::now() + self.cfg.net_retry_interval > deadline {
                        break e;
                    }
                    tokio::time::sleep(self.cfg.net_retry_interval).await;
                }
            }
        };
        let msg = format!(
            "the network of VM {id} could not be configured after {attempts} attempts in {:?}: {}",
            self.cfg.net_deadline,
            error_chain(&last_error)
        );
        let pod = {
            let mut g = self.lock();
            let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
            e.lifecycle = Lifecycle::Failed;
            e.message = Some(msg.clone());
            e.hint = self.backend.network_hint(&e.vm).map(|h| base64::engine::general_purpose::STANDARD.encode(h));
            e.pod.clone()
        };
        self.event(&pod, true, events::POST_CLONE_EXEC_EXHAUSTED, &msg);
    }

    /// Step 8: one synchronous probe, Running pushed, the probe loop started.
    async fn finish(self: &Arc<Self>, key: &str, gen: u64) {
        if let Some(target) = self.probe_target(key, gen) {
            let ok = self.probe_once(&target).await;
            let hibernate = {
                let mut g = self.lock();
                let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
                e.probe_ok = ok;
                e.busy = false;
                e.spec.hibernate
            };
            if hibernate {
                self.note_hibernate(key, gen);
            }
        }
        let task = tokio::spawn(self.clone().probe_loop(key.to_owned(), gen));
        {
            let mut g = self.lock();
            match g.entries.get_mut(key).filter(|e| e.gen == gen) {
                Some(e) => e.probe = Some(task.abort_handle()),
                None => task.abort(),
            }
        }
        self.push_entry(key, gen);
    }

    async fn track_unmanaged(self: &Arc<Self>, key: &str, pod: &Pod, spec: VmSpec) -> Result<(), CocoonProviderError> {
        let Some(pre) = spec.preassigned.clone() else {
            // `annotations::parse` requires both for an unmanaged Pod.
            return Err(CocoonProviderError::Annotation {
                key: key.to_owned(),
                source: AnnotationError::UnmanagedWithoutVm("both"),
            });
        };
        tracing::Span::current().record("vm", pre.id.as_str());
        let vm = VmInfo {
            id: pre.id,
            name: spec.vm_name.clone(),
            namespace: Some(namespace_of(pod)),
            ip: Some(pre.ip),
            state: VmState::Running,
            hypervisor: self.backend.hypervisors().first().copied().unwrap_or(Hypervisor::Qemu),
        };
        let gen = self.insert_entry(key, pod, spec, vm, Lifecycle::Ready);
        tracing::info!("tracking an unmanaged VM");
        self.finish(key, gen).await;
        Ok(())
    }

    /// An entry of an older Pod under `key`: its VM goes to the new Pod when the names match,
    /// else it is deleted like a DeletePod of the old Pod.
    async fn retire(self: &Arc<Self>, key: &str, new_pod: &Pod) -> Result<(), CocoonProviderError> {
        let (old_pod, vm, managed, terminal, gen, name) = {
            let g = self.lock();
            let Some(e) = g.entries.get(key) else { return Ok(()) };
            (e.pod.clone(), e.vm.clone(), e.spec.managed, e.terminal.is_some(), e.gen, e.spec.vm_name.clone())
        };
        if terminal || !managed || annotations::vm_name(new_pod).ok().as_deref() == Some(name.as_str()) {
            let mut g = self.lock();
            if let Some(mut e) = g.entries.remove(key) {
                e.stop_probe();
            }
            if managed && !terminal {
                tracing::info!(vm = %vm.id, "a new pod took over this key and names the same VM; it adopts it");
                g.adoptable.insert(vm.id.clone(), vm);
            }
            return Ok(());
        }
        tracing::info!(vm = %vm.id, "a new pod took over this key; deleting the old pod's VM");
        self.delete_vm(key, &old_pod, vm, Some(gen)).await
    }

    // ------------------------------------------------------------------ UpdatePod

    #[tracing::instrument(name = "update_pod", skip_all, fields(pod = %PodKey::of(pod)))]
    async fn update(self: &Arc<Self>, pod: &Pod) -> Result<(), CocoonProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        enum Next {
            Create,
            Push(Box<Pod>),
            Hibernate(u64),
            Nothing,
        }
        let next = {
            let mut g = self.lock();
            match g.entries.get_mut(&key) {
                None => Next::Create,
                Some(e) if e.uid != uid => Next::Create,
                Some(e) => {
                    e.pod = pod.clone();
                    if let Ok(spec) = annotations::parse(pod) {
                        e.spec.probe_port = spec.probe_port;
                        e.spec.snapshot_policy = spec.snapshot_policy;
                        e.spec.keep_snapshot_on_delete = spec.keep_snapshot_on_delete;
                        e.spec.hibernate = spec.hibernate;
                    }
                    if e.terminal.is_some() {
                        Next::Push(Box::new(e.view(&self.cfg.node_ip)))
                    } else if e.spec.hibernate && !e.hibernate_noted && !e.busy {
                        Next::Hibernate(e.gen)
                    } else {
                        Next::Nothing
                    }
                }
            }
        };
        match next {
            Next::Create => return Box::pin(self.create(pod)).await,
            Next::Push(p) => self.notify(*p),
            Next::Hibernate(gen) => {
                self.note_hibernate(&key, gen);
                self.push_entry(&key, gen);
            }
            Next::Nothing => {}
        }
        Ok(())
    }

    /// Answers `hibernate: "true"` once per entry: not supported, the VM keeps running.
    fn note_hibernate(&self, key: &str, gen: u64) {
        let pod = {
            let mut g = self.lock();
            let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen && !e.hibernate_noted) else { return };
            e.hibernate_noted = true;
            if e.spec.managed {
                e.message = Some(HIBERNATE_MESSAGE.to_owned());
            }
            e.pod.clone()
        };
        self.event(&pod, true, events::HIBERNATE_UNSUPPORTED, HIBERNATE_MESSAGE);
    }

    // ------------------------------------------------------------------ DeletePod

    #[tracing::instrument(name = "delete_pod", skip_all, fields(pod = %PodKey::of(pod), vm = tracing::field::Empty))]
    async fn delete(self: &Arc<Self>, pod: &Pod) -> Result<(), CocoonProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        enum Plan {
            Done,
            Tracked(VmInfo, u64),
            Untracked(VmInfo),
            /// The VM the Pod names is another namespace's: left alone.
            Refused(CocoonProviderError),
            ReleaseOnly(String),
        }
        let plan = {
            let mut g = self.lock();
            match g.entries.get_mut(&key) {
                Some(e) if !uid.is_empty() && e.uid != uid => {
                    tracing::debug!(%uid, "ignoring a delete for another pod generation");
                    Plan::Done
                }
                Some(e) if e.terminal.is_some() || !e.spec.managed => {
                    if let Some(mut e) = g.entries.remove(&key) {
                        e.stop_probe();
                    }
                    tracing::info!("forgot the pod (unmanaged, or its VM is already gone)");
                    Plan::Done
                }
                Some(e) => {
                    e.busy = true;
                    Plan::Tracked(e.vm.clone(), e.gen)
                }
                None if !annotations::flag(pod, annotations::MANAGED) => Plan::Done,
                None => {
                    let id = annotations::value(pod, annotations::VM_ID);
                    let name = annotations::vm_name(pod).ok();
                    let found = id
                        .and_then(|id| g.adoptable.get(id))
                        .or_else(|| g.adoptable.values().find(|v| Some(&v.name) == name.as_ref()))
                        .cloned();
                    match (found, id) {
                        (Some(vm), _) => match self.check_namespace(
                            &key,
                            &namespace_of(pod),
                            vm.namespace.as_deref(),
                            || format!("VM {}", vm.id),
                            Use::Delete,
                        ) {
                            Ok(()) => {
                                g.adoptable.remove(&vm.id);
                                g.restarted.remove(&vm.id);
                                Plan::Untracked(vm)
                            }
                            Err(e) => Plan::Refused(e),
                        },
                        (None, Some(id)) if !g.entries.values().any(|e| e.vm.id == id) => {
                            Plan::ReleaseOnly(id.to_owned())
                        }
                        (None, _) => Plan::Done,
                    }
                }
            }
        };
        match plan {
            Plan::Done => Ok(()),
            Plan::Tracked(vm, gen) => self.delete_vm(&key, pod, vm, Some(gen)).await,
            Plan::Untracked(vm) => {
                let r = self.delete_vm(&key, pod, vm.clone(), None).await;
                if r.is_err() {
                    self.lock().adoptable.insert(vm.id.clone(), vm);
                }
                r
            }
            Plan::Refused(e) => {
                // The Pod goes; the VM stays for a Pod of its own namespace (or the orphan policy).
                let _ = self.refused(pod, e, false);
                Ok(())
            }
            Plan::ReleaseOnly(id) => {
                // The VM was not found at start-up (it was removed before a restart): only the
                // lease may remain — released only when the backend is sure no VM has the id
                // now (the id comes from the Pod, and a VM of another namespace may have been
                // created under it since).
                match self.backend.inspect(&id).await {
                    Ok(None) => {}
                    Ok(Some(_)) => {
                        tracing::info!(vm = %id, "a VM with the pod's id exists now; its lease is not released");
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!(vm = %id, error = %error_chain(&e), "cannot tell whether the VM exists; its lease is kept");
                        return Ok(());
                    }
                }
                if let Err(e) = self.backend.release_ip(&id).await {
                    tracing::warn!(vm = %id, error = %error_chain(&e), "releasing the lease of a gone VM failed");
                }
                Ok(())
            }
        }
    }

    /// Snapshot per policy → remove → release the lease → drop the stale snapshot → forget.
    /// Any error before the removal keeps the VM (and the entry, no longer busy).
    async fn delete_vm(
        &self,
        key: &str,
        pod: &Pod,
        vm: VmInfo,
        tracked: Option<u64>,
    ) -> Result<(), CocoonProviderError> {
        tracing::Span::current().record("vm", vm.id.as_str());
        let unbusy = |r: CocoonProviderError| {
            if let Some(gen) = tracked {
                if let Some(e) = self.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
                    e.busy = false;
                }
            }
            r
        };
        let policy = annotations::delete_policy(pod, &vm.name);
        let snapshot = SnapshotRef::latest(&policy.vm_name);
        let ns = namespace_of(pod);
        // The snapshot belongs to the VM's owner (a sharing Pod may be deleting it).
        let owner = self.cfg.namespaces.owner(vm.namespace.as_deref()).to_owned();
        let mut saved = false;
        if policy.save {
            // Never save over another namespace's snapshot: the VM is kept, and the error says
            // how to delete it (snapshot-policy never) or share.
            let existing = self.backend.snapshot_inspect(&snapshot).await.map_err(|source| {
                unbusy(CocoonProviderError::Snapshot {
                    key: key.to_owned(),
                    id: vm.id.clone(),
                    snapshot: snapshot.clone(),
                    source: Box::new(source),
                })
            })?;
            if let Some(info) = existing {
                self.check_namespace(
                    key,
                    &ns,
                    info.namespace.as_deref(),
                    || format!("snapshot {snapshot}"),
                    Use::Overwrite,
                )
                .map_err(|e| unbusy(self.refused(pod, e, false)))?;
            }
            let current = self.backend.inspect(&vm.id).await.map_err(|source| {
                unbusy(CocoonProviderError::Inspect { key: key.to_owned(), id: vm.id.clone(), source })
            })?;
            if current.as_ref().is_some_and(|v| v.state == VmState::Running) {
                self.backend.snapshot_save(&vm.id, &snapshot, &owner).await.map_err(|source| {
                    unbusy(CocoonProviderError::Snapshot {
                        key: key.to_owned(),
                        id: vm.id.clone(),
                        snapshot: snapshot.clone(),
                        source: Box::new(source),
                    })
                })?;
                saved = true;
                tracing::info!(%snapshot, "saved the VM's snapshot");
            } else {
                tracing::info!(state = ?current.map(|v| v.state), "the VM is not running; no snapshot");
            }
        }
        self.backend
            .remove(&vm.id)
            .await
            .map_err(|source| unbusy(CocoonProviderError::Remove { key: key.to_owned(), id: vm.id.clone(), source }))?;
        if let Err(e) = self.backend.release_ip(&vm.id).await {
            tracing::warn!(error = %error_chain(&e), "releasing the VM's lease failed (best effort)");
        }
        if !policy.save && !policy.keep {
            // Best effort, and only a snapshot this Pod's namespace may drop.
            let droppable = match self.backend.snapshot_inspect(&snapshot).await {
                Ok(Some(info)) => self
                    .check_namespace(
                        key,
                        &ns,
                        info.namespace.as_deref(),
                        || format!("snapshot {snapshot}"),
                        Use::Delete,
                    )
                    .is_ok(),
                Ok(None) => false,
                Err(e) => {
                    tracing::warn!(%snapshot, error = %error_chain(&e), "cannot look the VM's snapshot up; it is not dropped");
                    false
                }
            };
            if droppable {
                if let Err(e) = self.backend.snapshot_rm(&snapshot).await {
                    tracing::warn!(%snapshot, error = %error_chain(&e), "dropping the VM's snapshot failed (best effort)");
                }
            }
        }
        if let Some(gen) = tracked {
            let mut g = self.lock();
            if g.entries.get(key).is_some_and(|e| e.gen == gen) {
                if let Some(mut e) = g.entries.remove(key) {
                    e.stop_probe();
                }
            }
        }
        tracing::info!(saved, "removed the VM");
        Ok(())
    }
}

/// The message answering a hibernate request.
const HIBERNATE_MESSAGE: &str =
    "hibernation (vm.cocoonstack.io/hibernate) is not supported on this node; the VM keeps running";

/// The vk-cocoon provider.
pub struct CocoonProvider(pub(crate) Arc<Shared>);

/// The provider's background loops; dropping this stops them (VMs are untouched).
pub struct BackgroundLoops(pub(crate) Vec<tokio::task::JoinHandle<()>>);

impl Drop for BackgroundLoops {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

impl CocoonProvider {
    /// A provider over `backend`. Events go nowhere until [`CocoonProvider::set_events`].
    pub fn new(backend: Arc<dyn VmBackend>, cfg: ProviderConfig) -> CocoonProvider {
        let events: Arc<dyn EventSink> = Arc::new(RecordedEvents::default());
        CocoonProvider(Arc::new(Shared {
            backend,
            cfg,
            inner: Mutex::new(Inner::default()),
            notifier: Mutex::new(None),
            events: Mutex::new(events),
        }))
    }

    /// Where provider events go from now on (e.g. [`events::KubeEvents`] for each new client).
    pub fn set_events(&self, sink: Arc<dyn EventSink>) {
        *self.0.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = sink;
    }

    /// The VM tracked for `key` (`ns/name`), if any.
    pub fn tracked_vm(&self, key: &str) -> Option<VmInfo> {
        self.0.lock().entries.get(key).map(|e| e.vm.clone())
    }

    /// Live VMs found at start-up that await their Pod's CreatePod (adoption) or DeletePod.
    pub fn adoptable(&self) -> Vec<VmInfo> {
        self.0.lock().adoptable.values().cloned().collect()
    }
}

#[async_trait::async_trait]
impl Provider for CocoonProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.0.create(pod).await.map_err(|e| report(&e))
    }

    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.0.update(pod).await.map_err(|e| report(&e))
    }

    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.0.delete(pod).await.map_err(|e| report(&e))
    }

    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.0.lock().entries.get(&key.to_string()).map(|e| e.view(&self.0.cfg.node_ip))
    }

    fn get_pods(&self) -> Vec<Pod> {
        self.0.lock().entries.values().map(|e| e.view(&self.0.cfg.node_ip)).collect()
    }

    fn notify_pods(&self, notifier: PodNotifier) {
        *self.0.notifier.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(notifier);
    }
}

#[cfg(test)]
#[path = "provider_tests.rs"]
mod tests;

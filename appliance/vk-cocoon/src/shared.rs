//! The provider's shared state, in one place: [`Shared`] (the backend, the timings, the
//! tables behind one lock, the notifier and the event sink) that the provider's calls and its
//! background tasks (probe loops, the VM watcher) all hold, the tracked [`Entry`] per Pod key,
//! and the state operations every one of them uses (push an entry, record an event, insert an
//! entry under a fresh generation). Behaviour (create, delete, probes, the watcher) lives in
//! the modules that use this one; nothing here calls them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use tokio::task::AbortHandle;
use vnode::kit::{uid_of, Locked, Notifier};

use crate::annotations::{self, VmSpec};
use crate::backend::{VmBackend, VmInfo};
use crate::config::OrphanPolicy;
use crate::events::{EventSink, RecordedEvents};
use crate::namespaces::NamespacePolicy;
use crate::status::{self, VmView};

/// Timings and node facts of the provider (`CocoonProvider::new`).
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

/// `vm.cocoonstack.io/lifecycle-state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Creating,
    Ready,
    /// The VM is being saved to `<vm-name>:hibernate` and stopped.
    Hibernating,
    /// The VM is saved and stopped; its address stays reserved for the wake.
    Hibernated,
    Failed,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Creating => "creating",
            Lifecycle::Ready => "ready",
            Lifecycle::Hibernating => "hibernating",
            Lifecycle::Hibernated => "hibernated",
            Lifecycle::Failed => "failed",
        }
    }
}

/// Why a tracked Pod is `Failed`: the watcher evicted it. As upstream does, an evicted Pod is
/// deleted (its owner, a Sandbox or CocoonSet controller, makes a new one): every push of it
/// carries a deletion at `at` with no grace, which the runtime carries out (`pods` delete with
/// the Pod's UID as precondition).
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
    /// The VM is hibernated: saved as `<vm-name>:hibernate` and removed, its lease (address)
    /// kept; `vm` describes the VM a wake brings back (same id, same address).
    pub hibernated: bool,
    /// What a `CocoonHibernation` naming this Pod desires (`true`: Hibernate); it overrides
    /// the annotation while the object exists ([`crate::hibernation`]).
    pub desire: Option<bool>,
    /// Hibernated, but the removal of the stopped VM (its TAP, its record) failed: retried by
    /// the VM watcher, before a wake and by DeletePod.
    pub remove_pending: bool,
    /// The `CocoonHibernation` loop retries a failed hibernate or wake no earlier than this
    /// (`provider/hibernate.rs`: 15 s doubling to 5 min, reset on success).
    pub retry_at: Option<tokio::time::Instant>,
    /// The wait before `retry_at` last time (zero: no failure since the last success).
    pub retry_backoff: Duration,
    /// Tracked asleep at a CreatePod because the Pod's lifecycle annotation said `hibernated`
    /// before any `CocoonHibernation` listing succeeded (a provider restart: an object may
    /// still ask it to sleep); it sleeps until the first successful listing, which clears it.
    pub held: bool,
    /// `<vm-name>:hibernate` exists but the running VM is newer (a wake or a rolled-back
    /// hibernate could not drop it): the next hibernate may replace it.
    pub stale_hibernation: bool,
}

impl Entry {
    /// Whether the Pod asks its VM to sleep: the `CocoonHibernation` desire, else the
    /// `vm.cocoonstack.io/hibernate` annotation (or [`Entry::held`]).
    pub fn wants_sleep(&self) -> bool {
        self.desire.unwrap_or(self.spec.hibernate || self.held)
    }

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
            // As upstream: no VM runs, so no container does (the address stays reserved and
            // is still in `vm.cocoonstack.io/ip`).
            None if self.hibernated => status::pending(&self.pod),
            None => status::running(&self.pod, &v),
        };
        let mut pushed = status::pushed(&self.pod, st, &self.out_annotations());
        if self.spec.managed && self.message.is_none() {
            vnode::pod_status::remove_annotations(&mut pushed, &[annotations::LIFECYCLE_MESSAGE]);
        }
        if let Some(t) = &self.terminal {
            pushed.metadata.deletion_timestamp = Some(t.at.clone());
            pushed.metadata.deletion_grace_period_seconds = Some(0);
        }
        pushed
    }

    pub fn stop_probe(&mut self) {
        if let Some(h) = self.probe.take() {
            h.abort();
        }
    }
}

/// `lifecycle-state`, and `lifecycle-state-message` when there is one. Without one the
/// message annotation is removed, as upstream's lifecycle patch does (cocoon-common
/// `meta/lifecycle.go` sends it as `null`): the push lists it in
/// `vnode::pod_status::REMOVE_ANNOTATIONS`.
fn lifecycle_annotations(l: Lifecycle, message: Option<&str>) -> BTreeMap<String, String> {
    let mut a = BTreeMap::from([(annotations::LIFECYCLE_STATE.to_owned(), l.as_str().to_owned())]);
    if let Some(m) = message.filter(|m| !m.is_empty()) {
        a.insert(annotations::LIFECYCLE_MESSAGE.to_owned(), m.to_owned());
    }
    a
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
    /// The desires of the last successful `CocoonHibernation` listing (Pod key → `true`:
    /// Hibernate), kept through failed listings; a new entry starts with its desire.
    pub desires: BTreeMap<String, bool>,
    /// A complete listing succeeded (or the CRD is absent) since the provider started.
    pub desires_known: bool,
    pub next_gen: u64,
}

/// The provider's shared state (background tasks hold it too).
pub(crate) struct Shared {
    pub backend: Arc<dyn VmBackend>,
    pub cfg: ProviderConfig,
    inner: Locked<Inner>,
    notifier: Notifier,
    events: Locked<Arc<dyn EventSink>>,
}

/// The Pod's namespace (empty when it has none: such a Pod owns nothing and shares nothing).
pub(crate) fn namespace_of(pod: &Pod) -> String {
    pod.metadata.namespace.clone().unwrap_or_default()
}

fn now() -> Time {
    Time(Timestamp::now())
}

impl Shared {
    /// Over `backend`; events go nowhere until [`Shared::set_events`].
    pub fn new(backend: Arc<dyn VmBackend>, cfg: ProviderConfig) -> Shared {
        let events: Arc<dyn EventSink> = Arc::new(RecordedEvents::default());
        Shared { backend, cfg, inner: Locked::default(), notifier: Notifier::default(), events: Locked::new(events) }
    }

    /// Stores the runtime's notifier.
    pub fn set_notifier(&self, notifier: vnode::PodNotifier) {
        self.notifier.set(notifier);
    }

    /// The tables (whole at every unlock: no await under the lock).
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Pushes a Pod's new status.
    pub fn notify(&self, pod: Pod) {
        self.notifier.notify(pod);
    }

    /// Where provider events go from now on.
    pub fn set_events(&self, sink: Arc<dyn EventSink>) {
        *self.events.lock() = sink;
    }

    pub fn event(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        if warning {
            tracing::warn!(reason, message, "pod event");
        } else {
            tracing::info!(reason, message, "pod event");
        }
        let sink = self.events.lock().clone();
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
    pub fn push_pending(&self, pod: &Pod, l: Lifecycle, message: Option<&str>) {
        let mut pushed = status::pushed(pod, status::pending(pod), &lifecycle_annotations(l, message));
        if message.is_none_or(str::is_empty) {
            vnode::pod_status::remove_annotations(&mut pushed, &[annotations::LIFECYCLE_MESSAGE]);
        }
        self.notify(pushed);
    }

    pub fn insert_entry(&self, key: &str, pod: &Pod, spec: VmSpec, vm: VmInfo, lifecycle: Lifecycle) -> u64 {
        let mut g = self.lock();
        g.next_gen += 1;
        let gen = g.next_gen;
        let desire = g.desires.get(key).copied();
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
            hibernated: false,
            desire,
            held: false,
            remove_pending: false,
            retry_at: None,
            retry_backoff: Duration::ZERO,
            stale_hibernation: false,
        };
        if let Some(mut old) = g.entries.insert(key.to_owned(), entry) {
            old.stop_probe();
        }
        gen
    }
}

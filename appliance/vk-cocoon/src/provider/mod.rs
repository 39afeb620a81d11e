//! [`CocoonProvider`]: the [`vnode::Provider`] that gives each Pod bound to this node one
//! microVM of its own (`docs/virtual-node.md` §3.4–§3.7), through a [`VmBackend`].
//!
//! # Expected flow
//! * **CreatePod** (key `ns/name`): a tracked entry of an older Pod under the key is retired
//!   first (its VM kept for adoption when the new Pod names the same VM, else deleted as in
//!   DeletePod) → 1. parse the annotations (`vm.cocoonstack.io/name` required; CPU-class gate;
//!   hypervisor check) → 3. *unmanaged*: track the pre-assigned `id`/`ip`, no backend call →
//!   2. *adopt* a live VM: from the start-up map by `vm.cocoonstack.io/id`, then by name, else a
//!   VM of this name in a fresh listing (a create whose answer was lost; a failed listing fails
//!   the create rather than boot a duplicate); a stopped one is started (unless its
//!   `<vm-name>:hibernate` exists: removed, and served from the snapshot as in 4a), a
//!   `Creating` leftover removed (its lease kept while that snapshot exists) → 4. *managed*: `run` the image or `clone` the snapshot (`repo[:tag]`, bare =
//!   `latest`), pushing `lifecycle-state=creating` first; a failure records Warning
//!   `CreateBringUpFailed`, pushes `lifecycle-state=failed` and returns the error (retried) →
//!   6. `id`/`ip` written back on every push → 7. clones (and adopted clones not yet `ready`):
//!   guest network configuration every 3 s for ≤ 180 s, exhaustion → `post-clone-hint`,
//!   Warning `PostCloneExecExhausted`, lifecycle `failed` → 8. one synchronous probe, `Running`
//!   + `startTime` pushed, the probe loop started.
//! * **Probe** (`crate::probe`): TCP to `probe-port`, else the agent's `info`; unmanaged
//!   without a port: "has an IP". 100 ms ×1.5 → 1 s until Ready, then every 5 s; 3 consecutive
//!   failures flip Ready off. Every flip is pushed.
//! * **UpdatePod**: another UID under the key → CreatePod; else the Pod is stored (probe port
//!   and snapshot policy follow it); `hibernate` turned `"true"` hibernates the VM, turned
//!   anything else wakes it (`hibernate.rs`). Before step 4 a create serves a hibernated VM
//!   (`<vm-name>:hibernate`, only to a Pod of the image it was saved from: tracked asleep, or
//!   woken) and `fork-from` (clone of the source's
//!   `fork-<name>` snapshot); a Pod created with `hibernate: "true"` is booted, then hibernated.
//! * **DeletePod**: unmanaged → forget. Managed: [`crate::annotations::delete_policy`] says whether to
//!   save `<vm-name>:latest`; if so and the VM runs, `snapshot_save` (failure → the VM and the
//!   entry stay, the error is returned and the runtime retries); `remove` (absent = OK);
//!   `release_ip` (best effort); when the policy saves no snapshot and `keep-snapshot-on-delete`
//!   is not `"true"`, `<vm-name>:latest` is dropped (best effort); forget. (A VM that is not
//!   running when a policy wants a snapshot is removed without one, and its earlier snapshot
//!   is kept.)
//! * **VM watcher** ([`crate::watcher`]) and **start-up reconcile** (`crate::reconcile`, which
//!   extends [`CocoonProvider`] from outside this module).
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
//!   with `VMGone`: deleted, for its owner to replace) — the reason a SandboxTemplate cannot
//!   carry `vm.cocoonstack.io/name`. While
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
//!   `lifecycle-state`); see `crate::reconcile`. Restart cooldowns and probe state start
//!   afresh.
//!
//! # Caveats
//! A Pod deleted while its status shows no running container is force-deleted by the runtime
//! without a DeletePod call (§1.2 rule 1); a VM booted at that moment is left to the next
//! start-up reconcile (orphan policy).
//!
//! # Code map
//! The state every call and background task shares is `crate::shared` (one file: the tables,
//! the entry per Pod, pushes and events). Here: `error.rs` ([`CocoonProviderError`] and the
//! refusals that also mark the Pod), `create.rs` (CreatePod, UpdatePod), `hibernate.rs`
//! (hibernate, wake, the restore and fork sources), `delete.rs` (DeletePod; a hibernated Pod's
//! lease goes, its snapshot too unless a policy keeps snapshots), `loops.rs` (the post-clone network loop, the start of the probe loop, the VM
//! watcher's schedule), `streams.rs` (the kubelet port's streams, not wired yet); this file
//! holds [`CocoonProvider`], the handle the runtime calls. The lock, the notifier and the
//! loops' handles come from [`vnode::kit`]. Dependencies run one way: this file → `create` → `hibernate`, `delete`, `loops` → `error`, `crate::probe`, [`crate::watcher`]
//! → `crate::shared`; nothing below calls back up.

mod create;
mod delete;
mod error;
mod hibernate;
mod loops;
mod metrics;
mod streams;

pub use crate::shared::{Lifecycle, ProviderConfig};
pub use error::{CocoonProviderError, ImageMismatch};
pub(crate) use hibernate::hibernation_held;
pub use hibernate::HibernationView;
/// The workspace's one chain formatter, where this crate's modules have always found it.
pub use vnode::error_chain;
pub use vnode::kit::BackgroundLoops;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use vnode::kit::reported;
use vnode::{PodKey, PodNotifier, Provider, ProviderError};

use crate::backend::{VmBackend, VmInfo};
use crate::events::EventSink;
use crate::metrics::{counted, Op};
use crate::shared::Shared;
use crate::watcher;

/// The vk-cocoon provider.
pub struct CocoonProvider(pub(crate) Arc<Shared>);

impl CocoonProvider {
    /// A provider over `backend`. Events go nowhere until [`CocoonProvider::set_events`].
    pub fn new(backend: Arc<dyn VmBackend>, cfg: ProviderConfig) -> CocoonProvider {
        CocoonProvider(Arc::new(Shared::new(backend, cfg)))
    }

    /// Where provider events go from now on (e.g. [`crate::events::KubeEvents`] for each new
    /// client).
    pub fn set_events(&self, sink: Arc<dyn EventSink>) {
        self.0.set_events(sink);
    }

    /// The VM tracked for `key` (`ns/name`), if any.
    pub fn tracked_vm(&self, key: &str) -> Option<VmInfo> {
        self.0.lock().entries.get(key).map(|e| e.vm.clone())
    }

    /// Live VMs found at start-up that await their Pod's CreatePod (adoption) or DeletePod.
    pub fn adoptable(&self) -> Vec<VmInfo> {
        self.0.lock().adoptable.values().cloned().collect()
    }

    /// One VM-watcher pass (the loop of [`CocoonProvider::spawn_watcher`] runs these).
    pub async fn watch_once(&self) {
        watcher::watch_once(&self.0).await;
    }

    /// Starts the VM watcher on the current tokio runtime.
    pub fn spawn_watcher(&self) -> BackgroundLoops {
        loops::spawn_watcher(&self.0)
    }
}

#[async_trait::async_trait]
impl Provider for CocoonProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(counted(Op::Create, create::create(&self.0, pod).await))
    }

    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(counted(Op::Update, create::update(&self.0, pod).await))
    }

    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(counted(Op::Delete, delete::delete(&self.0, pod).await))
    }

    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.0.lock().entries.get(&key.to_string()).map(|e| e.view(&self.0.cfg.node_ip))
    }

    fn get_pods(&self) -> Vec<Pod> {
        self.0.lock().entries.values().map(|e| e.view(&self.0.cfg.node_ip)).collect()
    }

    fn notify_pods(&self, notifier: PodNotifier) {
        self.0.set_notifier(notifier);
    }
}

#[cfg(test)]
mod tests;

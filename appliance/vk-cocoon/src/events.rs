//! Pod events the provider records itself (`docs/virtual-node.md` §3.8), besides the runtime's
//! `Provider*` events. Every Warning here also sets `vm.cocoonstack.io/lifecycle-state=failed`
//! on the Pod (done by the caller), except a `NamespaceRefused` or `VMIdRefused` of a DeletePod and
//! a `HibernateRemoveFailed` that leaves the Pod hibernated. [`EventSink`] decouples the provider from the API client:
//! [`KubeEvents`] writes through `vnode`'s recorder; tests use [`RecordedEvents`].

use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;

/// Warning: run/clone failed (the create is retried).
pub const CREATE_BRING_UP_FAILED: &str = "CreateBringUpFailed";
/// Warning: the clone's network could not be configured within the deadline.
pub const POST_CLONE_EXEC_EXHAUSTED: &str = "PostCloneExecExhausted";
/// Normal: the clone's network is configured.
pub const POST_CLONE_SUCCEEDED: &str = "PostCloneSucceeded";
/// Normal: a VM that outlived a provider restart was adopted.
pub const RESUMED_AFTER_RESTART: &str = "ResumedAfterRestart";
/// Warning: the Pod names another Pod's running VM and adopts it (the seed's constraint).
pub const VM_NAME_SHARED: &str = "VMNameShared";
/// Warning: the Pod named a VM or snapshot of another namespace that it may not use
/// ([`crate::namespaces`]); on CreatePod the create fails (lifecycle `failed`), on DeletePod
/// the VM or snapshot is left alone.
pub const NAMESPACE_REFUSED: &str = "NamespaceRefused";
/// Warning: an adopted VM was stopped and could not be started.
pub const RESUME_START_FAILED: &str = "ResumeStartFailed";
/// Normal: the VM was saved to `<vm-name>:hibernate` and stopped (`vm.cocoonstack.io/hibernate`).
pub const HIBERNATED: &str = "Hibernated";
/// Normal: a hibernated VM was restored from its snapshot, with its address.
pub const WOKEN: &str = "Woken";
/// Warning: saving the hibernation snapshot failed; the VM keeps running (retried).
pub const HIBERNATE_SNAPSHOT_FAILED: &str = "HibernateSnapshotFailed";
/// Warning: removing the saved VM failed. If it still runs, the snapshot is dropped and the
/// VM keeps running (lifecycle `failed`, retried); if its hypervisor is gone (or cannot be
/// told), the snapshot is its only copy: kept, the Pod hibernated (lifecycle `hibernated`, the
/// one Warning that does not set `failed`) and the removal retried.
pub const HIBERNATE_REMOVE_FAILED: &str = "HibernateRemoveFailed";
/// Warning: `<vm-name>:hibernate` exists already and is not replaced by a VM that may be
/// younger than it (a fresh boot); the VM keeps running.
pub const HIBERNATE_SNAPSHOT_EXISTS: &str = "HibernateSnapshotExists";
/// Warning: the Pod's `vm.cocoonstack.io/id` is not the id of its VM's name on this node;
/// it is refused (a create fails, a delete releases no lease by it).
pub const VM_ID_REFUSED: &str = "VMIdRefused";
/// Warning: `<vm-name>:hibernate` was saved from another image than the Pod's; it is not
/// restored (the create fails, the snapshot is kept).
pub const HIBERNATION_IMAGE_MISMATCH: &str = "HibernationImageMismatch";
/// Warning: restoring a hibernated VM failed (retried); its snapshot is kept.
pub const WAKE_CLONE_FAILED: &str = "WakeCloneFailed";
/// Warning + pod `Failed` reasons of the VM watcher.
pub const VM_GONE: &str = "VMGone";
pub const RESTART_COOLDOWN: &str = "RestartCooldown";
pub const RESTART_FAILED: &str = "RestartFailed";
/// Normal: the watcher started a VM that had stopped.
pub const VM_RESTARTED: &str = "VMRestarted";
/// Normal: the Pod's `vm.cocoonstack.io/backend` is not on this node; its own serves the VM.
pub const BACKEND_SUBSTITUTED: &str = "BackendSubstituted";

/// Where provider events go. Recording never blocks or fails the caller.
pub trait EventSink: Send + Sync {
    /// Records a `Normal` (`warning == false`) or `Warning` event about `pod`.
    fn record(&self, pod: &Pod, warning: bool, reason: &str, message: &str);
}

/// Events written to the API as the node (through `vnode::events::Recorder`).
pub struct KubeEvents(pub vnode::events::Recorder);

impl EventSink for KubeEvents {
    fn record(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        if warning {
            self.0.warning(pod, reason, message);
        } else {
            self.0.normal(pod, reason, message);
        }
    }
}

/// One recorded event (tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// `namespace/name` of the Pod.
    pub pod: String,
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

/// Keeps events in memory (tests, and a provider before it has a client).
#[derive(Debug, Default)]
pub struct RecordedEvents(Mutex<Vec<Recorded>>);

impl RecordedEvents {
    /// Every event so far.
    pub fn all(&self) -> Vec<Recorded> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The reasons so far, in order.
    pub fn reasons(&self) -> Vec<String> {
        self.all().into_iter().map(|e| e.reason).collect()
    }
}

impl EventSink for RecordedEvents {
    fn record(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        let key = vnode::PodKey::of(pod).to_string();
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Recorded {
            pod: key,
            warning,
            reason: reason.to_owned(),
            message: message.to_owned(),
        });
    }
}

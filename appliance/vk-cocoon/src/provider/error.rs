//! [`CocoonProviderError`]: why a provider call failed, each variant naming the Pod; and the
//! refusals that also record an event and a lifecycle state on the Pod (a namespace refusal, a
//! failed bring-up).

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;

use crate::annotations::AnnotationError;
use crate::backend::{BackendError, SnapshotRef};
use crate::events;
use crate::namespaces::Use;
use crate::shared::{Lifecycle, Shared};

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
    #[error(
        "pod {key}: snapshot {snapshot} exists already; a hibernate does not replace it (it may hold a newer \
         state than this VM): wake the pod to restore it, or remove the snapshot if it is stale"
    )]
    HibernationExists { key: String, snapshot: SnapshotRef },
    #[error(
        "pod {key}: its vm.cocoonstack.io/id {annotated:?} is not the id of VM {name} on this node ({ours}); \
         the annotation is refused: remove it or set it to {ours}"
    )]
    VmIdMismatch { key: String, name: String, annotated: String, ours: String },
    /// A `<vm-name>:hibernate` left by an older Pod of the name (§3.4: a restore fails closed
    /// when the snapshot's base image is not the Pod's).
    #[error(
        "pod {key}: snapshot {snapshot} was saved from a VM of image {saved}, but this pod's image {image} is \
         {resolved}; it is not restored: delete the snapshot (chrysalis snapshot rm {snapshot}) to boot this \
         pod's image, or set the pod's image back to the one the snapshot was saved from",
        snapshot = .found.snapshot,
        saved = .found.saved,
        image = .found.image,
        resolved = .found.resolved.as_deref().unwrap_or("not in the image library")
    )]
    HibernationImageMismatch { key: String, found: Box<ImageMismatch> },
    #[error("start-up reconcile: the VMs cannot be listed")]
    Reconcile(#[source] BackendError),
}

/// What [`CocoonProviderError::HibernationImageMismatch`] found.
#[derive(Debug)]
pub struct ImageMismatch {
    pub snapshot: SnapshotRef,
    /// The snapshot's recorded base image.
    pub saved: String,
    /// The Pod's image (or the snapshot it clones, or its fork source).
    pub image: String,
    /// What `image` resolves to now; `None`: the library does not hold it.
    pub resolved: Option<String>,
}

/// `Ok` when a Pod of `ns` may use what `recorded` owns; else the refusal (the owner goes
/// to the node's log, never into the Pod's message).
pub(super) fn check_namespace(
    s: &Shared,
    key: &str,
    ns: &str,
    recorded: Option<&str>,
    what: impl FnOnce() -> String,
    action: Use,
) -> Result<(), CocoonProviderError> {
    if s.cfg.namespaces.permits(ns, recorded) {
        return Ok(());
    }
    let mut what = what();
    let owner = s.cfg.namespaces.owner(recorded);
    tracing::warn!(pod = key, namespace = ns, owner, recorded = recorded.is_some(), %what, action = action.verb(), "refused: another namespace's VM or snapshot (VK_SHARED_NAMESPACES does not let them share)");
    if recorded.is_none() {
        what.push_str(" (recorded without a namespace, so it belongs to VK_LEGACY_NAMESPACE's)");
    }
    Err(CocoonProviderError::Namespace { key: key.to_owned(), namespace: ns.to_owned(), what, action })
}

/// Warning `NamespaceRefused` for a namespace refusal (+ lifecycle `failed` when `creating`);
/// any other error passes through untouched.
pub(super) fn refused(s: &Shared, pod: &Pod, e: CocoonProviderError, creating: bool) -> CocoonProviderError {
    if matches!(e, CocoonProviderError::Namespace { .. }) {
        let msg = error_chain(&e);
        s.event(pod, true, events::NAMESPACE_REFUSED, &msg);
        if creating {
            s.push_pending(pod, Lifecycle::Failed, Some(&msg));
        }
    }
    e
}

/// Warning `CreateBringUpFailed` + lifecycle `failed`; returns the error for the caller.
pub(super) fn bring_up_failed(s: &Shared, pod: &Pod, e: CocoonProviderError) -> CocoonProviderError {
    let msg = error_chain(&e);
    s.event(pod, true, events::CREATE_BRING_UP_FAILED, &msg);
    s.push_pending(pod, Lifecycle::Failed, Some(&msg));
    e
}

//! DeletePod: an unmanaged Pod is forgotten; a managed one's VM is snapshotted per
//! [`annotations::delete_policy`] (a failure keeps the VM and the entry), removed, its lease
//! released and its stale `<vm-name>:latest` dropped; a VM found at start-up is removed the same
//! way, and a lease whose VM is gone is released only when its id is the one of the Pod's VM
//! name, no VM has the id now and no `<vm-name>:hibernate` holds it.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;
use vnode::kit::uid_of;
use vnode::PodKey;

use super::error::{check_namespace, refused, CocoonProviderError};
use crate::annotations;
use crate::backend::{BackendError, SnapshotRef, VmInfo, VmState};
use crate::events;
use crate::metrics::timed_save;
use crate::namespaces::Use;
use crate::shared::{namespace_of, Shared};

#[tracing::instrument(name = "delete_pod", skip_all, fields(pod = %PodKey::of(pod), vm = tracing::field::Empty))]
pub(super) async fn delete(s: &Arc<Shared>, pod: &Pod) -> Result<(), CocoonProviderError> {
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
        let mut g = s.lock();
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
                    (Some(vm), _) => match check_namespace(
                        s,
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
                    (None, Some(id)) if !g.entries.values().any(|e| e.vm.id == id) => Plan::ReleaseOnly(id.to_owned()),
                    (None, _) => Plan::Done,
                }
            }
        }
    };
    match plan {
        Plan::Done => Ok(()),
        Plan::Tracked(vm, gen) => delete_vm(s, &key, pod, vm, Some(gen)).await,
        Plan::Untracked(vm) => {
            let r = delete_vm(s, &key, pod, vm.clone(), None).await;
            if r.is_err() {
                s.lock().adoptable.insert(vm.id.clone(), vm);
            }
            r
        }
        Plan::Refused(e) => {
            // The Pod goes; the VM stays for a Pod of its own namespace (or the orphan policy).
            let _ = refused(s, pod, e, false);
            Ok(())
        }
        Plan::ReleaseOnly(id) => {
            release_only(s, &key, pod, &id).await;
            Ok(())
        }
    }
}

/// A managed Pod with no entry and no VM found at start-up (it was removed before a restart):
/// only the lease of its `vm.cocoonstack.io/id` may remain. That id comes from the Pod, so the
/// lease is released only when the backend says it is the id of the Pod's VM name (when it can
/// tell), is sure no VM has it now (a VM of another namespace may have been created under it
/// since), and no `<vm-name>:hibernate` holds it for a wake.
async fn release_only(s: &Shared, key: &str, pod: &Pod, id: &str) {
    let name = annotations::vm_name(pod).ok();
    if let Some(ours) = name.as_deref().and_then(|n| s.backend.vm_id_of(n)).filter(|ours| ours != id) {
        let e = CocoonProviderError::VmIdMismatch {
            key: key.to_owned(),
            name: name.clone().unwrap_or_default(),
            annotated: id.to_owned(),
            ours,
        };
        s.event(pod, true, events::VM_ID_REFUSED, &format!("{}; no lease is released by it", error_chain(&e)));
        return;
    }
    match s.backend.inspect(id).await {
        Ok(None) => {}
        Ok(Some(_)) => {
            tracing::info!(vm = %id, "a VM with the pod's id exists now; its lease is not released");
            return;
        }
        Err(e) => {
            tracing::warn!(vm = %id, error = %error_chain(&e), "cannot tell whether the VM exists; its lease is kept");
            return;
        }
    }
    if super::hibernate::hibernation_held(s, name.as_deref()).await {
        tracing::info!(vm = %id, "the VM is hibernated (its snapshot is kept); its lease is kept for the wake");
        return;
    }
    if let Err(e) = s.backend.release_ip(id).await {
        tracing::warn!(vm = %id, error = %error_chain(&e), "releasing the lease of a gone VM failed");
    }
}

/// Snapshot per policy → remove → release the lease → drop the stale snapshot → forget.
/// Any error before the removal keeps the VM (and the entry, no longer busy).
pub(super) async fn delete_vm(
    s: &Shared,
    key: &str,
    pod: &Pod,
    vm: VmInfo,
    tracked: Option<u64>,
) -> Result<(), CocoonProviderError> {
    tracing::Span::current().record("vm", vm.id.as_str());
    let unbusy = |r: CocoonProviderError| {
        if let Some(gen) = tracked {
            if let Some(e) = s.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
                e.busy = false;
            }
        }
        r
    };
    let policy = annotations::delete_policy(pod, &vm.name);
    let snapshot = SnapshotRef::latest(&policy.vm_name);
    let ns = namespace_of(pod);
    // The snapshot belongs to the VM's owner (a sharing Pod may be deleting it).
    let owner = s.cfg.namespaces.owner(vm.namespace.as_deref()).to_owned();
    let mut saved = false;
    if policy.save {
        // Never save over another namespace's snapshot: the VM is kept, and the error says
        // how to delete it (snapshot-policy never) or share.
        let snapshot_failed = |source: BackendError| {
            unbusy(CocoonProviderError::Snapshot {
                key: key.to_owned(),
                id: vm.id.clone(),
                snapshot: snapshot.clone(),
                source: Box::new(source),
            })
        };
        let existing = s.backend.snapshot_inspect(&snapshot).await.map_err(snapshot_failed)?;
        if let Some(info) = existing {
            check_namespace(s, key, &ns, info.namespace.as_deref(), || format!("snapshot {snapshot}"), Use::Overwrite)
                .map_err(|e| unbusy(refused(s, pod, e, false)))?;
        }
        let current = s.backend.inspect(&vm.id).await.map_err(|source| {
            unbusy(CocoonProviderError::Inspect { key: key.to_owned(), id: vm.id.clone(), source })
        })?;
        if current.as_ref().is_some_and(|v| v.state == VmState::Running) {
            timed_save(s.backend.snapshot_save(&vm.id, &snapshot, &owner)).await.map_err(snapshot_failed)?;
            saved = true;
            tracing::info!(%snapshot, "saved the VM's snapshot");
        } else {
            tracing::info!(state = ?current.map(|v| v.state), "the VM is not running; no snapshot");
        }
    }
    let (hibernated, leftover) = tracked
        .and_then(|gen| s.lock().entries.get(key).filter(|e| e.gen == gen).map(|e| (e.hibernated, e.remove_pending)))
        .unwrap_or((false, false));
    // A hibernated VM is gone already, unless its hibernate could not finish the removal.
    if !hibernated || leftover {
        s.backend
            .remove(&vm.id)
            .await
            .map_err(|source| unbusy(CocoonProviderError::Remove { key: key.to_owned(), id: vm.id.clone(), source }))?;
    }
    if !vm.id.is_empty() {
        if let Err(e) = s.backend.release_ip(&vm.id).await {
            tracing::warn!(error = %error_chain(&e), "releasing the VM's lease failed (best effort)");
        }
    }
    if hibernated && !policy.save && !policy.keep {
        // The hibernated VM's state goes with its Pod unless a policy keeps snapshots.
        let asleep = super::hibernate::hibernation_of(&policy.vm_name);
        if let Err(e) = s.backend.snapshot_rm(&asleep).await {
            tracing::warn!(snapshot = %asleep, error = %error_chain(&e), "dropping the hibernation snapshot failed (best effort)");
        }
    }
    if !policy.save && !policy.keep {
        // Best effort, and only a snapshot this Pod's namespace may drop.
        let droppable = match s.backend.snapshot_inspect(&snapshot).await {
            Ok(Some(info)) => {
                check_namespace(s, key, &ns, info.namespace.as_deref(), || format!("snapshot {snapshot}"), Use::Delete)
                    .is_ok()
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(%snapshot, error = %error_chain(&e), "cannot look the VM's snapshot up; it is not dropped");
                false
            }
        };
        if droppable {
            if let Err(e) = s.backend.snapshot_rm(&snapshot).await {
                tracing::warn!(%snapshot, error = %error_chain(&e), "dropping the VM's snapshot failed (best effort)");
            }
        }
    }
    if let Some(gen) = tracked {
        let mut g = s.lock();
        if g.entries.get(key).is_some_and(|e| e.gen == gen) {
            if let Some(mut e) = g.entries.remove(key) {
                e.stop_probe();
            }
        }
    }
    tracing::info!(saved, "removed the VM");
    Ok(())
}

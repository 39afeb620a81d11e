//! Hibernation (`vm.cocoonstack.io/hibernate`, as upstream vk-cocoon's UpdatePod serves it,
//! `docs/virtual-node.md` §3.6) and the two VM sources that restore a saved VM instead of
//! booting the image: `restore-from-hibernate` and `fork-from`.
//!
//! * **Hibernate** (the annotation becomes `"true"` on a running managed Pod): an existing
//!   `<vm-name>:hibernate` is never replaced (Warning `HibernateSnapshotExists`: it may hold a
//!   newer state than a VM booted afresh; only one the entry knows to be stale, because a wake
//!   or a rollback could not drop it, is) → lifecycle `hibernating` → the VM is saved as
//!   `<vm-name>:hibernate` through the VMM's snapshot (it keeps running meanwhile) → removed;
//!   its address lease is *kept* → lifecycle `hibernated`, Normal `Hibernated`, the Pod is
//!   `Pending` (no VM, so no container runs) and keeps `vm.cocoonstack.io/id` and `ip`. A
//!   failed save (Warning `HibernateSnapshotFailed`) leaves the VM running with lifecycle
//!   `failed` and returns the error. A failed remove (Warning `HibernateRemoveFailed`) is
//!   followed by an `inspect`: a VM still running gets the same treatment (the saved snapshot
//!   dropped); a VM whose hypervisor is gone, or that cannot be inspected, has its only copy in
//!   the snapshot, which is kept: the Pod is hibernated and the removal retried (the VM
//!   watcher, a wake, DeletePod).
//! * **Wake** (the annotation is anything else while hibernated): lifecycle `creating` → the
//!   VM is restored from `<vm-name>:hibernate` under its own id with
//!   [`CloneRequest::keep_lease`], so the kept lease gives it the same address (no
//!   re-addressing: the guest already has it) and a failed restore leaves that lease in place
//!   → the snapshot is dropped, Normal `Woken`, lifecycle `ready`, the probe loop again. A
//!   failed restore (Warning `WakeCloneFailed`) keeps the snapshot and is retried. A provider
//!   that crashes mid-wake leaves a `Creating` VM: the start-up reconcile removes it and keeps
//!   its lease while the snapshot exists ([`hibernation_held`]).
//! * **Retries** of the `CocoonHibernation` loop ([`super::CocoonProvider::apply_hibernations`]):
//!   after a failed hibernate or wake an entry waits 15 s, doubling to 5 min, before the loop
//!   tries again (each try is a full memory snapshot or restore and a Warning event); a
//!   success resets the wait. UpdatePod retries are the runtime's.
//! * **CreatePod of a Pod whose `<vm-name>:hibernate` exists** (a provider restart while it
//!   was hibernated, or a new Pod for a hibernated name): tracked as hibernated while the Pod
//!   asks for it, else woken. The tracked id is the backend's id of the name
//!   ([`crate::backend::VmBackend::vm_id_of`]), never the Pod's `vm.cocoonstack.io/id`: an
//!   annotation naming another id fails the create (Warning `VMIdRefused`), since the delete
//!   of a hibernated Pod releases the lease of that id. A stopped VM found at start-up whose
//!   snapshot exists (a hibernate interrupted between the kill and the record's deletion) is
//!   removed and served the same way, never cold-booted. `restore-from-hibernate: "true"`
//!   without that snapshot fails the create with `SnapshotMissing`. The snapshot is served
//!   only to a Pod of the image it was saved from ([`check_base_image`], §3.4): a leftover of
//!   an older Pod of the name (a wake whose `snapshot_rm` failed, a crash before it, a
//!   hibernated Pod deleted under `snapshot-policy: always`) whose base image is not the new
//!   Pod's fails the create (Warning `HibernationImageMismatch`), never boots; a snapshot
//!   recording no base image is served as before. Whether it sleeps: the last known
//!   `CocoonHibernation` desire, else the annotation; before the first successful listing
//!   after a restart, a Pod whose lifecycle says `hibernated` is held asleep ([`crate::hibernation`]).
//!   Until then, a listing that fails (even 403/404) changes no desire.
//! * **Fork** (`fork-from: <vm-name>`): the running VM of that name (tracked, of a namespace
//!   this Pod may clone from) is saved once as `fork-<vm-name>:latest` (it keeps running) and
//!   the new VM is a clone of that snapshot, re-addressed like every clone. A source that does
//!   not run fails the create (retried).
//!
//! Upstream (cocoonstack/vk-cocoon `provider/cocoon/hibernate.go`, `create.go`) pushes the
//! snapshot to a registry and releases the address; here the image library is the registry and
//! the address stays reserved, so a woken Pod keeps its IP. Who flips the annotation is up to
//! the user or [`crate::hibernation`] (the `CocoonHibernation` objects).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;

use super::error::{bring_up_failed, check_namespace, CocoonProviderError, ImageMismatch};
use super::loops;
use crate::annotations::{self, Mode, VmSpec};
use crate::backend::{BackendError, CloneRequest, Hypervisor, SnapshotInfo, SnapshotRef, VmInfo, VmState};
use crate::events;
use crate::namespaces::Use;
use crate::shared::{namespace_of, Lifecycle, Shared};

/// The tag a hibernated VM is saved under (`<vm-name>:hibernate`, as upstream).
pub(crate) const HIBERNATE_TAG: &str = "hibernate";

/// The first wait before the `CocoonHibernation` loop retries a failed hibernate or wake (§3.6).
pub(crate) const RETRY_FIRST: Duration = Duration::from_secs(15);
/// The longest such wait.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(300);

/// `<vm-name>:hibernate`.
pub(crate) fn hibernation_of(vm_name: &str) -> SnapshotRef {
    SnapshotRef::new(vm_name, HIBERNATE_TAG)
}

/// `fork-<vm-name>:latest`, the snapshot a fork of `vm_name` clones (saved once).
pub(crate) fn fork_of(vm_name: &str) -> SnapshotRef {
    SnapshotRef::latest(format!("fork-{vm_name}"))
}

/// Whether the lease of a VM named one of `names` must stay because a wake will rely on it:
/// some `<name>:hibernate` exists, or the library cannot tell (never release on ambiguity).
pub(crate) async fn hibernation_held<'a>(s: &Shared, names: impl IntoIterator<Item = &'a str>) -> bool {
    for name in names.into_iter().filter(|n| !n.is_empty()) {
        let snapshot = hibernation_of(name);
        match s.backend.snapshot_inspect(&snapshot).await {
            Ok(None) => {}
            Ok(Some(_)) => return true,
            Err(e) => {
                tracing::warn!(%snapshot, error = %error_chain(&e), "cannot tell whether a hibernation holds the lease; it is kept");
                return true;
            }
        }
    }
    false
}

/// Marks the entry `busy` with `lifecycle` and returns its Pod and VM, if it is still `gen`,
/// managed, not evicted, not busy, and hibernated as `hibernated` says.
fn take(s: &Shared, key: &str, gen: u64, hibernated: bool, lifecycle: Lifecycle) -> Option<(Pod, VmInfo)> {
    let mut g = s.lock();
    let e = g
        .entries
        .get_mut(key)
        .filter(|e| e.gen == gen && e.spec.managed && e.terminal.is_none() && !e.busy && e.hibernated == hibernated)?;
    e.busy = true;
    e.lifecycle = lifecycle;
    e.message = None;
    e.stop_probe();
    Some((e.pod.clone(), e.vm.clone()))
}

/// The next wait after a failure that followed a wait of `last` (zero: none).
fn next_backoff(last: Duration) -> Duration {
    if last.is_zero() {
        RETRY_FIRST
    } else {
        (last * 2).min(RETRY_MAX)
    }
}

/// Ends a failed hibernate or wake: the entry is released with lifecycle `failed` and `why`
/// and its next retry pushed back, a Warning `reason` is recorded and the probe loop
/// restarted (the VM, if any, still runs).
async fn failed(
    s: &Arc<Shared>,
    key: &str,
    gen: u64,
    pod: &Pod,
    reason: &str,
    e: CocoonProviderError,
) -> CocoonProviderError {
    let msg = error_chain(&e);
    s.event(pod, true, reason, &msg);
    let running = {
        let mut g = s.lock();
        match g.entries.get_mut(key).filter(|e| e.gen == gen) {
            Some(entry) => {
                entry.lifecycle = Lifecycle::Failed;
                entry.message = Some(msg);
                entry.retry_backoff = next_backoff(entry.retry_backoff);
                entry.retry_at = Some(tokio::time::Instant::now() + entry.retry_backoff);
                !entry.hibernated
            }
            None => false,
        }
    };
    if running {
        loops::finish(s, key, gen).await;
    } else {
        if let Some(entry) = s.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
            entry.busy = false;
        }
        s.push_entry(key, gen);
    }
    e
}

/// The entry is hibernated (its VM saved and gone, or going: `remove_pending`), with
/// `message`; its retry wait is reset.
fn mark_hibernated(s: &Shared, key: &str, gen: u64, remove_pending: bool, message: Option<String>) {
    let mut g = s.lock();
    if let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) {
        e.hibernated = true;
        e.lifecycle = Lifecycle::Hibernated;
        e.message = message;
        e.vm.state = VmState::Stopped;
        e.probe_ok = false;
        e.busy = false;
        e.remove_pending = remove_pending;
        e.stale_hibernation = false;
        e.retry_at = None;
        e.retry_backoff = Duration::ZERO;
    }
}

/// Hibernates the VM of the entry at `key` (see the module docs).
#[tracing::instrument(name = "hibernate", skip_all, fields(pod = %key))]
pub(super) async fn hibernate(s: &Arc<Shared>, key: &str, gen: u64) -> Result<(), CocoonProviderError> {
    let Some((pod, vm)) = take(s, key, gen, false, Lifecycle::Hibernating) else { return Ok(()) };
    s.push_entry(key, gen);
    let snapshot = hibernation_of(&vm.name);
    let owner = s.cfg.namespaces.owner(vm.namespace.as_deref()).to_owned();
    let snap_err = |source: BackendError| CocoonProviderError::Snapshot {
        key: key.to_owned(),
        id: vm.id.clone(),
        snapshot: snapshot.clone(),
        source: Box::new(source),
    };
    let stale = s.lock().entries.get(key).filter(|e| e.gen == gen).is_some_and(|e| e.stale_hibernation);
    if !stale {
        match s.backend.snapshot_inspect(&snapshot).await {
            Ok(None) => {}
            Ok(Some(_)) => {
                let e = CocoonProviderError::HibernationExists { key: key.to_owned(), snapshot: snapshot.clone() };
                return Err(failed(s, key, gen, &pod, events::HIBERNATE_SNAPSHOT_EXISTS, e).await);
            }
            Err(source) => {
                return Err(failed(s, key, gen, &pod, events::HIBERNATE_SNAPSHOT_FAILED, snap_err(source)).await)
            }
        }
    }
    if let Err(source) = s.backend.snapshot_save(&vm.id, &snapshot, &owner).await {
        return Err(failed(s, key, gen, &pod, events::HIBERNATE_SNAPSHOT_FAILED, snap_err(source)).await);
    }
    if let Err(source) = s.backend.remove(&vm.id).await {
        let e = CocoonProviderError::Remove { key: key.to_owned(), id: vm.id.clone(), source };
        return remove_failed(s, key, gen, &pod, &vm, e).await;
    }
    mark_hibernated(s, key, gen, false, None);
    let ip = vm.ip.as_deref().unwrap_or("none");
    tracing::info!(vm = %vm.id, %snapshot, ip, "hibernated");
    s.event(
        &pod,
        false,
        events::HIBERNATED,
        &format!("VM {} saved as {snapshot} and stopped; its address {ip} stays reserved", vm.id),
    );
    s.push_entry(key, gen);
    Ok(())
}

/// A hibernate whose save succeeded and whose remove failed (`e`): the VM still running keeps
/// running and the snapshot goes (`failed`); otherwise the snapshot is the VM's only copy:
/// kept, and the entry hibernated with the removal pending.
async fn remove_failed(
    s: &Arc<Shared>,
    key: &str,
    gen: u64,
    pod: &Pod,
    vm: &VmInfo,
    e: CocoonProviderError,
) -> Result<(), CocoonProviderError> {
    let snapshot = hibernation_of(&vm.name);
    let seen = s.backend.inspect(&vm.id).await;
    if let Ok(Some(v)) = &seen {
        if v.state == VmState::Running {
            if let Err(rm) = s.backend.snapshot_rm(&snapshot).await {
                tracing::warn!(%snapshot, error = %error_chain(&rm), "dropping the snapshot of a failed hibernate failed; the next hibernate replaces it");
                if let Some(entry) = s.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
                    entry.stale_hibernation = true;
                }
            }
            return Err(failed(s, key, gen, pod, events::HIBERNATE_REMOVE_FAILED, e).await);
        }
    }
    let state = match &seen {
        Ok(Some(v)) => format!("{:?}", v.state).to_lowercase(),
        Ok(None) => "gone".to_owned(),
        Err(i) => format!("unknown ({})", error_chain(i)),
    };
    let msg = format!(
        "{}; the VM no longer runs (state {state}): {snapshot} holds it and is kept, the pod is hibernated and the \
         removal retried",
        error_chain(&e)
    );
    s.event(pod, true, events::HIBERNATE_REMOVE_FAILED, &msg);
    mark_hibernated(s, key, gen, !matches!(seen, Ok(None)), Some(msg));
    s.push_entry(key, gen);
    Ok(())
}

/// Wakes the hibernated VM of the entry at `key` (see the module docs).
#[tracing::instrument(name = "wake", skip_all, fields(pod = %key))]
pub(super) async fn wake(s: &Arc<Shared>, key: &str, gen: u64) -> Result<(), CocoonProviderError> {
    let Some((pod, vm)) = take(s, key, gen, true, Lifecycle::Creating) else { return Ok(()) };
    s.push_entry(key, gen);
    let pending = s.lock().entries.get(key).filter(|e| e.gen == gen).is_some_and(|e| e.remove_pending);
    if pending {
        if let Err(source) = crate::watcher::finish_removal(s, key, gen, &vm.id).await {
            let e = CocoonProviderError::Remove { key: key.to_owned(), id: vm.id.clone(), source };
            return Err(failed(s, key, gen, &pod, events::WAKE_CLONE_FAILED, e).await);
        }
    }
    let hypervisor = vm.hypervisor;
    match restore(s, &pod, &vm.name, hypervisor).await {
        Ok((woken, dropped)) => {
            {
                let mut g = s.lock();
                if let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) {
                    e.vm = woken;
                    e.hibernated = false;
                    e.lifecycle = Lifecycle::Ready;
                    e.stale_hibernation = !dropped;
                    e.retry_at = None;
                    e.retry_backoff = Duration::ZERO;
                }
            }
            loops::finish(s, key, gen).await;
            Ok(())
        }
        Err(source) => {
            let e = CocoonProviderError::BringUp {
                key: key.to_owned(),
                what: format!("VM {} (wake from {})", vm.name, hibernation_of(&vm.name)),
                source,
            };
            Err(failed(s, key, gen, &pod, events::WAKE_CLONE_FAILED, e).await)
        }
    }
}

/// Restores `vm_name` from its hibernation snapshot keeping its lease, drops the snapshot and
/// records `Woken`; `true` beside the VM when the snapshot was dropped.
async fn restore(s: &Shared, pod: &Pod, vm_name: &str, hypervisor: Hypervisor) -> Result<(VmInfo, bool), BackendError> {
    let snapshot = hibernation_of(vm_name);
    let req = CloneRequest {
        name: vm_name.to_owned(),
        namespace: namespace_of(pod),
        snapshot: snapshot.clone(),
        network: annotations::value(pod, annotations::NETWORK).map(str::to_owned),
        shared_network: annotations::value(pod, annotations::SHARED_NETWORK).map(str::to_owned),
        hypervisor,
        keep_lease: true,
    };
    let vm = s.backend.clone_vm(&req).await?;
    let dropped = match s.backend.snapshot_rm(&snapshot).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(%snapshot, error = %error_chain(&e), "dropping the hibernation snapshot after the wake failed; the next hibernate replaces it");
            false
        }
    };
    let ip = vm.ip.as_deref().unwrap_or("none");
    s.event(pod, false, events::WOKEN, &format!("VM {} restored from {snapshot} with address {ip}", vm.id));
    Ok((vm, dropped))
}

/// The id a hibernated Pod's entry carries: the backend's id of its VM name (`""` when the
/// backend cannot tell: no lease is then released by it). A `vm.cocoonstack.io/id` naming
/// another id is refused (Warning `VMIdRefused`, lifecycle `failed`).
fn hibernated_id(s: &Shared, key: &str, pod: &Pod, vm_name: &str) -> Result<String, CocoonProviderError> {
    let annotated = annotations::value(pod, annotations::VM_ID).filter(|a| !a.is_empty());
    match (s.backend.vm_id_of(vm_name), annotated) {
        (Some(ours), Some(a)) if a != ours => {
            let e = CocoonProviderError::VmIdMismatch {
                key: key.to_owned(),
                name: vm_name.to_owned(),
                annotated: a.to_owned(),
                ours,
            };
            let msg = error_chain(&e);
            s.event(pod, true, events::VM_ID_REFUSED, &msg);
            s.push_pending(pod, Lifecycle::Failed, Some(&msg));
            Err(e)
        }
        (Some(ours), _) => Ok(ours),
        (None, a) => {
            if a.is_some() {
                tracing::warn!(
                    vm = vm_name,
                    "the backend cannot vouch for the pod's vm.cocoonstack.io/id; tracked without one"
                );
            }
            Ok(String::new())
        }
    }
}

/// The source a VM of `spec` starts from when it boots (a fork's snapshot, the snapshot a
/// clone restores, the image a run boots); `None`: the Pod names none (`restore-from-hibernate`
/// alone).
fn pod_source(spec: &VmSpec) -> Option<String> {
    match (&spec.fork_from, &spec.snapshot, spec.mode, &spec.image) {
        (Some(source), ..) => Some(fork_of(source).to_string()),
        (None, Some(snapshot), Mode::Clone, _) => Some(snapshot.to_string()),
        (None, _, Mode::Run, Some(image)) => Some(image.clone()),
        _ => None,
    }
}

/// §3.4: `<vm-name>:hibernate` is restored only into a Pod whose image it was saved from (a
/// leftover of an older Pod of the name must not resume in a new one, e.g. after a rollout to
/// a new image). A mismatch, or a Pod image the library does not hold, fails the create
/// (Warning `HibernationImageMismatch`, lifecycle `failed`; the snapshot is kept). A snapshot
/// that records no base image, or a Pod that names no image, is restored as before (logged).
async fn check_base_image(
    s: &Shared,
    key: &str,
    pod: &Pod,
    spec: &VmSpec,
    snapshot: &SnapshotRef,
    info: &SnapshotInfo,
) -> Result<(), CocoonProviderError> {
    let Some(saved) = info.base_image.as_deref() else {
        tracing::warn!(%snapshot, "the snapshot records no base image, so it cannot be checked against the pod's image; served as it is");
        return Ok(());
    };
    let Some(image) = pod_source(spec) else {
        tracing::info!(%snapshot, base = saved, "the pod names no image to check the snapshot against; served as it is");
        return Ok(());
    };
    let resolved = match s.backend.base_image_of(&image).await {
        Ok(r) => r,
        Err(source) => {
            let what = format!("VM {} (looking up the base image of {image} to check {snapshot})", spec.vm_name);
            return Err(bring_up_failed(s, pod, CocoonProviderError::BringUp { key: key.to_owned(), what, source }));
        }
    };
    if resolved.as_deref() == Some(saved) {
        return Ok(());
    }
    let found = ImageMismatch { snapshot: snapshot.clone(), saved: saved.to_owned(), image, resolved };
    let e = CocoonProviderError::HibernationImageMismatch { key: key.to_owned(), found: Box::new(found) };
    let msg = error_chain(&e);
    s.event(pod, true, events::HIBERNATION_IMAGE_MISMATCH, &msg);
    s.push_pending(pod, Lifecycle::Failed, Some(&msg));
    Err(e)
}

/// CreatePod of a managed Pod whose VM was hibernated: `Some` when it was served here
/// (tracked as hibernated, or woken), `None` when there is nothing hibernated to serve.
pub(super) async fn create_from_hibernation(
    s: &Arc<Shared>,
    key: &str,
    pod: &Pod,
    spec: &VmSpec,
    hypervisor: Hypervisor,
) -> Result<Option<()>, CocoonProviderError> {
    let snapshot = hibernation_of(&spec.vm_name);
    let ns = namespace_of(pod);
    let info = match s.backend.snapshot_inspect(&snapshot).await {
        Ok(info) => info,
        Err(source) => {
            let what = format!("VM {} (looking up snapshot {snapshot})", spec.vm_name);
            return Err(bring_up_failed(s, pod, CocoonProviderError::BringUp { key: key.to_owned(), what, source }));
        }
    };
    let Some(info) = info else {
        if spec.restore_from_hibernate {
            let e = CocoonProviderError::SnapshotMissing { key: key.to_owned(), snapshot };
            return Err(bring_up_failed(s, pod, e));
        }
        return Ok(None);
    };
    check_namespace(s, key, &ns, info.namespace.as_deref(), || format!("snapshot {snapshot}"), Use::Clone)?;
    check_base_image(s, key, pod, spec, &snapshot, &info).await?;
    // Asleep while an object or the annotation asks for it; and, until the first successful
    // `CocoonHibernation` listing, while the lifecycle says it was hibernated (an object may).
    let (desire, known) = {
        let g = s.lock();
        (g.desires.get(key).copied(), g.desires_known)
    };
    let held = !known && annotations::value(pod, annotations::LIFECYCLE_STATE) == Some(Lifecycle::Hibernated.as_str());
    if desire.unwrap_or(spec.hibernate || held) {
        // Still asked to sleep: track it as it was, under the id of its name (whose lease a
        // delete releases) and the address the Pod shows.
        let vm = VmInfo {
            id: hibernated_id(s, key, pod, &spec.vm_name)?,
            name: spec.vm_name.clone(),
            namespace: Some(ns),
            ip: annotations::value(pod, annotations::VM_IP).map(str::to_owned),
            state: VmState::Stopped,
            hypervisor,
        };
        let gen = s.insert_entry(key, pod, spec.clone(), vm, Lifecycle::Hibernated);
        if let Some(e) = s.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
            e.hibernated = true;
            e.busy = false;
            e.held = held;
        }
        tracing::info!(%snapshot, held, "tracking a hibernated VM");
        s.push_entry(key, gen);
        return Ok(Some(()));
    }
    s.push_pending(pod, Lifecycle::Creating, None);
    let (vm, dropped) = match restore(s, pod, &spec.vm_name, hypervisor).await {
        Ok(woken) => woken,
        Err(source) => {
            let what = format!("VM {} (wake from {snapshot})", spec.vm_name);
            let e = CocoonProviderError::BringUp { key: key.to_owned(), what, source };
            return Err(bring_up_failed(s, pod, e));
        }
    };
    tracing::Span::current().record("vm", vm.id.as_str());
    let gen = s.insert_entry(key, pod, spec.clone(), vm, Lifecycle::Ready);
    if let Some(e) = s.lock().entries.get_mut(key).filter(|e| e.gen == gen) {
        e.stale_hibernation = !dropped;
    }
    loops::finish(s, key, gen).await;
    Ok(Some(()))
}

/// The snapshot a `fork-from` Pod clones: `fork-<source>:latest`, saved from the source's
/// running VM the first time (the source keeps running). The source must be a tracked, running
/// VM of a namespace this Pod may clone from.
pub(super) async fn fork_source(
    s: &Arc<Shared>,
    key: &str,
    pod: &Pod,
    source: &str,
) -> Result<SnapshotRef, CocoonProviderError> {
    let ns = namespace_of(pod);
    let snapshot = fork_of(source);
    let bring_up = |what: String, source: BackendError| {
        bring_up_failed(s, pod, CocoonProviderError::BringUp { key: key.to_owned(), what, source })
    };
    match s.backend.snapshot_inspect(&snapshot).await {
        Ok(Some(info)) => {
            check_namespace(s, key, &ns, info.namespace.as_deref(), || format!("snapshot {snapshot}"), Use::Clone)?;
            return Ok(snapshot);
        }
        Ok(None) => {}
        Err(e) => return Err(bring_up(format!("fork of {source} (looking up {snapshot})"), e)),
    }
    let vm = {
        let g = s.lock();
        g.entries
            .values()
            .find(|e| e.spec.managed && e.terminal.is_none() && !e.hibernated && e.spec.vm_name == source)
            .map(|e| e.vm.clone())
    };
    let Some(vm) = vm.filter(|v| v.state == VmState::Running) else {
        let what = format!("fork of {source}");
        let e = BackendError::NotFound { what: format!("a running VM named {source} on this node") };
        return Err(bring_up(what, e));
    };
    check_namespace(s, key, &ns, vm.namespace.as_deref(), || format!("VM {source}"), Use::Clone)?;
    let owner = s.cfg.namespaces.owner(vm.namespace.as_deref()).to_owned();
    s.backend
        .snapshot_save(&vm.id, &snapshot, &owner)
        .await
        .map_err(|e| bring_up(format!("fork of {source} (saving {snapshot})"), e))?;
    tracing::info!(%snapshot, source, "saved the fork snapshot");
    Ok(snapshot)
}

/// What a `CocoonHibernation` sees of the Pod it names ([`super::CocoonProvider::apply_hibernations`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HibernationView {
    /// `vm.cocoonstack.io/name`.
    pub vm_name: String,
    /// The VM is saved and stopped.
    pub hibernated: bool,
    /// A hibernate or wake is running.
    pub busy: bool,
    pub lifecycle: Lifecycle,
}

impl super::CocoonProvider {
    /// Sets the hibernation desires of `CocoonHibernation` objects (Pod key → `true`:
    /// Hibernate, `false`: Wake; a tracked Pod missing from the map falls back to its
    /// annotation), starts the hibernates and wakes they call for (on their own tasks; an
    /// entry whose last try failed waits out its backoff, see the module docs), and returns
    /// what each named, tracked Pod looks like now.
    pub fn apply_hibernations(
        &self,
        desires: &std::collections::BTreeMap<String, bool>,
    ) -> std::collections::BTreeMap<String, HibernationView> {
        self.apply(desires.clone(), true)
    }

    /// [`Self::apply_hibernations`] for a listing cut short (more objects than the loop reads):
    /// `listed` overrides the last known desires, and a desire no longer listed is kept (its
    /// object may be among those left out), so nothing is woken on a partial view.
    pub fn apply_incomplete_hibernations(
        &self,
        listed: &std::collections::BTreeMap<String, bool>,
    ) -> std::collections::BTreeMap<String, HibernationView> {
        let mut desires = self.0.lock().desires.clone();
        desires.extend(listed.iter().map(|(k, v)| (k.clone(), *v)));
        self.apply(desires, false)
    }

    /// Whether a complete `CocoonHibernation` listing (or the CRD's absence) was applied since
    /// the provider started.
    pub fn hibernation_desires_known(&self) -> bool {
        self.0.lock().desires_known
    }

    fn apply(
        &self,
        desires: std::collections::BTreeMap<String, bool>,
        complete: bool,
    ) -> std::collections::BTreeMap<String, HibernationView> {
        let s = &self.0;
        let now = tokio::time::Instant::now();
        let mut due = Vec::new();
        let mut views = std::collections::BTreeMap::new();
        {
            let mut g = s.lock();
            g.desires_known |= complete;
            g.desires = desires;
            let g = &mut *g;
            for (key, e) in g.entries.iter_mut() {
                e.desire = g.desires.get(key).copied();
                if complete {
                    e.held = false;
                }
                if !e.spec.managed || e.terminal.is_some() {
                    continue;
                }
                let waiting = e.retry_at.is_some_and(|at| now < at);
                if !e.busy && !waiting && e.wants_sleep() != e.hibernated {
                    due.push((key.clone(), e.gen, e.hibernated));
                }
                if e.desire.is_some() {
                    let view = HibernationView {
                        vm_name: e.spec.vm_name.clone(),
                        hibernated: e.hibernated,
                        busy: e.busy,
                        lifecycle: e.lifecycle,
                    };
                    views.insert(key.clone(), view);
                }
            }
        }
        for (key, gen, hibernated) in due {
            let s = s.clone();
            tokio::spawn(async move {
                let r = if hibernated { wake(&s, &key, gen).await } else { hibernate(&s, &key, gen).await };
                if let Err(e) = r {
                    tracing::warn!(pod = %key, error = %error_chain(&e), "a CocoonHibernation's request failed; retried after its backoff");
                }
            });
        }
        views
    }
}

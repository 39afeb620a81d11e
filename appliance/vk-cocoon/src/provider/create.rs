//! CreatePod and UpdatePod (the steps are in the module docs of [`super`]): retire an older
//! Pod's entry under the key, parse and gate the spec, then track an unmanaged VM, adopt a live
//! one, or boot one from an image or a snapshot, each VM and snapshot passing the namespace rule
//! first; then the post-clone network, one probe and Running.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;
use vnode::kit::uid_of;
use vnode::PodKey;

use super::delete;
use super::error::{bring_up_failed, check_namespace, refused, CocoonProviderError};
use super::hibernate;
use super::loops;
use crate::annotations::{self, AnnotationError, Mode, VmSpec};
use crate::backend::{BackendError, CloneRequest, Hypervisor, RunRequest, SnapshotRef, VmInfo, VmState};
use crate::events;
use crate::metrics::metrics;
use crate::namespaces::Use;
use crate::shared::{namespace_of, Lifecycle, Shared};

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

/// The namespace part of a key `ns/name`.
fn key_namespace(key: &str) -> &str {
    key.split_once('/').map(|(ns, _)| ns).unwrap_or_default()
}

#[tracing::instrument(name = "create_pod", skip_all, fields(pod = %PodKey::of(pod), vm = tracing::field::Empty))]
pub(super) async fn create(s: &Arc<Shared>, pod: &Pod) -> Result<(), CocoonProviderError> {
    let key = PodKey::of(pod).to_string();
    let uid = uid_of(pod);
    let same = s.lock().entries.get(&key).map(|e| e.uid == uid);
    match same {
        Some(true) => return update(s, pod).await,
        Some(false) => retire(s, &key, pod).await?,
        None => {}
    }
    // 1. The spec.
    let spec =
        annotations::parse(pod).map_err(|source| CocoonProviderError::Annotation { key: key.clone(), source })?;
    if let Some(wanted) = annotations::selected_cpu_class(pod) {
        if s.cfg.cpu_class.as_deref() != Some(wanted) {
            return Err(CocoonProviderError::CpuClass {
                key,
                wanted: wanted.to_owned(),
                node: s.cfg.cpu_class.clone(),
            });
        }
    }
    // 3. Unmanaged: only tracked.
    if !spec.managed {
        return track_unmanaged(s, &key, pod, spec).await;
    }
    let hypervisor = hypervisor_for(s, pod, &spec);
    create_managed(s, &key, pod, spec, hypervisor).await.map_err(|e| refused(s, pod, e, true))?;
    // A Pod created asking for hibernation (its VM was never saved): up first, then saved.
    let asleep = s.lock().entries.get(&key).filter(|e| e.wants_sleep() && !e.hibernated).map(|e| e.gen);
    match asleep {
        Some(gen) => hibernate::hibernate(s, &key, gen).await,
        None => Ok(()),
    }
}

/// Steps 2 and 4 of a managed Pod; every VM and snapshot it touches passes the namespace
/// rule ([`crate::namespaces`]) first.
async fn create_managed(
    s: &Arc<Shared>,
    key: &str,
    pod: &Pod,
    spec: VmSpec,
    hypervisor: Hypervisor,
) -> Result<(), CocoonProviderError> {
    let ns = namespace_of(pod);
    // 2a. The seed's documented constraint: a Pod naming the live VM of another Pod adopts
    // that VM instead of booting its own (upstream behaviour; shown, not hidden) — when
    // that VM is of its namespace, or of one sharing with it.
    if let Some((other, vm)) = live_vm_named(s, key, &spec.vm_name) {
        check_namespace(s, key, &ns, vm.namespace.as_deref(), || format!("VM {}", spec.vm_name), Use::Adopt)?;
        let msg = format!(
            "VM name {} is already used by pod {other}: this pod adopts VM {} instead of booting its own \
             (give each Sandbox its own vm.cocoonstack.io/name)",
            spec.vm_name, vm.id
        );
        tracing::warn!(vm = %vm.id, other = %other, "{msg}");
        s.event(pod, true, events::VM_NAME_SHARED, &msg);
        return adopt(s, key, pod, spec, hypervisor, vm, false).await;
    }
    // 2. Adopt a live VM.
    let _reservation = reserve(s, key, &ns, &spec.vm_name)?;
    if let Some((vm, from_startup)) = find_adoptable(s, key, pod, &spec).await? {
        return adopt(s, key, pod, spec, hypervisor, vm, from_startup).await;
    }
    // 4. Boot — under a name no other namespace holds through its saved state: the
    // deletion of this VM saves or drops `<name>:latest`.
    let own = SnapshotRef::latest(&spec.vm_name);
    match s.backend.snapshot_inspect(&own).await {
        Ok(Some(info)) => check_namespace(
            s,
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
            return Err(bring_up_failed(s, pod, e));
        }
    }
    // 4a. Its VM hibernated (`<name>:hibernate` exists): tracked asleep, or woken.
    if hibernate::create_from_hibernation(s, key, pod, &spec, hypervisor).await?.is_some() {
        return Ok(());
    }
    boot(s, key, pod, spec, hypervisor).await
}

/// The hypervisor `spec`'s VM runs under: the backend the Pod names when this node has it,
/// else the node's own, with a Normal `BackendSubstituted` event that says which (CocoonSet
/// Pods name `cloud-hypervisor`, cocoon-common's default, whatever the node runs).
fn hypervisor_for(s: &Shared, pod: &Pod, spec: &VmSpec) -> Hypervisor {
    let available = s.backend.hypervisors();
    let node = available.first().copied().unwrap_or(Hypervisor::Qemu);
    let Some(asked) = spec.backend else { return node };
    if let Some(h) = asked.hypervisor().filter(|h| available.contains(h)) {
        return h;
    }
    let runs = available.iter().map(|h| h.as_str()).collect::<Vec<_>>().join(", ");
    let why = match asked.hypervisor() {
        None => format!("no hypervisor here runs Firecracker; this node runs {runs}"),
        Some(_) => format!("this node runs {runs}"),
    };
    let msg = format!("backend {} was asked for; the VM runs under {} ({why})", asked.as_str(), node.as_str());
    s.event(pod, false, events::BACKEND_SUBSTITUTED, &msg);
    node
}

/// Another live, managed Pod's running VM called `name`, with that Pod's key.
fn live_vm_named(s: &Shared, key: &str, name: &str) -> Option<(String, VmInfo)> {
    let g = s.lock();
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
fn reserve(s: &Arc<Shared>, key: &str, ns: &str, name: &str) -> Result<Reservation, CocoonProviderError> {
    let mut g = s.lock();
    let other = g
        .entries
        .iter()
        .find(|(k, e)| k.as_str() != key && e.terminal.is_none() && e.spec.managed && e.spec.vm_name == name)
        .map(|(k, e)| (k.clone(), e.vm.namespace.clone()))
        .or_else(|| {
            g.reserved.get(name).filter(|k| k.as_str() != key).map(|k| (k.clone(), Some(key_namespace(k).to_owned())))
        });
    if let Some((other, owner)) = other {
        check_namespace(s, key, ns, owner.as_deref(), || format!("VM {name}"), Use::Name)?;
        return Err(CocoonProviderError::VmNameTaken { key: key.to_owned(), name: name.to_owned(), other });
    }
    g.reserved.insert(name.to_owned(), key.to_owned());
    Ok(Reservation { shared: s.clone(), name: name.to_owned(), key: key.to_owned() })
}

/// Step 2's candidates: the adoptable map by id, then by name; else a VM of this name in a
/// fresh listing that no entry tracks. `true` = the VM outlived a provider restart.
async fn find_adoptable(
    s: &Shared,
    key: &str,
    pod: &Pod,
    spec: &VmSpec,
) -> Result<Option<(VmInfo, bool)>, CocoonProviderError> {
    let ns = namespace_of(pod);
    {
        let mut g = s.lock();
        let by_id = annotations::value(pod, annotations::VM_ID)
            .and_then(|id| g.adoptable.get(id))
            .map(|v| (v.clone(), format!("VM {}", v.id)));
        let found = by_id.or_else(|| {
            g.adoptable.values().find(|v| v.name == spec.vm_name).map(|v| (v.clone(), format!("VM {}", v.name)))
        });
        if let Some((vm, what)) = found {
            // A refused VM stays adoptable for a Pod of its own namespace.
            check_namespace(s, key, &ns, vm.namespace.as_deref(), || what, Use::Adopt)?;
            g.adoptable.remove(&vm.id);
            let restarted = g.restarted.remove(&vm.id);
            return Ok(Some((vm, restarted)));
        }
    }
    let vms = s.backend.list().await.map_err(|source| CocoonProviderError::List {
        key: key.to_owned(),
        name: spec.vm_name.clone(),
        source,
    })?;
    let g = s.lock();
    let tracked: BTreeSet<&str> =
        g.entries.values().filter(|e| e.terminal.is_none()).map(|e| e.vm.id.as_str()).collect();
    let Some(vm) = vms.into_iter().find(|v| v.name == spec.vm_name) else { return Ok(None) };
    let action = if tracked.contains(vm.id.as_str()) { Use::Name } else { Use::Adopt };
    check_namespace(s, key, &ns, vm.namespace.as_deref(), || format!("VM {}", spec.vm_name), action)?;
    Ok((!tracked.contains(vm.id.as_str())).then_some((vm, false)))
}

async fn adopt(
    s: &Arc<Shared>,
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
            remove_leftover(s, key, &vm).await?;
            // A wake that never finished: its guest carries the address of this lease.
            if !hibernate::hibernation_held(s, [vm.name.as_str(), spec.vm_name.as_str()]).await {
                if let Err(e) = s.backend.release_ip(&vm.id).await {
                    tracing::warn!(vm = %vm.id, error = %error_chain(&e), "releasing the half-created VM's lease failed");
                }
            }
            return boot(s, key, pod, spec, hypervisor).await;
        }
        VmState::Stopped if interrupted_hibernate(s, key, pod, &vm).await? => {
            // The snapshot holds the VM; a cold boot would give the Pod a fresh guest, and the
            // next hibernate would save that over it. The stopped leftover goes (its lease
            // stays), and the Pod is served from the snapshot: asleep, or woken.
            tracing::info!(vm = %vm.id, "a hibernate was interrupted after the VM stopped; finishing it");
            remove_leftover(s, key, &vm).await?;
            return match hibernate::create_from_hibernation(s, key, pod, &spec, hypervisor).await? {
                Some(()) => Ok(()),
                None => boot(s, key, pod, spec, hypervisor).await,
            };
        }
        VmState::Stopped => match s.backend.start(&vm.id).await {
            Ok(v) => v,
            Err(source) => {
                let e = CocoonProviderError::Adopt { key: key.to_owned(), id: vm.id.clone(), source };
                let msg = error_chain(&e);
                s.event(pod, true, events::RESUME_START_FAILED, &msg);
                s.push_pending(pod, Lifecycle::Failed, Some(&msg));
                let mut g = s.lock();
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
    let gen = s.insert_entry(key, pod, spec, vm.clone(), lifecycle);
    tracing::info!(vm = %vm.id, name = %vm.name, from_startup, "adopted a live VM");
    if from_startup {
        s.event(pod, false, events::RESUMED_AFTER_RESTART, &format!("adopted VM {} after a provider restart", vm.id));
    }
    if owed_network {
        loops::post_clone(s, key, gen).await;
    }
    loops::finish(s, key, gen).await;
    Ok(())
}

/// Whether the stopped `vm` is the leftover of a hibernate that stopped it and then crashed:
/// its `<vm-name>:hibernate` exists. A failed lookup fails the create (retried) rather than
/// cold-boot over a snapshot that may exist.
/// Removes the VM a previous run left behind (half-created, or stopped mid-hibernate) before
/// the Pod is served afresh.
async fn remove_leftover(s: &Shared, key: &str, vm: &VmInfo) -> Result<(), CocoonProviderError> {
    s.backend.remove(&vm.id).await.map_err(|source| CocoonProviderError::Remove {
        key: key.to_owned(),
        id: vm.id.clone(),
        source,
    })
}

async fn interrupted_hibernate(s: &Shared, key: &str, pod: &Pod, vm: &VmInfo) -> Result<bool, CocoonProviderError> {
    let snapshot = hibernate::hibernation_of(&vm.name);
    match s.backend.snapshot_inspect(&snapshot).await {
        Ok(found) => Ok(found.is_some()),
        Err(source) => {
            let what = format!("VM {} (looking up snapshot {snapshot} before starting it)", vm.name);
            Err(bring_up_failed(s, pod, CocoonProviderError::BringUp { key: key.to_owned(), what, source }))
        }
    }
}

async fn boot(
    s: &Arc<Shared>,
    key: &str,
    pod: &Pod,
    spec: VmSpec,
    hypervisor: Hypervisor,
) -> Result<(), CocoonProviderError> {
    s.push_pending(pod, Lifecycle::Creating, None);
    let started = std::time::Instant::now();
    // 4b. A fork clones the source's `fork-<name>` snapshot instead of its image.
    let forked = match &spec.fork_from {
        Some(source) => Some(hibernate::fork_source(s, key, pod, source).await?),
        None => None,
    };
    let result = match (spec.mode, forked.as_ref().or(spec.snapshot.as_ref()), &spec.image) {
        (Mode::Clone, Some(snapshot), _) => match s.backend.snapshot_inspect(snapshot).await {
            Ok(Some(info)) => {
                check_namespace(
                    s,
                    key,
                    &namespace_of(pod),
                    info.namespace.as_deref(),
                    || format!("snapshot {snapshot}"),
                    Use::Clone,
                )?;
                s.backend
                    .clone_vm(&CloneRequest {
                        name: spec.vm_name.clone(),
                        namespace: namespace_of(pod),
                        snapshot: snapshot.clone(),
                        network: spec.network.clone(),
                        shared_network: spec.shared_network.clone(),
                        hypervisor,
                        keep_lease: false,
                    })
                    .await
                    .map_err(|source| (format!("clone of {snapshot}"), source))
            }
            Ok(None) => {
                let e = CocoonProviderError::SnapshotMissing { key: key.to_owned(), snapshot: snapshot.clone() };
                return Err(bring_up_failed(s, pod, e));
            }
            Err(source) => Err((format!("looking up snapshot {snapshot}"), source)),
        },
        (Mode::Run, _, Some(image)) => {
            let (vcpus, memory_mib) = annotations::run_resources(pod);
            s.backend
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
            return Err(bring_up_failed(s, pod, e));
        }
    };
    tracing::Span::current().record("vm", vm.id.as_str());
    tracing::info!(vm = %vm.id, ip = ?vm.ip, mode = ?spec.mode, "VM up");
    let clone = spec.mode == Mode::Clone;
    let gen = s.insert_entry(key, pod, spec, vm, if clone { Lifecycle::Creating } else { Lifecycle::Ready });
    if clone {
        loops::post_clone(s, key, gen).await;
    }
    loops::finish(s, key, gen).await;
    metrics().vm_booted(clone, hypervisor, started.elapsed());
    Ok(())
}

async fn track_unmanaged(s: &Arc<Shared>, key: &str, pod: &Pod, spec: VmSpec) -> Result<(), CocoonProviderError> {
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
        hypervisor: s.backend.hypervisors().first().copied().unwrap_or(Hypervisor::Qemu),
    };
    let gen = s.insert_entry(key, pod, spec, vm, Lifecycle::Ready);
    tracing::info!("tracking an unmanaged VM");
    loops::finish(s, key, gen).await;
    Ok(())
}

/// An entry of an older Pod under `key`: its VM goes to the new Pod when the names match,
/// else it is deleted like a DeletePod of the old Pod.
async fn retire(s: &Arc<Shared>, key: &str, new_pod: &Pod) -> Result<(), CocoonProviderError> {
    let (old_pod, vm, managed, terminal, gen, name) = {
        let g = s.lock();
        let Some(e) = g.entries.get(key) else { return Ok(()) };
        (e.pod.clone(), e.vm.clone(), e.spec.managed, e.terminal.is_some(), e.gen, e.spec.vm_name.clone())
    };
    if terminal || !managed || annotations::vm_name(new_pod).ok().as_deref() == Some(name.as_str()) {
        let mut g = s.lock();
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
    delete::delete_vm(s, key, &old_pod, vm, Some(gen)).await
}

#[tracing::instrument(name = "update_pod", skip_all, fields(pod = %PodKey::of(pod)))]
pub(super) async fn update(s: &Arc<Shared>, pod: &Pod) -> Result<(), CocoonProviderError> {
    let key = PodKey::of(pod).to_string();
    let uid = uid_of(pod);
    enum Next {
        Create,
        Push(Box<Pod>),
        Hibernate(u64),
        Wake(u64),
        Nothing,
    }
    let next = {
        let mut g = s.lock();
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
                    Next::Push(Box::new(e.view(&s.cfg.node_ip)))
                } else if e.spec.managed && !e.busy && e.wants_sleep() != e.hibernated {
                    if e.hibernated {
                        Next::Wake(e.gen)
                    } else {
                        Next::Hibernate(e.gen)
                    }
                } else {
                    Next::Nothing
                }
            }
        }
    };
    match next {
        Next::Create => return Box::pin(create(s, pod)).await,
        Next::Push(p) => s.notify(*p),
        Next::Hibernate(gen) => return hibernate::hibernate(s, &key, gen).await,
        Next::Wake(gen) => return hibernate::wake(s, &key, gen).await,
        Next::Nothing => {}
    }
    Ok(())
}

//! [`FakeBackend`]: an in-memory [`VmBackend`] with settable failures and a call log, for the
//! provider's unit tests (and any other test that needs a backend without VMs). It keeps the
//! trait's contract: unique names, idempotent teardown, leases released only by
//! `release_ip`, a failed `list` is an error.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use crate::backend::{
    BackendError, CloneRequest, Hypervisor, Library, RunRequest, SnapshotEntry, SnapshotInfo, SnapshotRef, VmBackend,
    VmInfo, VmState,
};

/// The failure a [`FakeBackend`] injects.
#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
pub struct Injected;

#[derive(Debug, Clone)]
struct FakeVm {
    info: VmInfo,
    agent_ok: bool,
    /// Where it came from: `run:<image>` or `clone:<repo:tag>`.
    source: String,
}

#[derive(Debug, Default)]
struct FakeState {
    vms: BTreeMap<String, FakeVm>,
    /// Snapshot → (the name of the VM it was saved from, its owning namespace).
    snapshots: BTreeMap<SnapshotRef, (String, Option<String>)>,
    /// VM id → the address its lease gives.
    leases: BTreeMap<String, Option<String>>,
    /// VM name → the id its latest VM had (as a name-derived id would: `vm_id_of`).
    ids: BTreeMap<String, String>,
    next: u64,
    calls: Vec<String>,
    /// op → remaining injected failures (`u32::MAX` = every call).
    failures: BTreeMap<&'static str, u32>,
    /// The `ip` new VMs get is `10.88.0.<n>`; `None` → no IP.
    no_ip: bool,
    /// What `usage` reports, by VM id.
    usage: BTreeMap<String, crate::backend::VmUsage>,
    /// The base image of each VM (by id) and snapshot that records one: a run's image, a
    /// clone's snapshot's base (`base_image_of` names an image by itself).
    vm_bases: BTreeMap<String, String>,
    snapshot_bases: BTreeMap<SnapshotRef, String>,
    /// When each snapshot was saved (absent: now, for `library`).
    created: BTreeMap<SnapshotRef, std::time::SystemTime>,
    /// Runs of `collect_garbage`.
    collections: u32,
    /// What each snapshot name points at ([`SnapshotEntry::content`]): a new number per save.
    contents: BTreeMap<SnapshotRef, u64>,
    saves: u64,
    /// op → a hook run once at the next call of op (see [`FakeBackend::before`]).
    hooks: BTreeMap<&'static str, Hook>,
}

/// Code a test runs inside a backend call.
struct Hook(Box<dyn FnOnce() + Send>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

/// The fake backend. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct FakeBackend {
    state: Mutex<FakeState>,
    hypervisors: Vec<Hypervisor>,
}

impl Default for FakeBackend {
    fn default() -> Self {
        FakeBackend::new()
    }
}

impl FakeBackend {
    /// A backend that runs QEMU only (like this TCG host).
    pub fn new() -> FakeBackend {
        FakeBackend::with_hypervisors(vec![Hypervisor::Qemu])
    }

    pub fn with_hypervisors(hypervisors: Vec<Hypervisor>) -> FakeBackend {
        FakeBackend { state: Mutex::default(), hypervisors }
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        // Test support: the state is whole at every unlock.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next `times` calls of `op` (the trait method's name) fail; `u32::MAX` = all.
    pub fn fail(&self, op: &'static str, times: u32) {
        self.lock().failures.insert(op, times);
    }

    /// Stops injecting failures into `op`.
    pub fn heal(&self, op: &'static str) {
        self.lock().failures.remove(op);
    }

    /// New VMs get no IP.
    pub fn without_ips(&self) {
        self.lock().no_ip = true;
    }

    /// Every call so far, `op arg…` (probes, listings and inspections excluded: they are reads, and noisy).
    /// What [`VmBackend::usage`] reports for VM `id` from now on.
    pub fn set_usage(&self, id: &str, usage: crate::backend::VmUsage) {
        self.lock().usage.insert(id.to_owned(), usage);
    }

    pub fn calls(&self) -> Vec<String> {
        self.lock().calls.clone()
    }

    /// Forgets the call log.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// A VM that exists already (as if created by an earlier provider process), owned by
    /// `namespace` (`None`: a record from before namespaces were recorded).
    pub fn add_vm(&self, namespace: Option<&str>, name: &str, state: VmState) -> VmInfo {
        let mut s = self.lock();
        let info = Self::new_vm(&mut s, name, namespace, Hypervisor::Qemu);
        let info = VmInfo { state, ..info };
        s.vms.insert(info.id.clone(), FakeVm { info: info.clone(), agent_ok: true, source: "preexisting".into() });
        info
    }

    /// A snapshot in the library, owned by `namespace` (`None`: saved without one); under a
    /// name in use, new content replaces the old (as a save does).
    pub fn add_snapshot(&self, namespace: Option<&str>, snapshot: &SnapshotRef) {
        let mut s = self.lock();
        s.snapshots.insert(snapshot.clone(), ("preexisting".into(), namespace.map(str::to_owned)));
        Self::new_content(&mut s, snapshot);
    }

    /// `f` runs once, with no lock of the backend held, at the start of the next call of
    /// `op` (so far only `snapshot_rm_if` runs hooks): a change racing with that call.
    pub fn before(&self, op: &'static str, f: impl FnOnce() + Send + 'static) {
        self.lock().hooks.insert(op, Hook(Box::new(f)));
    }

    fn run_hook(&self, op: &'static str) {
        let hook = self.lock().hooks.remove(op);
        if let Some(Hook(f)) = hook {
            f();
        }
    }

    fn new_content(s: &mut FakeState, snapshot: &SnapshotRef) {
        s.saves += 1;
        let n = s.saves;
        s.contents.insert(snapshot.clone(), n);
    }

    /// The snapshot was saved at `at` (as [`VmBackend::library`] reports it).
    pub fn set_snapshot_created(&self, snapshot: &SnapshotRef, at: std::time::SystemTime) {
        self.lock().created.insert(snapshot.clone(), at);
    }

    /// How many times [`VmBackend::collect_garbage`] ran.
    pub fn collections(&self) -> u32 {
        self.lock().collections
    }

    /// The VM's state changes (e.g. to `Stopped`: the hypervisor died).
    pub fn set_state(&self, id: &str, state: VmState) {
        if let Some(v) = self.lock().vms.get_mut(id) {
            v.info.state = state;
        }
    }

    /// The VM disappears without `remove` (its record deleted behind the provider's back).
    pub fn vanish(&self, id: &str) {
        self.lock().vms.remove(id);
    }

    /// Whether the VM's agent answers probes.
    pub fn set_agent(&self, id: &str, ok: bool) {
        if let Some(v) = self.lock().vms.get_mut(id) {
            v.agent_ok = ok;
        }
    }

    /// The VM with this id.
    pub fn vm(&self, id: &str) -> Option<VmInfo> {
        self.lock().vms.get(id).map(|v| v.info.clone())
    }

    /// Every VM.
    pub fn vms(&self) -> Vec<VmInfo> {
        self.lock().vms.values().map(|v| v.info.clone()).collect()
    }

    /// Where the VM came from: `run:<image>`, `clone:<repo:tag>` or `preexisting`.
    pub fn source_of(&self, id: &str) -> Option<String> {
        self.lock().vms.get(id).map(|v| v.source.clone())
    }

    /// Snapshot → the name of the VM it was saved from.
    pub fn snapshots(&self) -> BTreeMap<SnapshotRef, String> {
        self.lock().snapshots.iter().map(|(k, (vm, _))| (k.clone(), vm.clone())).collect()
    }

    /// The namespace a snapshot records (`None`: absent, or saved without one).
    pub fn snapshot_namespace(&self, snapshot: &SnapshotRef) -> Option<String> {
        self.lock().snapshots.get(snapshot).and_then(|(_, ns)| ns.clone())
    }

    /// VM ids holding a network lease.
    pub fn leases(&self) -> BTreeSet<String> {
        self.lock().leases.keys().cloned().collect()
    }

    /// The next `times` calls of `remove` kill the hypervisor (the VM is `Stopped`) and then
    /// fail, as a remove whose TAP or record deletion failed does.
    pub fn fail_remove_after_stop(&self, times: u32) {
        self.lock().failures.insert("remove_after_stop", times);
    }

    fn new_vm(s: &mut FakeState, name: &str, namespace: Option<&str>, hypervisor: Hypervisor) -> VmInfo {
        s.next += 1;
        let n = s.next;
        let (id, ip) = (format!("vm-{n}"), (!s.no_ip).then(|| format!("10.88.0.{}", n % 250 + 2)));
        s.leases.insert(id.clone(), ip.clone());
        s.ids.insert(name.to_owned(), id.clone());
        VmInfo {
            id,
            name: name.to_owned(),
            namespace: namespace.map(str::to_owned),
            ip,
            state: VmState::Running,
            hypervisor,
        }
    }

    /// Takes one injected failure of `op`, if one is due.
    fn due(s: &mut FakeState, op: &'static str) -> bool {
        match s.failures.get_mut(op) {
            Some(n) if *n > 0 => {
                if *n != u32::MAX {
                    *n -= 1;
                }
                true
            }
            _ => false,
        }
    }

    /// Logs the call and answers an injected failure, if one is due.
    fn enter(&self, s: &mut FakeState, op: &'static str, arg: &str) -> Result<(), BackendError> {
        if !matches!(op, "probe_agent" | "list" | "inspect" | "snapshot_inspect" | "base_image_of" | "library") {
            s.calls.push(format!("{op} {arg}"));
        }
        if Self::due(s, op) {
            return Err(BackendError::failed(op, arg, Injected));
        }
        Ok(())
    }

    /// A new VM; with `keep_lease`, under the id of its name and the lease that id holds
    /// (a wake), when there is one.
    fn create(
        &self,
        name: &str,
        namespace: &str,
        hypervisor: Hypervisor,
        source: String,
        keep_lease: bool,
    ) -> Result<VmInfo, BackendError> {
        let mut s = self.lock();
        if let Some(v) = s.vms.values().find(|v| v.info.name == name) {
            return Err(BackendError::NameInUse { name: name.to_owned(), id: v.info.id.clone() });
        }
        if !self.hypervisors.contains(&hypervisor) {
            return Err(BackendError::Unsupported { what: format!("hypervisor {hypervisor}") });
        }
        let kept = s.ids.get(name).filter(|_| keep_lease).and_then(|id| Some((id.clone(), s.leases.get(id)?.clone())));
        let info = match kept {
            Some((id, ip)) => VmInfo {
                id,
                name: name.to_owned(),
                namespace: Some(namespace.to_owned()),
                ip,
                state: VmState::Running,
                hypervisor,
            },
            None => Self::new_vm(&mut s, name, Some(namespace), hypervisor),
        };
        s.vms.insert(info.id.clone(), FakeVm { info: info.clone(), agent_ok: true, source });
        Ok(info)
    }
}

#[async_trait::async_trait]
impl VmBackend for FakeBackend {
    fn hypervisors(&self) -> Vec<Hypervisor> {
        self.hypervisors.clone()
    }

    async fn run(&self, req: &RunRequest) -> Result<VmInfo, BackendError> {
        {
            let mut s = self.lock();
            let arg = format!("{} {} {}x{}", req.name, req.image, req.vcpus, req.memory_mib);
            self.enter(&mut s, "run", &arg)?;
        }
        let vm = self.create(&req.name, &req.namespace, req.hypervisor, format!("run:{}", req.image), false)?;
        self.lock().vm_bases.insert(vm.id.clone(), req.image.clone());
        Ok(vm)
    }

    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmInfo, BackendError> {
        {
            let mut s = self.lock();
            self.enter(&mut s, "clone_vm", &format!("{} {}", req.name, req.snapshot))?;
            if !s.snapshots.contains_key(&req.snapshot) {
                return Err(BackendError::NotFound { what: format!("snapshot {}", req.snapshot) });
            }
        }
        let vm =
            self.create(&req.name, &req.namespace, req.hypervisor, format!("clone:{}", req.snapshot), req.keep_lease)?;
        let mut s = self.lock();
        match s.snapshot_bases.get(&req.snapshot).cloned() {
            Some(base) => s.vm_bases.insert(vm.id.clone(), base),
            None => s.vm_bases.remove(&vm.id),
        };
        Ok(vm)
    }

    async fn configure_network(&self, id: &str) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "configure_network", id)?;
        match s.vms.get(id) {
            Some(v) if v.info.state == VmState::Running && v.agent_ok => Ok(()),
            Some(_) => Err(BackendError::failed("configure_network", id, Injected)),
            None => Err(BackendError::NotFound { what: format!("VM {id}") }),
        }
    }

    fn vm_id_of(&self, name: &str) -> Option<String> {
        self.lock().ids.get(name).cloned()
    }

    fn network_hint(&self, vm: &VmInfo) -> Option<String> {
        vm.ip.as_ref().map(|ip| format!("/.chrysalis/guest-init net-config {ip}/24 10.88.0.1 02:00:00:00:00:01"))
    }

    async fn inspect(&self, id: &str) -> Result<Option<VmInfo>, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "inspect", id)?;
        Ok(s.vms.get(id).map(|v| v.info.clone()))
    }

    async fn list(&self) -> Result<Vec<VmInfo>, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "list", "")?;
        Ok(s.vms.values().map(|v| v.info.clone()).collect())
    }

    async fn start(&self, id: &str) -> Result<VmInfo, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "start", id)?;
        let v = s.vms.get_mut(id).ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        v.info.state = VmState::Running;
        Ok(v.info.clone())
    }

    async fn remove(&self, id: &str) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "remove", id)?;
        if Self::due(&mut s, "remove_after_stop") {
            if let Some(v) = s.vms.get_mut(id) {
                v.info.state = VmState::Stopped;
            }
            return Err(BackendError::failed("remove", id, Injected));
        }
        s.vms.remove(id);
        Ok(())
    }

    async fn snapshot_save(&self, id: &str, snapshot: &SnapshotRef, namespace: &str) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "snapshot_save", &format!("{id} {snapshot}"))?;
        let name = match s.vms.get(id) {
            Some(v) if v.info.state == VmState::Running => v.info.name.clone(),
            Some(_) => return Err(BackendError::failed("snapshot_save", id, Injected)),
            None => return Err(BackendError::NotFound { what: format!("VM {id}") }),
        };
        s.snapshots.insert(snapshot.clone(), (name, Some(namespace.to_owned())));
        match s.vm_bases.get(id).cloned() {
            Some(base) => s.snapshot_bases.insert(snapshot.clone(), base),
            None => s.snapshot_bases.remove(snapshot),
        };
        s.created.insert(snapshot.clone(), std::time::SystemTime::now());
        Self::new_content(&mut s, snapshot);
        Ok(())
    }

    async fn snapshot_inspect(&self, snapshot: &SnapshotRef) -> Result<Option<SnapshotInfo>, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "snapshot_inspect", &snapshot.to_string())?;
        let base_image = s.snapshot_bases.get(snapshot).cloned();
        Ok(s.snapshots.get(snapshot).map(|(_, ns)| SnapshotInfo { namespace: ns.clone(), base_image }))
    }

    async fn base_image_of(&self, source: &str) -> Result<Option<String>, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "base_image_of", source)?;
        // A snapshot of the library names its base; any other name is an image of itself.
        match source.parse::<SnapshotRef>().ok().filter(|r| s.snapshots.contains_key(r)) {
            Some(r) => Ok(s.snapshot_bases.get(&r).cloned()),
            None => Ok(Some(source.to_owned())),
        }
    }

    async fn snapshot_rm(&self, snapshot: &SnapshotRef) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "snapshot_rm", &snapshot.to_string())?;
        s.snapshots.remove(snapshot);
        s.snapshot_bases.remove(snapshot);
        s.contents.remove(snapshot);
        Ok(())
    }

    async fn snapshot_rm_if(&self, snapshot: &SnapshotRef, expected: &str) -> Result<bool, BackendError> {
        self.run_hook("snapshot_rm_if");
        let mut s = self.lock();
        self.enter(&mut s, "snapshot_rm_if", &format!("{snapshot} {expected}"))?;
        if s.contents.get(snapshot).map(u64::to_string).as_deref() != Some(expected) {
            return Ok(false);
        }
        s.snapshots.remove(snapshot);
        s.snapshot_bases.remove(snapshot);
        s.contents.remove(snapshot);
        Ok(true)
    }

    async fn library(&self) -> Result<Library, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "library", "")?;
        let snapshots = s
            .snapshots
            .iter()
            .map(|(r, (_, ns))| SnapshotEntry {
                reference: r.clone(),
                namespace: ns.clone(),
                created: s.created.get(r).copied().unwrap_or_else(std::time::SystemTime::now),
                disk_bytes: 1 << 20,
                in_use: s.vms.values().any(|v| v.source == format!("clone:{r}")),
                content: s.contents.get(r).map(u64::to_string).unwrap_or_default(),
            })
            .collect();
        Ok(Library { snapshots, image_disk_bytes: 8 << 20 })
    }

    async fn collect_garbage(&self) -> Result<u64, BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "collect_garbage", "")?;
        s.collections += 1;
        Ok(0)
    }

    async fn probe_agent(&self, id: &str) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "probe_agent", id)?;
        match s.vms.get(id) {
            Some(v) if v.info.state == VmState::Running && v.agent_ok => Ok(()),
            _ => Err(BackendError::failed("probe_agent", id, Injected)),
        }
    }

    async fn release_ip(&self, id: &str) -> Result<(), BackendError> {
        let mut s = self.lock();
        self.enter(&mut s, "release_ip", id)?;
        s.leases.remove(id);
        Ok(())
    }

    async fn usage(&self, ids: &[String]) -> Result<Vec<(String, crate::backend::VmUsage)>, BackendError> {
        let s = self.lock();
        Ok(ids.iter().filter_map(|id| s.usage.get(id).map(|u| (id.clone(), *u))).collect())
    }
}

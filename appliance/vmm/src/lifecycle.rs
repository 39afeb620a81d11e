//! The VM lifecycle record: how a driver never loses track of a hypervisor it started.
//!
//! Every VM directory `<state_dir>/vms/<id>/` holds its `vm.json` ([`VmRecord`]) from the moment
//! the directory exists, before any process is spawned:
//!
//! 1. **`creating`, no pid** — written right after `mkdir`, with the [`Owner`] (pid + start time
//!    of the process running the driver call);
//! 2. **`creating`, pid** — rewritten as soon as the hypervisor process exists (QEMU: right after
//!    the daemonizing parent returned and the pid file was read; cloud-hypervisor: right after
//!    `fork`);
//! 3. **`running`** — rewritten when the boot or restore completed; the owner is dropped, the
//!    record now lives exactly as long as its hypervisor pid.
//!
//! A record is [`Liveness::Live`] when its hypervisor pid (by pid + start time) runs; a
//! `creating` record is also live while its owner runs (a boot in flight) or while the
//! [`Finder`] finds a process of the VM: one naming the VM directory on its command line (the
//! pid file's pid, or a `/proc` scan) or one in the VM's cgroup leaf (a spawned child writes
//! itself in before its exec). That covers a hypervisor whose pid was never recorded because
//! the owner was `kill -9`ed in between; a child whose spawner died before its exec does not
//! exec at all (`jail::SpawnPlan::parent`).
//!
//! **Dead records** (not live) are *omitted* by `Driver::list` and removed by an explicit
//! `Driver::prune` ([`prune`]); a directory some live process names is never removed. So a
//! restarted owner sees every VM whose hypervisor may still run — `creating` ones included — and
//! can kill them (`Driver::kill` works without a recorded pid: [`vm_processes`]).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::driver::{Backend, DriverError, Vm, VmId, VmState};
use crate::jail::cgroup::CgroupLayout;
use crate::record::{self, RecordError, VM_JSON};

/// How old a VM directory without any record must be before [`prune`] removes it (a driver call
/// writes the record right after `mkdir`; only a crash in between leaves such a directory).
pub const PRUNE_GRACE: Duration = Duration::from_secs(60);

/// Where a driver looks for a VM's processes besides its recorded pid. The processes naming
/// the VM directory are always looked for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Finder<'a> {
    /// The hypervisor's pid file name inside the VM directory, if it writes one.
    pub pidfile: Option<&'a str>,
    /// The cgroups holding the VMs' leaves (one per VM, named by its id), if jailed.
    pub cgroups: Option<&'a CgroupLayout>,
}

impl Finder<'_> {
    /// The live processes in the cgroup leaf of the VM in `dir`.
    fn in_leaf(&self, dir: &Path) -> Vec<(u32, u64)> {
        let (Some(cgroups), Some(id)) = (self.cgroups, dir.file_name().and_then(|n| n.to_str())) else {
            return Vec::new();
        };
        let alive = |pid: u32| record::pid_start_time(pid).filter(|st| record::is_alive(pid, *st)).map(|st| (pid, st));
        cgroups.leaf_of(id).processes().into_iter().filter_map(alive).collect()
    }

    /// Every live process of the VM in `dir` found without its record.
    fn unrecorded(&self, dir: &Path) -> Vec<(u32, u64)> {
        let mut out: Vec<(u32, u64)> = self.pidfile.and_then(|f| pidfile_process(dir, f)).into_iter().collect();
        out.extend(processes_naming(dir));
        out.extend(self.in_leaf(dir));
        out
    }
}

/// The process running the driver call that creates a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// Its pid.
    pub pid: u32,
    /// Its start time (clock ticks since boot), against pid reuse.
    pub start_time: u64,
}

impl Owner {
    /// This process.
    pub fn current() -> Self {
        let pid = std::process::id();
        // Our own /proc entry exists while we run; 0 only if /proc is not mounted, and then
        // no liveness check works anyway.
        Owner { pid, start_time: record::pid_start_time(pid).unwrap_or(0) }
    }

    /// Whether the owner still runs.
    pub fn is_alive(&self) -> bool {
        record::is_alive(self.pid, self.start_time)
    }
}

/// `vm.json`: the [`Vm`] plus, while it is `creating`, its [`Owner`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// The VM (its `state` is the lifecycle state).
    #[serde(flatten)]
    pub vm: Vm,
    /// The process creating it; `None` once `running`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
}

/// Whether a record may still have a running process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The hypervisor runs, or (while `creating`) its owner or a process naming the directory does.
    Live,
    /// Nothing runs for it: stale state, removed by [`prune`].
    Dead,
}

impl VmRecord {
    /// Step 1: a `creating` record without a pid, owned by this process.
    pub fn creating(mut vm: Vm) -> Self {
        vm.state = VmState::Creating;
        vm.pid = 0;
        vm.pid_start_time = 0;
        VmRecord { vm, owner: Some(Owner::current()) }
    }

    /// Step 2: the hypervisor process exists.
    pub fn spawned(&mut self, pid: u32, start_time: u64) -> Result<(), DriverError> {
        if self.vm.state != VmState::Creating || self.vm.pid != 0 {
            return Err(self.bad_transition("record a hypervisor pid"));
        }
        self.vm.pid = pid;
        self.vm.pid_start_time = start_time;
        Ok(())
    }

    /// Step 3: the boot or restore completed.
    pub fn running(&mut self) -> Result<(), DriverError> {
        if self.vm.state != VmState::Creating || self.vm.pid == 0 {
            return Err(self.bad_transition("mark running"));
        }
        self.vm.state = VmState::Running;
        self.owner = None;
        Ok(())
    }

    fn bad_transition(&self, what: &str) -> DriverError {
        DriverError::Invalid(format!(
            "vm {}: cannot {what} in state {:?} (pid {})",
            self.vm.id, self.vm.state, self.vm.pid
        ))
    }

    /// Writes `<vm.dir>/vm.json` atomically.
    pub fn store(&self) -> Result<(), DriverError> {
        Ok(record::write_json_atomic(&self.vm.dir.join(VM_JSON), self)?)
    }

    /// Reads `<dir>/vm.json`; `None` if there is none.
    pub fn load(dir: &Path) -> Result<Option<Self>, DriverError> {
        match record::read_json(&dir.join(VM_JSON)) {
            Ok(r) => Ok(Some(r)),
            Err(RecordError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether anything may still run for this record (see the module docs).
    pub fn liveness(&self, find: &Finder) -> Liveness {
        let vm = &self.vm;
        if record::is_alive(vm.pid, vm.pid_start_time) {
            return Liveness::Live;
        }
        if vm.state == VmState::Running {
            return Liveness::Dead;
        }
        if self.owner.is_some_and(|o| o.is_alive()) || !find.unrecorded(&vm.dir).is_empty() {
            Liveness::Live
        } else {
            Liveness::Dead
        }
    }
}

/// Prefix of the staging directory a VM directory is built in before it appears under its id.
const STAGING_PREFIX: &str = ".staging-";

/// Creates `<vms_dir>/<id>/` (which must not exist) holding `rec`, atomically: the record is
/// written into a hidden staging directory `.staging-<id>.<our pid>` that is then renamed into
/// place, so a VM directory never exists without its record (a `kill -9` in between leaves
/// only a staging directory, which [`prune`] removes once its owner is dead).
/// On failure nothing is left behind.
pub fn create_vm_dir(rec: &VmRecord) -> Result<(), DriverError> {
    let dir = &rec.vm.dir;
    let parent = dir.parent().ok_or_else(|| DriverError::Invalid(format!("vm dir {} has no parent", dir.display())))?;
    std::fs::create_dir_all(parent).map_err(|e| DriverError::io(format!("creating {}", parent.display()), e))?;
    if dir.exists() {
        return Err(DriverError::Invalid(format!("vm {} already exists at {}", rec.vm.id, dir.display())));
    }
    let staging = parent.join(format!("{STAGING_PREFIX}{}.{}", rec.vm.id, std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    // 0700: the VM user (shared by every VM) reaches nothing in it; the driver hands the
    // hypervisor descriptors instead.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .map_err(|e| DriverError::io(format!("creating {}", staging.display()), e))?;
    let stored = record::write_json_atomic(&staging.join(VM_JSON), rec).map_err(DriverError::from).and_then(|()| {
        std::fs::rename(&staging, dir).map_err(|e| match e.raw_os_error() {
            Some(libc::EEXIST) | Some(libc::ENOTEMPTY) => {
                DriverError::Invalid(format!("vm {} already exists at {}", rec.vm.id, dir.display()))
            }
            _ => DriverError::io(format!("renaming {} to {}", staging.display(), dir.display()), e),
        })
    });
    if let Err(e) = stored {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    Ok(())
}

/// The owner pid of a staging directory name `.staging-<id>.<pid>`.
fn staging_owner(name: &str) -> Option<u32> {
    name.strip_prefix(STAGING_PREFIX)?.rsplit_once('.')?.1.parse().ok()
}

/// The record on disk for `vm` if it is the same VM (it may have advanced since `vm` was
/// listed, e.g. gained a pid), else `vm` as given.
pub fn freshest(vm: &Vm) -> Vm {
    match VmRecord::load(&vm.dir) {
        Ok(Some(r)) if r.vm.id == vm.id && r.vm.dir == vm.dir && r.vm.backend == vm.backend => r.vm,
        _ => vm.clone(),
    }
}

/// `/proc/<pid>/cmdline` split into arguments.
fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect())
}

/// Whether an argument names a path inside `dir` (`<dir>/…`, also inside `unix:<dir>/x,…`).
fn names_dir(argv: &[String], dir: &Path) -> bool {
    let prefix = format!("{}/", dir.display());
    argv.iter().any(|a| a.contains(&prefix))
}

/// The live process in `<dir>/<pidfile>` if its command line names `dir` (so a stale pid
/// file whose pid was reused by an unrelated process is never trusted).
pub fn pidfile_process(dir: &Path, pidfile: &str) -> Option<(u32, u64)> {
    let pid: u32 = std::fs::read_to_string(dir.join(pidfile)).ok()?.trim().parse().ok()?;
    let st = record::pid_start_time(pid)?;
    (record::is_alive(pid, st) && cmdline(pid).is_some_and(|a| names_dir(&a, dir))).then_some((pid, st))
}

/// Live processes (not us) whose command line names a path inside `dir`.
pub fn processes_naming(dir: &Path) -> Vec<(u32, u64)> {
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me || !cmdline(pid).is_some_and(|a| names_dir(&a, dir)) {
            continue;
        }
        if let Some(st) = record::pid_start_time(pid).filter(|st| record::is_alive(pid, *st)) {
            out.push((pid, st));
        }
    }
    out
}

/// Every live process that belongs to the VM in `dir`: the recorded hypervisor pid, the pid in
/// its pid file (verified), any process naming `dir` and any in its cgroup leaf — all but the
/// first matter for a VM whose pid was never recorded.
pub fn vm_processes(dir: &Path, recorded: Option<(u32, u64)>, find: &Finder) -> Vec<(u32, u64)> {
    let mut out: Vec<(u32, u64)> = recorded.filter(|(p, st)| record::is_alive(*p, *st)).into_iter().collect();
    out.extend(find.unrecorded(dir));
    out.sort_unstable();
    out.dedup();
    out
}

/// SIGKILLs `procs` and waits for all of them to go; true if all are gone within `timeout`.
pub async fn kill_all(procs: &[(u32, u64)], timeout: Duration) -> bool {
    for (pid, st) in procs {
        record::signal(*pid, *st, libc::SIGKILL);
    }
    let mut all = true;
    for (pid, st) in procs {
        all &= record::wait_gone(*pid, *st, timeout).await;
    }
    all
}

/// The same as [`kill_all`], blocking (for `Drop` guards).
pub fn kill_all_blocking(procs: &[(u32, u64)], timeout: Duration) -> bool {
    for (pid, st) in procs {
        record::signal(*pid, *st, libc::SIGKILL);
    }
    let deadline = std::time::Instant::now() + timeout;
    while procs.iter().any(|(p, st)| record::is_alive(*p, *st)) {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The records of `backend` under `vms_dir` with their liveness. Directories without a record
/// are skipped; an unreadable record is an error.
pub fn scan(vms_dir: &Path, backend: Backend, find: &Finder) -> Result<Vec<(VmRecord, Liveness)>, DriverError> {
    let mut out = Vec::new();
    for dir in vm_dirs(vms_dir)? {
        let Some(rec) = VmRecord::load(&dir)? else { continue };
        if rec.vm.backend != backend || rec.vm.dir != dir {
            continue;
        }
        let l = rec.liveness(find);
        out.push((rec, l));
    }
    out.sort_by(|a, b| a.0.vm.id.cmp(&b.0.vm.id));
    Ok(out)
}

/// The live VMs of `backend` under `vms_dir` (for `Driver::list`).
pub fn list(vms_dir: &Path, backend: Backend, find: &Finder) -> Result<Vec<Vm>, DriverError> {
    Ok(scan(vms_dir, backend, find)?.into_iter().filter(|(_, l)| *l == Liveness::Live).map(|(r, _)| r.vm).collect())
}

/// Removes the directories of dead records of `backend` under `vms_dir`, and VM directories
/// holding no record that are older than `grace` and named by no process. Returns the ids
/// removed. A directory a live process names is never removed.
pub fn prune(vms_dir: &Path, backend: Backend, find: &Finder, grace: Duration) -> Result<Vec<VmId>, DriverError> {
    let mut removed = Vec::new();
    for dir in vm_dirs(vms_dir)? {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if let Some(owner) = staging_owner(&name) {
            // A VM directory its creator never finished: gone for good once the creator is.
            if std::path::Path::new(&format!("/proc/{owner}")).exists() {
                continue;
            }
            tracing::info!(dir = %dir.display(), "pruned an unfinished VM directory");
            let _ = std::fs::remove_dir_all(&dir);
            continue;
        }
        let Some(id) = VmId::new(name).ok() else { continue };
        let stale = match VmRecord::load(&dir) {
            Ok(Some(rec)) => rec.vm.backend == backend && rec.liveness(find) == Liveness::Dead,
            Ok(None) => older_than(&dir, grace),
            Err(e) => {
                tracing::warn!(vm = %id, error = %crate::error_chain(&e), "prune: unreadable record; keeping it");
                false
            }
        };
        // Never remove a directory a live process still names or whose leaf holds one,
        // whatever its record says.
        if !stale || !processes_naming(&dir).is_empty() || !find.in_leaf(&dir).is_empty() {
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::info!(vm = %id, dir = %dir.display(), "pruned a dead VM record");
                removed.push(id);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(DriverError::io(format!("removing {}", dir.display()), e)),
        }
    }
    Ok(removed)
}

fn older_than(dir: &Path, grace: Duration) -> bool {
    std::fs::metadata(dir)
        .and_then(|m| m.modified())
        .map(|t| SystemTime::now().duration_since(t).unwrap_or_default() >= grace)
        .unwrap_or(false)
}

/// The subdirectories of `vms_dir` (none if it does not exist).
fn vm_dirs(vms_dir: &Path) -> Result<Vec<PathBuf>, DriverError> {
    let entries = match std::fs::read_dir(vms_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DriverError::io(format!("listing {}", vms_dir.display()), e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DriverError::io(format!("listing {}", vms_dir.display()), e))?;
        if entry.file_type().map_err(|e| DriverError::io(format!("listing {}", vms_dir.display()), e))?.is_dir() {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    const NONE: Finder = Finder { pidfile: None, cgroups: None };
    const PIDFILE: Finder = Finder { pidfile: Some("qemu.pid"), cgroups: None };

    fn vm(vms: &Path, id: &str) -> Vm {
        crate::test_utils::vm(vms, id, VmState::Running)
    }

    /// A shell whose `$0` names `dir` (like a hypervisor naming its VM directory); it waits
    /// on its stdin, so killing it leaves nothing behind. Returned once it has exec'd: until
    /// then its `/proc/<pid>/cmdline` is still ours, and it would not name the dir.
    fn naming_process(dir: &Path) -> Child {
        let child = Command::new("sh")
            .args(["-c", "read x", &dir.join("qemu.pid").display().to_string()])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cmdline(child.id()).is_some_and(|a| names_dir(&a, dir)) {
            assert!(std::time::Instant::now() < deadline, "sh did not exec within 10 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child
    }

    fn dead_pid() -> (u32, u64) {
        let mut c = Command::new("true").spawn().expect("spawn true");
        let pid = c.id();
        let st = record::pid_start_time(pid).unwrap_or(1);
        c.wait().expect("wait");
        (pid, st)
    }

    fn stop(mut c: Child) {
        let _ = c.kill();
        let _ = c.wait();
    }

    #[test]
    fn state_machine_creating_spawned_running() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut rec = VmRecord::creating(vm(tmp.path(), "a"));
        assert_eq!(rec.vm.state, VmState::Creating);
        assert_eq!((rec.vm.pid, rec.owner), (0, Some(Owner::current())));
        assert!(rec.running().is_err(), "no running without a pid");
        create_vm_dir(&rec).expect("create");
        assert!(matches!(create_vm_dir(&rec), Err(DriverError::Invalid(_))), "ids are unique");
        let on_disk: serde_json::Value = record::read_json(&rec.vm.dir.join(VM_JSON)).expect("json");
        assert_eq!(on_disk["state"], "creating");
        assert_eq!(on_disk["owner"]["pid"], std::process::id());

        let me = Owner::current();
        rec.spawned(me.pid, me.start_time).expect("spawned");
        assert!(rec.spawned(me.pid, me.start_time).is_err(), "pid is recorded once");
        rec.store().expect("store");
        assert_eq!(VmRecord::load(&rec.vm.dir).expect("load"), Some(rec.clone()));
        rec.running().expect("running");
        assert_eq!((rec.vm.state, rec.owner), (VmState::Running, None));
        assert!(rec.running().is_err() && rec.spawned(1, 1).is_err(), "running is final");
        rec.store().expect("store");
        let on_disk: serde_json::Value = record::read_json(&rec.vm.dir.join(VM_JSON)).expect("json");
        assert_eq!(on_disk["state"], "running");
        assert!(on_disk.get("owner").is_none());
        // Plain `Vm` readers (older code) still read the record.
        let plain: Vm = record::read_json(&rec.vm.dir.join(VM_JSON)).expect("as Vm");
        assert_eq!(plain, rec.vm);
    }

    #[test]
    fn records_without_state_load_as_running() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut v = serde_json::to_value(vm(tmp.path(), "old")).expect("json");
        v.as_object_mut().expect("object").remove("state");
        let parsed: VmRecord = serde_json::from_value(v).expect("old vm.json");
        assert_eq!(parsed.vm.state, VmState::Running);
        assert_eq!(parsed.owner, None);
    }

    #[test]
    fn liveness_of_each_state() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let me = Owner::current();
        let (dpid, dst) = dead_pid();
        let dead_owner = Owner { pid: dpid, start_time: dst };

        // running: only the hypervisor pid counts.
        let mut running = VmRecord { vm: vm(tmp.path(), "r"), owner: None };
        running.vm.pid = me.pid;
        running.vm.pid_start_time = me.start_time;
        assert_eq!(running.liveness(&NONE), Liveness::Live);
        running.vm.pid_start_time += 1;
        assert_eq!(running.liveness(&NONE), Liveness::Dead, "pid reuse is not life");

        // creating, no pid: live while the owner runs.
        let mut creating = VmRecord::creating(vm(tmp.path(), "c"));
        assert_eq!(creating.liveness(&PIDFILE), Liveness::Live);
        creating.owner = Some(dead_owner);
        assert_eq!(creating.liveness(&PIDFILE), Liveness::Dead);

        // ... or while a process names its directory (found through the pid file or by scan).
        std::fs::create_dir_all(&creating.vm.dir).expect("mkdir");
        let child = naming_process(&creating.vm.dir);
        std::fs::write(creating.vm.dir.join("qemu.pid"), format!("{}\n", child.id())).expect("pidfile");
        let st = record::pid_start_time(child.id()).expect("start time");
        assert_eq!(pidfile_process(&creating.vm.dir, "qemu.pid"), Some((child.id(), st)));
        assert_eq!(creating.liveness(&PIDFILE), Liveness::Live);
        assert_eq!(creating.liveness(&NONE), Liveness::Live, "found by the /proc scan");
        assert_eq!(vm_processes(&creating.vm.dir, None, &PIDFILE), vec![(child.id(), st)]);
        stop(child);
        assert_eq!(creating.liveness(&PIDFILE), Liveness::Dead);

        // A pid file naming a process that does not name the dir (pid reuse) is not trusted.
        std::fs::write(creating.vm.dir.join("qemu.pid"), format!("{}\n", me.pid)).expect("pidfile");
        assert_eq!(pidfile_process(&creating.vm.dir, "qemu.pid"), None);
        assert_eq!(creating.liveness(&PIDFILE), Liveness::Dead);

        // creating with a live recorded pid.
        creating.vm.pid = me.pid;
        creating.vm.pid_start_time = me.start_time;
        assert_eq!(creating.liveness(&NONE), Liveness::Live);
    }

    /// A `creating` record whose owner died before recording the pid, and whose process has
    /// not exec'd the hypervisor yet (so nothing names the directory), is live while its cgroup
    /// leaf holds a process; the kill finds that process there, and prune keeps the directory.
    #[test]
    fn a_process_in_the_vm_leaf_keeps_a_creating_record_live() {
        use crate::jail::cgroup::{CgroupLayout, Limits};
        let parent = format!("chrysalis-lifecycle-test-{}", std::process::id());
        let Ok(layout) = CgroupLayout::detect(Some(&parent)) else {
            foundation::testing::skip("no cgroup hierarchy here");
            return;
        };
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut rec = VmRecord::creating(vm(tmp.path(), "in-leaf"));
        let (dpid, dst) = dead_pid();
        rec.owner = Some(Owner { pid: dpid, start_time: dst });
        create_vm_dir(&rec).expect("create");
        let Ok(leaf) = layout.create_leaf("in-leaf", &Limits::for_vm(crate::SizeClass::Small, crate::Accel::Kvm))
        else {
            foundation::testing::skip("cannot create cgroups here (not root?)");
            return;
        };
        let find = Finder { pidfile: Some("qemu.pid"), cgroups: Some(&layout) };
        assert_eq!(rec.liveness(&find), Liveness::Dead, "an empty leaf is no life");
        // A child that names nothing, moved into the leaf the way a spawned child moves itself.
        let child = Command::new("sh").args(["-c", "read x"]).stdin(std::process::Stdio::piped()).spawn().expect("sh");
        for procs in leaf.dirs().iter().map(|d| d.join("cgroup.procs")) {
            std::fs::write(procs, child.id().to_string()).expect("move into the leaf");
        }
        let st = record::pid_start_time(child.id()).expect("start time");
        assert_eq!(rec.liveness(&PIDFILE), Liveness::Dead, "nothing names the directory");
        assert_eq!(rec.liveness(&find), Liveness::Live);
        assert_eq!(vm_processes(&rec.vm.dir, None, &find), vec![(child.id(), st)]);
        assert_eq!(ids(list(tmp.path(), Backend::Qemu, &find).expect("list")), ["in-leaf"]);
        assert!(prune(tmp.path(), Backend::Qemu, &find, Duration::ZERO).expect("prune").is_empty());
        assert!(rec.vm.dir.is_dir(), "prune keeps a directory whose leaf holds a process");
        stop(child);
        assert_eq!(rec.liveness(&find), Liveness::Dead);
        leaf.remove();
        for d in leaf.dirs() {
            let _ = d.parent().map(std::fs::remove_dir);
        }
    }

    fn ids(v: Vec<Vm>) -> Vec<String> {
        v.into_iter().map(|v| v.id.to_string()).collect()
    }

    #[test]
    fn list_and_prune_keep_everything_that_may_run() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let vms = tmp.path().join("vms");
        let (dpid, dst) = dead_pid();
        let me = Owner::current();

        // Live running VM (its "hypervisor" is us).
        let mut live = VmRecord::creating(vm(&vms, "live"));
        create_vm_dir(&live).expect("create");
        live.spawned(me.pid, me.start_time).expect("spawned");
        live.running().expect("running");
        live.store().expect("store");
        // Running VM whose hypervisor died.
        let mut gone = VmRecord { vm: vm(&vms, "gone"), owner: None };
        gone.vm.pid = dpid;
        gone.vm.pid_start_time = dst;
        create_vm_dir(&gone).expect("create");
        // Half-created VM whose owner died before spawning anything.
        let mut orphan = VmRecord::creating(vm(&vms, "orphan"));
        orphan.owner = Some(Owner { pid: dpid, start_time: dst });
        create_vm_dir(&orphan).expect("create");
        // Half-created VM whose owner died but whose unrecorded process still runs.
        let mut leaked = VmRecord::creating(vm(&vms, "leaked"));
        leaked.owner = Some(Owner { pid: dpid, start_time: dst });
        create_vm_dir(&leaked).expect("create");
        let child = naming_process(&leaked.vm.dir);
        // A cloud-hypervisor record: another driver's business.
        let mut other = VmRecord { vm: vm(&vms, "other"), owner: None };
        other.vm.backend = Backend::CloudHypervisor;
        create_vm_dir(&other).expect("create");
        // A directory without a record (crash between mkdir and the first write), and a
        // fresh one (maybe a boot that is about to write it).
        std::fs::create_dir_all(vms.join("norecord")).expect("mkdir");

        assert_eq!(ids(list(&vms, Backend::Qemu, &PIDFILE).expect("list")), ["leaked", "live"]);
        let listed = list(&vms, Backend::Qemu, &NONE).expect("list");
        assert_eq!(listed[0].state, VmState::Creating);
        assert_eq!(listed[1].state, VmState::Running);

        let pruned = prune(&vms, Backend::Qemu, &PIDFILE, PRUNE_GRACE).expect("prune");
        assert_eq!(pruned.iter().map(|i| i.to_string()).collect::<Vec<_>>(), ["gone", "orphan"]);
        for keep in ["live", "leaked", "other", "norecord"] {
            assert!(vms.join(keep).is_dir(), "{keep} must survive prune");
        }
        let pruned = prune(&vms, Backend::Qemu, &PIDFILE, Duration::ZERO).expect("prune");
        assert_eq!(pruned.iter().map(|i| i.to_string()).collect::<Vec<_>>(), ["norecord"]);

        // Once the leaked process is gone, its record is dead too.
        stop(child);
        assert_eq!(ids(list(&vms, Backend::Qemu, &PIDFILE).expect("list")), ["live"]);
        assert_eq!(prune(&vms, Backend::Qemu, &NONE, PRUNE_GRACE).expect("prune").len(), 1);
        assert!(!vms.join("leaked").exists());
        assert!(vms.join("live").is_dir() && vms.join("other").is_dir());
    }
}

#[cfg(test)]
mod staging_tests {
    use super::*;

    #[test]
    fn staging_owner_parses_the_creator_pid() {
        assert_eq!(staging_owner(".staging-sbx-abc-12345678.4242"), Some(4242));
        assert_eq!(staging_owner("sbx-abc"), None);
        assert_eq!(staging_owner(".staging-x.notapid"), None);
    }

    #[test]
    fn unfinished_vm_dirs_of_a_dead_creator_are_pruned_and_a_live_ones_kept() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let vms = tmp.path();
        // pid 0x7ffffffe is far above pid_max, so no such process exists.
        let dead = vms.join(format!("{STAGING_PREFIX}vm-a.{}", 0x7fff_fffe_u32));
        let live = vms.join(format!("{STAGING_PREFIX}vm-b.{}", std::process::id()));
        std::fs::create_dir_all(&dead).expect("mkdir");
        std::fs::create_dir_all(&live).expect("mkdir");
        prune(vms, Backend::Qemu, &Finder::default(), Duration::from_secs(60)).expect("prune");
        assert!(!dead.exists(), "a dead creator's staging dir is removed");
        assert!(live.exists(), "a live creator's staging dir is kept");
    }
}

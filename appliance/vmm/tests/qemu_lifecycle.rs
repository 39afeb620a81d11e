//! QEMU process lifecycle without guest images: the microvm firmware alone, vCPUs paused.
//! Checks boot / list / attach after a driver restart / pause / snapshot / restore / shutdown /
//! kill, failed boots cleaning up, that a VM whose owner process was `kill -9`ed mid-boot or
//! mid-clone is listed (`creating`) and killable by the next owner, dead records pruned, and that
//! no QEMU process outlives any of it.
//! They boot real QEMU processes (microvm firmware only, no guest images), so they run under
//! `--features qemu-tests` (`cargo xtask test` enables it after installing QEMU); a plain
//! `cargo test` reports them as ignored, with the reason.

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::process::{Child, Command, Stdio};
use std::time::Instant;

use vmm::lifecycle::VmRecord;
use vmm::qemu::{QemuConfig, QemuDriver};
use vmm::{AccelPreference, AfterSnapshot, BootSpec, Driver, DriverError, SizeClass, Snapshot, VmId, VmState};

fn have_qemu() -> bool {
    std::process::Command::new("qemu-system-x86_64").arg("--version").output().is_ok_and(|o| o.status.success())
}

fn config(state: &Path) -> QemuConfig {
    QemuConfig {
        state_dir: state.to_path_buf(),
        accel: AccelPreference::Tcg,
        tsc_khz: Some(2_000_000),
        start_paused: true,
        firmware_only: true,
        ..QemuConfig::from_env()
    }
}

fn spec() -> BootSpec {
    BootSpec {
        overlay_bytes: None,
        name: "fw".into(),
        kernel: "/nonexistent/vmlinux".into(),
        initrd: "/nonexistent/initrd".into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        size: SizeClass::Small,
        accel: AccelPreference::Auto,
        nic: None,
        rng: true,
        volumes: true,
        ram: vmm::Ram::Anonymous,
    }
}

/// Pids of QEMU processes whose command line mentions `needle`.
fn qemu_pids_mentioning(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains("qemu-system") && cmd.contains(needle) && vmm::record::pid_state(pid).is_some_and(|s| s != 'Z')
        {
            out.push(pid);
        }
    }
    out
}

fn dirs_under(p: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(p).map(|r| r.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "qemu-tests"), ignore = "boots QEMU: run through `cargo xtask test`")]
async fn qemu_process_lifecycle() {
    assert!(have_qemu(), "qemu-system-x86_64 is not installed (cargo xtask prereqs installs it)");
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    let needle = state.display().to_string();
    let d = QemuDriver::new(config(&state));
    assert_eq!(d.accel(), vmm::Accel::Tcg);

    let vm = d.boot(&spec()).await.expect("boot firmware-only VM");
    assert!(vmm::record::is_alive(vm.pid, vm.pid_start_time));
    assert_jailed(vm.pid, SizeClass::Small);
    assert!(vm.dir.join("vm.json").is_file());
    assert!(vm.vsock_socket.exists(), "vsock bridge socket is served");
    assert_eq!(d.list().await.expect("list"), vec![vm.clone()]);

    // Our process "restarts": a new driver re-attaches from vm.json (QEMU is not our
    // daemonized grandchild any more but a child in its own session: it outlives the driver).
    drop(d);
    let d = QemuDriver::new(config(&state));
    let again = d.attach(&vm.id).await.expect("attach");
    assert_eq!(again, vm);
    d.pause(&vm).await.expect("pause");

    let snapdir = tmp.path().join("snap");
    let snap = d.snapshot(&vm, &snapdir, AfterSnapshot::Paused).await.expect("snapshot");
    assert!(snapdir.join("state").metadata().expect("state file").len() > 0);
    assert_eq!(vmm::Snapshot::load(&snapdir).expect("snapshot.json"), snap);

    let clone_id = VmId::new("clone-1").expect("id");
    let clone = d.restore(&snap, &clone_id).await.expect("restore");
    assert_eq!(clone.restored_from.as_deref(), Some(snapdir.as_path()));
    assert_eq!(d.list().await.expect("list").len(), 2);
    assert_eq!(qemu_pids_mentioning(&needle).len(), 2);
    assert_jailed(clone.pid, SizeClass::Small);
    let clone_cgroups = vmm::jail::inspect::process_jail(clone.pid).expect("clone status").cgroups;

    d.kill(&vm).await.expect("kill");
    assert!(!vmm::record::is_alive(vm.pid, vm.pid_start_time));
    assert!(!vm.dir.exists(), "kill removes the VM dir");
    assert!(matches!(d.attach(&vm.id).await, Err(DriverError::NotFound(_))));

    // The firmware ignores the power button: shutdown falls back to killing.
    d.shutdown(&clone, Duration::from_millis(300)).await.expect("shutdown");
    assert!(!vmm::record::is_alive(clone.pid, clone.pid_start_time));
    assert!(d.list().await.expect("list").is_empty());
    assert!(qemu_pids_mentioning(&needle).is_empty(), "no QEMU outlives shutdown/kill");
    if jail_expected() {
        for dir in clone_cgroups {
            assert!(!dir.exists(), "the VM's cgroup leaf {} is removed with it", dir.display());
        }
    }
}

/// Whether the driver jails QEMU here: root, the VM user exists, `CHRYSALIS_JAIL` not `0`.
fn jail_expected() -> bool {
    vmm::jail::JailSettings::from_env().resolve().is_ok_and(|j| j.is_some())
}

/// QEMU runs as the VM user, with no capabilities, seccomp filtering, no new privileges, in a
/// cgroup leaf with its size class's limits (TCG here).
fn assert_jailed(pid: u32, size: SizeClass) {
    let Ok(Some(jail)) = vmm::jail::JailSettings::from_env().resolve() else {
        eprintln!("the jail is off here (not root, no VM user, or CHRYSALIS_JAIL=0): only the sandbox is checked");
        let j = vmm::jail::inspect::process_jail(pid).expect("status");
        assert_eq!(j.seccomp, 2, "QEMU's seccomp sandbox is on");
        return;
    };
    let j = vmm::jail::inspect::process_jail(pid).expect("status");
    assert_eq!(j.uids, [jail.uid; 4], "QEMU runs as {}", jail.user);
    assert_eq!((j.cap_eff, j.cap_prm, j.cap_bnd), (0, 0, 0), "no capabilities");
    assert_eq!(j.seccomp, 2, "QEMU's seccomp sandbox is on");
    assert!(j.no_new_privs, "NoNewPrivs");
    assert_eq!(j.limits, Some(vmm::jail::Limits::for_vm(size, vmm::Accel::Tcg)), "cgroup limits of {:?}", j.cgroups);
    assert!(j.cgroups.iter().all(|d| d.ends_with(d.file_name().expect("leaf"))), "{:?}", j.cgroups);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "qemu-tests"), ignore = "boots QEMU: run through `cargo xtask test`")]
async fn failed_boots_leave_nothing_behind() {
    assert!(have_qemu(), "qemu-system-x86_64 is not installed (cargo xtask prereqs installs it)");
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    let needle = state.display().to_string();

    // Missing input file: refused before anything starts.
    let d = QemuDriver::new(config(&state));
    let mut s = spec();
    s.rootfs = Some(tmp.path().join("missing.erofs"));
    assert!(matches!(d.boot(&s).await, Err(DriverError::Invalid(_))));

    // QEMU itself fails (a kernel that is not a kernel): process and dir are cleaned up.
    let junk = tmp.path().join("junk-kernel");
    std::fs::write(&junk, b"not a kernel").expect("write");
    let d = QemuDriver::new(QemuConfig { firmware_only: false, ..config(&state) });
    let mut s = spec();
    s.kernel = junk.clone();
    s.initrd = junk;
    match d.boot(&s).await {
        // QEMU's own words reach the error (its output drained into the capped qemu.log).
        Err(DriverError::Spawn { detail, .. }) => assert!(detail.contains("qemu"), "{detail}"),
        other => panic!("expected a QEMU start failure, got {other:?}"),
    }
    assert!(dirs_under(&state.join("vms")).is_empty(), "failed boot removed its dir");
    assert!(qemu_pids_mentioning(&needle).is_empty(), "no QEMU outlives a failed boot");

    // Restoring a snapshot whose state file is garbage fails and cleans up too.
    let d = QemuDriver::new(config(&state));
    let vm = d.boot(&spec()).await.expect("boot");
    let snapdir = tmp.path().join("snap");
    let snap = d.snapshot(&vm, &snapdir, AfterSnapshot::Resumed).await.expect("snapshot");
    std::fs::write(snapdir.join("state"), b"garbage").expect("corrupt");
    let r = d.restore(&snap, &VmId::new("bad-clone").expect("id")).await;
    assert!(r.is_err(), "restore of a corrupt state must fail");
    assert!(!state.join("vms").join("bad-clone").exists());
    d.kill(&vm).await.expect("kill");
    assert!(qemu_pids_mentioning(&needle).is_empty(), "no QEMU outlives a failed restore");
}

/// Live (non-zombie) processes other than us whose command line mentions `needle`.
fn pids_mentioning(needle: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if pid != std::process::id() && cmd.contains(needle) && vmm::record::pid_state(pid).is_some_and(|s| s != 'Z') {
            out.push((pid, cmd));
        }
    }
    out
}

/// On drop (also when an assertion failed) SIGKILLs every process mentioning its needle, so a
/// failing run leaks no QEMU.
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        for (pid, _) in pids_mentioning(&self.0) {
            // SAFETY: kill(2) on a positive pid has no memory effects.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// Set in the environment of a re-run of this test binary that becomes the owner process of
/// `owner_killed_mid_create_leaves_a_listed_killable_vm`: `boot\t<state>\t<qemu>` or
/// `restore\t<state>\t<snapshot dir>\t<id>`.
const OWNER_ENV: &str = "VMM_TEST_OWNER_PROCESS";

/// Not a check of its own: `owner_killed_mid_create_leaves_a_listed_killable_vm` re-runs this
/// test binary with [`OWNER_ENV`] set, and then this is the driver's owner process, which that
/// test SIGKILLs while the boot or restore hangs. Without the variable it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "qemu-tests"), ignore = "boots QEMU: run through `cargo xtask test`")]
async fn owner_process_helper() {
    let Ok(job) = std::env::var(OWNER_ENV) else { return };
    let args: Vec<&str> = job.split('\t').collect();
    match args.as_slice() {
        ["boot", state, qemu] => {
            let d = QemuDriver::new(QemuConfig { qemu: qemu.into(), ..config(Path::new(state)) });
            let r = d.boot(&spec()).await;
            panic!("the owner should have been killed mid-boot, but boot returned {r:?}");
        }
        ["restore", state, snap, id] => {
            let d = QemuDriver::new(config(Path::new(state)));
            let snap = Snapshot::load(Path::new(snap)).expect("snapshot.json");
            let r = d.restore(&snap, &VmId::new(*id).expect("id")).await;
            panic!("the owner should have been killed mid-restore, but restore returned {r:?}");
        }
        other => panic!("bad {OWNER_ENV}: {other:?}"),
    }
}

/// Starts this test binary as an owner process running `job` (see [`OWNER_ENV`]).
fn spawn_owner(job: &str) -> Child {
    Command::new(std::env::current_exe().expect("current exe"))
        .args(["owner_process_helper", "--exact", "--nocapture", "--test-threads=1"])
        .env(OWNER_ENV, job)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn owner process")
}

/// Polls `<vm_dir>/vm.json` until `ready` holds, failing if the owner exits first.
fn wait_for_record(owner: &mut Child, vm_dir: &Path, ready: impl Fn(&VmRecord) -> bool) -> VmRecord {
    let deadline = Instant::now() + Duration::from_secs(25);
    loop {
        if let Some(status) = owner.try_wait().expect("try_wait") {
            panic!("owner process exited early: {status}");
        }
        if let Ok(Some(rec)) = VmRecord::load(vm_dir) {
            if ready(&rec) {
                return rec;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never reached the expected state: {:?}; processes naming it: {:?}",
            vm_dir.display(),
            VmRecord::load(vm_dir).ok().flatten().map(|r| (r.vm.state, r.vm.pid)),
            pids_mentioning(&vm_dir.display().to_string())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The only VM directory under `vms`, once there is one (a hidden `.staging-…` directory is the
/// VM before its rename into place: not it yet).
fn only_vm_dir(owner: &mut Child, vms: &Path) -> PathBuf {
    let deadline = Instant::now() + Duration::from_secs(25);
    loop {
        let staging = |d: &PathBuf| d.file_name().is_some_and(|n| n.to_string_lossy().starts_with(".staging-"));
        let dirs: Vec<PathBuf> = dirs_under(vms).into_iter().filter(|d| !staging(d)).collect();
        if dirs.len() == 1 {
            return dirs[0].clone();
        }
        assert!(dirs.len() < 2, "{dirs:?}");
        if let Some(status) = owner.try_wait().expect("try_wait") {
            panic!("owner process exited early: {status}");
        }
        assert!(Instant::now() < deadline, "no VM dir appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sigkill(mut owner: Child) {
    owner.kill().expect("SIGKILL the owner");
    owner.wait().expect("reap the owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "qemu-tests"), ignore = "boots QEMU: run through `cargo xtask test`")]
async fn owner_killed_mid_create_leaves_a_listed_killable_vm() {
    assert!(have_qemu(), "qemu-system-x86_64 is not installed (cargo xtask prereqs installs it)");
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    let vms = state.join("vms");
    let needle = format!("{}/", vms.display());
    let _reaper = Reaper(tmp.path().display().to_string());

    // 1. Owner killed while QEMU sets up (pid recorded, QMP not answering yet): a wrapper
    //    starts QEMU and stops it as soon as it has exec'ed (long before its QMP greets), so
    //    the owner waits for QMP until it is killed.
    let wrapper = tmp.path().join("slow-hypervisor");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nqemu-system-x86_64 \"$@\" &\nq=$!\n\
         until readlink /proc/$q/exe | grep -q qemu; do :; done\nkill -STOP $q\nwait\n",
    )
    .expect("write wrapper");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut owner = spawn_owner(&format!("boot\t{}\t{}", state.display(), wrapper.display()));
    let dir = only_vm_dir(&mut owner, &vms);
    // Wait until the pid (the wrapper's) is recorded and QEMU runs (stopped): the owner now
    // waits for QMP.
    let rec = wait_for_record(&mut owner, &dir, |r| {
        r.vm.state == VmState::Creating
            && r.vm.pid != 0
            && vmm::lifecycle::pidfile_process(&r.vm.dir, "qemu.pid").is_some()
            && qemu_pids_mentioning(&needle).len() == 1
    });
    sigkill(owner);
    assert_eq!(qemu_pids_mentioning(&needle).len(), 1, "QEMU outlives its owner");

    let d = QemuDriver::new(config(&state));
    let listed = d.list().await.expect("list");
    assert_eq!(listed.len(), 1, "the half-created VM is listed: {listed:?}");
    let vm = &listed[0];
    assert_eq!((vm.state, vm.pid, &vm.dir), (VmState::Creating, rec.vm.pid, &dir));
    assert!(matches!(d.attach(&vm.id).await, Err(DriverError::Invalid(_))), "a creating VM is not attachable");
    assert!(d.prune().await.expect("prune").is_empty(), "prune never removes a VM whose QEMU runs");
    assert!(dir.is_dir());
    d.kill(vm).await.expect("kill a creating VM without a recorded pid");
    assert!(!dir.exists(), "kill removes the dir");
    assert!(pids_mentioning(&needle).is_empty(), "no QEMU (nor wrapper) survives: {:?}", pids_mentioning(&needle));
    assert!(d.list().await.expect("list").is_empty());

    // 2. Owner killed mid-clone, pid recorded: the incoming migration reads a FIFO nobody writes.
    let src = d.boot(&spec()).await.expect("boot");
    let snapdir = tmp.path().join("snap");
    d.snapshot(&src, &snapdir, AfterSnapshot::Paused).await.expect("snapshot");
    d.kill(&src).await.expect("kill source");
    let fifo = snapdir.join("state");
    std::fs::remove_file(&fifo).expect("rm state");
    let st = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(st.success());
    // A writer that never writes: QEMU's read of the stream blocks (the driver opens it itself).
    let mut silent_writer =
        Some(std::fs::OpenOptions::new().read(true).write(true).open(&fifo).expect("hold the FIFO open"));

    // 2a. In-process: dropping the restore future mid-migration cleans up at once.
    let snap = Snapshot::load(&snapdir).expect("snapshot.json");
    let r = tokio::time::timeout(Duration::from_secs(3), d.restore(&snap, &VmId::new("dropped").expect("id"))).await;
    assert!(r.is_err(), "restore from a silent FIFO cannot finish: {r:?}");
    assert!(!vms.join("dropped").exists(), "the dropped restore removed its dir");
    assert!(qemu_pids_mentioning(&needle).is_empty(), "the dropped restore killed its QEMU");

    // 2b. Another process owns the restore and is SIGKILLed.
    let mut owner = spawn_owner(&format!("restore\t{}\t{}\torphan-clone", state.display(), snapdir.display()));
    let dir = vms.join("orphan-clone");
    let rec = wait_for_record(&mut owner, &dir, |r| r.vm.pid != 0);
    assert_eq!(rec.vm.state, VmState::Creating);
    assert!(rec.owner.is_some_and(|o| o.pid == owner.id()), "{rec:?}");
    sigkill(owner);
    assert!(vmm::record::is_alive(rec.vm.pid, rec.vm.pid_start_time), "QEMU outlives its owner");

    let d = QemuDriver::new(config(&state));
    let listed = d.list().await.expect("list");
    assert_eq!(listed, vec![rec.vm.clone()], "listed with its recorded pid");
    // Shutdown of a creating VM kills it (no guest to ask).
    d.shutdown(&listed[0], Duration::from_secs(30)).await.expect("shutdown a creating VM");
    assert!(!vmm::record::is_alive(rec.vm.pid, rec.vm.pid_start_time));
    assert!(!dir.exists());
    silent_writer.take();
    assert!(pids_mentioning(&needle).is_empty(), "nothing survives: {:?}", pids_mentioning(&needle));

    // 3. A running VM whose QEMU died behind our back: omitted by list, removed by prune.
    let vm = d.boot(&spec()).await.expect("boot");
    assert!(vmm::qemu::process::kill_and_wait(vm.pid, vm.pid_start_time, Duration::from_secs(10)).await);
    assert!(d.list().await.expect("list").is_empty(), "a dead record is not listed");
    assert!(vm.dir.is_dir(), "list does not delete");
    let cgroups =
        vmm::jail::JailSettings::from_env().resolve().ok().flatten().map(|j| j.cgroups.leaf_of(vm.id.as_str()));
    assert_eq!(d.prune().await.expect("prune"), vec![vm.id.clone()]);
    for dir in cgroups.iter().flat_map(|l| l.dirs()) {
        assert!(!dir.exists(), "prune removes the dead VM's cgroup leaf {}", dir.display());
    }
    assert!(dirs_under(&vms).is_empty());
    assert!(qemu_pids_mentioning(&needle).is_empty());
}

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
        name: "fw".into(),
        kernel: "/nonexistent/vmlinux".into(),
        initrd: "/nonexistent/initrd".into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        size: SizeClass::Small,
        accel: AccelPreference::Auto,
        nic: None,
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
    assert!(vm.dir.join("vm.json").is_file());
    assert!(vm.vsock_socket.exists(), "vsock bridge socket is served");
    assert_eq!(d.list().await.expect("list"), vec![vm.clone()]);

    // Our process "restarts": a new driver re-attaches from vm.json.
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

    d.kill(&vm).await.expect("kill");
    assert!(!vmm::record::is_alive(vm.pid, vm.pid_start_time));
    assert!(!vm.dir.exists(), "kill removes the VM dir");
    assert!(matches!(d.attach(&vm.id).await, Err(DriverError::NotFound(_))));

    // The firmware ignores the power button: shutdown falls back to killing.
    d.shutdown(&clone, Duration::from_millis(300)).await.expect("shutdown");
    assert!(!vmm::record::is_alive(clone.pid, clone.pid_start_time));
    assert!(d.list().await.expect("list").is_empty());
    assert!(qemu_pids_mentioning(&needle).is_empty(), "no QEMU outlives shutdown/kill");
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
        Err(DriverError::Spawn { detail, .. }) => assert!(!detail.is_empty()),
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
        assert!(Instant::now() < deadline, "{} never reached the expected state", vm_dir.display());
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

/// Lets the `cat` of an incoming migration blocked on the FIFO `fifo` finish (EOF).
fn release_fifo_readers(fifo: &Path) {
    use std::os::unix::fs::OpenOptionsExt;
    // Succeeds only while a reader waits; dropping the writer gives it EOF.
    let _ = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(fifo);
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

    // 1. Owner killed between QEMU daemonizing and the pid being recorded: a wrapper whose
    //    parent process only returns once QEMU is gone keeps the owner inside the spawn.
    let wrapper = tmp.path().join("slow-hypervisor");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nqemu-system-x86_64 \"$@\" || exit $?\n\
         prev=; for a in \"$@\"; do [ \"$prev\" = -pidfile ] && pf=$a; prev=$a; done\n\
         while kill -0 \"$(cat \"$pf\" 2>/dev/null)\" 2>/dev/null; do sleep 0.05; done\n",
    )
    .expect("write wrapper");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut owner = spawn_owner(&format!("boot\t{}\t{}", state.display(), wrapper.display()));
    let dir = only_vm_dir(&mut owner, &vms);
    // Wait until QEMU has daemonized (its pid file names a live process and the foreground
    // QEMU exited): the owner now only waits for the wrapper.
    let rec = wait_for_record(&mut owner, &dir, |r| {
        r.vm.state == VmState::Creating
            && vmm::lifecycle::pidfile_process(&r.vm.dir, "qemu.pid").is_some()
            && qemu_pids_mentioning(&needle).len() == 1
    });
    assert_eq!(rec.vm.pid, 0, "the owner is still waiting for the daemonizing parent");
    sigkill(owner);
    assert_eq!(qemu_pids_mentioning(&needle).len(), 1, "QEMU outlives its owner");

    let d = QemuDriver::new(config(&state));
    let listed = d.list().await.expect("list");
    assert_eq!(listed.len(), 1, "the half-created VM is listed: {listed:?}");
    let vm = &listed[0];
    assert_eq!((vm.state, vm.pid, &vm.dir), (VmState::Creating, 0, &dir));
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

    // 2a. In-process: dropping the restore future mid-migration cleans up at once.
    let snap = Snapshot::load(&snapdir).expect("snapshot.json");
    let r = tokio::time::timeout(Duration::from_secs(3), d.restore(&snap, &VmId::new("dropped").expect("id"))).await;
    assert!(r.is_err(), "restore from a silent FIFO cannot finish: {r:?}");
    assert!(!vms.join("dropped").exists(), "the dropped restore removed its dir");
    assert!(qemu_pids_mentioning(&needle).is_empty(), "the dropped restore killed its QEMU");
    release_fifo_readers(&fifo);

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
    release_fifo_readers(&fifo);
    assert!(pids_mentioning(&needle).is_empty(), "nothing survives: {:?}", pids_mentioning(&needle));

    // 3. A running VM whose QEMU died behind our back: omitted by list, removed by prune.
    let vm = d.boot(&spec()).await.expect("boot");
    assert!(vmm::qemu::process::kill_and_wait(vm.pid, vm.pid_start_time, Duration::from_secs(10)).await);
    assert!(d.list().await.expect("list").is_empty(), "a dead record is not listed");
    assert!(vm.dir.is_dir(), "list does not delete");
    assert_eq!(d.prune().await.expect("prune"), vec![vm.id.clone()]);
    assert!(dirs_under(&vms).is_empty());
    assert!(qemu_pids_mentioning(&needle).is_empty());
}

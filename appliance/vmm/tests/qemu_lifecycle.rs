//! QEMU process lifecycle without guest images: the microvm firmware alone, vCPUs paused.
//! Checks boot / list / attach after a driver restart / pause / snapshot / restore / shutdown /
//! kill, failed boots cleaning up, and that no QEMU process outlives any of it.
//! They boot real QEMU processes (microvm firmware only, no guest images), so they run under
//! `--features qemu-tests` (`cargo xtask test` enables it after installing QEMU); a plain
//! `cargo test` reports them as ignored, with the reason.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm::qemu::{QemuConfig, QemuDriver};
use vmm::{AccelPreference, AfterSnapshot, BootSpec, Driver, DriverError, SizeClass, VmId};

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

//! Driver tests against the fake API server and a fake `cloud-hypervisor` script: the exact
//! request bodies, the error mapping, and that no process outlives a stop or a failed start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use super::api::{ApiClient, ApiError};
use super::fake_api::{fixture, fixtures_dir, FakeApi, Recorded};
use super::*;
use crate::size::SizeClass;

/// Fields drop in order: the fake (releasing leftover fake VMMs) before the temp dir.
struct Env {
    fake: FakeApi,
    driver: CloudHypervisor,
    tmp: tempfile::TempDir,
}

fn test_config(state: &Path, bin: &Path) -> CloudHypervisorConfig {
    CloudHypervisorConfig {
        state_dir: state.to_path_buf(),
        binary: Some(bin.as_os_str().to_os_string()),
        path_var: None,
        api_timeout: Duration::from_secs(5),
        snapshot_timeout: Duration::from_secs(5),
        start_timeout: Duration::from_secs(10),
        shared_memory: true,
        console_cap: 64 * 1024,
        jail: crate::jail::JailSettings::from_env(),
    }
}

fn env() -> Env {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeApi::start(tmp.path());
    let bin = fake.write_fake_binary(tmp.path());
    let driver = CloudHypervisor::new(test_config(&tmp.path().join("state"), &bin)).expect("driver");
    Env { fake, driver, tmp }
}

/// A template on disk: kernel, initrd, optional rootfs and overlay base.
fn spec(root: &Path, name: &str, size: SizeClass, rootfs: bool) -> BootSpec {
    let img = root.join("images").join(name);
    std::fs::create_dir_all(&img).expect("mkdir images");
    for f in ["vmlinux", "initrd.cpio.gz"] {
        std::fs::write(img.join(f), f).expect("write image file");
    }
    if rootfs {
        std::fs::write(img.join("rootfs.erofs"), b"erofs").expect("write rootfs");
        std::fs::write(img.join("overlay-empty.ext4"), b"ext4-superblock").expect("write overlay");
    }
    BootSpec {
        overlay_bytes: None,
        name: name.into(),
        kernel: img.join("vmlinux"),
        initrd: img.join("initrd.cpio.gz"),
        rootfs: rootfs.then(|| img.join("rootfs.erofs")),
        overlay_base: rootfs.then(|| img.join("overlay-empty.ext4")),
        cmdline: if rootfs { "quiet".into() } else { String::new() },
        size,
        accel: AccelPreference::Auto,
        nic: None,
        rng: true,
        volumes: true,
        ram: crate::driver::Ram::Anonymous,
    }
}

/// A fixture with `@NAME@` placeholders replaced, parsed as JSON.
fn rendered(name: &str, vars: &[(&str, String)]) -> Value {
    let mut s = fixture(name);
    for (k, v) in vars {
        s = s.replace(&format!("@{k}@"), v);
    }
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("fixture {name}: {e}\n{s}"))
}

fn vars(vm: &Vm) -> Vec<(&'static str, String)> {
    let s = |p: &Path| p.display().to_string();
    vec![
        ("VMDIR", s(&vm.dir)),
        ("JAILDIR", s(&vm.dir.join(JAIL_DIR))),
        ("KERNEL", s(&vm.spec.kernel)),
        ("INITRD", s(&vm.spec.initrd)),
        ("ROOTFS", vm.spec.rootfs.as_deref().map(s).unwrap_or_default()),
        ("CID", vsock_cid(&vm.id).to_string()),
    ]
}

fn put(path: &str, body: Option<Value>) -> Recorded {
    Recorded { method: "PUT".into(), path: path.into(), body }
}

fn get(path: &str) -> Recorded {
    Recorded { method: "GET".into(), path: path.into(), body: None }
}

fn proc_gone(vm: &Vm) -> bool {
    !crate::record::is_alive(vm.pid, vm.pid_start_time)
}

/// The jail the driver resolves here (root with the VM user: on), `None` when off.
fn jail() -> Option<crate::jail::Jail> {
    crate::jail::JailSettings::from_env().resolve().ok().flatten()
}

/// `(uid, gid, permission bits)` of `p` (not following a link).
fn owner_mode(p: &Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

/// Waits until `vm`'s `vmm.log` (both segments) holds `needle`; returns the text.
async fn vmm_log_until(vm: &Vm, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got =
            String::from_utf8_lossy(&crate::console::tail(&vm.dir.join(VMM_LOG), 1 << 20).expect("tail")).into_owned();
        if got.contains(needle) {
            return got;
        }
        assert!(Instant::now() < deadline, "vmm.log lacks {needle:?}: {got}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn boot_sends_the_recorded_create_and_boot_then_shuts_down_cleanly() {
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Medium, true);
    let vm = e.driver.boot(&spec).await.expect("boot");

    assert_eq!(vm.backend, Backend::CloudHypervisor);
    assert_eq!(vm.accel, Accel::Kvm);
    assert_eq!(vm.dir, e.tmp.path().join("state/vms").join(vm.id.as_str()));
    assert_eq!(vm.control_socket, vm.dir.join("jail/api.sock"));
    assert_eq!(vm.vsock_socket, vm.dir.join("jail/vsock.sock"));
    assert_eq!(vm.console_log, vm.dir.join("console.log"));
    assert!(vm.id.as_str().starts_with("rt-"), "{}", vm.id);
    assert!(!proc_gone(&vm), "cloud-hypervisor process should run");
    // Its jail: own session, no new privileges, and (where the jail is on) its cgroup leaf.
    let j = crate::jail::inspect::process_jail(vm.pid).expect("status");
    assert!(j.no_new_privs, "NoNewPrivs");
    assert_eq!(
        rustix::process::getsid(rustix::process::Pid::from_raw(vm.pid as i32))
            .ok()
            .map(|p| p.as_raw_nonzero().get() as u32),
        Some(vm.pid),
        "a session of its own"
    );
    let jail = jail();
    if let Some(jl) = &jail {
        assert_eq!(j.limits, Some(crate::jail::Limits::for_vm(SizeClass::Medium, Accel::Kvm)), "{:?}", j.cgroups);
        // The VM user, with no capability left in any set.
        assert_eq!(j.uids, [jl.uid; 4], "runs as the VM user");
        assert_eq!((j.cap_eff, j.cap_prm, j.cap_bnd), (0, 0, 0), "no capabilities");
        let status = std::fs::read_to_string(format!("/proc/{}/status", vm.pid)).expect("status");
        let gid_line = status.lines().find(|l| l.starts_with("Gid:")).expect("Gid:");
        assert!(gid_line.split_whitespace().skip(1).all(|g| g == jl.gid.to_string()), "{gid_line}");
        let groups = status.lines().find(|l| l.starts_with("Groups:")).expect("Groups:");
        assert_eq!(groups.trim_end(), "Groups:", "no supplementary groups");
        // Who owns what: root's directory (the VM user may only search it) holding root's
        // files, and the VM user's own directory with its overlay.
        assert_eq!(owner_mode(&vm.dir), (0, jl.gid, 0o710));
        assert_eq!(owner_mode(&vm.dir.join(JAIL_DIR)), (jl.uid, jl.gid, 0o700));
        assert_eq!(owner_mode(&vm.dir.join(JAIL_DIR).join(OVERLAY)), (jl.uid, jl.gid, 0o600));
        for f in [VMM_LOG, CONSOLE_LOG, VM_JSON] {
            assert_eq!(owner_mode(&vm.dir.join(f)).0, 0, "{f} is root's");
        }
        for f in [VMM_LOG, CONSOLE_LOG] {
            assert_eq!(owner_mode(&vm.dir.join(f)).2, 0o600, "{f}");
        }
        // The socket the (fake) hypervisor made is its own.
        assert_eq!(owner_mode(&vm.control_socket).0, jl.uid, "api.sock made by the VM user");
    } else {
        eprintln!("jail off here (not root, no VM user, or CHRYSALIS_JAIL=0): only the session and NoNewPrivs checked");
    }

    // Readiness pings first, then exactly create + boot.
    let reqs = e.fake.requests();
    assert_eq!(reqs.first().map(Recorded::line).as_deref(), Some("GET /vmm.ping"));
    let create = rendered("vm.create.medium-rt.request.json", &vars(&vm));
    assert_eq!(e.fake.calls(), vec![put("/vm.create", Some(create)), put("/vm.boot", None)]);

    // The overlay is a private copy of the base; vm.json is the returned record.
    assert_eq!(std::fs::read(vm.dir.join("jail/overlay.raw")).expect("overlay"), b"ext4-superblock");
    let rec: Vm = crate::record::read_json(&vm.dir.join("vm.json")).expect("vm.json");
    assert_eq!(rec, vm);
    vmm_log_until(&vm, &format!("listening on {}", vm.control_socket.display())).await;

    e.fake.clear();
    e.driver.shutdown(&vm, Duration::from_secs(5)).await.expect("shutdown");
    assert_eq!(e.fake.calls(), vec![put("/vm.shutdown", None), put("/vmm.shutdown", None)]);
    assert!(proc_gone(&vm), "process outlived shutdown");
    assert!(!vm.dir.exists(), "vm dir left behind");
    for dir in &j.cgroups {
        if jail.is_some() {
            assert!(!dir.ends_with(vm.id.as_str()) || !dir.exists(), "cgroup leaf {} left behind", dir.display());
        }
    }
    assert!(e.driver.list().await.expect("list").is_empty());
}

#[tokio::test]
async fn shutdown_kills_a_vmm_that_does_not_exit() {
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    // The VMM refuses to exit (no exit file is created): shutdown must still end it.
    e.fake.respond("PUT /vmm.shutdown", 500, r#"["Error from API","busy"]"#);
    let t = std::time::Instant::now();
    e.driver.shutdown(&vm, Duration::from_millis(300)).await.expect("shutdown");
    assert!(t.elapsed() >= Duration::from_millis(300), "did not wait for a clean exit");
    assert!(!e.fake.exit_file().exists());
    assert!(proc_gone(&vm), "process outlived shutdown");
    assert!(!vm.dir.exists());
}

#[tokio::test]
async fn base_template_has_no_disks_and_small_sizes() {
    let e = env();
    let spec = spec(e.tmp.path(), "base", SizeClass::Small, false);
    let vm = e.driver.boot(&spec).await.expect("boot");
    let create = rendered("vm.create.small-base.request.json", &vars(&vm));
    assert_eq!(e.fake.calls()[0], put("/vm.create", Some(create)));
    assert!(!vm.dir.join("overlay.raw").exists());
    e.driver.kill(&vm).await.expect("kill");
    assert!(proc_gone(&vm));
    assert!(!vm.dir.exists());
}

#[test]
fn every_size_class_maps_to_cpus_and_memory_bytes() {
    for size in SizeClass::ALL {
        let plan = config::VmPlan {
            kernel: "/k".into(),
            initramfs: "/i".into(),
            cmdline: "console=ttyS0".into(),
            vcpus: size.vcpus(),
            memory_bytes: size.memory_mib() << 20,
            shared_memory: false,
            rootfs: None,
            overlay: None,
            serial_socket: "/d/console.sock".into(),
            vsock_cid: 3,
            vsock_socket: "/d/vsock.sock".into(),
            rng: size == SizeClass::Small,
            net: None,
        };
        let body = serde_json::to_value(plan.to_vm_config()).expect("serialize");
        if size == SizeClass::Small {
            assert_eq!(body["rng"], json!({"src": "/dev/urandom"}), "virtio-rng from the host's urandom");
        } else {
            assert!(body.get("rng").is_none() || body["rng"].is_null(), "no rng unless the spec asks: {}", body["rng"]);
        }
        let (cpus, mib) = match size {
            SizeClass::Small => (1, 512u64),
            SizeClass::Medium => (2, 1024),
            SizeClass::Large => (4, 4096),
            SizeClass::XLarge => (4, 8192),
            SizeClass::X2Large => (8, 16384),
        };
        assert_eq!(body["cpus"], json!({"boot_vcpus": cpus, "max_vcpus": cpus}), "{size}");
        // Without snapshots, memory is private: no "shared" key at all.
        assert_eq!(body["memory"], json!({"size": mib * 1024 * 1024}), "{size}");
        assert!(body.get("disks").is_none());
        assert!(body.get("net").is_none() || body["net"].is_null(), "no NIC unless the spec has one");
    }
}

#[test]
fn a_nic_is_created_on_its_tap_and_a_clone_gets_its_own() {
    let plan = config::VmPlan {
        kernel: "/k".into(),
        initramfs: "/i".into(),
        cmdline: "console=ttyS0".into(),
        vcpus: 1,
        memory_bytes: 512 << 20,
        shared_memory: true,
        rootfs: None,
        overlay: None,
        serial_socket: "/d/console.sock".into(),
        vsock_cid: 3,
        vsock_socket: "/d/vsock.sock".into(),
        rng: true,
        net: Some(("sb-0a1b2c3d".into(), "02:42:0a:58:00:05".into())),
    };
    let body = serde_json::to_value(plan.to_vm_config()).expect("serialize");
    // cloud-hypervisor's NetConfig: the TAP by name (it joins the NIC's netns), the guest MAC.
    assert_eq!(body["net"], json!([{"tap": "sb-0a1b2c3d", "mac": "02:42:0a:58:00:05", "id": "net0"}]));
    // A clone's restored config names its own TAP; the saved device keeps the parent's MAC
    // (the guest is re-addressed through silkd) and every other field.
    let mut cfg = json!({
        "vsock": {"cid": 3, "socket": "/p/vsock.sock"},
        "net": [{"id": "net0", "tap": "sb-parent", "mac": "02:42:0a:58:00:05", "num_queues": 2}]
    });
    let with = config::CloneRewrite {
        vsock_socket: PathBuf::from("/c/vsock.sock"),
        serial_socket: PathBuf::from("/c/console.sock"),
        overlay: None,
        tap: Some("sb-clone".into()),
    };
    config::rewrite_snapshot_config(&mut cfg, &with).expect("rewrite");
    assert_eq!(cfg["net"], json!([{"id": "net0", "tap": "sb-clone", "mac": "02:42:0a:58:00:05", "num_queues": 2}]));
    let mut no_net = json!({"vsock": {"cid": 3, "socket": "/p/v"}});
    assert!(matches!(config::rewrite_snapshot_config(&mut no_net, &with), Err(config::ConfigError::Missing(_))));
}

#[test]
fn cmdline_adds_console_and_root_selection_once() {
    assert_eq!(config::kernel_cmdline("", false, false), "console=ttyS0 reboot=k panic=1");
    assert_eq!(
        config::kernel_cmdline("quiet", true, false),
        "console=ttyS0 reboot=k panic=1 chrysalis.rootfs=/dev/vda chrysalis.overlay=tmpfs quiet"
    );
    // The template's own values win and are not repeated.
    assert_eq!(
        config::kernel_cmdline("console=hvc0 chrysalis.rootfs=/dev/vda", true, true),
        "reboot=k panic=1 console=hvc0 chrysalis.rootfs=/dev/vda"
    );
}

#[tokio::test]
async fn pause_resume_and_snapshot_send_the_recorded_bodies() {
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Small, true);
    let vm = e.driver.boot(&spec).await.expect("boot");
    e.fake.clear();

    e.driver.pause(&vm).await.expect("pause");
    e.driver.resume(&vm).await.expect("resume");
    assert_eq!(e.fake.calls(), vec![put("/vm.pause", None), put("/vm.resume", None)]);
    e.fake.clear();

    // Overlay content at snapshot time must travel with the snapshot.
    std::fs::write(vm.dir.join("jail/overlay.raw"), b"guest wrote this").expect("dirty overlay");
    let snapdir = e.tmp.path().join("snaps/one");
    let snap = e.driver.snapshot(&vm, &snapdir, AfterSnapshot::Resumed).await.expect("snapshot");
    let body = rendered("vm.snapshot.request.json", &[("SNAPDIR", snapdir.display().to_string())]);
    assert_eq!(
        e.fake.calls(),
        vec![get("/vm.info"), put("/vm.pause", None), put("/vm.snapshot", Some(body)), put("/vm.resume", None),]
    );
    assert_eq!(snap.dir, snapdir);
    assert_eq!(snap.backend, Backend::CloudHypervisor);
    assert_eq!(snap.source, vm.id);
    assert_eq!(snap.spec, vm.spec);
    assert_eq!(snap.overlay.as_deref(), Some(snapdir.join("overlay.raw").as_path()));
    assert_eq!(std::fs::read(snapdir.join("overlay.raw")).expect("saved overlay"), b"guest wrote this");
    assert_eq!(Snapshot::load(&snapdir).expect("snapshot.json"), snap);
    // cloud-hypervisor wrote it as the VM user into a directory that was the VM user's for the
    // time of `vm.snapshot`; now it is root's, readable by the VM group (for clones), and the
    // files the driver wrote are root's only.
    let written = e.fake.snapshot_dirs();
    assert_eq!(written.len(), 1, "{written:?}");
    match jail() {
        Some(jl) => {
            assert_eq!((written[0].owner, written[0].mode), ((jl.uid, jl.gid), 0o700), "handed over");
            assert_eq!(owner_mode(&snapdir), (0, jl.gid, 0o750), "taken back");
            for f in ["config.json", "state.json", "memory-ranges"] {
                assert_eq!(owner_mode(&snapdir.join(f)), (0, jl.gid, 0o640), "{f}");
            }
            assert_eq!(owner_mode(&snapdir.join("overlay.raw")), (0, 0, 0o600));
        }
        None => assert_eq!(written[0].owner.0, rustix::process::geteuid().as_raw()),
    }

    // Already paused (vm.info says so): no second pause; AfterSnapshot::Paused: no resume.
    e.fake.clear();
    let mut info: Value = serde_json::from_str(&fixture("vm.info.running.response.json")).expect("json");
    info["state"] = json!("Paused");
    e.fake.respond("GET /vm.info", 200, &info.to_string());
    let snapdir2 = e.tmp.path().join("snaps/two");
    e.driver.snapshot(&vm, &snapdir2, AfterSnapshot::Paused).await.expect("snapshot paused vm");
    let lines: Vec<String> = e.fake.calls().iter().map(Recorded::line).collect();
    assert_eq!(lines, vec!["GET /vm.info", "PUT /vm.snapshot"]);
    // `is_paused` reads vm.info's state (a restarted sandboxd takes only paused VMs as warm).
    assert!(e.driver.is_paused(&vm).await.expect("is_paused"));
    e.fake.respond("GET /vm.info", 200, &fixture("vm.info.running.response.json"));
    assert!(!e.driver.is_paused(&vm).await.expect("is_paused"));

    e.driver.kill(&vm).await.expect("kill");
    assert!(proc_gone(&vm));
}

#[tokio::test]
async fn failed_snapshot_resumes_the_vm_and_reports_the_body() {
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    e.fake.clear();
    let body = r#"["Error from API","The VM could not be snapshotted","Error creating snapshot file"]"#;
    e.fake.respond("PUT /vm.snapshot", 500, body);
    let err =
        e.driver.snapshot(&vm, &e.tmp.path().join("snap"), AfterSnapshot::Paused).await.expect_err("snapshot fails");
    match &err {
        DriverError::Control { vm: id, message } => {
            assert_eq!(id, &vm.id);
            assert!(message.contains("PUT /vm.snapshot answered HTTP 500"), "{message}");
            assert!(message.contains(body), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let lines: Vec<String> = e.fake.calls().iter().map(Recorded::line).collect();
    assert_eq!(lines, vec!["GET /vm.info", "PUT /vm.pause", "PUT /vm.snapshot", "PUT /vm.resume"]);
    e.driver.kill(&vm).await.expect("kill");
}

/// A snapshot directory as cloud-hypervisor + our driver leave it.
fn fake_snapshot(root: &Path, spec: &BootSpec) -> Snapshot {
    let dir = root.join("golden-snap");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(fixtures_dir().join("snapshot/config.json"), dir.join("config.json")).expect("config");
    std::fs::write(dir.join("state.json"), b"{}").expect("state");
    std::fs::write(dir.join("memory-ranges"), b"guest memory").expect("memory");
    std::fs::write(dir.join("overlay.raw"), b"golden overlay").expect("overlay");
    let snap = Snapshot {
        dir: dir.clone(),
        backend: Backend::CloudHypervisor,
        accel: Accel::Kvm,
        source: VmId::new("rt-golden").expect("id"),
        spec: spec.clone(),
        overlay: Some(dir.join("overlay.raw")),
        created_at_epoch_secs: 1,
    };
    crate::record::write_json_atomic(&dir.join(Snapshot::FILE), &snap).expect("snapshot.json");
    snap
}

#[tokio::test]
async fn restore_clones_into_its_own_paths() {
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Medium, true);
    let snap = fake_snapshot(e.tmp.path(), &spec);
    let id = VmId::new("rt-clone-1").expect("id");
    let vm = e.driver.restore(&snap, &id).await.expect("restore");

    assert_eq!(vm.id, id);
    assert_eq!(vm.restored_from.as_deref(), Some(snap.dir.as_path()));
    assert_eq!(vm.spec, spec);
    let body = rendered("vm.restore.request.json", &vars(&vm));
    assert_eq!(e.fake.calls(), vec![put("/vm.restore", Some(body)), put("/vm.resume", None)]);

    // The clone's config points at its own sockets, log and overlay; the rest is untouched.
    let rdir = vm.dir.join("restore");
    let cfg: Value = crate::record::read_json(&rdir.join("config.json")).expect("config");
    let mut want: Value = serde_json::from_str(&fixture("snapshot/config.json")).expect("fixture");
    want["vsock"]["socket"] = json!(vm.vsock_socket.display().to_string());
    // A parent's file console becomes the clone's own console socket.
    want["serial"]["file"] = Value::Null;
    want["serial"]["mode"] = json!("Socket");
    want["serial"]["socket"] = json!(vm.control_socket.with_file_name("console.sock").display().to_string());
    want["disks"][1]["path"] = json!(vm.dir.join("jail/overlay.raw").display().to_string());
    assert_eq!(cfg, want);
    if let Some(jl) = jail() {
        // The clone's view of the snapshot is root's, readable by the VM user only.
        assert_eq!(owner_mode(&rdir), (0, jl.gid, 0o750));
        assert_eq!(owner_mode(&rdir.join("config.json")), (0, jl.gid, 0o640));
        assert_eq!(owner_mode(&vm.dir.join("jail/overlay.raw")), (jl.uid, jl.gid, 0o600));
        assert_eq!(crate::jail::inspect::process_jail(vm.pid).expect("status").uids, [jl.uid; 4]);
    }
    for f in ["state.json", "memory-ranges"] {
        let link = std::fs::read_link(rdir.join(f)).expect("symlink");
        assert_eq!(link, snap.dir.join(f));
    }
    assert!(!rdir.join("overlay.raw").exists() && !rdir.join("snapshot.json").exists());
    assert_eq!(std::fs::read(vm.dir.join("jail/overlay.raw")).expect("overlay"), b"golden overlay");

    // A second restore under the same id is refused before anything starts.
    assert!(matches!(e.driver.restore(&snap, &id).await, Err(DriverError::Invalid(_))));
    e.driver.kill(&vm).await.expect("kill");
    assert!(proc_gone(&vm));
    assert!(snap.dir.join("memory-ranges").exists(), "kill must not touch the snapshot");
}

#[tokio::test]
async fn failed_restore_leaves_no_process_or_dir() {
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Small, true);
    let snap = fake_snapshot(e.tmp.path(), &spec);
    e.fake.respond(
        "PUT /vm.restore",
        500,
        r#"["Error from API","The VM could not be restored","Error restoring memory"]"#,
    );
    let id = VmId::new("rt-clone-2").expect("id");
    let err = e.driver.restore(&snap, &id).await.expect_err("restore fails");
    assert!(matches!(err, DriverError::Control { .. }), "{err:?}");
    assert!(!e.tmp.path().join("state/vms/rt-clone-2").exists());
    assert_no_fake_vmm_running(e.tmp.path());
}

/// No process running the fake binary of this test is alive.
fn assert_no_fake_vmm_running(root: &Path) {
    let bin = root.join("cloud-hypervisor").display().to_string();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(&bin) {
            let pid: u32 = entry.file_name().to_string_lossy().parse().unwrap_or(0);
            let state = crate::record::pid_state(pid);
            assert!(
                matches!(state, Some('Z') | None),
                "fake cloud-hypervisor still running: pid {pid} state {state:?}: {cmd}"
            );
        }
    }
}

#[tokio::test]
async fn http_errors_become_typed_errors_carrying_the_body() {
    let e = env();
    let body = fixture("vm.boot.500.response.json");
    e.fake.respond("PUT /vm.boot", 500, &body);
    let err = e.driver.boot(&spec(e.tmp.path(), "rt", SizeClass::Small, true)).await.expect_err("boot fails");
    match &err {
        DriverError::Control { message, .. } => {
            assert!(message.starts_with("PUT /vm.boot answered HTTP 500: "), "{message}");
            assert!(message.contains(body.trim()), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // No process outlives a failed boot, and its directory is gone.
    assert_no_fake_vmm_running(e.tmp.path());
    let vms = e.tmp.path().join("state/vms");
    assert_eq!(std::fs::read_dir(&vms).expect("vms dir").count(), 0);

    // At the client level: status, endpoint and the decoded message chain.
    let api = ApiClient::new(e.fake.socket(), Duration::from_secs(5), None);
    let not_created = fixture("vm.pause.404.response.json");
    e.fake.respond("PUT /vm.pause", 404, &not_created);
    match api.pause().await.expect_err("404") {
        err @ ApiError::Status { .. } => {
            assert_eq!(err.status(), Some(404));
            assert_eq!(err.endpoint(), "PUT /vm.pause");
            assert_eq!(err.messages(), vec!["Error from API", "The VM could not be paused", "VM is not created"]);
            let vm_id = VmId::new("x").expect("id");
            match api_error(&vm_id, err) {
                DriverError::Control { message, .. } => {
                    assert!(message.contains("HTTP 404") && message.contains(not_created.trim()), "{message}")
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        other => panic!("unexpected {other:?}"),
    }
    // A ping answered with a body that does not parse is a transport (decode) error.
    e.fake.respond("GET /vmm.ping", 200, "{\"nope\":1}");
    assert!(matches!(api.ping().await, Err(ApiError::Transport { .. })));
    // A socket nobody listens on.
    let gone = ApiClient::new(&e.tmp.path().join("nothing.sock"), Duration::from_secs(1), None);
    let err = gone.boot().await.expect_err("no socket");
    assert!(matches!(err, ApiError::Transport { endpoint: "PUT /vm.boot", .. }), "{err:?}");
}

#[tokio::test]
async fn client_parses_recorded_success_responses() {
    let e = env();
    let api = ApiClient::new(e.fake.socket(), Duration::from_secs(5), None);
    let ping = api.ping().await.expect("ping");
    assert_eq!(ping.version, "44.0.0");
    assert_eq!(ping.pid, Some(4242));
    let info = api.info().await.expect("info");
    assert_eq!(info.state, cloud_hypervisor_client::models::VmState::Running);
    assert_eq!(info.config.memory.map(|m| m.size), Some(512 << 20));
    api.shutdown_vmm().await.expect("vmm.shutdown");
    assert!(e.fake.exit_file().exists());
}

#[tokio::test]
async fn missing_binary_is_a_typed_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cfg = test_config(tmp.path(), &tmp.path().join("no/such/cloud-hypervisor"));
    let err = CloudHypervisor::new(cfg).expect_err("no binary");
    assert!(matches!(err, ProcessError::BinaryNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("CLOUD_HYPERVISOR_BIN"), "{err}");

    let mut cfg = test_config(tmp.path(), Path::new("x"));
    cfg.binary = None;
    cfg.path_var = Some(tmp.path().as_os_str().to_os_string());
    let err = CloudHypervisor::new(cfg).expect_err("not in PATH");
    assert!(matches!(&err, ProcessError::BinaryNotFound { wanted } if wanted == "cloud-hypervisor"), "{err:?}");
    // As a driver error (the binary vanished after construction).
    let vm = VmId::new("x").expect("id");
    assert!(matches!(process_error(&vm, err), DriverError::Spawn { .. }));
}

#[tokio::test]
async fn binary_that_exits_at_once_fails_boot_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // The jailed binary runs as the VM user.
    std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let bin = tmp.path().join("ch-broken");
    // 200 KiB of noise first: the log keeps its end, and the error carries the last words.
    let script =
        "#!/bin/sh\nhead -c 204800 /dev/zero | tr '\\0' x >&2\necho >&2\necho 'Error: KVM unavailable' >&2\nexit 1\n";
    std::fs::write(&bin, script).expect("script");
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let driver = CloudHypervisor::new(test_config(&tmp.path().join("state"), &bin)).expect("driver");
    let err = driver.boot(&spec(tmp.path(), "base", SizeClass::Small, false)).await.expect_err("boot fails");
    match &err {
        DriverError::Exited { detail, .. } => {
            assert!(detail.contains("KVM unavailable"), "{detail}")
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(std::fs::read_dir(tmp.path().join("state/vms")).expect("vms").count(), 0);

    let mut tcg = spec(tmp.path(), "base", SizeClass::Small, false);
    tcg.accel = AccelPreference::Tcg;
    assert!(matches!(driver.boot(&tcg).await, Err(DriverError::Unsupported { .. })));
}

#[tokio::test]
async fn list_and_attach_from_a_fresh_driver() {
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");

    // "Our process restarted": a second driver on the same state dir.
    let bin = e.tmp.path().join("cloud-hypervisor");
    let again = CloudHypervisor::new(test_config(&e.tmp.path().join("state"), &bin)).expect("driver");
    assert_eq!(again.list().await.expect("list"), vec![vm.clone()]);

    // The API socket is answered by a different pid than the record: refuse.
    let err = again.attach(&vm.id).await.expect_err("pid mismatch");
    assert!(matches!(err, DriverError::Control { .. }), "{err:?}");
    let mut ping: Value = serde_json::from_str(&fixture("vmm.ping.response.json")).expect("json");
    ping["pid"] = json!(vm.pid);
    e.fake.respond("GET /vmm.ping", 200, &ping.to_string());
    assert_eq!(again.attach(&vm.id).await.expect("attach"), vm);

    let unknown = VmId::new("nope").expect("id");
    assert!(matches!(again.attach(&unknown).await, Err(DriverError::NotFound(_))));

    // A record whose directory is elsewhere is never deleted.
    let mut forged = vm.clone();
    forged.dir = e.tmp.path().join("images");
    assert!(matches!(again.kill(&forged).await, Err(DriverError::Invalid(_))));
    assert!(e.tmp.path().join("images").exists());

    // The adopted process is stopped by the second driver; the first reaps its child.
    again.shutdown(&vm, Duration::from_secs(5)).await.expect("shutdown");
    assert!(proc_gone(&vm));
    assert!(again.list().await.expect("list").is_empty());
    assert!(e.driver.list().await.expect("list").is_empty());
    e.driver.kill(&vm).await.expect("kill of a gone vm is a no-op");
}

#[test]
fn vsock_cids_are_at_least_3_and_stable() {
    let a = VmId::new("rt-00000001").expect("id");
    let b = VmId::new("rt-00000002").expect("id");
    assert!(vsock_cid(&a) >= 3 && vsock_cid(&b) >= 3);
    assert_eq!(vsock_cid(&a), vsock_cid(&a));
    assert_ne!(vsock_cid(&a), vsock_cid(&b));
}

#[test]
fn snapshot_config_rewrite_requires_vsock_and_overlay_disk() {
    let with = config::CloneRewrite {
        vsock_socket: PathBuf::from("/c/vsock.sock"),
        serial_socket: PathBuf::from("/c/console.sock"),
        overlay: Some(PathBuf::from("/c/overlay.raw")),
        tap: None,
    };
    let mut no_vsock = json!({"disks": []});
    assert_eq!(config::rewrite_snapshot_config(&mut no_vsock, &with), Err(config::ConfigError::Missing("vsock")));
    let mut no_overlay = json!({"vsock": {"cid": 3, "socket": "/p/v"}, "disks": [{"id": "rootfs", "path": "/r"}]});
    assert!(matches!(config::rewrite_snapshot_config(&mut no_overlay, &with), Err(config::ConfigError::Missing(_))));
    assert_eq!(config::rewrite_snapshot_config(&mut json!([1]), &with), Err(config::ConfigError::NotAnObject));
}

/// Waits until the console log's tail satisfies `pred`.
async fn console_until(vm: &Vm, pred: impl Fn(&[u8]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = crate::console::tail(&vm.console_log, 1 << 20).expect("tail");
        if pred(&got) {
            return;
        }
        assert!(Instant::now() < deadline, "console log holds {} bytes", got.len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn the_console_socket_is_drained_into_a_capped_log_and_again_after_a_restart() {
    use tokio::io::AsyncWriteExt;
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    let on_disk = || {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        size(&vm.console_log) + size(&crate::console::rotated_path(&vm.console_log))
    };
    // The fake cloud-hypervisor serves the serial socket (the driver checks who does) and
    // relays it here; the driver dials it (and keeps re-dialling).
    let listener = super::fake_api::bind_upstream(&vm, super::fake_api::SERIAL_UPSTREAM);
    let (mut serial, _) = listener.accept().await.expect("the driver dials the console");
    let block = vec![b'z'; 128 * 1024];
    for _ in 0..32 {
        serial.write_all(&block).await.expect("flood");
    }
    serial.write_all(b"\nlast words\n").await.expect("write");
    console_until(&vm, |b| b.ends_with(b"\nlast words\n")).await;
    assert!(on_disk() <= 64 * 1024, "4 MiB of guest output left {} bytes on disk", on_disk());

    // Our process restarted: a second driver re-attaches and drains the socket again.
    drop(serial);
    let bin = e.tmp.path().join("cloud-hypervisor");
    let again = CloudHypervisor::new(test_config(&e.tmp.path().join("state"), &bin)).expect("driver");
    let mut ping: Value = serde_json::from_str(&fixture("vmm.ping.response.json")).expect("json");
    ping["pid"] = json!(vm.pid);
    e.fake.respond("GET /vmm.ping", 200, &ping.to_string());
    again.attach(&vm.id).await.expect("attach");
    // The old process's drain is gone with it.
    e.driver.consoles().remove(&vm.id);
    let (mut serial, _) = listener.accept().await.expect("the re-attached driver dials the console");
    serial.write_all(b"after restart\n").await.expect("write");
    console_until(&vm, |b| b.ends_with(b"\nlast words\nafter restart\n")).await;
    assert!(on_disk() <= 64 * 1024);
    again.kill(&vm).await.expect("kill");
    assert!(again.consoles().is_empty(), "kill stops the drain");
}

#[tokio::test]
async fn a_flood_of_vmm_output_is_capped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeApi::start(tmp.path());
    // 256 KiB on stderr and 256 KiB on stdout before it starts listening.
    let bin = fake.write_fake_binary_with(
        tmp.path(),
        "head -c 262144 /dev/zero | tr '\\0' e >&2; head -c 262144 /dev/zero | tr '\\0' o",
    );
    let driver = CloudHypervisor::new(test_config(&tmp.path().join("state"), &bin)).expect("driver");
    let e = Env { fake, driver, tmp };
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    vmm_log_until(&vm, "listening on").await;
    let log = vm.dir.join(VMM_LOG);
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let on_disk = size(&log) + size(&crate::console::rotated_path(&log));
    assert!(on_disk <= process::LOG_CAP, "512 KiB of output left {on_disk} bytes on disk");
    e.driver.kill(&vm).await.expect("kill");
}

#[tokio::test]
async fn a_snapshot_the_vm_user_cannot_read_is_refused_before_anything_runs() {
    let Some(jl) = jail() else {
        foundation::testing::skip("the jail is off here (not root, or no VM user)");
        return;
    };
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Small, true);
    let snap = fake_snapshot(e.tmp.path(), &spec);
    std::fs::set_permissions(snap.dir.join("memory-ranges"), std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let id = VmId::new("rt-clone-3").expect("id");
    let err = e.driver.restore(&snap, &id).await.expect_err("unreadable snapshot");
    match &err {
        DriverError::Jail(crate::jail::JailError::Unreachable { path, uid, .. }) => {
            assert_eq!(path, &snap.dir.join("memory-ranges"));
            assert_eq!(*uid, jl.uid);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(e.fake.calls().is_empty(), "nothing was asked of cloud-hypervisor");
    assert!(!e.tmp.path().join("state/vms/rt-clone-3").exists());
    assert_no_fake_vmm_running(e.tmp.path());
}

#[tokio::test]
async fn a_snapshot_with_a_planted_link_is_not_taken_back() {
    let Some(jl) = jail() else {
        foundation::testing::skip("the jail is off here (not root, or no VM user)");
        return;
    };
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    let secret = e.tmp.path().join("secret");
    std::fs::write(&secret, b"root only").expect("write");
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    // A compromised cloud-hypervisor links a file of root's into its snapshot directory.
    let snapdir = e.tmp.path().join("snaps/evil");
    std::fs::create_dir_all(&snapdir).expect("mkdir");
    std::os::unix::fs::symlink(&secret, snapdir.join("memory-ranges.extra")).expect("plant");
    let err = e.driver.snapshot(&vm, &snapdir, AfterSnapshot::Resumed).await.expect_err("refused");
    assert!(matches!(err, DriverError::Jail(crate::jail::JailError::Unexpected { .. })), "{err:?}");
    assert_eq!(owner_mode(&secret), (0, 0, 0o600), "the linked file is untouched");
    assert_eq!(owner_mode(&snapdir), (0, jl.gid, 0o750), "the directory is root's again");
    assert!(!snapdir.join("snapshot.json").exists());
    e.driver.kill(&vm).await.expect("kill");
}

#[tokio::test]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates a netns and a TAP: cargo test -p vmm --features netns-tests --lib cloud_hypervisor"
)]
async fn a_nic_tap_is_handed_to_the_vm_user_and_the_vmm_joins_its_netns() {
    use std::os::unix::fs::MetadataExt;
    let Some(jl) = jail() else {
        foundation::testing::skip("the jail is off here (not root, or no VM user)");
        return;
    };
    struct Netns(String);
    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let ip = |args: &[&str]| {
        let out = std::process::Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let ns = Netns(format!("chtest-ch-{}", std::process::id()));
    ip(&["netns", "add", &ns.0]);
    ip(&["-n", &ns.0, "tuntap", "add", "dev", "chtap1", "mode", "tap"]);
    let e = env();
    let mut spec = spec(e.tmp.path(), "base", SizeClass::Small, false);
    spec.nic = Some(crate::driver::NicSpec {
        tap: "chtap1".into(),
        mac: "02:00:00:00:00:01".into(),
        netns: Some(ns.0.clone()),
        ip_cidr: "10.99.0.2/24".into(),
        gateway: "10.99.0.1".into(),
    });
    let vm = e.driver.boot(&spec).await.expect("boot");
    let sys = |f: &str| ip(&["netns", "exec", &ns.0, "cat", &format!("/sys/class/net/chtap1/{f}")]);
    assert_eq!((sys("owner"), sys("group")), (jl.uid.to_string(), jl.gid.to_string()));
    let netns_of = |p: &str| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).expect("netns");
    assert_eq!(netns_of(&format!("/proc/{}/ns/net", vm.pid)), netns_of(&format!("/run/netns/{}", ns.0)));
    e.driver.kill(&vm).await.expect("kill");
}

/// Replaces `path` atomically by what `make` creates at the path it is given (beside `path`),
/// keeping the original as `<path>.orig` for [`put_back`]: the fake cloud-hypervisor (which
/// exits when its API socket is gone) never sees the path missing.
fn swap(path: &Path, make: impl FnOnce(&Path)) {
    let orig = path.with_extension("sock.orig");
    std::fs::hard_link(path, &orig).expect("keep the original");
    let new = path.with_extension("sock.new");
    make(&new);
    std::fs::rename(&new, path).expect("swap in");
}

fn put_back(path: &Path) {
    std::fs::rename(path.with_extension("sock.orig"), path).expect("put back");
}

#[tokio::test]
async fn sockets_swapped_for_links_or_foreign_sockets_are_refused() {
    use crate::agent::DialError;
    use crate::driver::AGENT_PORT;
    use crate::peer::{Peer, PeerError};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let e = env();
    let vm = e.driver.boot(&spec(e.tmp.path(), "base", SizeClass::Small, false)).await.expect("boot");
    let (me, my_uid) = (std::process::id(), rustix::process::geteuid().as_raw());
    assert_ne!(me, vm.pid);

    // The normal path: every socket served by the fake cloud-hypervisor itself (the pid the
    // driver spawned; the VM user in a jail), the vsock one relayed to a test playing silkd.
    e.driver.pause(&vm).await.expect("pause through the VM's own API socket");
    let guest = super::fake_api::bind_upstream(&vm, super::fake_api::VSOCK_UPSTREAM);
    let silkd = tokio::spawn(async move {
        loop {
            let (s, _) = guest.accept().await.expect("accept");
            let mut r = tokio::io::BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).await.expect("CONNECT");
            r.get_mut().write_all(b"OK 1\n").await.expect("OK");
        }
    });
    e.driver.connect(&vm, AGENT_PORT).await.expect("agent dial through the VM's own vsock socket");

    // Another process's socket: the test's own fake API (served by this test process, which
    // would answer every request with success).
    let foreign_api = e.fake.socket().to_path_buf();
    e.fake.clear();

    // 1. A symbolic link in place of api.sock: refused before connecting.
    swap(&vm.control_socket, |p| std::os::unix::fs::symlink(&foreign_api, p).expect("symlink"));
    match e.driver.resume(&vm).await {
        Err(DriverError::Peer { vm: id, source: PeerError::Link { socket } }) => {
            assert_eq!((id, socket), (vm.id.clone(), vm.control_socket.clone()));
        }
        other => panic!("expected the link refused, got {other:?}"),
    }
    put_back(&vm.control_socket);

    // 2. The foreign socket itself in place of api.sock (a hard link: nothing to refuse by
    //    path) — the peer check after connecting is what catches it.
    swap(&vm.control_socket, |p| std::fs::hard_link(&foreign_api, p).expect("hard link"));
    let err = e.driver.resume(&vm).await.expect_err("foreign API socket");
    match &err {
        DriverError::Peer { vm: id, source: PeerError::Mismatch { socket, expected, found_pid, found_uid } } => {
            assert_eq!(id, &vm.id);
            assert_eq!(socket, &vm.control_socket);
            assert_eq!((*expected, *found_pid, *found_uid), (Peer::Pid(vm.pid), me, my_uid));
        }
        other => panic!("expected a peer mismatch, got {other:?}"),
    }
    let text = crate::error_chain(&err);
    assert!(text.contains(&format!("pid {me}")) && text.contains(&format!("pid {}", vm.pid)), "{text}");
    // A re-attaching driver is refused the same way.
    let again = CloudHypervisor::new(test_config(&e.tmp.path().join("state"), &e.tmp.path().join("cloud-hypervisor")))
        .expect("driver");
    assert!(matches!(again.attach(&vm.id).await, Err(DriverError::Peer { .. })));
    put_back(&vm.control_socket);
    assert!(e.fake.calls().is_empty(), "nothing reached the foreign socket: {:?}", e.fake.calls());

    // 3. The vsock socket: a link, then another process's socket.
    let other = e.tmp.path().join("other.sock");
    let other_l = tokio::net::UnixListener::bind(&other).expect("bind other");
    swap(&vm.vsock_socket, |p| std::os::unix::fs::symlink(&other, p).expect("symlink"));
    assert!(
        matches!(
            e.driver.connect(&vm, AGENT_PORT).await,
            Err(DriverError::Agent { source: DialError::Peer(PeerError::Link { .. }), .. })
        ),
        "a link in place of vsock.sock"
    );
    put_back(&vm.vsock_socket);
    swap(&vm.vsock_socket, |p| std::fs::hard_link(&other, p).expect("hard link"));
    match e.driver.connect(&vm, AGENT_PORT).await {
        Err(DriverError::Agent {
            source: DialError::Peer(PeerError::Mismatch { expected, found_pid, .. }), ..
        }) => {
            assert_eq!((expected, found_pid), (Peer::Pid(vm.pid), me));
        }
        other => panic!("expected a peer mismatch, got {other:?}"),
    }
    // Nothing was written to it: the dial hung up before its handshake.
    let (mut s, _) = other_l.accept().await.expect("the refused connection");
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.expect("read");
    assert!(got.is_empty(), "{got:?}");
    put_back(&vm.vsock_socket);
    e.driver.connect(&vm, AGENT_PORT).await.expect("the VM's own vsock socket again");

    // 4. The console socket: the drain (re-dialling) refuses another process's socket and
    //    drains nothing from it.
    let console = vm.control_socket.with_file_name(CONSOLE_SOCKET);
    swap(&console, |p| std::fs::hard_link(&other, p).expect("hard link"));
    let (mut s, _) = tokio::time::timeout(Duration::from_secs(10), other_l.accept())
        .await
        .expect("the drain dials within its re-dial interval")
        .expect("accept");
    let _ = s.write_all(b"not the guest\n").await;
    // It hangs up without reading (a reset: our bytes were never read).
    let mut got = Vec::new();
    match s.read_to_end(&mut got).await {
        Ok(_) => assert!(got.is_empty(), "{got:?}"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert!(!crate::console::tail_string(&vm.console_log, 1 << 20).contains("not the guest"));
    put_back(&console);

    silkd.abort();
    e.driver.shutdown(&vm, Duration::from_secs(5)).await.expect("shutdown through the restored sockets");
    assert!(proc_gone(&vm));
}

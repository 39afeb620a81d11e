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
        name: name.into(),
        kernel: img.join("vmlinux"),
        initrd: img.join("initrd.cpio.gz"),
        rootfs: rootfs.then(|| img.join("rootfs.erofs")),
        overlay_base: rootfs.then(|| img.join("overlay-empty.ext4")),
        cmdline: if rootfs { "quiet".into() } else { String::new() },
        size,
        accel: AccelPreference::Auto,
        nic: None,
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

#[tokio::test]
async fn boot_sends_the_recorded_create_and_boot_then_shuts_down_cleanly() {
    let e = env();
    let spec = spec(e.tmp.path(), "rt", SizeClass::Medium, true);
    let vm = e.driver.boot(&spec).await.expect("boot");

    assert_eq!(vm.backend, Backend::CloudHypervisor);
    assert_eq!(vm.accel, Accel::Kvm);
    assert_eq!(vm.dir, e.tmp.path().join("state/vms").join(vm.id.as_str()));
    assert_eq!(vm.control_socket, vm.dir.join("api.sock"));
    assert_eq!(vm.vsock_socket, vm.dir.join("vsock.sock"));
    assert_eq!(vm.console_log, vm.dir.join("console.log"));
    assert!(vm.id.as_str().starts_with("rt-"), "{}", vm.id);
    assert!(!proc_gone(&vm), "cloud-hypervisor process should run");

    // Readiness pings first, then exactly create + boot.
    let reqs = e.fake.requests();
    assert_eq!(reqs.first().map(Recorded::line).as_deref(), Some("GET /vmm.ping"));
    let create = rendered("vm.create.medium-rt.request.json", &vars(&vm));
    assert_eq!(e.fake.calls(), vec![put("/vm.create", Some(create)), put("/vm.boot", None)]);

    // The overlay is a private copy of the base; vm.json is the returned record.
    assert_eq!(std::fs::read(vm.dir.join("overlay.raw")).expect("overlay"), b"ext4-superblock");
    let rec: Vm = crate::record::read_json(&vm.dir.join("vm.json")).expect("vm.json");
    assert_eq!(rec, vm);
    let log = std::fs::read_to_string(vm.dir.join("vmm.log")).expect("vmm.log");
    assert!(log.contains(&format!("listening on {}", vm.control_socket.display())), "{log}");

    e.fake.clear();
    e.driver.shutdown(&vm, Duration::from_secs(5)).await.expect("shutdown");
    assert_eq!(e.fake.calls(), vec![put("/vm.shutdown", None), put("/vmm.shutdown", None)]);
    assert!(proc_gone(&vm), "process outlived shutdown");
    assert!(!vm.dir.exists(), "vm dir left behind");
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
        };
        let body = serde_json::to_value(plan.to_vm_config()).expect("serialize");
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
    }
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
    std::fs::write(vm.dir.join("overlay.raw"), b"guest wrote this").expect("dirty overlay");
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

    // Already paused (vm.info says so): no second pause; AfterSnapshot::Paused: no resume.
    e.fake.clear();
    let mut info: Value = serde_json::from_str(&fixture("vm.info.running.response.json")).expect("json");
    info["state"] = json!("Paused");
    e.fake.respond("GET /vm.info", 200, &info.to_string());
    let snapdir2 = e.tmp.path().join("snaps/two");
    e.driver.snapshot(&vm, &snapdir2, AfterSnapshot::Paused).await.expect("snapshot paused vm");
    let lines: Vec<String> = e.fake.calls().iter().map(Recorded::line).collect();
    assert_eq!(lines, vec!["GET /vm.info", "PUT /vm.snapshot"]);

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
    want["disks"][1]["path"] = json!(vm.dir.join("overlay.raw").display().to_string());
    assert_eq!(cfg, want);
    for f in ["state.json", "memory-ranges"] {
        let link = std::fs::read_link(rdir.join(f)).expect("symlink");
        assert_eq!(link, snap.dir.join(f));
    }
    assert!(!rdir.join("overlay.raw").exists() && !rdir.join("snapshot.json").exists());
    assert_eq!(std::fs::read(vm.dir.join("overlay.raw")).expect("overlay"), b"golden overlay");

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
    let api = ApiClient::new(e.fake.socket(), Duration::from_secs(5));
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
    let gone = ApiClient::new(&e.tmp.path().join("nothing.sock"), Duration::from_secs(1));
    let err = gone.boot().await.expect_err("no socket");
    assert!(matches!(err, ApiError::Transport { endpoint: "PUT /vm.boot", .. }), "{err:?}");
}

#[tokio::test]
async fn client_parses_recorded_success_responses() {
    let e = env();
    let api = ApiClient::new(e.fake.socket(), Duration::from_secs(5));
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
    let bin = tmp.path().join("ch-broken");
    std::fs::write(&bin, "#!/bin/sh\necho 'Error: KVM unavailable' >&2\nexit 1\n").expect("script");
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
    // The fake cloud-hypervisor's serial socket; the driver dials it (and keeps re-dialling).
    let listener = tokio::net::UnixListener::bind(vm.control_socket.with_file_name("console.sock")).expect("bind");
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

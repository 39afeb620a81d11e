//! The image library end to end with real QEMU guests: import the built catalog's `base`
//! template (`chrysalis image import base`), boot it from the store's blob paths, snapshot the
//! running VM with `chrysalis snapshot save`, restore a clone from the materialised snapshot,
//! and check that the clone carries the source's state, that nothing modified a blob, and that
//! `gc` keeps what the live VMs use.
//!
//! Boots QEMU (TCG here) from the catalog `cargo xtask vm-image base` builds, so it runs under
//! `--features qemu-tests`; a plain `cargo test` reports it as ignored, with the reason.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use vmm::qemu::{QemuConfig, QemuDriver};
use vmm::{Driver, SizeClass, VmId};

const AGENT_TIMEOUT: Duration = Duration::from_secs(240);

/// SIGKILLs every process mentioning its needle on drop (also when an assertion failed).
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
            if pid as u32 != std::process::id() && String::from_utf8_lossy(&cmd).contains(&self.0) {
                // SAFETY: kill(2) on a positive pid has no memory effects.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

fn chrysalis(store: &Path, args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_chrysalis"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("CHRYSALIS_IMAGES")
        .output()
        .expect("run chrysalis");
    assert!(
        o.status.success(),
        "chrysalis {args:?} failed ({}):\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "qemu-tests"),
    ignore = "boots QEMU guests from the built catalog: run with --features qemu-tests"
)]
async fn snapshot_save_and_restore_through_the_store() {
    let catalog = vmm::Catalog::load_default().expect("no image catalog: run `cargo xtask vm-image base` first");
    assert!(catalog.templates.contains_key("base"), "the catalog has no `base` template");
    let tmp = tempfile::tempdir().expect("tempdir");
    let _reaper = Reaper(tmp.path().display().to_string());
    let store_dir = tmp.path().join("images");
    let state = tmp.path().join("vm-state");

    // Import the real catalog template through the CLI (default catalog path).
    let out = chrysalis(&store_dir, &["image", "import", "base", "--name", "base:test"]);
    assert!(out.starts_with("base:test sha256:"), "{out}");
    let store = images::Store::open(&store_dir).expect("open store");
    let image = store.resolve_image("base:test").expect("resolve");
    store.verify("base:test").expect("imported blobs verify");

    // Boot from the store's blob paths.
    let driver = QemuDriver::new(QemuConfig { state_dir: state.clone(), ..QemuConfig::from_env() });
    let spec = image.boot_spec("base", SizeClass::Small, vmm::AccelPreference::from_env());
    let vm = driver.boot(&spec).await.expect("boot from the store");
    let before = driver.wait_agent(&vm, AGENT_TIMEOUT).await.expect("source agent answers");
    assert_eq!(store.in_use_by(&vm).len(), 2, "kernel and initrd blobs in use");
    let marker = format!("state from {} at {:?}", vm.id, std::time::SystemTime::now());
    let mut agent = silkd_client::AgentConn::new(driver.connect(&vm, vmm::AGENT_PORT).await.expect("dial source"));
    agent.write_file("/tmp/marker", marker.as_bytes(), None).await.expect("write the marker in the source guest");
    drop(agent);

    // Snapshot it through the CLI (another process: finds the VM by its record, uses QMP only).
    let st = state.to_str().expect("utf8");
    let out = chrysalis(
        &store_dir,
        &["snapshot", "save", vm.id.as_str(), "base-snap:1", "--vm-state-dir", st, "--namespace", "team-a"],
    );
    assert!(out.starts_with("base-snap:1 sha256:"), "{out}");
    driver.wait_agent(&vm, AGENT_TIMEOUT).await.expect("the source runs on after the snapshot");
    let list: Vec<serde_json::Value> =
        serde_json::from_str(&chrysalis(&store_dir, &["snapshot", "list", "--json"])).expect("json");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["base_image"], image.digest.to_string(), "the snapshot sits on the booted image");
    assert_eq!(list[0]["namespace"], "team-a", "--namespace is recorded as the owner");

    // Restore a clone from the store.
    let snap = store.resolve_snapshot("base-snap:1").expect("materialise");
    assert!(snap.dir.join("state").is_file());
    assert_eq!(snap.snapshot.spec.kernel, image.kernel);
    let clone = driver.restore(&snap.snapshot, &VmId::new("clone-1").expect("id")).await.expect("restore");
    let after = driver.wait_agent(&clone, AGENT_TIMEOUT).await.expect("clone agent answers");
    assert!(
        after.uptime_secs >= before.uptime_secs,
        "the clone continues the source's guest (uptime {} < {})",
        after.uptime_secs,
        before.uptime_secs
    );
    assert_eq!(clone.restored_from.as_deref(), Some(snap.dir.as_path()));
    let mut agent = silkd_client::AgentConn::new(driver.connect(&clone, vmm::AGENT_PORT).await.expect("dial clone"));
    let out = agent.exec(&["cat", "/tmp/marker"], Default::default(), b"").await.expect("exec in the clone");
    assert_eq!(
        (out.code, String::from_utf8_lossy(&out.stdout).into_owned()),
        (0, marker),
        "the clone has the source's memory"
    );
    drop(agent);

    // Nothing modified a blob; gc keeps what live VMs use even once no name does.
    assert!(store.verify_all().expect("verify").is_empty(), "restore and boot modify no blob");
    let in_use: Vec<_> = [&vm, &clone].iter().flat_map(|v| store.in_use_by(v)).collect();
    assert!(in_use.contains(&snap.digest), "a clone keeps its snapshot in use");
    store.remove("base-snap:1").expect("untag snapshot");
    store.remove("base:test").expect("untag image");
    let report = store.gc(&in_use).expect("gc");
    assert_eq!(report.removed_blobs.len(), 0, "{report:?}");
    assert!(snap.dir.join("state").is_file(), "the clone's materialised snapshot stays");
    store.verify(&snap.digest.to_string()).expect("snapshot and its base image kept");

    driver.kill(&clone).await.expect("kill clone");
    driver.kill(&vm).await.expect("kill source");
    let report = store.gc(&[]).expect("gc");
    assert_eq!(report.kept_blobs, 0, "everything goes once unused: {report:?}");
}

async fn sh(driver: &QemuDriver, vm: &vmm::Vm, script: &str) -> String {
    let mut agent = silkd_client::AgentConn::new(driver.connect(vm, vmm::AGENT_PORT).await.expect("dial"));
    let out = agent.exec(&["sh", "-c", script], Default::default(), b"").await.expect("exec");
    assert_eq!(out.code, 0, "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `rt` template's kernel, initrd and rootfs with a small overlay base of our own (the
/// built 2 GiB one takes minutes to hash in a debug build): a VM with a writable disk, whose
/// snapshot overlay the store rebases onto the overlay-base blob, and a clone of a clone whose
/// overlay chain the store flattens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "qemu-tests"),
    ignore = "boots QEMU guests from the built catalog: run with --features qemu-tests"
)]
async fn rt_disk_state_survives_snapshots_of_clones() {
    let catalog = vmm::Catalog::load_default().expect("no image catalog: run `cargo xtask vm-image rt` first");
    let (_, rt) = catalog.resolve("rt").expect("the catalog has no `rt` template");
    let tmp = tempfile::tempdir().expect("tempdir");
    let _reaper = Reaper(tmp.path().display().to_string());
    let store_dir = tmp.path().join("images");
    let state = tmp.path().join("vm-state");
    let ovl = tmp.path().join("overlay-empty.ext4");
    std::fs::File::create(&ovl).expect("create").set_len(64 << 20).expect("size");
    let st = Command::new("mkfs.ext4").args(["-F", "-q", "-L", "chrysalis-ovl"]).arg(&ovl).status().expect("mkfs.ext4");
    assert!(st.success());

    let store = images::Store::open(&store_dir).expect("open store");
    let mut src = images::ImageSource::from(rt);
    src.overlay_base = Some(ovl);
    store.import_image("rt:test", &src).expect("import");
    let image = store.resolve_image("rt:test").expect("resolve");
    let driver = QemuDriver::new(QemuConfig { state_dir: state.clone(), ..QemuConfig::from_env() });
    let vm = driver
        .boot(&image.boot_spec("rt", SizeClass::Small, vmm::AccelPreference::from_env()))
        .await
        .expect("boot rt from the store");
    driver.wait_agent(&vm, AGENT_TIMEOUT).await.expect("agent");
    sh(&driver, &vm, "echo one > /root/one && sync").await;

    let st = state.to_str().expect("utf8");
    chrysalis(&store_dir, &["snapshot", "save", vm.id.as_str(), "rt-snap:1", "--vm-state-dir", st]);
    let snap = store.resolve_snapshot("rt-snap:1").expect("materialise");
    assert!(snap.snapshot.overlay.as_ref().is_some_and(|o| o.starts_with(&snap.dir)));
    let clone = driver.restore(&snap.snapshot, &VmId::new("clone-1").expect("id")).await.expect("restore");
    driver.wait_agent(&clone, AGENT_TIMEOUT).await.expect("clone agent");
    // Read through the disk, not the page cache: the clone's overlay → the snapshot's → the blob.
    let got = sh(&driver, &clone, "echo 3 > /proc/sys/vm/drop_caches; cat /root/one").await;
    assert_eq!(got, "one\n");
    sh(&driver, &clone, "echo two > /root/two && sync").await;

    // A snapshot of the clone: its overlay's backing is the first snapshot's overlay (qcow2).
    chrysalis(&store_dir, &["snapshot", "save", clone.id.as_str(), "rt-snap:2", "--vm-state-dir", st]);
    let snap2 = store.resolve_snapshot("rt-snap:2").expect("materialise");
    assert_eq!(snap2.base_image, image.digest, "a clone's snapshot sits on the same image");
    driver.kill(&clone).await.expect("kill clone");
    driver.kill(&vm).await.expect("kill source");
    // The first snapshot may go: the second does not depend on it.
    store.remove("rt-snap:1").expect("untag");
    let report = store.gc(&[]).expect("gc");
    assert!(!snap.dir.exists(), "the first snapshot is collected: {report:?}");
    let clone2 = driver.restore(&snap2.snapshot, &VmId::new("clone-2").expect("id")).await.expect("restore 2");
    driver.wait_agent(&clone2, AGENT_TIMEOUT).await.expect("clone-2 agent");
    let got = sh(&driver, &clone2, "echo 3 > /proc/sys/vm/drop_caches; cat /root/one /root/two").await;
    assert_eq!(got, "one\ntwo\n", "both generations of disk writes survive, flattened");
    assert!(store.verify_all().expect("verify").is_empty(), "nothing modified a blob");
    driver.kill(&clone2).await.expect("kill clone-2");
}

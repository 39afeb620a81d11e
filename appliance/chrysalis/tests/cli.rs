//! The `chrysalis` binary on a temp library with fake image files: import --dir, list --json,
//! rm, gc, snapshot verbs' refusals, error exit codes.

use std::path::Path;
use std::process::{Command, Output};

fn chrysalis(store: &Path, vm_state: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_chrysalis"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env("CHRYSALIS_VM_STATE_DIR", vm_state)
        .env_remove("CHRYSALIS_IMAGES")
        .env_remove("RUST_LOG")
        .output()
        .expect("run chrysalis")
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "chrysalis failed ({}):\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails(o: Output) -> String {
    assert_eq!(o.status.code(), Some(1), "expected exit 1, stdout: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn image_dir(dir: &Path, seed: &str) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join("vmlinux"), format!("kernel {seed}")).expect("write");
    std::fs::write(dir.join("initrd.cpio.gz"), format!("initrd {seed}")).expect("write");
    std::fs::write(dir.join("rootfs.erofs"), format!("rootfs {seed}")).expect("write");
    let f = std::fs::File::create(dir.join("overlay-empty.ext4")).expect("create");
    f.set_len(16 << 20).expect("sparse 16 MiB");
    std::fs::write(dir.join("cmdline"), "chrysalis.rootfs=/dev/vda\n").expect("write");
}

fn list(store: &Path, vms: &Path, what: &str) -> Vec<serde_json::Value> {
    let out = ok(chrysalis(store, vms, &[what, "list", "--json"]));
    serde_json::from_str::<Vec<serde_json::Value>>(&out).expect("list --json is a JSON array")
}

#[test]
fn import_list_rm_gc() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    let vms = tmp.path().join("vms");
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    image_dir(&a, "a");
    image_dir(&b, "b");

    let out = ok(chrysalis(
        &store,
        &vms,
        &["image", "import", "--dir", a.to_str().expect("utf8"), "--name", "ubuntu-dev-base"],
    ));
    assert!(out.starts_with("ubuntu-dev-base:latest sha256:"), "{out}");
    ok(chrysalis(
        &store,
        &vms,
        &["image", "import", "--dir", b.to_str().expect("utf8"), "--name", "other:v1", "--cmdline", "x=1"],
    ));

    let images = list(&store, &vms, "image");
    let names: Vec<&str> = images.iter().filter_map(|e| e["reference"].as_str()).collect();
    assert_eq!(names, ["other:v1", "ubuntu-dev-base:latest"]);
    let base = &images[1];
    assert_eq!(base["kind"], "image");
    assert_eq!(base["size"].as_u64(), Some((16u64 << 20) + 3 * 8), "apparent size of the four files");
    assert!(base["disk"].as_u64().expect("disk") < (2 << 20), "the overlay base stays sparse: {base}");
    assert!(list(&store, &vms, "snapshot").is_empty());

    let table = ok(chrysalis(&store, &vms, &["image", "list"]));
    assert!(table.lines().next().is_some_and(|h| h.starts_with("REFERENCE")), "{table}");
    assert!(table.contains("ubuntu-dev-base:latest"), "{table}");

    let inspect: serde_json::Value =
        serde_json::from_str(&ok(chrysalis(&store, &vms, &["image", "inspect", "ubuntu-dev-base"]))).expect("json");
    assert_eq!(inspect["manifest"]["cmdline"], "chrysalis.rootfs=/dev/vda");
    let kernel = inspect["resolved"]["kernel"].as_str().expect("kernel path");
    assert_eq!(std::fs::read_to_string(kernel).expect("blob"), "kernel a");
    let other: serde_json::Value =
        serde_json::from_str(&ok(chrysalis(&store, &vms, &["image", "inspect", "other:v1"]))).expect("json");
    assert_eq!(other["manifest"]["cmdline"], "x=1", "--cmdline wins over the cmdline file");

    ok(chrysalis(&store, &vms, &["image", "verify"]));
    ok(chrysalis(&store, &vms, &["image", "verify", "other:v1"]));

    // rm untags; gc then removes what nothing names.
    let out = ok(chrysalis(&store, &vms, &["image", "rm", "other:v1"]));
    assert!(out.starts_with("untagged other:v1"), "{out}");
    assert_eq!(list(&store, &vms, "image").len(), 1);
    assert!(Path::new(other["resolved"]["kernel"].as_str().expect("path")).exists(), "rm leaves blobs to gc");
    let gc: serde_json::Value =
        serde_json::from_str(&ok(chrysalis(&store, &vms, &["image", "gc", "--json"]))).expect("gc json");
    assert_eq!(gc["removed_manifests"].as_array().map(Vec::len), Some(1), "{gc}");
    // other's kernel, initrd, rootfs (its overlay base is the same zeros as a's).
    assert_eq!(gc["removed_blobs"].as_array().map(Vec::len), Some(3), "{gc}");
    assert_eq!(gc["kept_blobs"], 5, "{gc}");
    assert!(!Path::new(other["resolved"]["kernel"].as_str().expect("path")).exists());
    assert!(Path::new(kernel).exists(), "the tagged image stays");
    let gc2 = ok(chrysalis(&store, &vms, &["image", "gc"]));
    assert!(gc2.starts_with("removed 0 manifest(s), 0 blob(s)"), "{gc2}");

    // --keep protects an untagged image.
    let d = inspect["digest"].as_str().expect("digest").to_string();
    ok(chrysalis(&store, &vms, &["image", "rm", "ubuntu-dev-base"]));
    ok(chrysalis(&store, &vms, &["image", "gc", "--keep", &d]));
    ok(chrysalis(&store, &vms, &["image", "verify", &d]));
    ok(chrysalis(&store, &vms, &["image", "tag", &d, "again:1"]));
    assert_eq!(list(&store, &vms, "image").len(), 1);
}

#[test]
fn errors_exit_1_with_a_chain() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    let vms = tmp.path().join("vms");
    let err = fails(chrysalis(&store, &vms, &["image", "rm", "nothing-here"]));
    assert!(err.contains("nothing-here:latest: not found"), "{err}");
    let err = fails(chrysalis(&store, &vms, &["image", "import", "--dir", "/nonexistent", "--name", "x"]));
    assert!(err.contains("/nonexistent is not a directory"), "{err}");
    let a = tmp.path().join("a");
    image_dir(&a, "a");
    let err =
        fails(chrysalis(&store, &vms, &["image", "import", "--dir", a.to_str().expect("utf8"), "--name", "Bad:Name"]));
    assert!(err.contains("invalid reference \"Bad:Name\""), "{err}");
    let err = fails(chrysalis(&store, &vms, &["snapshot", "save", "no-such-vm", "s:1"]));
    assert!(err.contains("no live QEMU VM no-such-vm"), "{err}");
    let err = fails(chrysalis(&store, &vms, &["snapshot", "save", "Bad_Id", "s:1"]));
    assert!(err.contains("vm id"), "{err}");
    let err = fails(chrysalis(&store, &vms, &["snapshot", "save", "no-such-vm", "s:1", "--namespace", "Team_A"]));
    assert!(err.contains("--namespace \"Team_A\" is not a Kubernetes namespace name"), "{err}");
    ok(chrysalis(&store, &vms, &["image", "import", "--dir", a.to_str().expect("utf8"), "--name", "img"]));
    let err = fails(chrysalis(&store, &vms, &["snapshot", "rm", "img"]));
    assert!(err.contains("img is an image, not a snapshot: use `chrysalis image rm`"), "{err}");
    let catalog = tmp.path().join("catalog.json");
    let err = fails(chrysalis(&store, &vms, &["image", "import", "rt", "--catalog", catalog.to_str().expect("utf8")]));
    assert!(err.contains("loading the image catalog") && err.contains("reading catalog"), "{err}");
    std::fs::write(&catalog, r#"{"templates":{},"aliases":{}}"#).expect("write");
    let err = fails(chrysalis(&store, &vms, &["image", "import", "rt", "--catalog", catalog.to_str().expect("utf8")]));
    assert!(err.contains("unknown template \"rt\""), "{err}");
    // Usage errors are clap's (exit 2), with help.
    let o = chrysalis(&store, &vms, &["image", "import"]);
    assert_eq!(o.status.code(), Some(2));
    let help = ok(chrysalis(&store, &vms, &["image", "import", "--help"]));
    assert!(help.contains("--dir") && help.contains("catalog"), "{help}");
}

#[test]
fn import_from_a_catalog_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    let vms = tmp.path().join("vms");
    let a = tmp.path().join("a");
    image_dir(&a, "a");
    let catalog = serde_json::json!({
        "templates": {"rt": {"kernel": a.join("vmlinux"), "initrd": a.join("initrd.cpio.gz"),
            "rootfs": a.join("rootfs.erofs"), "overlay_base": a.join("overlay-empty.ext4"),
            "cmdline": "chrysalis.rootfs=/dev/vda chrysalis.overlay=/dev/vdb", "digest": "sha256:00"}},
        "aliases": {"ubuntu-dev-base": "rt"}
    });
    let cat = tmp.path().join("catalog.json");
    std::fs::write(&cat, catalog.to_string()).expect("write");
    let c = cat.to_str().expect("utf8");
    let out = ok(chrysalis(&store, &vms, &["image", "import", "ubuntu-dev-base", "--catalog", c]));
    assert!(out.starts_with("ubuntu-dev-base:latest "), "an alias imports under its own name by default: {out}");
    ok(chrysalis(
        &store,
        &vms,
        &["image", "import", "rt", "--catalog", c, "--name", "ghcr.io/cocoonstack/sandbox/rt:24.04"],
    ));
    let images = list(&store, &vms, "image");
    assert_eq!(images.len(), 2);
    assert_eq!(images[0]["digest"], images[1]["digest"], "same content, one manifest");
}

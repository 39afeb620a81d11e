//! Store behaviour on a temp root with fake image files and fake driver snapshot directories.

use std::path::{Path, PathBuf};

use crate::*;

struct Fixture {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    store: Store,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).expect("mkdir");
    let store = Store::open(tmp.path().join("store")).expect("open store");
    Fixture { _tmp: tmp, src, store }
}

fn write(p: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::write(p, bytes).expect("write");
    p.to_path_buf()
}

/// Image files whose contents depend on `seed`.
fn source(dir: &Path, seed: &str, rootfs: bool) -> ImageSource {
    ImageSource {
        kernel: write(&dir.join(format!("vmlinux-{seed}")), format!("kernel {seed}").as_bytes()),
        initrd: write(&dir.join(format!("initrd-{seed}")), format!("initrd {seed}").as_bytes()),
        rootfs: rootfs.then(|| write(&dir.join(format!("rootfs-{seed}")), format!("rootfs {seed}").as_bytes())),
        overlay_base: rootfs.then(|| write(&dir.join(format!("overlay-{seed}")), &[0u8; 8192])),
        cmdline: format!("seed={seed}"),
    }
}

fn blob_count(s: &Store) -> usize {
    std::fs::read_dir(s.root().join("blobs/sha256")).expect("readdir").count()
}

/// A fake QEMU snapshot directory (as `vmm::qemu` writes it) of a VM booted from `spec`.
fn fake_snapshot(dir: &Path, spec: vmm::BootSpec, state: &[u8]) -> vmm::Snapshot {
    std::fs::create_dir_all(dir).expect("mkdir");
    write(&dir.join("state"), state);
    let snap = vmm::Snapshot {
        dir: dir.to_path_buf(),
        backend: vmm::Backend::Qemu,
        accel: vmm::Accel::Tcg,
        source: vmm::VmId::new("src-vm").expect("id"),
        spec,
        overlay: None,
        created_at_epoch_secs: 1,
    };
    std::fs::write(dir.join(vmm::Snapshot::FILE), serde_json::to_vec(&snap).expect("ser")).expect("write");
    snap
}

fn spec_of(src: &ImageSource) -> vmm::BootSpec {
    vmm::BootSpec {
        overlay_bytes: None,
        name: "t".into(),
        kernel: src.kernel.clone(),
        initrd: src.initrd.clone(),
        rootfs: src.rootfs.clone(),
        overlay_base: src.overlay_base.clone(),
        cmdline: src.cmdline.clone(),
        size: vmm::SizeClass::Small,
        accel: vmm::AccelPreference::Tcg,
        nic: None,
        rng: true,
        volumes: true,
        ram: vmm::Ram::Anonymous,
    }
}

#[test]
fn import_then_resolve_gives_verified_blob_paths() {
    let f = fixture();
    let src = source(&f.src, "a", true);
    let d = f.store.import_image("ubuntu-dev-base", &src).expect("import");
    let r = f.store.resolve_image("ubuntu-dev-base:latest").expect("resolve by the latest tag");
    assert_eq!(r.digest, d);
    for (p, orig) in [(&r.kernel, &src.kernel), (&r.initrd, &src.initrd)] {
        assert!(p.starts_with(f.store.root().join("blobs/sha256")), "{}", p.display());
        assert_eq!(std::fs::read(p).expect("blob"), std::fs::read(orig).expect("source"));
        let (h, _) = crate::blobs::hash_file(p).expect("hash");
        assert_eq!(p.file_name().and_then(|n| n.to_str()), Some(h.hex()), "blob name is its content hash");
    }
    assert!(r.rootfs.as_ref().is_some_and(|p| p.is_file()));
    assert!(r.overlay_base.as_ref().is_some_and(|p| p.is_file()));
    assert_eq!(r.cmdline, "seed=a");
    let spec = r.boot_spec("ubuntu-dev-base", vmm::SizeClass::Medium, vmm::AccelPreference::Auto);
    assert_eq!(spec.kernel, r.kernel);
    assert_eq!(spec.rootfs, r.rootfs);
    f.store.verify("ubuntu-dev-base").expect("verify");
    // By digest too.
    assert_eq!(f.store.resolve(&d.to_string()).expect("by digest").digest(), &d);
    // Sources are untouched and still writable (copied, not hard-linked).
    std::fs::write(&src.kernel, b"rebuilt").expect("source stays writable");
    f.store.verify("ubuntu-dev-base").expect("the blob did not change with its source");
}

#[test]
fn tags_untag_and_latest_default() {
    let f = fixture();
    let a = f.store.import_image("rt:24.04", &source(&f.src, "a", false)).expect("import a");
    let b = f.store.import_image("rt", &source(&f.src, "b", false)).expect("import b");
    assert_ne!(a, b);
    assert_eq!(f.store.lookup("rt").expect("bare"), b);
    assert_eq!(f.store.lookup("rt:latest").expect("latest"), b);
    assert_eq!(f.store.lookup("rt:24.04").expect("tag"), a);
    // Re-importing identical content under a new tag reuses the manifest.
    assert_eq!(f.store.import_image("rt:again", &source(&f.src, "a", false)).expect("re-import"), a);
    assert_eq!(f.store.tag("rt:24.04", "ghcr.io/cocoonstack/sandbox/rt:24.04").expect("tag"), a);
    let names: Vec<String> = f.store.list().expect("list").iter().map(|e| e.reference.to_string()).collect();
    assert_eq!(names, ["ghcr.io/cocoonstack/sandbox/rt:24.04", "rt:24.04", "rt:again", "rt:latest"]);
    let e = f.store.list().expect("list").into_iter().find(|e| e.reference.tag() == "24.04").expect("entry");
    assert_eq!((e.kind, e.size), (Kind::Image, ("kernel a".len() + "initrd a".len()) as u64));
    assert_eq!(f.store.remove("rt").expect("untag"), b);
    assert!(matches!(f.store.lookup("rt:latest"), Err(ImageError::NotFound { .. })));
    assert!(matches!(f.store.remove("rt"), Err(ImageError::NotFound { .. })));
    assert!(f.store.resolve_image("rt:24.04").is_ok(), "other tags stay");
    assert!(f.store.blob_path(&b).is_file(), "untag removes no blob");
}

#[test]
fn remove_if_untags_only_what_the_name_still_names() {
    let f = fixture();
    let a = f.store.import_image("rt", &source(&f.src, "a", false)).expect("import a");
    // The name is re-pointed after `a` was seen: the conditional remove leaves it.
    let b = f.store.import_image("rt", &source(&f.src, "b", false)).expect("import b");
    assert!(!f.store.remove_if("rt", &a).expect("stale digest"));
    assert_eq!(f.store.lookup("rt").expect("kept"), b);
    assert!(f.store.remove_if("rt:latest", &b).expect("current digest"));
    assert!(matches!(f.store.lookup("rt"), Err(ImageError::NotFound { .. })));
    assert!(!f.store.remove_if("rt", &b).expect("an absent name"));
    assert!(matches!(f.store.remove_if("Bad", &b), Err(ImageError::BadRef { .. })));
}

#[test]
fn bad_references_and_inputs_are_refused() {
    let f = fixture();
    let src = source(&f.src, "a", false);
    for bad in ["Upper", "a:", "", "x y", "sha256:abc", "a/../b"] {
        assert!(matches!(f.store.import_image(bad, &src), Err(ImageError::BadRef { .. })), "{bad:?}");
        assert!(matches!(f.store.resolve(bad), Err(ImageError::BadRef { .. }) | Err(ImageError::NotFound { .. })));
    }
    assert!(matches!(f.store.resolve("nope"), Err(ImageError::NotFound { .. })));
    let zeros = format!("sha256:{}", "0".repeat(64));
    assert!(matches!(f.store.resolve(&zeros), Err(ImageError::NotFound { .. })));
    let mut missing = src.clone();
    missing.rootfs = Some(f.src.join("no-such-file"));
    assert!(matches!(f.store.import_image("x", &missing), Err(ImageError::Io { .. })));
    let mut dir = src;
    dir.initrd = f.src.clone();
    assert!(matches!(f.store.import_image("x", &dir), Err(ImageError::Invalid(_))));
    assert!(f.store.list().expect("list").is_empty(), "failed imports name nothing");
    // A garbage refs.json is a typed error, not a panic.
    std::fs::write(f.store.root().join("refs.json"), b"{").expect("write");
    assert!(matches!(f.store.list(), Err(ImageError::Refs { .. })));
}

#[test]
fn snapshot_save_and_materialise() {
    let f = fixture();
    let src = source(&f.src, "a", false);
    let img = f.store.import_image("base", &src).expect("import");
    let booted = f.store.resolve_image("base").expect("resolve");
    // The VM was booted from the store's blobs: the snapshot's base is that same image.
    let spec = booted.boot_spec("base", vmm::SizeClass::Small, vmm::AccelPreference::Tcg);
    let sdir = f.src.join("snap");
    let snap = fake_snapshot(&sdir, spec, b"migration stream");
    std::fs::create_dir_all(sdir.join("sub")).expect("mkdir");
    write(&sdir.join("sub/extra"), b"extra");
    let before = blob_count(&f.store);
    let sd = f.store.save_snapshot("vk-default-pod:latest", &snap).expect("save");
    assert_eq!(blob_count(&f.store), before + 3, "state + extra + manifest; no new image blobs");
    assert!(sdir.join("state").is_file(), "save_snapshot copies");
    let Manifest::Snapshot(m) = f.store.manifest(&sd).expect("manifest") else { panic!("not a snapshot manifest") };
    assert_eq!(m.base_image, img);
    assert_eq!(m.files.keys().collect::<Vec<_>>(), ["state", "sub/extra"]);
    let r = f.store.resolve_snapshot("vk-default-pod").expect("materialise");
    assert_eq!(r.dir, f.store.root().join(MATERIALISED_DIR).join(sd.hex()));
    assert_eq!(std::fs::read(r.dir.join("state")).expect("state"), b"migration stream");
    assert_eq!(std::fs::read(r.dir.join("sub/extra")).expect("extra"), b"extra");
    let loaded = vmm::Snapshot::load(&r.dir).expect("snapshot.json the driver reads");
    assert_eq!(loaded, r.snapshot);
    assert_eq!(loaded.dir, r.dir);
    assert_eq!(loaded.spec.kernel, booted.kernel);
    assert_eq!(loaded.source.as_str(), "src-vm");
    // Materialised files are the blobs (hard links), not copies.
    use std::os::unix::fs::MetadataExt;
    let ino = |p: &Path| std::fs::metadata(p).expect("stat").ino();
    assert_eq!(ino(&r.dir.join("state")), ino(&f.store.blob_path(&m.files["state"])));
    // Resolving again reuses the directory.
    assert_eq!(f.store.resolve_snapshot(&sd.to_string()).expect("again").dir, r.dir);
    assert!(matches!(f.store.resolve_image("vk-default-pod"), Err(ImageError::WrongKind { .. })));
    assert!(matches!(f.store.resolve_snapshot("base"), Err(ImageError::WrongKind { .. })));
    let e = f.store.list().expect("list").into_iter().find(|e| e.kind == Kind::Snapshot).expect("entry");
    assert_eq!((e.size, e.base_image.as_ref()), (("migration stream".len() + 5) as u64, Some(&img)));

    // A VM booted from files outside the store: its image is imported as the snapshot's base.
    let other = source(&f.src, "b", false);
    let snap2 = fake_snapshot(&f.src.join("snap2"), spec_of(&other), b"s2");
    let sd2 = f.store.save_snapshot_moving("fork:1", &snap2).expect("save moving");
    assert!(!f.src.join("snap2").exists(), "moving consumes the directory");
    let r2 = f.store.resolve_snapshot("fork:1").expect("resolve");
    assert_ne!(r2.base_image, img);
    assert!(r2.snapshot.spec.kernel.starts_with(f.store.root()));
    assert_eq!(std::fs::read(&r2.snapshot.spec.kernel).expect("kernel"), b"kernel b");
    f.store.verify(&sd2.to_string()).expect("verify snapshot and its base");

    // Bad snapshot inputs.
    let mut gone = snap.clone();
    gone.dir = f.src.join("nothing-here");
    assert!(matches!(f.store.save_snapshot("x", &gone), Err(ImageError::Invalid(_))));
    let mut outside = snap;
    outside.overlay = Some(f.src.join("elsewhere.qcow2"));
    assert!(matches!(f.store.save_snapshot("x", &outside), Err(ImageError::Invalid(_))));
}

#[test]
fn a_snapshot_records_its_owning_namespace_and_old_manifests_have_none() {
    let f = fixture();
    let src = source(&f.src, "a", false);
    f.store.import_image("base", &src).expect("import");
    let spec = f.store.resolve_image("base").expect("resolve").boot_spec(
        "base",
        vmm::SizeClass::Small,
        vmm::AccelPreference::Tcg,
    );
    let owned = fake_snapshot(&f.src.join("s1"), spec.clone(), b"one");
    let d = f.store.save_snapshot_moving_for("team-a-vm:latest", &owned, Some("team-a")).expect("save");
    let m = f.store.manifest(&d).expect("manifest");
    assert_eq!(m.namespace(), Some("team-a"));
    let e = f.store.list().expect("list").into_iter().find(|e| e.digest == d).expect("entry");
    assert_eq!(e.namespace.as_deref(), Some("team-a"));
    // Without one: no `namespace` key at all, so manifests written before it existed (and
    // their digests) are unchanged, and they read back as `None`.
    let plain = fake_snapshot(&f.src.join("s2"), spec.clone(), b"two");
    let d2 = f.store.save_snapshot_moving_for("plain:latest", &plain, None).expect("save");
    let bytes = std::fs::read(f.store.blob_path(&d2)).expect("manifest blob");
    assert!(!String::from_utf8_lossy(&bytes).contains("namespace"));
    assert_eq!(f.store.manifest(&d2).expect("manifest").namespace(), None);
    // Not a namespace name: refused before anything is stored.
    for bad in ["", "Team-A", "-a", "a-", "a/b", &"x".repeat(64)] {
        let s = fake_snapshot(&f.src.join("s3"), spec.clone(), b"three");
        assert!(
            matches!(f.store.save_snapshot_moving_for("bad:1", &s, Some(bad)), Err(ImageError::Invalid(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(f.store.lookup("bad:1"), Err(ImageError::NotFound { .. })));
    assert!(crate::valid_namespace("default") && crate::valid_namespace("a") && crate::valid_namespace("0-9"));
}

#[test]
fn gc_keeps_named_snapshot_bases_and_in_use() {
    let f = fixture();
    f.store.import_image("kept", &source(&f.src, "kept", true)).expect("import");
    let base = f.store.import_image("base", &source(&f.src, "base", false)).expect("import");
    let live = f.store.import_image("live", &source(&f.src, "live", false)).expect("import");
    let live2 = f.store.import_image("live2", &source(&f.src, "live2", false)).expect("import");
    let dead = f.store.import_image("dead", &source(&f.src, "dead", false)).expect("import");
    let spec = f.store.resolve_image("base").expect("resolve").boot_spec(
        "b",
        vmm::SizeClass::Small,
        vmm::AccelPreference::Tcg,
    );
    let sd = f.store.save_snapshot("snap", &fake_snapshot(&f.src.join("s"), spec, b"state")).expect("save");
    let dead_snap_spec =
        f.store.resolve_image("dead").expect("r").boot_spec("d", vmm::SizeClass::Small, vmm::AccelPreference::Tcg);
    let dsd =
        f.store.save_snapshot("dsnap", &fake_snapshot(&f.src.join("ds"), dead_snap_spec, b"dstate")).expect("save");
    let mat = f.store.resolve_snapshot("snap").expect("materialise").dir;
    let dmat = f.store.resolve_snapshot("dsnap").expect("materialise").dir;
    let live_paths = f.store.resolve_image("live").expect("r");
    std::fs::write(f.store.root().join("tmp/.blob-leftover"), b"x").expect("leftover");

    for r in ["base", "live", "live2", "dead", "dsnap"] {
        f.store.remove(r).expect("untag");
    }
    // What a VM booted from `live` reports as in use.
    let vm = vmm::Vm {
        id: vmm::VmId::new("v").expect("id"),
        backend: vmm::Backend::Qemu,
        accel: vmm::Accel::Tcg,
        pid: 0,
        pid_start_time: 0,
        dir: f.src.clone(),
        control_socket: f.src.clone(),
        vsock_socket: f.src.clone(),
        console_log: f.src.clone(),
        spec: live_paths.boot_spec("l", vmm::SizeClass::Small, vmm::AccelPreference::Tcg),
        restored_from: None,
        created_at_epoch_secs: 0,
        state: vmm::VmState::Running,
    };
    let mut in_use = f.store.in_use_by(&vm);
    assert_eq!(in_use.len(), 2, "kernel and initrd blobs");
    // And an image manifest in use (its blobs are followed).
    in_use.push(live2.clone());
    let report = f.store.gc(&in_use).expect("gc");
    let removed: std::collections::HashSet<_> = report.removed_manifests.iter().collect();
    assert_eq!(removed, [&dead, &dsd, &live].into_iter().collect(), "{report:?}");
    assert_eq!(report.removed_blobs.len(), 3, "dead kernel, initrd and dsnap state: {report:?}");
    assert_eq!((report.removed_materialised, report.removed_temp), (1, 1), "{report:?}");
    assert!(!dmat.exists() && mat.exists());
    f.store.verify("kept").expect("tagged image kept");
    f.store.verify("snap").expect("named snapshot kept");
    f.store.verify(&base.to_string()).expect("the snapshot's untagged base image is kept");
    f.store.verify(&live2.to_string()).expect("in-use image is kept");
    assert!(live_paths.kernel.is_file() && live_paths.initrd.is_file(), "blobs a live VM uses are kept");
    assert!(matches!(f.store.resolve(&dead.to_string()), Err(ImageError::NotFound { .. })));
    assert_eq!(f.store.resolve_snapshot("snap").expect("still restorable").digest, sd);

    // Nothing in use any more, names gone: everything goes.
    f.store.remove("snap").expect("untag");
    f.store.remove("kept").expect("untag");
    let report = f.store.gc(&[]).expect("gc");
    assert_eq!(report.kept_blobs, 0, "{report:?}");
    assert_eq!(blob_count(&f.store), 0);
    assert!(!mat.exists());
}

#[test]
fn gc_refuses_to_guess_when_a_named_manifest_is_corrupt() {
    let f = fixture();
    let d = f.store.import_image("a", &source(&f.src, "a", false)).expect("import");
    let p = f.store.blob_path(&d);
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o644)).expect("chmod");
    std::fs::write(&p, b"{\"kind\":\"image\"}").expect("corrupt");
    assert!(matches!(f.store.gc(&[]), Err(ImageError::Corrupt { .. })));
    assert_eq!(blob_count(&f.store), 3, "nothing removed");
}

#[test]
fn verify_detects_a_corrupted_blob() {
    let f = fixture();
    f.store.import_image("a", &source(&f.src, "a", true)).expect("import");
    let r = f.store.resolve_image("a").expect("resolve");
    let rootfs = r.rootfs.expect("rootfs");
    std::fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o644)).expect("chmod");
    std::fs::write(&rootfs, b"bit rot").expect("corrupt");
    let want = Digest::from_hex(rootfs.file_name().and_then(|n| n.to_str()).expect("name")).expect("hex");
    match f.store.verify("a") {
        Err(ImageError::Corrupt { digest, .. }) => assert_eq!(digest, want),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(f.store.verify_all().expect("verify all"), vec![want]);
    std::fs::remove_file(&rootfs).expect("rm");
    assert!(matches!(f.store.verify("a"), Err(ImageError::MissingBlob { .. })));
    assert!(matches!(f.store.resolve("a"), Err(ImageError::MissingBlob { .. })));
}

#[test]
fn concurrent_imports_of_the_same_content_store_one_blob_each() {
    let f = fixture();
    let src = source(&f.src, "same", true);
    let root = f.store.root().to_path_buf();
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let src = src.clone();
            let root = root.clone();
            std::thread::spawn(move || {
                let s = Store::open(&root).expect("open");
                s.import_image(&format!("img:t{i}"), &src).expect("import")
            })
        })
        .collect();
    let digests: Vec<Digest> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
    assert_eq!(f.store.list().expect("list").len(), 6, "every tag was written (no lost refs.json update)");
    // 4 file blobs; manifests may differ only by creation time when imports raced.
    let manifests: std::collections::HashSet<_> = digests.iter().collect();
    assert_eq!(blob_count(&f.store), 4 + manifests.len());
    assert!(std::fs::read_dir(root.join("tmp")).expect("tmp").next().is_none(), "no temp files left");
}

#[cfg(feature = "qemu-tests")]
fn run_tool(program: &str, args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new(program).args(args).output().expect(program);
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// A qcow2 on `backing` with 512 bytes of `pattern` written at `offset`.
#[cfg(feature = "qemu-tests")]
fn qcow2_overlay(path: &Path, backing: &Path, backing_fmt: &str, offset: u64, pattern: u8) {
    let (p, b) = (path.display().to_string(), backing.display().to_string());
    run_tool("qemu-img", &["create", "-q", "-f", "qcow2", "-F", backing_fmt, "-b", &b, &p]);
    let cmd = format!("write -P {pattern} {offset} 512");
    run_tool("qemu-io", &["-f", "qcow2", "-c", &cmd, &p]);
}

/// The guest-visible bytes of a qcow2 (through its backing chain).
#[cfg(feature = "qemu-tests")]
fn guest_bytes(qcow2: &Path, scratch: &Path) -> Vec<u8> {
    let raw = scratch.join("flat.raw");
    let _ = std::fs::remove_file(&raw);
    run_tool(
        "qemu-img",
        &["convert", "-f", "qcow2", "-O", "raw", &qcow2.display().to_string(), &raw.display().to_string()],
    );
    std::fs::read(&raw).expect("read flat")
}

#[test]
#[cfg_attr(not(feature = "qemu-tests"), ignore = "runs qemu-img: enable the qemu-tests feature")]
fn snapshot_overlay_is_rebased_onto_the_overlay_base_blob() {
    #[cfg(feature = "qemu-tests")]
    {
        let f = fixture();
        let src = source(&f.src, "a", true);
        f.store.import_image("rt", &src).expect("import");
        // The VM booted from the catalog copy, not the store: the overlay's backing is the source file.
        let sdir = f.src.join("snap");
        let mut snap = fake_snapshot(&sdir, spec_of(&src), b"state");
        let ov = sdir.join("overlay.qcow2");
        qcow2_overlay(&ov, src.overlay_base.as_ref().expect("ob"), "raw", 0, 0xab);
        snap.overlay = Some(ov);
        let d = f.store.save_snapshot("rt-snap", &snap).expect("save");
        let r = f.store.resolve_snapshot("rt-snap").expect("resolve");
        assert_eq!(r.snapshot.overlay.as_deref(), Some(r.dir.join("overlay.qcow2").as_path()));
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json", "--backing-chain"])
            .arg(r.dir.join("overlay.qcow2"))
            .output()
            .expect("qemu-img info");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let chain: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let ob_blob = f.store.resolve_image("rt").expect("img").overlay_base.expect("ob");
        assert_eq!(
            chain[0]["backing-filename"],
            format!("../../blobs/sha256/{}", ob_blob.file_name().and_then(|n| n.to_str()).expect("n"))
        );
        assert_eq!(chain[0]["backing-filename-format"], "raw");
        let full = chain[0]["full-backing-filename"].as_str().expect("full");
        assert_eq!(std::fs::canonicalize(full).expect("resolves"), ob_blob);
        f.store.verify(&d.to_string()).expect("verify");
        let bytes = guest_bytes(&r.dir.join("overlay.qcow2"), &f.src);
        assert_eq!(bytes.len(), 8192);
        assert!(bytes[..512].iter().all(|b| *b == 0xab) && bytes[512..].iter().all(|b| *b == 0), "overlay data kept");

        // A snapshot of a clone: the overlay's backing is the materialised snapshot overlay (qcow2).
        let sdir2 = f.src.join("snap2");
        let mut snap2 = fake_snapshot(&sdir2, r.snapshot.spec.clone(), b"state2");
        let ov2 = sdir2.join("overlay.qcow2");
        qcow2_overlay(&ov2, &r.dir.join("overlay.qcow2"), "qcow2", 4096, 0xcd);
        snap2.overlay = Some(ov2);
        f.store.save_snapshot("rt-snap2", &snap2).expect("save clone snapshot");
        let r2 = f.store.resolve_snapshot("rt-snap2").expect("resolve");
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(r2.dir.join("overlay.qcow2"))
            .output()
            .expect("qemu-img info");
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(info["backing-filename-format"], "raw", "flattened onto the overlay base: {info}");
        let bytes = guest_bytes(&r2.dir.join("overlay.qcow2"), &f.src);
        assert!(bytes[..512].iter().all(|b| *b == 0xab), "the parent snapshot's writes are folded in");
        assert!(bytes[4096..4608].iter().all(|b| *b == 0xcd), "the clone's own writes are kept");
        assert!(bytes[512..4096].iter().all(|b| *b == 0));
        // Neither snapshot's blobs were modified by any of it.
        assert!(f.store.verify_all().expect("verify").is_empty());
    }
}

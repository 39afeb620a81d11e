//! The host root tree: the Debian base from mmdebstrap (cached tarball), `rootfs/overlay/`, our
//! release binaries, the shipped VM images and the trusted update keys. The tree is cached per input
//! hash under `$CHRYSALIS_CACHE/appliance/<board>/tree-<key>/root`, so building another
//! version only rewrites the version files ([`stamp_version`]) and re-packs the root.

use super::board::{Board, HostOs};
use crate::prereqs::VM_USER;
use crate::vm_image::catalog::{BuiltCatalog, BuiltTemplate};
use crate::vm_image::rootfs::{self, Debootstrap};
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bump when the tree layout produced here changes.
const TREE_FORMAT: &str = "chrysalis-host-tree-v2";
/// Where the VM images go in the root.
pub const VM_IMAGES_DIR: &str = "usr/share/chrysalis/vm-images";
/// Directories the fstab mounts on that Debian does not create.
const MOUNT_POINTS: &[&str] = &["efi"];
/// Shared libraries our binaries may link (all in Debian's essential set).
const ALLOWED_LIBS: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libutil.so.1",
];

/// Everything the tree is made of.
pub struct TreeInputs<'a> {
    pub board: &'a Board,
    /// Release binaries: name in /usr/bin → built file.
    pub binaries: &'a BTreeMap<String, PathBuf>,
    /// Shipped VM templates, by name.
    pub templates: &'a BTreeMap<String, BuiltTemplate>,
    /// The trusted update public keys (`usr/share/chrysalis/update-keys/<name>`).
    pub update_keys: &'a [crate::keys::PublicKeyFile],
}

/// A prepared tree.
pub struct Tree {
    /// The root directory.
    pub root: PathBuf,
    /// Hash of its inputs.
    pub key: String,
    /// Debian `(package, version)` list of the tree.
    pub packages: Vec<(String, String)>,
}

/// mmdebstrap for the host OS; returns the tarball and its key.
pub fn debootstrap(host: &HostOs, board: &Board, force: bool) -> Result<(PathBuf, String)> {
    let mut packages = host.packages.clone();
    packages.extend(board.packages.extra.iter().cloned());
    packages.extend(board.packages.firmware.iter().cloned());
    let components = host.components.join(" ");
    // The host's mirrors, with our components (the host may only enable `main`).
    let mirrors = rootfs::host_mirrors(&host.suite)?
        .into_iter()
        .map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            match parts.as_slice() {
                ["deb", uri, suite, ..] => format!("deb {uri} {suite} {components}"),
                _ => line.clone(),
            }
        })
        .collect();
    let mut hooks = Vec::new();
    if !host.purge.is_empty() {
        hooks.push(format!(
            r#"chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get -y -q purge {} && chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get -y -q --purge autoremove"#,
            host.purge.join(" ")
        ));
    }
    if !host.enable.is_empty() {
        hooks.push(format!(r#"chroot "$1" systemctl enable {}"#, host.enable.join(" ")));
    }
    if !host.mask.is_empty() {
        hooks.push(format!(r#"chroot "$1" systemctl mask {}"#, host.mask.join(" ")));
    }
    for path in &host.remove {
        if path.starts_with('/') || path.contains("..") || path.contains(char::is_whitespace) || path.contains('"') {
            bail!("rootfs/packages.toml: remove entry {path:?} must be relative, without `..`, spaces or quotes");
        }
        // Unquoted after "$1"/ so that globs expand.
        hooks.push(format!(r#"rm -rf "$1"/{path}"#));
    }
    let mut dpkg_opts: Vec<String> = host.path_exclude.iter().map(|p| format!("path-exclude={p}")).collect();
    dpkg_opts.extend(host.path_include.iter().map(|p| format!("path-include={p}")));
    let run = Debootstrap {
        label: "image".into(),
        suite: host.suite.clone(),
        variant: host.variant.clone(),
        packages,
        mirrors,
        hooks,
        dpkg_opts,
    };
    rootfs::debootstrap_with(&crate::paths::cache_dir(), &run, host.source_date_epoch, force)
}

/// Makes (or finds) the tree for `inputs` on top of the mmdebstrap `tarball`.
pub fn prepare(
    board_dir: &Path,
    tarball: &Path,
    tarball_key: &str,
    overlay: &Path,
    inputs: &TreeInputs<'_>,
) -> Result<Tree> {
    let key = tree_key(tarball_key, overlay, inputs)?;
    let dir = board_dir.join(format!("tree-{key}"));
    let root = dir.join("root");
    let ready = dir.join(".ready");
    if !ready.is_file() {
        // One cached tree per board: the previous one is dropped.
        if let Ok(entries) = fs::read_dir(board_dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("tree-") {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        fs::create_dir_all(&root)?;
        build(&root, tarball, overlay, inputs)?;
        fs::copy(root.join("usr/lib/os-release"), dir.join("os-release.base")).context("saving os-release")?;
        fs::write(&ready, &key)?;
    } else {
        eprintln!("image: cached root tree {}", root.display());
    }
    let packages = packages(&root)?;
    Ok(Tree { root, key, packages })
}

/// Writes the version-dependent files: `/usr/lib/os-release` (+ IMAGE_ID/IMAGE_VERSION/
/// CHRYSALIS_SECURITY_VERSION) and `/usr/share/chrysalis/image.json` (the updater reads `board`
/// and `security_version` from it).
pub fn stamp_version(tree: &Tree, board: &str, version: &str, build_id: &str, security_version: u64) -> Result<()> {
    let base = tree.root.parent().context("tree has no parent")?.join("os-release.base");
    let mut os = fs::read_to_string(&base).with_context(|| format!("reading {}", base.display()))?;
    if !os.ends_with('\n') {
        os.push('\n');
    }
    os.push_str(&format!(
        "VARIANT=\"Chrysalis appliance\"\nVARIANT_ID=chrysalis\nIMAGE_ID=chrysalis-{board}\nIMAGE_VERSION={version}\n\
         CHRYSALIS_SECURITY_VERSION={security_version}\n"
    ));
    fs::write(tree.root.join("usr/lib/os-release"), os)?;
    let image = serde_json::json!({
        "board": board,
        "version": version,
        "build_id": build_id,
        "security_version": security_version,
        "generation_hint": 1,
    });
    fs::write(
        tree.root.join("usr/share/chrysalis/image.json"),
        format!("{}\n", serde_json::to_string_pretty(&image)?),
    )?;
    Ok(())
}

fn tree_key(tarball_key: &str, overlay: &Path, inputs: &TreeInputs<'_>) -> Result<String> {
    let mut h = Sha256::new();
    let mut line = |s: String| {
        h.update(s.as_bytes());
        h.update(b"\n");
    };
    line(TREE_FORMAT.into());
    line(format!("debian {tarball_key}"));
    for entry in walk(overlay)? {
        let path = overlay.join(&entry);
        let meta = fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            line(format!("link {} {}", entry.display(), fs::read_link(&path)?.display()));
        } else if meta.is_file() {
            line(format!("file {} {:o} {}", entry.display(), meta.permissions().mode() & 0o7777, sha256(&path)?));
        } else {
            line(format!("dir {}", entry.display()));
        }
    }
    for (name, path) in inputs.binaries {
        line(format!("bin {name} {}", sha256(path)?));
    }
    for (name, t) in inputs.templates {
        line(format!("template {name} {} kernel {}", t.digest, sha256(&t.kernel)?));
    }
    for (alias, target) in &inputs.board.vm_images.aliases {
        line(format!("alias {alias} {target}"));
    }
    for key in inputs.update_keys {
        line(format!("key {} {}", key.name, key.text.trim()));
    }
    Ok(hex::encode(h.finalize())[..16].to_string())
}

fn build(root: &Path, tarball: &Path, overlay: &Path, inputs: &TreeInputs<'_>) -> Result<()> {
    eprintln!("image: unpacking the Debian base into {}", root.display());
    // Device nodes are skipped (devtmpfs provides /dev); unprivileged tar keeps our uid, and the
    // erofs build makes every file root's anyway.
    run(
        Command::new("tar")
            .arg("--numeric-owner")
            .arg("--exclude=./dev/*")
            .arg("-xpf")
            .arg(tarball)
            .arg("-C")
            .arg(root),
        "unpacking the Debian base",
    )?;
    run(
        Command::new("cp").arg("-a").arg("--no-preserve=ownership").arg(overlay.join(".")).arg(root),
        "adding rootfs/overlay",
    )?;
    add_vm_user(root)?;
    // Mount points on the read-only root (the ESP; the rest live on tmpfs /var and /run).
    for dir in MOUNT_POINTS {
        fs::create_dir_all(root.join(dir))?;
    }
    let bin = root.join("usr/bin");
    for (name, path) in inputs.binaries {
        check_links(path)?;
        let dest = bin.join(name);
        run(Command::new("strip").arg("-o").arg(&dest).arg(path), &format!("stripping {name}"))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))?;
    }
    let keys = root.join("usr/share/chrysalis/update-keys");
    fs::create_dir_all(&keys)?;
    for key in inputs.update_keys {
        fs::write(keys.join(&key.name), &key.text)?;
    }
    install_vm_images(root, inputs)?;
    Ok(())
}

/// The uid and gid of [`VM_USER`] (every microVM's hypervisor runs as it, `vmm::jail`) in
/// the host image.
pub const VM_UID: u32 = 990;

/// Adds [`VM_USER`] to the tree's `/etc/passwd`, `/etc/group` and `/etc/shadow` (locked, no
/// shell, no home) unless it is there already.
fn add_vm_user(root: &Path) -> Result<()> {
    let lines = [
        ("etc/passwd", format!("{VM_USER}:x:{VM_UID}:{VM_UID}:Chrysalis microVMs:/nonexistent:/usr/sbin/nologin")),
        ("etc/group", format!("{VM_USER}:x:{VM_UID}:")),
        ("etc/shadow", format!("{VM_USER}:!:1::::::")),
    ];
    for (file, line) in lines {
        let path = root.join(file);
        let mut text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && file == "etc/shadow" => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        if text.lines().any(|l| l.split(':').next() == Some(VM_USER)) {
            continue;
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Copies the templates into `/usr/share/chrysalis/vm-images/` and writes its catalog with
/// paths in the image and the board's aliases.
fn install_vm_images(root: &Path, inputs: &TreeInputs<'_>) -> Result<()> {
    let dir = root.join(VM_IMAGES_DIR);
    fs::create_dir_all(&dir)?;
    let image_path = |rel: &str| Path::new("/").join(VM_IMAGES_DIR).join(rel);
    let mut catalog = BuiltCatalog::default();
    let mut kernels: BTreeMap<String, String> = BTreeMap::new();
    for (name, t) in inputs.templates {
        let ksha = sha256(&t.kernel)?;
        let kname = match kernels.get(&ksha) {
            Some(k) => k.clone(),
            None => {
                let k = if kernels.is_empty() { "vmlinux".to_string() } else { format!("vmlinux-{}", &ksha[..12]) };
                fs::copy(&t.kernel, dir.join(&k)).with_context(|| format!("copying {}", t.kernel.display()))?;
                kernels.insert(ksha, k.clone());
                k
            }
        };
        fs::create_dir_all(dir.join(name))?;
        let mut copy = |src: &Path| -> Result<PathBuf> {
            let file = src.file_name().context("template file without a name")?.to_string_lossy().into_owned();
            let rel = format!("{name}/{file}");
            // --sparse keeps the empty overlay images small in the tree.
            run(Command::new("cp").arg("--sparse=always").arg(src).arg(dir.join(&rel)), "copying a template")?;
            Ok(image_path(&rel))
        };
        let built = BuiltTemplate {
            kernel: image_path(&kname),
            initrd: copy(&t.initrd)?,
            rootfs: t.rootfs.as_deref().map(&mut copy).transpose()?,
            overlay_base: t.overlay_base.as_deref().map(&mut copy).transpose()?,
            cmdline: t.cmdline.clone(),
            digest: t.digest.clone(),
        };
        catalog.templates.insert(name.clone(), built);
    }
    catalog.aliases = inputs.board.vm_images.aliases.clone();
    fs::write(dir.join("catalog.json"), format!("{}\n", serde_json::to_string_pretty(&catalog)?))?;
    Ok(())
}

/// Refuses a binary that needs a shared library outside glibc and libgcc.
fn check_links(bin: &Path) -> Result<()> {
    let out = Command::new("readelf").arg("-d").arg(bin).output().context("running readelf")?;
    if !out.status.success() {
        bail!("readelf -d {} failed", bin.display());
    }
    for line in String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("(NEEDED)")) {
        let lib = line.split('[').nth(1).and_then(|r| r.split(']').next()).unwrap_or(line);
        if !ALLOWED_LIBS.contains(&lib) {
            bail!("{} links {lib}, which the image does not ship (only glibc and libgcc)", bin.display());
        }
    }
    Ok(())
}

/// `(package, version)` of every package installed in the tree.
fn packages(root: &Path) -> Result<Vec<(String, String)>> {
    let out = Command::new("dpkg-query")
        .arg(format!("--admindir={}", root.join("var/lib/dpkg").display()))
        .args(["-W", "-f=${Package}\t${Version}\n"])
        .output()
        .context("running dpkg-query")?;
    if !out.status.success() {
        bail!("dpkg-query on the tree failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut list: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(p, v)| (p.to_string(), v.to_string()))
        .collect();
    list.sort();
    Ok(list)
}

/// Every entry under `dir` (files, links, directories), relative and sorted.
fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    fn go(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let path = entry.path();
            out.push(path.strip_prefix(base).unwrap_or(&path).to_path_buf());
            if entry.file_type()?.is_dir() {
                go(base, &path, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    go(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

fn sha256(path: &Path) -> Result<String> {
    super::assemble::file_sha256(path)
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("{what}: running {cmd:?}"))?;
    if !status.success() {
        bail!("{what} failed ({status}): {cmd:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vm_user_is_added_once() {
        let root = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(root.path().join("etc")).expect("etc");
        fs::write(root.path().join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").expect("passwd");
        fs::write(root.path().join("etc/group"), "root:x:0:").expect("group");
        add_vm_user(root.path()).expect("add");
        add_vm_user(root.path()).expect("again");
        let passwd = fs::read_to_string(root.path().join("etc/passwd")).expect("read");
        assert_eq!(passwd.matches("chrysalis-vm:").count(), 1, "{passwd}");
        assert!(passwd.contains("chrysalis-vm:x:990:990:"), "{passwd}");
        let group = fs::read_to_string(root.path().join("etc/group")).expect("read");
        assert_eq!(group, "root:x:0:\nchrysalis-vm:x:990:\n");
    }
}

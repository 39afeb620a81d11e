//! `cargo xtask vm-image <template>|--all`: builds guest images and registers them in
//! `$CHRYSALIS_CACHE/images/catalog.json`.
//!
//! Every template gets an initramfs (`initrd.cpio.gz`: `/init` = guest-init, `/sbin/silkd`,
//! optionally busybox-static); templates with a `[rootfs]` section also get `rootfs.erofs`
//! (mmdebstrap'ed Debian + silkd) and `overlay-empty.ext4`. Outputs live in
//! `$CHRYSALIS_CACHE/images/<template>/<input-hash>/` and are rebuilt only when the template
//! folder, the guest binaries or the kernel change.

pub(crate) mod catalog;
mod cpio;
pub(crate) mod rootfs;

use crate::{flags, guest_kernel, paths, prereqs};
use anyhow::{bail, Context, Result};
use catalog::{BuiltTemplate, Sources, Template};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The musl target the guest binaries are built for.
const GUEST_TARGET: &str = "x86_64-unknown-linux-musl";
/// Bump when the image layout produced here changes.
const IMAGE_FORMAT: &str = "chrysalis-image-v1";
/// Uses a prebuilt silkd instead of building `-p silkd` (testing stand-ins, custom builds).
const SILKD_OVERRIDE_ENV: &str = "CHRYSALIS_SILKD_BIN";

/// What `manifest.json` in an image directory records.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Manifest {
    template: String,
    built: BuiltTemplate,
}

pub fn run(args: &flags::VmImageArgs) -> Result<()> {
    let root = paths::project_root();
    let sources = Sources::load(&root.join("vm-images/catalog.toml"))?;
    let names: Vec<String> = if args.all {
        sources.templates.keys().cloned().collect()
    } else {
        let requested = args.template.as_deref().context("a template name (or --all) is required")?;
        vec![sources.resolve(requested)?.to_string()]
    };

    prereqs::ensure_rust_targets()?;
    prereqs::ensure_apt(&["busybox-static", "mmdebstrap", "erofs-utils", "e2fsprogs"])?;
    let kernel = guest_kernel::run(&flags::GuestKernelArgs { force: false })?;
    let bins = build_guest_binaries()?;

    for name in names {
        if let Some(entry) = sources.templates.get(&name) {
            eprintln!("vm-image: {name}: {}", entry.description);
        }
        let built = build_template(&root, &name, &kernel, &bins, args.force)?;
        let json = paths::cache_dir().join("images/catalog.json");
        catalog::register(&json, &sources, &name, built.clone())?;
        eprintln!("vm-image: {name} ready ({}) → {}", built.digest, json.display());
        println!("{name}\t{}", built.initrd.parent().unwrap_or(Path::new("")).display());
    }
    Ok(())
}

/// The static guest binaries.
struct GuestBins {
    silkd: PathBuf,
    guest_init: PathBuf,
}

/// Whether the workspace's `silkd` package has a `silkd` binary target yet.
fn silkd_has_binary() -> Result<bool> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    Ok(packages.iter().filter(|p| p["name"] == "silkd").any(|p| {
        p["targets"].as_array().is_some_and(|ts| {
            ts.iter()
                .any(|t| t["name"] == "silkd" && t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bin")))
        })
    }))
}

/// `cargo build --profile guest --target x86_64-unknown-linux-musl -p silkd -p guest-init`.
fn build_guest_binaries() -> Result<GuestBins> {
    let silkd_override = std::env::var_os(SILKD_OVERRIDE_ENV).map(PathBuf::from);
    let mut packages = vec!["guest-init"];
    match &silkd_override {
        Some(path) => eprintln!(
            "vm-image: WARNING: using {} from ${SILKD_OVERRIDE_ENV} instead of building silkd",
            path.display()
        ),
        None if silkd_has_binary()? => packages.push("silkd"),
        None => bail!(
            "appliance/silkd has no `silkd` binary target yet (src/main.rs); images need the guest agent. \
             To test images with another binary set {SILKD_OVERRIDE_ENV}=/path/to/static/silkd"
        ),
    }
    eprintln!("vm-image: cargo build --profile guest --target {GUEST_TARGET} -p {}", packages.join(" -p "));
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "--profile", "guest", "--target", GUEST_TARGET]);
    for p in &packages {
        cmd.args(["-p", p]);
    }
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("building the guest binaries failed ({status})");
    }
    let out_dir = paths::target_dir().join(GUEST_TARGET).join("guest");
    let bins = GuestBins {
        silkd: silkd_override.unwrap_or_else(|| out_dir.join("silkd")),
        guest_init: out_dir.join("guest-init"),
    };
    for bin in [&bins.silkd, &bins.guest_init] {
        if !bin.is_file() {
            bail!("{} is missing after the build", bin.display());
        }
    }
    Ok(bins)
}

/// sha256 of a file, hex.
fn file_sha256(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

/// Every regular file under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let ty = entry.file_type()?;
            if ty.is_dir() {
                walk(base, &entry.path(), out)?;
            } else if ty.is_file() {
                out.push(entry.path().strip_prefix(base).unwrap_or(&entry.path()).to_path_buf());
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    if dir.is_dir() {
        walk(dir, dir, &mut out)?;
    }
    out.sort();
    Ok(out)
}

/// Hash over everything an image is made of.
fn input_hash(template_dir: &Path, bins: &GuestBins, kernel: &Path, busybox: Option<&str>) -> Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut h = Sha256::new();
    let mut line = |s: String| {
        h.update(s.as_bytes());
        h.update(b"\n");
    };
    line(IMAGE_FORMAT.to_string());
    for rel in files_under(template_dir)? {
        let path = template_dir.join(&rel);
        let mode = fs::metadata(&path)?.permissions().mode();
        line(format!("file {} {:o} {}", rel.display(), mode & 0o7777, file_sha256(&path)?));
    }
    line(format!("silkd {}", file_sha256(&bins.silkd)?));
    line(format!("guest-init {}", file_sha256(&bins.guest_init)?));
    line(format!("kernel {}", kernel.display()));
    line(format!("busybox {}", busybox.unwrap_or("-")));
    Ok(hex::encode(h.finalize())[..16].to_string())
}

fn package_version(pkg: &str) -> Result<String> {
    let out = Command::new("dpkg-query").args(["-W", "-f=${Version}", pkg]).output()?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || v.is_empty() {
        bail!("{pkg} is not installed");
    }
    Ok(v)
}

/// Builds one template (or finds it in the cache) and returns its catalog entry.
fn build_template(root: &Path, name: &str, kernel: &Path, bins: &GuestBins, force: bool) -> Result<BuiltTemplate> {
    let template_dir = root.join("vm-images/templates").join(name);
    let template = Template::load(&template_dir)?;
    let busybox_version = if template.busybox { Some(package_version("busybox-static")?) } else { None };
    let hash = input_hash(&template_dir, bins, kernel, busybox_version.as_deref())?;
    let images = paths::cache_dir().join("images");
    let _lock = paths::lock_file(&images.join(name).join(".lock"))?;
    let out = images.join(name).join(&hash);
    let manifest_path = out.join("manifest.json");
    if !force {
        if let Ok(bytes) = fs::read(&manifest_path) {
            if let Ok(m) = serde_json::from_slice::<Manifest>(&bytes) {
                eprintln!("vm-image: {name}: cached {}", out.display());
                return Ok(m.built);
            }
        }
    }
    eprintln!("vm-image: {name}: building into {} ({})", out.display(), template.description);
    let tmp = images.join(name).join(format!(".{hash}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;

    let initrd = tmp.join("initrd.cpio.gz");
    write_initramfs(&template_dir, &template, bins, &initrd)?;
    let (mut rootfs, mut overlay) = (None, None);
    if let Some(spec) = &template.rootfs {
        let tarball = rootfs::debootstrap(&paths::cache_dir(), spec, template.source_date_epoch, force)?;
        let erofs = tmp.join("rootfs.erofs");
        let extra = template_dir.join("rootfs");
        let extra = extra.is_dir().then_some(extra.as_path());
        rootfs::make_erofs(&tarball, &bins.silkd, extra, template.source_date_epoch, &erofs)?;
        let ovl = tmp.join("overlay-empty.ext4");
        rootfs::make_overlay_ext4(&ovl, spec.overlay_size_mib, template.source_date_epoch)?;
        rootfs = Some(out.join("rootfs.erofs"));
        overlay = Some(out.join("overlay-empty.ext4"));
    }

    let mut digest = Sha256::new();
    digest.update(format!("kernel {}\n", file_sha256(kernel)?));
    for file in ["initrd.cpio.gz", "rootfs.erofs", "overlay-empty.ext4"] {
        let path = tmp.join(file);
        if path.is_file() {
            digest.update(format!("{file} {}\n", file_sha256(&path)?));
        }
    }
    digest.update(format!("cmdline {}\n", template.cmdline));
    let built = BuiltTemplate {
        kernel: kernel.to_path_buf(),
        initrd: out.join("initrd.cpio.gz"),
        rootfs,
        overlay_base: overlay,
        cmdline: template.cmdline.clone(),
        digest: format!("sha256:{}", hex::encode(digest.finalize())),
    };
    let manifest = Manifest { template: name.to_string(), built: built.clone() };
    fs::write(tmp.join("manifest.json"), serde_json::to_vec_pretty(&manifest)?)?;
    let _ = fs::remove_dir_all(&out);
    fs::rename(&tmp, &out).with_context(|| format!("installing {}", out.display()))?;
    Ok(built)
}

/// Writes the gzip'ed initramfs: guest-init as `/init`, silkd, the base directories,
/// `/dev/console`, optionally busybox + applet links, and the template's `initramfs/` files.
fn write_initramfs(template_dir: &Path, template: &Template, bins: &GuestBins, out: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut a = cpio::Archive::default();
    for (dir, perm) in [
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("tmp", 0o1777),
        ("run", 0o755),
        ("root", 0o700),
        ("etc", 0o755),
        ("bin", 0o755),
        ("sbin", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
    ] {
        a.dir(dir, perm);
    }
    // The kernel opens /dev/console for /init before anything is mounted.
    a.add("dev/console", cpio::Kind::CharDev { major: 5, minor: 1 }, 0o600, 0, 0);
    a.file("init", fs::read(&bins.guest_init).context("reading guest-init")?, 0o755);
    a.file("sbin/silkd", fs::read(&bins.silkd).context("reading silkd")?, 0o755);
    if template.rootfs.is_none() {
        // The initramfs is the root: give the unprivileged user a home.
        a.add("home/sandbox", cpio::Kind::Dir, 0o755, 1000, 1000);
    }
    if template.busybox {
        let busybox = Path::new("/bin/busybox");
        a.file("bin/busybox", fs::read(busybox).context("reading /bin/busybox (busybox-static)")?, 0o755);
        let list = Command::new(busybox).arg("--list-full").output().context("running busybox --list-full")?;
        for applet in String::from_utf8_lossy(&list.stdout).lines().map(str::trim).filter(|l| !l.is_empty()) {
            if applet == "bin/busybox" || a.contains(applet) {
                continue;
            }
            let depth = applet.matches('/').count();
            a.symlink(applet, &format!("{}bin/busybox", "../".repeat(depth)));
        }
    }
    let extra = template_dir.join("initramfs");
    for rel in files_under(&extra)? {
        let path = extra.join(&rel);
        let perm = fs::metadata(&path)?.permissions().mode() & 0o7777;
        a.file(&rel.to_string_lossy(), fs::read(&path)?, perm);
    }
    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut gz = flate2::GzBuilder::new().mtime(0).write(std::io::BufWriter::new(file), flate2::Compression::best());
    a.write(&mut gz, template.source_date_epoch).context("writing the initramfs")?;
    gz.finish()?.flush()?;
    Ok(())
}

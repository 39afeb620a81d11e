//! `cargo xtask guest-kernel`: the microVM guest kernel, and the kernel build machinery the host
//! image (`cargo xtask image`) shares.
//!
//! Debian's `linux-source-6.1` is unpacked once per package version under
//! `$CHRYSALIS_CACHE/kernel/src/<version>/`, configured out of tree with `make tinyconfig` plus
//! committed fragments (the guest: `vm-images/kernel/guest.config`; a host board:
//! `rootfs/kernel/host-base.config` + `boards/<board>/kernel.config`), checked (every option the
//! fragments set must survive `olddefconfig`) and built into `$CHRYSALIS_CACHE/kernel/<key>/<file>`
//! (the guest: an uncompressed PVH `vmlinux`; the host: an EFI-stub `bzImage`), where `<key>`
//! hashes the fragments, the target and the package version. A per-kind symlink
//! (`kernel/current` for the guest) points at the last kernel built or found.

use crate::{flags::GuestKernelArgs, paths, prereqs};
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The Debian package providing the kernel source.
const SOURCE_PACKAGE: &str = "linux-source-6.1";
/// The tarball that package installs.
const SOURCE_TARBALL: &str = "/usr/src/linux-source-6.1.tar.xz";
/// The top directory inside the tarball.
const SOURCE_TOPDIR: &str = "linux-source-6.1";
/// The committed config fragment, relative to the project root.
pub const FRAGMENT: &str = "vm-images/kernel/guest.config";

/// Fixed build identity (`uname -v`, `/proc/version`) so the same inputs give the same kernel.
const REPRODUCIBLE_ENV: &[(&str, &str)] = &[
    ("KBUILD_BUILD_TIMESTAMP", "2025-01-01 00:00:00 UTC"),
    ("KBUILD_BUILD_USER", "chrysalis"),
    ("KBUILD_BUILD_HOST", "chrysalis"),
    ("KBUILD_BUILD_VERSION", "1"),
];

/// What `make` builds and which file of the object tree is installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelTarget {
    /// Uncompressed ELF `vmlinux` (PVH entry): the microVM guest.
    Vmlinux,
    /// Compressed `arch/x86/boot/bzImage` (EFI stub): the host.
    BzImage,
}

impl KernelTarget {
    /// The `make` target (also the installed file name).
    fn make_target(self) -> &'static str {
        match self {
            KernelTarget::Vmlinux => "vmlinux",
            KernelTarget::BzImage => "bzImage",
        }
    }

    /// Where `make` leaves it, relative to the object tree.
    fn built_path(self) -> &'static str {
        match self {
            KernelTarget::Vmlinux => "vmlinux",
            KernelTarget::BzImage => "arch/x86/boot/bzImage",
        }
    }
}

/// One kernel to build: fragments merged in order on top of `tinyconfig`.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    /// Prefix of progress messages (`guest-kernel`, `image: host kernel`).
    pub label: String,
    /// Config fragments, relative to the project root, merged in this order.
    pub fragments: Vec<PathBuf>,
    /// What to build.
    pub target: KernelTarget,
    /// The symlink under `$CHRYSALIS_CACHE/kernel/` naming the last kernel of this kind.
    pub current_link: String,
}

impl KernelSpec {
    /// The microVM guest kernel.
    pub fn guest() -> KernelSpec {
        KernelSpec {
            label: "guest-kernel".into(),
            fragments: vec![PathBuf::from(FRAGMENT)],
            target: KernelTarget::Vmlinux,
            current_link: "current".into(),
        }
    }
}

/// Builds (or finds in the cache) the guest kernel and returns the path of its `vmlinux`.
pub fn run(args: &GuestKernelArgs) -> Result<PathBuf> {
    build(&KernelSpec::guest(), args.force)
}

/// Builds (or finds in the cache) the kernel `spec` describes; returns the installed file.
pub fn build(spec: &KernelSpec, force: bool) -> Result<PathBuf> {
    let label = spec.label.as_str();
    prereqs::ensure_apt(&[SOURCE_PACKAGE, "bc", "bison", "flex", "libelf-dev", "libssl-dev", "make", "gcc"])?;
    let root = paths::project_root();
    let mut fragment = String::new();
    for rel in &spec.fragments {
        let path = root.join(rel);
        fragment.push_str(&fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?);
    }
    let fragment_names = spec.fragments.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" + ");
    let version = package_version(SOURCE_PACKAGE)?;
    let key = cache_key(&fragment, &version, spec.target);
    let kernel_dir = paths::cache_dir().join("kernel");
    let out_dir = kernel_dir.join(&key);
    let target = spec.target.make_target();
    let installed = out_dir.join(target);
    // A cached kernel needs no lock (it is installed by rename); a build waits for others.
    let cached = |installed: &Path| installed.is_file() && !force;
    if cached(&installed) {
        eprintln!("{label}: cached {} ({SOURCE_PACKAGE} {version})", installed.display());
        set_current(&kernel_dir, &spec.current_link, &key)?;
        return Ok(installed);
    }
    let _lock = paths::lock_file(&kernel_dir.join(".lock"))?;
    if cached(&installed) {
        eprintln!("{label}: cached {} ({SOURCE_PACKAGE} {version})", installed.display());
        set_current(&kernel_dir, &spec.current_link, &key)?;
        return Ok(installed);
    }

    let started = Instant::now();
    eprintln!(
        "{label}: building {SOURCE_PACKAGE} {version} {target} with {fragment_names} (key {key}); \
         this takes ~8-10 minutes on 2 cores"
    );
    let src = unpack_source(&kernel_dir, &version)?;
    let build = out_dir.join("build");
    fs::create_dir_all(&build).with_context(|| format!("creating {}", build.display()))?;
    let log = out_dir.join("build.log");
    let o_arg = format!("O={}", build.display());

    eprintln!("{label}: [1/4] make tinyconfig");
    run_logged(Command::new("make").current_dir(&src).args([o_arg.as_str(), "tinyconfig"]), &log)?;

    eprintln!("{label}: [2/4] merging {fragment_names}");
    let config = build.join(".config");
    run_logged(
        Command::new(src.join("scripts/kconfig/merge_config.sh"))
            .current_dir(&src)
            .arg("-m")
            .arg("-O")
            .arg(&build)
            .arg(&config)
            .args(spec.fragments.iter().map(|f| root.join(f))),
        &log,
    )?;
    run_logged(Command::new("make").current_dir(&src).args([o_arg.as_str(), "olddefconfig"]), &log)?;
    let final_config = fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?;
    let dropped = dropped_options(&fragment, &final_config);
    if !dropped.is_empty() {
        bail!(
            "{label}: {} option(s) of {fragment_names} did not survive olddefconfig (missing dependency?):\n  {}",
            dropped.len(),
            dropped.join("\n  ")
        );
    }

    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    eprintln!("{label}: [3/4] make -j{jobs} {target} (log: {})", log.display());
    let done = Arc::new(AtomicBool::new(false));
    let ticker = {
        let done = Arc::clone(&done);
        let label = label.to_string();
        std::thread::spawn(move || {
            let mut last = Instant::now();
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                if last.elapsed() >= Duration::from_secs(30) {
                    eprintln!("{label}:       still compiling, {}s elapsed", started.elapsed().as_secs());
                    last = Instant::now();
                }
            }
        })
    };
    let result = run_logged(
        Command::new("make")
            .current_dir(&src)
            .args([o_arg.as_str(), &format!("-j{jobs}"), target])
            .envs(REPRODUCIBLE_ENV.iter().copied()),
        &log,
    );
    done.store(true, Ordering::Relaxed);
    let _ = ticker.join();
    result?;

    eprintln!("{label}: [4/4] installing {target}");
    let tmp = out_dir.join(format!("{target}.tmp"));
    fs::copy(build.join(spec.target.built_path()), &tmp).with_context(|| format!("copying {target}"))?;
    fs::copy(&config, out_dir.join("config")).context("copying .config")?;
    fs::rename(&tmp, &installed).with_context(|| format!("installing {target}"))?;
    // The object tree is ~200 MB and only useful for incremental rebuilds of the same key.
    let _ = fs::remove_dir_all(&build);
    set_current(&kernel_dir, &spec.current_link, &key)?;
    eprintln!("{label}: built {} in {}s", installed.display(), started.elapsed().as_secs());
    Ok(installed)
}
/// The installed version of a Debian package.
fn package_version(pkg: &str) -> Result<String> {
    let out = Command::new("dpkg-query").args(["-W", "-f=${Version}", pkg]).output().context("running dpkg-query")?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || version.is_empty() {
        bail!("package {pkg} is not installed");
    }
    Ok(version)
}

/// sha256 over the package version, the fragments and the target, shortened to 16 hex digits.
/// The `vmlinux` target adds nothing, so guest kernel keys are those of before hosts existed
/// (guest kernels built since carry the fixed build identity too; cached ones keep theirs).
fn cache_key(fragment: &str, version: &str, target: KernelTarget) -> String {
    let mut h = Sha256::new();
    h.update(format!("{SOURCE_PACKAGE}={version}\n").as_bytes());
    h.update(fragment.as_bytes());
    if target != KernelTarget::Vmlinux {
        h.update(format!("\ntarget={}\n", target.make_target()).as_bytes());
        for (k, v) in REPRODUCIBLE_ENV {
            h.update(format!("{k}={v}\n").as_bytes());
        }
    }
    hex::encode(h.finalize())[..16].to_string()
}

/// Unpacks the source tarball once per package version; returns the source tree.
fn unpack_source(kernel_dir: &Path, version: &str) -> Result<PathBuf> {
    let root = kernel_dir.join("src").join(version.replace(['/', ':'], "_"));
    let tree = root.join(SOURCE_TOPDIR);
    let marker = root.join(".unpacked");
    if marker.is_file() && tree.is_dir() {
        return Ok(tree);
    }
    eprintln!("guest-kernel: unpacking {SOURCE_TARBALL}");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root)?;
    let status =
        Command::new("tar").arg("-xf").arg(SOURCE_TARBALL).arg("-C").arg(&root).status().context("running tar")?;
    if !status.success() {
        bail!("unpacking {SOURCE_TARBALL} failed ({status})");
    }
    fs::write(&marker, version)?;
    Ok(tree)
}

/// Runs a command appending its output to `log`; on failure prints the log's tail.
fn run_logged(cmd: &mut Command, log: &Path) -> Result<()> {
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        let text = fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        for line in tail.iter().rev() {
            eprintln!("  | {line}");
        }
        bail!("{cmd:?} failed ({status}); full log: {}", log.display());
    }
    Ok(())
}

/// Points `kernel/<link>` at `key` (atomic symlink replace).
fn set_current(kernel_dir: &Path, link: &str, key: &str) -> Result<()> {
    let tmp = kernel_dir.join(format!(".{link}.tmp"));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(key, &tmp).with_context(|| format!("creating {link} symlink"))?;
    fs::rename(&tmp, kernel_dir.join(link)).with_context(|| format!("updating {link} symlink"))?;
    Ok(())
}

/// The fragment's settings that `.config` does not have: `CONFIG_X=v` lines must appear verbatim,
/// `CONFIG_X=n` / `# CONFIG_X is not set` lines must not be set to anything. When fragments are
/// concatenated, the last setting of an option wins (as in `merge_config.sh`).
fn dropped_options(fragment: &str, config: &str) -> Vec<String> {
    let set: std::collections::HashMap<&str, &str> =
        config.lines().filter(|l| l.starts_with("CONFIG_")).filter_map(|l| l.split_once('=')).collect();
    let mut wanted: Vec<(&str, &str)> = Vec::new();
    for line in fragment.lines().map(str::trim) {
        let (key, want) = if let Some(rest) = line.strip_prefix("# ").and_then(|l| l.strip_suffix(" is not set")) {
            (rest, "n")
        } else if line.starts_with("CONFIG_") {
            match line.split_once('=') {
                Some(kv) => kv,
                None => continue,
            }
        } else {
            continue;
        };
        match wanted.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = want,
            None => wanted.push((key, want)),
        }
    }
    let mut dropped = Vec::new();
    for (key, want) in wanted {
        let have = set.get(key).copied();
        let ok = match want {
            "n" => have.is_none() || have == Some("n"),
            _ => have == Some(want),
        };
        if !ok {
            dropped.push(format!("{key}={want} (have: {})", have.unwrap_or("not set")));
        }
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_options_reports_missing_and_wrong_values() {
        let fragment = "# c\nCONFIG_A=y\nCONFIG_B=y\nCONFIG_C=n\n# CONFIG_D is not set\nCONFIG_E=8\n";
        let config = "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=y\nCONFIG_E=4\n";
        let dropped = dropped_options(fragment, config);
        assert_eq!(dropped, vec!["CONFIG_B=y (have: not set)", "CONFIG_C=n (have: y)", "CONFIG_E=8 (have: 4)"]);
    }

    #[test]
    fn cache_key_depends_on_fragment_and_version() {
        let v = KernelTarget::Vmlinux;
        assert_ne!(cache_key("CONFIG_A=y\n", "1", v), cache_key("CONFIG_A=y\n", "2", v));
        assert_ne!(cache_key("CONFIG_A=y\n", "1", v), cache_key("CONFIG_B=y\n", "1", v));
        assert_ne!(cache_key("CONFIG_A=y\n", "1", v), cache_key("CONFIG_A=y\n", "1", KernelTarget::BzImage));
        assert_eq!(cache_key("x", "1", v).len(), 16);
    }

    #[test]
    fn guest_cache_key_is_unchanged_by_the_generalization() {
        // The key before targets existed: sha256("linux-source-6.1=1\n" + fragment).
        let mut h = Sha256::new();
        h.update(b"linux-source-6.1=1\nCONFIG_A=y\n");
        assert_eq!(cache_key("CONFIG_A=y\n", "1", KernelTarget::Vmlinux), hex::encode(h.finalize())[..16]);
    }

    #[test]
    fn later_fragments_override_earlier_ones() {
        let fragment = "CONFIG_A=y\nCONFIG_B=y\nCONFIG_A=n\n";
        assert!(dropped_options(fragment, "CONFIG_B=y\n").is_empty());
        assert_eq!(dropped_options(fragment, "CONFIG_A=y\nCONFIG_B=y\n"), vec!["CONFIG_A=n (have: y)"]);
    }
}

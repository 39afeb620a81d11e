//! `cargo xtask guest-kernel`: the microVM guest kernel.
//!
//! Debian's `linux-source-6.1` is unpacked once per package version under
//! `$CHRYSALIS_CACHE/kernel/src/<version>/`, configured out of tree with `make tinyconfig` plus the
//! committed fragment `vm-images/kernel/guest.config`, checked (every option the fragment sets must
//! survive `olddefconfig`) and built into an uncompressed PVH `vmlinux` at
//! `$CHRYSALIS_CACHE/kernel/<key>/vmlinux`, where `<key>` hashes the fragment and the package
//! version. `$CHRYSALIS_CACHE/kernel/current` points at the last kernel built or found.

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

/// Builds (or finds in the cache) the guest kernel and returns the path of its `vmlinux`.
pub fn run(args: &GuestKernelArgs) -> Result<PathBuf> {
    prereqs::ensure_apt(&[SOURCE_PACKAGE, "bc", "bison", "flex", "libelf-dev", "libssl-dev", "make", "gcc"])?;
    let fragment_path = paths::project_root().join(FRAGMENT);
    let fragment =
        fs::read_to_string(&fragment_path).with_context(|| format!("reading {}", fragment_path.display()))?;
    let version = package_version(SOURCE_PACKAGE)?;
    let key = cache_key(&fragment, &version);
    let kernel_dir = paths::cache_dir().join("kernel");
    let out_dir = kernel_dir.join(&key);
    let vmlinux = out_dir.join("vmlinux");
    let _lock = paths::lock_file(&kernel_dir.join(".lock"))?;

    if vmlinux.is_file() && !args.force {
        eprintln!("guest-kernel: cached {} ({SOURCE_PACKAGE} {version})", vmlinux.display());
        set_current(&kernel_dir, &key)?;
        return Ok(vmlinux);
    }

    let started = Instant::now();
    eprintln!("guest-kernel: building {SOURCE_PACKAGE} {version} with {FRAGMENT} (key {key}); this takes ~8 minutes on 2 cores");
    let src = unpack_source(&kernel_dir, &version)?;
    let build = out_dir.join("build");
    fs::create_dir_all(&build).with_context(|| format!("creating {}", build.display()))?;
    let log = out_dir.join("build.log");
    let o_arg = format!("O={}", build.display());

    eprintln!("guest-kernel: [1/4] make tinyconfig");
    run_logged(Command::new("make").current_dir(&src).args([o_arg.as_str(), "tinyconfig"]), &log)?;

    eprintln!("guest-kernel: [2/4] merging {FRAGMENT}");
    let config = build.join(".config");
    run_logged(
        Command::new(src.join("scripts/kconfig/merge_config.sh"))
            .current_dir(&src)
            .arg("-m")
            .arg("-O")
            .arg(&build)
            .arg(&config)
            .arg(&fragment_path),
        &log,
    )?;
    run_logged(Command::new("make").current_dir(&src).args([o_arg.as_str(), "olddefconfig"]), &log)?;
    let final_config = fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?;
    let dropped = dropped_options(&fragment, &final_config);
    if !dropped.is_empty() {
        bail!(
            "guest-kernel: {} option(s) of {FRAGMENT} did not survive olddefconfig (missing dependency?):\n  {}",
            dropped.len(),
            dropped.join("\n  ")
        );
    }

    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    eprintln!("guest-kernel: [3/4] make -j{jobs} vmlinux (log: {})", log.display());
    let done = Arc::new(AtomicBool::new(false));
    let ticker = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut last = Instant::now();
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                if last.elapsed() >= Duration::from_secs(30) {
                    eprintln!("guest-kernel:       still compiling, {}s elapsed", started.elapsed().as_secs());
                    last = Instant::now();
                }
            }
        })
    };
    let result = run_logged(
        Command::new("make").current_dir(&src).args([o_arg.as_str(), &format!("-j{jobs}"), "vmlinux"]),
        &log,
    );
    done.store(true, Ordering::Relaxed);
    let _ = ticker.join();
    result?;

    eprintln!("guest-kernel: [4/4] installing vmlinux");
    let tmp = out_dir.join("vmlinux.tmp");
    fs::copy(build.join("vmlinux"), &tmp).context("copying vmlinux")?;
    fs::copy(&config, out_dir.join("config")).context("copying .config")?;
    fs::rename(&tmp, &vmlinux).context("installing vmlinux")?;
    // The object tree is ~200 MB and only useful for incremental rebuilds of the same key.
    let _ = fs::remove_dir_all(&build);
    set_current(&kernel_dir, &key)?;
    eprintln!("guest-kernel: built {} in {}s", vmlinux.display(), started.elapsed().as_secs());
    Ok(vmlinux)
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

/// sha256 over the package version and the fragment, shortened to 16 hex digits.
fn cache_key(fragment: &str, version: &str) -> String {
    let mut h = Sha256::new();
    h.update(format!("{SOURCE_PACKAGE}={version}\n").as_bytes());
    h.update(fragment.as_bytes());
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

/// Points `kernel/current` at `key` (atomic symlink replace).
fn set_current(kernel_dir: &Path, key: &str) -> Result<()> {
    let tmp = kernel_dir.join(".current.tmp");
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(key, &tmp).context("creating current symlink")?;
    fs::rename(&tmp, kernel_dir.join("current")).context("updating current symlink")?;
    Ok(())
}

/// The fragment's settings that `.config` does not have: `CONFIG_X=v` lines must appear verbatim,
/// `CONFIG_X=n` / `# CONFIG_X is not set` lines must not be set to anything.
fn dropped_options(fragment: &str, config: &str) -> Vec<String> {
    let set: std::collections::HashMap<&str, &str> =
        config.lines().filter(|l| l.starts_with("CONFIG_")).filter_map(|l| l.split_once('=')).collect();
    let mut dropped = Vec::new();
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
        assert_ne!(cache_key("CONFIG_A=y\n", "1"), cache_key("CONFIG_A=y\n", "2"));
        assert_ne!(cache_key("CONFIG_A=y\n", "1"), cache_key("CONFIG_B=y\n", "1"));
        assert_eq!(cache_key("x", "1").len(), 16);
    }
}

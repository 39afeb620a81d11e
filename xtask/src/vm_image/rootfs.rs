//! The read-only root disk of image templates: a Debian userland from `mmdebstrap` (cached as
//! a tarball keyed by everything that goes into it, so agent changes do not re-run it), our
//! files added on top, packed with `mkfs.erofs`; and the empty sparse ext4 overlay image.

use super::catalog::RootfsSpec;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bump when the mmdebstrap invocation changes in a way the key would not notice.
const DEBOOTSTRAP_FORMAT: &str = "mmdebstrap-v1";
/// Fixed filesystem UUID of our images (reproducible output).
const FS_UUID: &str = "c4a15a11-0000-4000-8000-000000000001";

/// Every rootfs gets the unprivileged `sandbox` user (uid/gid 1000), plus a hostname and
/// hosts file matching guest-init's default hostname.
const CUSTOMIZE_HOOKS: &[&str] = &[
    r#"chroot "$1" useradd --create-home --uid 1000 --user-group --shell /bin/bash sandbox"#,
    r#"echo sandbox > "$1/etc/hostname""#,
    r#"printf '127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n' > "$1/etc/hosts""#,
    r#"mkdir -p "$1/.chrysalis""#,
    r#"rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*.log"#,
];

/// Documentation is excluded from the image (keeps copyright files).
const DPKG_OPTS: &[&str] = &[
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
];

/// The host's Debian apt sources for `suite` (and its -updates/-security), as one-line
/// `deb URI SUITE COMPONENTS` entries for mmdebstrap.
pub fn host_mirrors(suite: &str) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut files: Vec<PathBuf> = vec!["/etc/apt/sources.list".into()];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        more.sort();
        files.extend(more);
    }
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        match file.extension().and_then(|e| e.to_str()) {
            Some("sources") => lines.extend(parse_deb822(&text, suite)),
            Some("list") | None if file.ends_with("sources.list") || file.extension().is_some() => {
                lines.extend(parse_one_line(&text, suite))
            }
            _ => {}
        }
    }
    if lines.is_empty() {
        bail!("no Debian '{suite}' apt source found in /etc/apt/sources.list(.d)");
    }
    Ok(lines)
}

fn wanted_suite(s: &str, suite: &str) -> bool {
    s == suite || s.strip_prefix(suite).is_some_and(|rest| rest.starts_with('-'))
}

fn parse_deb822(text: &str, suite: &str) -> Vec<String> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
                .map(|v| v.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .unwrap_or_default()
        };
        if !field("Types").iter().any(|t| t == "deb") || field("Enabled").iter().any(|e| e == "no") {
            continue;
        }
        let components = field("Components").join(" ");
        for uri in field("URIs") {
            for s in field("Suites").iter().filter(|s| wanted_suite(s, suite)) {
                out.push(format!("deb {uri} {s} {components}"));
            }
        }
    }
    out
}

fn parse_one_line(text: &str, suite: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("deb "))
        .filter_map(|l| {
            // Drop an optional `[options]` block.
            let l = match (l.find('['), l.find(']')) {
                (Some(a), Some(b)) if a < b => format!("{}{}", &l[..a], &l[b + 1..]),
                _ => l.to_string(),
            };
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts.len() >= 4 && wanted_suite(parts[2], suite)).then(|| parts.join(" "))
        })
        .collect()
}

/// What one mmdebstrap run installs, and how (guest templates and the host image share it).
#[derive(Debug, Clone)]
pub struct Debootstrap {
    /// Prefix of progress messages.
    pub label: String,
    pub suite: String,
    pub variant: String,
    pub packages: Vec<String>,
    /// `deb URI SUITE COMPONENTS` lines.
    pub mirrors: Vec<String>,
    /// `--customize-hook=` scripts (`$1` is the root).
    pub hooks: Vec<String>,
    /// `--dpkgopt=` lines.
    pub dpkg_opts: Vec<String>,
}

/// Runs mmdebstrap (or reuses its cached tarball) for a guest template; returns the tarball.
pub fn debootstrap(cache: &Path, spec: &RootfsSpec, epoch: u64, force: bool) -> Result<PathBuf> {
    let run = Debootstrap {
        label: "vm-image".into(),
        suite: spec.suite.clone(),
        variant: spec.variant.clone(),
        packages: spec.packages.clone(),
        mirrors: host_mirrors(&spec.suite)?,
        hooks: CUSTOMIZE_HOOKS.iter().map(|h| h.to_string()).collect(),
        dpkg_opts: DPKG_OPTS.iter().map(|o| o.to_string()).collect(),
    };
    debootstrap_with(cache, &run, epoch, force).map(|(tarball, _key)| tarball)
}

/// Runs mmdebstrap (or reuses its cached tarball, keyed by everything in `run` and `epoch`);
/// returns the tarball and its cache key.
pub fn debootstrap_with(cache: &Path, run: &Debootstrap, epoch: u64, force: bool) -> Result<(PathBuf, String)> {
    let label = run.label.as_str();
    let mut packages = run.packages.clone();
    packages.sort();
    packages.dedup();
    let mut h = Sha256::new();
    for part in
        [DEBOOTSTRAP_FORMAT, &run.suite, &run.variant, &packages.join(","), &run.mirrors.join("|"), &epoch.to_string()]
    {
        h.update(part.as_bytes());
        h.update(b"\n");
    }
    for hook in run.hooks.iter().chain(&run.dpkg_opts) {
        h.update(hook.as_bytes());
        h.update(b"\n");
    }
    let key = hex::encode(h.finalize())[..16].to_string();
    let dir = cache.join("mmdebstrap").join(&key);
    let tarball = dir.join("rootfs.tar");
    let _lock = crate::paths::lock_file(&dir.join(".lock"))?;
    if tarball.is_file() && !force {
        eprintln!("{label}: cached mmdebstrap {} ({})", run.suite, tarball.display());
        return Ok((tarball, key));
    }
    fs::create_dir_all(&dir)?;
    let tmp = dir.join("rootfs.tar.tmp");
    let started = std::time::Instant::now();
    eprintln!(
        "{label}: mmdebstrap --variant={} {} + {} packages (a few minutes)",
        run.variant,
        run.suite,
        packages.len()
    );
    let mut cmd = Command::new("mmdebstrap");
    cmd.arg("--quiet")
        .arg(format!("--variant={}", run.variant))
        .arg("--format=tar")
        .arg(format!("--include={}", packages.join(",")))
        .env("SOURCE_DATE_EPOCH", epoch.to_string());
    for opt in &run.dpkg_opts {
        cmd.arg(format!("--dpkgopt={opt}"));
    }
    for hook in &run.hooks {
        cmd.arg(format!("--customize-hook={hook}"));
    }
    cmd.arg(&run.suite).arg(&tmp).args(&run.mirrors);
    let status = cmd.status().context("running mmdebstrap")?;
    if !status.success() {
        bail!("mmdebstrap failed ({status})");
    }
    fs::rename(&tmp, &tarball)?;
    eprintln!("{label}: mmdebstrap done in {}s", started.elapsed().as_secs());
    Ok((tarball, key))
}

/// Unpacks `tarball`, adds `silkd` at `/sbin/silkd` and the template's `rootfs/` files, and
/// packs the tree into an erofs image at `out`.
pub fn make_erofs(tarball: &Path, silkd: &Path, extra: Option<&Path>, epoch: u64, out: &Path) -> Result<()> {
    let work = out.with_extension("tree");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let result = (|| -> Result<()> {
        run(
            Command::new("tar").arg("--numeric-owner").arg("-xpf").arg(tarball).arg("-C").arg(&work),
            "unpacking the rootfs",
        )?;
        fs::create_dir_all(work.join("sbin"))?;
        fs::copy(silkd, work.join("sbin/silkd")).context("adding silkd")?;
        if let Some(extra) = extra {
            // `cp -a dir/. tree/` merges the template's files over the Debian tree.
            run(
                Command::new("cp").arg("-a").arg("--no-preserve=ownership").arg(extra.join(".")).arg(&work),
                "adding template files",
            )?;
        }
        eprintln!("vm-image: mkfs.erofs {}", out.display());
        run(
            Command::new("mkfs.erofs")
                .arg("--quiet")
                .arg(format!("-T{epoch}"))
                .arg(format!("-U{FS_UUID}"))
                .arg(out)
                .arg(&work),
            "mkfs.erofs",
        )
    })();
    let _ = fs::remove_dir_all(&work);
    result
}

/// Creates the empty, sparse ext4 image per-VM overlays are cloned from.
pub fn make_overlay_ext4(out: &Path, size_mib: u64, epoch: u64) -> Result<()> {
    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    file.set_len(size_mib * 1024 * 1024)?;
    drop(file);
    run(
        Command::new("mkfs.ext4")
            .args(["-F", "-q", "-L", "chrysalis-ovl", "-U", FS_UUID])
            .arg(format!("-Elazy_itable_init=1,lazy_journal_init=1,hash_seed={FS_UUID}"))
            .arg(out)
            .env("E2FSPROGS_FAKE_TIME", epoch.to_string()),
        "mkfs.ext4",
    )
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
    fn deb822_sources_pick_the_suite_and_its_updates() {
        let text = "Types: deb\n# comment\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                    Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\nComponents: main contrib\n\n\
                    Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\nComponents: main\n\n\
                    Types: deb-src\nURIs: http://x\nSuites: bookworm\nComponents: main\n";
        assert_eq!(
            parse_deb822(text, "bookworm"),
            vec![
                "deb http://deb.debian.org/debian bookworm main",
                "deb http://deb.debian.org/debian bookworm-updates main",
                "deb http://deb.debian.org/debian-security bookworm-security main contrib",
            ]
        );
    }

    #[test]
    fn one_line_sources() {
        let text = "deb [arch=amd64] http://m/debian bookworm main\ndeb https://x cloud-sdk-bookworm main\n# deb http://y bookworm main\n";
        assert_eq!(parse_one_line(text, "bookworm"), vec!["deb http://m/debian bookworm main"]);
    }
}

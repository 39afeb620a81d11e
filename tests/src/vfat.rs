//! Filling a vfat image rootless with mtools: the host image's ESP (`cargo xtask image`, every
//! timestamp at `SOURCE_DATE_EPOCH`) and the appliance machine's config disk.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Copies `files` (path inside the FAT → host file) into the formatted image `img`, making the
/// directories they need. With `epoch`, new entries are stamped with it and the copies keep their
/// host mtime (`mcopy -m`; the caller sets it), so the image is reproducible.
pub fn fill(img: &Path, files: &[(String, PathBuf)], epoch: Option<u64>) -> Result<()> {
    let mut dirs = std::collections::BTreeSet::new();
    for (path, _) in files {
        if path.starts_with('/') || path.split('/').any(|p| p == ".." || p.is_empty()) {
            bail!("vfat path {path:?} must be relative, without `..`");
        }
        let parts: Vec<&str> = path.split('/').collect();
        dirs.extend((1..parts.len()).map(|i| parts[..i].join("/")));
    }
    let mtools = |tool: &str| {
        let mut cmd = Command::new(tool);
        if let Some(e) = epoch {
            cmd.env("SOURCE_DATE_EPOCH", e.to_string());
        }
        cmd.stdin(Stdio::null());
        cmd
    };
    // A BTreeSet orders a parent before its children.
    for d in &dirs {
        run(mtools("mmd").arg("-i").arg(img).arg(format!("::/{d}")), "mmd")?;
    }
    for (path, source) in files {
        let flags = if epoch.is_some() { "-om" } else { "-o" };
        run(mtools("mcopy").args([flags, "-i"]).arg(img).arg(source).arg(format!("::/{path}")), "mcopy")?;
    }
    Ok(())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("{what}: running {cmd:?} (mtools: cargo xtask prereqs)"))?;
    if !out.status.success() {
        bail!("{what} failed ({}): {cmd:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

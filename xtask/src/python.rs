//! The Python environment the SDK suites run in: a venv under the cache with the public
//! `cocoonstack-sandbox` SDK pinned in `tests/python-requirements.txt`, installed from PyPI.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::process::Command;

/// Ensures the venv exists with the pinned requirements; returns its `python`.
pub fn ensure_sdk_venv() -> Result<PathBuf> {
    let reqs = std::fs::read("tests/python-requirements.txt").context("reading tests/python-requirements.txt")?;
    let key = hex::encode(&Sha256::digest(&reqs)[..8]);
    let venv = crate::paths::cache_dir().join("python").join(key);
    let python = venv.join("bin/python");
    let stamp = venv.join(".installed");
    if stamp.exists() && python.exists() {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&venv);
    std::fs::create_dir_all(venv.parent().context("venv parent")?)?;
    let mut made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status();
    if !matches!(made, Ok(s) if s.success()) {
        crate::prereqs::ensure_apt(&["python3-venv"])?;
        made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status();
    }
    if !matches!(made, Ok(s) if s.success()) {
        bail!("python3 -m venv {} failed", venv.display());
    }
    eprintln!("xtask: installing the Python SDK suite requirements into {}", venv.display());
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "-q", "-r", "tests/python-requirements.txt"])
        .status()
        .context("running pip")?;
    if !status.success() {
        bail!("pip install -r tests/python-requirements.txt failed");
    }
    std::fs::write(&stamp, b"ok")?;
    Ok(python)
}

//! `cargo xtask sandboxd`: build what sandboxd needs (guest images, the release binary) and
//! run it standalone on 127.0.0.1:7777 with `appliance/sandboxd/examples/standalone.json`: warm
//! pools for the seed's `ghcr.io/cocoonstack/sandbox/rt:24.04` (our local `rt` build) and `base`.
//!
//! Development mode: loopback and no root token, so node routes are open to local clients
//! (`Client("127.0.0.1:7777")`) and `PUT /v1/pools` is refused (it needs a root token). To serve
//! other machines, pass a config with `api_token_file` (and `tls_cert_file`/`tls_key_file`)
//! and `--listen 0.0.0.0:7777`; without a token sandboxd refuses to start and says why.

use crate::flags::{SandboxdArgs, VmImageArgs};
use anyhow::{bail, Context, Result};
use std::process::Command;

/// The sample config the main job runs with.
pub const SAMPLE_CONFIG: &str = "appliance/sandboxd/examples/standalone.json";

/// Builds the sandboxd binary (release) and returns its path.
pub fn build_binary() -> Result<std::path::PathBuf> {
    let status = Command::new("cargo")
        .args(["build", "--release", "-p", "sandboxd", "--bin", "sandboxd"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building sandboxd failed");
    }
    Ok(crate::paths::target_dir().join("release/sandboxd"))
}

pub fn run(args: &SandboxdArgs) -> Result<()> {
    crate::prereqs::ensure_all()?;
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })?;
    let bin = build_binary()?;
    let data_dir = args.data_dir.clone().unwrap_or_else(|| crate::paths::cache_dir().join("sandboxd"));
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let config = args.config.clone().unwrap_or_else(|| SAMPLE_CONFIG.into());
    eprintln!(
        "xtask: sandboxd on {} (config {}, data {}); Ctrl-C stops it and leaves claimed VMs running for the next start",
        args.listen,
        config.display(),
        data_dir.display()
    );
    eprintln!(
        "xtask: from Python: Client(\"{}\") (loopback without api_token_file: node routes open, for development)",
        args.listen
    );
    let status = Command::new(&bin)
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--listen")
        .arg(&args.listen)
        .env("CHRYSALIS_CACHE", crate::paths::cache_dir())
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    if !status.success() {
        bail!("sandboxd exited with {status}");
    }
    Ok(())
}

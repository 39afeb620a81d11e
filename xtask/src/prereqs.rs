//! Host prerequisites: apt packages and Rust targets, installed when missing.

use anyhow::{bail, Context, Result};
use std::process::Command;

/// Debian packages the build, the VMs and the tests need.
pub const APT_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "qemu-utils",
    "linux-source-6.1",
    "bc",
    "bison",
    "flex",
    "libelf-dev",
    "libssl-dev",
    "mmdebstrap",
    "erofs-utils",
    "busybox-static",
    "e2fsprogs",
    "cpio",
    "zstd",
    "xz-utils",
    "iproute2",
    // vmnet's packet filter (nft -f -) and its netns tests
    "nftables",
    // the test control plane's PKI cross-check
    "openssl",
    // the host image (cargo xtask image / run / flash) and its QEMU machine
    "cryptsetup-bin",
    "dosfstools",
    "mtools",
    "fdisk",
    "binutils",
    "ovmf",
    "socat",
];

/// Rust targets: silkd and guest-init are static musl binaries.
pub const RUST_TARGETS: &[&str] = &["x86_64-unknown-linux-musl"];

pub fn ensure_all() -> Result<()> {
    ensure_apt(APT_PACKAGES)?;
    ensure_vm_user()?;
    ensure_rust_targets()
}

/// The unprivileged user QEMU and cloud-hypervisor run as (`vmm::jail`'s default;
/// `CHRYSALIS_VM_USER`).
pub const VM_USER: &str = vmm::jail::DEFAULT_USER;

/// Creates [`VM_USER`] as a system user (no home, no shell) when it is missing.
pub fn ensure_vm_user() -> Result<()> {
    let exists = Command::new("id").arg("-u").arg(VM_USER).output().map(|o| o.status.success()).unwrap_or(false);
    if exists {
        return Ok(());
    }
    eprintln!("xtask: creating the system user {VM_USER} (the microVMs' hypervisors run as it)");
    let status = Command::new("useradd")
        .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", VM_USER])
        .status()
        .context("running useradd")?;
    if !status.success() {
        bail!("useradd --system {VM_USER} failed ({status}): run it as root");
    }
    Ok(())
}

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// Installs the missing packages of `pkgs` with apt-get (runs `apt-get update` first).
pub fn ensure_apt(pkgs: &[&str]) -> Result<()> {
    let missing: Vec<&str> = pkgs.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing apt packages: {}", missing.join(" "));
    let status = Command::new("apt-get").arg("update").arg("-q").status().context("running apt-get update")?;
    if !status.success() {
        bail!("apt-get update failed ({status})");
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install")?;
    if !status.success() {
        bail!("apt-get install {} failed ({status})", missing.join(" "));
    }
    Ok(())
}

pub fn ensure_rust_targets() -> Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output().context("running rustup")?;
    let have = String::from_utf8_lossy(&out.stdout).to_string();
    for target in RUST_TARGETS {
        if !have.lines().any(|l| l.trim() == *target) {
            eprintln!("xtask: adding Rust target {target}");
            let status = Command::new("rustup").args(["target", "add", target]).status()?;
            if !status.success() {
                bail!("rustup target add {target} failed");
            }
        }
    }
    Ok(())
}

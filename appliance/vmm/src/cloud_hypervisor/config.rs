//! Pure translation from what we want to boot into cloud-hypervisor request bodies.
//!
//! [`VmPlan`] → `PUT /vm.create` body ([`VmPlan::to_vm_config`]), the kernel command line
//! ([`kernel_cmdline`]), and the rewrite of a snapshot's `config.json` so a clone uses its own
//! vsock socket, serial log and overlay disk instead of its parent's ([`rewrite_snapshot_config`]).
//! No IO here; the callers read and write the files.

use std::path::{Path, PathBuf};

use cloud_hypervisor_client::models::{
    ConsoleConfig, ConsoleMode, CpusConfig, DiskConfig, ImageType, MemoryConfig, NetConfig, PayloadConfig, RngConfig,
    SerialConfig, VmConfig, VsockConfig,
};
use serde_json::Value;

/// Disk id of the read-only root filesystem (`/dev/vda`).
pub const ROOTFS_DISK_ID: &str = "rootfs";
/// Disk id of the per-VM writable overlay (`/dev/vdb`).
pub const OVERLAY_DISK_ID: &str = "overlay";
/// Device id of the VM's one NIC (`eth0` in the guest).
pub const NET_ID: &str = "net0";

/// Errors of [`rewrite_snapshot_config`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The snapshot's `config.json` lacks a field we must rewrite.
    #[error("snapshot config.json has no {0}")]
    Missing(&'static str),
    /// The snapshot's `config.json` is not a JSON object.
    #[error("snapshot config.json is not a JSON object")]
    NotAnObject,
}

/// Everything `vm.create` needs, already resolved to absolute paths and numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPlan {
    /// Uncompressed PVH `vmlinux`.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initramfs: PathBuf,
    /// Full kernel command line.
    pub cmdline: String,
    /// Boot (and max) vCPUs.
    pub vcpus: u32,
    /// Guest memory in bytes.
    pub memory_bytes: u64,
    /// Map guest memory `MAP_SHARED` (needed for fast snapshot/clone restore).
    pub shared_memory: bool,
    /// Read-only root disk, attached first (`/dev/vda`).
    pub rootfs: Option<PathBuf>,
    /// Writable per-VM raw overlay, attached second (`/dev/vdb`).
    pub overlay: Option<PathBuf>,
    /// Serial console (ttyS0) socket cloud-hypervisor listens on; the driver drains it into a
    /// capped log ([`crate::console`]). Never a file: its size would be the guest's choice.
    pub serial_socket: PathBuf,
    /// Guest vsock CID (≥ 3).
    pub vsock_cid: u32,
    /// Hybrid-vsock Unix socket cloud-hypervisor listens on.
    pub vsock_socket: PathBuf,
    /// A `virtio-rng` device fed from the host's `/dev/urandom`.
    pub rng: bool,
    /// The NIC: `(TAP, guest MAC)`. cloud-hypervisor attaches to the persistent TAP by name,
    /// from inside the NIC's netns, as the VM user the TAP was handed to.
    pub net: Option<(String, String)>,
}

/// The host source of a VM's `virtio-rng` device.
pub const RNG_SOURCE: &str = "/dev/urandom";

fn path_str(p: &Path) -> String {
    p.display().to_string()
}

impl VmPlan {
    /// The `PUT /vm.create` body.
    pub fn to_vm_config(&self) -> VmConfig {
        let payload = PayloadConfig {
            kernel: Some(path_str(&self.kernel)),
            initramfs: Some(path_str(&self.initramfs)),
            cmdline: Some(self.cmdline.clone()),
            ..PayloadConfig::new()
        };
        let vcpus = i32::try_from(self.vcpus).unwrap_or(i32::MAX);
        let mut memory = MemoryConfig::new(i64::try_from(self.memory_bytes).unwrap_or(i64::MAX));
        if self.shared_memory {
            memory.shared = Some(true);
        }
        let mut disks = Vec::new();
        if let Some(rootfs) = &self.rootfs {
            disks.push(DiskConfig {
                path: Some(path_str(rootfs)),
                readonly: Some(true),
                image_type: Some(ImageType::Raw),
                id: Some(ROOTFS_DISK_ID.into()),
                ..DiskConfig::new()
            });
        }
        if let Some(overlay) = &self.overlay {
            disks.push(DiskConfig {
                path: Some(path_str(overlay)),
                readonly: Some(false),
                image_type: Some(ImageType::Raw),
                id: Some(OVERLAY_DISK_ID.into()),
                ..DiskConfig::new()
            });
        }
        VmConfig {
            cpus: Some(CpusConfig::new(vcpus, vcpus)),
            memory: Some(memory),
            disks: (!disks.is_empty()).then_some(disks),
            serial: Some(SerialConfig {
                socket: Some(path_str(&self.serial_socket)),
                ..SerialConfig::new(ConsoleMode::Socket)
            }),
            console: Some(ConsoleConfig::new(ConsoleMode::Off)),
            vsock: Some(VsockConfig::new(i64::from(self.vsock_cid), path_str(&self.vsock_socket))),
            rng: self.rng.then(|| RngConfig::new(RNG_SOURCE.into())),
            net: self.net.as_ref().map(|(tap, mac)| {
                vec![NetConfig {
                    tap: Some(tap.clone()),
                    mac: Some(mac.clone()),
                    id: Some(NET_ID.into()),
                    ..NetConfig::new()
                }]
            }),
            ..VmConfig::new(payload)
        }
    }
}

/// The kernel command line for cloud-hypervisor: console on the 8250 serial port (ttyS0),
/// reboot/panic exit the VMM, the root/overlay selection for guest-init, then the template's
/// own arguments. An argument the template already sets is not repeated.
pub fn kernel_cmdline(template: &str, has_rootfs: bool, has_overlay: bool) -> String {
    let mut args: Vec<&str> = vec!["console=ttyS0", "reboot=k", "panic=1"];
    if has_rootfs {
        args.push("chrysalis.rootfs=/dev/vda");
        if !has_overlay {
            args.push("chrysalis.overlay=tmpfs");
        }
    }
    let keys: Vec<&str> = template.split_whitespace().map(|a| a.split('=').next().unwrap_or(a)).collect();
    let mut out: Vec<&str> = args.into_iter().filter(|a| !keys.contains(&a.split('=').next().unwrap_or(a))).collect();
    out.extend(template.split_whitespace());
    out.join(" ")
}

/// Paths a clone must own instead of its parent's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneRewrite {
    /// The clone's hybrid-vsock socket.
    pub vsock_socket: PathBuf,
    /// The clone's serial socket.
    pub serial_socket: PathBuf,
    /// The clone's own overlay copy, when the parent had an overlay.
    pub overlay: Option<PathBuf>,
    /// The clone's own TAP, when the parent had a NIC (the guest keeps the parent's MAC until
    /// it is re-addressed).
    pub tap: Option<String>,
}

/// Rewrites a snapshot's `config.json` (cloud-hypervisor's serialised `VmConfig`) in place for
/// a clone: `vsock.socket`, the serial port (made the clone's own console socket, whatever the
/// parent had: a parent's `File` console becomes a `Socket`) and the path of the disk with id
/// [`OVERLAY_DISK_ID`], and the TAP of the NIC with id [`NET_ID`]. Unknown fields are kept as
/// they are.
pub fn rewrite_snapshot_config(config: &mut Value, with: &CloneRewrite) -> Result<(), ConfigError> {
    let obj = config.as_object_mut().ok_or(ConfigError::NotAnObject)?;
    let vsock = obj.get_mut("vsock").and_then(Value::as_object_mut).ok_or(ConfigError::Missing("vsock"))?;
    vsock.insert("socket".into(), Value::String(path_str(&with.vsock_socket)));
    if let Some(serial) = obj.get_mut("serial").and_then(Value::as_object_mut) {
        serial.insert("mode".into(), Value::String("Socket".into()));
        serial.insert("socket".into(), Value::String(path_str(&with.serial_socket)));
        serial.insert("file".into(), Value::Null);
    }
    if let Some(overlay) = &with.overlay {
        let disk = obj
            .get_mut("disks")
            .and_then(Value::as_array_mut)
            .and_then(|disks| disks.iter_mut().find(|d| d.get("id").and_then(Value::as_str) == Some(OVERLAY_DISK_ID)))
            .and_then(Value::as_object_mut)
            .ok_or(ConfigError::Missing("disk with id \"overlay\""))?;
        disk.insert("path".into(), Value::String(path_str(overlay)));
    }
    if let Some(tap) = &with.tap {
        let net = obj
            .get_mut("net")
            .and_then(Value::as_array_mut)
            .and_then(|nets| nets.iter_mut().find(|n| n.get("id").and_then(Value::as_str) == Some(NET_ID)))
            .and_then(Value::as_object_mut)
            .ok_or(ConfigError::Missing("net device with id \"net0\""))?;
        net.insert("tap".into(), Value::String(tap.clone()));
    }
    Ok(())
}

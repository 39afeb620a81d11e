//! `volume_mount` / `volume_unmount`: the guest end of a hot-plugged volume.
//!
//! The host plugs each volume into the VM's virtio-scsi controller as SCSI target `target`,
//! LUN 0, then asks silkd to mount it. The disk is found by its SCSI address under
//! `/sys/bus/scsi/devices/<host>:0:<target>:0/block/` (no udev in the guest; devtmpfs makes
//! `/dev/sdX`), linked as `/dev/volumes/<name>` and, when asked, mounted (ext4, `nosuid`,
//! `nodev`, read-only unless the claim holds it `rw`). Before the host unplugs it, silkd
//! unmounts it (lazily when busy, so a process holding a file cannot pin the host's detach),
//! removes the link and deletes the SCSI disk so the kernel forgets it cleanly.

use crate::error::OpError;
use crate::rpc::Rpc;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use wire::Response;

/// Where the SCSI bus lists its devices.
const SCSI_DEVICES: &str = "/sys/bus/scsi/devices";
/// Where volume links live.
pub const VOLUME_LINKS: &str = "/dev/volumes";
/// How long a hot-plugged disk may take to appear (the guest scans the bus on the host's event).
const APPEAR_TIMEOUT: Duration = Duration::from_secs(20);
/// How often the bus is re-read while waiting.
const POLL: Duration = Duration::from_millis(25);

/// A volume name: 1 to 64 of `[A-Za-z0-9._-]`, not starting with a dot.
pub fn check_name(name: &str) -> Result<(), OpError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(OpError::bad_request(format!("volume name {name:?}: want 1-64 of [A-Za-z0-9._-], not starting with '.'")))
    }
}

/// The block device (`sdX`) of SCSI target `target`, LUN 0, if the guest has it.
pub fn find_disk(scsi_devices: &Path, target: u16) -> Option<String> {
    let suffix = format!(":0:{target}:0");
    let entries = std::fs::read_dir(scsi_devices).ok()?;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        // `<host>:<channel>:<target>:<lun>`; hosts are `hostN`/`targetN:…` entries too.
        let Some(host) = name.strip_suffix(&suffix) else { continue };
        if host.is_empty() || !host.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let disk = std::fs::read_dir(e.path().join("block")).ok()?.flatten().next()?;
        return Some(disk.file_name().to_string_lossy().into_owned());
    }
    None
}

/// `volume_mount`: waits for the disk, links it and mounts it when asked; answers `done`.
pub async fn volume_mount(
    rpc: &mut Rpc,
    name: String,
    target: u16,
    mount_at: Option<String>,
    read_only: bool,
) -> Result<(), OpError> {
    check_name(&name)?;
    if let Some(m) = &mount_at {
        if !m.starts_with('/') || m == "/" {
            return Err(OpError::bad_request(format!(
                "volume {name}: mount point {m:?} must be an absolute path, not /"
            )));
        }
    }
    tokio::task::spawn_blocking(move || mount_blocking(&name, target, mount_at.as_deref(), read_only))
        .await
        .map_err(|e| OpError::internal(format!("volume_mount: {e}")))??;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn mount_blocking(name: &str, target: u16, mount_at: Option<&str>, read_only: bool) -> Result<(), OpError> {
    let start = Instant::now();
    let dev = loop {
        if let Some(disk) = find_disk(Path::new(SCSI_DEVICES), target) {
            let dev = PathBuf::from("/dev").join(&disk);
            // The node comes first; the disk is usable once the kernel has read its capacity.
            if dev.exists() && sectors(&disk) > 0 {
                break dev;
            }
        }
        if start.elapsed() > APPEAR_TIMEOUT {
            return Err(OpError::not_found(format!(
                "volume {name}: no disk at SCSI target {target} after {APPEAR_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(POLL);
    };
    std::fs::create_dir_all(VOLUME_LINKS).map_err(|e| OpError::io("volume_mount: /dev/volumes", &e))?;
    let link = Path::new(VOLUME_LINKS).join(name);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&dev, &link).map_err(|e| OpError::io("volume_mount: link", &e))?;
    let Some(at) = mount_at else { return Ok(()) };
    std::fs::create_dir_all(at).map_err(|e| OpError::io("volume_mount: mount point", &e))?;
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    let mounted = loop {
        match mount(Some(&dev), at, Some("ext4"), flags, None::<&str>) {
            // Still settling (the SCSI scan finishes after the node appears).
            Err(nix::errno::Errno::ENXIO | nix::errno::Errno::ENODEV) if start.elapsed() < APPEAR_TIMEOUT => {
                std::thread::sleep(POLL)
            }
            other => break other,
        }
    };
    // A read-only disk whose journal a killed holder left dirty cannot replay it: mount it
    // without loading the journal (what was last committed is what is read).
    let mounted = match mounted {
        Err(nix::errno::Errno::EROFS | nix::errno::Errno::EINVAL | nix::errno::Errno::EIO) if read_only => {
            mount(Some(&dev), at, Some("ext4"), flags, Some("noload"))
        }
        other => other,
    };
    match mounted {
        Ok(()) => Ok(()),
        // Mounted there already (the host retried after a lost answer).
        Err(nix::errno::Errno::EBUSY) if mounted_at(&dev).iter().any(|m| m == Path::new(at)) => Ok(()),
        Err(e) => Err(OpError::internal(format!("volume {name}: mounting {} at {at}: {e}", dev.display()))),
    }
}

/// The size of block device `disk` in sectors (0 until the kernel knows it).
fn sectors(disk: &str) -> u64 {
    std::fs::read_to_string(Path::new("/sys/block").join(disk).join("size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Mount points of `dev`, from `/proc/self/mounts`.
fn mounted_at(dev: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mount_points(&text, dev)
}

/// The mount points `mounts` (the `/proc/self/mounts` format) lists for `dev`.
pub fn mount_points(mounts: &str, dev: &Path) -> Vec<PathBuf> {
    let dev = dev.to_string_lossy();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (src, at) = (f.next()?, f.next()?);
            // Octal escapes (`\040` for a space) as the kernel writes them.
            (src == dev).then(|| PathBuf::from(unescape(at)))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `volume_unmount`: unmounts, unlinks and deletes the disk; answers `done` (also when absent).
pub async fn volume_unmount(rpc: &mut Rpc, name: String, target: u16) -> Result<(), OpError> {
    check_name(&name)?;
    tokio::task::spawn_blocking(move || unmount_blocking(&name, target))
        .await
        .map_err(|e| OpError::internal(format!("volume_unmount: {e}")))??;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn unmount_blocking(name: &str, target: u16) -> Result<(), OpError> {
    let link = Path::new(VOLUME_LINKS).join(name);
    let _ = std::fs::remove_file(&link);
    let Some(disk) = find_disk(Path::new(SCSI_DEVICES), target) else { return Ok(()) };
    let dev = PathBuf::from("/dev").join(&disk);
    for at in mounted_at(&dev) {
        if umount2(&at, MntFlags::empty()).is_err() {
            umount2(&at, MntFlags::MNT_DETACH)
                .map_err(|e| OpError::internal(format!("volume {name}: unmounting {}: {e}", at.display())))?;
        }
    }
    let delete = Path::new("/sys/block").join(&disk).join("device/delete");
    std::fs::write(&delete, b"1").map_err(|e| OpError::io("volume_unmount: deleting the disk", &e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["datasets", "a", "model-v1.2_x"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "a/b", "..", "sp ace", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn finds_the_disk_by_scsi_address() {
        let d = tempfile::tempdir().expect("tempdir");
        for (dev, disk) in [("0:0:1:0", Some("sda")), ("0:0:2:0", Some("sdb")), ("target0:0:3", None), ("host0", None)]
        {
            std::fs::create_dir_all(d.path().join(dev)).expect("mkdir");
            if let Some(disk) = disk {
                std::fs::create_dir_all(d.path().join(dev).join("block").join(disk)).expect("mkdir");
            }
        }
        assert_eq!(find_disk(d.path(), 2).as_deref(), Some("sdb"));
        assert_eq!(find_disk(d.path(), 1).as_deref(), Some("sda"));
        assert_eq!(find_disk(d.path(), 3), None);
        assert_eq!(find_disk(Path::new("/nonexistent"), 1), None);
    }

    #[test]
    fn mount_points_of_a_device() {
        let mounts =
            "/dev/sda /mnt/data ext4 ro 0 0\n/dev/sdb /x ext4 rw 0 0\n/dev/sda /mnt/with\\040space ext4 ro 0 0\n";
        assert_eq!(
            mount_points(mounts, Path::new("/dev/sda")),
            vec![PathBuf::from("/mnt/data"), PathBuf::from("/mnt/with space")]
        );
        assert!(mount_points(mounts, Path::new("/dev/sdc")).is_empty());
    }
}

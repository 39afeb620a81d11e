//! Filesystems: the pseudo filesystems every guest needs, and the optional image root
//! (read-only erofs + writable overlay) that guest-init moves into, switch_root style.

use crate::cmdline::Overlay;
use crate::console::say;
use nix::mount::{mount, MsFlags};
use nix::sys::stat::Mode;
use std::path::Path;
use std::time::{Duration, Instant};

/// A mount or root-switch step that failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("mounting {fstype} {source} on {target}")]
    Mount {
        fstype: String,
        source: String,
        target: String,
        #[source]
        errno: nix::Error,
    },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}")]
    Sys {
        what: &'static str,
        #[source]
        errno: nix::Error,
    },
    #[error("device {0} did not appear within 5 s")]
    NoDevice(String),
}

/// Where the new root is assembled inside the initramfs.
const NEW_ROOT: &str = "/newroot";
/// Mount point of the read-only image inside the initramfs.
const LOWER: &str = "/.chrysalis-lower";
/// Mount point of the writable layer's filesystem inside the initramfs.
const RW: &str = "/.chrysalis-rw";
/// Per-boot tmpfs in the new root holding guest-init's copy of silkd.
pub const CHRYSALIS_DIR: &str = "/.chrysalis";

fn mkdir(path: &str) -> Result<(), MountError> {
    std::fs::create_dir_all(path).map_err(|source| MountError::Io { what: "creating", path: path.into(), source })
}

fn do_mount(source: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) -> Result<(), MountError> {
    mkdir(target)?;
    mount(Some(source), target, Some(fstype), flags, data).map_err(|errno| MountError::Mount {
        fstype: fstype.into(),
        source: source.into(),
        target: target.into(),
        errno,
    })
}

fn is_mountpoint(path: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| m.lines().any(|l| l.split_whitespace().nth(1) == Some(path)))
        .unwrap_or(false)
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC);

/// Mounts `/proc`, `/sys` and `/dev` (devtmpfs): enough to read the command line and see disks.
pub fn mount_early() -> Result<(), MountError> {
    if !Path::new("/proc/self").exists() {
        do_mount("proc", "/proc", "proc", NOSUID_NODEV_NOEXEC, None)?;
    }
    if !is_mountpoint("/sys") {
        do_mount("sysfs", "/sys", "sysfs", NOSUID_NODEV_NOEXEC, None)?;
    }
    if !is_mountpoint("/dev") {
        do_mount("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, Some("mode=0755"))?;
    }
    Ok(())
}

/// Mounts the rest in the final root: `/dev/pts`, `/dev/shm`, `/tmp`, `/run`, plus the
/// `/dev/fd`, `/dev/std*` links that devtmpfs lacks.
pub fn mount_late() -> Result<(), MountError> {
    do_mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    do_mount("shm", "/dev/shm", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    do_mount("tmpfs", "/tmp", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    do_mount("tmpfs", "/run", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))?;
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if std::fs::symlink_metadata(link).is_err() {
            std::os::unix::fs::symlink(target, link).map_err(|source| MountError::Io {
                what: "linking",
                path: link.into(),
                source,
            })?;
        }
    }
    Ok(())
}

fn wait_for_device(dev: &str) -> Result<(), MountError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !Path::new(dev).exists() {
        if Instant::now() > deadline {
            return Err(MountError::NoDevice(dev.into()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Mounts the writable layer's filesystem on [`RW`]; an unusable disk falls back to tmpfs
/// (with a console warning) so the guest still comes up.
fn mount_rw(overlay: &Overlay) -> Result<&'static str, MountError> {
    if let Overlay::Disk(dev) = overlay {
        let res = wait_for_device(dev).and_then(|()| do_mount(dev, RW, "ext4", MsFlags::MS_NOATIME, None));
        match res {
            Ok(()) => return Ok("ext4"),
            Err(e) => say!("WARNING: overlay disk unusable ({}), falling back to tmpfs", foundation::error_chain(&e)),
        }
    }
    do_mount("tmpfs", RW, "tmpfs", MsFlags::empty(), Some("mode=0755"))?;
    Ok("tmpfs")
}

/// Assembles erofs `rootfs` + `overlay` as an overlayfs on [`NEW_ROOT`], copies `silkd` (from
/// the initramfs) into a tmpfs at `/.chrysalis`, moves `/proc`, `/sys`, `/dev` over and makes
/// the new root `/`.
pub fn switch_to_image_root(rootfs: &str, overlay: &Overlay, silkd: Option<&Path>) -> Result<(), MountError> {
    wait_for_device(rootfs)?;
    do_mount(rootfs, LOWER, "erofs", MsFlags::MS_RDONLY, None)?;
    say!("mounted {rootfs} (erofs, read-only)");
    let kind = mount_rw(overlay)?;
    let (upper, work) = (format!("{RW}/upper"), format!("{RW}/work"));
    mkdir(&upper)?;
    mkdir(&work)?;
    let opts = format!("lowerdir={LOWER},upperdir={upper},workdir={work}");
    do_mount("overlay", NEW_ROOT, "overlay", MsFlags::empty(), Some(&opts))?;
    say!("overlay root ready (upper on {kind})");

    let chrysalis = format!("{NEW_ROOT}{CHRYSALIS_DIR}");
    do_mount("tmpfs", &chrysalis, "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755,size=64m"))?;
    if let Some(silkd) = silkd {
        let dest = format!("{chrysalis}/silkd");
        std::fs::copy(silkd, &dest).map_err(|source| MountError::Io {
            what: "copying silkd to",
            path: dest,
            source,
        })?;
    }

    for dir in ["/proc", "/sys", "/dev"] {
        let target = format!("{NEW_ROOT}{dir}");
        mkdir(&target)?;
        mount(Some(dir), target.as_str(), None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(|errno| {
            MountError::Mount { fstype: "move".into(), source: dir.into(), target: target.clone(), errno }
        })?;
    }
    // switch_root: the initramfs cannot be pivot_root'ed away, so move the new root over `/`
    // and chroot into it (the initramfs files stay, unreachable; they are a few MB).
    nix::unistd::chdir(NEW_ROOT).map_err(|errno| MountError::Sys { what: "chdir to the new root", errno })?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|errno| MountError::Sys { what: "moving the new root to /", errno })?;
    nix::unistd::chroot(".").map_err(|errno| MountError::Sys { what: "chroot into the new root", errno })?;
    nix::unistd::chdir("/").map_err(|errno| MountError::Sys { what: "chdir /", errno })?;
    Ok(())
}

/// Makes sure the well-known directories of a root exist (the initramfs root may lack some).
pub fn ensure_dirs() {
    for (dir, mode) in [("/tmp", 0o1777), ("/run", 0o755), ("/root", 0o700)] {
        if !Path::new(dir).exists() && std::fs::create_dir_all(dir).is_ok() {
            let _ = nix::sys::stat::fchmodat(
                nix::fcntl::AT_FDCWD,
                dir,
                Mode::from_bits_truncate(mode),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            );
        }
    }
}

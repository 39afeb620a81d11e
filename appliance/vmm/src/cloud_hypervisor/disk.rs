//! Per-VM writable disks as cheap copies of a raw base image.
//!
//! cloud-hypervisor opens the overlay as a raw image, so "copy-on-write" is done by the host
//! filesystem: [`clone_file`] first tries a reflink (`FICLONE`, instant on btrfs/xfs), and
//! otherwise copies only the allocated extents (`SEEK_DATA`/`SEEK_HOLE` + `copy_file_range`),
//! so a mostly empty ext4 image stays sparse. Used for a VM's overlay at boot, for the overlay
//! saved with a snapshot, and for a clone's overlay at restore.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::SeekFrom;
use rustix::io::Errno;

/// Errors of [`clone_file`].
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Opening, creating, reading or writing one of the files failed.
    #[error("copying {from} to {to}")]
    Copy {
        /// Source image.
        from: PathBuf,
        /// Destination image.
        to: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// How [`clone_file`] made the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneKind {
    /// Shared extents (reflink).
    Reflink,
    /// Allocated extents copied, holes kept.
    SparseCopy,
}

/// Copies `from` to a new file `to` (which must not exist), mode 0600, preferring a reflink.
pub fn clone_file(from: &Path, to: &Path) -> Result<CloneKind, DiskError> {
    let err = |source: std::io::Error| DiskError::Copy { from: from.to_path_buf(), to: to.to_path_buf(), source };
    let src = File::open(from).map_err(err)?;
    clone_open(&src, from, to)
}

/// [`clone_file`] from a file in a directory the VM user can write (a running VM's overlay):
/// `from` is opened with `O_NOFOLLOW` and must be a regular file with one link owned by one
/// of `owners`, so a compromised hypervisor cannot make the driver copy a file of root's
/// (by a symbolic or hard link) into a place the VM user can read.
pub fn clone_file_nofollow(from: &Path, to: &Path, owners: &[u32]) -> Result<CloneKind, DiskError> {
    use std::os::unix::fs::MetadataExt;
    let err = |source: std::io::Error| DiskError::Copy { from: from.to_path_buf(), to: to.to_path_buf(), source };
    let src =
        OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(from).map_err(err)?;
    let m = src.metadata().map_err(err)?;
    if !m.is_file() || m.nlink() != 1 || !owners.contains(&m.uid()) {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "not a regular file with one link owned by uid {owners:?} (uid {}, {} links, mode {:o})",
                m.uid(),
                m.nlink(),
                m.mode()
            ),
        )));
    }
    clone_open(&src, from, to)
}

fn clone_open(src: &File, from: &Path, to: &Path) -> Result<CloneKind, DiskError> {
    let err = |source: std::io::Error| DiskError::Copy { from: from.to_path_buf(), to: to.to_path_buf(), source };
    let dst = OpenOptions::new().write(true).create_new(true).mode(0o600).open(to).map_err(err)?;
    let result = match rustix::fs::ioctl_ficlone(&dst, src) {
        Ok(()) => Ok(CloneKind::Reflink),
        Err(_) => sparse_copy(src, &dst).map(|()| CloneKind::SparseCopy),
    };
    match result {
        Ok(kind) => Ok(kind),
        Err(e) => {
            // Leave no half-written image behind; the copy error is what matters.
            let _ = std::fs::remove_file(to);
            Err(err(e))
        }
    }
}

/// Copies the data extents of `src` into `dst` at the same offsets and sets `dst`'s length.
fn sparse_copy(src: &File, dst: &File) -> std::io::Result<()> {
    let len = src.metadata()?.len();
    dst.set_len(len)?;
    let mut pos = 0u64;
    while pos < len {
        let data = match rustix::fs::seek(src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(Errno::NXIO) => break, // no data after pos: the rest is a hole
            Err(e) if e == Errno::INVAL || e == Errno::OPNOTSUPP => pos, // no SEEK_DATA: copy all
            Err(e) => return Err(e.into()),
        };
        let hole = match rustix::fs::seek(src, SeekFrom::Hole(data)) {
            Ok(h) => h.min(len),
            Err(e) if e == Errno::INVAL || e == Errno::OPNOTSUPP => len,
            Err(e) => return Err(e.into()),
        };
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            let chunk = usize::try_from(hole - off_in).unwrap_or(usize::MAX).min(1 << 30);
            let n = rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), chunk)?;
            if n == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "source shrank while copying"));
            }
        }
        pos = hole;
    }
    dst.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn copies_content_and_keeps_holes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let from = dir.path().join("base.raw");
        let to = dir.path().join("overlay.raw");
        let mut f = File::create(&from).expect("create base");
        f.write_all(b"superblock").expect("write");
        f.seek(std::io::SeekFrom::Start(64 << 20)).expect("seek");
        f.write_all(b"tail").expect("write");
        drop(f);

        let kind = clone_file(&from, &to).expect("clone");
        let a = std::fs::read(&from).expect("read base");
        let b = std::fs::read(&to).expect("read copy");
        assert_eq!(a.len(), b.len());
        assert!(a == b, "copy differs from source");
        let meta = std::fs::metadata(&to).expect("meta");
        assert_eq!(meta.mode() & 0o777, 0o600);
        if kind == CloneKind::SparseCopy {
            // 64 MiB logical, two tiny extents: far fewer than 64 MiB of blocks allocated.
            assert!(meta.blocks() * 512 < 8 << 20, "copy is not sparse: {} blocks", meta.blocks());
        }
    }

    #[test]
    fn refuses_to_overwrite_and_reports_paths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let from = dir.path().join("base.raw");
        let to = dir.path().join("overlay.raw");
        std::fs::write(&from, b"x").expect("write");
        std::fs::write(&to, b"keep").expect("write");
        let e = clone_file(&from, &to).expect_err("must not overwrite");
        assert!(e.to_string().contains("overlay.raw"), "{e}");
        assert_eq!(std::fs::read(&to).expect("read"), b"keep");

        let missing = dir.path().join("missing.raw");
        let e = clone_file(&missing, &dir.path().join("o2.raw")).expect_err("missing source");
        assert!(e.to_string().contains("missing.raw"), "{e}");
        assert!(!dir.path().join("o2.raw").exists());
    }

    #[test]
    fn nofollow_copies_only_single_link_files_of_the_given_owners() {
        let dir = tempfile::tempdir().expect("tempdir");
        let me = rustix::process::geteuid().as_raw();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"root's").expect("write");
        let overlay = dir.path().join("overlay.raw");
        std::fs::write(&overlay, b"guest disk").expect("write");
        clone_file_nofollow(&overlay, &dir.path().join("a.raw"), &[me]).expect("a plain file");
        assert_eq!(std::fs::read(dir.path().join("a.raw")).expect("read"), b"guest disk");

        let link = dir.path().join("link.raw");
        std::os::unix::fs::symlink(&secret, &link).expect("symlink");
        assert!(clone_file_nofollow(&link, &dir.path().join("b.raw"), &[me]).is_err(), "a symbolic link");
        let hard = dir.path().join("hard.raw");
        std::fs::hard_link(&secret, &hard).expect("hard link");
        assert!(clone_file_nofollow(&hard, &dir.path().join("c.raw"), &[me]).is_err(), "a hard link");
        assert!(clone_file_nofollow(&overlay, &dir.path().join("d.raw"), &[me + 1]).is_err(), "another owner");
        for f in ["b.raw", "c.raw", "d.raw"] {
            assert!(!dir.path().join(f).exists(), "{f} was written");
        }
    }
}

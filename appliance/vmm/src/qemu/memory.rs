//! Guest RAM that clones share ([`Ram`]).
//!
//! - A [`Ram::SharedFile`] VM (a pool's golden) maps `<vmdir>/memory` shared: the driver makes
//!   the file (sparse, the RAM's size, owned by the VM user so the jailed QEMU can reopen it as
//!   `/proc/self/fd/N`) and QEMU writes the guest's RAM into it. Its snapshot migrates with
//!   `x-ignore-shared` (the stream skips that RAM) and keeps the file as `<snapdir>/memory`
//!   (a hard link once the VM is stopped, so no copy).
//! - A clone of such a snapshot maps the golden's RAM privately (`share=off`). It is given a
//!   sealed copy of the file ([`SharedRam`]): a memfd, one per golden, that no one can write
//!   or resize (`F_SEAL_WRITE|GROW|SHRINK|SEAL`), so a hostile QEMU that reopens it read-write
//!   still cannot change what the next clone starts from; only pages a clone writes become its
//!   own. The copy is allocated whole (the RAM's size, once per golden, charged to sandboxd):
//!   see [`sealed_copy`]. The golden file on disk stays root's and unreachable to the VM user.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::fs::{MemfdFlags, SealFlags, SeekFrom};

use crate::driver::DriverError;

/// Bytes copied per read when sealing a golden's RAM.
const CHUNK: usize = 1 << 20;

/// Makes a VM's own RAM file: `size` bytes, sparse, mode 0600, owned by `owner` (the VM user)
/// when the VM runs jailed.
pub(super) fn create_ram_file(path: &Path, size: u64, owner: Option<(u32, u32)>) -> Result<OwnedFd, DriverError> {
    let io_err = |what: &str, e: io::Error| DriverError::io(format!("{what} {}", path.display()), e);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| io_err("creating", e))?;
    file.set_len(size).map_err(|e| io_err("sizing", e))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(|e| io_err("handing to the VM user", e))?;
    }
    Ok(OwnedFd::from(file))
}

/// Keeps a stopped VM's RAM file as a snapshot's: a hard link (same file system), else a
/// sparse copy; then root's, mode 0600, flushed.
pub(super) fn keep_ram_file(from: &Path, to: &Path) -> Result<(), DriverError> {
    let io_err =
        |what: &str, e: io::Error| DriverError::io(format!("{what} {} as {}", from.display(), to.display()), e);
    let _ = std::fs::remove_file(to);
    if std::fs::hard_link(from, to).is_err() {
        let src = File::open(from).map_err(|e| io_err("opening", e))?;
        let dst = copy_sparse(&src, || {
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(to).map(OwnedFd::from)
        })
        .map_err(|e| io_err("copying", e))?;
        drop(dst);
    }
    let file = File::open(to).map_err(|e| io_err("opening", e))?;
    if rustix::process::geteuid().is_root() {
        std::os::unix::fs::fchown(&file, Some(0), Some(0)).map_err(|e| io_err("taking back", e))?;
    }
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(|e| io_err("restricting", e))?;
    file.sync_all().map_err(|e| io_err("flushing", e))
}

/// Copies the data of `src` (its holes and all-zero chunks stay holes) into the file `open`
/// makes, sized like `src`.
fn copy_sparse(src: &File, open: impl FnOnce() -> io::Result<OwnedFd>) -> io::Result<OwnedFd> {
    let len = src.metadata()?.len();
    let dst = open()?;
    rustix::fs::ftruncate(&dst, len)?;
    let mut buf = vec![0u8; CHUNK];
    let mut pos = 0u64;
    while pos < len {
        let data = match rustix::fs::seek(src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = rustix::fs::seek(src, SeekFrom::Hole(data))?.min(len);
        let mut at = data;
        while at < hole {
            let want = usize::try_from(hole - at).unwrap_or(CHUNK).min(CHUNK);
            let n = rustix::io::pread(src, &mut buf[..want], at)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank while copied"));
            }
            if buf[..n].iter().any(|b| *b != 0) {
                let mut done = 0;
                while done < n {
                    done += rustix::io::pwrite(&dst, &buf[done..n], at + done as u64)?;
                }
            }
            at += n as u64;
        }
        pos = hole;
    }
    Ok(dst)
}

/// A golden RAM file sealed into a memfd: the copy a clone maps.
///
/// The copy is whole, holes included: a fault on a hole of a memfd allocates the page in the
/// memfd and charges it to the faulting QEMU's cgroup, so a clone that touched all its RAM
/// would be charged it twice (the shared page, then its private copy) and be OOM-killed well
/// inside its size class. Allocated here, the golden's RAM is charged once, to sandboxd.
pub(super) fn sealed_copy(path: &Path) -> io::Result<OwnedFd> {
    let src = File::open(path)?;
    let len = src.metadata()?.len();
    let fd = copy_sparse(&src, || {
        Ok(rustix::fs::memfd_create("chrysalis-golden-ram", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?)
    })?;
    rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL)?;
    Ok(fd)
}

/// What identifies one version of a golden's RAM file (a rebuilt golden is a new file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Version {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    len: u64,
}

impl Version {
    fn of(meta: &std::fs::Metadata) -> Self {
        Version {
            dev: meta.dev(),
            ino: meta.ino(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            len: meta.len(),
        }
    }
}

/// The sealed copies of the goldens' RAM, one per golden file, made on a golden's first
/// clone. A copy whose file is gone or replaced is dropped (QEMUs that map it keep theirs).
#[derive(Default)]
pub(super) struct SharedRam {
    sealed: Mutex<HashMap<PathBuf, (Version, Arc<OwnedFd>)>>,
}

impl SharedRam {
    /// A descriptor of the sealed copy of the RAM file at `path` (for one clone to inherit).
    pub(super) fn clone_fd(&self, path: &Path) -> Result<OwnedFd, DriverError> {
        let io_err = |e: io::Error| DriverError::io(format!("sealing the golden RAM {}", path.display()), e);
        let mut sealed = self.sealed.lock().unwrap_or_else(|p| p.into_inner());
        sealed.retain(|p, (v, _)| std::fs::metadata(p).is_ok_and(|m| Version::of(&m) == *v));
        let version = Version::of(&std::fs::metadata(path).map_err(io_err)?);
        let fd = match sealed.get(path) {
            Some((v, fd)) if *v == version => Arc::clone(fd),
            _ => {
                let t0 = std::time::Instant::now();
                let fd = Arc::new(sealed_copy(path).map_err(io_err)?);
                tracing::info!(golden = %path.display(), ms = t0.elapsed().as_millis() as u64, "golden RAM sealed for its clones");
                sealed.insert(path.to_path_buf(), (version, Arc::clone(&fd)));
                fd
            }
        };
        fd.as_fd().try_clone_to_owned().map_err(io_err)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn a_sealed_copy_holds_the_data_is_allocated_whole_and_refuses_every_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mut f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        rustix::io::pwrite(&f, b"golden", 3 << 20).unwrap();
        f.flush().unwrap();
        let fd = sealed_copy(&path).unwrap();
        let mut back = [0u8; 6];
        rustix::io::pread(&fd, &mut back, 3 << 20).unwrap();
        assert_eq!(&back, b"golden");
        assert_eq!(rustix::fs::fstat(&fd).unwrap().st_size, 64 << 20);
        // No holes: a clone's fault never allocates in the shared copy.
        assert!(rustix::fs::fstat(&fd).unwrap().st_blocks * 512 >= 64 << 20);
        // Writes, resizes and new seals are refused, also through a reopened descriptor.
        assert_eq!(rustix::io::pwrite(&fd, b"x", 0).unwrap_err(), rustix::io::Errno::PERM);
        assert_eq!(rustix::fs::ftruncate(&fd, 1).unwrap_err(), rustix::io::Errno::PERM);
        let reopened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)))
            .unwrap();
        assert_eq!(rustix::io::pwrite(&reopened, b"x", 0).unwrap_err(), rustix::io::Errno::PERM);
        // A private writable map (what a clone's QEMU makes) is allowed, and its writes stay its own.
        // SAFETY: a fresh private mapping of a descriptor we own, unmapped below.
        unsafe {
            let p = rustix::mm::mmap(
                std::ptr::null_mut(),
                4 << 20,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
                &reopened,
                0,
            )
            .unwrap();
            *(p as *mut u8).add(3 << 20) = b'G';
            rustix::mm::munmap(p, 4 << 20).unwrap();
        }
        rustix::io::pread(&fd, &mut back, 3 << 20).unwrap();
        assert_eq!(&back, b"golden");
    }

    #[test]
    fn one_sealed_copy_per_golden_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let ram = SharedRam::default();
        let a = ram.clone_fd(&path).unwrap();
        let b = ram.clone_fd(&path).unwrap();
        let ino = |fd: &OwnedFd| rustix::fs::fstat(fd).unwrap().st_ino;
        assert_eq!(ino(&a), ino(&b));
        // A rebuilt golden (a new file at the same path) gets a new copy; a gone one none.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![9u8; 8192]).unwrap();
        let c = ram.clone_fd(&path).unwrap();
        assert_ne!(ino(&a), ino(&c));
        let mut back = [0u8; 1];
        rustix::io::pread(&c, &mut back, 0).unwrap();
        assert_eq!(back, [9]);
        std::fs::remove_file(&path).unwrap();
        assert!(ram.clone_fd(&path).is_err());
        assert!(ram.sealed.lock().unwrap().is_empty());
    }

    #[test]
    fn keeping_a_ram_file_links_it_and_makes_it_private() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("vm-memory");
        std::fs::write(&from, b"ram").unwrap();
        let to = dir.path().join("memory");
        keep_ram_file(&from, &to).unwrap();
        let m = std::fs::metadata(&to).unwrap();
        assert_eq!(m.ino(), std::fs::metadata(&from).unwrap().ino());
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(&to).unwrap(), b"ram");
    }
}

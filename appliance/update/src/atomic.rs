//! Crash-safe file replacement: write a sibling temporary file, fsync it, rename it over the
//! target, fsync the directory ([`foundation::write_atomic`] for whole files; [`tmp_path`] and
//! [`rename`] for the files streamed into place).
//!
//! Used for boot entries and kernels on the ESP (vfat) and for the update records on the state
//! partition (ext4). On vfat, Linux's `rename(2)` over an existing file is fine, and an
//! `fsync` of the directory flushes the directory entry; a filesystem that refuses to fsync a
//! directory (`EINVAL`) is tolerated, nothing else is.
//!
//! The functions return plain [`std::io::Error`]s; every caller wraps them with the path and
//! the step in its own module error.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

/// The temporary sibling of `path` (`<name>.tmp`). Never ends in `.conf`, so systemd-boot
/// ignores a temporary boot entry left by a power cut.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Replaces `path` with `bytes` atomically and durably (mode 0644; on vfat the mount decides).
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    foundation::write_atomic(path, bytes, foundation::PUBLIC_FILE)
}

/// Renames `from` to `to` (replacing `to`) and fsyncs the destination directory.
pub(crate) fn rename(from: &Path, to: &Path) -> io::Result<()> {
    fs::rename(from, to)?;
    sync_parent(to)
}

/// Removes `path`; `Ok(false)` when it did not exist. Does not fsync (callers batch removals
/// and call [`sync_dir`] once).
pub(crate) fn remove(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// fsyncs the directory holding `path`.
pub(crate) fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => sync_dir(Path::new(".")),
    }
}

/// fsyncs a directory so renames and removals in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    match File::open(dir)?.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc_einval()) => Ok(()),
        other => other,
    }
}

fn libc_einval() -> i32 {
    rustix::io::Errno::INVAL.raw_os_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_replaces_and_leaves_no_tmp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.conf");
        write_file(&path, b"one").expect("write");
        write_file(&path, b"two").expect("rewrite");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(dir.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, ["x.conf"], "no temp file left");
        assert_eq!(tmp_path(&path).file_name().and_then(|n| n.to_str()), Some("x.conf.tmp"));
        assert!(remove(&path).expect("remove"));
        assert!(!remove(&path).expect("remove again"));
    }
}

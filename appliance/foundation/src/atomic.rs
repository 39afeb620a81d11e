//! Crash-safe file replacement.
//!
//! [`write_atomic`] writes a sibling temporary file created with its final mode (`O_EXCL`,
//! a random name, so two writers never share one), writes and fsyncs it, renames it over the
//! target and fsyncs the directory. A reader sees the old file or the new one, never a torn
//! one; after a power cut the new file is either complete or absent.
//!
//! [`write_secret`] is the same with mode 0600, in a directory it makes 0700 ([`private_dir`]).
//!
//! [`write_secret_unsynced`] is [`write_secret`] without the two fsyncs, for a hot path whose
//! caller flushes soon after with [`sync_file_and_dir`]: a reader (and a restarted process)
//! still sees the old file or the new one, never a torn one, since the rename is atomic and
//! the page cache outlives the process; only a power cut before the flush can bring back the
//! old file. On ext4 (`auto_da_alloc`) a rename over an existing file also commits its data
//! with the rename, so even then no empty file is left.
//!
//! A filesystem that cannot fsync a directory (`EINVAL`, vfat) is tolerated; no other error is.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use rand::RngCore as _;

/// A file's permission bits (`0o600`, `0o644`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(pub u32);

/// Secrets: tokens, keys, journals holding tokens.
pub const SECRET_FILE: FileMode = FileMode(0o600);
/// Files anyone on the box may read (public keys, certificates, records).
pub const PUBLIC_FILE: FileMode = FileMode(0o644);
/// The mode of a directory holding secrets.
pub const PRIVATE_DIR: u32 = 0o700;

/// The parent of `path` (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// A fresh temporary sibling of `path`: `.<name>.<random>.tmp`. Never ends in the target's
/// extension, so a reader scanning for `*.conf` or `*.json` ignores one left by a power cut.
fn tmp_sibling(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut r = [0u8; 6];
    rand::rng().fill_bytes(&mut r);
    let suffix: String = r.iter().map(|b| format!("{b:02x}")).collect();
    parent(path).join(format!(".{name}.{suffix}.tmp"))
}

/// Replaces `path` with `contents`, atomically and durably; the file is born with `mode`
/// (umask does not apply: the mode is set on the open descriptor before any byte is written).
/// The parent directory must exist.
pub fn write_atomic(path: &Path, contents: &[u8], mode: FileMode) -> io::Result<()> {
    let tmp = tmp_sibling(path);
    let result = write_tmp(&tmp, contents, mode, Sync::Yes)
        .and_then(|()| fs::rename(&tmp, path))
        .and_then(|()| sync_dir(parent(path)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// [`write_secret`] without fsyncs: atomic for readers and for a crash of the process, durable
/// once [`sync_file_and_dir`] has run on `path`.
pub fn write_secret_unsynced(path: &Path, contents: &[u8]) -> io::Result<()> {
    private_dir(parent(path))?;
    let tmp = tmp_sibling(path);
    let result = write_tmp(&tmp, contents, SECRET_FILE, Sync::No).and_then(|()| fs::rename(&tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Makes what [`write_secret_unsynced`] wrote at `path` durable: fsyncs the file now at `path`,
/// then its directory (the rename).
pub fn sync_file_and_dir(path: &Path) -> io::Result<()> {
    File::open(path).and_then(|f| f.sync_all())?;
    sync_dir(parent(path))
}

/// Like [`write_atomic`], but only if `path` does not exist yet: an existing file is left as it
/// is and the error is [`io::ErrorKind::AlreadyExists`]. Two racing writers: one wins, the
/// other gets `AlreadyExists`; a reader never sees a partial file.
pub fn write_new(path: &Path, contents: &[u8], mode: FileMode) -> io::Result<()> {
    let tmp = tmp_sibling(path);
    // link(2) never replaces its target: the exclusive step.
    let result = write_tmp(&tmp, contents, mode, Sync::Yes).and_then(|()| fs::hard_link(&tmp, path));
    let _ = fs::remove_file(&tmp);
    result.and_then(|()| sync_dir(parent(path)))
}

/// Whether [`write_tmp`] fsyncs.
#[derive(PartialEq)]
enum Sync {
    Yes,
    No,
}

/// Creates `tmp` (which must not exist) with `mode`, writes `contents` and fsyncs it (unless
/// `sync` is [`Sync::No`]).
fn write_tmp(tmp: &Path, contents: &[u8], mode: FileMode, sync: Sync) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).create_new(true).mode(mode.0).open(tmp)?;
    // The umask can only have removed bits from `mode`; this puts them back. A filesystem
    // that cannot represent modes (vfat: `EPERM`) keeps its own, never looser than asked
    // for a secret since the file was born `mode & !umask`.
    match f.set_permissions(fs::Permissions::from_mode(mode.0)) {
        Err(e) if e.raw_os_error() == Some(EPERM) => {}
        r => r?,
    }
    f.write_all(contents)?;
    if sync == Sync::Yes {
        f.sync_all()?;
    }
    Ok(())
}

/// `EPERM`: this crate links no libc.
const EPERM: i32 = 1;

/// Writes a secret: mode 0600, in a directory made 0700 if it is missing or looser.
pub fn write_secret(path: &Path, contents: &[u8]) -> io::Result<()> {
    private_dir(parent(path))?;
    write_atomic(path, contents, SECRET_FILE)
}

/// Creates `dir` (and its missing parents) and makes `dir` itself 0700. Missing parents are
/// created 0755; an existing parent is left as it is.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    if let Some(p) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(p)?;
    }
    match fs::DirBuilder::new().mode(PRIVATE_DIR).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
        Err(e) => return Err(e),
    }
    let meta = fs::metadata(dir)?;
    if meta.permissions().mode() & 0o7777 != PRIVATE_DIR {
        fs::set_permissions(dir, fs::Permissions::from_mode(PRIVATE_DIR))?;
    }
    Ok(())
}

/// fsyncs a directory, so a rename into it survives a power cut. `EINVAL` (a filesystem that
/// cannot sync directories, such as vfat on some kernels) is tolerated.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    match File::open(dir).and_then(|d| d.sync_all()) {
        Err(e) if e.raw_os_error() == Some(22) => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(p: &Path) -> u32 {
        fs::metadata(p).expect("metadata").permissions().mode() & 0o7777
    }

    #[test]
    fn replaces_with_the_final_mode_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("state.json");
        write_atomic(&p, b"one", PUBLIC_FILE).expect("first write");
        assert_eq!(fs::read(&p).expect("read"), b"one");
        assert_eq!(mode_of(&p), 0o644);
        write_atomic(&p, b"two", SECRET_FILE).expect("second write");
        assert_eq!(fs::read(&p).expect("read"), b"two");
        assert_eq!(mode_of(&p), 0o600);
        let names: Vec<_> = fs::read_dir(dir.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[test]
    fn the_mode_ignores_the_umask() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("pub");
        // A restrictive umask must not make a public file private, nor a loose one a secret
        // public: the mode is set on the descriptor.
        write_atomic(&p, b"x", FileMode(0o640)).expect("write");
        assert_eq!(mode_of(&p), 0o640);
    }

    #[test]
    fn secrets_are_0600_in_a_0700_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = dir.path().join("a/b");
        fs::create_dir_all(&sub).expect("mkdir");
        fs::set_permissions(&sub, fs::Permissions::from_mode(0o755)).expect("chmod");
        let p = sub.join("token");
        write_secret(&p, b"s3cret").expect("write");
        assert_eq!(mode_of(&p), 0o600);
        assert_eq!(mode_of(&sub), 0o700, "a looser existing directory is tightened");
        let fresh = dir.path().join("x/y/key");
        write_secret(&fresh, b"k").expect("write into missing dirs");
        assert_eq!(mode_of(fresh.parent().expect("parent")), 0o700);
    }

    #[test]
    fn an_unsynced_secret_is_replaced_whole_then_synced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("s/claims.json");
        write_secret_unsynced(&p, b"one").expect("first");
        write_secret_unsynced(&p, b"two").expect("second");
        assert_eq!(fs::read(&p).expect("read"), b"two");
        assert_eq!(mode_of(&p), 0o600);
        assert_eq!(mode_of(p.parent().expect("parent")), 0o700);
        sync_file_and_dir(&p).expect("sync");
        assert_eq!(fs::read_dir(p.parent().expect("parent")).expect("ls").count(), 1, "no temp left");
        assert!(sync_file_and_dir(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn write_new_never_replaces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("rec.json");
        write_new(&p, b"first", PUBLIC_FILE).expect("first");
        let e = write_new(&p, b"second", PUBLIC_FILE).expect_err("exists");
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&p).expect("read"), b"first");
        assert_eq!(mode_of(&p), 0o644);
        assert_eq!(fs::read_dir(dir.path()).expect("ls").count(), 1, "no temp left");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("f");
        write_atomic(&p, b"old", SECRET_FILE).expect("write");
        // The target is a directory now: rename fails, the temp file is removed.
        let d = dir.path().join("d");
        fs::create_dir(&d).expect("mkdir");
        fs::write(d.join("inner"), b"x").expect("fill");
        assert!(write_atomic(&d, b"new", SECRET_FILE).is_err());
        assert_eq!(fs::read(&p).expect("read"), b"old");
        let temps = fs::read_dir(dir.path())
            .expect("ls")
            .filter(|e| e.as_ref().expect("entry").file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(temps, 0);
    }
}

//! Filesystem ops: `fs_*`, `fs_push`/`fs_pull` (tar), `fs_find`, `fs_replace`, `fs_watch`.
//!
//! Each op is an `async fn(&mut Rpc, …) -> Result<(), OpError>` called by the dispatcher
//! with the request's fields; it sends its own terminal `done` (or single `stat` reply) and
//! leaves `error` frames to the engine.
//!
//! Conventions shared by every op here:
//! - **Paths.** A relative path is resolved against `/` (silkd has no per-connection cwd).
//!   An empty path or one with a NUL byte is `bad_request`.
//! - **Errors.** io `NotFound` → `not_found`, any other io error → `internal`, both rendered
//!   `"<op>: <path>: <err>"`; a request that can never succeed (reading a directory, a bad
//!   regex, a bad tar) → `bad_request`.
//! - **Blocking work** runs on `spawn_blocking`; streams (read, list, pull, find) are
//!   produced on a blocking thread into a small bounded channel ([`stream`]), so a slow
//!   client back-pressures the producer and nothing is buffered without bound.
//! - **Uploads** (`fs_write`, `fs_push`) are fed from `data`…`data_end` through a bounded
//!   channel ([`feed`]); a feed that ends without `data_end`, or carries a `stdin` frame,
//!   is `bad_request` and leaves the target untouched.
//! - **Names** that are not UTF-8 are reported lossily (U+FFFD) in `entries`, `match`,
//!   `replaced` and `event` frames.

mod feed;
mod find;
mod list;
mod paths;
mod pull;
mod push;
mod read;
mod replace;
mod stat;
mod stream;
mod watch;
mod write;

#[cfg(test)]
mod testutil;

pub use find::fs_find;
pub use list::fs_list;
pub use paths::{fs_mkdir, fs_rename, fs_rm};
pub use pull::fs_pull;
pub use push::fs_push;
pub use read::fs_read;
pub use replace::fs_replace;
pub use stat::fs_stat;
pub use watch::fs_watch;
pub use write::fs_write;

use crate::error::OpError;
use std::fs::Metadata;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use wire::FileKind;

/// The largest `data` payload silkd emits (the SDK's fs chunk size).
pub(crate) const CHUNK: usize = 256 * 1024;

/// Resolves a request path: relative paths are taken from `/`.
pub(crate) fn resolve(op: &str, path: &str) -> Result<PathBuf, OpError> {
    if path.is_empty() {
        return Err(OpError::bad_request(format!("{op}: path must not be empty")));
    }
    if path.contains('\0') {
        return Err(OpError::bad_request(format!("{op}: path contains a NUL byte")));
    }
    Ok(Path::new("/").join(path))
}

/// An io failure on `path`: `not_found` for `NotFound`, else `internal`; `"<op>: <path>: <err>"`.
pub(crate) fn io_err(op: &str, path: &Path, err: &std::io::Error) -> OpError {
    OpError::io(op, &std::io::Error::new(err.kind(), format!("{}: {err}", path.display())))
}

/// The protocol's kind of an entry, from `lstat`-style metadata.
pub(crate) fn kind_of(meta: &Metadata) -> FileKind {
    let ft = meta.file_type();
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

/// Runs `f` on the blocking pool; a panicked or cancelled worker becomes `internal`.
pub(crate) async fn blocking<T, F>(op: &'static str, f: F) -> Result<T, OpError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, OpError> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(OpError::internal(format!("{op}: worker failed: {e}"))),
    }
}

/// A fresh hidden name next to `base` in `dir` for a temp file or staging dir:
/// `.<base>.silkd-<tag>-<pid>-<n>`. Callers create it with `create_new`/`create_dir`,
/// so a collision is an error, never an overwrite.
pub(crate) fn temp_path(dir: &Path, base: &str, tag: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    // Keep the name well under NAME_MAX (255 bytes) whatever the base.
    let mut cut = base.len().min(100);
    while !base.is_char_boundary(cut) {
        cut -= 1;
    }
    let base = &base[..cut];
    dir.join(format!(".{base}.silkd-{tag}-{}-{n}-{nanos}", std::process::id()))
}

/// The file name of `path` as text, for temp names (`"root"` for `/`).
pub(crate) fn base_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "root".into())
}

/// The lossy text form of a path for reply frames.
pub(crate) fn display(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_takes_relative_paths_from_root() {
        assert_eq!(resolve("op", "a/b").ok(), Some(PathBuf::from("/a/b")));
        assert_eq!(resolve("op", "/x").ok(), Some(PathBuf::from("/x")));
        assert_eq!(resolve("op", "").map_err(|e| e.kind).err(), Some(wire::ErrorKind::BadRequest));
        assert_eq!(resolve("op", "a\0b").map_err(|e| e.kind).err(), Some(wire::ErrorKind::BadRequest));
    }

    #[test]
    fn io_err_maps_kinds() {
        let nf = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = io_err("fs_read", Path::new("/x"), &nf);
        assert_eq!(e.kind, wire::ErrorKind::NotFound);
        assert!(e.message.starts_with("fs_read: /x: "), "{}", e.message);
        let pd = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(io_err("fs_read", Path::new("/x"), &pd).kind, wire::ErrorKind::Internal);
    }

    #[test]
    fn temp_paths_are_unique_and_hidden() {
        let a = temp_path(Path::new("/d"), "f", "w");
        let b = temp_path(Path::new("/d"), "f", "w");
        assert_ne!(a, b);
        assert!(base_name(&a).starts_with(".f.silkd-w-"));
    }
}

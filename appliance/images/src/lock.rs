//! Advisory locks (`flock`) on files in the store root.
//!
//! - `<root>/.lock`, exclusive: around every change of `refs.json` and around `gc`;
//! - `<root>/.gc.lock`: shared by every writer that holds blobs no reference names yet (an
//!   import, a snapshot save, a materialisation, a scratch directory), exclusive by `gc` — so a
//!   collection never removes a blob an unfinished write is about to name.
//!
//! Order: `.gc.lock` before `.lock`. Locks belong to an open file, so two `Store`s in one
//! process exclude each other like two processes do. Linux `flock` does not queue writers
//! ahead of readers, so taking a second shared lock while holding one cannot deadlock.

use std::fs::File;
use std::path::Path;

use rustix::fs::FlockOperation;

use crate::error::ImageError;

/// A held lock; released when dropped (the file is closed).
#[derive(Debug)]
pub(crate) struct LockGuard {
    _file: File,
}

/// Takes a shared or exclusive lock on `path` (created if missing), blocking until granted.
pub(crate) fn lock(path: &Path, exclusive: bool) -> Result<LockGuard, ImageError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(ImageError::io("opening lock", path))?;
    let op = if exclusive { FlockOperation::LockExclusive } else { FlockOperation::LockShared };
    loop {
        match rustix::fs::flock(&file, op) {
            Ok(()) => return Ok(LockGuard { _file: file }),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(ImageError::io("locking", path)(e.into())),
        }
    }
}

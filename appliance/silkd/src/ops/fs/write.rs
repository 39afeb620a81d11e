//! `fs_write {path, mode?}` + `data`…`data_end` → `done`.
//!
//! The upload goes to a hidden temp file in the target's directory and is renamed over
//! the target only after `data_end`, so readers see the old or the new content, never a
//! mix. Rules:
//! - A symlink `path` is written through: its final target is replaced, the link stays.
//! - An overwritten file keeps its permission bits and (best effort) its owner; `mode` is
//!   ignored then. A new file gets `mode & 0o7777`, default `0o644` (umask not applied).
//! - The parent directory must exist (`not_found` otherwise); a directory, device or FIFO
//!   at `path` is `bad_request`.
//! - A bad feed (input ends without `data_end`, or a `stdin` frame) is `bad_request`; the
//!   temp file is removed and the target is untouched. No fsync (`docs/sandboxd.md` §9.5).

use super::feed;
use super::{base_name, blocking, io_err, resolve, temp_path};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use wire::Response;

const OP: &str = "fs_write";

/// Writes the upload to `path` atomically, then sends `done`.
pub async fn fs_write(rpc: &mut Rpc, path: String, mode: Option<u32>) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    let mut staged = blocking(OP, move || Staged::create(OP, &path, mode)).await?;
    feed::consume(rpc, OP, move |mut rx| {
        loop {
            match rx.next_chunk() {
                Ok(Some(chunk)) => staged.file.write_all(&chunk).map_err(|e| io_err(OP, &staged.target, &e))?,
                Ok(None) => break,
                // The feed's own bad_request is what the client sees; dropping `staged`
                // removes the temp file first.
                Err(e) => return Err(OpError::bad_request(format!("{OP}: {e}"))),
            }
        }
        staged.commit()
    })
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// Atomically replaces the contents of the existing regular file `path` (through
/// symlinks), keeping its mode and owner. For `fs_replace`.
pub(crate) fn replace_contents(op: &'static str, path: &Path, data: &[u8]) -> Result<(), OpError> {
    let mut staged = Staged::create(op, path, None)?;
    staged.file.write_all(data).map_err(|e| io_err(op, &staged.target, &e))?;
    staged.commit()
}

/// A temp file waiting to replace `target`; removed on drop unless committed.
struct Staged {
    op: &'static str,
    file: File,
    tmp: PathBuf,
    target: PathBuf,
    mode: u32,
    owner: Option<(u32, u32)>,
    committed: bool,
}

impl Staged {
    fn create(op: &'static str, path: &Path, mode: Option<u32>) -> Result<Self, OpError> {
        // Write through symlinks: replace what the link points at, not the link.
        let target = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let existing = match fs::metadata(&target) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(op, &target, &e)),
        };
        if let Some(m) = &existing {
            if m.is_dir() {
                return Err(OpError::bad_request(format!("{op}: {}: is a directory", target.display())));
            }
            if !m.is_file() {
                return Err(OpError::bad_request(format!("{op}: {}: not a regular file", target.display())));
            }
        }
        let final_mode = match &existing {
            Some(m) => m.mode() & 0o7777,
            None => mode.map_or(0o644, |m| m & 0o7777),
        };
        let dir = target
            .parent()
            .ok_or_else(|| OpError::bad_request(format!("{op}: {}: not a file path", target.display())))?;
        let tmp = temp_path(dir, &base_name(&target), "write");
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io_err(op, &target, &e))?;
        Ok(Self {
            op,
            file,
            tmp,
            target,
            mode: final_mode,
            owner: existing.as_ref().map(|m| (m.uid(), m.gid())),
            committed: false,
        })
    }

    fn commit(mut self) -> Result<(), OpError> {
        if let Some((uid, gid)) = self.owner {
            // Best effort: only root can give a file away; chown before chmod because
            // chown clears set-id bits.
            let _ = std::os::unix::fs::fchown(&self.file, Some(uid), Some(gid));
        }
        self.file.set_permissions(Permissions::from_mode(self.mode)).map_err(|e| io_err(self.op, &self.target, &e))?;
        fs::rename(&self.tmp, &self.target).map_err(|e| io_err(self.op, &self.target, &e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, entries_named, kind_of_err, p};
    use crate::rpc::Input;

    async fn write(path: &Path, mode: Option<u32>, chunks: Vec<Input>) -> Vec<Response> {
        let path = p(path);
        drive(chunks, move |mut rpc| async move { fs_write(&mut rpc, path, mode).await }).await
    }

    fn data(b: &[u8]) -> Input {
        Input::Data(b.to_vec())
    }

    #[tokio::test]
    async fn writes_10_mib_in_chunks_then_done() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("big.bin");
        let content: Vec<u8> = (0..10 * 1024 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut chunks: Vec<Input> = content.chunks(256 * 1024).map(data).collect();
        chunks.push(Input::DataEnd);
        let frames = write(&f, None, chunks).await;
        assert_eq!(frames, vec![Response::Done]);
        assert_eq!(fs::read(&f).expect("read"), content);
        assert_eq!(fs::metadata(&f).expect("meta").mode() & 0o7777, 0o644);
        assert_eq!(entries_named(dir.path()), vec!["big.bin".to_string()], "temp file left behind");
    }

    #[tokio::test]
    async fn mode_applies_to_new_files_and_overwrite_keeps_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("x.sh");
        let frames = write(&f, Some(0o100755), vec![data(b"one"), Input::DataEnd]).await;
        assert_eq!(frames, vec![Response::Done]);
        assert_eq!(fs::metadata(&f).expect("meta").mode() & 0o7777, 0o755);
        fs::set_permissions(&f, Permissions::from_mode(0o600)).expect("chmod");
        let frames = write(&f, Some(0o644), vec![data(b"two"), Input::DataEnd]).await;
        assert_eq!(frames, vec![Response::Done]);
        assert_eq!(fs::read(&f).expect("read"), b"two");
        assert_eq!(fs::metadata(&f).expect("meta").mode() & 0o7777, 0o600);
    }

    #[tokio::test]
    async fn empty_upload_makes_an_empty_file_and_symlinks_are_written_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let real = dir.path().join("real");
        fs::write(&real, b"old").expect("write");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        assert_eq!(write(&link, None, vec![data(b"new"), Input::DataEnd]).await, vec![Response::Done]);
        assert!(fs::symlink_metadata(&link).expect("lstat").file_type().is_symlink());
        assert_eq!(fs::read(&real).expect("read"), b"new");
        let empty = dir.path().join("empty");
        assert_eq!(write(&empty, None, vec![Input::DataEnd]).await, vec![Response::Done]);
        assert_eq!(fs::read(&empty).expect("read"), b"");
    }

    #[tokio::test]
    async fn bad_feeds_leave_the_target_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keep.txt");
        fs::write(&f, b"original").expect("write");
        // Input ends without data_end.
        let frames = write(&f, None, vec![data(b"partial")]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest), "{frames:?}");
        // A stdin frame inside the feed.
        let frames = write(&f, None, vec![data(b"partial"), Input::Stdin(b"x".to_vec()), Input::DataEnd]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest), "{frames:?}");
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!(fs::read(&f).expect("read"), b"original");
        assert_eq!(entries_named(dir.path()), vec!["keep.txt".to_string()], "temp file left behind");
    }

    #[tokio::test]
    async fn errors_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let frames = write(&dir.path().join("no/such/dir/f"), None, vec![Input::DataEnd]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::NotFound), "{frames:?}");
        let frames = write(dir.path(), None, vec![Input::DataEnd]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest), "{frames:?}");
        let frames = write(Path::new("/dev/null"), None, vec![Input::DataEnd]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest), "{frames:?}");
        let frames = write(Path::new(""), None, vec![Input::DataEnd]).await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest), "{frames:?}");
    }
}

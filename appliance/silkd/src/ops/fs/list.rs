//! `fs_list {path}` → `entries{entries:[{name, kind, size}]}`… (batches of ≤ 4096) → `done`.
//!
//! Entries come in directory order (unsorted; `.` and `..` omitted) and are streamed batch
//! by batch, so a huge directory is never held in memory. `kind` and `size` are from
//! `lstat` (a symlink is `symlink`, its size the link length; a directory's size is its
//! `st_size`). An entry that vanishes while listing is skipped. `path` itself may be a
//! symlink to a directory; a non-directory `path` is `bad_request`.

use super::stream::{produce, Sink};
use super::{display, io_err, kind_of, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::path::Path;
use wire::{DirEntry, FileKind, Response};

const OP: &str = "fs_list";

/// Entries per `entries` frame.
pub(crate) const BATCH: usize = 4096;

/// Lists `path`.
pub async fn fs_list(rpc: &mut Rpc, path: String) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    produce(rpc, OP, 2, move |sink| list(&path, &sink), |entries| Response::Entries { entries }).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn list(path: &Path, sink: &Sink<Vec<DirEntry>>) -> Result<(), OpError> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(OP, path, &e))?;
    if !meta.is_dir() {
        return Err(OpError::bad_request(format!("{OP}: {}: not a directory", display(path))));
    }
    let dir = std::fs::read_dir(path).map_err(|e| io_err(OP, path, &e))?;
    let mut batch = Vec::with_capacity(BATCH);
    for entry in dir {
        let entry = entry.map_err(|e| io_err(OP, path, &e))?;
        // DirEntry::metadata is lstat (fstatat with AT_SYMLINK_NOFOLLOW).
        let (kind, size) = match entry.metadata() {
            Ok(m) => (kind_of(&m), m.len()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => (FileKind::Other, 0),
        };
        batch.push(DirEntry { name: entry.file_name().to_string_lossy().into_owned(), kind, size });
        if batch.len() == BATCH {
            let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
            sink.send(full).map_err(|_| OpError::internal(format!("{OP}: client went away")))?;
        }
    }
    if !batch.is_empty() {
        sink.send(batch).map_err(|_| OpError::internal(format!("{OP}: client went away")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, kind_of_err, p};

    async fn ls(path: &Path) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_list(&mut rpc, path).await }).await
    }

    #[tokio::test]
    async fn lists_more_than_a_batch_in_batches() {
        let dir = tempfile::tempdir().expect("tempdir");
        for i in 0..5000 {
            std::fs::write(dir.path().join(format!("f{i}")), b"abc").expect("write");
        }
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::os::unix::fs::symlink("f0", dir.path().join("ln")).expect("symlink");
        let frames = ls(dir.path()).await;
        assert_eq!(frames.last(), Some(&Response::Done));
        let mut all = Vec::new();
        let mut sizes = Vec::new();
        for f in &frames[..frames.len() - 1] {
            match f {
                Response::Entries { entries } => {
                    sizes.push(entries.len());
                    all.extend(entries.iter().cloned());
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(sizes, vec![4096, 5002 - 4096]);
        assert_eq!(all.len(), 5002);
        let get = |n: &str| all.iter().find(|e| e.name == n).cloned();
        assert_eq!(get("f42"), Some(DirEntry { name: "f42".into(), kind: FileKind::File, size: 3 }));
        assert_eq!(get("sub").map(|e| e.kind), Some(FileKind::Dir));
        assert_eq!(get("ln").map(|e| (e.kind, e.size)), Some((FileKind::Symlink, 2)));
    }

    #[tokio::test]
    async fn empty_dir_is_just_done_and_errors_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(ls(dir.path()).await, vec![Response::Done]);
        assert_eq!(kind_of_err(&ls(&dir.path().join("missing")).await), Some(wire::ErrorKind::NotFound));
        std::fs::write(dir.path().join("f"), b"").expect("write");
        assert_eq!(kind_of_err(&ls(&dir.path().join("f")).await), Some(wire::ErrorKind::BadRequest));
    }
}

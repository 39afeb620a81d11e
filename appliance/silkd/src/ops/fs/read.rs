//! `fs_read {path}` → `data`… → `done`.
//!
//! The file is read on a blocking thread straight into [`CHUNK`]-sized buffers (one
//! `read(2)` per chunk where the kernel allows) and each buffer becomes one `data` frame.
//! Symlinks are followed. Anything but a regular file (directory, device, FIFO, socket)
//! is `bad_request`; it is checked with `stat` before opening so a FIFO can never block
//! the open, and re-checked on the opened descriptor.

use super::stream::{data_frame, produce, Sink};
use super::{io_err, resolve, CHUNK};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use wire::Response;

const OP: &str = "fs_read";

/// Chunks read ahead of the client.
const DEPTH: usize = 4;

/// Streams the file at `path` as `data` frames, then `done`.
pub async fn fs_read(rpc: &mut Rpc, path: String) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    produce(rpc, OP, DEPTH, move |sink| read_into(&path, &sink), data_frame).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn not_regular(path: &Path, meta: &Metadata) -> Option<OpError> {
    let ft = meta.file_type();
    if ft.is_file() {
        return None;
    }
    let what = if ft.is_dir() { "is a directory" } else { "not a regular file" };
    Some(OpError::bad_request(format!("{OP}: {}: {what}", path.display())))
}

/// Opens `path` as a regular file (never blocking on a FIFO).
pub(crate) fn open_regular(op: &str, path: &Path) -> Result<(File, Metadata), OpError> {
    let meta = fs::metadata(path).map_err(|e| io_err(op, path, &e))?;
    if let Some(e) = not_regular(path, &meta) {
        return Err(e);
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| io_err(op, path, &e))?;
    let meta = file.metadata().map_err(|e| io_err(op, path, &e))?;
    if let Some(e) = not_regular(path, &meta) {
        return Err(e);
    }
    Ok((file, meta))
}

fn read_into(path: &Path, sink: &Sink<Vec<u8>>) -> Result<(), OpError> {
    let (mut file, _) = open_regular(OP, path)?;
    loop {
        // read_to_end into exact capacity: one read(2) per chunk, no zero-fill, and the
        // `take` limit stops it without growing the buffer.
        let mut buf = Vec::with_capacity(CHUNK);
        loop {
            match file.by_ref().take((CHUNK - buf.len()) as u64).read_to_end(&mut buf) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(OP, path, &e)),
            }
        }
        let len = buf.len();
        if len == 0 {
            return Ok(());
        }
        if sink.send(buf).is_err() {
            return Err(OpError::internal(format!("{OP}: client went away")));
        }
        if len < CHUNK {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{data_of, drive, kind_of_err, p};

    async fn read(path: &Path) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_read(&mut rpc, path).await }).await
    }

    #[tokio::test]
    async fn reads_10_mib_in_bounded_chunks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("big");
        let content: Vec<u8> = (0..10 * 1024 * 1024 + 123u32).map(|i| (i % 253) as u8).collect();
        fs::write(&f, &content).expect("write");
        let frames = read(&f).await;
        assert_eq!(frames.last(), Some(&Response::Done));
        assert!(frames.iter().all(|f| match f {
            Response::Data { data } => !data.0.is_empty() && data.0.len() <= CHUNK,
            _ => true,
        }));
        assert_eq!(frames.len(), 41 + 1);
        assert_eq!(data_of(&frames), content);
    }

    #[tokio::test]
    async fn empty_file_is_just_done() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("e");
        fs::write(&f, b"").expect("write");
        assert_eq!(read(&f).await, vec![Response::Done]);
    }

    #[tokio::test]
    async fn errors_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(kind_of_err(&read(dir.path()).await), Some(wire::ErrorKind::BadRequest));
        assert_eq!(kind_of_err(&read(&dir.path().join("missing")).await), Some(wire::ErrorKind::NotFound));
        assert_eq!(kind_of_err(&read(Path::new("/dev/null")).await), Some(wire::ErrorKind::BadRequest));
        let fifo = dir.path().join("fifo");
        let st = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(st.success());
        let frames =
            tokio::time::timeout(std::time::Duration::from_secs(10), read(&fifo)).await.expect("fifo read hung");
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest));
    }
}

//! `fs_pull {path}` → tar as `data`… → `done`.
//!
//! Layout (so that `fs_push(dest=P, fs_pull(P))` round-trips a directory):
//! - a directory `P` → its contents, names relative to `P` (`a.txt`, `sub/`, `sub/b`),
//!   without an entry for `P` itself;
//! - a file `P` → one entry named by its base name.
//!
//! A symlink at `P` itself is followed; symlinks inside are archived as symlinks, never
//! followed. Sockets, FIFOs and devices inside the tree are skipped, as are entries that
//! vanish while the archive is being built. GNU headers (long names and links supported),
//! with mode, uid/gid and mtime.
//!
//! The archive is built on a blocking thread into a [`ChunkWriter`] (256 KiB `data`
//! chunks through a bounded channel): nothing is buffered beyond a few chunks and a slow
//! client stalls the builder. File contents are read in 256 KiB reads. A file that
//! changes size while being archived is cut or zero-padded to the size in its header, so
//! the stream stays a valid tar.

use super::stream::{data_frame, produce, ChunkWriter, Sink};
use super::{display, io_err, resolve, CHUNK};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::path::Path;
use tar::{Builder, EntryType, Header, HeaderMode};
use wire::Response;

const OP: &str = "fs_pull";

/// Chunks built ahead of the client.
const DEPTH: usize = 4;

/// Streams `path` as a tar archive.
pub async fn fs_pull(rpc: &mut Rpc, path: String) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    produce(rpc, OP, DEPTH, move |sink| build(&path, sink), data_frame).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn build(root: &Path, sink: Sink<Vec<u8>>) -> Result<(), OpError> {
    let meta = fs::metadata(root).map_err(|e| io_err(OP, root, &e))?;
    if !meta.is_dir() && !meta.is_file() {
        return Err(OpError::bad_request(format!("{OP}: {}: not a file or directory", display(root))));
    }
    let mut tar = Builder::new(ChunkWriter::new(sink));
    tar.follow_symlinks(false);
    let fail = |e: io::Error| io_err(OP, root, &e);
    if meta.is_file() {
        let name = root.file_name().map(Path::new).unwrap_or(Path::new("file"));
        append_file(&mut tar, root, name).map_err(fail)?;
    } else {
        let walk = walkdir::WalkDir::new(root).min_depth(1).follow_links(false).sort_by_file_name();
        for entry in walk {
            let entry = match entry {
                Ok(e) => e,
                Err(e) if e.io_error().map(io::Error::kind) == Some(io::ErrorKind::NotFound) => continue,
                Err(e) => {
                    let path = e.path().unwrap_or(root).to_path_buf();
                    return Err(io_err(OP, &path, &io::Error::other(e.to_string())));
                }
            };
            let Ok(rel) = entry.path().strip_prefix(root) else {
                continue;
            };
            let ft = entry.file_type();
            let r = if ft.is_file() {
                append_file(&mut tar, entry.path(), rel)
            } else if ft.is_dir() {
                append_dir(&mut tar, entry.path(), rel)
            } else if ft.is_symlink() {
                append_symlink(&mut tar, entry.path(), rel)
            } else {
                continue;
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(OP, entry.path(), &e)),
            }
        }
    }
    let writer = tar.into_inner().map_err(fail)?;
    writer.finish().map_err(fail)
}

fn append_file(tar: &mut Builder<ChunkWriter>, path: &Path, name: &Path) -> io::Result<()> {
    let file = File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(());
    }
    let mut h = Header::new_gnu();
    h.set_metadata_in_mode(&meta, HeaderMode::Complete);
    h.set_entry_type(EntryType::Regular);
    let len = meta.len();
    h.set_size(len);
    let exact = Exact { inner: file.take(len), left: len };
    // 256 KiB reads for big files; small files get a buffer their size.
    let cap = usize::try_from(len).unwrap_or(CHUNK).clamp(512, CHUNK);
    tar.append_data(&mut h, name, BufReader::with_capacity(cap, exact))
}

fn append_dir(tar: &mut Builder<ChunkWriter>, path: &Path, name: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    let mut h = Header::new_gnu();
    h.set_metadata_in_mode(&meta, HeaderMode::Complete);
    h.set_entry_type(EntryType::Directory);
    h.set_size(0);
    tar.append_data(&mut h, name, io::empty())
}

fn append_symlink(tar: &mut Builder<ChunkWriter>, path: &Path, name: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    let target = fs::read_link(path)?;
    let mut h = Header::new_gnu();
    h.set_metadata_in_mode(&meta, HeaderMode::Complete);
    h.set_entry_type(EntryType::Symlink);
    h.set_size(0);
    tar.append_link(&mut h, name, target)
}

/// Yields exactly `left` bytes: the file's, then zeros if it shrank meanwhile.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || out.is_empty() {
            return Ok(0);
        }
        let want = usize::try_from(self.left).unwrap_or(usize::MAX).min(out.len());
        let n = match self.inner.read(&mut out[..want])? {
            0 => {
                out[..want].fill(0);
                want
            }
            n => n,
        };
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{data_of, drive, kind_of_err, p};

    pub(crate) async fn pull(path: &Path) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_pull(&mut rpc, path).await }).await
    }

    #[tokio::test]
    async fn pulls_a_tree_relative_to_the_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        fs::create_dir_all(root.join("sub/deeper")).expect("mkdir");
        fs::write(root.join("a.txt"), b"alpha").expect("write");
        fs::write(root.join("sub/deeper/b.bin"), vec![9u8; 700_000]).expect("write");
        std::os::unix::fs::symlink("../a.txt", root.join("sub/ln")).expect("symlink");
        let long = "x".repeat(150);
        fs::write(root.join(&long), b"long").expect("write");
        let frames = pull(&root).await;
        assert_eq!(frames.last(), Some(&Response::Done));
        let tar_bytes = data_of(&frames);
        let mut ar = tar::Archive::new(&tar_bytes[..]);
        let mut seen = Vec::new();
        for e in ar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let name = e.path().expect("path").to_string_lossy().into_owned();
            let kind = e.header().entry_type();
            let mut body = Vec::new();
            e.read_to_end(&mut body).expect("body");
            let link = e.link_name().expect("link").map(|l| l.to_string_lossy().into_owned());
            seen.push((name, kind, body.len(), link));
        }
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, vec!["a.txt", "sub", "sub/deeper", "sub/deeper/b.bin", "sub/ln", long.as_str()]);
        assert_eq!(seen[3].2, 700_000);
        assert_eq!(seen[4].1, EntryType::Symlink);
        assert_eq!(seen[4].3.as_deref(), Some("../a.txt"));
    }

    #[tokio::test]
    async fn pulls_a_single_file_by_base_name_and_errors_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("one.txt");
        fs::write(&f, b"1").expect("write");
        let tar_bytes = data_of(&pull(&f).await);
        let mut ar = tar::Archive::new(&tar_bytes[..]);
        let names: Vec<String> = ar
            .entries()
            .expect("entries")
            .map(|e| e.expect("entry").path().expect("path").to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["one.txt"]);
        assert_eq!(kind_of_err(&pull(&dir.path().join("nope")).await), Some(wire::ErrorKind::NotFound));
        assert_eq!(kind_of_err(&pull(Path::new("/dev/null")).await), Some(wire::ErrorKind::BadRequest));
    }

    #[test]
    fn exact_pads_a_shrunk_file_and_cuts_a_grown_one() {
        let mut v = Vec::new();
        Exact { inner: &b"abc"[..], left: 5 }.read_to_end(&mut v).expect("read");
        assert_eq!(v, b"abc\0\0");
        let mut v = Vec::new();
        Exact { inner: (&b"abcdef"[..]).take(4), left: 4 }.read_to_end(&mut v).expect("read");
        assert_eq!(v, b"abcd");
    }
}

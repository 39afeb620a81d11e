//! `fs_push {dest}` + tar `data`…`data_end` → `done`.
//!
//! The tar stream is extracted on a blocking thread that reads the upload through a
//! bounded channel ([`FeedReader`]), so the archive is never held in memory. Extraction
//! goes into a hidden staging directory and reaches `dest` only after the whole stream
//! ended cleanly with `data_end`:
//! - `dest` missing: staging is created next to it (parents are created, `mkdir -p`),
//!   and renamed to `dest` at the end.
//! - `dest` an existing directory (or a symlink to one): staging is created *inside* it,
//!   so every final move is a same-filesystem `rename(2)` even when `dest` is a mount
//!   point (e.g. `/tmp`); then each top-level staged entry is merged into `dest`:
//!   directories merge recursively (existing directories keep their mode), anything
//!   else replaces what is there (a symlink in `dest` is replaced, never followed).
//! - `dest` anything else: `bad_request`.
//!
//! A truncated stream (no `data_end`), a `stdin` frame, or a malformed tar is
//! `bad_request` and leaves `dest` as it was (staging removed). Entries that would
//! escape `dest` are refused with `bad_request` before anything is written for them:
//! absolute names, `..` components, names (or hard-link targets) that pass through a
//! symlink, and hard links to absolute or `..` targets. Symlink entries themselves may
//! point anywhere (they are created, never followed). Devices and FIFOs are skipped.
//! Permissions and mtimes are restored; ownership is not (files belong to silkd's user).
//! If the final merge fails midway (e.g. disk full), `dest` can be partly updated; the
//! error is `internal`.

use super::feed::{self, FeedReader};
use super::{base_name, blocking, display, io_err, resolve, temp_path};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};
use wire::Response;

const OP: &str = "fs_push";

/// Extracts the uploaded tar into `dest`, then sends `done`.
pub async fn fs_push(rpc: &mut Rpc, dest: String) -> Result<(), OpError> {
    let dest = resolve(OP, &dest)?;
    let staged = blocking(OP, move || Staging::prepare(&dest)).await?;
    feed::consume(rpc, OP, move |rx| {
        let mut reader = FeedReader::new(rx);
        extract(&mut reader, &staged.dir)?;
        // Only a clean data_end counts: read to the end of the feed (tar padding after
        // the end-of-archive blocks is fine; truncation is an error).
        io::copy(&mut reader, &mut io::sink()).map_err(|e| bad(format!("{e}")))?;
        staged.commit()
    })
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn bad(msg: String) -> OpError {
    OpError::bad_request(format!("{OP}: {msg}"))
}

/// The staging directory; removed (with its contents) on drop unless committed.
struct Staging {
    dir: PathBuf,
    dest: PathBuf,
    /// `dest` existed: merge into it; else rename staging to it.
    merge: bool,
    committed: bool,
}

impl Staging {
    fn prepare(dest: &Path) -> Result<Self, OpError> {
        let dest = fs::canonicalize(dest).unwrap_or_else(|_| dest.to_path_buf());
        let (dir, merge) = match fs::metadata(&dest) {
            Ok(m) if m.is_dir() => (temp_path(&dest, "incoming", "push"), true),
            Ok(_) => return Err(bad(format!("{}: not a directory", display(&dest)))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let parent = dest.parent().ok_or_else(|| bad(format!("{}: bad destination", display(&dest))))?;
                fs::create_dir_all(parent).map_err(|e| io_err(OP, parent, &e))?;
                (temp_path(parent, &base_name(&dest), "push"), false)
            }
            Err(e) => return Err(io_err(OP, &dest, &e)),
        };
        fs::DirBuilder::new().mode(0o755).create(&dir).map_err(|e| io_err(OP, &dir, &e))?;
        Ok(Self { dir, dest, merge, committed: false })
    }

    fn commit(mut self) -> Result<(), OpError> {
        if self.merge {
            merge(&self.dir, &self.dest)?;
            fs::remove_dir(&self.dir).map_err(|e| io_err(OP, &self.dir, &e))?;
        } else {
            fs::rename(&self.dir, &self.dest).map_err(|e| io_err(OP, &self.dest, &e))?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Unpacks every entry of `reader` into `staging`, refusing escapes.
fn extract<R: Read>(reader: &mut R, staging: &Path) -> Result<(), OpError> {
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(false);
    ar.set_overwrite(true);
    let bad_tar = |e: io::Error| bad(format!("bad tar stream: {e}"));
    for entry in ar.entries().map_err(bad_tar)? {
        let mut entry = entry.map_err(bad_tar)?;
        let raw = entry.path().map_err(bad_tar)?.into_owned();
        let rel = contained(&raw)?;
        if rel.as_os_str().is_empty() {
            continue; // "./" — the destination itself
        }
        let kind = entry.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            continue;
        }
        no_symlink_parents(staging, &rel, &raw)?;
        if kind.is_hard_link() {
            let link = entry
                .link_name()
                .map_err(bad_tar)?
                .ok_or_else(|| bad(format!("{}: hard link without a target", raw.display())))?
                .into_owned();
            let lrel = contained(&link)?;
            no_symlink_parents(staging, &lrel, &link)?;
        }
        match entry.unpack_in(staging) {
            Ok(true) => {}
            Ok(false) => return Err(bad(format!("{}: refused: escapes the destination", raw.display()))),
            Err(e) => {
                return Err(match e.kind() {
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput => {
                        bad(format!("bad tar stream: {e}"))
                    }
                    _ => io_err(OP, &staging.join(&rel), &e),
                })
            }
        }
    }
    Ok(())
}

/// `name` as a path inside the destination: `.` parts dropped; absolute or `..` refused.
fn contained(name: &Path) -> Result<PathBuf, OpError> {
    let mut out = PathBuf::new();
    for c in name.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(bad(format!("{}: refused: absolute path", name.display())));
            }
            Component::ParentDir => {
                return Err(bad(format!("{}: refused: `..` in path", name.display())));
            }
        }
    }
    Ok(out)
}

/// Refuses `rel` if any of its parents inside `root` is a symlink or a non-directory.
fn no_symlink_parents(root: &Path, rel: &Path, shown: &Path) -> Result<(), OpError> {
    let mut cur = root.to_path_buf();
    let mut parts = rel.components().peekable();
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            break; // the entry itself may replace anything
        }
        cur.push(part);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(bad(format!("{}: refused: passes through a symlink", shown.display())));
            }
            Ok(m) if !m.is_dir() => {
                return Err(bad(format!("{}: refused: a parent is not a directory", shown.display())));
            }
            Ok(_) => {}
            Err(_) => break, // not created yet; nothing below exists either
        }
    }
    Ok(())
}

/// Moves the contents of `src` into `dst` (see the module doc).
fn merge(src: &Path, dst: &Path) -> Result<(), OpError> {
    let names: Vec<_> = fs::read_dir(src)
        .map_err(|e| io_err(OP, src, &e))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(|e| io_err(OP, src, &e))?;
    for name in names {
        let s = src.join(&name);
        let d = dst.join(&name);
        let smeta = fs::symlink_metadata(&s).map_err(|e| io_err(OP, &s, &e))?;
        let dmeta = match fs::symlink_metadata(&d) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(OP, &d, &e)),
        };
        let fail = |e: io::Error| io_err(OP, &d, &e);
        match dmeta {
            Some(m) if m.is_dir() && smeta.is_dir() => {
                merge(&s, &d)?;
                fs::remove_dir(&s).map_err(|e| io_err(OP, &s, &e))?;
                continue;
            }
            Some(m) if m.is_dir() => fs::remove_dir_all(&d).map_err(fail)?,
            Some(_) if smeta.is_dir() => fs::remove_file(&d).map_err(fail)?,
            _ => {}
        }
        fs::rename(&s, &d).map_err(fail)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{data_of, drive, entries_named, kind_of_err, p};
    use crate::rpc::Input;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use tar::{Builder, EntryType, Header};
    use wire::ErrorKind;

    async fn push(dest: &Path, inputs: Vec<Input>) -> Vec<Response> {
        let dest = p(dest);
        drive(inputs, move |mut rpc| async move { fs_push(&mut rpc, dest).await }).await
    }

    async fn pull(path: &Path) -> Vec<u8> {
        let path = p(path);
        let frames = drive(Vec::new(), move |mut rpc| async move { super::super::fs_pull(&mut rpc, path).await }).await;
        assert_eq!(frames.last(), Some(&Response::Done), "{:?}", frames.last());
        data_of(&frames)
    }

    /// The upload as 1 MiB `data` frames (the SDK's bulk chunk), then `data_end`.
    fn feed(tar: &[u8]) -> Vec<Input> {
        let mut v: Vec<Input> = tar.chunks(1 << 20).map(|c| Input::Data(c.to_vec())).collect();
        v.push(Input::DataEnd);
        v
    }

    /// A header with a raw (unvalidated) name, as a hostile client could send.
    fn raw(b: &mut Builder<Vec<u8>>, name: &str, kind: EntryType, link: Option<&str>, data: &[u8]) {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(l) = link {
            old.linkname[..l.len()].copy_from_slice(l.as_bytes());
        }
        h.set_cksum();
        b.append(&h, data).expect("append");
    }

    /// (name, type, mode, body) of every entry (mtimes differ legitimately: a directory's
    /// mtime moves when entries are created in it).
    fn listing(tar: &[u8]) -> Vec<(String, EntryType, u32, Vec<u8>)> {
        let mut ar = tar::Archive::new(tar);
        let mut v = Vec::new();
        for e in ar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let mut body = Vec::new();
            e.read_to_end(&mut body).expect("body");
            let name = e.path().expect("path").to_string_lossy().into_owned();
            v.push((name, e.header().entry_type(), e.header().mode().expect("mode"), body));
        }
        v
    }

    fn sample_tar() -> Vec<u8> {
        let mut b = Builder::new(Vec::new());
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Directory);
        h.set_mode(0o750);
        h.set_size(0);
        b.append_data(&mut h, "dir", io::empty()).expect("dir");
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 241) as u8).collect();
        for (name, data, mode) in [
            ("dir/big.bin", &big[..], 0o600),
            ("top.sh", &b"#!/bin/sh\n"[..], 0o755),
            ("dir/deep/er/x", &b"x"[..], 0o644),
        ] {
            let mut h = Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(mode);
            b.append_data(&mut h, name, data).expect("file");
        }
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "dir/ln", "../top.sh").expect("symlink");
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Link);
        h.set_size(0);
        b.append_link(&mut h, "hard", "top.sh").expect("hardlink");
        let long = format!("dir/{}", "n".repeat(180));
        let mut h = Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o644);
        b.append_data(&mut h, &long, &b"long"[..]).expect("long");
        b.into_inner().expect("finish")
    }

    fn check_sample(root: &Path) {
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 241) as u8).collect();
        assert_eq!(fs::read(root.join("dir/big.bin")).expect("big"), big);
        assert_eq!(fs::metadata(root.join("dir/big.bin")).expect("m").mode() & 0o777, 0o600);
        assert_eq!(fs::metadata(root.join("top.sh")).expect("m").mode() & 0o777, 0o755);
        assert_eq!(fs::metadata(root.join("dir")).expect("m").mode() & 0o777, 0o750);
        assert_eq!(fs::read(root.join("dir/deep/er/x")).expect("x"), b"x");
        assert_eq!(fs::read_link(root.join("dir/ln")).expect("ln"), Path::new("../top.sh"));
        assert_eq!(
            fs::metadata(root.join("hard")).expect("m").ino(),
            fs::metadata(root.join("top.sh")).expect("m").ino()
        );
        assert_eq!(fs::read(root.join(format!("dir/{}", "n".repeat(180)))).expect("long"), b"long");
    }

    #[tokio::test]
    async fn push_then_pull_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("new/dest");
        assert_eq!(push(&dest, feed(&sample_tar())).await, vec![Response::Done]);
        check_sample(&dest);
        assert_eq!(entries_named(&dir.path().join("new")), vec!["dest".to_string()], "staging left behind");

        let again = dir.path().join("again");
        let pulled = pull(&dest).await;
        assert_eq!(push(&again, feed(&pulled)).await, vec![Response::Done]);
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 241) as u8).collect();
        assert_eq!(fs::read(again.join("dir/big.bin")).expect("big"), big);
        assert_eq!(fs::metadata(again.join("top.sh")).expect("m").mode() & 0o777, 0o755);
        assert_eq!(fs::read_link(again.join("dir/ln")).expect("ln"), Path::new("../top.sh"));
        assert_eq!(fs::read(again.join(format!("dir/{}", "n".repeat(180)))).expect("long"), b"long");
        assert_eq!(listing(&pull(&again).await), listing(&pulled), "pull(push(pull(x))) differs");
    }

    #[tokio::test]
    async fn push_merges_into_an_existing_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("d");
        fs::create_dir_all(dest.join("dir")).expect("mkdir");
        fs::set_permissions(dest.join("dir"), fs::Permissions::from_mode(0o700)).expect("chmod");
        fs::write(dest.join("dir/keep"), b"keep").expect("write");
        fs::write(dest.join("top.sh"), b"old").expect("write");
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).expect("mkdir");
        // `hard` in dest is a symlink to a directory outside: it must be replaced, not followed.
        std::os::unix::fs::symlink(&outside, dest.join("hard")).expect("symlink");
        assert_eq!(push(&dest, feed(&sample_tar())).await, vec![Response::Done]);
        assert_eq!(fs::read(dest.join("dir/keep")).expect("keep"), b"keep");
        assert_eq!(fs::read(dest.join("top.sh")).expect("top"), b"#!/bin/sh\n");
        assert_eq!(fs::metadata(dest.join("dir")).expect("m").mode() & 0o777, 0o700);
        assert!(fs::symlink_metadata(dest.join("hard")).expect("m").is_file());
        assert!(entries_named(&outside).is_empty());
        assert_eq!(entries_named(&dest), vec!["dir", "hard", "top.sh"], "staging left behind");
    }

    #[tokio::test]
    async fn truncated_or_bad_push_leaves_dest_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("d");
        fs::create_dir(&dest).expect("mkdir");
        fs::write(dest.join("top.sh"), b"old").expect("write");
        let tar = sample_tar();
        // Cut in the middle of the big file, without data_end.
        let mut cut = feed(&tar[..1_500_000]);
        cut.pop();
        let frames = push(&dest, cut).await;
        assert_eq!(kind_of_err(&frames), Some(ErrorKind::BadRequest), "{frames:?}");
        // The whole archive but no data_end.
        let mut no_end = feed(&tar);
        no_end.pop();
        let frames = push(&dest, no_end).await;
        assert_eq!(kind_of_err(&frames), Some(ErrorKind::BadRequest), "{frames:?}");
        // A stdin frame in the feed.
        let mut stdin = feed(&tar);
        stdin.insert(1, Input::Stdin(b"x".to_vec()));
        let frames = push(&dest, stdin).await;
        assert_eq!(kind_of_err(&frames), Some(ErrorKind::BadRequest), "{frames:?}");
        // Not a tar at all.
        let frames = push(&dest, feed(&vec![0x41u8; 4096])).await;
        assert_eq!(kind_of_err(&frames), Some(ErrorKind::BadRequest), "{frames:?}");
        assert_eq!(entries_named(&dest), vec!["top.sh"]);
        assert_eq!(fs::read(dest.join("top.sh")).expect("top"), b"old");

        // A missing dest stays missing.
        let fresh = dir.path().join("fresh");
        let mut cut = feed(&tar[..1_500_000]);
        cut.pop();
        assert_eq!(kind_of_err(&push(&fresh, cut).await), Some(ErrorKind::BadRequest));
        assert_eq!(entries_named(dir.path()), vec!["d"]);
    }

    #[tokio::test]
    async fn escapes_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("d");
        fs::create_dir(&dest).expect("mkdir");
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).expect("mkdir");
        let out = outside.to_string_lossy().into_owned();
        type Case = (&'static str, Box<dyn Fn(&mut Builder<Vec<u8>>)>);
        let cases: Vec<Case> = vec![
            ("dotdot", Box::new(|b| raw(b, "../evil", EntryType::Regular, None, b"x"))),
            ("nested dotdot", Box::new(|b| raw(b, "a/../../evil", EntryType::Regular, None, b"x"))),
            ("absolute", Box::new(move |b| raw(b, "/etc/evil", EntryType::Regular, None, b"x"))),
            (
                "through symlink",
                Box::new(move |b| {
                    raw(b, "ln", EntryType::Symlink, Some(&out), b"");
                    raw(b, "ln/evil", EntryType::Regular, None, b"x");
                }),
            ),
            (
                "relative symlink out",
                Box::new(|b| {
                    raw(b, "up", EntryType::Symlink, Some(".."), b"");
                    raw(b, "up/outside/evil", EntryType::Regular, None, b"x");
                }),
            ),
            ("hardlink dotdot", Box::new(|b| raw(b, "h", EntryType::Link, Some("../outside/x"), b""))),
            ("hardlink absolute", Box::new(|b| raw(b, "h", EntryType::Link, Some("/etc/passwd"), b""))),
        ];
        for (what, build) in cases {
            let mut b = Builder::new(Vec::new());
            raw(&mut b, "fine.txt", EntryType::Regular, None, b"ok");
            build(&mut b);
            let tar = b.into_inner().expect("tar");
            let frames = push(&dest, feed(&tar)).await;
            assert_eq!(kind_of_err(&frames), Some(ErrorKind::BadRequest), "{what}: {frames:?}");
            assert!(entries_named(&dest).is_empty(), "{what}: dest changed");
            assert!(entries_named(&outside).is_empty(), "{what}: wrote outside");
            assert_eq!(entries_named(dir.path()), vec!["d", "outside"], "{what}");
        }
    }

    #[tokio::test]
    async fn dest_that_is_a_file_is_bad_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("f");
        fs::write(&f, b"x").expect("write");
        assert_eq!(kind_of_err(&push(&f, feed(&sample_tar())).await), Some(ErrorKind::BadRequest));
        assert_eq!(fs::read(&f).expect("read"), b"x");
    }
}

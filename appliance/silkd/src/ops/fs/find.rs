//! `fs_find {path, pattern, glob?}` → `match{file, line, content}`… → `done`.
//!
//! A `grep -rn` over `path` (a directory, walked in name order without following
//! symlinks, or a single file): `pattern` is a Rust `regex` matched against each line
//! (bytes, so non-UTF-8 files still match; `\n` separates lines and is not part of the
//! line). `line` is 1-based; `file` is the absolute path; `content` is the line as lossy
//! UTF-8, cut to [`MAX_CONTENT`] bytes so a match frame stays far below the frame cap.
//! Skipped: non-regular files, symlinks, files larger than [`MAX_FILE`] (8 MiB), binary
//! files (a NUL byte in the first 8 KiB), and unreadable entries.
//! `glob` (globset syntax) filters files: by file name, or — when the glob contains a
//! `/` — by the path relative to `path`. A bad regex or glob is `bad_request`.

use super::stream::{produce, Sink};
use super::{display, io_err, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use globset::{GlobBuilder, GlobMatcher};
use regex::bytes::Regex;
use std::io::Read;
use std::path::Path;
use wire::Response;

const OP: &str = "fs_find";

/// Files larger than this are not searched.
pub(crate) const MAX_FILE: u64 = 8 * 1024 * 1024;
/// A NUL in this many leading bytes marks a file binary.
const BINARY_PROBE: usize = 8 * 1024;
/// The longest `content` reported, in bytes.
pub(crate) const MAX_CONTENT: usize = 4096;

struct Hit {
    file: String,
    line: u64,
    content: String,
}

struct Filter {
    glob: GlobMatcher,
    by_path: bool,
}

impl Filter {
    fn new(glob: &str) -> Result<Self, OpError> {
        let g = GlobBuilder::new(glob)
            .literal_separator(true)
            .build()
            .map_err(|e| OpError::bad_request(format!("{OP}: bad glob: {e}")))?;
        Ok(Self { glob: g.compile_matcher(), by_path: glob.contains('/') })
    }

    fn admits(&self, root: &Path, path: &Path) -> bool {
        if self.by_path {
            path.strip_prefix(root).map(|rel| self.glob.is_match(rel)).unwrap_or(false)
        } else {
            path.file_name().map(|n| self.glob.is_match(n)).unwrap_or(false)
        }
    }
}

/// Streams the lines under `path` that match `pattern`.
pub async fn fs_find(rpc: &mut Rpc, path: String, pattern: String, glob: Option<String>) -> Result<(), OpError> {
    let root = resolve(OP, &path)?;
    let re = Regex::new(&pattern).map_err(|e| OpError::bad_request(format!("{OP}: bad pattern: {e}")))?;
    let filter = match glob.filter(|g| !g.is_empty()) {
        Some(g) => Some(Filter::new(&g)?),
        None => None,
    };
    produce(
        rpc,
        OP,
        64,
        move |sink| search(&root, &re, filter.as_ref(), &sink),
        |h: Hit| Response::Match { file: h.file, line: h.line, content: h.content },
    )
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn search(root: &Path, re: &Regex, filter: Option<&Filter>, sink: &Sink<Hit>) -> Result<(), OpError> {
    std::fs::metadata(root).map_err(|e| io_err(OP, root, &e))?;
    let gone = || OpError::internal(format!("{OP}: client went away"));
    for entry in walkdir::WalkDir::new(root).follow_links(false).sort_by_file_name() {
        let Ok(entry) = entry else { continue };
        if !entry.file_type().is_file() {
            continue;
        }
        let path = entry.path();
        if filter.is_some_and(|f| !f.admits(root, path)) {
            continue;
        }
        let Some(data) = load(path) else { continue };
        let file = display(path);
        for (i, line) in lines(&data).enumerate() {
            if re.is_match(line) {
                let hit = Hit { file: file.clone(), line: i as u64 + 1, content: clip(line) };
                sink.send(hit).map_err(|_| gone())?;
            }
        }
    }
    Ok(())
}

/// The file's bytes, or `None` if it is too big, binary or unreadable.
fn load(path: &Path) -> Option<Vec<u8>> {
    let file = std::fs::File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_FILE {
        return None;
    }
    let mut data = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE + 1).read_to_end(&mut data).ok()?;
    if data.len() as u64 > MAX_FILE || data[..data.len().min(BINARY_PROBE)].contains(&0) {
        return None;
    }
    Some(data)
}

/// The lines of `data` without their `\n` (no phantom empty line after a final `\n`).
fn lines(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    let empty = data.is_empty();
    body.split(|b| *b == b'\n').filter(move |_| !empty)
}

/// `line` as text, at most [`MAX_CONTENT`] bytes (cut on a char boundary).
fn clip(line: &[u8]) -> String {
    let s = String::from_utf8_lossy(&line[..line.len().min(MAX_CONTENT + 4)]);
    if s.len() <= MAX_CONTENT {
        return s.into_owned();
    }
    let mut end = MAX_CONTENT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, kind_of_err, p};
    use std::fs;

    async fn find(path: &Path, pattern: &str, glob: Option<&str>) -> Vec<Response> {
        let (path, pattern, glob) = (p(path), pattern.to_string(), glob.map(str::to_string));
        drive(Vec::new(), move |mut rpc| async move { fs_find(&mut rpc, path, pattern, glob).await }).await
    }

    fn hits(frames: &[Response], root: &Path) -> Vec<(String, u64, String)> {
        assert_eq!(frames.last(), Some(&Response::Done), "{frames:?}");
        frames[..frames.len() - 1]
            .iter()
            .map(|f| match f {
                Response::Match { file, line, content } => {
                    let rel = Path::new(file).strip_prefix(root).expect("under root").to_string_lossy().into_owned();
                    (rel, *line, content.clone())
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn finds_lines_skipping_binary_and_big_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = dir.path();
        fs::create_dir_all(r.join("src/deep")).expect("mkdir");
        fs::write(r.join("a.txt"), "foo 1\nbar\nfoo 3\n").expect("write");
        fs::write(r.join("src/deep/b.rs"), "fn foo() {}\r\nnope").expect("write");
        fs::write(r.join("bin.dat"), b"foo\0foo\n").expect("write");
        let mut big = vec![b'x'; (MAX_FILE + 1) as usize];
        big[..4].copy_from_slice(b"foo\n");
        fs::write(r.join("big.txt"), big).expect("write");
        std::os::unix::fs::symlink("a.txt", r.join("ln.txt")).expect("symlink");
        let got = hits(&find(r, "fo+", None).await, r);
        assert_eq!(
            got,
            vec![
                ("a.txt".to_string(), 1, "foo 1".to_string()),
                ("a.txt".to_string(), 3, "foo 3".to_string()),
                ("src/deep/b.rs".to_string(), 1, "fn foo() {}\r".to_string()),
            ]
        );
        let got = hits(&find(r, "foo", Some("*.rs")).await, r);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "src/deep/b.rs");
        let got = hits(&find(r, "foo", Some("src/**/*.rs")).await, r);
        assert_eq!(got.len(), 1);
        let got = hits(&find(&r.join("a.txt"), "^bar$", None).await, &r.join("a.txt"));
        assert_eq!(got, vec![(String::new(), 2, "bar".to_string())]);
    }

    #[tokio::test]
    async fn long_lines_are_clipped_and_errors_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = dir.path();
        fs::write(r.join("long"), format!("{}é{}\n", "a".repeat(MAX_CONTENT - 1), "b".repeat(100))).expect("write");
        match find(r, "b+", None).await.as_slice() {
            [Response::Match { content, .. }, Response::Done] => {
                assert_eq!(content.len(), MAX_CONTENT - 1, "cut inside a multibyte char");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(kind_of_err(&find(r, "(", None).await), Some(wire::ErrorKind::BadRequest));
        assert_eq!(kind_of_err(&find(r, "a", Some("[")).await), Some(wire::ErrorKind::BadRequest));
        assert_eq!(kind_of_err(&find(&r.join("nope"), "a", None).await), Some(wire::ErrorKind::NotFound));
    }

    #[test]
    fn lines_split_like_grep() {
        let v: Vec<&[u8]> = lines(b"a\n\nb\n").collect();
        assert_eq!(v, vec![&b"a"[..], b"", b"b"]);
        assert_eq!(lines(b"").count(), 0);
        assert_eq!(lines(b"x").count(), 1);
    }
}

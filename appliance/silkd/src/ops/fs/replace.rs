//! `fs_replace {files[], pattern, replacement}` → `replaced{file, replacements}`… → `done`.
//!
//! For each file, in request order: every match of `pattern` (a Rust `regex` over the
//! whole file, multi-line mode so `^`/`$` anchor at line boundaries like `fs_find`) is
//! replaced by `replacement` (`$1`/`${name}` expand capture groups; `$$` is a literal
//! `$`). A changed file is rewritten atomically (temp + rename, keeping mode and owner,
//! through symlinks). Only files with at least one replacement get a `replaced` frame;
//! untouched files are not reported.
//! All files are checked before any is changed: a missing file is `not_found`, a
//! non-regular file or one over [`MAX_FILE`] (64 MiB) is `bad_request`, and nothing is
//! modified in either case. A bad regex is `bad_request`. Relative paths are from `/`.

use super::stream::{produce, Sink};
use super::write::replace_contents;
use super::{display, io_err, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use regex::bytes::RegexBuilder;
use std::path::PathBuf;
use wire::Response;

const OP: &str = "fs_replace";

/// Files larger than this are refused.
pub(crate) const MAX_FILE: u64 = 64 * 1024 * 1024;

/// Applies the replacement to every file.
pub async fn fs_replace(
    rpc: &mut Rpc,
    files: Vec<String>,
    pattern: String,
    replacement: String,
) -> Result<(), OpError> {
    let re = RegexBuilder::new(&pattern)
        .multi_line(true)
        .build()
        .map_err(|e| OpError::bad_request(format!("{OP}: bad pattern: {e}")))?;
    let paths = files.iter().map(|f| resolve(OP, f)).collect::<Result<Vec<_>, _>>()?;
    produce(
        rpc,
        OP,
        16,
        move |sink| replace_all(&paths, &re, replacement.as_bytes(), &sink),
        |(file, replacements)| Response::Replaced { file, replacements },
    )
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn replace_all(
    paths: &[PathBuf],
    re: &regex::bytes::Regex,
    replacement: &[u8],
    sink: &Sink<(String, u64)>,
) -> Result<(), OpError> {
    for p in paths {
        let meta = std::fs::metadata(p).map_err(|e| io_err(OP, p, &e))?;
        if !meta.is_file() {
            return Err(OpError::bad_request(format!("{OP}: {}: not a regular file", display(p))));
        }
        if meta.len() > MAX_FILE {
            return Err(OpError::bad_request(format!("{OP}: {}: larger than 64 MiB", display(p))));
        }
    }
    for p in paths {
        let data = std::fs::read(p).map_err(|e| io_err(OP, p, &e))?;
        let n = re.find_iter(&data).count() as u64;
        if n == 0 {
            continue;
        }
        let out = re.replace_all(&data, replacement);
        replace_contents(OP, p, &out)?;
        sink.send((display(p), n)).map_err(|_| OpError::internal(format!("{OP}: client went away")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, entries_named, kind_of_err, p};
    use std::fs;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::path::Path;

    async fn replace(files: &[&Path], pattern: &str, replacement: &str) -> Vec<Response> {
        let files: Vec<String> = files.iter().map(|f| p(f)).collect();
        let (pattern, replacement) = (pattern.to_string(), replacement.to_string());
        drive(Vec::new(), move |mut rpc| async move { fs_replace(&mut rpc, files, pattern, replacement).await }).await
    }

    #[tokio::test]
    async fn replaces_and_reports_changed_files_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.txt");
        let b = dir.path().join("b.txt");
        fs::write(&a, "let x = 1;\nlet y = x;\n").expect("write");
        fs::set_permissions(&a, fs::Permissions::from_mode(0o640)).expect("chmod");
        fs::write(&b, "nothing here\n").expect("write");
        let frames = replace(&[&a, &b], r"\blet (\w+)", "const $1").await;
        assert_eq!(frames, vec![Response::Replaced { file: p(&a), replacements: 2 }, Response::Done]);
        assert_eq!(fs::read_to_string(&a).expect("read"), "const x = 1;\nconst y = x;\n");
        assert_eq!(fs::metadata(&a).expect("m").mode() & 0o7777, 0o640);
        assert_eq!(fs::read_to_string(&b).expect("read"), "nothing here\n");
        assert_eq!(entries_named(dir.path()), vec!["a.txt", "b.txt"], "temp file left behind");
        // ^ anchors per line.
        let frames = replace(&[&a], "^const", "var").await;
        assert_eq!(frames, vec![Response::Replaced { file: p(&a), replacements: 2 }, Response::Done]);
    }

    #[tokio::test]
    async fn checks_every_file_before_changing_any() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.txt");
        fs::write(&a, "foo\n").expect("write");
        let frames = replace(&[&a, &dir.path().join("missing")], "foo", "bar").await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::NotFound), "{frames:?}");
        assert_eq!(frames.len(), 1);
        assert_eq!(fs::read_to_string(&a).expect("read"), "foo\n");
        let frames = replace(&[&a, dir.path()], "foo", "bar").await;
        assert_eq!(kind_of_err(&frames), Some(wire::ErrorKind::BadRequest));
        assert_eq!(kind_of_err(&replace(&[&a], "(", "x").await), Some(wire::ErrorKind::BadRequest));
        assert_eq!(fs::read_to_string(&a).expect("read"), "foo\n");
        assert_eq!(replace(&[], "foo", "bar").await, vec![Response::Done]);
    }
}

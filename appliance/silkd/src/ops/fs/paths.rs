//! `fs_mkdir {path, parents?}`, `fs_rm {path, recursive?}`, `fs_rename {from, to}` → `done`.
//!
//! - `fs_mkdir`: mode `0o755` minus umask. Without `parents` the parent must exist and
//!   `path` must not (`internal "File exists"` otherwise); with `parents` it is `mkdir -p`
//!   (an existing directory is fine).
//! - `fs_rm`: never follows symlinks (removes the link). A directory needs `recursive`
//!   unless empty: a non-empty directory without it is `bad_request`. Removing `/` is
//!   refused (`bad_request`).
//! - `fs_rename`: `rename(2)`: atomic, replaces a file or empty directory at `to`, cannot
//!   cross filesystems (`internal`).

use super::{blocking, io_err, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::path::Path;
use wire::Response;

/// Creates a directory.
pub async fn fs_mkdir(rpc: &mut Rpc, path: String, parents: bool) -> Result<(), OpError> {
    const OP: &str = "fs_mkdir";
    let path = resolve(OP, &path)?;
    blocking(OP, move || {
        let r = if parents { std::fs::create_dir_all(&path) } else { std::fs::create_dir(&path) };
        r.map_err(|e| io_err(OP, &path, &e))
    })
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// Removes a file, symlink or directory.
pub async fn fs_rm(rpc: &mut Rpc, path: String, recursive: bool) -> Result<(), OpError> {
    const OP: &str = "fs_rm";
    let path = resolve(OP, &path)?;
    blocking(OP, move || {
        if path.parent().is_none() {
            return Err(OpError::bad_request(format!("{OP}: refusing to remove /")));
        }
        let meta = std::fs::symlink_metadata(&path).map_err(|e| io_err(OP, &path, &e))?;
        let r = if !meta.is_dir() {
            std::fs::remove_file(&path)
        } else if recursive {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_dir(&path)
        };
        r.map_err(|e| match e.kind() {
            std::io::ErrorKind::DirectoryNotEmpty => {
                OpError::bad_request(format!("{OP}: {}: directory not empty (set recursive)", path.display()))
            }
            _ => io_err(OP, &path, &e),
        })
    })
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// Renames `from` to `to`.
pub async fn fs_rename(rpc: &mut Rpc, from: String, to: String) -> Result<(), OpError> {
    const OP: &str = "fs_rename";
    let from = resolve(OP, &from)?;
    let to = resolve(OP, &to)?;
    blocking(OP, move || {
        std::fs::rename(&from, &to).map_err(|e| {
            // Name the side that is missing when we can tell.
            let side: &Path = if std::fs::symlink_metadata(&from).is_err() { &from } else { &to };
            io_err(OP, side, &e)
        })
    })
    .await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, kind_of_err, p};
    use wire::ErrorKind;

    async fn mkdir(path: &Path, parents: bool) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_mkdir(&mut rpc, path, parents).await }).await
    }

    async fn rm(path: &Path, recursive: bool) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_rm(&mut rpc, path, recursive).await }).await
    }

    async fn mv(from: &Path, to: &Path) -> Vec<Response> {
        let (from, to) = (p(from), p(to));
        drive(Vec::new(), move |mut rpc| async move { fs_rename(&mut rpc, from, to).await }).await
    }

    #[tokio::test]
    async fn mkdir_with_and_without_parents() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deep = dir.path().join("a/b/c");
        assert_eq!(kind_of_err(&mkdir(&deep, false).await), Some(ErrorKind::NotFound));
        assert_eq!(mkdir(&deep, true).await, vec![Response::Done]);
        assert!(deep.is_dir());
        assert_eq!(mkdir(&deep, true).await, vec![Response::Done]);
        assert_eq!(kind_of_err(&mkdir(&deep, false).await), Some(ErrorKind::Internal));
    }

    #[tokio::test]
    async fn rm_files_links_and_dirs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().join("d");
        std::fs::create_dir_all(d.join("sub")).expect("mkdir");
        std::fs::write(d.join("sub/f"), b"x").expect("write");
        let target = dir.path().join("target");
        std::fs::create_dir(&target).expect("mkdir");
        std::fs::write(target.join("keep"), b"x").expect("write");
        std::os::unix::fs::symlink(&target, d.join("link")).expect("symlink");

        assert_eq!(kind_of_err(&rm(&d, false).await), Some(ErrorKind::BadRequest));
        assert!(d.join("sub/f").exists());
        assert_eq!(rm(&d.join("link"), false).await, vec![Response::Done]);
        assert!(target.join("keep").exists(), "rm followed a symlink");
        assert_eq!(rm(&d.join("sub/f"), false).await, vec![Response::Done]);
        assert_eq!(rm(&d.join("sub"), false).await, vec![Response::Done]);
        std::fs::write(d.join("g"), b"x").expect("write");
        assert_eq!(rm(&d, true).await, vec![Response::Done]);
        assert!(!d.exists());
        assert_eq!(kind_of_err(&rm(&d, true).await), Some(ErrorKind::NotFound));
        assert_eq!(kind_of_err(&rm(Path::new("/"), true).await), Some(ErrorKind::BadRequest));
    }

    #[tokio::test]
    async fn rename_moves_and_reports_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, b"x").expect("write");
        assert_eq!(mv(&a, &b).await, vec![Response::Done]);
        assert!(!a.exists() && b.exists());
        assert_eq!(kind_of_err(&mv(&a, &b).await), Some(ErrorKind::NotFound));
        assert_eq!(kind_of_err(&mv(&b, &dir.path().join("no/such")).await), Some(ErrorKind::NotFound));
    }
}

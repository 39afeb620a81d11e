//! `fs_stat {path}` → one `stat{info:{kind, size, mode, mtime_epoch_secs}}` (no `done`).
//!
//! Uses `lstat`: a symlink is reported as `kind: "symlink"` with the link's own size, so
//! the `symlink` kind is observable at all. `mode` is the permission bits only,
//! `st_mode & 0o7777` (e.g. `0o644` = 420, set-id and sticky bits included, file type
//! bits excluded — the type is `kind`). `size` is `st_size`; `mtime_epoch_secs` is the
//! whole seconds of `st_mtime` (negative before 1970).

use super::{blocking, io_err, kind_of, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use std::os::unix::fs::MetadataExt;
use wire::{FileInfo, Response};

const OP: &str = "fs_stat";

/// Sends the `stat` reply for `path`.
pub async fn fs_stat(rpc: &mut Rpc, path: String) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    let info = blocking(OP, move || {
        let meta = std::fs::symlink_metadata(&path).map_err(|e| io_err(OP, &path, &e))?;
        Ok(FileInfo {
            kind: kind_of(&meta),
            size: meta.size(),
            mode: meta.mode() & 0o7777,
            mtime_epoch_secs: meta.mtime(),
        })
    })
    .await?;
    rpc.send(Response::Stat { info }).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fs::testutil::{drive, kind_of_err, p};
    use std::os::unix::fs::PermissionsExt;
    use wire::FileKind;

    async fn stat(path: &std::path::Path) -> Vec<Response> {
        let path = p(path);
        drive(Vec::new(), move |mut rpc| async move { fs_stat(&mut rpc, path).await }).await
    }

    #[tokio::test]
    async fn reports_kind_size_mode_mtime() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("f");
        std::fs::write(&f, b"hello").expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o4751)).expect("chmod");
        let mtime = std::fs::metadata(&f).expect("meta").mtime();
        let frames = stat(&f).await;
        assert_eq!(
            frames,
            vec![Response::Stat {
                info: FileInfo { kind: FileKind::File, size: 5, mode: 0o4751, mtime_epoch_secs: mtime }
            }]
        );
        let link = dir.path().join("l");
        std::os::unix::fs::symlink("f", &link).expect("symlink");
        match stat(&link).await.as_slice() {
            [Response::Stat { info }] => assert_eq!((info.kind, info.size), (FileKind::Symlink, 1)),
            other => panic!("{other:?}"),
        }
        match stat(dir.path()).await.as_slice() {
            [Response::Stat { info }] => assert_eq!(info.kind, FileKind::Dir),
            other => panic!("{other:?}"),
        }
        match stat(std::path::Path::new("/dev/null")).await.as_slice() {
            [Response::Stat { info }] => assert_eq!(info.kind, FileKind::Other),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn missing_is_not_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(kind_of_err(&stat(&dir.path().join("nope")).await), Some(wire::ErrorKind::NotFound));
    }
}

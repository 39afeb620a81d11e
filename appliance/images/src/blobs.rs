//! Content-addressed blobs: `<root>/blobs/sha256/<hex>`, immutable, read-only (mode 0444).
//!
//! A blob is written to a temp file in `<root>/tmp/`, hashed while it is copied (sparse: runs
//! of zeros become holes, so a 2 GiB empty ext4 image stays small), fsynced, then renamed into
//! place without replacing an existing blob (`RENAME_NOREPLACE`): two writers of the same
//! content leave one blob. A reflink (`FICLONE`) is tried first where the filesystem has it.
//! Files the store owns already (a snapshot written into a scratch dir) are hashed in place and
//! moved in ([`Blobs::ingest_move`]).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::Digest as _;

use crate::error::ImageError;
use crate::reference::Digest;

/// Copy / hash buffer size.
const CHUNK: usize = 1 << 20;

/// The blob directory of a store.
#[derive(Debug, Clone)]
pub(crate) struct Blobs {
    dir: PathBuf,
    tmp: PathBuf,
}

/// Size facts of a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct BlobSize {
    /// Apparent size in bytes.
    pub len: u64,
    /// Allocated bytes on disk.
    pub disk: u64,
}

fn all_zero(buf: &[u8]) -> bool {
    // OR-folding fixed-size chunks vectorises well and still stops at the first non-zero chunk.
    buf.chunks(4096).all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

fn read_chunk(f: &mut File, buf: &mut [u8], path: &Path) -> Result<usize, ImageError> {
    loop {
        match f.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ImageError::io("reading", path)(e)),
        }
    }
}

/// Hashes a file's content.
pub(crate) fn hash_file(path: &Path) -> Result<(Digest, u64), ImageError> {
    let mut f = File::open(path).map_err(ImageError::io("opening", path))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut len = 0u64;
    loop {
        let n = read_chunk(&mut f, &mut buf, path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
    Ok((Digest::from_hasher(h), len))
}

/// Copies `src` to `dst` (an empty file) leaving holes for zero runs; returns the digest of the content.
fn copy_sparse_hashing(src: &Path, dst: &mut File, dst_path: &Path) -> Result<(Digest, u64), ImageError> {
    let mut f = File::open(src).map_err(ImageError::io("opening", src))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut len = 0u64;
    loop {
        let n = read_chunk(&mut f, &mut buf, src)?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        h.update(chunk);
        if all_zero(chunk) {
            dst.seek(SeekFrom::Current(n as i64)).map_err(ImageError::io("seeking in", dst_path))?;
        } else {
            dst.write_all(chunk).map_err(ImageError::io("writing", dst_path))?;
        }
        len += n as u64;
    }
    dst.set_len(len).map_err(ImageError::io("sizing", dst_path))?;
    Ok((Digest::from_hasher(h), len))
}

/// Copies `src` to a new file `dst`, sparse, without hashing (scratch copies).
pub(crate) fn copy_sparse(src: &Path, dst: &Path) -> Result<(), ImageError> {
    let mut out = File::create_new(dst).map_err(ImageError::io("creating", dst))?;
    if rustix::fs::ioctl_ficlone(&out, &File::open(src).map_err(ImageError::io("opening", src))?).is_ok() {
        return Ok(());
    }
    copy_sparse_hashing(src, &mut out, dst).map(|_| ())
}

fn fsync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

impl Blobs {
    /// The blobs of the store at `root` (directories are created by the store).
    pub(crate) fn new(root: &Path) -> Self {
        Blobs { dir: root.join("blobs").join("sha256"), tmp: root.join("tmp") }
    }

    /// `<root>/blobs/sha256`.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<root>/tmp`.
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// The path of a blob (which may not exist).
    pub(crate) fn path(&self, d: &Digest) -> PathBuf {
        self.dir.join(d.hex())
    }

    /// If `p` is a blob path of this store that exists, its digest.
    pub(crate) fn digest_of_path(&self, p: &Path) -> Option<Digest> {
        if p.parent()? != self.dir {
            return None;
        }
        let d = Digest::from_hex(p.file_name()?.to_str()?)?;
        p.is_file().then_some(d)
    }

    /// Whether the blob exists.
    pub(crate) fn has(&self, d: &Digest) -> bool {
        self.path(d).is_file()
    }

    /// Size facts of a blob.
    pub(crate) fn size(&self, d: &Digest) -> Result<BlobSize, ImageError> {
        let p = self.path(d);
        let m = std::fs::metadata(&p).map_err(ImageError::io("stat", &p))?;
        Ok(BlobSize { len: m.len(), disk: m.blocks() * 512 })
    }

    /// Reads a small blob whole, verifying its hash.
    pub(crate) fn read_verified(&self, d: &Digest, max: u64) -> Result<Vec<u8>, ImageError> {
        let p = self.path(d);
        let f = File::open(&p).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ImageError::not_found(d),
            _ => ImageError::io("opening", &p)(e),
        })?;
        let mut bytes = Vec::new();
        f.take(max + 1).read_to_end(&mut bytes).map_err(ImageError::io("reading", &p))?;
        if bytes.len() as u64 > max {
            return Err(ImageError::Corrupt { digest: d.clone(), actual: format!("larger than {max} bytes") });
        }
        let actual = Digest::of_bytes(&bytes);
        if &actual != d {
            return Err(ImageError::Corrupt { digest: d.clone(), actual: actual.to_string() });
        }
        Ok(bytes)
    }

    /// Re-hashes a blob: [`ImageError::Corrupt`] if it does not match its name.
    pub(crate) fn verify(&self, d: &Digest) -> Result<(), ImageError> {
        let p = self.path(d);
        if !p.exists() {
            return Err(ImageError::not_found(d));
        }
        let (actual, _) = hash_file(&p)?;
        if &actual != d {
            return Err(ImageError::Corrupt { digest: d.clone(), actual: actual.to_string() });
        }
        Ok(())
    }

    fn temp(&self) -> Result<tempfile::NamedTempFile, ImageError> {
        tempfile::Builder::new()
            .prefix(".blob-")
            .tempfile_in(&self.tmp)
            .map_err(ImageError::io("creating a temp file in", &self.tmp))
    }

    /// Seals a temp file holding `d`: fsync, read-only, renamed into place unless the blob exists.
    fn commit(&self, tmp: tempfile::NamedTempFile, d: &Digest) -> Result<(), ImageError> {
        let tp = tmp.path().to_path_buf();
        tmp.as_file().sync_all().map_err(ImageError::io("syncing", &tp))?;
        std::fs::set_permissions(&tp, std::fs::Permissions::from_mode(0o444)).map_err(ImageError::io("chmod", &tp))?;
        let dst = self.path(d);
        match tmp.persist_noclobber(&dst) {
            Ok(_) => {
                fsync_dir(&self.dir);
                tracing::debug!(blob = %d, "blob stored");
                Ok(())
            }
            // Same content stored by someone else meanwhile: keep theirs (the temp file is dropped).
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(ImageError::io("storing blob", dst)(e.error)),
        }
    }

    /// Stores the bytes of a small blob (a manifest).
    pub(crate) fn put_bytes(&self, bytes: &[u8]) -> Result<Digest, ImageError> {
        let d = Digest::of_bytes(bytes);
        if self.has(&d) {
            return Ok(d);
        }
        let mut tmp = self.temp()?;
        let tp = tmp.path().to_path_buf();
        tmp.write_all(bytes).map_err(ImageError::io("writing", &tp))?;
        self.commit(tmp, &d)?;
        Ok(d)
    }

    /// Stores a copy of `src` (reflinked where possible, else copied sparse), hashing its content.
    pub(crate) fn ingest_copy(&self, src: &Path) -> Result<(Digest, u64), ImageError> {
        let meta = std::fs::metadata(src).map_err(ImageError::io("stat", src))?;
        if !meta.is_file() {
            return Err(ImageError::Invalid(format!("{} is not a regular file", src.display())));
        }
        let mut tmp = self.temp()?;
        let tp = tmp.path().to_path_buf();
        let srcf = File::open(src).map_err(ImageError::io("opening", src))?;
        let (d, len) = if rustix::fs::ioctl_ficlone(tmp.as_file(), &srcf).is_ok() {
            hash_file(&tp)?
        } else {
            copy_sparse_hashing(src, tmp.as_file_mut(), &tp)?
        };
        self.commit(tmp, &d)?;
        Ok((d, len))
    }

    /// Moves a file the store owns (inside `<root>/tmp`) into the blobs, hashing it in place.
    /// The source is gone afterwards (moved, or removed when the blob existed already).
    pub(crate) fn ingest_move(&self, src: &Path) -> Result<(Digest, u64), ImageError> {
        let meta = std::fs::symlink_metadata(src).map_err(ImageError::io("stat", src))?;
        if !meta.is_file() {
            return Err(ImageError::Invalid(format!("{} is not a regular file", src.display())));
        }
        let (d, len) = hash_file(src)?;
        {
            let f = OpenOptions::new().read(true).open(src).map_err(ImageError::io("opening", src))?;
            f.sync_all().map_err(ImageError::io("syncing", src))?;
        }
        std::fs::set_permissions(src, std::fs::Permissions::from_mode(0o444)).map_err(ImageError::io("chmod", src))?;
        let dst = self.path(&d);
        match rustix::fs::renameat_with(rustix::fs::CWD, src, rustix::fs::CWD, &dst, rustix::fs::RenameFlags::NOREPLACE)
        {
            Ok(()) => fsync_dir(&self.dir),
            Err(rustix::io::Errno::EXIST) => {
                std::fs::remove_file(src).map_err(ImageError::io("removing", src))?;
            }
            Err(rustix::io::Errno::XDEV) => {
                let (d2, _) = self.ingest_copy(src)?;
                if d2 != d {
                    return Err(ImageError::Invalid(format!("{} changed while being stored", src.display())));
                }
                std::fs::remove_file(src).map_err(ImageError::io("removing", src))?;
            }
            Err(e) => return Err(ImageError::io("moving into the blobs", &dst)(e.into())),
        }
        Ok((d, len))
    }

    /// All blob digests present (files with other names are ignored).
    pub(crate) fn all(&self) -> Result<Vec<Digest>, ImageError> {
        let rd = std::fs::read_dir(&self.dir).map_err(ImageError::io("listing", &self.dir))?;
        let mut out = Vec::new();
        for e in rd {
            let e = e.map_err(ImageError::io("listing", &self.dir))?;
            if let Some(d) = e.file_name().to_str().and_then(Digest::from_hex) {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes a blob; returns the bytes it occupied on disk.
    pub(crate) fn remove(&self, d: &Digest) -> Result<u64, ImageError> {
        let disk = self.size(d).map(|s| s.disk).unwrap_or(0);
        let p = self.path(d);
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(disk),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(ImageError::io("removing", p)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blobs(root: &Path) -> Blobs {
        let b = Blobs::new(root);
        std::fs::create_dir_all(b.dir()).expect("mkdir");
        std::fs::create_dir_all(b.tmp()).expect("mkdir");
        b
    }

    #[test]
    fn zero_detection() {
        assert!(all_zero(&[0u8; 1000]));
        assert!(all_zero(&[]));
        let mut v = vec![0u8; 1000];
        v[999] = 1;
        assert!(!all_zero(&v));
        v[999] = 0;
        v[1] = 1;
        assert!(!all_zero(&v[1..]));
    }

    #[test]
    fn sparse_copy_keeps_holes_and_content() {
        let t = tempfile::tempdir().expect("tempdir");
        let b = blobs(t.path());
        let src = t.path().join("disk.img");
        let mut f = File::create(&src).expect("create");
        f.write_all(b"head").expect("write");
        f.set_len(16 << 20).expect("grow sparse");
        f.seek(SeekFrom::Start((16 << 20) - 4)).expect("seek");
        f.write_all(b"tail").expect("write");
        drop(f);
        let (d, len) = b.ingest_copy(&src).expect("ingest");
        assert_eq!(len, 16 << 20);
        assert_eq!(d, hash_file(&src).expect("hash").0);
        let sz = b.size(&d).expect("size");
        assert_eq!(sz.len, 16 << 20);
        assert!(sz.disk < (4 << 20), "zero runs stay holes, got {} bytes on disk", sz.disk);
        b.verify(&d).expect("verifies");
        let mode = std::fs::metadata(b.path(&d)).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o444, "blobs are read-only");
    }

    #[test]
    fn move_ingest_dedups() {
        let t = tempfile::tempdir().expect("tempdir");
        let b = blobs(t.path());
        let a = b.tmp().join("a");
        let c = b.tmp().join("c");
        std::fs::write(&a, b"same").expect("write");
        std::fs::write(&c, b"same").expect("write");
        let (d1, _) = b.ingest_move(&a).expect("move a");
        let (d2, _) = b.ingest_move(&c).expect("move c");
        assert_eq!(d1, d2);
        assert!(!a.exists() && !c.exists(), "sources are consumed");
        assert_eq!(b.all().expect("list"), vec![d1]);
    }
}

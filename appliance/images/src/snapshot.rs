//! Snapshots in the store: ingesting a driver's snapshot directory ([`Store::save_snapshot`])
//! and materialising one back into a directory the driver restores from.
//!
//! What the QEMU driver's snapshot directory holds (`vmm::qemu`): `state` (the migration
//! stream, opened by the driver and handed to QEMU on restore), `overlay.qcow2` (a copy of the VM's writable disk:
//! a qcow2 whose backing file is the image's `overlay_base`, raw) and `snapshot.json` (the
//! [`vmm::Snapshot`] record with absolute paths). Restore only reads the directory: it creates
//! the clone's own overlay in the clone's VM directory with the snapshot's overlay as backing
//! (opened read-only), so the materialised directory can be hard links to blobs.
//!
//! Ingest: the base image (the spec's kernel, initrd, rootfs, overlay base) is stored as an
//! image manifest (reusing a named one with the same content; files that are blobs of this
//! store already are not re-hashed); the overlay is rebased (`qemu-img rebase -u`) onto the
//! path of the overlay-base blob relative to the materialised directory — after flattening
//! (`qemu-img rebase` without `-u`) when its backing was another qcow2 (a snapshot of a clone);
//! every other file is stored as is.
//!
//! Materialise: `snapshots-materialised/<hex>/` gets a hard link per file and a `snapshot.json`
//! whose paths (`dir`, `overlay`, the spec's kernel/initrd/rootfs/overlay base) all point into
//! the store; it is built in a temp directory and renamed into place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::blobs;
use crate::error::ImageError;
use crate::lock::LockGuard;
use crate::manifest::{safe_relative, ImageManifest, Manifest, SnapshotManifest};
use crate::reference::{Digest, Reference};
use crate::store::{now_secs, ResolvedSnapshot, Store};

/// How a snapshot directory's files get into the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ingest {
    /// Copy (reflink where possible); the directory stays as it was.
    Copy,
    /// Move the files in (the directory is consumed).
    Move,
}

/// A scratch directory under `<root>/tmp/` on the store's filesystem, for a driver to write a
/// snapshot into before [`Store::save_snapshot_moving`]. Removed on drop; no `gc` runs while it exists.
#[derive(Debug)]
pub struct Scratch {
    dir: tempfile::TempDir,
    _gc: LockGuard,
}

impl Scratch {
    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Whether `ns` is a Kubernetes namespace name: an RFC 1123 label (1-63 characters of
/// `[a-z0-9-]`, starting and ending with a letter or digit).
pub fn valid_namespace(ns: &str) -> bool {
    let b = ns.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first() != Some(&b'-')
        && b.last() != Some(&b'-')
}

/// Removes a file on drop unless disarmed.
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Backing file of a qcow2 image, from `qemu-img info`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Backing {
    /// As recorded in the image.
    file: String,
    /// Its format, if recorded.
    format: Option<String>,
}

fn run_tool(program: &Path, args: &[&str]) -> Result<Vec<u8>, ImageError> {
    foundation::tool::run(program, args, None)
        .map_err(|e| ImageError::Tool { program: program.display().to_string(), detail: e.to_string() })
}

impl Store {
    /// A scratch directory for a driver snapshot (see [`Scratch`]).
    pub fn scratch_dir(&self) -> Result<Scratch, ImageError> {
        let gc = self.gc_shared()?;
        let tmp = self.blobs.tmp();
        let dir = tempfile::Builder::new()
            .prefix("scratch-")
            .tempdir_in(tmp)
            .map_err(ImageError::io("creating a scratch directory in", tmp))?;
        Ok(Scratch { dir, _gc: gc })
    }

    /// Stores a copy of the driver snapshot `snap` (its directory stays) under `name`.
    pub fn save_snapshot(&self, name: &str, snap: &vmm::Snapshot) -> Result<Digest, ImageError> {
        self.save_snapshot_with(name, snap, Ingest::Copy, None)
    }

    /// Like [`Store::save_snapshot`] but moves the files in (cheap for a [`Scratch`] directory
    /// on the store's filesystem); `snap.dir` is consumed.
    pub fn save_snapshot_moving(&self, name: &str, snap: &vmm::Snapshot) -> Result<Digest, ImageError> {
        self.save_snapshot_with(name, snap, Ingest::Move, None)
    }

    /// [`Store::save_snapshot_moving`], recording `namespace` as the snapshot's owner
    /// ([`SnapshotManifest::namespace`]); it must be a Kubernetes namespace name (a DNS label).
    pub fn save_snapshot_moving_for(
        &self,
        name: &str,
        snap: &vmm::Snapshot,
        namespace: Option<&str>,
    ) -> Result<Digest, ImageError> {
        self.save_snapshot_with(name, snap, Ingest::Move, namespace)
    }

    fn save_snapshot_with(
        &self,
        name: &str,
        snap: &vmm::Snapshot,
        mode: Ingest,
        namespace: Option<&str>,
    ) -> Result<Digest, ImageError> {
        let reference = Reference::parse(name)?;
        if let Some(ns) = namespace {
            if !valid_namespace(ns) {
                return Err(ImageError::Invalid(format!(
                    "namespace {ns:?} is not a Kubernetes namespace name (1-63 of [a-z0-9-], starting and ending with a letter or digit)"
                )));
            }
        }
        let span = tracing::info_span!("snapshot_save", reference = %reference, vm = %snap.source);
        let _e = span.enter();
        let t0 = std::time::Instant::now();
        let _gc = self.gc_shared()?;
        if !snap.dir.is_dir() {
            return Err(ImageError::Invalid(format!("snapshot directory {} does not exist", snap.dir.display())));
        }
        let overlay_rel = match &snap.overlay {
            None => None,
            Some(o) => Some(
                o.strip_prefix(&snap.dir)
                    .ok()
                    .and_then(|r| r.to_str())
                    .filter(|r| safe_relative(r))
                    .map(str::to_string)
                    .ok_or_else(|| {
                        ImageError::Invalid(format!(
                            "snapshot overlay {} is not inside {}",
                            o.display(),
                            snap.dir.display()
                        ))
                    })?,
            ),
        };
        let (base, base_m) = self.ensure_base_image(&snap.spec)?;
        let mut files = BTreeMap::new();
        for entry in walkdir::WalkDir::new(&snap.dir).follow_links(false).sort_by_file_name() {
            let entry = entry.map_err(|e| {
                let path = e.path().unwrap_or(&snap.dir).to_path_buf();
                ImageError::io("walking", path)(e.into())
            })?;
            if entry.file_type().is_dir() {
                continue;
            }
            let path = entry.path();
            if !entry.file_type().is_file() {
                return Err(ImageError::Invalid(format!("{}: not a regular file", path.display())));
            }
            let rel = path
                .strip_prefix(&snap.dir)
                .ok()
                .and_then(|r| r.to_str())
                .filter(|r| safe_relative(r))
                .ok_or_else(|| ImageError::Invalid(format!("{}: unusable file name", path.display())))?
                .to_string();
            if rel == vmm::Snapshot::FILE {
                continue;
            }
            let d = if overlay_rel.as_deref() == Some(rel.as_str()) {
                self.ingest_overlay(path, &rel, &base_m, mode)?
            } else {
                match mode {
                    Ingest::Copy => self.blobs.ingest_copy(path)?.0,
                    Ingest::Move => self.blobs.ingest_move(path)?.0,
                }
            };
            files.insert(rel, d);
        }
        if let Some(o) = &overlay_rel {
            if !files.contains_key(o) {
                return Err(ImageError::Invalid(format!(
                    "snapshot overlay {o} is missing from {}",
                    snap.dir.display()
                )));
            }
        }
        let m = Manifest::Snapshot(SnapshotManifest {
            base_image: base,
            files,
            overlay: overlay_rel,
            vmm: snap.clone(),
            created: now_secs(),
            namespace: namespace.map(str::to_owned),
        });
        let d = self.blobs.put_bytes(&m.to_bytes())?;
        self.set_ref(&reference, &d)?;
        if mode == Ingest::Move {
            let _ = std::fs::remove_dir_all(&snap.dir);
        }
        tracing::info!(digest = %d, ms = t0.elapsed().as_millis() as u64, "snapshot saved");
        Ok(d)
    }

    /// Stores the image a spec boots (recognising blobs of this store) as an image manifest.
    fn ensure_base_image(&self, spec: &vmm::BootSpec) -> Result<(Digest, ImageManifest), ImageError> {
        let m = ImageManifest {
            kernel: self.ingest_path(&spec.kernel)?,
            initrd: self.ingest_path(&spec.initrd)?,
            rootfs: spec.rootfs.as_deref().map(|p| self.ingest_path(p)).transpose()?,
            overlay_base: spec.overlay_base.as_deref().map(|p| self.ingest_path(p)).transpose()?,
            cmdline: spec.cmdline.clone(),
            created: now_secs(),
        };
        self.put_image_manifest(m)
    }

    fn qemu_img_backing(&self, file: &Path) -> Result<Option<Backing>, ImageError> {
        let f = file.display().to_string();
        let out = run_tool(&self.qemu_img, &["info", "--output=json", "-f", "qcow2", &f])?;
        let v: serde_json::Value = serde_json::from_slice(&out).map_err(|e| ImageError::Tool {
            program: self.qemu_img.display().to_string(),
            detail: format!("unreadable `info` output for {f}: {e}"),
        })?;
        Ok(v.get("backing-filename").and_then(|b| b.as_str()).map(|b| Backing {
            file: b.to_string(),
            format: v.get("backing-filename-format").and_then(|x| x.as_str()).map(str::to_string),
        }))
    }

    /// Stores a snapshot overlay rebased onto the base image's overlay-base blob.
    fn ingest_overlay(&self, path: &Path, rel: &str, base: &ImageManifest, mode: Ingest) -> Result<Digest, ImageError> {
        let Some(ob) = &base.overlay_base else {
            return Err(ImageError::Invalid(format!(
                "the snapshot has an overlay ({rel}) but the image it was booted from has no overlay base"
            )));
        };
        let (work, _guard) = match mode {
            Ingest::Move => (path.to_path_buf(), RemoveOnDrop(None)),
            Ingest::Copy => {
                let w = self.blobs.tmp().join(format!(".overlay-{}-{}", std::process::id(), rand_suffix()));
                blobs::copy_sparse(path, &w)?;
                (w.clone(), RemoveOnDrop(Some(w)))
            }
        };
        let w = work.display().to_string();
        if let Some(b) = self.qemu_img_backing(&work)? {
            if b.format.as_deref() != Some("raw") {
                // A chain (the VM was itself a clone): fold the intermediate layers in.
                tracing::info!(backing = %b.file, "flattening the overlay onto its image's overlay base");
                let abs = self.blob_path(ob).display().to_string();
                run_tool(&self.qemu_img, &["rebase", "-f", "qcow2", "-F", "raw", "-b", &abs, &w])?;
            }
            let depth = rel.split('/').count() - 1;
            let relative = format!("{}blobs/sha256/{}", "../".repeat(2 + depth), ob.hex());
            run_tool(&self.qemu_img, &["rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", &relative, &w])?;
        }
        Ok(self.blobs.ingest_move(&work)?.0)
    }

    /// `<root>/snapshots-materialised/<hex>/`, built on first use.
    pub(crate) fn materialise(&self, d: &Digest, m: &SnapshotManifest) -> Result<ResolvedSnapshot, ImageError> {
        let _gc = self.gc_shared()?;
        let base = self.image_manifest(&m.base_image)?;
        let image = self.image_paths(&m.base_image, &base)?;
        let root = self.materialised_root();
        let dir = root.join(d.hex());
        let mut snap = m.vmm.clone();
        snap.dir = dir.clone();
        snap.overlay = m.overlay.as_ref().map(|o| dir.join(o));
        snap.spec.kernel = image.kernel;
        snap.spec.initrd = image.initrd;
        snap.spec.rootfs = image.rootfs;
        snap.spec.overlay_base = image.overlay_base;
        let resolved =
            ResolvedSnapshot { digest: d.clone(), base_image: m.base_image.clone(), dir: dir.clone(), snapshot: snap };
        if dir.join(vmm::Snapshot::FILE).is_file() {
            return Ok(resolved);
        }
        let tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .tempdir_in(&root)
            .map_err(ImageError::io("creating a temp directory in", &root))?;
        for (rel, b) in &m.files {
            if !safe_relative(rel) || rel == vmm::Snapshot::FILE {
                return Err(ImageError::Invalid(format!("snapshot {d} names an unusable file {rel:?}")));
            }
            let src = self.blobs.path(b);
            if !src.is_file() {
                return Err(ImageError::MissingBlob { digest: b.clone(), by: d.to_string() });
            }
            let dst = tmp.path().join(rel);
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent).map_err(ImageError::io("creating", parent))?;
            }
            if let Err(e) = std::fs::hard_link(&src, &dst) {
                tracing::debug!(error = %e, "hard link failed; copying");
                blobs::copy_sparse(&src, &dst)?;
            }
        }
        let json = serde_json::to_vec_pretty(&resolved.snapshot).unwrap_or_default();
        let sj = tmp.path().join(vmm::Snapshot::FILE);
        std::fs::write(&sj, json).map_err(ImageError::io("writing", &sj))?;
        let t = tmp.keep();
        match std::fs::rename(&t, &dir) {
            Ok(()) => {
                tracing::debug!(snapshot = %d, dir = %dir.display(), "snapshot materialised");
                Ok(resolved)
            }
            // Materialised concurrently by someone else.
            Err(_) if dir.join(vmm::Snapshot::FILE).is_file() => {
                let _ = std::fs::remove_dir_all(&t);
                Ok(resolved)
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&t);
                Err(ImageError::io("renaming into", &dir)(e))
            }
        }
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

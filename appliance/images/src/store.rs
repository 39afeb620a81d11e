//! [`Store`]: the library's API — import, name, resolve, list, untag, verify.
//!
//! Layout under the root: `blobs/sha256/<hex>` (file contents and manifests), `refs.json`
//! (names → manifest digests), `snapshots-materialised/<hex>/` (snapshot directories the
//! driver restores from: hard links to blobs plus a rewritten `snapshot.json`), `tmp/`
//! (writes in flight), `.lock` and `.gc.lock` ([`crate::lock`]).

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::blobs::Blobs;
use crate::error::ImageError;
use crate::lock::{self, LockGuard};
use crate::manifest::{ImageManifest, Kind, Manifest, MAX_MANIFEST_BYTES};
use crate::reference::{Digest, Reference};
use crate::refs::Refs;

/// Name of the materialised-snapshot directory under the root.
pub const MATERIALISED_DIR: &str = "snapshots-materialised";

/// `$CHRYSALIS_STATE/images` (default `/var/lib/chrysalis/images`).
pub fn default_root() -> PathBuf {
    vmm::record::default_state_dir().join("images")
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The files of an image to import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSource {
    /// Uncompressed PVH `vmlinux`.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Read-only erofs root disk.
    pub rootfs: Option<PathBuf>,
    /// Empty ext4 image for per-VM overlays.
    pub overlay_base: Option<PathBuf>,
    /// Extra kernel arguments.
    pub cmdline: String,
}

impl From<&vmm::catalog::Template> for ImageSource {
    fn from(t: &vmm::catalog::Template) -> Self {
        ImageSource {
            kernel: t.kernel.clone(),
            initrd: t.initrd.clone(),
            rootfs: t.rootfs.clone(),
            overlay_base: t.overlay_base.clone(),
            cmdline: t.cmdline.clone(),
        }
    }
}

/// An image resolved to absolute blob paths: what a [`vmm::BootSpec`] needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedImage {
    /// The image manifest.
    pub digest: Digest,
    /// Kernel blob.
    pub kernel: PathBuf,
    /// Initramfs blob.
    pub initrd: PathBuf,
    /// Root disk blob.
    pub rootfs: Option<PathBuf>,
    /// Overlay base blob (QEMU creates each VM's qcow2 overlay on it).
    pub overlay_base: Option<PathBuf>,
    /// Extra kernel arguments.
    pub cmdline: String,
}

impl ResolvedImage {
    /// A boot spec for this image. `name` names the VM's template in logs and prefixes its id.
    pub fn boot_spec(&self, name: &str, size: vmm::SizeClass, accel: vmm::AccelPreference) -> vmm::BootSpec {
        vmm::BootSpec {
            overlay_bytes: None,
            name: name.to_string(),
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            rootfs: self.rootfs.clone(),
            overlay_base: self.overlay_base.clone(),
            cmdline: self.cmdline.clone(),
            size,
            accel,
            nic: None,
            rng: true,
            volumes: true,
            ram: vmm::Ram::Anonymous,
        }
    }
}

/// A snapshot materialised as a directory the driver restores from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedSnapshot {
    /// The snapshot manifest.
    pub digest: Digest,
    /// The image manifest it sits on.
    pub base_image: Digest,
    /// `<root>/snapshots-materialised/<hex>/` (hard links to blobs, read-only: restore only reads it).
    pub dir: PathBuf,
    /// The driver's record with every path pointing into the store: pass it to `Driver::restore`.
    pub snapshot: vmm::Snapshot,
}

/// What a reference resolves to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)] // one per call, never held in bulk
pub enum Resolved {
    /// A bootable image.
    Image(ResolvedImage),
    /// A saved VM state.
    Snapshot(ResolvedSnapshot),
}

impl Resolved {
    /// The manifest digest (what a VM started from it keeps in use).
    pub fn digest(&self) -> &Digest {
        match self {
            Resolved::Image(i) => &i.digest,
            Resolved::Snapshot(s) => &s.digest,
        }
    }

    /// Which kind it is.
    pub fn kind(&self) -> Kind {
        match self {
            Resolved::Image(_) => Kind::Image,
            Resolved::Snapshot(_) => Kind::Snapshot,
        }
    }
}

/// One named entry of the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// Its name.
    pub reference: Reference,
    /// The manifest it names.
    pub digest: Digest,
    /// Image or snapshot.
    pub kind: Kind,
    /// Apparent bytes of its own blobs (a snapshot's files, not its base image).
    pub size: u64,
    /// Bytes those blobs occupy on disk (sparse files count their allocated blocks).
    pub disk: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created: u64,
    /// A snapshot's base image manifest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_image: Option<Digest>,
    /// A snapshot's owning namespace ([`crate::SnapshotManifest::namespace`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The image library rooted at one directory.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) root: PathBuf,
    pub(crate) blobs: Blobs,
    pub(crate) qemu_img: PathBuf,
}

impl Store {
    /// Opens (creating if needed) the store at `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Store, ImageError> {
        let root = root.as_ref();
        std::fs::create_dir_all(root).map_err(ImageError::io("creating", root))?;
        let root = std::fs::canonicalize(root).map_err(ImageError::io("resolving", root))?;
        let blobs = Blobs::new(&root);
        for d in [blobs.dir(), blobs.tmp(), &root.join(MATERIALISED_DIR)] {
            std::fs::create_dir_all(d).map_err(ImageError::io("creating", d))?;
        }
        Ok(Store { root, blobs, qemu_img: "qemu-img".into() })
    }

    /// Uses `qemu_img` (default `qemu-img` from `PATH`) to rebase snapshot overlays.
    pub fn with_qemu_img(mut self, qemu_img: impl Into<PathBuf>) -> Self {
        self.qemu_img = qemu_img.into();
        self
    }

    /// The (canonical) root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where blob `d` lives (whether or not it exists).
    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.blobs.path(d)
    }

    pub(crate) fn refs_path(&self) -> PathBuf {
        self.root.join("refs.json")
    }

    pub(crate) fn materialised_root(&self) -> PathBuf {
        self.root.join(MATERIALISED_DIR)
    }

    /// Shared `.gc.lock`: blobs written under it survive a concurrent `gc`.
    pub(crate) fn gc_shared(&self) -> Result<LockGuard, ImageError> {
        lock::lock(&self.root.join(".gc.lock"), false)
    }

    pub(crate) fn gc_exclusive(&self) -> Result<LockGuard, ImageError> {
        lock::lock(&self.root.join(".gc.lock"), true)
    }

    /// Exclusive `.lock`: ref changes and gc.
    pub(crate) fn refs_lock(&self) -> Result<LockGuard, ImageError> {
        lock::lock(&self.root.join(".lock"), true)
    }

    pub(crate) fn load_refs(&self) -> Result<Refs, ImageError> {
        Refs::load(&self.refs_path())
    }

    /// Points `reference` at `digest` (replacing what it named).
    pub(crate) fn set_ref(&self, reference: &Reference, digest: &Digest) -> Result<(), ImageError> {
        let _l = self.refs_lock()?;
        let mut refs = self.load_refs()?;
        refs.refs.insert(reference.clone(), digest.clone());
        refs.store(&self.refs_path())?;
        tracing::info!(reference = %reference, digest = %digest, "tagged");
        Ok(())
    }

    /// Stores a file, or recognises one that is a blob of this store already.
    pub(crate) fn ingest_path(&self, p: &Path) -> Result<Digest, ImageError> {
        if let Some(d) = self.blobs.digest_of_path(p) {
            return Ok(d);
        }
        let t0 = std::time::Instant::now();
        let (d, len) = self.blobs.ingest_copy(p)?;
        tracing::debug!(file = %p.display(), blob = %d, len, ms = t0.elapsed().as_millis() as u64, "file stored");
        Ok(d)
    }

    /// The manifest `d` (hash-verified).
    pub fn manifest(&self, d: &Digest) -> Result<Manifest, ImageError> {
        let bytes = self.blobs.read_verified(d, MAX_MANIFEST_BYTES)?;
        Manifest::from_bytes(d, &bytes)
    }

    pub(crate) fn image_manifest(&self, d: &Digest) -> Result<ImageManifest, ImageError> {
        match self.manifest(d)? {
            Manifest::Image(m) => Ok(m),
            Manifest::Snapshot(_) => {
                Err(ImageError::WrongKind { reference: d.to_string(), expected: Kind::Image, found: Kind::Snapshot })
            }
        }
    }

    /// Stores an image manifest, or returns an existing named one (or base of a named
    /// snapshot) with the same files and command line, so re-imports do not multiply manifests.
    pub(crate) fn put_image_manifest(&self, m: ImageManifest) -> Result<(Digest, ImageManifest), ImageError> {
        let refs = self.load_refs()?;
        let mut seen = HashSet::new();
        for d in refs.refs.values() {
            let candidates = match self.manifest(d) {
                Ok(Manifest::Image(im)) => vec![(d.clone(), im)],
                Ok(Manifest::Snapshot(sm)) => match self.image_manifest(&sm.base_image) {
                    Ok(im) => vec![(sm.base_image.clone(), im)],
                    Err(_) => vec![],
                },
                Err(_) => vec![],
            };
            for (cd, im) in candidates {
                if seen.insert(cd.clone()) && im.same_content(&m) {
                    return Ok((cd, im));
                }
            }
        }
        let d = self.blobs.put_bytes(&Manifest::Image(m.clone()).to_bytes())?;
        Ok((d, m))
    }

    /// Imports an image under `name` (`repo[:tag]`, replacing what that name named); returns
    /// its manifest digest. Re-importing identical files reuses the existing manifest.
    pub fn import_image(&self, name: &str, src: &ImageSource) -> Result<Digest, ImageError> {
        let reference = Reference::parse(name)?;
        let span = tracing::info_span!("image_import", reference = %reference);
        let _e = span.enter();
        let _gc = self.gc_shared()?;
        let t0 = std::time::Instant::now();
        let m = ImageManifest {
            kernel: self.ingest_path(&src.kernel)?,
            initrd: self.ingest_path(&src.initrd)?,
            rootfs: src.rootfs.as_deref().map(|p| self.ingest_path(p)).transpose()?,
            overlay_base: src.overlay_base.as_deref().map(|p| self.ingest_path(p)).transpose()?,
            cmdline: src.cmdline.clone(),
            created: now_secs(),
        };
        let (d, _) = self.put_image_manifest(m)?;
        self.set_ref(&reference, &d)?;
        tracing::info!(digest = %d, ms = t0.elapsed().as_millis() as u64, "image imported");
        Ok(d)
    }

    /// Imports a built catalog template (`cargo xtask vm-image`) under `name`.
    pub fn import_catalog_template(&self, name: &str, t: &vmm::catalog::Template) -> Result<Digest, ImageError> {
        self.import_image(name, &ImageSource::from(t))
    }

    /// The manifest digest `s` names: a `sha256:…` digest of a stored manifest, or a `repo[:tag]`.
    pub fn lookup(&self, s: &str) -> Result<Digest, ImageError> {
        if Digest::looks_like(s) {
            let d = Digest::parse(s)?;
            return if self.blobs.has(&d) { Ok(d) } else { Err(ImageError::not_found(s)) };
        }
        let r = Reference::parse(s)?;
        self.load_refs()?.refs.get(&r).cloned().ok_or_else(|| ImageError::not_found(&r))
    }

    fn blob_for(&self, d: &Digest, by: &Digest) -> Result<PathBuf, ImageError> {
        let p = self.blobs.path(d);
        if p.is_file() {
            Ok(p)
        } else {
            Err(ImageError::MissingBlob { digest: d.clone(), by: by.to_string() })
        }
    }

    pub(crate) fn image_paths(&self, d: &Digest, m: &ImageManifest) -> Result<ResolvedImage, ImageError> {
        Ok(ResolvedImage {
            digest: d.clone(),
            kernel: self.blob_for(&m.kernel, d)?,
            initrd: self.blob_for(&m.initrd, d)?,
            rootfs: m.rootfs.as_ref().map(|b| self.blob_for(b, d)).transpose()?,
            overlay_base: m.overlay_base.as_ref().map(|b| self.blob_for(b, d)).transpose()?,
            cmdline: m.cmdline.clone(),
        })
    }

    /// Resolves a reference or digest: an image to its blob paths, a snapshot to a
    /// materialised directory (created on first use).
    pub fn resolve(&self, s: &str) -> Result<Resolved, ImageError> {
        let d = self.lookup(s)?;
        match self.manifest(&d)? {
            Manifest::Image(m) => Ok(Resolved::Image(self.image_paths(&d, &m)?)),
            Manifest::Snapshot(m) => Ok(Resolved::Snapshot(self.materialise(&d, &m)?)),
        }
    }

    /// [`Store::resolve`], refusing a snapshot.
    pub fn resolve_image(&self, s: &str) -> Result<ResolvedImage, ImageError> {
        match self.resolve(s)? {
            Resolved::Image(i) => Ok(i),
            Resolved::Snapshot(_) => {
                Err(ImageError::WrongKind { reference: s.to_string(), expected: Kind::Image, found: Kind::Snapshot })
            }
        }
    }

    /// [`Store::resolve`], refusing an image.
    pub fn resolve_snapshot(&self, s: &str) -> Result<ResolvedSnapshot, ImageError> {
        match self.resolve(s)? {
            Resolved::Snapshot(r) => Ok(r),
            Resolved::Image(_) => {
                Err(ImageError::WrongKind { reference: s.to_string(), expected: Kind::Snapshot, found: Kind::Image })
            }
        }
    }

    /// Names the manifest `src` names (a reference or digest) also as `dst`.
    pub fn tag(&self, src: &str, dst: &str) -> Result<Digest, ImageError> {
        let dst = Reference::parse(dst)?;
        let d = self.lookup(src)?;
        self.manifest(&d)?;
        self.set_ref(&dst, &d)?;
        Ok(d)
    }

    /// Removes the name `s` (the blobs stay until [`Store::gc`]); returns what it named.
    pub fn remove(&self, s: &str) -> Result<Digest, ImageError> {
        let r = Reference::parse(s)?;
        let _l = self.refs_lock()?;
        let mut refs = self.load_refs()?;
        let d = refs.refs.remove(&r).ok_or_else(|| ImageError::not_found(&r))?;
        refs.store(&self.refs_path())?;
        tracing::info!(reference = %r, digest = %d, "untagged");
        Ok(d)
    }

    /// Removes the name `s` only while it still names `expected` (checked and removed under
    /// `.lock`, so a concurrent save or tag of the name is never undone): `Ok(true)` removed,
    /// `Ok(false)` the name names other content now, or nothing, and stays as it is.
    pub fn remove_if(&self, s: &str, expected: &Digest) -> Result<bool, ImageError> {
        let r = Reference::parse(s)?;
        let _l = self.refs_lock()?;
        let mut refs = self.load_refs()?;
        if refs.refs.get(&r) != Some(expected) {
            return Ok(false);
        }
        refs.refs.remove(&r);
        refs.store(&self.refs_path())?;
        tracing::info!(reference = %r, digest = %expected, "untagged");
        Ok(true)
    }

    /// Every named entry, sorted by name.
    pub fn list(&self) -> Result<Vec<Entry>, ImageError> {
        let refs = self.load_refs()?;
        let mut out = Vec::with_capacity(refs.refs.len());
        for (r, d) in refs.refs {
            let m = self.manifest(&d)?;
            let own: BTreeSet<&Digest> = match &m {
                Manifest::Image(im) => im.blobs().collect(),
                Manifest::Snapshot(sm) => sm.files.values().collect(),
            };
            let (mut size, mut disk) = (0, 0);
            for b in own {
                let s = self.blobs.size(b).unwrap_or_default();
                size += s.len;
                disk += s.disk;
            }
            let base_image = match &m {
                Manifest::Snapshot(sm) => Some(sm.base_image.clone()),
                Manifest::Image(_) => None,
            };
            let namespace = m.namespace().map(str::to_owned);
            out.push(Entry {
                reference: r,
                digest: d,
                kind: m.kind(),
                size,
                disk,
                created: m.created(),
                base_image,
                namespace,
            });
        }
        Ok(out)
    }

    /// Every blob `d` needs (itself, what it names, a snapshot's base image and its blobs).
    pub(crate) fn closure(&self, d: &Digest) -> Result<Vec<Digest>, ImageError> {
        let mut out = vec![d.clone()];
        match self.manifest(d)? {
            Manifest::Image(m) => out.extend(m.blobs().cloned()),
            Manifest::Snapshot(m) => {
                out.extend(m.files.values().cloned());
                out.extend(self.closure(&m.base_image)?);
            }
        }
        Ok(out)
    }

    /// Re-hashes every blob the reference or digest `s` needs. [`ImageError::Corrupt`] names
    /// the first blob whose content does not match its name, [`ImageError::MissingBlob`] a missing one.
    pub fn verify(&self, s: &str) -> Result<(), ImageError> {
        let d = self.lookup(s)?;
        for b in self.closure(&d)? {
            match self.blobs.verify(&b) {
                Err(ImageError::NotFound { .. }) => {
                    return Err(ImageError::MissingBlob { digest: b, by: s.to_string() })
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// Re-hashes every blob of the store; returns the corrupt ones.
    pub fn verify_all(&self) -> Result<Vec<Digest>, ImageError> {
        let mut bad = Vec::new();
        for d in self.blobs.all()? {
            match self.blobs.verify(&d) {
                Ok(()) => {}
                Err(ImageError::Corrupt { .. }) => bad.push(d),
                Err(ImageError::NotFound { .. }) => {} // removed meanwhile
                Err(e) => return Err(e),
            }
        }
        Ok(bad)
    }

    /// The store digests a VM started from it uses: its spec's blobs (a VM booted from a
    /// [`ResolvedImage`]) and the snapshot it was restored from (a [`ResolvedSnapshot`]).
    /// Pass them (for every live VM) to [`Store::gc`].
    pub fn in_use_by(&self, vm: &vmm::Vm) -> Vec<Digest> {
        let s = &vm.spec;
        let mut out: Vec<Digest> = [Some(&s.kernel), Some(&s.initrd), s.rootfs.as_ref(), s.overlay_base.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|p| self.blobs.digest_of_path(p))
            .collect();
        if let Some(dir) = &vm.restored_from {
            if dir.parent() == Some(self.materialised_root().as_path()) {
                if let Some(d) = dir.file_name().and_then(|n| n.to_str()).and_then(Digest::from_hex) {
                    out.push(d);
                }
            }
        }
        out
    }
}

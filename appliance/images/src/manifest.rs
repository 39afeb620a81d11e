//! Manifests: small JSON blobs naming the blobs an image or snapshot is made of.
//!
//! - **image** `{"kind":"image","kernel":D,"initrd":D,"rootfs":D|null,"overlay_base":D|null,"cmdline":"…","created":secs}`;
//! - **snapshot** `{"kind":"snapshot","base_image":D,"files":{"state":D,"overlay.qcow2":D},"overlay":"overlay.qcow2"|null,
//!   "vmm":{…vmm::Snapshot as written by the driver…},"created":secs}`.
//!
//! `files` holds every file of the driver's snapshot directory except `snapshot.json` (that
//! record is `vmm`, kept as the driver wrote it; [`crate::Store::resolve`] rewrites its paths
//! when it materialises the directory). A snapshot's overlay (a qcow2 on its image's
//! `overlay_base`) is stored rebased onto the relative path of that blob as seen from the
//! materialised directory, so it needs no absolute path of the machine it was saved on.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ImageError;
use crate::reference::Digest;

/// Largest manifest we read.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// What a reference names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A bootable image.
    Image,
    /// A saved VM state.
    Snapshot,
}

impl Kind {
    /// With its indefinite article: `an image`, `a snapshot`.
    pub fn with_article(self) -> &'static str {
        match self {
            Kind::Image => "an image",
            Kind::Snapshot => "a snapshot",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Image => "image",
            Kind::Snapshot => "snapshot",
        })
    }
}

/// A bootable image: a [`vmm::BootSpec`]'s files, by digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageManifest {
    /// Uncompressed PVH `vmlinux`.
    pub kernel: Digest,
    /// Initramfs.
    pub initrd: Digest,
    /// Read-only erofs root disk.
    #[serde(default)]
    pub rootfs: Option<Digest>,
    /// Empty ext4 image per-VM overlays are created on.
    #[serde(default)]
    pub overlay_base: Option<Digest>,
    /// Extra kernel arguments.
    #[serde(default)]
    pub cmdline: String,
    /// Import time, seconds since the Unix epoch.
    pub created: u64,
}

impl ImageManifest {
    /// Every blob it names.
    pub fn blobs(&self) -> impl Iterator<Item = &Digest> {
        [Some(&self.kernel), Some(&self.initrd), self.rootfs.as_ref(), self.overlay_base.as_ref()].into_iter().flatten()
    }

    /// Same files and command line (ignoring `created`).
    pub fn same_content(&self, o: &ImageManifest) -> bool {
        (&self.kernel, &self.initrd, &self.rootfs, &self.overlay_base, &self.cmdline)
            == (&o.kernel, &o.initrd, &o.rootfs, &o.overlay_base, &o.cmdline)
    }
}

/// A saved VM state on top of an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    /// The image manifest the source VM was booted from.
    pub base_image: Digest,
    /// The snapshot directory's files (relative path → blob), without `snapshot.json`.
    pub files: BTreeMap<String, Digest>,
    /// Which of `files` is the qcow2 overlay on the base image's `overlay_base`, if any.
    #[serde(default)]
    pub overlay: Option<String>,
    /// The driver's `snapshot.json` record, as written on the source machine.
    pub vmm: vmm::Snapshot,
    /// Save time, seconds since the Unix epoch.
    pub created: u64,
    /// The Kubernetes namespace that owns it (vk-cocoon: the namespace of the Pod whose VM it
    /// was saved from; only Pods of that namespace, or of one sharing with it, may clone,
    /// overwrite or delete it). `None`: saved without one (`chrysalis snapshot save` without
    /// `--namespace`, or before namespaces were recorded); vk-cocoon treats it as
    /// `VK_LEGACY_NAMESPACE`'s. Omitted from the JSON when `None`, so older manifests keep
    /// their digests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// An image or snapshot manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)] // one per call, never held in bulk
pub enum Manifest {
    /// A bootable image.
    Image(ImageManifest),
    /// A saved VM state.
    Snapshot(SnapshotManifest),
}

impl Manifest {
    /// Which kind it is.
    pub fn kind(&self) -> Kind {
        match self {
            Manifest::Image(_) => Kind::Image,
            Manifest::Snapshot(_) => Kind::Snapshot,
        }
    }

    /// The owning namespace of a snapshot (`None` for an image, or a snapshot saved without one).
    pub fn namespace(&self) -> Option<&str> {
        match self {
            Manifest::Image(_) => None,
            Manifest::Snapshot(m) => m.namespace.as_deref(),
        }
    }

    /// Creation time, seconds since the Unix epoch.
    pub fn created(&self) -> u64 {
        match self {
            Manifest::Image(m) => m.created,
            Manifest::Snapshot(m) => m.created,
        }
    }

    /// The blobs it names directly (for a snapshot: its files and its base image manifest).
    pub fn references(&self) -> Vec<&Digest> {
        match self {
            Manifest::Image(m) => m.blobs().collect(),
            Manifest::Snapshot(m) => m.files.values().chain(std::iter::once(&m.base_image)).collect(),
        }
    }

    /// Serialises it (deterministically: maps are ordered).
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serialising plain structs of strings, numbers and ordered maps cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Parses a manifest blob.
    pub fn from_bytes(digest: &Digest, bytes: &[u8]) -> Result<Self, ImageError> {
        serde_json::from_slice(bytes).map_err(|source| ImageError::Manifest { digest: digest.clone(), source })
    }
}

/// Whether `rel` is a safe relative path inside a snapshot directory (no `..`, not absolute, UTF-8 normal components).
pub fn safe_relative(rel: &str) -> bool {
    let p = std::path::Path::new(rel);
    !rel.is_empty()
        && p.components().all(|c| matches!(c, std::path::Component::Normal(_)))
        && p.components().count() == rel.split('/').count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(b: &[u8]) -> Digest {
        Digest::of_bytes(b)
    }

    #[test]
    fn image_manifest_round_trips_with_kind_tag() {
        let m = Manifest::Image(ImageManifest {
            kernel: d(b"k"),
            initrd: d(b"i"),
            rootfs: None,
            overlay_base: Some(d(b"o")),
            cmdline: "quiet".into(),
            created: 7,
        });
        let bytes = m.to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(v["kind"], "image");
        assert_eq!(v["kernel"], d(b"k").to_string());
        let digest = Digest::of_bytes(&bytes);
        assert_eq!(Manifest::from_bytes(&digest, &bytes).expect("parse"), m);
        assert_eq!(m.references().len(), 3);
        assert!(matches!(Manifest::from_bytes(&digest, b"{\"kind\":\"zip\"}"), Err(ImageError::Manifest { .. })));
    }

    #[test]
    fn relative_paths() {
        assert!(safe_relative("state"));
        assert!(safe_relative("a/b"));
        for bad in ["", "/abs", "../x", "a/../b", "./a", "a//b", "a/"] {
            assert!(!safe_relative(bad), "{bad:?}");
        }
    }
}

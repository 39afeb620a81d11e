//! The volume catalog: raw ext4 images under `<data_dir>/volumes/<name>.img`.
//!
//! Volumes the config declares are made at start when missing (`mkfs.ext4` on a sparse file);
//! any other `*.img` an operator puts in the directory is in the catalog too. A sandbox holds
//! a volume by hot-plugging its image (`node/volumes.rs`); the images outlive every sandbox.

use std::path::{Path, PathBuf};

use sandboxd_api::config::VolumeConfig;

/// The image suffix.
const SUFFIX: &str = ".img";
/// The smallest volume the node makes, MiB (ext4's journal needs room).
pub const MIN_SIZE_MIB: u64 = 8;

/// Errors of the catalog.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// A name that cannot be a volume.
    #[error("volume name {0:?}: want 1-64 of [A-Za-z0-9._-], not starting with '.'")]
    BadName(String),
    /// Not in the catalog.
    #[error("no volume {0:?} in this node's catalog (GET /v1/volumes lists it; config key volumes makes one)")]
    Unknown(String),
    /// A declared volume is too small.
    #[error("volume {name:?}: size_mib {size_mib} is below {MIN_SIZE_MIB}")]
    TooSmall {
        /// The volume.
        name: String,
        /// Its declared size.
        size_mib: u64,
    },
    /// Making or listing images failed.
    #[error("{what} {path}")]
    Io {
        /// The step.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `mkfs.ext4` failed.
    #[error("mkfs.ext4 {path} failed: {stderr}")]
    Mkfs {
        /// The image.
        path: PathBuf,
        /// What it said.
        stderr: String,
    },
}

/// Whether `name` can name a volume (the same rule as the guest agent's).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// The catalog directory.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
}

impl Catalog {
    /// The catalog under `data_dir`, creating its directory.
    pub fn open(data_dir: &Path) -> Result<Catalog, CatalogError> {
        let dir = data_dir.join("volumes");
        foundation::private_dir(&dir).map_err(|source| CatalogError::Io {
            what: "creating",
            path: dir.clone(),
            source,
        })?;
        Ok(Catalog { dir })
    }

    /// Makes each declared volume that is missing (an existing image is never touched).
    pub fn ensure(&self, declared: &[VolumeConfig]) -> Result<(), CatalogError> {
        for v in declared {
            if !valid_name(&v.name) {
                return Err(CatalogError::BadName(v.name.clone()));
            }
            if v.size_mib < MIN_SIZE_MIB {
                return Err(CatalogError::TooSmall { name: v.name.clone(), size_mib: v.size_mib });
            }
            let path = self.image(&v.name);
            if path.exists() {
                continue;
            }
            self.make(&v.name, v.size_mib)?;
            tracing::info!(volume = %v.name, size_mib = v.size_mib, "volume made");
        }
        Ok(())
    }

    /// A new ext4 image, made under a temporary name and renamed into place.
    fn make(&self, name: &str, size_mib: u64) -> Result<(), CatalogError> {
        let path = self.image(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let io = |what, source| CatalogError::Io { what, path: tmp.clone(), source };
        let f = std::fs::File::create(&tmp).map_err(|e| io("creating", e))?;
        f.set_len(size_mib << 20).map_err(|e| io("sizing", e))?;
        drop(f);
        let out = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L"])
            .arg(name.chars().take(16).collect::<String>())
            .args(["-E", "root_owner=0:0"])
            .arg(&tmp)
            .output()
            .map_err(|e| io("running mkfs.ext4 for", e))?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&tmp);
            let stderr = String::from_utf8_lossy(&out.stderr).trim().chars().take(512).collect();
            return Err(CatalogError::Mkfs { path, stderr });
        }
        std::fs::rename(&tmp, &path).map_err(|e| io("renaming", e))
    }

    fn image(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}{SUFFIX}"))
    }

    /// The image of volume `name`.
    pub fn path(&self, name: &str) -> Result<PathBuf, CatalogError> {
        if !valid_name(name) {
            return Err(CatalogError::BadName(name.to_string()));
        }
        let p = self.image(name);
        if p.is_file() {
            Ok(p)
        } else {
            Err(CatalogError::Unknown(name.to_string()))
        }
    }

    /// Every volume and its image size, sorted by name.
    pub fn list(&self) -> Result<Vec<(String, u64)>, CatalogError> {
        let io = |source| CatalogError::Io { what: "listing", path: self.dir.clone(), source };
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(io)? {
            let e = e.map_err(io)?;
            let file = e.file_name();
            let Some(name) = file.to_str().and_then(|n| n.strip_suffix(SUFFIX)) else { continue };
            if !valid_name(name) {
                continue;
            }
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_file() {
                out.push((name.to_string(), meta.len()));
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("data-1.v2_x"));
        for bad in ["", ".x", "a/b", "a b", "é"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(!valid_name(&"x".repeat(65)));
    }

    #[test]
    fn declared_volumes_are_made_once_and_listed() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = Catalog::open(d.path()).expect("open");
        if std::process::Command::new("mkfs.ext4").arg("-V").output().is_err() {
            eprintln!("SKIPPED: mkfs.ext4 is not installed (e2fsprogs)");
            return;
        }
        c.ensure(&[VolumeConfig { name: "data".into(), size_mib: 16 }]).expect("made");
        let img = c.path("data").expect("in the catalog");
        std::fs::write(d.path().join("volumes/ops.img"), b"operator's").expect("operator image");
        std::fs::write(d.path().join("volumes/notes.txt"), b"not a volume").expect("other file");
        assert_eq!(c.list().expect("list"), vec![("data".to_string(), 16 << 20), ("ops".to_string(), 10)]);
        // An existing image is never remade.
        let before = std::fs::metadata(&img).expect("meta").modified().expect("mtime");
        c.ensure(&[VolumeConfig { name: "data".into(), size_mib: 64 }]).expect("kept");
        assert_eq!(std::fs::metadata(&img).expect("meta").modified().expect("mtime"), before);
        assert!(matches!(c.path("nope"), Err(CatalogError::Unknown(_))));
        assert!(matches!(c.path("../x"), Err(CatalogError::BadName(_))));
        assert!(matches!(
            c.ensure(&[VolumeConfig { name: "tiny".into(), size_mib: 1 }]),
            Err(CatalogError::TooSmall { .. })
        ));
    }
}

//! Promoted templates: a claimed sandbox's memory and disk kept as a template
//! (`POST …/{id}/promote`), under `<data_dir>/templates/<name>/` with `promoted.json`.
//!
//! A pool of a promoted template clones from its snapshot (it is the pool's golden; it cannot
//! cold-boot, having no catalog image). A template is written into a staging directory and
//! renamed into place whole, so a crash leaves a staging directory (removed at start), never a
//! half template. Its content digest is the SHA-256 of its snapshot files, in name order.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use sandboxd_api::Key;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use vmm::Snapshot;

/// The record of a promoted template in its directory.
pub const RECORD: &str = "promoted.json";

/// One promoted template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promoted {
    /// Its name (a pool template).
    pub name: String,
    /// The pool key of the sandbox it was promoted from (`net`, `size` of its pools).
    pub key: Key,
    /// `sha256:` of its snapshot files.
    pub content_digest: String,
    /// The sandbox it came from.
    pub sandbox_id: String,
}

/// The promoted templates of a node.
#[derive(Debug)]
pub struct PromotedStore {
    dir: PathBuf,
}

impl PromotedStore {
    /// `<data_dir>/templates`, created private; staging directories left by a crash removed.
    pub fn open(data_dir: &Path) -> std::io::Result<Self> {
        let dir = data_dir.join("templates");
        foundation::private_dir(&dir)?;
        for e in std::fs::read_dir(&dir)?.flatten() {
            if e.file_name().to_string_lossy().starts_with(".staging-") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(Self { dir })
    }

    /// A fresh staging directory path (not created).
    pub fn staging(&self) -> PathBuf {
        let mut b = [0u8; 8];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
        self.dir.join(format!(".staging-{}", hex::encode(b)))
    }

    /// Where template `name` lives.
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name.replace('/', "%2F"))
    }

    /// The record of promoted template `name` (no snapshot read).
    pub fn record(&self, name: &str) -> Option<Promoted> {
        let rec: Promoted = serde_json::from_slice(&std::fs::read(self.path(name).join(RECORD)).ok()?).ok()?;
        (rec.name == name).then_some(rec)
    }

    /// A promoted template and its snapshot, by name.
    pub fn get(&self, name: &str) -> Option<(Promoted, Snapshot)> {
        let dir = self.path(name);
        let rec = self.record(name)?;
        // The snapshot was written in the staging dir: its paths are read from here.
        let mut snap = Snapshot::load(&dir).ok()?;
        let staged = snap.dir.clone();
        snap.dir = dir.clone();
        snap.overlay = snap.overlay.map(|o| o.strip_prefix(&staged).map_or(o.clone(), |rel| dir.join(rel)));
        Some((rec, snap))
    }

    /// Installs the snapshot in `staging` as template `rec.name` (replacing an older one);
    /// returns the record with its digest.
    pub fn install(&self, staging: &Path, mut rec: Promoted) -> std::io::Result<Promoted> {
        rec.content_digest = digest(staging)?;
        let body = serde_json::to_vec_pretty(&rec).map_err(std::io::Error::other)?;
        foundation::write_atomic(&staging.join(RECORD), &body, foundation::SECRET_FILE)?;
        let dest = self.path(&rec.name);
        if dest.exists() {
            // Moved aside first: a crash between the renames leaves a staging dir, not a gap
            // filled with half of each.
            let old = self.staging();
            std::fs::rename(&dest, &old)?;
            std::fs::rename(staging, &dest)?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(staging, &dest)?;
        }
        Ok(rec)
    }

    /// The directory of every promoted template.
    pub fn dirs(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join(RECORD).is_file())
            .collect()
    }

    /// Removes template `name`; `false` when there is none.
    pub fn remove(&self, name: &str) -> std::io::Result<bool> {
        let dir = self.path(name);
        if !dir.join(RECORD).is_file() {
            return Ok(false);
        }
        let aside = self.staging();
        std::fs::rename(&dir, &aside)?;
        std::fs::remove_dir_all(&aside)?;
        Ok(true)
    }
}

/// `sha256:` of the regular files in `dir` other than the record, in name order (name, then
/// content).
fn digest(dir: &Path) -> std::io::Result<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != RECORD && n != Snapshot::FILE)
        .collect();
    names.sort();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for n in names {
        h.update(n.as_bytes());
        h.update([0]);
        let mut f = std::fs::File::open(dir.join(&n))?;
        loop {
            let k = f.read(&mut buf)?;
            if k == 0 {
                break;
            }
            h.update(&buf[..k]);
        }
    }
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_get_replace_and_remove() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = PromotedStore::open(tmp.path()).expect("open");
        let stage = |content: &[u8]| {
            let d = store.staging();
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("state"), content).expect("state");
            std::fs::write(d.join("overlay.qcow2"), b"disk").expect("overlay");
            let snap = Snapshot {
                dir: d.clone(),
                backend: vmm::Backend::Qemu,
                accel: vmm::Accel::Tcg,
                source: vmm::VmId::new("sbx-aa-00000001").expect("id"),
                spec: crate::test_utils::fake_spec("x"),
                overlay: Some(d.join("overlay.qcow2")),
                created_at_epoch_secs: 0,
            };
            std::fs::write(d.join(Snapshot::FILE), serde_json::to_vec(&snap).expect("json")).expect("snap");
            d
        };
        let rec = |name: &str| Promoted {
            name: name.into(),
            key: Key { template: "rt".into(), net: "none".into(), size: "small".into() },
            content_digest: String::new(),
            sandbox_id: "sb_1".into(),
        };
        let a = store.install(&stage(b"one"), rec("my-agent")).expect("install");
        assert!(a.content_digest.starts_with("sha256:") && a.content_digest.len() == 71, "{a:?}");
        let (got, snap) = store.get("my-agent").expect("get");
        assert_eq!(got, a);
        assert_eq!(snap.overlay.as_deref(), Some(tmp.path().join("templates/my-agent/overlay.qcow2").as_path()));
        // Same content, same digest; new content replaces it.
        let b = store.install(&stage(b"one"), rec("other")).expect("install");
        assert_eq!(b.content_digest, a.content_digest);
        let c = store.install(&stage(b"two"), rec("my-agent")).expect("replace");
        assert_ne!(c.content_digest, a.content_digest);
        assert_eq!(store.get("my-agent").expect("get").0.content_digest, c.content_digest);
        assert!(store.remove("my-agent").expect("remove"));
        assert!(!store.remove("my-agent").expect("again"));
        assert!(store.get("my-agent").is_none());
        // A staging dir a crash left is removed at the next open.
        let left = stage(b"x");
        PromotedStore::open(tmp.path()).expect("reopen");
        assert!(!left.exists());
    }
}

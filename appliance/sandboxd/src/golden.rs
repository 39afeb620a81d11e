//! Golden snapshots on disk: `<data_dir>/goldens/<pool hash>`, one per pool, the snapshot
//! every clone of that pool is restored from.
//!
//! A golden is written into `goldens/<hash>.staging-<16 hex>` first and renamed into place
//! only when whole ([`Goldens::install`]); a crash leaves a staging dir, never a half golden at
//! `goldens/<hash>`, and start-up deletes staging dirs ([`Goldens::clean_staging`]). A golden
//! is loaded only when it was made by the running backend ([`Goldens::load`]). Building one
//! (boot, probe, snapshot) is the refill task's job (`crate::refill`).
//!
//! Imports nothing else of sandboxd.

use std::path::{Path, PathBuf};

use vmm::{Backend, Snapshot};

/// Creating, moving or removing a golden's directory failed.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}")]
pub struct GoldenError {
    /// What we were doing.
    what: &'static str,
    /// The directory.
    path: PathBuf,
    /// The cause.
    #[source]
    source: std::io::Error,
}

/// The goldens directory of a data dir.
#[derive(Debug, Clone)]
pub struct Goldens {
    dir: PathBuf,
}

impl Goldens {
    /// The goldens under `data_dir` (`<data_dir>/goldens`).
    pub fn new(data_dir: &Path) -> Self {
        Goldens { dir: data_dir.join("goldens") }
    }

    /// The goldens directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the golden of pool `hash` lives.
    pub fn path(&self, hash: &str) -> PathBuf {
        self.dir.join(hash)
    }

    /// Deletes staging dirs left by a build that never finished (start-up, before any build).
    pub fn clean_staging(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().contains(".staging-") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// The golden of pool `hash`, if one exists that `backend` made; an unreadable golden or
    /// one of another backend is logged and ignored (refill builds a new one).
    pub fn load(&self, hash: &str, backend: Backend) -> Option<Snapshot> {
        let dir = self.path(hash);
        if !dir.join(Snapshot::FILE).exists() {
            return None;
        }
        match Snapshot::load(&dir) {
            Ok(s) if s.backend == backend => Some(rebase(s, &dir)),
            Ok(s) => {
                tracing::warn!(golden = %dir.display(), backend = %s.backend, "ignoring a golden of another backend");
                None
            }
            Err(e) => {
                tracing::warn!(golden = %dir.display(), error = %vmm::error_chain(&e), "ignoring an unreadable golden");
                None
            }
        }
    }

    /// Deletes the golden of pool `hash` (best effort).
    pub fn remove(&self, hash: &str) {
        let _ = std::fs::remove_dir_all(self.path(hash));
    }

    /// A fresh staging dir name for a golden of pool `hash` (the goldens dir is created; the
    /// staging dir itself is the snapshot's to create).
    pub fn staging(&self, hash: &str) -> Result<PathBuf, GoldenError> {
        std::fs::create_dir_all(&self.dir).map_err(io("creating", &self.dir))?;
        Ok(self.dir.join(format!("{hash}.staging-{:016x}", rand::random::<u64>())))
    }

    /// Moves snapshot `snap`, written to `staging`, into place as the golden of pool `hash`
    /// (replacing an older one) and points it at its new home. On failure the staging dir is
    /// deleted.
    pub fn install(&self, snap: Snapshot, staging: &Path, hash: &str) -> Result<Snapshot, GoldenError> {
        let fin = self.path(hash);
        if fin.exists() {
            std::fs::remove_dir_all(&fin).map_err(io("removing the old golden", &fin))?;
        }
        if let Err(e) = std::fs::rename(staging, &fin) {
            let _ = std::fs::remove_dir_all(staging);
            return Err(io("moving the golden into place", &fin)(e));
        }
        Ok(rebase(snap, &fin))
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> GoldenError {
    let path = path.to_path_buf();
    move |source| GoldenError { what, path, source }
}

/// Points a snapshot that was written elsewhere (the staging dir) at the dir it now lives in.
pub fn rebase(mut s: Snapshot, dir: &Path) -> Snapshot {
    if s.dir != dir {
        if let Some(rel) = s.overlay.as_ref().and_then(|o| o.strip_prefix(&s.dir).ok()) {
            s.overlay = Some(dir.join(rel));
        }
        s.dir = dir.to_path_buf();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_dirs_are_cleaned_and_goldens_kept() {
        let data = tempfile::tempdir().expect("tempdir");
        let g = Goldens::new(data.path());
        assert_eq!(g.dir(), data.path().join("goldens"));
        let staging = g.staging("abc").expect("staging");
        assert!(staging.starts_with(g.dir()) && staging.to_string_lossy().contains("abc.staging-"));
        std::fs::create_dir_all(&staging).expect("mkdir");
        std::fs::create_dir_all(g.path("abc")).expect("mkdir");
        g.clean_staging();
        assert!(!staging.exists() && g.path("abc").exists());
        assert!(g.load("abc", Backend::Qemu).is_none(), "no snapshot.json: no golden");
    }
}

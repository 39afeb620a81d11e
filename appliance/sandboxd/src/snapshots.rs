//! Snapshots of claimed VMs, under `<data_dir>/snapshots/`: the snapshot a fork restores its
//! children from (`fork-<16 hex>`), checkpoints (`ck_<16 hex>`, with `checkpoint.json`) and
//! hibernated sandboxes (`hib-<16 hex>`, named by their claim's `hibernate_snap`).
//!
//! A snapshot directory holds the driver's snapshot (memory state, a copy of the disk overlay,
//! `snapshot.json`). A VM restored from it keeps using that overlay copy as its backing file,
//! so a directory stays while any of these holds:
//! - it is a checkpoint (its `checkpoint.json` is there: not deleted, not past retention);
//! - a claimed VM was restored from it (`Vm::restored_from`);
//! - a claim is hibernated into it (`hibernate_snap`) or hibernating into it (`pending_snap`);
//! - a kept snapshot depends on it (its source VM was restored from it: `parent.json`).
//!
//! [`SnapshotStore::gc`] removes every other directory, stray staging ones included. It is
//! only called with the full set of claimed VMs (never on ambiguity), and under
//! [`SnapshotStore::lock`], which a fork or a checkpoint holds while it writes a snapshot.
//! `checkpoint.json` is written atomically (mode 0600) after the snapshot is complete, so a
//! crash mid-checkpoint leaves a directory without it, which the next gc removes.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rand::RngCore as _;
use sandboxd_api::Checkpoint;
use serde::{Deserialize, Serialize};
use vmm::Snapshot;

/// A checkpoint's record inside its directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// The snapshot directory a snapshot's source VM was restored from, when it is one of ours.
const PARENT_FILE: &str = "parent.json";
/// The directory name prefix of a fork's snapshot.
const FORK_PREFIX: &str = "fork-";
/// The directory name prefix of a hibernated sandbox's snapshot.
const HIBERNATE_PREFIX: &str = "hib-";
/// The id prefix of a checkpoint (also its directory name).
const CHECKPOINT_PREFIX: &str = "ck_";

#[derive(Debug, Serialize, Deserialize)]
struct Parent {
    dir: PathBuf,
}

/// A checkpoint as stored: the wire record plus its creation time for retention.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    checkpoint: Checkpoint,
    created_at_unix_ms: u64,
}

/// The snapshot directories of a node.
#[derive(Debug)]
pub struct SnapshotStore {
    dir: PathBuf,
    lock: tokio::sync::Mutex<()>,
}

impl SnapshotStore {
    /// `<data_dir>/snapshots`, created private (0700).
    pub fn open(data_dir: &Path) -> io::Result<Self> {
        let dir = data_dir.join("snapshots");
        foundation::private_dir(&dir)?;
        Ok(Self { dir, lock: tokio::sync::Mutex::new(()) })
    }

    /// Serializes writers (fork, checkpoint) with [`SnapshotStore::gc`].
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.lock.lock().await
    }

    /// A fresh directory path for a fork's snapshot (not created).
    pub fn fork_dir(&self) -> PathBuf {
        self.dir.join(format!("{FORK_PREFIX}{}", hex16()))
    }

    /// A fresh directory path for a hibernated sandbox's snapshot (not created).
    pub fn hibernate_dir(&self) -> PathBuf {
        self.dir.join(format!("{HIBERNATE_PREFIX}{}", hex16()))
    }

    /// A fresh checkpoint id and its directory path (not created).
    pub fn new_checkpoint(&self) -> (String, PathBuf) {
        let id = format!("{CHECKPOINT_PREFIX}{}", hex16());
        let dir = self.dir.join(&id);
        (id, dir)
    }

    /// Records that the snapshot in `dir` depends on `restored_from` (the snapshot its source
    /// VM was restored from), when that is one of ours.
    pub fn record_parent(&self, dir: &Path, restored_from: Option<&Path>) -> io::Result<()> {
        match restored_from {
            Some(p) if p.starts_with(&self.dir) => {
                let body = serde_json::to_vec(&Parent { dir: p.to_path_buf() }).map_err(io::Error::other)?;
                foundation::write_atomic(&dir.join(PARENT_FILE), &body, foundation::SECRET_FILE)
            }
            _ => Ok(()),
        }
    }

    /// Makes the snapshot in `dir` a checkpoint (atomic: listed only once complete).
    pub fn publish_checkpoint(&self, dir: &Path, checkpoint: &Checkpoint, now: SystemTime) -> io::Result<()> {
        let stored = Stored { checkpoint: checkpoint.clone(), created_at_unix_ms: crate::claims::unix_ms(now) };
        let body = serde_json::to_vec(&stored).map_err(io::Error::other)?;
        foundation::write_atomic(&dir.join(CHECKPOINT_FILE), &body, foundation::SECRET_FILE)
    }

    /// Every checkpoint, newest first, with its size on disk.
    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        let mut all: Vec<(u64, Checkpoint)> = self
            .entries()
            .filter_map(|dir| {
                let s = read_stored(&dir)?;
                let mut ck = s.checkpoint;
                ck.size_bytes = Some(dir_bytes(&dir));
                Some((s.created_at_unix_ms, ck))
            })
            .collect();
        all.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
        all.into_iter().map(|(_, ck)| ck).collect()
    }

    /// A checkpoint and its snapshot, by id; `None` for an unknown or malformed id.
    pub fn checkpoint(&self, id: &str) -> Option<(Checkpoint, Snapshot)> {
        let dir = self.checkpoint_dir(id)?;
        let stored = read_stored(&dir)?;
        let snap = Snapshot::load(&dir).ok()?;
        Some((stored.checkpoint, snap))
    }

    /// Deletes a checkpoint: it is unlisted at once; its files go with the next gc that finds
    /// no VM restored from it. `false` when there is no such checkpoint.
    pub fn delete(&self, id: &str) -> io::Result<bool> {
        let Some(dir) = self.checkpoint_dir(id) else { return Ok(false) };
        match std::fs::remove_file(dir.join(CHECKPOINT_FILE)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes the checkpoints older than `retention`; returns how many.
    pub fn expire(&self, retention: Duration, now: SystemTime) -> usize {
        let cutoff =
            crate::claims::unix_ms(now).saturating_sub(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX));
        let old: Vec<String> = self
            .entries()
            .filter_map(|d| read_stored(&d))
            .filter(|s| s.created_at_unix_ms < cutoff)
            .map(|s| s.checkpoint.id)
            .collect();
        old.iter().filter(|id| self.delete(id).unwrap_or(false)).count()
    }

    /// Removes every snapshot directory that no checkpoint, no VM in `restored_from` and no
    /// kept snapshot needs; returns how many. Call with the snapshot of every claimed VM (a
    /// set known only in part must not be passed) and under [`SnapshotStore::lock`].
    pub fn gc<'a>(&self, restored_from: impl IntoIterator<Item = &'a Path>) -> usize {
        let mut keep: HashSet<PathBuf> = restored_from.into_iter().map(Path::to_path_buf).collect();
        keep.extend(self.entries().filter(|d| d.join(CHECKPOINT_FILE).is_file()));
        // Follow each kept snapshot's parent chain (bounded by the number of directories).
        let mut frontier: Vec<PathBuf> = keep.iter().cloned().collect();
        while let Some(d) = frontier.pop() {
            if let Some(p) = read_parent(&d) {
                if keep.insert(p.clone()) {
                    frontier.push(p);
                }
            }
        }
        let mut removed = 0;
        for dir in self.entries().filter(|d| !keep.contains(d)) {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "removing an unused snapshot failed"),
            }
        }
        if removed > 0 {
            tracing::info!(removed, "unused snapshots removed");
        }
        removed
    }

    /// Bytes held by the snapshot in `dir`.
    pub fn bytes_of(dir: &Path) -> u64 {
        dir_bytes(dir)
    }

    /// In one walk: how many checkpoints there are, and the bytes every snapshot directory
    /// holds.
    pub fn summary(&self) -> (usize, u64) {
        self.entries()
            .fold((0, 0), |(n, bytes), d| (n + usize::from(d.join(CHECKPOINT_FILE).is_file()), bytes + dir_bytes(&d)))
    }

    fn checkpoint_dir(&self, id: &str) -> Option<PathBuf> {
        let hex = id.strip_prefix(CHECKPOINT_PREFIX)?;
        (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| self.dir.join(id))
    }

    fn entries(&self) -> impl Iterator<Item = PathBuf> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
    }
}

fn hex16() -> String {
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

fn read_stored(dir: &Path) -> Option<Stored> {
    serde_json::from_slice(&std::fs::read(dir.join(CHECKPOINT_FILE)).ok()?).ok()
}

fn read_parent(dir: &Path) -> Option<PathBuf> {
    serde_json::from_slice::<Parent>(&std::fs::read(dir.join(PARENT_FILE)).ok()?).ok().map(|p| p.dir)
}

/// Bytes allocated to the files directly in `dir` (snapshots are flat).
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks().saturating_mul(512))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap_dir(dir: &Path) {
        std::fs::create_dir_all(dir).expect("mkdir");
        std::fs::write(dir.join("state.bin"), vec![7u8; 8192]).expect("state");
    }

    #[test]
    fn gc_keeps_checkpoints_vms_and_their_parents_and_removes_the_rest() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = SnapshotStore::open(tmp.path()).expect("open");
        let (ck_id, ck) = store.new_checkpoint();
        let (used, parent, stray, gone_ck) =
            (store.fork_dir(), store.fork_dir(), store.fork_dir(), store.new_checkpoint());
        for d in [&ck, &used, &parent, &stray, &gone_ck.1] {
            snap_dir(d);
        }
        let record = |id: &str| Checkpoint { id: id.into(), name: "n".into(), ..Checkpoint::default() };
        let now = SystemTime::now();
        store.publish_checkpoint(&ck, &record(&ck_id), now).expect("publish");
        store.publish_checkpoint(&gone_ck.1, &record(&gone_ck.0), now).expect("publish");
        // `used` was taken from a VM restored from `parent`.
        store.record_parent(&used, Some(&parent)).expect("parent");
        store.record_parent(&stray, Some(Path::new("/elsewhere/golden"))).expect("foreign parent");
        assert!(store.delete(&gone_ck.0).expect("delete"));
        assert!(!store.delete(&gone_ck.0).expect("delete twice"));
        assert!(!store.delete("ck_../../etc").expect("malformed"));

        assert_eq!(store.gc([used.as_path()]), 2, "the stray fork and the deleted checkpoint");
        for d in [&ck, &used, &parent] {
            assert!(d.is_dir(), "{} kept", d.display());
        }
        assert!(!stray.exists() && !gone_ck.1.exists());
        let listed = store.checkpoints();
        assert_eq!(listed.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), [ck_id.as_str()]);
        assert!(listed[0].size_bytes.unwrap_or(0) >= 8192, "{listed:?}");
        let (n, bytes) = store.summary();
        assert_eq!(n, 1);
        assert!(bytes >= 3 * 8192);

        // Retention: a checkpoint older than it is deleted, then collected once no VM uses it.
        assert_eq!(store.expire(Duration::from_secs(3600), now), 0);
        assert_eq!(store.expire(Duration::from_secs(1), now + Duration::from_secs(5)), 1);
        assert_eq!(store.gc([]), 3, "the expired checkpoint, and the fork snapshot and its parent nobody uses");
        assert!(store.checkpoints().is_empty());
    }
}

//! The claims state file (`docs/virtual-node.md` §2.8): the only durable copy of each
//! claim's release credential, so a restart never orphans authority over a live VM.
//!
//! Shape: `{"claims":{"ns/name":{id, token, address, podUID, claimedAt, deadline, owner?}}}`,
//! plus `releasing` (claims decided for release whose release has not yet succeeded). Written
//! 0600 in a directory made 0700, atomically (a temp file born 0600, renamed over the file);
//! writes are serialized. Loading: a missing file is an empty table; a malformed one is fatal
//! (reading it as empty would forget live credentials).
//!
//! # Durability off the claim path
//! [`StateStore::save`] returns once the rename is done, without waiting for the disk
//! ([`foundation::write_secret_unsynced`]); a flush task fsyncs the file and its directory
//! right after, one flush for any number of saves that land while one runs. A crash of the
//! process loses nothing (the page cache outlives it). Only a power cut (or a host kernel crash)
//! inside that window of a few milliseconds can bring back the previous table, and it also
//! ends every VM, so the claims a stale table would miss name VMs that are gone; any that
//! survive (sandboxd's journal) carry this node's `claim_ref` and are taken back by the
//! provider's lost-claim scan. A failed flush is logged, counted in
//! [`StateStore::flush_failures`] (`vk_sandbox_state_flush_failures_total`) and retried on the next save.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};

/// Why the state file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// An IO step failed.
    #[error("claims state {}: {what}", .path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The file exists but does not parse: refusing to start rather than forget credentials.
    #[error("claims state {} is malformed; refusing to read it as empty (fix or move it aside by hand)", .path.display())]
    Malformed {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Serializing the table failed.
    #[error("claims state {}: encoding", .path.display())]
    Encode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The blocking write task died.
    #[error("claims state {}: the write task failed", .path.display())]
    Task { path: PathBuf },
}

/// The controller owner a claim was made (or preserved) under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerRef {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    #[serde(default)]
    pub uid: String,
}

/// One claim row. `Debug` never prints the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    pub id: String,
    pub token: String,
    /// sandboxd's `owner_addr` for this claim.
    #[serde(default)]
    pub address: String,
    #[serde(rename = "podUID", default)]
    pub pod_uid: String,
    #[serde(rename = "claimedAt", default, skip_serializing_if = "Option::is_none")]
    pub claimed_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerRef>,
}

impl std::fmt::Debug for ClaimRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimRecord")
            .field("id", &self.id)
            .field("token", &"<redacted>")
            .field("address", &self.address)
            .field("pod_uid", &self.pod_uid)
            .field("claimed_at", &self.claimed_at)
            .field("deadline", &self.deadline)
            .field("owner", &self.owner)
            .finish()
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFile {
    /// Pod key (`ns/name`) → claim.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimRecord>,
    /// Claims withdrawn from their key and awaiting a successful release.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub releasing: Vec<ClaimRecord>,
}

/// Reads `path`: missing = empty; malformed = [`StateError::Malformed`].
pub fn load(path: &Path) -> Result<StateFile, StateError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StateFile::default()),
        Err(source) => return Err(StateError::Io { path: path.to_owned(), what: "reading", source }),
    };
    serde_json::from_slice(&bytes).map_err(|source| StateError::Malformed { path: path.to_owned(), source })
}

/// Writes `state` to `path` atomically and durably, 0600 in a directory made 0700 (blocking).
pub fn write(path: &Path, state: &StateFile) -> Result<(), StateError> {
    foundation::write_secret(path, &encode(path, state)?).map_err(|source| StateError::Io {
        path: path.to_owned(),
        what: "writing (temp file, fsync, rename)",
        source,
    })
}

fn encode(path: &Path, state: &StateFile) -> Result<Vec<u8>, StateError> {
    serde_json::to_vec_pretty(state).map_err(|source| StateError::Encode { path: path.to_owned(), source })
}

/// [`write`] without waiting for the disk (see the module docs).
fn write_unsynced(path: &Path, state: &StateFile) -> Result<(), StateError> {
    foundation::write_secret_unsynced(path, &encode(path, state)?).map_err(|source| StateError::Io {
        path: path.to_owned(),
        what: "writing (temp file, rename)",
        source,
    })
}

/// Creates the parent directory, or tightens an existing one, to 0700 (the file holds every
/// claim's release credential).
pub fn prepare_dir(path: &Path) -> Result<(), StateError> {
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    foundation::private_dir(dir).map_err(|source| StateError::Io {
        path: path.to_owned(),
        what: "creating the state directory (0700)",
        source,
    })
}

/// The state file with group-committed writes and a coalescing flush.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    /// Held while writing; holds the newest save request the file covers.
    write_lock: tokio::sync::Mutex<u64>,
    /// Save requests so far: each save takes the next number after its change is in memory.
    requested: AtomicU64,
    flush: Arc<Flush>,
}

/// The flush task's bookkeeping: whether one is queued, and how many failed.
#[derive(Debug, Default)]
struct Flush {
    queued: AtomicBool,
    failures: Counter,
}

impl StateStore {
    /// Prepares the directory, loads the file and writes it back once, proving it writable.
    pub fn open(path: &Path) -> Result<(StateStore, StateFile), StateError> {
        prepare_dir(path)?;
        let loaded = load(path)?;
        write(path, &loaded)?;
        let store = StateStore {
            path: path.to_owned(),
            write_lock: tokio::sync::Mutex::new(0),
            requested: AtomicU64::new(0),
            flush: Arc::default(),
        };
        Ok((store, loaded))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Persists the snapshot `take()` returns; call it after the change to persist is in memory.
    /// The snapshot is taken under the write lock, so writes land in the order their snapshots
    /// were taken and the last write is the newest. Group commit: a save whose change a write
    /// that started after it already covered returns without writing (`take` is not called), so
    /// a burst of saves costs a few writes, not one each.
    pub async fn save(&self, take: impl FnOnce() -> StateFile) -> Result<(), StateError> {
        self.save_with(take, || {}).await
    }

    /// [`StateStore::save`], then `written()` — still under the write lock, so no other
    /// snapshot can be written between this write and what `written` changes.
    pub async fn save_with(&self, take: impl FnOnce() -> StateFile, written: impl FnOnce()) -> Result<(), StateError> {
        let mine = self.requested.fetch_add(1, Ordering::SeqCst) + 1;
        let mut on_disk = self.write_lock.lock().await;
        if *on_disk >= mine {
            written();
            return Ok(());
        }
        // Every save numbered up to `covers` made its change before this snapshot is taken.
        let covers = self.requested.load(Ordering::SeqCst);
        let snapshot = take();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || write_unsynced(&path, &snapshot))
            .await
            .map_err(|_| StateError::Task { path: self.path.clone() })??;
        *on_disk = covers;
        written();
        self.queue_flush();
        Ok(())
    }

    /// Starts a flush unless one is queued and not yet started (that one will see this write).
    fn queue_flush(&self) {
        if self.flush.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let (flush, path) = (self.flush.clone(), self.path.clone());
        tokio::task::spawn_blocking(move || {
            // Cleared before the fsync: a save landing during it queues the next flush.
            flush.queued.store(false, Ordering::Release);
            if let Err(e) = foundation::sync_file_and_dir(&path) {
                flush.failures.inc();
                tracing::error!(path = %path.display(), error = %e, "flushing the claims state to disk failed; the next save tries again");
            }
        });
    }

    /// Flushes that failed since the store opened (a counter for `/metrics`).
    pub fn flush_failures(&self) -> Counter {
        self.flush.failures.clone()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn rec(id: &str) -> ClaimRecord {
        ClaimRecord {
            id: id.into(),
            token: "secret-token".into(),
            address: "10.0.0.1:7777".into(),
            pod_uid: "uid-1".into(),
            claimed_at: Some("2030-01-01T00:00:00Z".parse().unwrap()),
            deadline: Some("2030-01-02T00:00:00Z".parse().unwrap()),
            owner: None,
        }
    }

    #[test]
    fn a_loose_existing_directory_is_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("vk-sandbox");
        std::fs::create_dir(&sub).unwrap();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = sub.join("claims.json");
        StateStore::open(&path).unwrap();
        assert_eq!(std::fs::metadata(&sub).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn round_trip_with_the_documented_field_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/claims.json");
        let (store, loaded) = StateStore::open(&path).unwrap();
        assert_eq!(loaded, StateFile::default());
        assert_eq!(std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        let mut st = StateFile::default();
        st.claims.insert("ns/a".into(), rec("sb_1"));
        let mut owned = rec("sb_2");
        owned.owner = Some(OwnerRef {
            api_version: "agents.x-k8s.io/v1beta1".into(),
            kind: "Sandbox".into(),
            name: "a".into(),
            uid: "u".into(),
        });
        st.claims.insert("ns/b".into(), owned);
        write(store.path(), &st).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let row = &raw["claims"]["ns/a"];
        for k in ["id", "token", "address", "podUID", "claimedAt", "deadline"] {
            assert!(row.get(k).is_some(), "missing {k}: {row}");
        }
        assert!(row.get("owner").is_none());
        assert_eq!(raw["claims"]["ns/b"]["owner"]["apiVersion"], "agents.x-k8s.io/v1beta1");
        assert!(raw.get("releasing").is_none());
        assert_eq!(load(&path).unwrap(), st);
        assert!(!format!("{:?}", st).contains("secret-token"), "the token leaked into Debug");
        // No temp file left behind.
        let names: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from("claims.json")]);
    }

    #[test]
    fn missing_is_empty_malformed_is_fatal_and_minimal_rows_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claims.json");
        assert_eq!(load(&path).unwrap(), StateFile::default());
        std::fs::write(&path, b"{\"claims\": {\"ns/a\": ").unwrap();
        let e = StateStore::open(&path).unwrap_err();
        assert!(matches!(e, StateError::Malformed { .. }), "{e:?}");
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"claims\": {\"ns/a\": ", "a malformed file was overwritten");
        // An older row (no timestamps, no owner) still loads.
        std::fs::write(&path, br#"{"claims":{"ns/a":{"id":"sb_1","token":"t","podUID":"u"}}}"#).unwrap();
        let st = load(&path).unwrap();
        assert_eq!(st.claims["ns/a"].id, "sb_1");
        assert_eq!(st.claims["ns/a"].deadline, None);
    }

    #[test]
    fn an_unwritable_location_fails_open() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").unwrap();
        // The parent "directory" is a regular file.
        assert!(StateStore::open(&blocker.join("claims.json")).is_err());
    }

    #[tokio::test]
    async fn saves_waiting_behind_a_write_are_covered_by_one_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claims.json");
        let (store, _) = StateStore::open(&path).unwrap();
        let store = std::sync::Arc::new(store);
        let table = std::sync::Arc::new(std::sync::Mutex::new(StateFile::default()));
        let takes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Hold the write lock, as a slow write would, while 20 saves queue up.
        let held = store.write_lock.lock().await;
        let mut tasks = Vec::new();
        for n in 0..20 {
            let (store, table, takes) = (store.clone(), table.clone(), takes.clone());
            tasks.push(tokio::spawn(async move {
                table.lock().unwrap().claims.insert(format!("ns/{n}"), rec(&format!("sb_{n}")));
                store
                    .save(|| {
                        takes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        table.lock().unwrap().clone()
                    })
                    .await
                    .unwrap()
            }));
        }
        while store.requested.load(Ordering::SeqCst) < 20 {
            tokio::task::yield_now().await;
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(takes.load(std::sync::atomic::Ordering::SeqCst), 1, "queued saves were not written as one");
        assert_eq!(load(&path).unwrap().claims.len(), 20, "a covered save's change is not on disk");
    }

    #[tokio::test]
    async fn serialized_saves_keep_the_last_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claims.json");
        let (store, _) = StateStore::open(&path).unwrap();
        let store = std::sync::Arc::new(store);
        let counter = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (store, counter) = (store.clone(), counter.clone());
            tasks.push(tokio::spawn(async move {
                store
                    .save(|| {
                        let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let mut st = StateFile::default();
                        st.claims.insert(format!("ns/{n}"), rec(&format!("sb_{n}")));
                        st
                    })
                    .await
                    .unwrap()
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let st = load(&path).unwrap();
        let last = format!("ns/{}", counter.load(std::sync::atomic::Ordering::SeqCst) - 1);
        assert_eq!(st.claims.keys().collect::<Vec<_>>(), [&last], "the last snapshot taken was not the one on disk");
    }
}

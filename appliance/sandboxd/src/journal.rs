//! Durable state in `data_dir`: the claims journal `claims.json` and the pool override `pools.json`.
//!
//! Every write is atomic: a temp file in the same directory, an optional fsync (`sync_claims`),
//! then `rename` over the old file. A crash at any moment leaves either the old or the new file.
//! Claim writes are group-committed: each mutation of the claim table bumps a generation, and a
//! writer that finds its generation already on disk returns at once.
//!
//! Invariant: a claim is granted (replied to) only after a write that includes it returned `Ok`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use vmm::VmId;

use crate::config::PoolConfig;
use crate::pool::PoolKey;

/// The claims journal file name.
pub const CLAIMS_FILE: &str = "claims.json";
/// The pool override file name.
pub const POOLS_FILE: &str = "pools.json";

/// Errors reading or writing the journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Reading, writing, syncing or renaming a file failed.
    #[error("{what} {path}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A journal file does not parse (we refuse to guess: nothing is destroyed on ambiguity).
    #[error("parsing {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// One journaled claim (internal format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    /// Sandbox id `sb_<16 hex>`.
    pub id: String,
    /// The sandbox bearer token (32 hex).
    pub token: String,
    /// The VM serving it.
    pub vm: VmId,
    /// The pool key it was claimed from.
    pub key: PoolKey,
    /// Lease end, milliseconds since the Unix epoch.
    pub deadline_unix_ms: u64,
    /// First grant, milliseconds since the Unix epoch.
    pub claimed_at_unix_ms: u64,
    /// Caller's reference, filterable in listings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ClaimsFile {
    version: u32,
    claims: Vec<ClaimRecord>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PoolsFile {
    pools: Vec<PoolConfig>,
}

/// The journal in one data dir.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    sync: bool,
    /// The claim-table generation last written (the write lock of `claims.json`).
    written: Mutex<u64>,
}

impl Journal {
    /// Opens (creates) `dir`.
    pub fn open(dir: &Path, sync: bool) -> Result<Self, JournalError> {
        std::fs::create_dir_all(dir).map_err(|source| JournalError::Io {
            what: "creating data dir",
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(Journal { dir: dir.to_path_buf(), sync, written: Mutex::new(0) })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Loads `claims.json`; a missing file is an empty journal.
    pub fn load_claims(&self) -> Result<Vec<ClaimRecord>, JournalError> {
        Ok(read_opt::<ClaimsFile>(&self.dir.join(CLAIMS_FILE))?.map_or_else(Vec::new, |f| f.claims))
    }

    /// Makes sure generation `gen` of the claim table is on disk. `snapshot` is called (at most
    /// once) under the write lock and returns the table's current generation and rows.
    pub fn commit_claims(
        &self,
        gen: u64,
        snapshot: impl FnOnce() -> (u64, Vec<ClaimRecord>),
    ) -> Result<(), JournalError> {
        // A poisoned lock only means another writer panicked; the counter is still meaningful.
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if *written >= gen {
            return Ok(());
        }
        let (now, claims) = snapshot();
        let file = ClaimsFile { version: 1, claims };
        let path = self.dir.join(CLAIMS_FILE);
        let bytes =
            serde_json::to_vec_pretty(&file).map_err(|source| JournalError::Parse { path: path.clone(), source })?;
        write_atomic(&path, &bytes, self.sync)?;
        *written = now;
        Ok(())
    }

    /// Loads `pools.json` (the persisted `PUT /v1/pools`), if present.
    pub fn load_pools(&self) -> Result<Option<Vec<PoolConfig>>, JournalError> {
        Ok(read_opt::<PoolsFile>(&self.dir.join(POOLS_FILE))?.map(|f| f.pools))
    }

    /// Persists the pool list.
    pub fn write_pools(&self, pools: &[PoolConfig]) -> Result<(), JournalError> {
        let path = self.dir.join(POOLS_FILE);
        let bytes = serde_json::to_vec_pretty(&PoolsFile { pools: pools.to_vec() })
            .map_err(|source| JournalError::Parse { path: path.clone(), source })?;
        write_atomic(&path, &bytes, true)
    }
}

fn read_opt<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, JournalError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(JournalError::Io { what: "reading", path: path.to_path_buf(), source }),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|source| JournalError::Parse { path: path.to_path_buf(), source })
}

/// Writes `bytes` to `path` atomically: temp file in the same dir, optional fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8], sync: bool) -> Result<(), JournalError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map_or_else(|| "journal".into(), |n| n.to_string_lossy());
    let tmp = dir.join(format!(".{name}.tmp-{:016x}", rand::random::<u64>()));
    let io = |what: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| JournalError::Io { what, path: p, source }
    };
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        f.write_all(bytes).map_err(io("writing", &tmp))?;
        if sync {
            f.sync_all().map_err(io("syncing", &tmp))?;
        }
        drop(f);
        std::fs::rename(&tmp, path).map_err(io("renaming over", path))?;
        if sync {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing", dir))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> ClaimRecord {
        ClaimRecord {
            id: id.into(),
            token: "t".repeat(32),
            vm: VmId::new("sbx-aa-00000001").expect("id"),
            key: PoolKey::parse("base", None, None).expect("key"),
            deadline_unix_ms: 2,
            claimed_at_unix_ms: 1,
            claim_ref: Some("ref".into()),
        }
    }

    #[test]
    fn round_trip_and_group_commit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path(), true).expect("open");
        assert!(j.load_claims().expect("empty").is_empty());
        j.commit_claims(1, || (2, vec![rec("sb_1"), rec("sb_2")])).expect("write");
        assert_eq!(j.load_claims().expect("load"), vec![rec("sb_1"), rec("sb_2")]);
        // Generation 2 is already on disk: the snapshot is not even taken.
        j.commit_claims(2, || panic!("must not snapshot")).expect("skip");
        j.commit_claims(3, || (3, vec![])).expect("write");
        assert!(j.load_claims().expect("load").is_empty());
        // No temp files are left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(CLAIMS_FILE)]);
    }

    #[test]
    fn failed_write_keeps_the_old_file_and_reports() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path(), false).expect("open");
        j.commit_claims(1, || (1, vec![rec("sb_1")])).expect("write");
        // A directory where the temp file's rename must land makes the rename fail.
        std::fs::remove_file(dir.path().join(CLAIMS_FILE)).expect("rm");
        std::fs::create_dir(dir.path().join(CLAIMS_FILE)).expect("mkdir");
        std::fs::write(dir.path().join(CLAIMS_FILE).join("x"), b"x").expect("fill");
        assert!(j.commit_claims(2, || (2, vec![])).is_err());
        // The failed generation is not recorded as written.
        std::fs::remove_dir_all(dir.path().join(CLAIMS_FILE)).expect("rm dir");
        j.commit_claims(2, || (2, vec![rec("sb_9")])).expect("retry");
        assert_eq!(j.load_claims().expect("load")[0].id, "sb_9");
    }

    #[test]
    fn corrupt_journal_is_an_error_not_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(CLAIMS_FILE), b"{\"claims\":[").expect("write");
        let j = Journal::open(dir.path(), false).expect("open");
        assert!(matches!(j.load_claims(), Err(JournalError::Parse { .. })));
    }

    #[test]
    fn pools_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path(), false).expect("open");
        assert_eq!(j.load_pools().expect("none"), None);
        let p = vec![PoolConfig {
            template: "base".into(),
            net: None,
            size: Some("medium".into()),
            warm: Some(2),
            warm_max: None,
            idle_hibernate_seconds: None,
            archive_after_seconds: None,
            archive_delete_after_seconds: None,
        }];
        j.write_pools(&p).expect("write");
        assert_eq!(j.load_pools().expect("load"), Some(p));
    }
}

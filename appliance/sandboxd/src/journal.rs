//! Durable state in `data_dir`: the claims journal and the pool override `pools.json`.
//!
//! The claims journal is a snapshot plus an append-only log:
//! - `claims.json` — `{"version": 2, "seq": S, "claims": [...]}`, the whole claim table as of
//!   sequence number `S`, always replaced atomically (temp + fsync + rename + dir fsync, via
//!   [`foundation::write_atomic`], born 0600);
//! - `claims.log` — one JSON line per claim-table mutation after the snapshot:
//!   `{"seq":N,"op":{"grant":{<record>}}}`, `{"seq":N,"op":{"release":{"id":…}}}`,
//!   `{"seq":N,"op":{"renew":{"id":…,"deadline_unix_ms":…}}}`. A grant, release or renew appends
//!   its line (one `write`, then `fdatasync` when `sync_claims` is on) before it is answered;
//!   concurrent mutations are group-committed: a writer appends every pending line at once and
//!   a writer whose sequence number is already on disk returns at once;
//! - `claims.log.1` — the previous log, sealed while a background compaction writes the
//!   snapshot that covers it, then deleted.
//!
//! Load: the snapshot, then `claims.log.1`, then `claims.log`, skipping lines whose `seq` the
//! snapshot already covers (so a crash between writing a snapshot and deleting a log replays
//! nothing twice). A final segment without its newline is a torn write that was never
//! acknowledged and is ignored; any other line that does not parse is an error (we refuse to
//! guess: nothing is destroyed on ambiguity). Start-up compacts: it writes a fresh snapshot
//! and deletes both logs.
//!
//! Compaction: when the log outgrows [`COMPACT_MIN_BYTES`] or the last snapshot (amortised
//! O(1) per mutation), [`Journal::compact_if_large`] (run by the node's reaper tick, off the
//! claim path) flushes pending lines, renames `claims.log` to `claims.log.1` under the writer
//! lock (cheap), then writes the snapshot and deletes `claims.log.1` without holding it, so
//! claims keep appending meanwhile. A log past [`COMPACT_HARD_BYTES`], or a failed append
//! (the log may hold a torn tail or miss lines), makes the next commit compact inline.
//!
//! Snapshots (and `pools.json`) are always fsynced: they are written off the claim path, so
//! durability costs nothing there; `sync_claims` governs only the per-append `fdatasync`.
//! Without it, a claim survives `kill -9` of sandboxd (the page cache keeps the appended line)
//! but not a power loss.
//!
//! Invariant: a claim is granted (replied to) only after a commit that includes it returned `Ok`.
//!
//! Secrets at rest: the journal holds every sandbox token, so the data dir is 0700 and every
//! journal file (`claims.json`, `claims.log`, `claims.log.1`, `pools.json`) is 0600, created
//! with that mode (the snapshot and `pools.json` through [`foundation::write_atomic`], the log
//! opened `O_CREAT` with mode 0600), so no file is ever readable by others, not even for a
//! moment. [`Journal::open`] tightens a looser data dir or journal file left by an older
//! version.
//!
//! Lock order: compaction → writer → claim table.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use vmm::VmId;

use crate::config::PoolConfig;
use crate::pool::PoolKey;

/// The claims snapshot file name.
pub const CLAIMS_FILE: &str = "claims.json";
/// The claims log file name (lines after the snapshot).
pub const CLAIMS_LOG: &str = "claims.log";
/// The sealed previous log, present while a compaction runs (or after one failed).
pub const CLAIMS_LOG_SEALED: &str = "claims.log.1";
/// The pool override file name.
pub const POOLS_FILE: &str = "pools.json";
/// The log is compacted in the background once it is larger than this and than the last snapshot.
pub const COMPACT_MIN_BYTES: u64 = 1 << 20;
/// A log larger than this is compacted inline by the next commit (background compaction lagging).
pub const COMPACT_HARD_BYTES: u64 = 64 << 20;

const SNAPSHOT_VERSION: u32 = 2;

/// Errors reading or writing the journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Reading, writing, syncing, renaming or removing a file failed.
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
    /// A complete line of a claims log does not parse.
    #[error("parsing {path} line {line}")]
    LogLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// Encoding a snapshot or `pools.json` failed.
    #[error("encoding {path}")]
    Encode {
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
    /// The checkpoint it was claimed from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_checkpoint: Option<String>,
    /// Hibernated: its VM is gone and the sandbox is this snapshot (memory and disk); a wake
    /// restores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hibernate_snap: Option<PathBuf>,
    /// A hibernate in progress into this directory (the intent, journaled before the
    /// snapshot): a restart resolves it from what it finds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_snap: Option<PathBuf>,
    /// The volumes plugged into its VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<HeldVolume>,
}

/// A volume a sandbox holds: which, in which slot (SCSI target) of its VM, mounted where
/// (absent: attached only), and whether read-write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldVolume {
    /// The catalog volume.
    pub name: String,
    /// The slot, 1..=[`vmm::MAX_VOLUMES`].
    pub slot: u16,
    /// The guest mount point; absent when attached only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<String>,
    /// Held read-write (exclusively).
    #[serde(default)]
    pub rw: bool,
}

impl HeldVolume {
    /// How the API shows it.
    pub fn spec(&self) -> sandboxd_api::VolumeSpec {
        sandboxd_api::VolumeSpec {
            name: self.name.clone(),
            mount: self.mount.clone(),
            mode: self.rw.then(|| "rw".to_string()),
        }
    }
}

/// One mutation of the claim table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogOp {
    /// A claim was granted (or re-inserted).
    Grant(ClaimRecord),
    /// A claim ended (release, reap, dropped at reconcile, or a grant rolled back).
    Release {
        /// Sandbox id.
        id: String,
    },
    /// A lease was reset.
    Renew {
        /// Sandbox id.
        id: String,
        /// The new lease end, milliseconds since the Unix epoch.
        deadline_unix_ms: u64,
    },
}

/// One line of `claims.log`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// The claim-table generation this mutation produced (strictly increasing).
    pub seq: u64,
    /// The mutation.
    pub op: LogOp,
}

#[derive(Debug, Serialize, Deserialize)]
struct ClaimsFile {
    version: u32,
    /// Generation covered by the snapshot (absent in version 1 files: 0).
    #[serde(default)]
    seq: u64,
    claims: Vec<ClaimRecord>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PoolsFile {
    pools: Vec<PoolConfig>,
}

/// What the journal reads of the claim table it makes durable: the records, never the table
/// itself (`claims::ClaimTable` implements this). Every mutation of the
/// table bumps its generation and queues one [`LogEntry`]; the journal drains the queue in
/// generation order (group commit) or snapshots every record (compaction).
///
/// Called with the table's lock held and the journal's writer lock held (lock order:
/// compaction → writer → claim table).
pub trait ClaimLog {
    /// The current generation and the log lines queued since the last call.
    fn take_pending(&mut self) -> (u64, Vec<LogEntry>);
    /// The current generation and every record, sorted by id.
    fn snapshot(&self) -> (u64, Vec<ClaimRecord>);
}

/// The generation of a claim table and the log lines queued since the journal last took them:
/// what a [`ClaimLog`] implementation keeps beside its records. Each mutation is one
/// [`Pending::push`], which numbers it with the next generation.
#[derive(Debug, Default)]
pub struct Pending {
    gen: u64,
    lines: Vec<LogEntry>,
}

impl Pending {
    /// Nothing queued, at generation `gen` (a table loaded from disk: it is all there).
    pub fn at(gen: u64) -> Self {
        Pending { gen, lines: Vec::new() }
    }

    /// The current generation.
    pub fn gen(&self) -> u64 {
        self.gen
    }

    /// Queues one mutation; returns its generation (the one to commit).
    pub fn push(&mut self, op: LogOp) -> u64 {
        self.gen += 1;
        self.lines.push(LogEntry { seq: self.gen, op });
        self.gen
    }

    /// The current generation and the lines queued since the last call
    /// ([`ClaimLog::take_pending`]).
    pub fn take(&mut self) -> (u64, Vec<LogEntry>) {
        (self.gen, std::mem::take(&mut self.lines))
    }
}

/// The claim table as read from disk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The generation of the last mutation on disk.
    pub seq: u64,
    /// Live claims, sorted by id.
    pub claims: Vec<ClaimRecord>,
    /// Torn final lines ignored (never acknowledged).
    pub torn: usize,
}

#[derive(Debug)]
struct Writer {
    /// The claim-table generation known to be on disk.
    written: u64,
    /// Size of `claims.log` as far as we wrote it.
    log_bytes: u64,
    /// Size of the last snapshot (the compaction threshold scales with it).
    snapshot_bytes: u64,
    /// An append failed: the log may miss lines or hold a torn tail; compact before appending.
    dirty: bool,
    /// `claims.log.1` exists.
    sealed: bool,
    /// `claims.log` may not exist yet: after creating it, fsync the directory (with `sync`).
    fresh: bool,
}

/// The journal in one data dir.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    sync: bool,
    writer: Mutex<Writer>,
    /// Held by whoever writes `claims.json` (one snapshot writer at a time).
    compaction: Mutex<()>,
    /// Serializes `pools.json` writes (the atomic writer's temp name is per process).
    pools: Mutex<()>,
    /// Background compaction threshold ([`COMPACT_MIN_BYTES`]).
    compact_min: u64,
    /// Inline compaction threshold ([`COMPACT_HARD_BYTES`]).
    compact_hard: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded value is updated in single statements; a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> JournalError {
    let path = path.to_path_buf();
    move |source| JournalError::Io { what, path, source }
}

impl Journal {
    /// Opens (creates) `dir`, made 0700, and tightens journal files looser than 0600. Does not
    /// read the claims: see [`Journal::recover`].
    pub fn open(dir: &Path, sync: bool) -> Result<Self, JournalError> {
        foundation::private_dir(dir).map_err(io_err("creating (0700) data dir", dir))?;
        for name in [CLAIMS_FILE, CLAIMS_LOG, CLAIMS_LOG_SEALED, POOLS_FILE] {
            tighten(&dir.join(name))?;
        }
        let len = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
        let writer = Writer {
            written: 0,
            log_bytes: len(CLAIMS_LOG),
            snapshot_bytes: len(CLAIMS_FILE),
            dirty: false,
            sealed: dir.join(CLAIMS_LOG_SEALED).exists(),
            fresh: true,
        };
        Ok(Journal {
            dir: dir.to_path_buf(),
            sync,
            writer: Mutex::new(writer),
            compaction: Mutex::new(()),
            pools: Mutex::new(()),
            compact_min: COMPACT_MIN_BYTES,
            compact_hard: COMPACT_HARD_BYTES,
        })
    }

    /// Overrides the compaction thresholds (tests use tiny ones to compact often).
    pub fn with_compaction_bounds(mut self, min_bytes: u64, hard_bytes: u64) -> Self {
        self.compact_min = min_bytes;
        self.compact_hard = hard_bytes.max(min_bytes);
        self
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether appends are fdatasynced (`sync_claims`).
    pub fn sync(&self) -> bool {
        self.sync
    }

    /// Start-up: reads the claims ([`read_claims`]), then compacts them into a fresh snapshot
    /// and deletes the logs. Call once, before any commit.
    pub fn recover(&self) -> Result<Loaded, JournalError> {
        let loaded = read_claims(&self.dir)?;
        if loaded.torn > 0 {
            tracing::warn!(torn = loaded.torn, "claims log: ignoring a torn final line (never acknowledged)");
        }
        let _c = lock(&self.compaction);
        let mut w = lock(&self.writer);
        self.write_snapshot_and_drop_logs(&mut w, loaded.seq, &loaded.claims)?;
        Ok(loaded)
    }

    /// Makes sure generation `gen` of `table` is on disk: appends every pending mutation of the
    /// table (group commit), or compacts inline when the log is dirty or past the hard bound.
    pub fn commit_claims<T: ClaimLog>(&self, gen: u64, table: &Mutex<T>) -> Result<(), JournalError> {
        {
            let mut w = lock(&self.writer);
            if w.written >= gen {
                return Ok(());
            }
            if !w.dirty && w.log_bytes <= self.compact_hard {
                let (seq, entries) = lock(table).take_pending();
                return self.append(&mut w, seq, &entries);
            }
        }
        // Lock order: compaction before writer.
        let _c = lock(&self.compaction);
        let mut w = lock(&self.writer);
        if w.written >= gen {
            return Ok(());
        }
        self.compact_inline(&mut w, table)
    }

    /// Replaces the pending lines by a snapshot written while holding the writer lock (so no
    /// commit returns before it is durable). Caller holds the compaction lock.
    fn compact_inline<T: ClaimLog>(&self, w: &mut Writer, table: &Mutex<T>) -> Result<(), JournalError> {
        let (seq, rows) = {
            let mut t = lock(table);
            // The snapshot covers the pending lines; if writing it fails they are on disk
            // nowhere, so the log stays dirty until a snapshot succeeds.
            let _ = t.take_pending();
            t.snapshot()
        };
        w.dirty = true;
        self.write_snapshot_and_drop_logs(w, seq, &rows)
    }

    /// Background compaction (the reaper tick): when the log outgrows [`COMPACT_MIN_BYTES`] and
    /// the last snapshot, seals it and writes a snapshot covering it. Returns whether it ran.
    pub fn compact_if_large<T: ClaimLog>(&self, table: &Mutex<T>) -> Result<bool, JournalError> {
        let _c = lock(&self.compaction);
        let (seq, rows) = {
            let mut w = lock(&self.writer);
            if !w.sealed && w.log_bytes <= self.compact_min.max(w.snapshot_bytes) {
                return Ok(false);
            }
            if w.dirty {
                self.compact_inline(&mut w, table)?;
                return Ok(true);
            }
            // Everything up to `seq` goes to the log being sealed, so the snapshot covers it;
            // later mutations stay pending for the next log.
            let (seq, entries, rows) = {
                let mut t = lock(table);
                let (seq, entries) = t.take_pending();
                (seq, entries, t.snapshot().1)
            };
            self.append(&mut w, seq, &entries)?;
            if !w.sealed {
                let (log, sealed) = (self.dir.join(CLAIMS_LOG), self.dir.join(CLAIMS_LOG_SEALED));
                match std::fs::rename(&log, &sealed) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => return Err(JournalError::Io { what: "sealing", path: log, source }),
                }
                w.sealed = true;
                w.log_bytes = 0;
                w.fresh = true;
            }
            // With a log sealed earlier (a failed compaction), the live log keeps lines ≤ seq;
            // loading skips them.
            (seq, rows)
        };
        let bytes = self.write_snapshot(seq, &rows)?;
        remove_if_exists(&self.dir.join(CLAIMS_LOG_SEALED))?;
        let mut w = lock(&self.writer);
        w.sealed = false;
        w.snapshot_bytes = bytes;
        Ok(true)
    }

    /// Appends `entries` (the table's pending lines up to generation `seq`); on failure
    /// truncates the torn tail (best effort) and marks the log dirty.
    fn append(&self, w: &mut Writer, seq: u64, entries: &[LogEntry]) -> Result<(), JournalError> {
        if entries.is_empty() {
            w.written = w.written.max(seq);
            return Ok(());
        }
        let mut buf = Vec::with_capacity(entries.len() * 320);
        for e in entries {
            let path = self.dir.join(CLAIMS_LOG);
            serde_json::to_writer(&mut buf, e).map_err(|source| JournalError::Parse { path, source })?;
            buf.push(b'\n');
        }
        let path = self.dir.join(CLAIMS_LOG);
        let result = (|| {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(foundation::SECRET_FILE.0)
                .open(&path)
                .map_err(io_err("opening", &path))?;
            if let Err(source) = f.write_all(&buf) {
                // Cut a partial line so later appends never follow garbage.
                let _ = f.set_len(w.log_bytes);
                return Err(JournalError::Io { what: "appending to", path: path.clone(), source });
            }
            if self.sync {
                f.sync_data().map_err(io_err("syncing", &path))?;
                if w.fresh {
                    sync_dir(&self.dir)?;
                }
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                w.fresh = false;
                w.log_bytes += buf.len() as u64;
                w.written = seq;
                Ok(())
            }
            Err(e) => {
                w.dirty = true;
                Err(e)
            }
        }
    }

    /// Writes a snapshot of `rows` at `seq`, then deletes both logs (holding compaction + writer).
    fn write_snapshot_and_drop_logs(&self, w: &mut Writer, seq: u64, rows: &[ClaimRecord]) -> Result<(), JournalError> {
        w.snapshot_bytes = self.write_snapshot(seq, rows)?;
        remove_if_exists(&self.dir.join(CLAIMS_LOG_SEALED))?;
        w.sealed = false;
        remove_if_exists(&self.dir.join(CLAIMS_LOG))?;
        w.log_bytes = 0;
        w.fresh = true;
        w.dirty = false;
        w.written = w.written.max(seq);
        Ok(())
    }

    /// Writes `claims.json` atomically (always fsynced); returns its approximate size.
    fn write_snapshot(&self, seq: u64, rows: &[ClaimRecord]) -> Result<u64, JournalError> {
        let file = ClaimsFile { version: SNAPSHOT_VERSION, seq, claims: rows.to_vec() };
        let path = self.dir.join(CLAIMS_FILE);
        write_secret_json(&path, &file)?;
        Ok(std::fs::metadata(&path).map_or(0, |m| m.len()))
    }

    /// Loads `pools.json` (the persisted `PUT /v1/pools`), if present.
    pub fn load_pools(&self) -> Result<Option<Vec<PoolConfig>>, JournalError> {
        Ok(read_opt::<PoolsFile>(&self.dir.join(POOLS_FILE))?.map(|f| f.pools))
    }

    /// Persists the pool list (atomically, fsynced).
    pub fn write_pools(&self, pools: &[PoolConfig]) -> Result<(), JournalError> {
        let _p = lock(&self.pools);
        write_secret_json(&self.dir.join(POOLS_FILE), &PoolsFile { pools: pools.to_vec() })
    }
}

/// Reads the claims of a data dir without changing anything: the snapshot, then
/// `claims.log.1`, then `claims.log` (see the module docs for the rules).
pub fn read_claims(dir: &Path) -> Result<Loaded, JournalError> {
    let snap = read_opt::<ClaimsFile>(&dir.join(CLAIMS_FILE))?;
    let (base, rows) = snap.map_or((0, Vec::new()), |f| (f.seq, f.claims));
    let mut table: std::collections::BTreeMap<String, ClaimRecord> =
        rows.into_iter().map(|r| (r.id.clone(), r)).collect();
    let mut seq = base;
    let mut torn = 0;
    for name in [CLAIMS_LOG_SEALED, CLAIMS_LOG] {
        let path = dir.join(name);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(JournalError::Io { what: "reading", path, source }),
        };
        let mut lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
        // `split` yields a final segment after the last newline: empty, or a torn write.
        if lines.pop().is_some_and(|tail| !tail.is_empty()) {
            torn += 1;
        }
        for (i, line) in lines.iter().enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let e: LogEntry = serde_json::from_slice(line).map_err(|source| JournalError::LogLine {
                path: path.clone(),
                line: i + 1,
                source,
            })?;
            if e.seq <= base {
                continue;
            }
            seq = seq.max(e.seq);
            match e.op {
                LogOp::Grant(r) => {
                    table.insert(r.id.clone(), r);
                }
                LogOp::Release { id } => {
                    table.remove(&id);
                }
                LogOp::Renew { id, deadline_unix_ms } => {
                    if let Some(r) = table.get_mut(&id) {
                        r.deadline_unix_ms = deadline_unix_ms;
                    }
                }
            }
        }
    }
    Ok(Loaded { seq, claims: table.into_values().collect(), torn })
}

fn read_opt<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, JournalError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(JournalError::Io { what: "reading", path: path.to_path_buf(), source }),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|source| JournalError::Parse { path: path.to_path_buf(), source })
}

/// Replaces `path` with `value` as JSON: atomic, fsynced, born 0600.
fn write_secret_json<T: Serialize>(path: &Path, value: &T) -> Result<(), JournalError> {
    let bytes =
        serde_json::to_vec_pretty(value).map_err(|source| JournalError::Encode { path: path.to_path_buf(), source })?;
    foundation::write_atomic(path, &bytes, foundation::SECRET_FILE).map_err(io_err("writing", path))
}

/// Makes an existing file 0600 when it is looser (files of older versions).
fn tighten(path: &Path) -> Result<(), JournalError> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::metadata(path) {
        Ok(m) if m.permissions().mode() & 0o077 != 0 => {
            tracing::warn!(path = %path.display(), mode = format!("{:04o}", m.permissions().mode() & 0o7777), "tightening a journal file to 0600");
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(foundation::SECRET_FILE.0))
                .map_err(io_err("tightening (0600)", path))
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(JournalError::Io { what: "inspecting", path: path.to_path_buf(), source }),
    }
}

fn remove_if_exists(path: &Path) -> Result<(), JournalError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(JournalError::Io { what: "removing", path: path.to_path_buf(), source }),
    }
}

fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("syncing", dir))
}

#[cfg(test)]
mod tests;

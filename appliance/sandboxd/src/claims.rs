//! Claims: the table of granted sandboxes, lease (TTL) rules and id/token minting.
//!
//! A claim is an ownership transfer of a warm VM: no VM work happens on the claim path
//! (see [`crate::node::Node::claim`]). This module holds the pure parts.
//!
//! TTL rules: absent or 0 → 300 s; capped at 86400 s and at the lease horizon
//! (`max_lifetime_secs`); negative → `400`. A renew past the horizon is refused (`409`).

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::RngCore;
use vmm::Vm;

use crate::journal::{ClaimLog, ClaimRecord, LogEntry, LogOp, Pending};
use crate::pool::{KeyError, PoolKey};

/// Default lease.
pub const DEFAULT_TTL: Duration = Duration::from_secs(300);
/// Longest lease.
pub const MAX_TTL: Duration = Duration::from_secs(86_400);

/// Why a claim (or renew) was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The pool key is malformed.
    #[error("invalid pool key")]
    Key(#[from] KeyError),
    /// A lease field is unusable.
    #[error("{0}")]
    Ttl(String),
    /// The node is draining.
    #[error("node draining")]
    Draining,
    /// No pool serves the key (a catalog template nothing keeps warm).
    #[error("no warm capacity for {0}")]
    NoCapacity(PoolKey),
    /// The pool is empty and no VM could be started for the claim now.
    #[error("no warm VM for {key}, and none can be started now: {reason}")]
    Full {
        /// The pool.
        key: PoolKey,
        /// Why (the node budget, draining).
        reason: String,
    },
    /// Neither a configured pool nor a catalog template.
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    /// A short template name that several catalog references share.
    #[error("{0}")]
    AmbiguousTemplate(String),
    /// `net: egress` on a node without an uplink for VMs.
    #[error(
        "net egress is not available on this node: its config has no network.uplink (the interface VM egress \
         leaves by); ask for net none, or set network.uplink in the sandboxd config"
    )]
    Egress,
    /// An advanced feature the request asks for.
    #[error("{0} is not implemented on this node")]
    Unsupported(&'static str),
    /// No such sandbox.
    #[error("sandbox not found")]
    NotFound,
    /// A renew would move the deadline past the lease horizon.
    #[error(
        "renew refused: the lease cannot run past {horizon} (claimed_at + max_lifetime_secs = {max_lifetime_secs} s); \
         {remaining_secs} s remain, ask for at most ttl_seconds = {remaining_secs} or claim a new sandbox"
    )]
    LeaseHorizon {
        /// `claimed_at` + horizon, RFC 3339.
        horizon: String,
        /// The configured horizon.
        max_lifetime_secs: u64,
        /// Seconds left until the horizon.
        remaining_secs: u64,
    },
    /// The pool was empty and the VM made for the claim failed.
    #[error("the pool was empty and starting a VM for the claim failed: {0}")]
    Start(String),
    /// The journal write failed; the claim was not granted.
    #[error("journaling the claim")]
    Journal(#[source] crate::journal::JournalError),
}

/// Resolves a requested TTL in seconds.
pub fn ttl(requested: Option<i64>) -> Result<Duration, ClaimError> {
    match requested {
        None | Some(0) => Ok(DEFAULT_TTL),
        Some(s) if s < 0 => Err(ClaimError::Ttl("ttl_seconds must not be negative".into())),
        Some(s) => Ok(Duration::from_secs(s.unsigned_abs()).min(MAX_TTL)),
    }
}

/// A fresh sandbox id: `sb_` + 16 hex chars (8 random bytes).
pub fn mint_id() -> String {
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    format!("sb_{}", hex::encode(b))
}

/// A fresh sandbox token: 32 hex chars (16 random bytes).
pub fn mint_token() -> String {
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// RFC 3339 (UTC, seconds) of a Unix-ms instant.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A granted sandbox.
#[derive(Debug, Clone)]
pub struct Claim {
    /// What is journaled.
    pub rec: ClaimRecord,
    /// The VM, once attached (absent between a restart and the reconcile that re-adopts it).
    pub vm: Option<Vm>,
}

pub use sandboxd_api::SandboxRow;

impl Claim {
    /// The listing row (without the token).
    pub fn row(&self) -> SandboxRow {
        SandboxRow {
            id: self.rec.id.clone(),
            key: self.rec.key.clone().into(),
            deadline: rfc3339(self.rec.deadline_unix_ms),
            claimed_at: rfc3339(self.rec.claimed_at_unix_ms),
            hibernated: self.rec.hibernate_snap.is_some(),
            claim_ref: self.rec.claim_ref.clone(),
            from_checkpoint: self.rec.from_checkpoint.clone(),
            token: None,
            volumes: self.rec.volumes.iter().map(|v| v.spec()).collect(),
        }
    }
}

/// The claim table. Every journaled mutation bumps the generation and queues one log line
/// ([`LogEntry`]) in generation order; the journal reads them through [`ClaimLog`] and
/// [`crate::journal::Journal::commit_claims`] appends the queued lines (group commit).
/// Queuing under the table lock keeps the log in table order.
#[derive(Debug, Default)]
pub struct ClaimTable {
    by_id: HashMap<String, Claim>,
    log: Pending,
}

impl ClaimTable {
    /// A table loaded from the journal at generation `seq` (nothing pending: it is on disk).
    pub fn restore(seq: u64, records: Vec<ClaimRecord>) -> Self {
        let by_id = records.into_iter().map(|rec| (rec.id.clone(), Claim { rec, vm: None })).collect();
        ClaimTable { by_id, log: Pending::at(seq) }
    }

    /// Inserts a claim; returns the new generation.
    pub fn insert(&mut self, c: Claim) -> u64 {
        let op = LogOp::Grant(c.rec.clone());
        self.by_id.insert(c.rec.id.clone(), c);
        self.log.push(op)
    }

    /// Removes a claim; returns it and the new generation.
    pub fn remove(&mut self, id: &str) -> Option<(Claim, u64)> {
        let c = self.by_id.remove(id)?;
        Some((c, self.log.push(LogOp::Release { id: id.to_string() })))
    }

    /// Sets a claim's deadline; returns the new generation.
    pub fn set_deadline(&mut self, id: &str, deadline_unix_ms: u64) -> Option<u64> {
        let c = self.by_id.get_mut(id)?;
        c.rec.deadline_unix_ms = deadline_unix_ms;
        Some(self.log.push(LogOp::Renew { id: id.to_string(), deadline_unix_ms }))
    }

    /// Changes a claim's record (journaled whole) and its attached VM; returns the new
    /// generation, `None` when there is no such claim.
    pub fn update(&mut self, id: &str, vm: Option<Vm>, change: impl FnOnce(&mut ClaimRecord)) -> Option<u64> {
        let c = self.by_id.get_mut(id)?;
        change(&mut c.rec);
        c.vm = vm;
        let op = LogOp::Grant(c.rec.clone());
        Some(self.log.push(op))
    }

    /// Records the attached VM of a claim (not journaled: only the id is).
    pub fn set_vm(&mut self, id: &str, vm: Vm) {
        if let Some(c) = self.by_id.get_mut(id) {
            c.vm = Some(vm);
        }
    }

    /// One claim.
    pub fn get(&self, id: &str) -> Option<&Claim> {
        self.by_id.get(id)
    }

    /// All claims.
    pub fn iter(&self) -> impl Iterator<Item = &Claim> {
        self.by_id.values()
    }

    /// Number of claims.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// No claims.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Ids of claims whose deadline is at or before `now_ms`.
    pub fn expired(&self, now_ms: u64) -> Vec<String> {
        self.by_id.values().filter(|c| c.rec.deadline_unix_ms <= now_ms).map(|c| c.rec.id.clone()).collect()
    }
}

impl ClaimLog for ClaimTable {
    fn take_pending(&mut self) -> (u64, Vec<LogEntry>) {
        self.log.take()
    }

    fn snapshot(&self) -> (u64, Vec<ClaimRecord>) {
        let mut rows: Vec<ClaimRecord> = self.by_id.values().map(|c| c.rec.clone()).collect();
        rows.sort_by(|a, b| a.id.cmp(&b.id));
        (self.log.gen(), rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rules() {
        assert_eq!(ttl(None).expect("absent"), DEFAULT_TTL);
        assert_eq!(ttl(Some(0)).expect("zero"), DEFAULT_TTL);
        assert_eq!(ttl(Some(2)).expect("two"), Duration::from_secs(2));
        assert_eq!(ttl(Some(86_401)).expect("cap"), MAX_TTL);
        assert_eq!(ttl(Some(i64::MAX)).expect("cap"), MAX_TTL);
        assert!(matches!(ttl(Some(-1)), Err(ClaimError::Ttl(_))));
    }

    #[test]
    fn id_and_token_shapes() {
        let id = mint_id();
        assert_eq!(id.len(), 19);
        assert!(id.starts_with("sb_") && id[3..].bytes().all(|b| b.is_ascii_hexdigit()));
        let t = mint_token();
        assert_eq!(t.len(), 32);
        assert!(t.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(mint_token(), t);
    }

    #[test]
    fn every_mutation_queues_one_log_line_in_generation_order() {
        let rec = |id: &str| ClaimRecord {
            id: id.into(),
            token: "t".repeat(32),
            vm: vmm::VmId::new("sbx-aa-00000001").expect("id"),
            key: PoolKey::parse("base", None, None).expect("key"),
            deadline_unix_ms: 5,
            claimed_at_unix_ms: 1,
            claim_ref: None,
            from_checkpoint: None,
            hibernate_snap: None,
            pending_snap: None,
            volumes: Vec::new(),
        };
        let mut t = ClaimTable::default();
        assert_eq!(t.insert(Claim { rec: rec("sb_2"), vm: None }), 1);
        assert_eq!(t.insert(Claim { rec: rec("sb_1"), vm: None }), 2);
        assert_eq!(t.set_deadline("sb_1", 9), Some(3));
        assert_eq!(t.remove("sb_2").map(|(c, g)| (c.rec.id, g)), Some(("sb_2".to_string(), 4)));
        assert_eq!((t.set_deadline("sb_x", 1), t.remove("sb_x").is_none()), (None, true), "no line for a miss");
        let (gen, lines) = t.take_pending();
        assert_eq!(gen, 4);
        assert_eq!(lines.iter().map(|l| l.seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert!(matches!(&lines[2].op, LogOp::Renew { id, deadline_unix_ms: 9 } if id == "sb_1"));
        assert!(matches!(&lines[3].op, LogOp::Release { id } if id == "sb_2"));
        assert!(t.take_pending().1.is_empty(), "taken once");
        let snap = t.snapshot();
        assert_eq!(snap, (4, vec![ClaimRecord { deadline_unix_ms: 9, ..rec("sb_1") }]));
        let back = ClaimTable::restore(snap.0, snap.1.clone());
        assert_eq!(back.snapshot(), snap);
    }

    #[test]
    fn rfc3339_is_utc_seconds() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000_999), "2023-11-14T22:13:20Z");
    }
}

//! Branching claimed sandboxes: fork and checkpoints (`docs/sandboxd.md` §5.2).
//!
//! - **fork**: the parent is snapshotted (paused for the snapshot, then resumed), `count`
//!   children are restored from that snapshot like pool clones (silkd answers, RNG reseeded),
//!   and every child is journaled in one write. All or nothing: a failed restore or journal
//!   write destroys the children made so far and grants none. Children share the parent's
//!   pool key; their snapshot stays on disk while any of them runs.
//! - **checkpoint**: the same snapshot, kept under `ck_<hex>` with its record written last;
//!   claims from it restore a fresh VM each time, journaled with `from_checkpoint`.
//! - The node budget is reserved for every VM before any VM work; a fork that does not fit
//!   is refused whole (`429`).
//! - A crash at any point leaves only what a restart cleans: children not yet journaled are
//!   `sbx-` VMs nobody owns (the reconcile destroys them), and a snapshot no checkpoint and no
//!   VM needs is removed by the snapshot gc.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sandboxd_api::Checkpoint;
use vmm::{AfterSnapshot, DriverError, Snapshot, Vm};

use super::{Grant, Node};
use crate::claims::{self, Claim};
use crate::journal::{ClaimRecord, JournalError};
use crate::limits::Reservation;
use crate::pool::{Net, PoolKey};
use crate::refill::{self, RefillError};
use crate::snapshots::SnapshotStore;
use crate::vms::disk_mib;

/// Why a fork, a checkpoint or a claim from one failed.
#[derive(Debug, thiserror::Error)]
pub enum BranchError {
    /// `count` outside `1..=max_fork_count`.
    #[error("count must be between 1 and {max} (max_fork_count), got {count}")]
    Count {
        /// Asked for.
        count: i64,
        /// The node's `max_fork_count`.
        max: usize,
    },
    /// The sandbox is on the egress lane: each child would need its own address and identity.
    #[error(
        "sandbox {0} is on the egress lane, which cannot be forked or checkpointed (each branch would resume with \
         its network identity); branch a net none sandbox, or claim egress sandboxes separately"
    )]
    Egress(String),
    /// The sandbox is hibernated.
    #[error("sandbox {0} is hibernated: wake it first (POST …/wake, or any call into it)")]
    Hibernated(String),
    /// The sandbox holds volumes, which a snapshot cannot carry.
    #[error(
        "sandbox {0} holds volumes ({1}): a snapshot cannot carry them; detach them first (PUT …/volumes with [])"
    )]
    Volumes(String, String),
    /// The node is draining.
    #[error("node draining")]
    Draining,
    /// The node budget cannot hold the new VMs.
    #[error("{0}")]
    Budget(String),
    /// No such checkpoint.
    #[error("checkpoint not found")]
    NoCheckpoint,
    /// The sandbox's VM could not be snapshotted.
    #[error("snapshotting the sandbox")]
    Snapshot(#[source] DriverError),
    /// A VM could not be restored from the snapshot.
    #[error("restoring from the snapshot")]
    Restore(#[source] Box<RefillError>),
    /// Writing the snapshot's records failed.
    #[error("writing the snapshot records")]
    Io(#[source] std::io::Error),
    /// The journal write failed; nothing was granted.
    #[error("journaling the new claims")]
    Journal(#[source] JournalError),
}

impl Node {
    /// Forks `parent` into `count` children with lease `ttl`; `claim_ref_prefix` names them
    /// `<prefix>-<n>`. The caller has checked the parent's token.
    pub async fn fork(
        &self,
        parent: &Claim,
        count: i64,
        ttl: Duration,
        claim_ref_prefix: Option<String>,
    ) -> Result<Vec<Grant>, BranchError> {
        let max = self.limits.branching.max_fork_count;
        let n =
            usize::try_from(count).ok().filter(|n| (1..=max).contains(n)).ok_or(BranchError::Count { count, max })?;
        self.branchable(parent)?;
        let key = parent.rec.key.clone();
        let slots = self.reserve(&key, n)?;
        let span = tracing::info_span!("fork", claim = %parent.rec.id, vm = %parent.rec.vm, count = n);
        let _g = self.snapshots.lock().await;
        let dir = self.snapshots.fork_dir();
        let snap = self.snapshot_into(parent, &dir).await?;
        let made = self.restore_all(&key, &snap, slots).await;
        let made = match made {
            Ok(m) => m,
            Err(e) => {
                self.gc_snapshots_locked();
                return Err(e);
            }
        };
        let prefix = claim_ref_prefix.filter(|p| !p.is_empty());
        let recs = made
            .iter()
            .enumerate()
            .map(|(i, (vm, _))| self.record(vm, &key, ttl, prefix.as_ref().map(|p| format!("{p}-{i}")), None))
            .collect();
        let grants = self.journal_all(recs, made).await?;
        let _e = span.enter();
        crate::metrics::inc_by(&self.metrics.fork_children, grants.len());
        tracing::info!(children = grants.len(), "forked");
        Ok(grants)
    }

    /// Checkpoints `claim` (named `name`); the caller has checked its token.
    pub async fn checkpoint(&self, claim: &Claim, name: Option<String>) -> Result<Checkpoint, BranchError> {
        self.branchable(claim)?;
        let _g = self.snapshots.lock().await;
        let (id, dir) = self.snapshots.new_checkpoint();
        self.snapshot_into(claim, &dir).await?;
        let now = SystemTime::now();
        let mut ck = Checkpoint {
            id,
            name: name.unwrap_or_default(),
            sandbox_id: claim.rec.id.clone(),
            key: claim.rec.key.clone().into(),
            created_at: claims::rfc3339(claims::unix_ms(now)),
            size_bytes: None,
        };
        if let Err(e) = self.snapshots.publish_checkpoint(&dir, &ck, now) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(BranchError::Io(e));
        }
        ck.size_bytes = Some(SnapshotStore::bytes_of(&dir));
        crate::metrics::inc(&self.metrics.checkpoints);
        tracing::info!(claim = %claim.rec.id, checkpoint = %ck.id, "checkpointed");
        Ok(ck)
    }

    /// Claims a fresh sandbox from checkpoint `id` with lease `ttl`.
    pub async fn claim_checkpoint(&self, id: &str, ttl: Duration) -> Result<Grant, BranchError> {
        if self.draining() {
            return Err(BranchError::Draining);
        }
        let (ck, snap) = self.snapshots.checkpoint(id).ok_or(BranchError::NoCheckpoint)?;
        let key = PoolKey::parse(&ck.key.template, Some(&ck.key.net), Some(&ck.key.size))
            .map_err(|e| BranchError::Io(std::io::Error::other(e)))?;
        let slots = self.reserve(&key, 1)?;
        // Held while restoring, so a delete racing this claim cannot have its files collected.
        let _g = self.snapshots.lock().await;
        let made = self.restore_all(&key, &snap, slots).await?;
        let rec = self.record(&made[0].0, &key, ttl, None, Some(ck.id.clone()));
        let mut grants = self.journal_all(vec![rec], made).await?;
        tracing::info!(checkpoint = %ck.id, "claimed from a checkpoint");
        grants.pop().ok_or(BranchError::NoCheckpoint)
    }

    /// Every checkpoint, newest first.
    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        self.snapshots.checkpoints()
    }

    /// Deletes checkpoint `id`; its files go once no sandbox claimed from it runs.
    pub async fn delete_checkpoint(&self, id: &str) -> Result<(), BranchError> {
        let _g = self.snapshots.lock().await;
        if !self.snapshots.delete(id).map_err(BranchError::Io)? {
            return Err(BranchError::NoCheckpoint);
        }
        self.gc_snapshots_locked();
        tracing::info!(checkpoint = %id, "checkpoint deleted");
        Ok(())
    }

    /// How many checkpoints there are, and the bytes the snapshots (checkpoints, fork
    /// snapshots, hibernated sandboxes) hold on disk.
    pub fn snapshot_summary(&self) -> (usize, u64) {
        self.snapshots.summary()
    }

    /// Expires old checkpoints and removes the snapshots nothing needs (and the transition
    /// locks of claims that ended without a release, such as reaped ones).
    pub async fn gc_snapshots(&self) {
        self.forget_ended_transitions();
        let _g = self.snapshots.lock().await;
        if let Some(ttl) = self.limits.branching.checkpoint_ttl {
            let n = self.snapshots.expire(ttl, SystemTime::now());
            if n > 0 {
                tracing::info!(expired = n, "checkpoints past checkpoint_ttl_hours deleted");
            }
        }
        self.gc_snapshots_locked();
    }

    /// [`Node::gc_snapshots`]'s removal, under the snapshot lock; skipped while any claim's VM is
    /// not attached (its snapshot is unknown: nothing is removed on ambiguity).
    fn gc_snapshots_locked(&self) {
        if !self.reconciled() {
            return;
        }
        // Every claim's snapshots: its VM's source, a hibernated or hibernating one's own. A
        // claim whose VM is not attached yet makes the set unknown: nothing is removed.
        let mut used: Vec<PathBuf> = Vec::new();
        for c in self.store.lock().iter() {
            used.extend(c.rec.hibernate_snap.iter().chain(&c.rec.pending_snap).cloned());
            match &c.vm {
                Some(vm) => used.extend(vm.restored_from.clone()),
                None if c.rec.hibernate_snap.is_some() => {}
                None => {
                    tracing::debug!(claim = %c.rec.id, "snapshot gc skipped: a claimed VM is not attached yet");
                    return;
                }
            }
        }
        // A promoted template's disk may be backed by a snapshot of ours (`parent.json`).
        used.extend(self.promoted.dirs());
        self.snapshots.gc(used.iter().map(PathBuf::as_path));
    }

    pub(super) fn branchable(&self, claim: &Claim) -> Result<(), BranchError> {
        if claim.rec.hibernate_snap.is_some() {
            return Err(BranchError::Hibernated(claim.rec.id.clone()));
        }
        if claim.rec.key.net() == Net::Egress {
            return Err(BranchError::Egress(claim.rec.id.clone()));
        }
        if !claim.rec.volumes.is_empty() {
            return Err(BranchError::Volumes(claim.rec.id.clone(), held_names(claim)));
        }
        if self.draining() {
            return Err(BranchError::Draining);
        }
        Ok(())
    }

    /// Budget for `n` VMs of `key`, all or none.
    fn reserve(&self, key: &PoolKey, n: usize) -> Result<Vec<Reservation>, BranchError> {
        let (slots, short) = self.vms.ledger.reserve(n, key.size(), disk_mib(&self.refill.catalog, key.template()));
        match short {
            Some(why) => Err(BranchError::Budget(why)),
            None => Ok(slots),
        }
    }

    /// Snapshots the claim's VM into `dir` (it keeps running) and records the snapshot it
    /// depends on; a failure removes `dir`.
    pub(super) async fn snapshot_into(&self, claim: &Claim, dir: &Path) -> Result<Snapshot, BranchError> {
        let vm = self.vm_for(claim).await.map_err(BranchError::Snapshot)?;
        self.snapshot_vm(&vm, dir, AfterSnapshot::Resumed).await.map_err(|e| match e {
            SnapshotFailure::Vm(e) => BranchError::Snapshot(e),
            SnapshotFailure::Io(e) => BranchError::Io(e),
        })
    }

    /// Snapshots `vm` into `dir`, leaving it as `after` says, and records the snapshot it
    /// depends on (`parent.json`); a failure removes `dir`. What fork, checkpoint, promote and
    /// hibernate share.
    pub(super) async fn snapshot_vm(
        &self,
        vm: &Vm,
        dir: &Path,
        after: AfterSnapshot,
    ) -> Result<Snapshot, SnapshotFailure> {
        let r = async {
            let snap = self.vms.driver.snapshot(vm, dir, after).await.map_err(SnapshotFailure::Vm)?;
            self.snapshots.record_parent(dir, vm.restored_from.as_deref()).map_err(SnapshotFailure::Io)?;
            Ok(snap)
        }
        .await;
        if r.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        r
    }

    /// Restores one VM per reservation from `snap`, concurrently; all or none (the ones made
    /// are destroyed when another fails).
    async fn restore_all(
        &self,
        key: &PoolKey,
        snap: &Snapshot,
        slots: Vec<Reservation>,
    ) -> Result<Vec<(Vm, Reservation)>, BranchError> {
        let restores =
            slots.iter().map(|_| refill::restore_ready(&self.refill, key, snap, vmm::jail::CpuWeight::Normal));
        let results = futures::future::join_all(restores).await;
        let mut made = Vec::new();
        let mut failed = None;
        for (r, slot) in results.into_iter().zip(slots) {
            match r {
                Ok(vm) => made.push((vm, slot)),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            None => Ok(made),
            Some(e) => {
                tracing::warn!(error = %vmm::error_chain(&e), "a restore failed; destroying the others");
                self.vms.destroy_all(made.into_iter().map(|(vm, _)| vm).collect()).await;
                Err(BranchError::Restore(Box::new(e)))
            }
        }
    }

    /// A new claim on `vm`.
    fn record(
        &self,
        vm: &Vm,
        key: &PoolKey,
        ttl: Duration,
        claim_ref: Option<String>,
        from: Option<String>,
    ) -> ClaimRecord {
        let now = claims::unix_ms(SystemTime::now());
        let ttl_ms = u64::try_from(ttl.min(self.limits.max_lifetime).as_millis()).unwrap_or(u64::MAX);
        ClaimRecord {
            id: claims::mint_id(),
            token: claims::mint_token(),
            vm: vm.id.clone(),
            key: key.clone(),
            deadline_unix_ms: now.saturating_add(ttl_ms),
            claimed_at_unix_ms: now,
            claim_ref,
            from_checkpoint: from,
            hibernate_snap: None,
            pending_snap: None,
            volumes: Vec::new(),
        }
    }

    /// Journals one claim per VM in a single write; all granted or, on a failed write, none
    /// (the VMs are destroyed).
    async fn journal_all(
        &self,
        recs: Vec<ClaimRecord>,
        made: Vec<(Vm, Reservation)>,
    ) -> Result<Vec<Grant>, BranchError> {
        let mut gen = 0;
        let mut grants = Vec::new();
        let mut ids = Vec::new();
        {
            let mut table = self.store.lock();
            for (rec, (vm, _)) in recs.into_iter().zip(&made) {
                grants.push(self.grant_for(&rec));
                ids.push(rec.id.clone());
                gen = table.insert(Claim { rec, vm: Some(vm.clone()) });
            }
        }
        if let Err(e) = self.store.commit(gen) {
            tracing::error!(error = %vmm::error_chain(&e), "new claims not granted: journal write failed");
            {
                let mut table = self.store.lock();
                for id in &ids {
                    table.remove(id);
                }
            }
            self.vms.destroy_all(made.into_iter().map(|(vm, _)| vm).collect()).await;
            return Err(BranchError::Journal(e));
        }
        for (vm, slot) in made {
            slot.admit(&vm.id);
        }
        Ok(grants)
    }
}

/// Why [`Node::snapshot_vm`] failed.
#[derive(Debug)]
pub(super) enum SnapshotFailure {
    /// The driver's snapshot.
    Vm(DriverError),
    /// Recording its parent.
    Io(std::io::Error),
}

/// The names of the volumes a claim holds, for messages.
pub(super) fn held_names(claim: &Claim) -> String {
    claim.rec.volumes.iter().map(|v| v.name.as_str()).collect::<Vec<_>>().join(", ")
}

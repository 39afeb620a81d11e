//! Hibernation (`docs/sandboxd.md` §5.2): a hibernated sandbox holds no VM process and no RAM;
//! it keeps its id, token, lease and claim, and is a snapshot on disk until it wakes.
//!
//! - **hibernate** (explicit, or after `idle_hibernate_seconds` with no byte through its
//!   relays and no exec running):
//!   journal the intent (`pending_snap`), snapshot the VM paused, journal the result
//!   (`hibernate_snap`, the intent cleared), then destroy the VM. Idempotent.
//! - **wake** (explicit, or the next `/agent`, `/ports` or `/exec`; a request that is not one
//!   of those never wakes): reserve the budget for one VM, restore it from the snapshot like a
//!   pool clone, journal its new VM id. Idempotent. The snapshot stays (the woken VM's disk
//!   is backed by it) until the snapshot gc finds nothing uses it.
//! - One transition at a time per sandbox (a per-claim lock); a release racing a wake wins:
//!   the woken VM is destroyed.
//! - A crash loses nothing: the restart reconcile (`reconcile::resolve_intents`) finishes or
//!   undoes an intent from what it finds (the VM alive: it keeps running and the partial
//!   snapshot goes; the VM gone with a complete snapshot: the sandbox is hibernated; neither:
//!   the claim is dropped), and never adopts the VM of a hibernated claim.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::{AfterSnapshot, DriverError, Snapshot, Vm};

use super::Node;
use crate::claims::Claim;
use crate::journal::JournalError;
use crate::pool::{Net, PoolKey};
use crate::refill::{self, RefillError};
use crate::slots::ClaimUse;

/// Why a hibernate or a wake failed.
#[derive(Debug, thiserror::Error)]
pub enum HibernateError {
    /// No such sandbox (or it ended meanwhile).
    #[error("sandbox not found")]
    NotFound,
    /// Egress sandboxes keep running: their address and connections would not survive.
    #[error("sandbox {0} is on the egress lane, which cannot hibernate (its address and open connections would not survive)")]
    Egress(String),
    /// A sandbox holding volumes keeps running: its snapshot could not carry them.
    #[error("sandbox {0} holds volumes ({1}), which cannot hibernate; detach them first (PUT …/volumes with [])")]
    Volumes(String, String),
    /// The node budget has no room for the woken VM.
    #[error("{0}")]
    Budget(String),
    /// The VM could not be snapshotted.
    #[error("snapshotting the VM")]
    Snapshot(#[source] DriverError),
    /// The VM could not be restored.
    #[error("restoring the VM")]
    Restore(#[source] Box<RefillError>),
    /// A snapshot record could not be written.
    #[error("writing the snapshot records")]
    Io(#[source] std::io::Error),
    /// The journal write failed.
    #[error("journaling the hibernation")]
    Journal(#[source] JournalError),
}

impl Node {
    /// The per-sandbox transition lock.
    pub(super) fn transition(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut all = self.transitions.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(all.entry(id.to_string()).or_default())
    }

    /// Drops the transition lock of an ended claim.
    pub(crate) fn forget_transitions(&self, id: &str) {
        self.transitions.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        self.slots.forget(id);
    }

    /// Drops the transition locks of claims no longer in the table.
    pub(crate) fn forget_ended_transitions(&self) {
        let live: std::collections::HashSet<String> = self.store.lock().iter().map(|c| c.rec.id.clone()).collect();
        self.transitions.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| live.contains(id));
    }

    /// Hibernates sandbox `id` (nothing to do when it already is).
    pub async fn hibernate(&self, id: &str) -> Result<(), HibernateError> {
        let lock = self.transition(id);
        let _t = lock.lock().await;
        let claim = self.sandbox(id).ok_or(HibernateError::NotFound)?;
        if claim.rec.hibernate_snap.is_some() {
            return Ok(());
        }
        if claim.rec.key.net() == Net::Egress {
            return Err(HibernateError::Egress(id.to_string()));
        }
        if !claim.rec.volumes.is_empty() {
            return Err(HibernateError::Volumes(id.to_string(), super::branch::held_names(&claim)));
        }
        let span = tracing::info_span!("hibernate", claim = %id, vm = %claim.rec.vm);
        let _g = self.snapshots.lock().await;
        let vm = self.vm_for(&claim).await.map_err(HibernateError::Snapshot)?;
        let dir = self.snapshots.hibernate_dir();
        // 1. The intent, so that a crash from here on is resolved at the next start.
        self.journal_change(id, Some(vm.clone()), |r| r.pending_snap = Some(dir.clone()))?;
        // 2. The snapshot, the VM left paused.
        if let Err(e) = self.snapshot_vm(&vm, &dir, AfterSnapshot::Paused).await {
            // Undo: the VM runs on, the intent goes (the partial snapshot is already gone).
            let _ = self.vms.driver.resume(&vm).await;
            let _ = self.journal_change(id, Some(vm), |r| r.pending_snap = None);
            return Err(match e {
                super::branch::SnapshotFailure::Vm(e) => HibernateError::Snapshot(e),
                super::branch::SnapshotFailure::Io(e) => HibernateError::Io(e),
            });
        }
        // 3. The result, then the VM goes.
        self.journal_change(id, None, |r| {
            r.pending_snap = None;
            r.hibernate_snap = Some(dir.clone());
        })?;
        self.vms.destroy(&vm).await;
        inc_hibernations(self);
        let _e = span.enter();
        tracing::info!(snapshot = %dir.display(), "hibernated");
        Ok(())
    }

    /// Wakes sandbox `id`; returns its VM (the running one when it was awake).
    pub async fn wake(&self, id: &str) -> Result<Vm, HibernateError> {
        let lock = self.transition(id);
        let _t = lock.lock().await;
        let claim = self.sandbox(id).ok_or(HibernateError::NotFound)?;
        let Some(dir) = claim.rec.hibernate_snap.clone() else {
            return self.vm_for(&claim).await.map_err(HibernateError::Snapshot);
        };
        let started = Instant::now();
        let key = claim.rec.key.clone();
        let snap = Snapshot::load(&dir).map_err(|e| HibernateError::Io(std::io::Error::other(e)))?;
        let (mut slots, short) =
            self.vms.ledger.reserve(1, key.size(), crate::vms::disk_mib(&self.refill.catalog, key.template()));
        let (Some(slot), None) = (slots.pop(), short.clone()) else {
            return Err(HibernateError::Budget(short.unwrap_or_default()));
        };
        let vm = refill::restore_ready(&self.refill, &key, &snap, vmm::jail::CpuWeight::Normal)
            .await
            .map_err(|e| HibernateError::Restore(Box::new(e)))?;
        match self.journal_change(id, Some(vm.clone()), |r| {
            r.vm = vm.id.clone();
            r.hibernate_snap = None;
        }) {
            Ok(()) => {
                slot.admit(&vm.id);
                inc_wakes(self);
                tracing::info!(claim = %id, vm = %vm.id, ms = started.elapsed().as_millis() as u64, "woke");
                Ok(vm)
            }
            Err(e) => {
                // Released meanwhile, or the journal failed: the sandbox stays as it was.
                self.vms.destroy(&vm).await;
                Err(e)
            }
        }
    }

    /// The VM of a claim for a guest call (`/agent`, `/ports`, `/exec`): wakes it first when
    /// it is hibernated.
    pub async fn vm_waking(&self, claim: &Claim) -> Result<Vm, HibernateError> {
        if claim.rec.hibernate_snap.is_some() {
            return self.wake(&claim.rec.id).await;
        }
        self.vm_for(claim).await.map_err(HibernateError::Snapshot)
    }

    /// Hibernates every claim of a pool with `idle_hibernate_seconds` through which nothing
    /// moved for that long (no byte through its relays, no exec running; since its claim when
    /// never used). Its open relays are cut; a client's next call wakes it.
    pub async fn hibernate_idle(&self) {
        let idle_after: Vec<(PoolKey, Duration)> = self
            .pool_configs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|c| {
                let secs = c.idle_hibernate_seconds.filter(|s| *s > 0)?;
                let key = PoolKey::parse(&c.template, c.net.as_deref(), c.size.as_deref()).ok()?;
                Some((key, Duration::from_secs(secs)))
            })
            .collect();
        if idle_after.is_empty() {
            return;
        }
        let now_ms = crate::claims::unix_ms(std::time::SystemTime::now());
        let due: Vec<String> = self
            .store
            .lock()
            .iter()
            .filter(|c| c.rec.hibernate_snap.is_none() && c.rec.pending_snap.is_none() && c.rec.volumes.is_empty())
            .filter_map(|c| {
                let (_, after) = idle_after.iter().find(|(k, _)| *k == c.rec.key)?;
                let idle = match self.slots.activity(&c.rec.id) {
                    ClaimUse::Busy => return None,
                    ClaimUse::IdleSince(t) => t.elapsed(),
                    ClaimUse::Unused => Duration::from_millis(now_ms.saturating_sub(c.rec.claimed_at_unix_ms)),
                };
                (idle >= *after).then(|| c.rec.id.clone())
            })
            .collect();
        for id in due {
            match self.hibernate(&id).await {
                Ok(()) => tracing::info!(claim = %id, "hibernated after idle_hibernate_seconds"),
                Err(e) => tracing::warn!(claim = %id, error = %vmm::error_chain(&e), "idle hibernation failed"),
            }
        }
    }

    /// Number of hibernated claims.
    pub fn hibernated(&self) -> usize {
        self.store.lock().iter().filter(|c| c.rec.hibernate_snap.is_some()).count()
    }

    /// Changes a claim's record and its attached VM, journaled.
    fn journal_change(
        &self,
        id: &str,
        vm: Option<Vm>,
        change: impl FnOnce(&mut crate::journal::ClaimRecord),
    ) -> Result<(), HibernateError> {
        let gen = self.store.lock().update(id, vm, change).ok_or(HibernateError::NotFound)?;
        self.store.commit(gen).map_err(HibernateError::Journal)
    }
}

fn inc_hibernations(node: &Node) {
    crate::metrics::inc(&node.metrics.hibernations);
}

fn inc_wakes(node: &Node) {
    crate::metrics::inc(&node.metrics.wakes);
}

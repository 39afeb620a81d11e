//! Warm pools: one [`Pool`] per key `(template, net, size)`, all of them in [`Pools`].
//!
//! A pool's state sits behind one `std::sync::Mutex` that is never held across an `.await`:
//! the claim path locks it only to pop the newest warm VM (LIFO). A refill task per pool
//! (`crate::refill`) keeps `warm + refilling` at the target: it builds a golden snapshot once,
//! fills by cloning it (falling back to cold boots), and admits a VM only after silkd answers
//! `info`. Every refill slot and golden build first reserves room in the node budget
//! (`crate::limits::Ledger`); without room the pool waits and reports why (`at_capacity`).
//!
//! This module is plain state: it imports nothing else of sandboxd.

mod key;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use vmm::{Snapshot, Vm};

pub use key::{valid_template, KeyError, Net, PoolKey};
pub use sandboxd_api::PoolInfo;

/// Refill failures in a row before backing off.
pub const BACKOFF_AFTER: u32 = 8;
/// First backoff step.
pub const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// Backoff ceiling.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// One warm pool.
#[derive(Debug)]
pub struct Pool {
    /// Its key.
    pub key: PoolKey,
    /// `key.hash()`, cached.
    pub hash: String,
    pub(crate) state: std::sync::Mutex<PoolState>,
    pub(crate) kick: Notify,
    /// Cancelled when the pool is removed (or the node stops).
    pub(crate) cancel: CancellationToken,
}

/// The mutable state of a pool.
#[derive(Debug, Default)]
pub struct PoolState {
    /// Ready VMs, newest last (claims pop from the end).
    pub warm: Vec<Vm>,
    /// Refill slots in flight (reserved, booting or probing).
    pub refilling: usize,
    /// Warm target.
    pub target: usize,
    /// The golden snapshot clones are made from.
    pub golden: Option<Snapshot>,
    /// A golden build is running.
    pub golden_building: bool,
    /// Cold boots started for a claim on a miss, in flight (at most one per pool).
    pub on_demand_booting: usize,
    /// Do not try to build a golden before this instant (after a failure).
    pub golden_retry_at: Option<Instant>,
    /// Clone failures in a row (the golden is dropped after a few).
    pub clone_failures: u32,
    /// Refill failures in a row.
    pub failures: u32,
    /// Current backoff step (zero when not backing off).
    pub backoff: Duration,
    /// No refill before this instant.
    pub backoff_until: Option<Instant>,
    /// Why the pool cannot fill, when it cannot.
    pub at_capacity: Option<String>,
    /// The node budget stopped the last refill short (why), until a refill is granted in full.
    pub budget_blocked: Option<String>,
    /// The pool was removed; in-flight refills destroy their VM.
    pub retired: bool,
}

impl Pool {
    /// A new, empty pool with `target` warm VMs wanted.
    pub fn new(key: PoolKey, target: usize, parent: &CancellationToken) -> Self {
        Pool {
            hash: key.hash(),
            key,
            state: std::sync::Mutex::new(PoolState { target, ..PoolState::default() }),
            kick: Notify::new(),
            cancel: parent.child_token(),
        }
    }

    /// Locks the state. A poisoned lock means a panic mid-update elsewhere; the state is plain
    /// data that stays consistent field by field, so we keep going.
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pops the newest warm VM (the whole claim-side critical section).
    pub fn take(&self) -> Option<Vm> {
        self.lock().warm.pop()
    }

    /// Puts a VM back on top (a claim that could not be journaled).
    pub fn put_back(&self, vm: Vm) {
        self.lock().warm.push(vm);
    }

    /// Wakes the refill task.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Takes every warm VM out (drain, removal); the caller destroys them.
    pub fn take_all(&self) -> Vec<Vm> {
        std::mem::take(&mut self.lock().warm)
    }

    /// Sets the target; returns the surplus warm VMs to destroy.
    pub fn set_target(&self, target: usize) -> Vec<Vm> {
        let mut s = self.lock();
        s.target = target;
        let keep = s.warm.len().min(target);
        // Oldest VMs are at the front; keep the newest.
        let cut = s.warm.len() - keep;
        let surplus: Vec<Vm> = s.warm.drain(..cut).collect();
        surplus
    }

    /// Marks the pool removed and stops its refill task; returns the warm VMs to destroy.
    pub fn retire(&self) -> Vec<Vm> {
        self.cancel.cancel();
        let mut s = self.lock();
        s.retired = true;
        std::mem::take(&mut s.warm)
    }

    /// The pool's row in `GET /v1/info`.
    pub fn info(&self) -> PoolInfo {
        let s = self.lock();
        PoolInfo {
            key: self.key.clone().into(),
            warm: s.warm.len(),
            refilling: s.refilling,
            target: s.target,
            golden: s.golden.is_some(),
            at_capacity: s.at_capacity.is_some() || s.budget_blocked.is_some(),
            at_capacity_reason: s.at_capacity.clone().or_else(|| s.budget_blocked.clone()),
        }
    }

    /// The VM ids the pool holds (warm).
    pub fn warm_ids(&self) -> Vec<vmm::VmId> {
        self.lock().warm.iter().map(|v| v.id.clone()).collect()
    }
}

/// The node's pools by key (a `BTreeMap`, so listings come sorted). Readers hold the lock
/// only to clone an `Arc`; start-up and `PUT /v1/pools` write.
#[derive(Debug, Default)]
pub struct Pools {
    map: RwLock<BTreeMap<PoolKey, Arc<Pool>>>,
}

impl Pools {
    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<PoolKey, Arc<Pool>>> {
        // The map is replaced entry by entry; a poisoned lock is still consistent.
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A pool by key.
    pub fn get(&self, key: &PoolKey) -> Option<Arc<Pool>> {
        self.read().get(key).cloned()
    }

    /// All pools, sorted by key.
    pub fn all(&self) -> Vec<Arc<Pool>> {
        self.read().values().cloned().collect()
    }

    /// Every pool's info row, sorted by key.
    pub fn infos(&self) -> Vec<PoolInfo> {
        self.all().iter().map(|p| p.info()).collect()
    }

    /// Adds (or replaces) a pool.
    pub fn insert(&self, pool: Arc<Pool>) {
        self.map.write().unwrap_or_else(|p| p.into_inner()).insert(pool.key.clone(), pool);
    }

    /// Removes every pool whose key is not in `keep`; returns them (the caller retires them).
    pub fn remove_others(&self, keep: &HashSet<&PoolKey>) -> Vec<Arc<Pool>> {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<PoolKey> = map.keys().filter(|k| !keep.contains(k)).cloned().collect();
        gone.iter().filter_map(|k| map.remove(k)).collect()
    }

    /// Wakes every refill task.
    pub fn kick_all(&self) {
        for p in self.all() {
            p.kick();
        }
    }

    /// Wakes the refill tasks of pools the node budget stopped short (room was freed).
    pub fn kick_budget_blocked(&self) {
        for p in self.all() {
            if p.lock().budget_blocked.is_some() {
                p.kick();
            }
        }
    }
}

impl PoolState {
    /// Records a refill success.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.backoff = Duration::ZERO;
        self.backoff_until = None;
        self.at_capacity = None;
    }

    /// Records a refill failure; from [`BACKOFF_AFTER`] in a row, backs off 250 ms doubling to 30 s
    /// and reports the pool at capacity with `reason`.
    pub fn failed(&mut self, reason: String, now: Instant) {
        self.failures = self.failures.saturating_add(1);
        if self.failures >= BACKOFF_AFTER {
            self.backoff = if self.backoff.is_zero() { BACKOFF_MIN } else { (self.backoff * 2).min(BACKOFF_MAX) };
            self.backoff_until = Some(now + self.backoff);
            self.at_capacity = Some(reason);
        }
    }

    /// Parks the pool for `wait` with `reason` (a condition retrying cannot fix soon).
    pub fn park(&mut self, reason: String, now: Instant, wait: Duration) {
        self.backoff_until = Some(now + wait);
        self.at_capacity = Some(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_starts_after_eight_and_doubles_to_thirty_seconds() {
        let mut s = PoolState::default();
        let now = Instant::now();
        for _ in 0..7 {
            s.failed("boom".into(), now);
        }
        assert_eq!((s.backoff, s.backoff_until, s.at_capacity.as_deref()), (Duration::ZERO, None, None));
        s.failed("boom".into(), now);
        assert_eq!(s.backoff, BACKOFF_MIN);
        assert_eq!(s.backoff_until, Some(now + BACKOFF_MIN));
        assert_eq!(s.at_capacity.as_deref(), Some("boom"));
        let mut seen = vec![s.backoff];
        for _ in 0..10 {
            s.failed("boom".into(), now);
            seen.push(s.backoff);
        }
        assert_eq!(seen[1], Duration::from_millis(500));
        assert_eq!(*seen.last().expect("some"), BACKOFF_MAX);
        s.succeeded();
        assert_eq!((s.failures, s.backoff, s.at_capacity.as_deref()), (0, Duration::ZERO, None));
    }
}

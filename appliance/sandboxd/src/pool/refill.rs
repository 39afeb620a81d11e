//! The refill task of one pool.
//!
//! Every tick (2 s) and on every kick (after each claim), [`step`] reserves slots for the
//! deficit `target − warm − refilling` and spawns one job per slot, each bounded by the node's
//! refill semaphore:
//! - golden: the first time (clone enabled, no golden yet) a single job cold-boots
//!   `sbx-gb-<hash>`, waits for silkd, snapshots it into `goldens/<hash>.staging-*`, destroys it and
//!   renames the staging dir to `goldens/<hash>`. A failure retries after 30 s; meanwhile slots
//!   cold-boot;
//! - clone: `restore` from the golden, probe silkd (5 s); three clone failures in a row drop the
//!   golden (it is rebuilt); a failed clone falls back to a cold boot in the same slot;
//! - cold: boot from the catalog template, probe silkd (`boot_timeout_secs`).
//!
//! A VM enters the pool only after silkd answers `info`. Failures back off (see
//! [`super::PoolState::failed`]); a template missing from the catalog parks the pool and reports it.
//!
//! Budget: each slot (and the golden build) holds a [`Reservation`] of the node budget from
//! before its first VM operation to its end; a VM admitted to the pool keeps its share. When
//! the budget has no room for the whole deficit, the pool gets what fits and reports
//! `at_capacity` with the reason until a later step is granted in full.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tracing::Instrument as _;
use vmm::{AfterSnapshot, BootSpec, Snapshot, Vm, VmId};

use super::Pool;
use crate::limits::Reservation;
use crate::metrics::inc;
use crate::node::{goldens_dir, Node};

/// Clone failures in a row after which the golden is dropped and rebuilt.
const CLONE_FAILURES_TO_REBUILD: u32 = 3;

/// Why a slot failed.
#[derive(Debug, thiserror::Error)]
pub enum RefillError {
    /// The template is not in the catalog (parks the pool).
    #[error("template {template:?} is not in the image catalog")]
    Catalog {
        /// The template.
        template: String,
        /// The cause.
        #[source]
        source: vmm::CatalogError,
    },
    /// A driver operation failed.
    #[error("{what}")]
    Driver {
        /// What we were doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: vmm::DriverError,
    },
    /// Moving the golden into place failed.
    #[error("{what} {path}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The path.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

enum Tier {
    Clone,
    Cold,
}

/// The refill loop: runs until the pool is retired or the node stops.
pub async fn run(node: Arc<Node>, pool: Arc<Pool>) {
    let mut tick = tokio::time::interval(node.timing.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = pool.cancel.cancelled() => return,
            _ = tick.tick() => {}
            () = pool.kick.notified() => {}
        }
        step(&node, &pool);
    }
}

enum Plan {
    Golden(Reservation),
    Slots(Vec<Reservation>, Option<Box<Snapshot>>),
}

/// Reserves and spawns the work the pool needs now.
pub fn step(node: &Arc<Node>, pool: &Arc<Pool>) {
    if !node.reconciled() || node.draining() {
        return;
    }
    let now = Instant::now();
    let disk = crate::node::disk_mib(&node.catalog, pool.key.template());
    let plan = {
        let mut s = pool.lock();
        if s.retired || s.backoff_until.is_some_and(|t| now < t) {
            return;
        }
        let deficit = s.target.saturating_sub(s.warm.len() + s.refilling);
        if deficit == 0 {
            s.budget_blocked = None;
            return;
        }
        let golden_first = node.clone_enabled
            && s.golden.is_none()
            && !s.golden_building
            && s.golden_retry_at.is_none_or(|t| now >= t);
        if node.clone_enabled && s.golden.is_none() && s.golden_building {
            return;
        }
        let (granted, short) = node.ledger.reserve(if golden_first { 1 } else { deficit }, pool.key.size(), disk);
        if let Some(why) = &short {
            inc(&node.metrics.refill_budget_blocked);
            if s.budget_blocked.as_deref() != Some(why.as_str()) {
                tracing::warn!(reason = %why, granted = granted.len(), deficit, "refill stopped at the node budget");
            }
        }
        s.budget_blocked = short;
        if golden_first {
            let Some(reservation) = granted.into_iter().next() else { return };
            s.golden_building = true;
            Plan::Golden(reservation)
        } else if granted.is_empty() {
            return;
        } else {
            s.refilling += granted.len();
            Plan::Slots(granted, s.golden.clone().filter(|_| node.clone_enabled).map(Box::new))
        }
    };
    match plan {
        Plan::Golden(reservation) => {
            let (n, p) = (Arc::clone(node), Arc::clone(pool));
            let span = tracing::info_span!("golden", template = %pool.key.template(), hash = %pool.hash);
            tokio::spawn(async move { build_golden(n, p, reservation).await }.instrument(span));
        }
        Plan::Slots(granted, golden) => {
            for reservation in granted {
                let (n, p, g) = (Arc::clone(node), Arc::clone(pool), golden.clone());
                let span = tracing::info_span!("fill", template = %pool.key.template(), vm = tracing::field::Empty);
                tokio::spawn(async move { slot(n, p, g, reservation).await }.instrument(span));
            }
        }
    }
}

async fn slot(node: Arc<Node>, pool: Arc<Pool>, golden: Option<Box<Snapshot>>, reservation: Reservation) {
    let work = async {
        let Ok(_permit) = Arc::clone(&node.refill_sem).acquire_owned().await else {
            return None;
        };
        if let Some(g) = &golden {
            match clone_one(&node, &pool, g).await {
                Ok(vm) => {
                    pool.lock().clone_failures = 0;
                    return Some(Ok((vm, Tier::Clone)));
                }
                Err(e) => {
                    tracing::warn!(error = %vmm::error_chain(&e), "clone failed; cold-booting instead");
                    clone_failed(&node, &pool);
                }
            }
        }
        Some(cold_one(&node, &pool).await.map(|vm| (vm, Tier::Cold)))
    };
    let outcome = tokio::select! {
        () = pool.cancel.cancelled() => None,
        r = work => r,
    };
    let mut doomed = None;
    let mut reservation = Some(reservation);
    {
        let mut s = pool.lock();
        s.refilling = s.refilling.saturating_sub(1);
        match outcome {
            None => {}
            Some(Ok((vm, tier))) => {
                tracing::Span::current().record("vm", vm.id.as_str());
                if s.retired || node.draining() || s.warm.len() >= s.target {
                    doomed = Some(vm);
                } else {
                    tracing::info!(vm = %vm.id, "warm VM ready");
                    if let Some(r) = reservation.take() {
                        r.admit(&vm.id);
                    }
                    s.warm.push(vm);
                    s.succeeded();
                    inc(match tier {
                        Tier::Clone => &node.metrics.refill_clone,
                        Tier::Cold => &node.metrics.refill_cold,
                    });
                }
            }
            Some(Err(e)) => {
                inc(&node.metrics.refill_failures);
                let reason = vmm::error_chain(&e);
                tracing::warn!(error = %reason, "refill failed");
                match e {
                    RefillError::Catalog { .. } => s.park(reason, Instant::now(), node.timing.park),
                    _ => s.failed(reason, Instant::now()),
                }
            }
        }
    }
    if let Some(vm) = doomed {
        node.destroy(&vm).await;
    }
    // A slot that admitted nothing frees its share of the budget only now, after its VM (if
    // any) is destroyed.
    drop(reservation);
}

fn clone_failed(node: &Node, pool: &Pool) {
    let drop_golden = {
        let mut s = pool.lock();
        s.clone_failures += 1;
        if s.clone_failures >= CLONE_FAILURES_TO_REBUILD && s.golden.is_some() {
            s.golden = None;
            s.clone_failures = 0;
            s.golden_retry_at = Some(Instant::now() + node.timing.golden_retry);
            true
        } else {
            false
        }
    };
    if drop_golden {
        let dir = goldens_dir(node.journal.dir()).join(&pool.hash);
        tracing::warn!(golden = %dir.display(), "clones keep failing; dropping the golden");
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn spec_for(node: &Node, pool: &Pool, id_prefix: String) -> Result<BootSpec, RefillError> {
    let mut spec = BootSpec::from_template(&node.catalog, pool.key.template(), pool.key.size())
        .map_err(|source| RefillError::Catalog { template: pool.key.template().to_string(), source })?;
    // The driver names a booted VM `<spec.name>-<8 hex>`: this gives our VMs the `sbx-` prefix
    // the restart sweep relies on.
    spec.name = id_prefix;
    Ok(spec)
}

fn vm_prefix(pool: &Pool) -> String {
    format!("sbx-{}", &pool.hash[..12])
}

async fn probe(node: &Node, vm: Vm, budget: std::time::Duration) -> Result<Vm, RefillError> {
    match node.driver.wait_agent(&vm, budget).await {
        Ok(_) => Ok(vm),
        Err(source) => {
            node.destroy(&vm).await;
            Err(RefillError::Driver { what: "waiting for silkd", source })
        }
    }
}

async fn clone_one(node: &Node, pool: &Pool, golden: &Snapshot) -> Result<Vm, RefillError> {
    let id = VmId::generate(&vm_prefix(pool));
    let vm = node
        .driver
        .restore(golden, &id)
        .await
        .map_err(|source| RefillError::Driver { what: "cloning the golden", source })?;
    probe(node, vm, node.timing.clone_probe).await
}

async fn cold_one(node: &Node, pool: &Pool) -> Result<Vm, RefillError> {
    let spec = spec_for(node, pool, vm_prefix(pool))?;
    let vm = node.driver.boot(&spec).await.map_err(|source| RefillError::Driver { what: "cold boot", source })?;
    probe(node, vm, node.timing.cold_probe).await
}

async fn build_golden(node: Arc<Node>, pool: Arc<Pool>, reservation: Reservation) {
    let permit = Arc::clone(&node.refill_sem).acquire_owned().await;
    let result = tokio::select! {
        () = pool.cancel.cancelled() => None,
        r = golden_inner(&node, &pool) => Some(r),
    };
    drop(permit);
    // The golden builder VM is destroyed by now.
    drop(reservation);
    {
        let mut s = pool.lock();
        s.golden_building = false;
        match result {
            None => {}
            Some(Ok(snap)) => {
                inc(&node.metrics.goldens_built);
                tracing::info!(golden = %snap.dir.display(), "golden snapshot ready");
                s.golden = Some(snap);
                s.golden_retry_at = None;
                s.clone_failures = 0;
            }
            Some(Err(e)) => {
                inc(&node.metrics.golden_failures);
                let reason = vmm::error_chain(&e);
                tracing::warn!(error = %reason, "golden build failed; cold boots until the retry");
                s.golden_retry_at = Some(Instant::now() + node.timing.golden_retry);
                match e {
                    RefillError::Catalog { .. } => s.park(reason, Instant::now(), node.timing.park),
                    _ => s.failed(reason, Instant::now()),
                }
            }
        }
    }
    pool.kick();
}

async fn golden_inner(node: &Node, pool: &Pool) -> Result<Snapshot, RefillError> {
    let spec = spec_for(node, pool, format!("sbx-gb-{}", pool.hash))?;
    let vm =
        node.driver.boot(&spec).await.map_err(|source| RefillError::Driver { what: "booting the golden", source })?;
    let vm = probe(node, vm, node.timing.cold_probe).await?;
    let goldens = goldens_dir(node.journal.dir());
    let staging = goldens.join(format!("{}.staging-{:016x}", pool.hash, rand::random::<u64>()));
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| RefillError::Io { what, path, source }
    };
    let made = async {
        std::fs::create_dir_all(&goldens).map_err(io("creating", &goldens))?;
        node.driver
            .snapshot(&vm, &staging, AfterSnapshot::Paused)
            .await
            .map_err(|source| RefillError::Driver { what: "snapshotting the golden", source })
    }
    .await;
    node.destroy(&vm).await;
    let snap = match made {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    let fin = goldens.join(&pool.hash);
    if fin.exists() {
        std::fs::remove_dir_all(&fin).map_err(io("removing the old golden", &fin))?;
    }
    if let Err(e) = std::fs::rename(&staging, &fin) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(io("moving the golden into place", &fin)(e));
    }
    Ok(rebase(snap, &fin))
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

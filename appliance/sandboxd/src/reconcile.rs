//! The restart reconcile: make the journal and the hypervisors agree, then let refill start.
//!
//! Expected flow ([`reconcile`]), on `vmm::owned`: list the driver's VMs ([`Listing`]);
//! re-adopt each journaled claim whose VM is listed ([`owned::adopt`]: attach), drop the claims
//! whose VM is gone or half-created; put the paused warm VMs of the previous run back into their
//! pools ([`rewarm`]); destroy every `sbx-` VM no claim or pool names (the
//! [`OWNERSHIP`] sweep); release the network leases no listed VM holds; prune the records
//! of VMs that died on their own; then mark the node reconciled ([`Refill::mark_reconciled`]),
//! which wakes every pool.
//!
//! Guarantees: nothing is destroyed on ambiguity. A failed `list` returns the error and changes
//! nothing; it is retried in the background ([`retry`]), never read as empty, and refill (whose
//! new VMs could be mistaken for unowned ones) waits until a reconcile succeeds.

use std::collections::HashSet;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use vmm::owned::{self, Listing};
use vmm::{DriverError, VmId};

use crate::metrics::inc;
use crate::refill::Refill;
use crate::store::ClaimStore;
use crate::vms::{Vms, OWNERSHIP};

/// What a reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Journaled claims re-attached.
    pub adopted: usize,
    /// Journaled claims whose VM was gone.
    pub dropped: usize,
    /// Paused warm VMs of a previous run put back into their pools.
    pub rewarmed: usize,
    /// Unowned `sbx-` VMs destroyed.
    pub destroyed: usize,
    /// Network leases (and TAPs) of VMs that no longer exist, released.
    pub leases_released: usize,
}

/// Retries [`reconcile`] every `reconcile_retry` until one succeeds or `cancel`.
pub async fn retry(store: Arc<ClaimStore>, refill: Arc<Refill>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(refill.timing.reconcile_retry) => {}
        }
        match reconcile(&store, &refill).await {
            Ok(_) => return,
            Err(e) => tracing::warn!(error = %vmm::error_chain(&e), "reconcile: listing VMs failed again"),
        }
    }
}

/// Restart reconcile: re-adopt journaled claims whose VM lives, drop rows whose VM is gone,
/// destroy every `sbx-` VM no claim or pool names, then let refill start.
/// A failed `list` returns the error and changes nothing.
pub async fn reconcile(store: &ClaimStore, refill: &Refill) -> Result<ReconcileReport, DriverError> {
    let vms = &refill.vms;
    let span = tracing::info_span!("reconcile");
    async {
        let listing = Listing::of(vms.driver.as_ref()).await?;
        let mut report = ReconcileReport::default();
        resolve_intents(store, vms, &listing).await;
        // A hibernated claim has no VM to adopt (the one its record names, if still listed,
        // is swept below).
        let pending: Vec<(String, VmId)> = store
            .lock()
            .iter()
            .filter(|c| c.vm.is_none() && c.rec.hibernate_snap.is_none())
            .map(|c| (c.rec.id.clone(), c.rec.vm.clone()))
            .collect();
        let adoption = owned::adopt(vms.driver.as_ref(), &listing, pending).await;
        let mut last_gen = None;
        for (id, vm) in adoption.attached {
            // A crash in the middle of a fork, a checkpoint or a hibernate may have left the VM
            // paused by its snapshot: it runs on.
            if let Err(e) = vms.driver.resume(&vm).await {
                tracing::warn!(claim = %id, vm = %vm.id, error = %vmm::error_chain(&e), "resuming a re-adopted VM failed");
            }
            tracing::info!(claim = %id, vm = %vm.id, "re-adopted");
            store.lock().set_vm(&id, vm);
            report.adopted += 1;
        }
        // A claim only ever takes a VM that finished booting; a half-created one under a
        // claimed id is not that VM, so the claim cannot be honoured.
        for (id, listed) in adoption.half_created {
            tracing::warn!(claim = %id, vm = %listed.id, "claimed VM is half-created; dropping the claim");
            if let Some((_, gen)) = store.lock().remove(&id) {
                last_gen = Some(gen);
            }
            vms.destroy(&listed).await;
            report.dropped += 1;
        }
        for (id, vm_id) in adoption.gone {
            tracing::info!(claim = %id, vm = %vm_id, "VM gone; dropping the claim");
            if let Some((_, gen)) = store.lock().remove(&id) {
                last_gen = Some(gen);
            }
            vms.ledger.forget(&vm_id);
            report.dropped += 1;
        }
        if let Some(gen) = last_gen {
            if let Err(e) = store.commit(gen) {
                tracing::warn!(error = %vmm::error_chain(&e), "journaling dropped claims failed");
            }
        }
        let mut named: HashSet<VmId> =
            store.lock().iter().filter(|c| c.rec.hibernate_snap.is_none()).map(|c| c.rec.vm.clone()).collect();
        report.rewarmed = rewarm(refill, &listing, &named).await;
        for p in vms.pools.all() {
            named.extend(p.warm_ids());
        }
        let swept = OWNERSHIP.sweep(&listing, |vm| named.contains(&vm.id), vms.as_ref()).await;
        report.destroyed = swept.len();
        // Destroyed VMs gave their leases back; leases of VMs gone while we were down go now.
        report.leases_released = sweep_leases(vms, &listing).await;
        // Half-created VMs are listed (state `creating`) and were destroyed above when
        // unowned; records of VMs that died on their own are removed here.
        if let Err(e) = vms.driver.prune().await {
            tracing::warn!(error = %vmm::error_chain(&e), "pruning dead VM records failed");
        }
        refill.mark_reconciled();
        tracing::info!(
            adopted = report.adopted,
            rewarmed = report.rewarmed,
            dropped = report.dropped,
            destroyed = report.destroyed,
            leases_released = report.leases_released,
            "reconciled"
        );
        Ok(report)
    }
    .instrument(span)
    .await
}

/// Puts the warm VMs of a previous run back into their pools, so a restart does not throw the
/// pool away: an unclaimed, listed VM named like a pool's VMs, booted from the image that pool
/// boots now (same lane), and paused, which only a VM refill admitted is (one a claim was
/// resuming, or refill had not finished, runs, and is swept), up to the pool's target. Each is
/// re-attached and woken once to open a fresh agent session (the previous run's ended with
/// it; a guest that does not answer within the clone budget is swept), paused again and counted
/// in the budget. Returns how many went back.
async fn rewarm(refill: &Refill, listing: &Listing, claimed: &HashSet<VmId>) -> usize {
    let vms = &refill.vms;
    let mut back = 0;
    for pool in vms.pools.all() {
        let Ok(now) = vmm::BootSpec::from_template(&refill.catalog, pool.key.template(), pool.key.size()) else {
            continue;
        };
        let prefix = format!("{}-", crate::refill::prefix_for(&pool.hash));
        let egress = pool.key.net() == crate::pool::Net::Egress;
        let room = {
            let s = pool.lock();
            s.target.saturating_sub(s.warm.len())
        };
        let mut paused = Vec::new();
        for listed in listing.vms().iter().filter(|v| {
            v.state == vmm::VmState::Running
                && v.id.as_str().starts_with(&prefix)
                && !claimed.contains(&v.id)
                && v.spec.nic.is_some() == egress
                && same_image(&v.spec, &now)
        }) {
            if paused.len() >= room {
                break;
            }
            if matches!(vms.driver.is_paused(listed).await, Ok(true)) {
                paused.push(listed.id.clone());
            }
        }
        let revived = futures::future::join_all(paused.iter().map(|id| revive(refill, id))).await;
        for vm in revived.into_iter().flatten() {
            vms.ledger.hold(&vm.id, pool.key.size(), crate::vms::disk_mib(&refill.catalog, pool.key.template()));
            tracing::info!(vm = %vm.id, template = %pool.key.template(), "a paused warm VM of the previous run is warm again");
            pool.put_back(vm);
            back += 1;
        }
    }
    back
}

/// Re-attaches a paused warm VM, resumes it until its agent answers a new session, and pauses
/// it again; `None` (logged) when any step fails, leaving it to the sweep.
async fn revive(refill: &Refill, id: &VmId) -> Option<vmm::Vm> {
    let driver = &refill.vms.driver;
    let step = async {
        let vm = driver.attach(id).await.map_err(|e| ("re-attaching", e))?;
        driver.resume(&vm).await.map_err(|e| ("resuming", e))?;
        driver.wait_agent(&vm, refill.timing.clone_probe).await.map_err(|e| ("waiting for silkd", e))?;
        driver.pause(&vm).await.map_err(|e| ("pausing", e))?;
        Ok::<_, (&str, DriverError)>(vm)
    };
    match step.await {
        Ok(vm) => Some(vm),
        Err((what, e)) => {
            tracing::warn!(vm = %id, error = %vmm::error_chain(&e), "{what} a paused warm VM of the previous run failed; it is swept");
            None
        }
    }
}

/// Whether a VM booted from `was` runs the image `now` describes (kernel, initrd, disks, command
/// line and size; the name and devices a VM gets of its own are not compared).
fn same_image(was: &vmm::BootSpec, now: &vmm::BootSpec) -> bool {
    (&was.kernel, &was.initrd, &was.rootfs, &was.overlay_base, &was.cmdline, was.size)
        == (&now.kernel, &now.initrd, &now.rootfs, &now.overlay_base, &now.cmdline, now.size)
}

/// Resolves the hibernations a crash interrupted (a claim with `pending_snap`), from what is
/// left: its VM listed → it runs on (resumed: the snapshot may have paused it) and the partial
/// snapshot goes; its VM gone with a complete snapshot → the sandbox is hibernated; neither →
/// the claim is dropped.
async fn resolve_intents(store: &ClaimStore, vms: &Vms, listing: &Listing) {
    let pending: Vec<(String, VmId, std::path::PathBuf)> = store
        .lock()
        .iter()
        .filter_map(|c| c.rec.pending_snap.clone().map(|d| (c.rec.id.clone(), c.rec.vm.clone(), d)))
        .collect();
    for (id, vm_id, dir) in pending {
        let gen = match listing.get(&vm_id) {
            Some(vm) => {
                if let Err(e) = vms.driver.resume(vm).await {
                    tracing::warn!(claim = %id, error = %vmm::error_chain(&e), "resuming the VM of an interrupted hibernate failed");
                }
                let _ = std::fs::remove_dir_all(&dir);
                tracing::warn!(claim = %id, "an interrupted hibernate was undone: the VM runs on");
                store.lock().update(&id, None, |r| r.pending_snap = None)
            }
            None if vmm::Snapshot::load(&dir).is_ok() => {
                tracing::warn!(claim = %id, "an interrupted hibernate was completed from its snapshot");
                store.lock().update(&id, None, |r| {
                    r.pending_snap = None;
                    r.hibernate_snap = Some(dir.clone());
                })
            }
            None => {
                tracing::warn!(claim = %id, "an interrupted hibernate left neither the VM nor a snapshot; dropping the claim");
                let _ = std::fs::remove_dir_all(&dir);
                store.lock().remove(&id).map(|(_, g)| g)
            }
        };
        if let Some(gen) = gen {
            if let Err(e) = store.commit(gen) {
                tracing::warn!(claim = %id, error = %vmm::error_chain(&e), "journaling a resolved hibernate failed");
            }
        }
    }
}

/// Releases every lease (and deletes its TAP) that no listed VM holds: leftovers of VMs
/// destroyed or half-made while sandboxd was down. A lease whose TAP a listed VM names
/// (alive, creating, or one whose kill failed) is kept.
async fn sweep_leases(vms: &Vms, listing: &Listing) -> usize {
    let Some(net) = &vms.net else { return 0 };
    let held: HashSet<&str> =
        listing.vms().iter().filter_map(|v| v.spec.nic.as_ref()).map(|n| n.tap.as_str()).collect();
    let leases = match net.leases() {
        Ok(l) => l,
        Err(e) => {
            inc(&vms.metrics.network_failures);
            tracing::warn!(error = %vmm::error_chain(&e), "reading the leases failed; none released");
            return 0;
        }
    };
    let mut released = 0;
    for (key, lease) in leases {
        if held.contains(lease.tap.as_str()) {
            continue;
        }
        tracing::info!(lease = %key, tap = %lease.tap, ip = %lease.ip, "releasing the lease of a VM that is gone");
        if let Err(e) = net.delete_tap(&lease.tap).await {
            inc(&vms.metrics.network_failures);
            tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "deleting a stale TAP failed");
        }
        match net.release(&key) {
            Ok(_) => released += 1,
            Err(e) => {
                inc(&vms.metrics.network_failures);
                tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "releasing a stale lease failed");
            }
        }
    }
    released
}

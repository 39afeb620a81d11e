//! What the node's VMs run on, shared by every job that makes or ends one (refill, release,
//! the reaper, drain, the restart reconcile): the [`vmm::Driver`], the VM network of egress
//! pools, the budget [`Ledger`], the counters and the pools (to wake the ones the budget
//! stopped).
//!
//! Guarantees of [`Vms::destroy`]:
//! - a VM leaves the budget only once it is gone: a failed kill keeps it counted (it may still
//!   run);
//! - its TAP and lease are given back only once its hypervisor is gone;
//! - pools waiting on the budget are woken when room is freed.

use std::sync::Arc;

use tracing::Instrument as _;
use vmm::owned::Ownership;
use vmm::{Catalog, Driver, Vm, VmId};

use crate::claims::Claim;
use crate::limits::Ledger;
use crate::metrics::{inc, Metrics};
use crate::pool::Pools;

/// The VMs sandboxd owns: every id it makes starts with `sbx-` (pool VMs, goldens); the
/// restart reconcile destroys the ones nothing names.
pub const OWNERSHIP: Ownership = Ownership::new("sbx-");

/// The driver, the VM network, the budget ledger, the counters and the pools.
pub struct Vms {
    /// The hypervisor driver.
    pub driver: Arc<dyn Driver>,
    /// The VM network of egress pools (bridge, leases, TAPs, packet filter).
    pub net: Option<vmnet::Network>,
    /// What warm + refilling + claimed VMs hold of the budget.
    pub ledger: Arc<Ledger>,
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The pools.
    pub pools: Arc<Pools>,
}

impl std::fmt::Debug for Vms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vms").field("backend", &self.driver.backend()).finish_non_exhaustive()
    }
}

impl Vms {
    /// Whether `net: egress` is available (a network with an uplink).
    pub fn egress(&self) -> bool {
        self.net.as_ref().is_some_and(|n| n.config().filter.uplink.is_some())
    }

    /// Destroys a VM (kill), counting the outcome. Once it is gone it leaves the budget (a
    /// failed kill keeps it counted: it may still run) and pools waiting on the budget are woken.
    /// A VM with a NIC gives its TAP and lease back once it is gone.
    pub async fn destroy(&self, vm: &Vm) {
        match self.driver.kill(vm).await {
            Ok(()) => {
                inc(&self.metrics.vms_destroyed);
                if let Some(nic) = &vm.spec.nic {
                    self.release_nic(&vm.id, &nic.tap).await;
                }
                self.ledger.forget(&vm.id);
                self.pools.kick_budget_blocked();
            }
            Err(e) => {
                inc(&self.metrics.destroy_failures);
                tracing::warn!(vm = %vm.id, error = %vmm::error_chain(&e), "destroying VM failed; it stays counted against the budget");
            }
        }
    }

    /// Destroys every VM of `vms`, one after the other.
    pub async fn destroy_all(&self, vms: Vec<Vm>) {
        for vm in vms {
            self.destroy(&vm).await;
        }
    }

    /// Destroys the VM of an ended claim; one not attached yet (`list` failed at start) is left
    /// to the next successful reconcile's sweep.
    pub async fn destroy_claim_vm(&self, claim: &Claim) {
        match &claim.vm {
            Some(vm) => self.destroy(vm).await,
            // Hibernated: no VM; its snapshot goes with the snapshot gc.
            None if claim.rec.hibernate_snap.is_some() => {}
            None => tracing::warn!(vm = %claim.rec.vm, "VM not attached; left to the reconcile sweep"),
        }
    }

    /// Deletes TAP `tap` and releases the lease holding it (best effort: logged and counted).
    /// Only for a VM whose hypervisor is gone, or that never started.
    pub async fn release_nic(&self, vm: &VmId, tap: &str) {
        let Some(net) = &self.net else { return };
        let span = tracing::info_span!("release_nic", vm = %vm, tap);
        async {
            if let Err(e) = net.delete_tap(tap).await {
                inc(&self.metrics.network_failures);
                tracing::warn!(error = %vmm::error_chain(&e), "deleting the TAP failed");
            }
            let key = match net.leases() {
                Ok(all) => all.into_iter().find(|(_, l)| l.tap == tap).map(|(k, _)| k),
                Err(e) => {
                    inc(&self.metrics.network_failures);
                    tracing::warn!(error = %vmm::error_chain(&e), "reading the leases failed; the lease stays until the next start");
                    return;
                }
            };
            if let Some(key) = key {
                match net.release(&key) {
                    Ok(_) => tracing::debug!(lease = %key, "lease released"),
                    Err(e) => {
                        inc(&self.metrics.network_failures);
                        tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "releasing the lease failed");
                    }
                }
            }
        }
        .instrument(span)
        .await;
    }
}

/// The restart reconcile's sweep ends a VM as every other job does: [`Vms::destroy`].
#[async_trait::async_trait]
impl vmm::owned::Destroy for Vms {
    async fn destroy(&self, vm: &Vm) {
        Vms::destroy(self, vm).await;
    }
}

/// The most host disk a VM of `template` can fill (its overlay's worst case), MiB, as the
/// ledger counts it. A template that is not in the catalog or whose overlay image cannot be
/// read counts 0: no VM of it can boot either.
pub fn disk_mib(catalog: &Catalog, template: &str) -> u64 {
    let Ok((_, t)) = catalog.resolve(template) else { return 0 };
    match &t.overlay_base {
        Some(base) => vmm::disk::overlay_cap(base).map(vmm::disk::mib_ceil).unwrap_or_else(|e| {
            tracing::warn!(template, overlay = %base.display(), error = %e, "cannot size the template's overlay image");
            0
        }),
        None => 0,
    }
}

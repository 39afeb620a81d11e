//! VM ownership, once for every service that keeps VMs through a [`Driver`] (sandboxd's pools and
//! claims, vk-cocoon's Pods).
//!
//! - [`Ownership`]: which driver VMs are a service's — an id prefix (`sbx-`, `vc-`) — and the
//!   instance rule: a driver VM `<owner>-<8 hex>` (what [`VmId::generate`] makes of the owner's
//!   id) belongs to `<owner>` ([`Ownership::owner_of`]), so a VM maps back to its owner even
//!   when a crash came between its boot and its record;
//! - [`Listing`]: one successful [`Driver::list`]. There is no empty default and no other way
//!   to make one, so a failed listing can only be an error, never "no VMs";
//! - [`adopt`]: after a restart, re-attach the wanted VMs that live and report the gone ones
//!   and the half-created ones;
//! - [`Ownership::orphans`] / [`Ownership::sweep`]: the listed VMs of the prefix that nothing
//!   names, and their destruction;
//! - [`records`]: a durable per-VM record store (`<dir>/<id>.json`) generic over the
//!   service's own metadata, with an exclusive claim.
//!
//! Architecture invariant: no VM is destroyed on ambiguity. Everything that destroys works on a
//! [`Listing`], and only VMs of the service's prefix that no record, claim or pool names go.

pub mod records;

use async_trait::async_trait;

use crate::driver::{Driver, DriverError, Vm, VmId, VmState};

pub use records::{OwnedRecord, RecordState, RecordStore, RecordStoreError};

/// Which driver VMs belong to a service: those whose id starts with its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ownership {
    prefix: &'static str,
}

impl Ownership {
    /// The VMs whose id starts with `prefix` (`"sbx-"`, `"vc-"`).
    pub const fn new(prefix: &'static str) -> Ownership {
        Ownership { prefix }
    }

    /// The prefix.
    pub fn prefix(&self) -> &'static str {
        self.prefix
    }

    /// Whether the driver VM `id` is ours.
    pub fn owns(&self, id: &str) -> bool {
        id.starts_with(self.prefix)
    }

    /// The owner of the driver VM `vmm_id` (`<owner>-<8 hex>` → `<owner>`), if it is ours and
    /// an instance id.
    pub fn owner_of<'a>(&self, vmm_id: &'a str) -> Option<&'a str> {
        let (owner, suffix) = vmm_id.rsplit_once('-')?;
        (self.owns(owner)
            && suffix.len() == 8
            && suffix.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then_some(owner)
    }

    /// Whether the driver VM `vm` is an instance of `owner`, whose current instance is `current`:
    /// the current instance itself, any `<owner>-<8 hex>`, or a VM named `owner` exactly.
    pub fn is_instance(&self, vm: &VmId, owner: &str, current: Option<&VmId>) -> bool {
        current == Some(vm) || self.owner_of(vm.as_str()) == Some(owner) || vm.as_str() == owner
    }

    /// The listed instances of `owner` ([`Ownership::is_instance`]).
    pub fn instances<'a>(&self, listing: &'a Listing, owner: &str, current: Option<&VmId>) -> Vec<&'a Vm> {
        listing.vms.iter().filter(|v| self.is_instance(&v.id, owner, current)).collect()
    }

    /// The listed VMs of our prefix that `named` does not name.
    pub fn orphans<'a>(&self, listing: &'a Listing, named: impl Fn(&Vm) -> bool) -> Vec<&'a Vm> {
        listing.vms.iter().filter(|v| self.owns(v.id.as_str()) && !named(v)).collect()
    }

    /// Destroys every [orphan](Ownership::orphans) with `destroyer` (the driver's [`Kill`], or
    /// a service's own destroy that also gives back what the VM held) and returns their ids.
    pub async fn sweep(&self, listing: &Listing, named: impl Fn(&Vm) -> bool, destroyer: &dyn Destroy) -> Vec<VmId> {
        let mut swept = Vec::new();
        for vm in self.orphans(listing, named) {
            tracing::info!(vm = %vm.id, prefix = self.prefix, "destroying an unowned VM");
            destroyer.destroy(vm).await;
            swept.push(vm.id.clone());
        }
        swept
    }
}

/// How [`Ownership::sweep`] ends a VM; failures are the implementation's to log and count.
#[async_trait]
pub trait Destroy: Send + Sync {
    /// Ends `vm` (best effort).
    async fn destroy(&self, vm: &Vm);
}

/// Destroys through the driver alone: [`Driver::kill`], a failure logged.
pub struct Kill<'a>(pub &'a dyn Driver);

#[async_trait]
impl Destroy for Kill<'_> {
    async fn destroy(&self, vm: &Vm) {
        if let Err(e) = self.0.kill(vm).await {
            tracing::warn!(vm = %vm.id, error = %crate::error_chain(&e), "destroying an unowned VM failed");
        }
    }
}

/// The VMs of one successful [`Driver::list`].
#[derive(Debug, Clone)]
pub struct Listing {
    vms: Vec<Vm>,
}

impl Listing {
    /// Lists `driver`'s VMs; a failed listing is the error, never an empty listing.
    pub async fn of(driver: &dyn Driver) -> Result<Listing, DriverError> {
        Ok(Listing { vms: driver.list().await? })
    }

    /// The listed VMs.
    pub fn vms(&self) -> &[Vm] {
        &self.vms
    }

    /// The listed VM `id`.
    pub fn get(&self, id: &VmId) -> Option<&Vm> {
        self.vms.iter().find(|v| &v.id == id)
    }
}

/// What [`adopt`] found of the wanted VMs, each with the caller's key.
#[derive(Debug)]
pub struct Adoption<K> {
    /// Listed and running: re-attached (or, when attaching failed, the listed record).
    pub attached: Vec<(K, Vm)>,
    /// Listed but half-created: not the VM that was wanted (a claim only takes a VM that
    /// finished booting); the caller destroys it.
    pub half_created: Vec<(K, Vm)>,
    /// Not listed: the VM is gone.
    pub gone: Vec<(K, VmId)>,
}

/// Re-adopts the `wanted` VMs (`(key, id)`) of `listing` after a restart: each listed running
/// VM is re-attached ([`Driver::attach`]; a failed attach keeps the listed record, logged).
pub async fn adopt<K>(driver: &dyn Driver, listing: &Listing, wanted: Vec<(K, VmId)>) -> Adoption<K> {
    let mut out = Adoption { attached: Vec::new(), half_created: Vec::new(), gone: Vec::new() };
    for (key, id) in wanted {
        match listing.get(&id) {
            Some(listed) if listed.state == VmState::Creating => out.half_created.push((key, listed.clone())),
            Some(listed) => {
                let vm = match driver.attach(&id).await {
                    Ok(vm) => vm,
                    Err(e) => {
                        tracing::warn!(vm = %id, error = %crate::error_chain(&e), "attach failed; keeping the listed record");
                        listed.clone()
                    }
                };
                out.attached.push((key, vm));
            }
            None => out.gone.push((key, id)),
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;

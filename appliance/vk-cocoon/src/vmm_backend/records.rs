//! The backend's VM records, `<root>/cocoon/<id>.json`, kept by `vmm::owned::RecordStore` with
//! vk-cocoon's own fields ([`CocoonMeta`]) flattened beside the common ones — the same JSON as
//! the records written before the store existed — and the views built on them: `list` /
//! `inspect` (the records joined with the driver's [`Listing`] and the leases), the running
//! instance of a VM ([`VmmBackend::live_vm`]), `start` and `remove`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vmm::owned::{Listing, OwnedRecord, RecordState, RecordStoreError};
use vmm::VmId;
use vmnet::Lease;

use super::identity::OWNERSHIP;
use super::{failed, VmmBackend, VmmBackendError};
use crate::backend::{BackendError, Hypervisor, VmBackend as _, VmInfo, VmState, VmUsage};

/// vk-cocoon's fields of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct CocoonMeta {
    /// The Pod's VM name (the id of a hashed name cannot be read back).
    pub(super) name: String,
    /// The owning namespace; absent in records written before it was recorded.
    #[serde(default)]
    pub(super) namespace: Option<String>,
    pub(super) hypervisor: Hypervisor,
    /// `run <image>` or `clone <snapshot>`.
    pub(super) source: String,
}

/// `<root>/cocoon/<id>.json`.
pub(super) type Record = OwnedRecord<CocoonMeta>;

/// A backend VM id as a driver id (every id [`super::vm_id_for`] makes is one).
fn vm_id(id: &str) -> Result<VmId, BackendError> {
    VmId::new(id).map_err(|e| failed("naming", id.to_owned(), VmmBackendError::Invalid(e.to_string())))
}

impl VmmBackend {
    pub(super) fn load_record(&self, id: &str) -> Result<Option<Record>, BackendError> {
        self.records.load(id).map_err(|e| failed("reading the VM record", id.to_owned(), e))
    }

    pub(super) fn delete_record(&self, id: &str) -> Result<(), BackendError> {
        self.records.delete(id).map_err(|e| failed("deleting the VM record", id.to_owned(), e))
    }

    /// Claims the record of `id` (exclusive create: a second VM of the name is
    /// [`BackendError::NameInUse`]).
    pub(super) fn claim(&self, id: &str, meta: CocoonMeta) -> Result<(), BackendError> {
        let name = meta.name.clone();
        match self.records.claim(&vm_id(id)?, meta) {
            Ok(_) => Ok(()),
            Err(RecordStoreError::InUse { .. }) => {
                let name = self.load_record(id).ok().flatten().map_or(name, |r| r.meta.name);
                Err(BackendError::NameInUse { name, id: id.to_owned() })
            }
            Err(e) => Err(failed("writing the VM record", id.to_owned(), e)),
        }
    }

    /// Records the freshly started `vm` as the current instance of `id`, with the spec it was
    /// booted from (its name set to `id`) for a later cold boot; if that fails, kills it.
    pub(super) async fn complete(&self, id: &str, vm: &vmm::Vm) -> Result<(), BackendError> {
        let mut spec = vm.spec.clone();
        spec.name = id.to_owned();
        let done = vm_id(id).and_then(|vid| {
            self.records.complete(&vid, &vm.id, spec).map_err(|e| match e {
                RecordStoreError::Missing { .. } => BackendError::NotFound { what: format!("record of VM {id}") },
                e => failed("writing the VM record", id.to_owned(), e),
            })
        });
        if let Err(e) = done {
            let _ = self.driver.kill(vm).await;
            return Err(e);
        }
        Ok(())
    }

    pub(super) async fn listing(&self) -> Result<Listing, BackendError> {
        Listing::of(self.driver.as_ref()).await.map_err(|e| failed("listing", "the hypervisors", e))
    }

    fn info(rec: &Record, listing: &Listing, leases: &BTreeMap<String, Lease>) -> VmInfo {
        let inst = OWNERSHIP.instances(listing, rec.id.as_str(), rec.vmm_id.as_ref());
        let state = if inst.iter().any(|v| v.state == vmm::VmState::Running && Some(&v.id) == rec.vmm_id.as_ref()) {
            if rec.state == RecordState::Created {
                VmState::Running
            } else {
                VmState::Creating
            }
        } else if !inst.is_empty() || rec.state == RecordState::Creating {
            VmState::Creating
        } else {
            VmState::Stopped
        };
        VmInfo {
            id: rec.id.to_string(),
            name: rec.meta.name.clone(),
            namespace: rec.meta.namespace.clone(),
            ip: leases.get(rec.id.as_str()).map(|l| l.ip.to_string()),
            state,
            hypervisor: rec.meta.hypervisor,
        }
    }

    pub(super) async fn list_all(&self) -> Result<Vec<VmInfo>, BackendError> {
        let listing = self.listing().await?;
        let records = self
            .records
            .list()
            .map_err(|e| failed("listing VM records", self.records.dir().display().to_string(), e))?;
        let leases = self.net.leases().map_err(|e| failed("reading", "the address leases", e))?;
        let mut out: Vec<VmInfo> = records.iter().map(|r| Self::info(r, &listing, &leases)).collect();
        // Driver VMs of ours without a record: a crash between the hypervisor start and the record.
        let recorded =
            |v: &vmm::Vm| records.iter().any(|r| OWNERSHIP.is_instance(&v.id, r.id.as_str(), r.vmm_id.as_ref()));
        for v in OWNERSHIP.orphans(&listing, recorded) {
            let owner = OWNERSHIP.owner_of(v.id.as_str()).unwrap_or(v.id.as_str());
            if !out.iter().any(|i| i.id == owner) {
                out.push(VmInfo {
                    id: owner.to_owned(),
                    name: String::new(),
                    namespace: None,
                    ip: leases.get(owner).map(|l| l.ip.to_string()),
                    state: VmState::Creating,
                    hypervisor: Hypervisor::Qemu,
                });
            }
        }
        Ok(out)
    }

    /// The running hypervisor of `id`, attached (agent bridge up) in this process.
    pub(super) async fn live_vm(&self, id: &str) -> Result<vmm::Vm, BackendError> {
        let rec = self.load_record(id)?.ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        let listing = self.listing().await?;
        let vm = rec
            .vmm_id
            .as_ref()
            .and_then(|vid| listing.get(vid).filter(|v| v.state == vmm::VmState::Running))
            .cloned()
            .ok_or_else(|| BackendError::NotFound { what: format!("a running hypervisor of VM {id}") })?;
        if !self.lock_attached().contains(&vm.id) {
            let vm = self.driver.attach(&vm.id).await.map_err(|e| failed("re-attaching to", id.to_owned(), e))?;
            self.lock_attached().insert(vm.id.clone());
            return Ok(vm);
        }
        Ok(vm)
    }

    /// What the running VMs among `ids` use: one listing, then each VM's cgroup leaf or
    /// hypervisor process (`vmm::usage`). A VM without a running hypervisor, or one that
    /// cannot be measured, is left out.
    pub(super) async fn measure(&self, ids: &[String]) -> Result<Vec<(String, VmUsage)>, BackendError> {
        let listing = self.listing().await?;
        let reader = vmm::usage::UsageReader::default();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let Ok(Some(rec)) = self.load_record(id) else { continue };
            let Some(vm) =
                rec.vmm_id.as_ref().and_then(|v| listing.get(v)).filter(|v| v.state == vmm::VmState::Running)
            else {
                continue;
            };
            match reader.vm(vm) {
                Ok(u) => out.push((
                    id.clone(),
                    VmUsage {
                        cpu_usage_nanos: u.cpu_usage_nanos,
                        memory_working_set_bytes: u.memory_working_set_bytes,
                        measured_at: u.measured_at,
                        started_at: Some(
                            std::time::UNIX_EPOCH + std::time::Duration::from_secs(vm.created_at_epoch_secs),
                        ),
                    },
                )),
                Err(e) => tracing::debug!(vm = %id, error = %vmm::error_chain(&e), "the VM could not be measured"),
            }
        }
        Ok(out)
    }

    /// `start`: a cold boot of the recorded spec with the VM's own lease (see the module doc).
    pub(super) async fn start_vm(&self, id: &str) -> Result<VmInfo, BackendError> {
        let current = self.inspect(id).await?.ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        match current.state {
            VmState::Running => return Ok(current),
            VmState::Creating => {
                return Err(BackendError::Unsupported {
                    what: format!("VM {id} is still being created; it cannot be started"),
                })
            }
            VmState::Stopped => {}
        }
        let rec = self.load_record(id)?.ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        let mut spec = rec.spec.clone().ok_or_else(|| {
            failed("starting", id.to_owned(), VmmBackendError::Invalid("the record has no boot spec".into()))
        })?;
        let lease = self.network_for(id, None).await?;
        spec.name = id.to_owned();
        spec.nic = Some(self.net.nic_spec(&lease));
        self.prune(id).await;
        let vm = self.driver.boot(&spec).await.map_err(|e| failed("starting (cold boot)", id.to_owned(), e))?;
        self.lock_attached().insert(vm.id.clone());
        self.complete(id, &vm).await?;
        self.await_agent(id, &vm).await?;
        tracing::info!(vm = id, instance = %vm.id, "stopped VM booted again");
        Ok(VmInfo { state: VmState::Running, ip: Some(lease.ip.to_string()), ..current })
    }

    /// `remove`: kills every hypervisor of `id`, deletes its TAP and record (the lease stays).
    pub(super) async fn remove_vm(&self, id: &str) -> Result<(), BackendError> {
        let rec = self.load_record(id)?;
        let listing = self.listing().await?;
        for v in OWNERSHIP.instances(&listing, id, rec.as_ref().and_then(|r| r.vmm_id.as_ref())) {
            self.driver.kill(v).await.map_err(|e| failed("killing the hypervisor of", id.to_owned(), e))?;
            self.lock_attached().remove(&v.id);
        }
        if let Some(lease) = self.net.lookup(id).map_err(|e| failed("reading the lease of", id.to_owned(), e))? {
            self.net.delete_tap(&lease.tap).await.map_err(|e| failed("deleting the TAP of", id.to_owned(), e))?;
        }
        self.prune(id).await;
        self.delete_record(id)?;
        tracing::info!(vm = id, existed = rec.is_some(), "VM removed");
        Ok(())
    }

    /// Removes the directories of dead driver VMs (best effort: logged).
    async fn prune(&self, id: &str) {
        if let Err(e) = self.driver.prune().await {
            tracing::debug!(vm = id, error = %crate::provider::error_chain(&e), "pruning dead VM directories failed");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn records_keep_their_namespace_and_old_records_read_as_none() {
        let old = r#"{"id":"vc-a","name":"a","hypervisor":"qemu","state":"created","source":"run x","created_at_epoch_secs":1}"#;
        let rec: Record = serde_json::from_str(old).unwrap();
        assert_eq!(rec.meta.namespace, None, "a record from before namespaces were recorded");
        assert_eq!(
            (rec.meta.name.as_str(), rec.meta.hypervisor, rec.meta.source.as_str()),
            ("a", Hypervisor::Qemu, "run x")
        );
        let mut new = rec.clone();
        new.meta.namespace = Some("team-a".into());
        let back: Record = serde_json::from_slice(&serde_json::to_vec(&new).unwrap()).unwrap();
        assert_eq!(back.meta.namespace.as_deref(), Some("team-a"));
    }

    #[test]
    fn records_keep_their_json_field_names() {
        // Boxes in the field hold `<root>/cocoon/<id>.json` files with these keys.
        let full = r#"{"id":"vc-a","name":"a","namespace":"ns","hypervisor":"qemu","state":"creating",
            "vmm_id":"vc-a-0a1b2c3d","spec":null,"source":"clone s:1","created_at_epoch_secs":7}"#;
        let rec: Record = serde_json::from_str(full).unwrap();
        assert_eq!((rec.state, rec.vmm_id.as_ref().map(VmId::as_str)), (RecordState::Creating, Some("vc-a-0a1b2c3d")));
        let v = serde_json::to_value(&rec).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["created_at_epoch_secs", "hypervisor", "id", "name", "namespace", "source", "spec", "state", "vmm_id"]
        );
    }
}

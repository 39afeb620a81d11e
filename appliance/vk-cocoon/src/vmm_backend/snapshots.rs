//! Snapshots through the `images` store: `clone_vm` (restore with the clone's own NIC, then a
//! fresh RNG state and the host's time), `snapshot_save`, `snapshot_inspect` (owner and base image), `base_image_of`, `snapshot_rm` and
//! `snapshot_rm_if` (untag only, the latter through `images::Store::remove_if`: content is
//! collected by `collect_garbage`, `library.rs`, or `chrysalis image gc`).

use silkd_client::AgentConn;
use vmm::{AfterSnapshot, RestoreOptions, VmId, AGENT_PORT};
use vmnet::VmPolicy;

use super::{blocking, failed, image_error, running, VmmBackend, VmmBackendError, AGENT_CALL};
use crate::backend::{BackendError, CloneRequest, SnapshotInfo, SnapshotRef, VmInfo};

impl VmmBackend {
    /// Gives a fresh clone its own kernel RNG state (host randomness + a forced CRNG reseed)
    /// and the host's time, before it is handed out: every clone of a snapshot resumes with
    /// the same state and the clock of the moment it was saved. A
    /// snapshot whose agent predates `reseed` is cloned with a warning (re-save it to fix);
    /// any other failure fails the clone.
    pub(super) async fn reseed(&self, id: &str, vm: &vmm::Vm) -> Result<(), BackendError> {
        let op = "reseeding the guest RNG of";
        let exchange = async {
            // The restored guest's agent may take a moment to accept dials again.
            self.driver.wait_agent(vm, AGENT_CALL).await.map_err(|e| failed(op, id.to_owned(), e))?;
            let stream = self.driver.connect(vm, AGENT_PORT).await.map_err(|e| failed(op, id.to_owned(), e))?;
            let mut agent = AgentConn::new(stream);
            match agent.reseed_from_host().await {
                Ok(()) => {
                    // The snapshot's clock stood still since it was saved; best effort.
                    if let Err(e) = agent.set_clock_from_host().await {
                        tracing::warn!(vm = id, error = %e, "the clone's clock was not set");
                    }
                    Ok(())
                }
                Err(silkd_client::ClientError::Agent { kind: silkd_client::ErrorKind::Unimplemented, .. }) => {
                    tracing::warn!(
                        vm = id,
                        "the snapshot's guest agent predates reseed: this clone keeps the snapshot's RNG state \
                         (save the snapshot again with this node's images to fix)"
                    );
                    Ok(())
                }
                Err(e) => Err(failed(op, id.to_owned(), VmmBackendError::Agent(e))),
            }
        };
        tokio::time::timeout(AGENT_CALL, exchange)
            .await
            .map_err(|_| failed(op, id.to_owned(), VmmBackendError::Timeout { what: "reseed", after: AGENT_CALL }))?
    }

    pub(super) async fn clone_inner(
        &self,
        id: &str,
        req: &CloneRequest,
        policy: &VmPolicy,
    ) -> Result<VmInfo, BackendError> {
        let r = req.snapshot.to_string();
        let snap = {
            let (store, name) = (self.store.clone(), r.clone());
            blocking("resolving", &r, move || store.resolve_snapshot(&name)).await?
        }
        .map_err(|e| image_error("resolving", &format!("snapshot {r}"), e))?;
        if snap.snapshot.backend != vmm::Backend::Qemu {
            return Err(BackendError::Unsupported {
                what: format!(
                    "snapshot {r} was written by {}; this node restores qemu snapshots",
                    snap.snapshot.backend
                ),
            });
        }
        if snap.snapshot.spec.nic.is_none() {
            return Err(BackendError::Unsupported {
                what: format!("snapshot {r} has no network interface, so a clone of it could not be reached"),
            });
        }
        let lease = self.network_for(id, Some(policy)).await?;
        let opts = RestoreOptions { nic: Some(self.net.nic_spec(&lease)) };
        let vmm_id = VmId::generate(id);
        let vm = self
            .driver
            .restore_with(&snap.snapshot, &vmm_id, &opts)
            .await
            .map_err(|e| failed("restoring", format!("VM {id} from snapshot {r}"), e))?;
        self.lock_attached().insert(vm.id.clone());
        if let Err(e) = self.reseed(id, &vm).await {
            let _ = self.driver.kill(&vm).await;
            return Err(e);
        }
        self.complete(id, &vm).await?;
        Ok(running(id, &req.name, &req.namespace, &lease, req.hypervisor))
    }

    /// `snapshot_save`: the driver snapshots into a store scratch directory (the VM is
    /// resumed), the store takes the files and names them.
    pub(super) async fn save_snapshot(
        &self,
        id: &str,
        snapshot: &SnapshotRef,
        namespace: &str,
    ) -> Result<(), BackendError> {
        let vm = self.live_vm(id).await?;
        let target = format!("{snapshot} of VM {id}");
        let scratch = {
            let store = self.store.clone();
            blocking("preparing a snapshot of", &target, move || store.scratch_dir()).await?
        }
        .map_err(|e| failed("preparing a snapshot of", target.clone(), e))?;
        let dir = scratch.path().join("vm");
        let t0 = std::time::Instant::now();
        let snap = self
            .driver
            .snapshot(&vm, &dir, AfterSnapshot::Resumed)
            .await
            .map_err(|e| failed("snapshotting", target.clone(), e))?;
        let (store, name, ns) = (self.store.clone(), snapshot.to_string(), namespace.to_owned());
        let digest = blocking("storing", &target, move || {
            let r = store.save_snapshot_moving_for(&name, &snap, Some(&ns));
            drop(scratch);
            r
        })
        .await?
        .map_err(|e| failed("storing", target.clone(), e))?;
        tracing::info!(vm = id, %snapshot, %digest, ms = t0.elapsed().as_millis() as u64, "snapshot saved");
        Ok(())
    }

    /// `snapshot_inspect`: the owner of a stored snapshot (`None`: no such snapshot).
    pub(super) async fn inspect_snapshot(&self, snapshot: &SnapshotRef) -> Result<Option<SnapshotInfo>, BackendError> {
        let (store, r) = (self.store.clone(), snapshot.to_string());
        let target = r.clone();
        blocking("looking up", &target, move || match store.lookup(&r) {
            Ok(d) => store.manifest(&d).map(|m| match m {
                images::Manifest::Snapshot(s) => {
                    Some(SnapshotInfo { namespace: s.namespace, base_image: Some(s.base_image.to_string()) })
                }
                images::Manifest::Image(_) => None,
            }),
            Err(images::ImageError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        })
        .await?
        .map_err(|e| failed("looking up", format!("snapshot {target}"), e))
    }

    /// `base_image_of`: the digest of the image manifest `source` names, or of a snapshot's
    /// base image (`None`: no such name in the library, or not a valid reference).
    pub(super) async fn base_image(&self, source: &str) -> Result<Option<String>, BackendError> {
        let (store, r) = (self.store.clone(), source.to_owned());
        blocking("looking up", source, move || match store.lookup(&r) {
            Ok(d) => store.manifest(&d).map(|m| match m {
                images::Manifest::Image(_) => Some(d.to_string()),
                images::Manifest::Snapshot(s) => Some(s.base_image.to_string()),
            }),
            Err(images::ImageError::NotFound { .. } | images::ImageError::BadRef { .. }) => Ok(None),
            Err(e) => Err(e),
        })
        .await?
        .map_err(|e| failed("looking up", format!("the base image of {source}"), e))
    }

    /// `snapshot_rm`: untags a snapshot (never an image of the name).
    pub(super) async fn remove_snapshot(&self, snapshot: &SnapshotRef) -> Result<(), BackendError> {
        let (store, r) = (self.store.clone(), snapshot.to_string());
        let target = r.clone();
        blocking("removing", &target, move || match store.lookup(&r) {
            Ok(d) => match store.manifest(&d)?.kind() {
                images::Kind::Snapshot => match store.remove(&r) {
                    Ok(_) | Err(images::ImageError::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e),
                },
                // Never untag an image under a snapshot's name.
                images::Kind::Image => Ok(()),
            },
            Err(images::ImageError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        })
        .await?
        .map_err(|e| failed("removing", format!("snapshot {target}"), e))
    }

    /// `snapshot_rm_if`: untags a snapshot while the name still names the manifest `expected`
    /// (`images::Store::remove_if`: compared and removed under the store's `.lock`, which every
    /// save of a name takes). `expected` must be a snapshot manifest, so no image is untagged.
    pub(super) async fn remove_snapshot_if(
        &self,
        snapshot: &SnapshotRef,
        expected: &str,
    ) -> Result<bool, BackendError> {
        let (store, r) = (self.store.clone(), snapshot.to_string());
        let target = r.clone();
        let expected =
            images::Digest::parse(expected).map_err(|e| failed("removing", format!("snapshot {target}"), e))?;
        blocking("removing", &target, move || match store.manifest(&expected)?.kind() {
            images::Kind::Snapshot => store.remove_if(&r, &expected),
            // Never untag an image under a snapshot's name.
            images::Kind::Image => Ok(false),
        })
        .await?
        .map_err(|e| failed("removing", format!("snapshot {target}"), e))
    }
}

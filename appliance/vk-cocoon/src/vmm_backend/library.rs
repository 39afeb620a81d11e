//! The library as the snapshot GC (`crate::gc`) sees it: `library` (every snapshot with its
//! owner, age, disk bytes and whether a live VM uses it; the images' disk bytes) and
//! `collect_garbage` (`images::Store::gc` keeping what live VMs use).
//!
//! "Live VMs" are this backend's (the driver's listing: running and still creating) and those
//! of the `chrysalis` CLI under `$CHRYSALIS_STATE/vms` (`images::Store::live_vm_digests`, as
//! `chrysalis image gc` finds them): the appliance gives both one library (`CHRYSALIS_IMAGES`).
//! A listing that fails fails the call: nothing is collected on a guess.

use std::collections::HashSet;
use std::time::{Duration, UNIX_EPOCH};

use images::Digest;

use super::{blocking, failed, VmmBackend};
use crate::backend::{BackendError, Library, SnapshotEntry, SnapshotRef};

impl VmmBackend {
    /// The digests live VMs use: this backend's, then the CLI's.
    async fn digests_in_use(&self) -> Result<HashSet<Digest>, BackendError> {
        let ours = self.driver.list().await.map_err(|e| failed("listing", "the backend's VMs", e))?;
        let store = self.store.clone();
        blocking("listing", "the VMs using the image library", move || {
            let mut used: HashSet<Digest> = ours.iter().flat_map(|vm| store.in_use_by(vm)).collect();
            let cli = vmm::record::vms_dir(&vmm::record::default_state_dir());
            used.extend(store.live_vm_digests(&cli)?);
            Ok::<_, images::ImageError>(used)
        })
        .await?
        .map_err(|e| failed("listing", "the VMs using the image library", e))
    }

    pub(super) async fn list_library(&self) -> Result<Library, BackendError> {
        let used = self.digests_in_use().await?;
        let store = self.store.clone();
        let entries = blocking("listing", "the image library", move || store.list())
            .await?
            .map_err(|e| failed("listing", "the image library", e))?;
        let mut library = Library::default();
        for e in entries {
            match e.kind {
                images::Kind::Image => library.image_disk_bytes += e.disk,
                images::Kind::Snapshot => {
                    let reference = SnapshotRef::new(e.reference.repo(), e.reference.tag());
                    library.snapshots.push(SnapshotEntry {
                        reference,
                        namespace: e.namespace,
                        created: UNIX_EPOCH + Duration::from_secs(e.created),
                        disk_bytes: e.disk,
                        in_use: used.contains(&e.digest),
                        content: e.digest.to_string(),
                    });
                }
            }
        }
        Ok(library)
    }

    pub(super) async fn collect_library_garbage(&self) -> Result<u64, BackendError> {
        let used: Vec<Digest> = self.digests_in_use().await?.into_iter().collect();
        let store = self.store.clone();
        let report = blocking("collecting", "the image library", move || store.gc(&used))
            .await?
            .map_err(|e| failed("collecting", "the image library", e))?;
        Ok(report.freed_bytes)
    }
}

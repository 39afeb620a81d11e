//! [`VmmBackend`] over a driver that boots nothing, a lease table in a temporary directory
//! (`vmnet::Network::new`: bookkeeping only, no bridge) and an empty image library: the paths
//! that fail before a hypervisor would start, and what they leave behind.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use vmm::{AfterSnapshot, Backend, BootSpec, Driver, DriverError, Snapshot, Vm, VmId};
use vmnet::{NetConfig, Network};

use super::{vm_id_for, VmmBackend};
use crate::backend::{BackendError, CloneRequest, Hypervisor, SnapshotRef, VmBackend};

/// A driver with no VMs, refusing every operation that would start or touch one.
struct NoVms;

fn refused(what: &str) -> DriverError {
    DriverError::io(what.to_owned(), std::io::Error::other("this test driver runs no VM"))
}

#[async_trait::async_trait]
impl Driver for NoVms {
    fn backend(&self) -> Backend {
        Backend::Qemu
    }

    fn accel(&self) -> vmm::Accel {
        vmm::Accel::Tcg
    }

    async fn boot(&self, _spec: &BootSpec) -> Result<Vm, DriverError> {
        Err(refused("boot"))
    }

    async fn pause(&self, _vm: &Vm) -> Result<(), DriverError> {
        Err(refused("pause"))
    }

    async fn resume(&self, _vm: &Vm) -> Result<(), DriverError> {
        Err(refused("resume"))
    }

    async fn snapshot(&self, _vm: &Vm, _dir: &Path, _after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        Err(refused("snapshot"))
    }

    async fn restore(&self, _snapshot: &Snapshot, _id: &VmId) -> Result<Vm, DriverError> {
        Err(refused("restore"))
    }

    async fn shutdown(&self, _vm: &Vm, _timeout: Duration) -> Result<(), DriverError> {
        Ok(())
    }

    async fn kill(&self, _vm: &Vm) -> Result<(), DriverError> {
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        Ok(Vec::new())
    }

    async fn attach(&self, _id: &VmId) -> Result<Vm, DriverError> {
        Err(refused("attach"))
    }
}

fn backend(dir: &Path) -> (VmmBackend, Network) {
    let store = images::Store::open(dir.join("images")).unwrap();
    let net = Network::new(NetConfig::new("10.88.0.0/24".parse().unwrap(), dir.join("leases.json"))).unwrap();
    let b = VmmBackend::new(Arc::new(NoVms), store, net.clone(), dir.join("cocoon"), Duration::from_secs(1)).unwrap();
    (b, net)
}

fn wake(name: &str, keep_lease: bool) -> CloneRequest {
    CloneRequest {
        name: name.into(),
        namespace: "ns".into(),
        snapshot: SnapshotRef::new(name, "hibernate"),
        network: None,
        shared_network: None,
        hypervisor: Hypervisor::Qemu,
        keep_lease,
    }
}

#[tokio::test]
async fn a_failed_wake_keeps_the_lease_its_guest_carries_and_a_failed_clone_releases_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let (b, net) = backend(tmp.path());
    // The hibernated VM's lease, kept for its wake.
    let id = vm_id_for("vm-a");
    let kept = net.allocate(&id).unwrap();
    // The restore fails (here: the snapshot cannot be resolved); the undo must keep the lease.
    let e = b.clone_vm(&wake("vm-a", true)).await.unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e:?}");
    assert_eq!(net.lookup(&id).unwrap().map(|l| l.ip), Some(kept.ip), "the wake's lease survives a failed attempt");
    assert!(b.load_record(&id).unwrap().is_none(), "the record is undone");
    // The retry claims the name again (nothing half-made is left) and fails the same way.
    assert!(matches!(b.clone_vm(&wake("vm-a", true)).await, Err(BackendError::NotFound { .. })));
    assert_eq!(net.lookup(&id).unwrap().map(|l| l.ip), Some(kept.ip));
    // A plain clone's undo releases the lease as before.
    let other = vm_id_for("vm-b");
    net.allocate(&other).unwrap();
    assert!(b.clone_vm(&wake("vm-b", false)).await.is_err());
    assert!(net.lookup(&other).unwrap().is_none(), "a clone's own lease goes with it");
    assert_eq!(b.vm_id_of("vm-a"), Some(id), "ids follow from names");
}

/// A driver snapshot directory of a VM booted from image files written under `dir`.
fn saved_vm(dir: &Path, state: &[u8]) -> Snapshot {
    let file = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let spec = BootSpec {
        overlay_bytes: None,
        name: "t".into(),
        kernel: file("vmlinux", b"kernel"),
        initrd: file("initrd", b"initrd"),
        rootfs: None,
        overlay_base: None,
        cmdline: "console=ttyS0".into(),
        size: vmm::SizeClass::Small,
        accel: vmm::AccelPreference::Tcg,
        nic: None,
        rng: true,
        volumes: true,
        ram: vmm::Ram::Anonymous,
    };
    let snap_dir = dir.join("snap");
    std::fs::create_dir_all(&snap_dir).unwrap();
    std::fs::write(snap_dir.join("state"), state).unwrap();
    Snapshot {
        dir: snap_dir,
        backend: Backend::Qemu,
        accel: vmm::Accel::Tcg,
        source: VmId::new("src-vm").unwrap(),
        spec,
        overlay: None,
        created_at_epoch_secs: 1,
    }
}

#[tokio::test]
async fn snapshot_rm_if_removes_only_the_content_that_was_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let (b, _net) = backend(tmp.path());
    let store = images::Store::open(tmp.path().join("images")).unwrap();
    let name = SnapshotRef::latest("vm-a");
    let old = store.save_snapshot(&name.to_string(), &saved_vm(tmp.path(), b"old")).unwrap();
    // Saved again under the same name (a DeletePod's `<name>:latest`) after `old` was listed.
    let new = store.save_snapshot(&name.to_string(), &saved_vm(tmp.path(), b"new")).unwrap();
    assert_ne!(old, new);
    assert!(!b.snapshot_rm_if(&name, &old.to_string()).await.unwrap(), "stale content: kept");
    assert_eq!(store.lookup(&name.to_string()).unwrap(), new);
    assert!(b.snapshot_rm_if(&name, &new.to_string()).await.unwrap());
    assert!(b.snapshot_inspect(&name).await.unwrap().is_none());
    assert!(!b.snapshot_rm_if(&name, &new.to_string()).await.unwrap(), "already gone: nothing removed");
    // Never an image of the name, nor on an expected content that is no digest.
    let base = store.tag(&old.to_string(), "img").and_then(|_| store.resolve_snapshot("img")).unwrap().base_image;
    store.tag(&base.to_string(), "img").unwrap();
    assert!(!b.snapshot_rm_if(&SnapshotRef::latest("img"), &base.to_string()).await.unwrap());
    assert_eq!(store.lookup("img").unwrap(), base);
    assert!(b.snapshot_rm_if(&SnapshotRef::latest("img"), "not-a-digest").await.is_err());
}

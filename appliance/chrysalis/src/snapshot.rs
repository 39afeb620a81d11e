//! `chrysalis snapshot …`: save a running QEMU VM into the library, list, rm.

use anyhow::{bail, Context, Result};
use images::{Kind, Reference, Store};
use vmm::{AfterSnapshot, Driver, VmId, VmState};

use crate::flags::{SnapshotCmd, VmStateDir};
use crate::output;

/// Runs a snapshot verb.
pub fn run(store: &Store, cmd: SnapshotCmd) -> Result<()> {
    match cmd {
        SnapshotCmd::Save { vm_id, name, namespace, vms } => save(store, &vm_id, &name, namespace.as_deref(), &vms),
        SnapshotCmd::List(a) => output::entries(store.list()?, Kind::Snapshot, a.json),
        SnapshotCmd::Rm { refs } => crate::image::remove(store, &refs, Kind::Snapshot),
    }
}

/// Snapshots VM `vm_id` (left running) into a scratch dir of the store, then moves it in.
///
/// The VM is found through its record (`Driver::list`), not `Driver::attach`: attaching would
/// take over the VM's agent bridge socket from the process that owns the VM. A snapshot needs
/// only QMP.
/// `namespace` is recorded as the snapshot's owner (see `images::SnapshotManifest::namespace`).
fn save(store: &Store, vm_id: &str, name: &str, namespace: Option<&str>, vms: &VmStateDir) -> Result<()> {
    let id = VmId::new(vm_id)?;
    let reference = Reference::parse(name)?;
    if let Some(ns) = namespace.filter(|ns| !images::valid_namespace(ns)) {
        bail!("--namespace {ns:?} is not a Kubernetes namespace name (1-63 of a-z, 0-9 and '-')");
    }
    let namespace = namespace.map(str::to_owned);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
    let d = rt.block_on(async {
        let mut cfg = vmm::qemu::QemuConfig::from_env();
        cfg.state_dir = vms.vm_state_dir.clone();
        let driver = vmm::qemu::QemuDriver::new(cfg);
        let vm = driver
            .list()
            .await
            .with_context(|| format!("listing the VMs under {}", vms.vm_state_dir.display()))?
            .into_iter()
            .find(|v| v.id == id)
            .with_context(|| format!("no live QEMU VM {id} under {}", vms.vm_state_dir.display()))?;
        if vm.state != VmState::Running {
            bail!("vm {id} is still being created");
        }
        let scratch = store.scratch_dir()?;
        let snap = driver
            .snapshot(&vm, scratch.path(), AfterSnapshot::Resumed)
            .await
            .with_context(|| format!("snapshotting vm {id}"))?;
        let store = store.clone();
        let n = reference.to_string();
        let d = tokio::task::spawn_blocking(move || {
            let r = store.save_snapshot_moving_for(&n, &snap, namespace.as_deref());
            drop(scratch);
            r
        })
        .await
        .context("the snapshot ingest task failed")??;
        anyhow::Ok(d)
    })?;
    println!("{reference} {d}");
    Ok(())
}

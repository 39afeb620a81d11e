//! [`VmmBackend`]: the production [`VmBackend`] — QEMU microVMs through the `vmm` driver,
//! images and snapshots from the `images` library, a TAP + address per VM from `vmnet`.
//!
//! # Configuration ([`BackendConfig`], from the environment in `main.rs`)
//! * `COCOON_ROOT_DIR` (`/var/lib/cocoon`): `<root>/vms/<vmm-id>/` the driver's VM directories,
//!   `<root>/cocoon/<id>.json` this backend's VM records, `<root>/net/leases.json` the address
//!   leases, `<root>/images` the image library (unless `CHRYSALIS_IMAGES` names another).
//! * `VK_BRIDGE` (`chrysalis0`), `VK_VM_CIDR` (`10.88.0.0/24`, the gateway is its first host,
//!   assigned to the bridge), `VK_NETNS` (optional: a named netns `/run/netns/<name>` holding the
//!   bridge, the TAPs and every QEMU; the tests use one so that no VM packet leaves it).
//! * The VM packet filter (`vmnet::filter`, installed by `Network::ensure`): `VK_NET_HOST_ALLOW`
//!   (`tcp/PORT,udp/PORT`: the host services VMs may reach at their gateway; default none),
//!   `VK_NET_UPLINK` (the interface egress leaves by, masqueraded; default none: no VM has a
//!   route out), `VK_NET_REFUSE` (IPv4 networks refused to egress on top of the private,
//!   link-local, metadata, loopback and multicast ranges).
//!
//! # Network policy of a VM
//! The Pod's `cocoonset.cocoonstack.io/network` = `egress` gives the VM a route out (refused
//! without `VK_NET_UPLINK`); `vm.cocoonstack.io/shared-network` = `<group>` puts it in the group
//! `<namespace>/<group>`, whose VMs may talk to each other. Both are kept in the VM's lease, so
//! a `start` and a restart of vk-cocoon keep them.
//!
//! # Identity
//! A VM's id (the Pod's `vm.cocoonstack.io/id`) is derived from its name ([`vm_id_for`]):
//! `vc-<name>` when that is a valid id of at most 40 characters, else
//! `vc-<slug of the name>-<10 hex of sha256(name)>` — deterministic, so the name → id mapping
//! survives any restart, and the `vc-` prefix marks our VMs. The record `<root>/cocoon/<id>.json`
//! (a `vmm::owned::RecordStore` record) keeps the name (the id of a hashed name cannot be read back), the boot spec and the current
//! hypervisor instance. Each hypervisor instance has its own driver id `<id>-<8 hex>` (the QEMU
//! driver generates ids as `<spec.name>-<8 hex>`, and `spec.name` is set to the id), so a driver
//! VM maps back to its owner by dropping the suffix ([`owner_of`]) even when a crash came
//! between the boot and the record update. Prefix, instance rule, records and the listing of
//! our driver VMs without a record are `vmm::owned`'s ([`OWNERSHIP`]).
//!
//! # Code map
//! [`config`](BackendConfig) (the environment), `identity` (ids, network policy, sizes),
//! `records` (the records and the views on them: list, inspect, start, remove), `network`
//! (lease, TAP, guest re-addressing, probes), `snapshots` (clone, save, inspect, untag), `library` (the
//! snapshot GC's listing and content collection), and here
//! the backend itself: open, run, and the [`VmBackend`] impl.
//!
//! # Operations
//! * Owners: the record keeps the creating Pod's namespace, the snapshot manifest the saving
//!   VM owner's (`images::SnapshotManifest::namespace`); records from before either have none.
//! * `run`: claim the record (exclusive create: a second VM of the name is
//!   [`BackendError::NameInUse`]) → resolve the image → lease + TAP → boot with the NIC → wait for
//!   the agent (`VK_BOOT_TIMEOUT`, default 300 s: TCG is slow). Any failure undoes it all.
//! * `clone_vm`: resolve the snapshot → lease + TAP → `restore_with` the clone's own NIC; the
//!   guest keeps the parent's address until `configure_network` runs
//!   `guest-init net-config <ip/prefix> <gw> <mac>` through the agent. A wake
//!   (`CloneRequest::keep_lease`) takes the lease its id already holds, so the guest's address
//!   is right as restored; its undo keeps that lease.
//! * `list`/`inspect`: the records joined with the driver's listing (process liveness) and the
//!   leases (`ip`). A record whose hypervisor is gone is `Stopped`; a record never completed, or a
//!   driver VM of ours without a record (a crash mid-create), is `Creating`.
//! * `start` (a `Stopped` VM): a **cold boot of the recorded spec** with the VM's own lease —
//!   the QEMU driver always gives a boot a fresh writable layer, so the VM's disk changes and, for
//!   a clone, its memory state are lost (the clone boots its parent's image afresh, with its own
//!   address on the kernel command line).
//! * `remove`: kill every hypervisor of the id, delete its TAP and record (the lease stays until
//!   `release_ip`). `snapshot_save`: the driver snapshots into a store scratch directory (the VM
//!   is resumed), the store takes the files (`save_snapshot_moving`) and names them.
//!   `snapshot_rm` only untags: content is collected by `collect_garbage` (vk-cocoon's snapshot
//!   GC) or `chrysalis image gc`, each keeping what every live VM of the library uses.
//!
//! # Limits
//! `hypervisors()` is `[qemu]`: the cloud-hypervisor driver has no NIC support (and needs KVM),
//! so a Pod asking for it is refused by the provider. `network` other than `default`/`egress`, and
//! sizes beyond the largest class, are refused ([`BackendError::Unsupported`]). `storage` sizes
//! the writable disk of a `run` (`BootSpec::overlay_bytes`; below the image's size refused, on an
//! image without a writable disk ignored with a warning); a clone keeps its snapshot's, as upstream.

mod config;
mod identity;
mod library;
mod network;
mod records;
mod snapshots;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::owned::RecordStore;
use vmm::{AccelPreference, Driver, SizeClass, VmId, AGENT_PORT};
use vmnet::{NetConfig, Network, VmPolicy};

pub use self::config::BackendConfig;
pub use self::identity::{owner_of, size_for, vm_id_for, vm_policy, ID_PREFIX, OWNERSHIP};
use self::records::CocoonMeta;
use crate::backend::{
    BackendError, CloneRequest, Hypervisor, RunRequest, SnapshotInfo, SnapshotRef, VmBackend, VmInfo, VmState, VmUsage,
};

/// How long one agent exchange (connect + `info`, or the net-config exec) may take.
const AGENT_CALL: Duration = Duration::from_secs(30);

/// Failures of this module that are not another crate's error (the `source` of a
/// [`BackendError::Failed`]).
#[derive(Debug, thiserror::Error)]
pub enum VmmBackendError {
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: &'static str, after: Duration },
    #[error("{argv} exited with {code}: {stderr}")]
    Exit { argv: String, code: i32, stderr: String },
    #[error("the guest agent")]
    Agent(#[source] silkd_client::ClientError),
    #[error("the guest agent")]
    Dial(#[source] vmm::agent::DialError),
    #[error("a blocking task of the backend died: {0}")]
    Join(String),
    #[error("{0}")]
    Invalid(String),
}

// ------------------------------------------------------------------------------- the backend

/// The production backend (see the module doc).
pub struct VmmBackend {
    driver: Arc<dyn Driver>,
    store: Arc<images::Store>,
    net: Network,
    records: RecordStore<CocoonMeta>,
    boot_timeout: Duration,
    /// Driver VMs whose host-side agent bridge this process runs (booted here or attached).
    attached: Mutex<HashSet<VmId>>,
}

fn failed(
    op: &'static str,
    target: impl Into<String>,
    e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
) -> BackendError {
    BackendError::failed(op, target, e)
}

/// An image-library error as a backend error (`NotFound` / `Unsupported` when it says so).
fn image_error(op: &'static str, what: &str, e: images::ImageError) -> BackendError {
    match e {
        images::ImageError::NotFound { .. } => BackendError::NotFound { what: format!("{what} (image library)") },
        images::ImageError::WrongKind { .. } => BackendError::Unsupported { what: e.to_string() },
        e => failed(op, what.to_owned(), e),
    }
}

async fn blocking<T: Send + 'static>(
    op: &'static str,
    target: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| failed(op, target.to_owned(), VmmBackendError::Join(e.to_string())))
}
impl VmmBackend {
    /// A backend over `driver` (its state dir should be `<root>`), `store` and `net` (its bridge
    /// must exist: [`Network::ensure`]).
    pub fn new(
        driver: Arc<dyn Driver>,
        store: images::Store,
        net: Network,
        records: PathBuf,
        boot_timeout: Duration,
    ) -> Result<VmmBackend, BackendError> {
        let records = RecordStore::open(records.clone())
            .map_err(|e| failed("creating the record directory", records.display().to_string(), e))?;
        Ok(VmmBackend {
            driver,
            store: Arc::new(store),
            net,
            records,
            boot_timeout,
            attached: Mutex::new(HashSet::new()),
        })
    }

    /// Opens everything `cfg` names: the hypervisor driver `cfg.hypervisor` chooses (state
    /// `<root>`), the image library, the bridge (created if missing) and the lease table.
    pub async fn open(cfg: &BackendConfig) -> Result<VmmBackend, BackendError> {
        let mut qcfg = vmm::qemu::QemuConfig::from_env();
        qcfg.state_dir = cfg.root_dir.clone();
        qcfg.console_cap = cfg.console_cap;
        let (driver, choice) = vmm::hypervisor::driver(cfg.hypervisor, qcfg)
            .map_err(|e| failed("starting the hypervisor driver", cfg.hypervisor.to_string(), e))?;
        tracing::info!(backend = %choice.backend, why = %choice.why, "VM driver chosen");
        let images_dir = cfg.images_dir.clone();
        let store = blocking("opening the image library", &images_dir.display().to_string(), {
            let d = images_dir.clone();
            move || images::Store::open(d)
        })
        .await?
        .map_err(|e| failed("opening the image library", images_dir.display().to_string(), e))?;
        let ncfg = NetConfig {
            bridge: cfg.bridge.clone(),
            netns: cfg.netns.clone(),
            filter: cfg.filter.clone(),
            ..NetConfig::new(cfg.cidr, cfg.leases_path())
        };
        if let Some(dir) = cfg.leases_path().parent() {
            std::fs::create_dir_all(dir).map_err(|e| failed("creating", dir.display().to_string(), e))?;
        }
        let net = Network::ensure(&ncfg)
            .await
            .map_err(|e| failed("setting up the VM bridge", format!("{} ({})", cfg.bridge, cfg.cidr), e))?;
        tracing::info!(root = %cfg.root_dir.display(), images = %images_dir.display(), bridge = %cfg.bridge, cidr = %cfg.cidr, netns = ?cfg.netns, accel = %driver.accel(), "VM backend ready");
        VmmBackend::new(driver, store, net, cfg.records_dir(), cfg.boot_timeout)
    }

    fn lock_attached(&self) -> std::sync::MutexGuard<'_, HashSet<VmId>> {
        // Inserts and removes only: a poisoned set is still valid.
        self.attached.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for the agent of a freshly booted VM; on failure kills it (console tail in the error).
    async fn await_agent(&self, id: &str, vm: &vmm::Vm) -> Result<(), BackendError> {
        if let Err(e) = self.driver.wait_agent(vm, self.boot_timeout).await {
            // Read by seeking: the console is the guest's to fill (up to its cap).
            let console = vmm::console::tail_text(&vm.console_log, 10);
            let tail: Vec<&str> = console.lines().collect();
            if let Err(k) = self.driver.kill(vm).await {
                tracing::warn!(vm = id, error = %crate::provider::error_chain(&k), "killing a VM whose agent never answered failed");
            }
            self.lock_attached().remove(&vm.id);
            return Err(failed("waiting for the guest agent of", format!("{id} (console: {})", tail.join(" | ")), e));
        }
        Ok(())
    }

    /// Checks the hypervisor and the network, and returns the VM's network policy: egress for
    /// `network: egress` (when the node has an uplink), the group `<namespace>/<shared>`.
    fn check_common(
        &self,
        hypervisor: Hypervisor,
        network: Option<&str>,
        namespace: &str,
        shared: Option<&str>,
    ) -> Result<VmPolicy, BackendError> {
        if !self.hypervisors().contains(&hypervisor) {
            return Err(BackendError::Unsupported {
                what: format!("hypervisor {hypervisor} is not available on this node (it runs qemu)"),
            });
        }
        vm_policy(network, namespace, shared, self.net.config().filter.uplink.is_some())
    }

    async fn run_inner(
        &self,
        id: &str,
        req: &RunRequest,
        size: SizeClass,
        policy: &VmPolicy,
    ) -> Result<VmInfo, BackendError> {
        let image = {
            let (store, name) = (self.store.clone(), req.image.clone());
            blocking("resolving", &req.image, move || store.resolve_image(&name)).await?
        }
        .map_err(|e| image_error("resolving", &format!("image {}", req.image), e))?;
        let lease = self.network_for(id, Some(policy)).await?;
        let mut spec = image.boot_spec(id, size, AccelPreference::Auto);
        spec.nic = Some(self.net.nic_spec(&lease));
        match (req.storage_bytes, spec.overlay_base.is_some()) {
            // `storage` sizes the writable disk (upstream: `cocoon vm run --storage`); the
            // driver refuses a size below the image's.
            (Some(b), true) => spec.overlay_bytes = Some(b),
            (Some(b), false) => {
                tracing::warn!(vm = %id, bytes = b, image = %req.image, "storage ignored: this image has no writable disk (it writes to guest memory)");
            }
            (None, _) => {}
        }
        let vm =
            self.driver.boot(&spec).await.map_err(|e| failed("booting", format!("VM {id} from {}", req.image), e))?;
        self.lock_attached().insert(vm.id.clone());
        self.complete(id, &vm).await?;
        self.await_agent(id, &vm).await?;
        Ok(running(id, &req.name, &req.namespace, &lease, req.hypervisor))
    }
}

/// The [`VmInfo`] of a VM just booted or restored.
fn running(id: &str, name: &str, namespace: &str, lease: &vmnet::Lease, hypervisor: Hypervisor) -> VmInfo {
    VmInfo {
        id: id.to_owned(),
        name: name.to_owned(),
        namespace: Some(namespace.to_owned()),
        ip: Some(lease.ip.to_string()),
        state: VmState::Running,
        hypervisor,
    }
}

/// vk-cocoon's fields of a new record.
fn meta(name: &str, namespace: &str, hypervisor: Hypervisor, source: String) -> CocoonMeta {
    CocoonMeta { name: name.to_owned(), namespace: Some(namespace.to_owned()), hypervisor, source }
}

#[async_trait::async_trait]
impl VmBackend for VmmBackend {
    fn hypervisors(&self) -> Vec<Hypervisor> {
        vec![Hypervisor::Qemu]
    }

    async fn run(&self, req: &RunRequest) -> Result<VmInfo, BackendError> {
        let id = vm_id_for(&req.name);
        let span = tracing::info_span!("backend_run", vm = %id, name = %req.name, image = %req.image);
        let policy =
            self.check_common(req.hypervisor, req.network.as_deref(), &req.namespace, req.shared_network.as_deref())?;
        let size = size_for(req.vcpus, req.memory_mib).ok_or_else(|| BackendError::Unsupported {
            what: format!(
                "{} vCPUs / {} MiB: the largest VM size here is {} vCPUs / {} MiB",
                req.vcpus,
                req.memory_mib,
                SizeClass::X2Large.vcpus(),
                SizeClass::X2Large.memory_mib()
            ),
        })?;
        self.claim(&id, meta(&req.name, &req.namespace, req.hypervisor, format!("run {}", req.image)))?;
        let t0 = std::time::Instant::now();
        match tracing::Instrument::instrument(self.run_inner(&id, req, size, &policy), span).await {
            Ok(v) => {
                tracing::info!(vm = %id, ip = ?v.ip, size = %size, ms = t0.elapsed().as_millis() as u64, "VM booted, agent up");
                Ok(v)
            }
            Err(e) => {
                self.undo_create(&id, false).await;
                Err(e)
            }
        }
    }

    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmInfo, BackendError> {
        let id = vm_id_for(&req.name);
        let span = tracing::info_span!("backend_clone", vm = %id, name = %req.name, snapshot = %req.snapshot);
        let policy =
            self.check_common(req.hypervisor, req.network.as_deref(), &req.namespace, req.shared_network.as_deref())?;
        // A wake restores a guest that already carries the address of this id's lease: that
        // lease outlives a failed attempt (a lease that cannot be read counts as existing).
        let keep_lease = req.keep_lease && !matches!(self.net.lookup(&id), Ok(None));
        self.claim(&id, meta(&req.name, &req.namespace, req.hypervisor, format!("clone {}", req.snapshot)))?;
        let t0 = std::time::Instant::now();
        match tracing::Instrument::instrument(self.clone_inner(&id, req, &policy), span).await {
            Ok(v) => {
                tracing::info!(vm = %id, ip = ?v.ip, ms = t0.elapsed().as_millis() as u64, "VM restored");
                Ok(v)
            }
            Err(e) => {
                self.undo_create(&id, keep_lease).await;
                Err(e)
            }
        }
    }
    async fn configure_network(&self, id: &str) -> Result<(), BackendError> {
        self.readdress(id).await
    }

    fn network_hint(&self, vm: &VmInfo) -> Option<String> {
        self.hint(&vm.id)
    }

    fn vm_id_of(&self, name: &str) -> Option<String> {
        Some(vm_id_for(name))
    }

    async fn inspect(&self, id: &str) -> Result<Option<VmInfo>, BackendError> {
        Ok(self.list_all().await?.into_iter().find(|v| v.id == id))
    }

    async fn list(&self) -> Result<Vec<VmInfo>, BackendError> {
        self.list_all().await
    }

    async fn start(&self, id: &str) -> Result<VmInfo, BackendError> {
        self.start_vm(id).await
    }

    async fn remove(&self, id: &str) -> Result<(), BackendError> {
        self.remove_vm(id).await
    }

    async fn snapshot_save(&self, id: &str, snapshot: &SnapshotRef, namespace: &str) -> Result<(), BackendError> {
        self.save_snapshot(id, snapshot, namespace).await
    }

    async fn snapshot_inspect(&self, snapshot: &SnapshotRef) -> Result<Option<SnapshotInfo>, BackendError> {
        self.inspect_snapshot(snapshot).await
    }

    async fn base_image_of(&self, source: &str) -> Result<Option<String>, BackendError> {
        self.base_image(source).await
    }

    async fn snapshot_rm(&self, snapshot: &SnapshotRef) -> Result<(), BackendError> {
        self.remove_snapshot(snapshot).await
    }

    async fn snapshot_rm_if(&self, snapshot: &SnapshotRef, expected: &str) -> Result<bool, BackendError> {
        self.remove_snapshot_if(snapshot, expected).await
    }

    async fn library(&self) -> Result<crate::backend::Library, BackendError> {
        self.list_library().await
    }

    async fn collect_garbage(&self) -> Result<u64, BackendError> {
        self.collect_library_garbage().await
    }

    async fn probe_agent(&self, id: &str) -> Result<(), BackendError> {
        let vm = self.live_vm(id).await?;
        let op = "asking the guest agent of";
        let exchange = async {
            let mut s = self.driver.connect(&vm, AGENT_PORT).await.map_err(|e| failed(op, id.to_owned(), e))?;
            vmm::agent::info(&mut s).await.map_err(|e| failed(op, id.to_owned(), VmmBackendError::Dial(e)))
        };
        tokio::time::timeout(AGENT_CALL, exchange)
            .await
            .map_err(|_| failed(op, id.to_owned(), VmmBackendError::Timeout { what: "info", after: AGENT_CALL }))??;
        Ok(())
    }

    async fn probe_tcp(&self, ip: &str, port: u16, timeout: Duration) -> bool {
        self.tcp_probe(ip, port, timeout).await
    }

    async fn release_ip(&self, id: &str) -> Result<(), BackendError> {
        self.release_lease(id).await
    }

    async fn usage(&self, ids: &[String]) -> Result<Vec<(String, VmUsage)>, BackendError> {
        self.measure(ids).await
    }

    async fn dial_agent(&self, id: &str) -> Result<vnode::streams::AgentIo, BackendError> {
        let vm = self.live_vm(id).await?;
        let stream = self
            .driver
            .connect(&vm, AGENT_PORT)
            .await
            .map_err(|e| failed("dialling the guest agent of", id.to_owned(), e))?;
        Ok(Box::new(stream))
    }

    async fn console_log(&self, id: &str) -> Result<std::path::PathBuf, BackendError> {
        Ok(self.live_vm(id).await?.console_log)
    }
}

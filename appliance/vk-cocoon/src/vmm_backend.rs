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
//! keeps the name (the id of a hashed name cannot be read back), the boot spec and the current
//! hypervisor instance. Each hypervisor instance has its own driver id `<id>-<8 hex>` (the QEMU
//! driver generates ids as `<spec.name>-<8 hex>`, and `spec.name` is set to the id), so a driver
//! VM maps back to its owner by dropping the suffix ([`owner_of`]) even when a crash came
//! between the boot and the record update.
//!
//! # Operations
//! * Owners: the record keeps the creating Pod's namespace, the snapshot manifest the saving
//!   VM owner's (`images::SnapshotManifest::namespace`); records from before either have none.
//! * `run`: claim the record (exclusive create: a second VM of the name is
//!   [`BackendError::NameInUse`]) → resolve the image → lease + TAP → boot with the NIC → wait for
//!   the agent (`VK_BOOT_TIMEOUT`, default 300 s: TCG is slow). Any failure undoes it all.
//! * `clone_vm`: resolve the snapshot → lease + TAP → `restore_with` the clone's own NIC; the
//!   guest keeps the parent's address until `configure_network` runs
//!   `guest-init net-config <ip/prefix> <gw> <mac>` through the agent.
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
//!   `snapshot_rm` only untags: content is collected by `chrysalis image gc`, which knows every
//!   VM's use.
//!
//! # Limits
//! `hypervisors()` is `[qemu]`: the cloud-hypervisor driver has no NIC support (and needs KVM),
//! so a Pod asking for it is refused by the provider. `network` other than `default`/`egress`, and
//! sizes beyond the largest class, are refused ([`BackendError::Unsupported`]); `storage` is
//! ignored (a VM's writable layer is the image's overlay size).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use silkd_client::{AgentConn, ExecOptions};
use vmm::{AccelPreference, AfterSnapshot, BootSpec, Driver, NicSpec, RestoreOptions, SizeClass, VmId, AGENT_PORT};
use vmnet::{FilterPolicy, Ipv4Net, Lease, NetConfig, Network, VmPolicy};

use crate::backend::{
    BackendError, CloneRequest, Hypervisor, RunRequest, SnapshotInfo, SnapshotRef, VmBackend, VmInfo, VmState,
};
use crate::config::ConfigError;

/// The prefix of every VM id this backend makes.
pub const ID_PREFIX: &str = "vc-";
/// Longest id [`vm_id_for`] makes (so that the driver's `<id>-<8 hex>` keeps the whole id).
const MAX_ID: usize = 40;
/// How long one agent exchange (connect + `info`, or the net-config exec) may take.
const AGENT_CALL: Duration = Duration::from_secs(30);
/// What a `guest-init net-config` exec may print (stdout + stderr) before it is cut off: a
/// guest that streams endless output gets a typed error, never our memory.
const NET_CONFIG_OUTPUT_CAP: usize = 64 * 1024;

/// Failures of this module that are not another crate's error (the `source` of a
/// [`BackendError::Failed`]).
#[derive(Debug, thiserror::Error)]
pub enum VmmBackendError {
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("VM record {} is corrupt", path.display())]
    Record {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
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

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmmBackendError {
    let path = path.to_path_buf();
    move |source| VmmBackendError::Io { what, path, source }
}

// ------------------------------------------------------------------------------- configuration

/// Where and how the backend keeps its VMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendConfig {
    /// `COCOON_ROOT_DIR`.
    pub root_dir: PathBuf,
    /// `CHRYSALIS_IMAGES`, else `<root>/images`.
    pub images_dir: PathBuf,
    /// `VK_BRIDGE`.
    pub bridge: String,
    /// `VK_VM_CIDR`.
    pub cidr: Ipv4Net,
    /// `VK_NETNS`.
    pub netns: Option<String>,
    /// `VK_BOOT_TIMEOUT` (seconds, default 300): how long `run`/`start` wait for the agent.
    pub boot_timeout: Duration,
    /// `VK_NET_HOST_ALLOW`, `VK_NET_UPLINK`, `VK_NET_REFUSE`: what VMs may reach.
    pub filter: FilterPolicy,
}

impl BackendConfig {
    /// From `get` (one variable's value; empty = unset) for the root `root_dir`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>, root_dir: &Path) -> Result<BackendConfig, ConfigError> {
        let val = |k: &str| get(k).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let bad = |var: &'static str, value: &str, why: &'static str| ConfigError::Invalid {
            var,
            value: value.to_owned(),
            why,
        };
        let cidr = match val("VK_VM_CIDR") {
            None => vmnet::config::DEFAULT_CIDR.parse().map_err(|_| bad("VK_VM_CIDR", "", "internal"))?,
            Some(v) => {
                let c: Ipv4Net = v.parse().map_err(|_| bad("VK_VM_CIDR", &v, "is not an IPv4 range a.b.c.d/len"))?;
                if c != c.trunc() {
                    return Err(bad("VK_VM_CIDR", &v, "has host bits set"));
                }
                if c.prefix_len() > 30 {
                    return Err(bad("VK_VM_CIDR", &v, "is smaller than a /30"));
                }
                c
            }
        };
        let bridge = val("VK_BRIDGE").unwrap_or_else(|| vmnet::config::DEFAULT_BRIDGE.to_owned());
        if !vmnet::config::valid_ifname(&bridge) {
            return Err(bad("VK_BRIDGE", &bridge, "is not an interface name (1-15 characters)"));
        }
        let netns = val("VK_NETNS");
        if let Some(ns) = &netns {
            if !vmnet::config::valid_netns_name(ns) {
                return Err(bad("VK_NETNS", ns, "is not a name under /run/netns"));
            }
        }
        let boot_timeout = match val("VK_BOOT_TIMEOUT") {
            None => Duration::from_secs(300),
            Some(v) => match v.parse::<u64>() {
                Ok(s) if s > 0 => Duration::from_secs(s),
                _ => return Err(bad("VK_BOOT_TIMEOUT", &v, "expected a positive number of seconds")),
            },
        };
        let net = |var: &'static str, value: &str, e: vmnet::FilterError| ConfigError::Net {
            var,
            value: value.to_owned(),
            why: e.to_string(),
        };
        let mut filter = FilterPolicy::default();
        if let Some(v) = val("VK_NET_HOST_ALLOW") {
            filter.host_allow = vmnet::filter::parse_host_allow(&v).map_err(|e| net("VK_NET_HOST_ALLOW", &v, e))?;
        }
        if let Some(v) = val("VK_NET_UPLINK") {
            filter.uplink = Some(v.clone());
            filter.validate().map_err(|e| net("VK_NET_UPLINK", &v, e))?;
        }
        if let Some(v) = val("VK_NET_REFUSE") {
            filter.refuse = vmnet::filter::parse_refuse(&v).map_err(|e| net("VK_NET_REFUSE", &v, e))?;
        }
        Ok(BackendConfig {
            filter,
            root_dir: root_dir.to_path_buf(),
            images_dir: val("CHRYSALIS_IMAGES").map(PathBuf::from).unwrap_or_else(|| root_dir.join("images")),
            bridge,
            cidr,
            netns,
            boot_timeout,
        })
    }

    /// From the process environment.
    pub fn from_env(root_dir: &Path) -> Result<BackendConfig, ConfigError> {
        BackendConfig::from_lookup(&|k| std::env::var(k).ok(), root_dir)
    }

    /// The lease file.
    pub fn leases_path(&self) -> PathBuf {
        self.root_dir.join("net").join("leases.json")
    }

    /// The backend's records.
    pub fn records_dir(&self) -> PathBuf {
        self.root_dir.join("cocoon")
    }
}

// ------------------------------------------------------------------------------- identity

/// The VM id of the VM named `name` (see the module doc): deterministic, `vc-` prefixed,
/// `[a-z0-9-]`, at most 40 characters, never ending in `-`.
pub fn vm_id_for(name: &str) -> String {
    let direct = format!("{ID_PREFIX}{name}");
    if direct.len() <= MAX_ID && VmId::new(direct.as_str()).is_ok() && !direct.ends_with('-') {
        return direct;
    }
    let hash = hex::encode(Sha256::digest(name.as_bytes()));
    let slug: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
        .collect();
    let slug: String = slug.trim_matches('-').chars().take(MAX_ID - ID_PREFIX.len() - 11).collect();
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        format!("{ID_PREFIX}{}", &hash[..10])
    } else {
        format!("{ID_PREFIX}{slug}-{}", &hash[..10])
    }
}

/// The backend id owning the driver VM `vmm_id` (`<id>-<8 hex>` → `<id>`), if it is one of ours.
pub fn owner_of(vmm_id: &str) -> Option<&str> {
    let (owner, suffix) = vmm_id.rsplit_once('-')?;
    (owner.starts_with(ID_PREFIX)
        && suffix.len() == 8
        && suffix.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(owner)
}

/// A VM's network policy (see the module doc): egress for `network: egress` (refused without an
/// uplink), the shared group `<namespace>/<shared>`.
pub fn vm_policy(
    network: Option<&str>,
    namespace: &str,
    shared: Option<&str>,
    has_uplink: bool,
) -> Result<VmPolicy, BackendError> {
    let egress = match network {
        None | Some("default") => false,
        Some("egress") if has_uplink => true,
        Some("egress") => {
            return Err(BackendError::Unsupported {
                what: "network \"egress\": this node has no uplink for VMs (set [vk_cocoon] vm_uplink, VK_NET_UPLINK)"
                    .to_owned(),
            })
        }
        Some(n) => {
            return Err(BackendError::Unsupported {
                what: format!("network {n:?}: this node has the networks default (no route out) and egress"),
            })
        }
    };
    Ok(VmPolicy { group: shared.map(|g| format!("{namespace}/{g}")), egress })
}

/// The smallest size class holding `vcpus` and `memory_mib`.
pub fn size_for(vcpus: u32, memory_mib: u64) -> Option<SizeClass> {
    SizeClass::ALL.into_iter().find(|c| c.vcpus() >= vcpus && c.memory_mib() >= memory_mib)
}

// ------------------------------------------------------------------------------- records

/// Whether a record's VM was ever completely created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum RecordState {
    Creating,
    Created,
}

/// `<root>/cocoon/<id>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    name: String,
    /// The owning namespace; absent in records written before it was recorded.
    #[serde(default)]
    namespace: Option<String>,
    hypervisor: Hypervisor,
    state: RecordState,
    /// The current hypervisor instance.
    #[serde(default)]
    vmm_id: Option<VmId>,
    /// What `start` boots (the NIC included).
    #[serde(default)]
    spec: Option<BootSpec>,
    /// `run <image>` or `clone <snapshot>`.
    source: String,
    created_at_epoch_secs: u64,
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

// ------------------------------------------------------------------------------- the backend

/// The production backend (see the module doc).
pub struct VmmBackend {
    driver: Arc<dyn Driver>,
    store: Arc<images::Store>,
    net: Network,
    records: PathBuf,
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
        std::fs::create_dir_all(&records)
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

    /// Opens everything `cfg` names: the QEMU driver (state `<root>`), the image library, the
    /// bridge (created if missing) and the lease table.
    pub async fn open(cfg: &BackendConfig) -> Result<VmmBackend, BackendError> {
        let mut qcfg = vmm::qemu::QemuConfig::from_env();
        qcfg.state_dir = cfg.root_dir.clone();
        let driver: Arc<dyn Driver> = Arc::new(vmm::qemu::QemuDriver::new(qcfg));
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

    fn record_path(&self, id: &str) -> PathBuf {
        self.records.join(format!("{id}.json"))
    }

    fn load_record(&self, id: &str) -> Result<Option<Record>, BackendError> {
        let path = self.record_path(id);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|source| {
                failed("reading the VM record", id.to_owned(), VmmBackendError::Record { path, source })
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(failed("reading the VM record", id.to_owned(), io("reading", &path)(e))),
        }
    }

    fn all_records(&self) -> Result<Vec<Record>, BackendError> {
        let rd = std::fs::read_dir(&self.records)
            .map_err(|e| failed("listing VM records", self.records.display().to_string(), e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| failed("listing VM records", self.records.display().to_string(), e))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else { continue };
            if let Some(r) = self.load_record(id)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Writes `rec` atomically; `exclusive` fails with `NameInUse` when a record exists.
    fn write_record(&self, rec: &Record, exclusive: bool) -> Result<(), BackendError> {
        let path = self.record_path(&rec.id);
        let op = "writing the VM record";
        let bytes = serde_json::to_vec_pretty(rec)
            .map_err(|source| failed(op, rec.id.clone(), VmmBackendError::Record { path: path.clone(), source }))?;
        let r = if exclusive {
            foundation::write_new(&path, &bytes, foundation::PUBLIC_FILE)
        } else {
            foundation::write_atomic(&path, &bytes, foundation::PUBLIC_FILE)
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if exclusive && e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(BackendError::NameInUse { name: rec.name.clone(), id: rec.id.clone() })
            }
            Err(e) => Err(failed(op, rec.id.clone(), io("placing", &path)(e))),
        }
    }

    fn delete_record(&self, id: &str) -> Result<(), BackendError> {
        let path = self.record_path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(failed("deleting the VM record", id.to_owned(), io("deleting", &path)(e))),
        }
    }

    fn nic(&self, lease: &Lease) -> NicSpec {
        NicSpec {
            tap: lease.tap.clone(),
            mac: lease.mac.to_string(),
            netns: self.net.config().netns.clone(),
            ip_cidr: self.net.ip_cidr(lease),
            gateway: self.net.gateway().to_string(),
        }
    }

    async fn driver_vms(&self) -> Result<Vec<vmm::Vm>, BackendError> {
        self.driver.list().await.map_err(|e| failed("listing", "the hypervisors", e))
    }

    /// The driver VMs belonging to `id`: the recorded instance and any `<id>-<8 hex>`.
    fn instances<'a>(vms: &'a [vmm::Vm], id: &str, rec: Option<&Record>) -> Vec<&'a vmm::Vm> {
        vms.iter()
            .filter(|v| {
                rec.and_then(|r| r.vmm_id.as_ref()) == Some(&v.id)
                    || owner_of(v.id.as_str()) == Some(id)
                    || v.id.as_str() == id
            })
            .collect()
    }

    fn info(&self, rec: &Record, vms: &[vmm::Vm], leases: &std::collections::BTreeMap<String, Lease>) -> VmInfo {
        let inst = Self::instances(vms, &rec.id, Some(rec));
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
            id: rec.id.clone(),
            name: rec.name.clone(),
            namespace: rec.namespace.clone(),
            ip: leases.get(&rec.id).map(|l| l.ip.to_string()),
            state,
            hypervisor: rec.hypervisor,
        }
    }

    async fn list_all(&self) -> Result<Vec<VmInfo>, BackendError> {
        let vms = self.driver_vms().await?;
        let records = self.all_records()?;
        let leases = self.net.leases().map_err(|e| failed("reading", "the address leases", e))?;
        let mut out: Vec<VmInfo> = records.iter().map(|r| self.info(r, &vms, &leases)).collect();
        // Driver VMs without a record: a crash between the hypervisor start and the record.
        let known: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        for v in &vms {
            let owner = owner_of(v.id.as_str()).unwrap_or(v.id.as_str());
            let recorded = records.iter().any(|r| r.vmm_id.as_ref() == Some(&v.id));
            if !known.contains(owner) && !recorded && !out.iter().any(|i| i.id == owner) {
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
    async fn live_vm(&self, id: &str) -> Result<vmm::Vm, BackendError> {
        let rec = self.load_record(id)?.ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        let vms = self.driver_vms().await?;
        let vm = rec
            .vmm_id
            .as_ref()
            .and_then(|vid| vms.iter().find(|v| &v.id == vid && v.state == vmm::VmState::Running))
            .cloned()
            .ok_or_else(|| BackendError::NotFound { what: format!("a running hypervisor of VM {id}") })?;
        if !self.lock_attached().contains(&vm.id) {
            let vm = self.driver.attach(&vm.id).await.map_err(|e| failed("re-attaching to", id.to_owned(), e))?;
            self.lock_attached().insert(vm.id.clone());
            return Ok(vm);
        }
        Ok(vm)
    }

    /// Takes a lease and its TAP for `id`, with `policy` (`None`: the lease's own, for a VM
    /// that already has one).
    async fn network_for(&self, id: &str, policy: Option<&VmPolicy>) -> Result<Lease, BackendError> {
        let lease = match policy {
            Some(p) => self.net.allocate_with(id, p),
            None => self.net.allocate(id),
        }
        .map_err(|e| failed("leasing an address for", id.to_owned(), e))?;
        self.net.create_tap(&lease).await.map_err(|e| failed("creating the TAP of", id.to_owned(), e))?;
        Ok(lease)
    }

    /// Undoes a failed create: TAP, lease, record (best effort; logged).
    async fn undo_create(&self, id: &str) {
        if let Ok(Some(lease)) = self.net.lookup(id) {
            if let Err(e) = self.net.delete_tap(&lease.tap).await {
                tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: deleting the TAP failed");
            }
        }
        if let Err(e) = self.net.release(id) {
            tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: releasing the lease failed");
        }
        if let Err(e) = self.delete_record(id) {
            tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: deleting the record failed");
        }
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

    /// Gives a fresh clone its own kernel RNG state (host randomness + a forced CRNG reseed),
    /// before it is handed out: every clone of a snapshot resumes with the same state. A
    /// snapshot whose agent predates `reseed` is cloned with a warning (re-save it to fix);
    /// any other failure fails the clone.
    async fn reseed(&self, id: &str, vm: &vmm::Vm) -> Result<(), BackendError> {
        let op = "reseeding the guest RNG of";
        let exchange = async {
            // The restored guest's agent may take a moment to accept dials again.
            self.driver.wait_agent(vm, AGENT_CALL).await.map_err(|e| failed(op, id.to_owned(), e))?;
            let stream = self.driver.connect(vm, AGENT_PORT).await.map_err(|e| failed(op, id.to_owned(), e))?;
            match AgentConn::new(stream).reseed_from_host().await {
                Ok(()) => Ok(()),
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

    fn claim(
        &self,
        id: &str,
        name: &str,
        namespace: &str,
        hypervisor: Hypervisor,
        source: String,
    ) -> Result<(), BackendError> {
        if let Some(r) = self.load_record(id)? {
            return Err(BackendError::NameInUse { name: r.name, id: r.id });
        }
        self.write_record(
            &Record {
                id: id.to_owned(),
                name: name.to_owned(),
                namespace: Some(namespace.to_owned()),
                hypervisor,
                state: RecordState::Creating,
                vmm_id: None,
                spec: None,
                source,
                created_at_epoch_secs: now_secs(),
            },
            true,
        )
    }

    fn complete(&self, id: &str, vm: &vmm::Vm) -> Result<Record, BackendError> {
        let mut rec =
            self.load_record(id)?.ok_or_else(|| BackendError::NotFound { what: format!("record of VM {id}") })?;
        rec.state = RecordState::Created;
        rec.vmm_id = Some(vm.id.clone());
        let mut spec = vm.spec.clone();
        spec.name = id.to_owned();
        rec.spec = Some(spec);
        self.write_record(&rec, false)?;
        Ok(rec)
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
        spec.nic = Some(self.nic(&lease));
        let vm =
            self.driver.boot(&spec).await.map_err(|e| failed("booting", format!("VM {id} from {}", req.image), e))?;
        self.lock_attached().insert(vm.id.clone());
        if let Err(e) = self.complete(id, &vm) {
            let _ = self.driver.kill(&vm).await;
            return Err(e);
        }
        self.await_agent(id, &vm).await?;
        Ok(VmInfo {
            id: id.to_owned(),
            name: req.name.clone(),
            namespace: Some(req.namespace.clone()),
            ip: Some(lease.ip.to_string()),
            state: VmState::Running,
            hypervisor: req.hypervisor,
        })
    }

    async fn clone_inner(&self, id: &str, req: &CloneRequest, policy: &VmPolicy) -> Result<VmInfo, BackendError> {
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
        let opts = RestoreOptions { nic: Some(self.nic(&lease)) };
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
        if let Err(e) = self.complete(id, &vm) {
            let _ = self.driver.kill(&vm).await;
            return Err(e);
        }
        Ok(VmInfo {
            id: id.to_owned(),
            name: req.name.clone(),
            namespace: Some(req.namespace.clone()),
            ip: Some(lease.ip.to_string()),
            state: VmState::Running,
            hypervisor: req.hypervisor,
        })
    }
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
        if let Some(b) = req.storage_bytes {
            tracing::info!(vm = %id, bytes = b, "storage size ignored: the VM's writable layer is the image's");
        }
        self.claim(&id, &req.name, &req.namespace, req.hypervisor, format!("run {}", req.image))?;
        let t0 = std::time::Instant::now();
        match tracing::Instrument::instrument(self.run_inner(&id, req, size, &policy), span).await {
            Ok(v) => {
                tracing::info!(vm = %id, ip = ?v.ip, size = %size, ms = t0.elapsed().as_millis() as u64, "VM booted, agent up");
                Ok(v)
            }
            Err(e) => {
                self.undo_create(&id).await;
                Err(e)
            }
        }
    }

    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmInfo, BackendError> {
        let id = vm_id_for(&req.name);
        let span = tracing::info_span!("backend_clone", vm = %id, name = %req.name, snapshot = %req.snapshot);
        let policy =
            self.check_common(req.hypervisor, req.network.as_deref(), &req.namespace, req.shared_network.as_deref())?;
        self.claim(&id, &req.name, &req.namespace, req.hypervisor, format!("clone {}", req.snapshot))?;
        let t0 = std::time::Instant::now();
        match tracing::Instrument::instrument(self.clone_inner(&id, req, &policy), span).await {
            Ok(v) => {
                tracing::info!(vm = %id, ip = ?v.ip, ms = t0.elapsed().as_millis() as u64, "VM restored");
                Ok(v)
            }
            Err(e) => {
                self.undo_create(&id).await;
                Err(e)
            }
        }
    }

    async fn configure_network(&self, id: &str) -> Result<(), BackendError> {
        let lease = self
            .net
            .lookup(id)
            .map_err(|e| failed("reading the lease of", id.to_owned(), e))?
            .ok_or_else(|| BackendError::NotFound { what: format!("the address lease of VM {id}") })?;
        let vm = self.live_vm(id).await?;
        let argv = self.net.net_config_argv(&lease);
        let args: Vec<&str> = argv.iter().map(String::as_str).collect();
        let op = "configuring the guest network of";
        let exchange = async {
            let stream = self.driver.connect(&vm, AGENT_PORT).await.map_err(|e| failed(op, id.to_owned(), e))?;
            net_config_exec(stream, &args).await.map_err(|e| failed(op, id.to_owned(), VmmBackendError::Agent(e)))
        };
        let out = tokio::time::timeout(AGENT_CALL, exchange).await.map_err(|_| {
            failed(op, id.to_owned(), VmmBackendError::Timeout { what: "net-config", after: AGENT_CALL })
        })??;
        if out.code != 0 {
            return Err(failed(
                op,
                id.to_owned(),
                VmmBackendError::Exit {
                    argv: argv.join(" "),
                    code: out.code,
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                },
            ));
        }
        tracing::info!(vm = id, ip = %lease.ip, "guest network configured");
        Ok(())
    }

    fn network_hint(&self, vm: &VmInfo) -> Option<String> {
        let lease = self.net.lookup(&vm.id).ok().flatten()?;
        Some(self.net.net_config_argv(&lease).join(" "))
    }

    async fn inspect(&self, id: &str) -> Result<Option<VmInfo>, BackendError> {
        Ok(self.list_all().await?.into_iter().find(|v| v.id == id))
    }

    async fn list(&self) -> Result<Vec<VmInfo>, BackendError> {
        self.list_all().await
    }

    async fn start(&self, id: &str) -> Result<VmInfo, BackendError> {
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
        let mut rec = self.load_record(id)?.ok_or_else(|| BackendError::NotFound { what: format!("VM {id}") })?;
        let mut spec = rec.spec.clone().ok_or_else(|| {
            failed("starting", id.to_owned(), VmmBackendError::Invalid("the record has no boot spec".into()))
        })?;
        let lease = self.network_for(id, None).await?;
        spec.name = id.to_owned();
        spec.nic = Some(self.nic(&lease));
        if let Err(e) = self.driver.prune().await {
            tracing::debug!(vm = id, error = %crate::provider::error_chain(&e), "pruning dead VM directories failed");
        }
        let vm = self.driver.boot(&spec).await.map_err(|e| failed("starting (cold boot)", id.to_owned(), e))?;
        self.lock_attached().insert(vm.id.clone());
        rec.vmm_id = Some(vm.id.clone());
        rec.spec = Some(spec);
        if let Err(e) = self.write_record(&rec, false) {
            let _ = self.driver.kill(&vm).await;
            return Err(e);
        }
        self.await_agent(id, &vm).await?;
        tracing::info!(vm = id, instance = %vm.id, "stopped VM booted again");
        Ok(VmInfo { state: VmState::Running, ip: Some(lease.ip.to_string()), ..current })
    }

    async fn remove(&self, id: &str) -> Result<(), BackendError> {
        let rec = self.load_record(id)?;
        let vms = self.driver_vms().await?;
        for v in Self::instances(&vms, id, rec.as_ref()) {
            self.driver.kill(v).await.map_err(|e| failed("killing the hypervisor of", id.to_owned(), e))?;
            self.lock_attached().remove(&v.id);
        }
        if let Some(lease) = self.net.lookup(id).map_err(|e| failed("reading the lease of", id.to_owned(), e))? {
            self.net.delete_tap(&lease.tap).await.map_err(|e| failed("deleting the TAP of", id.to_owned(), e))?;
        }
        if let Err(e) = self.driver.prune().await {
            tracing::debug!(vm = id, error = %crate::provider::error_chain(&e), "pruning dead VM directories failed");
        }
        self.delete_record(id)?;
        tracing::info!(vm = id, existed = rec.is_some(), "VM removed");
        Ok(())
    }

    async fn snapshot_save(&self, id: &str, snapshot: &SnapshotRef, namespace: &str) -> Result<(), BackendError> {
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

    async fn snapshot_inspect(&self, snapshot: &SnapshotRef) -> Result<Option<SnapshotInfo>, BackendError> {
        let (store, r) = (self.store.clone(), snapshot.to_string());
        let target = r.clone();
        blocking("looking up", &target, move || match store.lookup(&r) {
            Ok(d) => store.manifest(&d).map(|m| match m {
                images::Manifest::Snapshot(s) => Some(SnapshotInfo { namespace: s.namespace }),
                images::Manifest::Image(_) => None,
            }),
            Err(images::ImageError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        })
        .await?
        .map_err(|e| failed("looking up", format!("snapshot {target}"), e))
    }

    async fn snapshot_rm(&self, snapshot: &SnapshotRef) -> Result<(), BackendError> {
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
        let Some(ns) = self.net.config().netns.clone() else {
            return crate::backend::tcp_probe(ip, port, timeout).await;
        };
        // The bridge and the VMs live in `VK_NETNS`: connect from a thread inside it.
        let ip = ip.to_owned();
        let connected =
            vmnet::netns::run_in(
                Some(&ns),
                move || async move { Ok(crate::backend::tcp_probe(&ip, port, timeout).await) },
            )
            .await;
        connected.unwrap_or_else(|e| {
            tracing::warn!(netns = %ns, error = %vnode::provider::error_chain(&e), "TCP probe: cannot enter the VM network namespace");
            false
        })
    }

    async fn release_ip(&self, id: &str) -> Result<(), BackendError> {
        if let Some(lease) = self.net.release(id).map_err(|e| failed("releasing the lease of", id.to_owned(), e))? {
            // remove() deleted it already; a TAP left by an interrupted remove goes too.
            if let Err(e) = self.net.delete_tap(&lease.tap).await {
                tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "deleting a leftover TAP failed");
            }
            tracing::info!(vm = id, ip = %lease.ip, "lease released");
        }
        Ok(())
    }
}

/// Runs the `guest-init net-config` argv over an agent stream, keeping at most
/// [`NET_CONFIG_OUTPUT_CAP`] bytes of its output.
async fn net_config_exec<S>(stream: S, argv: &[&str]) -> Result<silkd_client::ExecOutput, silkd_client::ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    AgentConn::new(stream).with_output_cap(NET_CONFIG_OUTPUT_CAP).exec(argv, ExecOptions::default(), b"").await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_net_config_streaming_endless_output_hits_the_cap() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use wire::codec::{encode_response, FrameSplitter};
        let (ours, mut guest) = tokio::io::duplex(64 * 1024);
        // A hostile guest agent: whatever the request, `started` and then stdout forever.
        tokio::spawn(async move {
            let mut splitter = FrameSplitter::new();
            let mut buf = vec![0; 4096];
            while splitter.next_frame().is_none() {
                match guest.read(&mut buf).await {
                    Ok(n) if n > 0 => splitter.push(&buf[..n]),
                    _ => return,
                }
            }
            let (mut rd, mut wr) = tokio::io::split(guest);
            tokio::spawn(async move { while rd.read(&mut buf).await.is_ok_and(|n| n > 0) {} });
            let started = encode_response(&wire::Response::Started { pid: 1 }).unwrap();
            let chunk = encode_response(&wire::Response::Stdout { data: wire::Bytes64(vec![b'y'; 4096]) }).unwrap();
            if wr.write_all(&started).await.is_err() {
                return;
            }
            while wr.write_all(&chunk).await.is_ok() {}
        });
        let got = net_config_exec(ours, &["/.chrysalis/guest-init", "net-config"]).await;
        assert!(
            matches!(
                got,
                Err(silkd_client::ClientError::OutputTooLarge(silkd_client::OutputTooLarge {
                    cap: NET_CONFIG_OUTPUT_CAP
                }))
            ),
            "{got:?}"
        );
    }

    #[test]
    fn ids_are_derived_from_names() {
        assert_eq!(vm_id_for("sandbox-default-cocoon-example"), "vc-sandbox-default-cocoon-example");
        for name in [
            "Upper_Case",
            "a-",
            "x".repeat(63).as_str(),
            "vk-default-very-long-pod-name-that-goes-on-and-on",
            "----",
            "ünïcode",
        ] {
            let id = vm_id_for(name);
            assert!(id.starts_with(ID_PREFIX) && id.len() <= MAX_ID, "{name} → {id}");
            assert!(VmId::new(id.as_str()).is_ok() && !id.ends_with('-'), "{name} → {id}");
            assert_eq!(vm_id_for(name), id, "deterministic");
            // The driver's generated instance ids map back to the owner.
            let inst = VmId::generate(&id);
            assert_eq!(owner_of(inst.as_str()), Some(id.as_str()), "{inst}");
        }
        assert_ne!(vm_id_for("Upper_Case"), vm_id_for("upper-case"));
        assert_eq!(owner_of("base-0a1b2c3d"), None, "not ours");
        assert_eq!(owner_of("vc-x-0a1b2c3"), None);
        assert_eq!(owner_of("vc-x-0A1B2C3D"), None);
    }

    #[test]
    fn records_keep_their_namespace_and_old_records_read_as_none() {
        let old = r#"{"id":"vc-a","name":"a","hypervisor":"qemu","state":"created","source":"run x","created_at_epoch_secs":1}"#;
        let rec: Record = serde_json::from_str(old).unwrap();
        assert_eq!(rec.namespace, None, "a record from before namespaces were recorded");
        let mut new = rec.clone();
        new.namespace = Some("team-a".into());
        let back: Record = serde_json::from_slice(&serde_json::to_vec(&new).unwrap()).unwrap();
        assert_eq!(back.namespace.as_deref(), Some("team-a"));
    }

    #[test]
    fn sizes() {
        assert_eq!(size_for(1, 512), Some(SizeClass::Small));
        assert_eq!(size_for(1, 513), Some(SizeClass::Medium));
        assert_eq!(size_for(3, 512), Some(SizeClass::Large));
        assert_eq!(size_for(4, 8192), Some(SizeClass::XLarge));
        assert_eq!(size_for(9, 1), None);
    }

    #[test]
    fn network_policy() {
        assert_eq!(vm_policy(None, "ns", None, false).unwrap(), VmPolicy::default(), "no group, no egress");
        assert_eq!(vm_policy(Some("default"), "ns", None, true).unwrap(), VmPolicy::default());
        let p = vm_policy(Some("egress"), "team-a", Some("g1"), true).unwrap();
        assert_eq!(p, VmPolicy { group: Some("team-a/g1".into()), egress: true }, "the group is scoped by namespace");
        let e = vm_policy(Some("egress"), "ns", None, false).unwrap_err();
        assert!(matches!(&e, BackendError::Unsupported { what } if what.contains("VK_NET_UPLINK")), "{e}");
        assert!(matches!(vm_policy(Some("lan"), "ns", None, true), Err(BackendError::Unsupported { .. })));
    }

    #[test]
    fn config_from_env() {
        let none = |_: &str| None;
        let c = BackendConfig::from_lookup(&none, Path::new("/r")).unwrap();
        assert_eq!(c.images_dir, PathBuf::from("/r/images"));
        assert_eq!(c.bridge, "chrysalis0");
        assert_eq!(c.cidr.to_string(), "10.88.0.0/24");
        assert_eq!(c.netns, None);
        assert_eq!(c.leases_path(), PathBuf::from("/r/net/leases.json"));
        assert_eq!(c.boot_timeout, Duration::from_secs(300));
        assert_eq!(c.filter, FilterPolicy::default(), "VMs reach nothing by default");
        let env = |k: &str| {
            match k {
                "VK_BRIDGE" => Some("br-t"),
                "VK_VM_CIDR" => Some("10.9.0.0/16"),
                "VK_NETNS" => Some("vkc-e2e-1"),
                "CHRYSALIS_IMAGES" => Some("/lib/img"),
                "VK_BOOT_TIMEOUT" => Some("60"),
                "VK_NET_HOST_ALLOW" => Some("udp/53,tcp/8053"),
                "VK_NET_UPLINK" => Some("eno1"),
                "VK_NET_REFUSE" => Some("203.0.113.0/24"),
                _ => None,
            }
            .map(String::from)
        };
        let c = BackendConfig::from_lookup(&env, Path::new("/r")).unwrap();
        assert_eq!(
            (c.bridge.as_str(), c.cidr.to_string(), c.netns.as_deref()),
            ("br-t", "10.9.0.0/16".into(), Some("vkc-e2e-1"))
        );
        assert_eq!(c.images_dir, PathBuf::from("/lib/img"));
        assert_eq!(c.boot_timeout, Duration::from_secs(60));
        assert_eq!(
            c.filter,
            FilterPolicy::parse(Some("tcp/8053,udp/53"), Some("eno1"), Some("203.0.113.0/24")).unwrap()
        );
        for (var, value) in [
            ("VK_NET_HOST_ALLOW", "53"),
            ("VK_NET_UPLINK", "a/b"),
            ("VK_NET_REFUSE", "example.com"),
            ("VK_VM_CIDR", "10.88.0.1/24"),
            ("VK_VM_CIDR", "10.88.0.0/31"),
            ("VK_VM_CIDR", "nope"),
            ("VK_BRIDGE", "a-bridge-name-too-long"),
            ("VK_NETNS", "../x"),
            ("VK_BOOT_TIMEOUT", "0"),
        ] {
            let get = move |k: &str| (k == var).then(|| value.to_owned());
            let e = BackendConfig::from_lookup(&get, Path::new("/r")).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{var}=")), "{e}");
        }
    }
}

//! [`VmBackend`]: every VM operation the provider needs, and nothing else. The provider never
//! spawns a hypervisor, touches an image or a TAP device itself; it calls this trait.
//!
//! The production implementation (over `vmm` drivers, the `images` library and `vmnet`) is
//! [`crate::vmm_backend::VmmBackend`], outside the provider logic; `test_utils::FakeBackend` is the in-memory
//! double the unit tests use.
//!
//! # Contract every implementation keeps
//! * **Scope.** A backend sees only the VMs *it* created (its own state directory under
//!   `COCOON_ROOT_DIR`), never other VMs on the host (sandboxd's warm pool): [`VmBackend::list`]
//!   feeds the orphan policy, which may destroy what it lists.
//! * **Names are durable and unique.** `name` (the Pod's `vm.cocoonstack.io/name`) is recorded
//!   with the VM so that [`VmBackend::list`] reports it after a provider crash; a second VM with
//!   a name in use is refused ([`BackendError::NameInUse`]).
//! * **Owners are durable.** The Pod's namespace (`namespace` of [`RunRequest`] /
//!   [`CloneRequest`], of [`VmBackend::snapshot_save`]) is recorded with the VM and the snapshot
//!   and reported by [`VmBackend::list`] / [`VmBackend::snapshot_inspect`]; `None` only for
//!   records written without one (see [`crate::namespaces`]). The backend records; the provider
//!   decides who may use what.
//! * **VMs outlive the provider.** Hypervisors run daemonized: a killed (even `kill -9`)
//!   provider leaves them running, and a new provider finds them with [`VmBackend::list`].
//! * **Idempotent teardown.** [`VmBackend::remove`], [`VmBackend::snapshot_rm`] and
//!   [`VmBackend::release_ip`] succeed when the thing is already gone.
//! * **Compare-and-delete.** [`VmBackend::snapshot_rm_if`] removes a name only while it still
//!   names the content [`VmBackend::library`] listed, checked and removed atomically against
//!   saves of that name.
//! * **A failed listing is an error, never an empty list** (`docs/virtual-node.md` §5 pitfall 2).
//! * Calls may run concurrently for different VMs; the provider never runs two calls for one
//!   VM at once except [`VmBackend::inspect`] / [`VmBackend::probe_agent`] next to others.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The hypervisor a VM runs under (`vm.cocoonstack.io/backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Hypervisor {
    /// `cloud-hypervisor` (production, KVM).
    #[serde(rename = "cloud-hypervisor")]
    CloudHypervisor,
    /// `qemu` (`-M microvm`; the only choice under TCG).
    #[serde(rename = "qemu")]
    Qemu,
}

impl Hypervisor {
    /// The annotation spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Hypervisor::CloudHypervisor => "cloud-hypervisor",
            Hypervisor::Qemu => "qemu",
        }
    }
}

impl fmt::Display for Hypervisor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot in the image library, `repo:tag` (the repo may carry a registry host with a
/// port: only a `:` after the last `/` starts the tag).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SnapshotRef {
    pub repo: String,
    pub tag: String,
}

/// The tag a bare repo means, and the tag DeletePod saves under.
pub const LATEST: &str = "latest";

/// A snapshot reference that is empty or malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a snapshot reference repo[:tag] (e.g. my-vm or my-vm:latest)")]
pub struct SnapshotRefError(pub String);

impl SnapshotRef {
    /// `repo:tag`.
    pub fn new(repo: impl Into<String>, tag: impl Into<String>) -> SnapshotRef {
        SnapshotRef { repo: repo.into(), tag: tag.into() }
    }

    /// `<repo>:latest`.
    pub fn latest(repo: impl Into<String>) -> SnapshotRef {
        SnapshotRef::new(repo, LATEST)
    }
}

impl FromStr for SnapshotRef {
    type Err = SnapshotRefError;

    /// `repo[:tag]`; a bare `repo` means `repo:latest`.
    fn from_str(s: &str) -> Result<SnapshotRef, SnapshotRefError> {
        let s = s.trim();
        let bad = || SnapshotRefError(s.to_owned());
        if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) || s.contains('@') {
            return Err(bad());
        }
        let last_slash = s.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (repo, tag) = match s[last_slash..].rfind(':') {
            Some(i) => (&s[..last_slash + i], &s[last_slash + i + 1..]),
            None => (s, LATEST),
        };
        if repo.is_empty() || tag.is_empty() || repo.ends_with('/') {
            return Err(bad());
        }
        Ok(SnapshotRef::new(repo, tag))
    }
}

impl fmt::Display for SnapshotRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.repo, self.tag)
    }
}

/// Where a VM is, as the backend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Being booted or restored (a VM still `Creating` when a provider starts was left by a
    /// crashed create: nothing is creating it any more).
    Creating,
    /// The hypervisor process is alive.
    Running,
    /// The record exists but the hypervisor exited (crash, guest poweroff, host OOM kill);
    /// [`VmBackend::start`] boots it again.
    Stopped,
}

/// One VM the backend manages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// Backend-generated, unique for the VM's life (`[a-z0-9-]`, ≤ 63 chars); written to the
    /// Pod as `vm.cocoonstack.io/id`.
    pub id: String,
    /// The Pod's `vm.cocoonstack.io/name`, recorded durably with the VM.
    pub name: String,
    /// The namespace owning the VM (its creating Pod's), recorded durably with it; `None`: a
    /// record written before namespaces were recorded.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The guest's IPv4 address from the VM's network lease, when it has one.
    pub ip: Option<String>,
    pub state: VmState,
    pub hypervisor: Hypervisor,
}

/// What one running VM uses (for `kubectl top`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUsage {
    /// CPU time used since it started, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// Memory working set on the host, bytes.
    pub memory_working_set_bytes: u64,
    /// When measured.
    pub measured_at: std::time::SystemTime,
    /// When its hypervisor started, if known.
    pub started_at: Option<std::time::SystemTime>,
}

/// `mode: run`: boot `image` fresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRequest {
    /// `vm.cocoonstack.io/name`.
    pub name: String,
    /// The Pod's namespace: the VM's owner.
    pub namespace: String,
    /// An image reference the image library resolves (a catalog name or alias, `repo[:tag]`).
    pub image: String,
    /// Guest vCPUs (≥ 1): the Pod's CPU limit rounded up, else its request. A backend with
    /// fixed size classes picks the smallest class that fits both numbers.
    pub vcpus: u32,
    /// Guest memory in MiB (≥ 1): the Pod's memory request, else its limit.
    pub memory_mib: u64,
    /// Writable disk size in bytes (`cocoonset.cocoonstack.io/storage`); `None` = the image's.
    pub storage_bytes: Option<u64>,
    /// Network name (`cocoonset.cocoonstack.io/network`); `None` = the default network.
    pub network: Option<String>,
    /// The shared network group (`vm.cocoonstack.io/shared-network`), scoped by `namespace`.
    pub shared_network: Option<String>,
    pub hypervisor: Hypervisor,
}

/// `mode: clone` (the default): restore a snapshot under a new identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneRequest {
    /// `vm.cocoonstack.io/name`.
    pub name: String,
    /// The Pod's namespace: the new VM's owner (not the snapshot's, which may differ when
    /// namespaces share).
    pub namespace: String,
    /// The snapshot to restore.
    pub snapshot: SnapshotRef,
    /// Network name; `None` = the default network.
    pub network: Option<String>,
    /// The shared network group, scoped by `namespace`.
    pub shared_network: Option<String>,
    /// Must match the hypervisor that wrote the snapshot, else [`BackendError::Unsupported`].
    pub hypervisor: Hypervisor,
    /// The restored guest keeps the address it was saved with (a wake from hibernation): the
    /// VM comes back under the id of its name ([`VmBackend::vm_id_of`]) with the lease that id
    /// already holds, and a failed restore leaves a lease that existed before the call in
    /// place (the guest of the next attempt still carries its address).
    pub keep_lease: bool,
}

/// A snapshot in the library, as [`VmBackend::snapshot_inspect`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The namespace owning it; `None`: saved without one.
    pub namespace: Option<String>,
    /// The image the saved VM was booted from, as [`VmBackend::base_image_of`] names images
    /// (the production backend: the digest of its image manifest); `None`: not recorded.
    pub base_image: Option<String>,
}

/// One snapshot in the library, as [`VmBackend::library`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub reference: SnapshotRef,
    /// The namespace owning it; `None`: saved without one (never written by this provider).
    pub namespace: Option<String>,
    /// When it was saved.
    pub created: std::time::SystemTime,
    /// Disk bytes of its own files (not its base image's).
    pub disk_bytes: u64,
    /// A live VM of the library uses its content (a clone restored from it).
    pub in_use: bool,
    /// What the name pointed at when listed, opaque (the production backend: the digest of the
    /// snapshot manifest; a new save under the name changes it): the `expected` of
    /// [`VmBackend::snapshot_rm_if`].
    pub content: String,
}

/// The image library as [`VmBackend::library`] sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Library {
    /// Every snapshot.
    pub snapshots: Vec<SnapshotEntry>,
    /// Disk bytes of every image's own files.
    pub image_disk_bytes: u64,
}

/// Why a backend call failed. The provider shows the chain on the Pod, so each variant names
/// its object.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// An image, snapshot or VM that does not exist.
    #[error("{what} does not exist")]
    NotFound { what: String },
    /// Another VM already carries this name.
    #[error("VM name {name} is already used by VM {id}")]
    NameInUse { name: String, id: String },
    /// The request cannot be served on this host (e.g. a snapshot written by another
    /// hypervisor, a hypervisor this host cannot run).
    #[error("{what}")]
    Unsupported { what: String },
    /// The operation failed.
    #[error("{op} {target}")]
    Failed {
        op: &'static str,
        target: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl BackendError {
    /// `op` on `target` failed because of `source`.
    pub fn failed(
        op: &'static str,
        target: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> BackendError {
        BackendError::Failed { op, target: target.into(), source: source.into() }
    }
}

/// The VM operations of vk-cocoon. Object safe; the provider holds an `Arc<dyn VmBackend>`.
#[async_trait::async_trait]
pub trait VmBackend: Send + Sync + 'static {
    /// The hypervisors this host can run, preferred first (never empty). The first is the
    /// default of `vm.cocoonstack.io/backend`; here (TCG only) that is `[Qemu]`.
    fn hypervisors(&self) -> Vec<Hypervisor>;

    /// Boots a new VM named `req.name` from `req.image`, with a fresh network lease (TAP, MAC,
    /// IP) attached. Returns once the hypervisor runs (the guest agent may still be booting).
    /// On error nothing is left behind (no VM record, no lease).
    async fn run(&self, req: &RunRequest) -> Result<VmInfo, BackendError>;

    /// Restores `req.snapshot` as a new VM named `req.name` with a fresh lease. The guest
    /// still carries the source's network configuration until [`VmBackend::configure_network`]
    /// runs. `NotFound` when the snapshot is missing; nothing is left behind on error, except
    /// a lease that existed before the call when `req.keep_lease` is set.
    /// (Not `clone_from`: that name collides with `Clone::clone_from` on `Arc<dyn VmBackend>`.)
    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmInfo, BackendError>;

    /// Applies the VM's own lease inside the guest (agent exec of `/.chrysalis/guest-init
    /// net-config <ip/prefix> <gw> <mac>`). Idempotent; fails while the agent is unreachable,
    /// and the provider retries it (every 3 s, ≤ 180 s) after a clone.
    async fn configure_network(&self, id: &str) -> Result<(), BackendError>;

    /// The guest command [`VmBackend::configure_network`] runs for `vm`, for a human to run
    /// when automatic configuration gave up (written base64-encoded as
    /// `vm.cocoonstack.io/post-clone-hint`). `None`: no hint.
    fn network_hint(&self, _vm: &VmInfo) -> Option<String> {
        None
    }

    /// The id a VM named `name` has on this backend whether or not it exists now (a
    /// hibernated VM's lease stays under it), when the backend's ids follow from names;
    /// `None` when it cannot tell. The provider trusts this, never a Pod's
    /// `vm.cocoonstack.io/id`, to name a lease it releases.
    fn vm_id_of(&self, _name: &str) -> Option<String> {
        None
    }

    /// The VM with this id; `Ok(None)` only when the backend is sure it does not exist.
    async fn inspect(&self, id: &str) -> Result<Option<VmInfo>, BackendError>;

    /// Every VM this backend manages, whatever its state. An error when the listing is
    /// incomplete — never a partial or empty list standing in for a failure.
    async fn list(&self) -> Result<Vec<VmInfo>, BackendError>;

    /// Boots a `Stopped` VM again from its own disks with its existing lease (a cold boot);
    /// a `Running` VM is returned as is.
    async fn start(&self, id: &str) -> Result<VmInfo, BackendError>;

    /// Stops the hypervisor (forcefully) and deletes the VM's record and disks. The network
    /// lease is *not* released (see [`VmBackend::release_ip`]). An absent VM is success.
    async fn remove(&self, id: &str) -> Result<(), BackendError>;

    /// Saves the running VM's memory and disk state into the library as `snapshot`, owned by
    /// `namespace`, replacing an existing snapshot of that name atomically (the old one stays
    /// until the new one is complete). The VM keeps running afterwards.
    async fn snapshot_save(&self, id: &str, snapshot: &SnapshotRef, namespace: &str) -> Result<(), BackendError>;

    /// The snapshot `snapshot` if the library holds one under that name (`Ok(None)`: none, or
    /// the name is an image's).
    async fn snapshot_inspect(&self, snapshot: &SnapshotRef) -> Result<Option<SnapshotInfo>, BackendError>;

    /// The image a VM started from `source` (an image or snapshot reference, as a
    /// [`RunRequest`] or [`CloneRequest`] names it) runs: an image's own identity, a snapshot's
    /// base image, comparable with [`SnapshotInfo::base_image`]. `Ok(None)`: the library holds
    /// no `source` (or records no base image for it).
    async fn base_image_of(&self, source: &str) -> Result<Option<String>, BackendError>;

    /// Deletes `snapshot` from the library (its content is garbage-collected when no VM uses
    /// it). An absent snapshot is success.
    async fn snapshot_rm(&self, snapshot: &SnapshotRef) -> Result<(), BackendError>;

    /// Deletes `snapshot` only while the name still points at `expected` (a
    /// [`SnapshotEntry::content`]), checked and removed atomically with respect to
    /// [`VmBackend::snapshot_save`] of that name: `Ok(true)` removed; `Ok(false)` the name now
    /// points at other content (saved again since), or at nothing, and nothing was removed.
    /// Never removes an image of the name.
    async fn snapshot_rm_if(&self, snapshot: &SnapshotRef, expected: &str) -> Result<bool, BackendError>;

    /// Every snapshot of the library, with the disk its images take (the snapshot GC,
    /// `crate::gc`). An error when the listing is incomplete, never a partial list.
    async fn library(&self) -> Result<Library, BackendError>;

    /// Collects the library's content that no name and no live VM uses any more (after
    /// [`VmBackend::snapshot_rm`] untagged snapshots); returns the disk bytes freed.
    async fn collect_garbage(&self) -> Result<u64, BackendError>;

    /// One guest-agent round trip (silkd `info`); `Ok` means the agent answered.
    async fn probe_agent(&self, id: &str) -> Result<(), BackendError>;

    /// One TCP connect to a VM's `ip:port` within `timeout`, from where the VMs' network is
    /// (a backend whose bridge lives in another network namespace connects from there).
    async fn probe_tcp(&self, ip: &str, port: u16, timeout: std::time::Duration) -> bool {
        tcp_probe(ip, port, timeout).await
    }

    /// Returns the VM's network lease (IP, MAC, TAP) to the pool. Called after
    /// [`VmBackend::remove`]; a lease already released (or never taken) is success.
    async fn release_ip(&self, id: &str) -> Result<(), BackendError>;

    /// What the running VMs among `ids` use now, by id; a VM that does not run or cannot be
    /// measured is left out. The default measures nothing.
    async fn usage(&self, _ids: &[String]) -> Result<Vec<(String, VmUsage)>, BackendError> {
        Ok(Vec::new())
    }

    /// A fresh byte stream to the guest agent of the running VM `id` (`kubectl exec`,
    /// `port-forward`). The default has no agents to reach.
    async fn dial_agent(&self, id: &str) -> Result<vnode::streams::AgentIo, BackendError> {
        Err(BackendError::Unsupported { what: format!("this backend cannot reach the guest agent of VM {id}") })
    }

    /// The console log of the running VM `id` (`kubectl logs`, `attach`): a `vmm::console`
    /// log. The default has none.
    async fn console_log(&self, id: &str) -> Result<std::path::PathBuf, BackendError> {
        Err(BackendError::Unsupported { what: format!("this backend keeps no console of VM {id}") })
    }
}

/// One TCP connect to `ip:port` within `timeout` (the default [`VmBackend::probe_tcp`]).
pub(crate) async fn tcp_probe(ip: &str, port: u16, timeout: std::time::Duration) -> bool {
    let Ok(ip) = ip.parse::<std::net::IpAddr>() else { return false };
    let connect = tokio::net::TcpStream::connect(std::net::SocketAddr::new(ip, port));
    matches!(tokio::time::timeout(timeout, connect).await, Ok(Ok(_)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[tokio::test]
    async fn tcp_probe_connects_or_not() {
        let timeout = std::time::Duration::from_secs(1);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(tcp_probe("127.0.0.1", port, timeout).await);
        drop(l);
        assert!(!tcp_probe("127.0.0.1", port, timeout).await);
        assert!(!tcp_probe("not-an-ip", port, timeout).await);
    }

    #[test]
    fn snapshot_refs() {
        for (s, repo, tag) in [
            ("my-vm", "my-vm", "latest"),
            ("my-vm:v2", "my-vm", "v2"),
            ("ghcr.io/x/rt:24.04", "ghcr.io/x/rt", "24.04"),
            ("registry:5000/x/rt", "registry:5000/x/rt", "latest"),
            ("registry:5000/x/rt:t", "registry:5000/x/rt", "t"),
        ] {
            assert_eq!(s.parse::<SnapshotRef>().unwrap(), SnapshotRef::new(repo, tag), "{s}");
        }
        for bad in ["", " ", "a:", ":t", "a b", "x/", "r@sha256:00"] {
            assert!(bad.parse::<SnapshotRef>().is_err(), "{bad:?}");
        }
        assert_eq!(SnapshotRef::latest("vm-a").to_string(), "vm-a:latest");
    }

    #[test]
    fn backend_is_object_safe() {
        fn takes(_: Option<std::sync::Arc<dyn VmBackend>>) {}
        takes(None);
        assert_eq!(Hypervisor::CloudHypervisor.to_string(), "cloud-hypervisor");
    }
}

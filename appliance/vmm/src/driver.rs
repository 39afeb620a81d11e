//! The hypervisor driver trait and the types every driver shares.
//!
//! A [`Driver`] boots microVMs from a [`BootSpec`], reaches their guest agent over the
//! hybrid-vsock convention ([`crate::agent::dial`] on [`Vm::vsock_socket`]), pauses,
//! snapshots, clones ([`Driver::restore`]) and stops them. Each VM has one JSON
//! record `<state_dir>/vms/<id>/vm.json` ([`crate::record`]), written before its hypervisor is
//! spawned and advanced through [`VmState`] ([`crate::lifecycle`]), holding enough to find and
//! kill it, or re-attach, after our own process restarted ([`Driver::list`], [`Driver::attach`]).
//!
//! Guarantees every implementation keeps:
//! - no hypervisor process outlives [`Driver::shutdown`], [`Driver::kill`] or a failed
//!   [`Driver::boot`] / [`Driver::restore`];
//! - [`Driver::list`] reports an error as an error, never as an empty list;
//! - a hypervisor whose owner process died mid-boot/-restore is still listed (`creating`) and
//!   [`Driver::kill`]able; a VM directory some live process names is never deleted.

use std::fmt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub use crate::accel::{Accel, AccelPreference};
pub use crate::agent::AgentInfo;
use crate::agent::DialError;
use crate::catalog::{Catalog, CatalogError};
pub use crate::id::{VmId, VmIdError};
use crate::jail::CpuWeight;
use crate::record::RecordError;
pub use crate::size::SizeClass;

/// The guest-agent (silkd) vsock port.
pub const AGENT_PORT: u32 = 2048;

/// Which hypervisor a driver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// QEMU `-M microvm`, controlled over QMP; agent over virtio-serial + agent-mux.
    Qemu,
    /// cloud-hypervisor, controlled over its REST API; agent over hybrid vsock.
    CloudHypervisor,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Qemu => "qemu",
            Backend::CloudHypervisor => "cloud-hypervisor",
        })
    }
}

/// Everything needed to boot one VM from a built template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootSpec {
    /// Template name (after alias resolution), e.g. `base`, `rt`.
    pub name: String,
    /// Uncompressed PVH `vmlinux`.
    pub kernel: PathBuf,
    /// Initramfs (cpio, maybe gzipped) holding `/init` and `silkd`.
    pub initrd: PathBuf,
    /// Read-only root disk (erofs), attached as the first virtio-blk disk `/dev/vda`.
    pub rootfs: Option<PathBuf>,
    /// Empty ext4 image; each VM gets a writable copy-on-write overlay on it as `/dev/vdb`.
    pub overlay_base: Option<PathBuf>,
    /// The size of that writable overlay in bytes, when it must be larger than its base (the
    /// guest sees a larger `/dev/vdb`; growing its filesystem is the guest's business); `None`:
    /// the base's size. Smaller than the base is refused at boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay_bytes: Option<u64>,
    /// Extra kernel command-line arguments from the template (the driver adds console etc.).
    pub cmdline: String,
    /// vCPUs and memory.
    pub size: SizeClass,
    /// Which accelerator to use; `Auto` probes.
    #[serde(default)]
    pub accel: AccelPreference,
    /// A network interface (virtio-net on a host TAP), if the VM gets one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic: Option<NicSpec>,
    /// A `virtio-rng` device fed from the host's kernel RNG (rate-limited to
    /// [`RNG_BYTES_PER_SEC`]). Specs recorded before it existed read `false`, so their VMs and
    /// snapshots keep the device layout they were started with.
    #[serde(default)]
    pub rng: bool,
    /// A controller volumes hot-plug onto (QEMU: `virtio-scsi`, the microvm machine has no PCI
    /// hotplug; cloud-hypervisor plugs PCI disks and needs none). Specs recorded before
    /// volumes existed read `false`, keeping their device layout; such a VM takes no volume.
    #[serde(default)]
    pub volumes: bool,
    /// Where the guest's RAM lives ([`Ram`]). Specs recorded before it existed read
    /// `anonymous`, keeping the RAM block their snapshots name.
    #[serde(default, skip_serializing_if = "Ram::is_anonymous")]
    pub ram: Ram,
}

/// Where a VM's RAM lives. What a snapshot holds follows from it: the RAM of a `shared_file`
/// VM stays in its file (the snapshot keeps the file as `memory`, the migration stream skips
/// it), and every clone of such a snapshot maps that file copy-on-write, so the pages a clone
/// has not written are one copy on the host however many clones run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ram {
    /// Anonymous memory in the hypervisor's default RAM block.
    #[default]
    Anonymous,
    /// A file of the VM's own, mapped shared: the golden a pool's clones share.
    SharedFile,
    /// A named, private RAM block: a clone of a `shared_file` snapshot (the golden's file
    /// mapped copy-on-write), or a VM restored from a snapshot of such a clone.
    Private,
}

impl Ram {
    /// The default (for `skip_serializing_if`).
    pub fn is_anonymous(&self) -> bool {
        *self == Ram::Anonymous
    }

    /// The RAM of a VM restored from a snapshot of a VM with this RAM.
    pub fn restored(self) -> Ram {
        match self {
            Ram::Anonymous => Ram::Anonymous,
            Ram::SharedFile | Ram::Private => Ram::Private,
        }
    }
}

/// The most volumes one VM holds at once (SCSI targets 1..=MAX_VOLUMES).
pub const MAX_VOLUMES: u16 = 16;

/// A volume to hot-plug: a raw disk image on the host, and the slot (SCSI target) it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeAttach {
    /// The slot, 1..=[`MAX_VOLUMES`]; the guest finds the disk by it.
    pub slot: u16,
    /// The raw image file.
    pub path: PathBuf,
    /// Plugged read-only.
    pub read_only: bool,
}

/// The most bytes per second a VM's `virtio-rng` draws from the host.
pub const RNG_BYTES_PER_SEC: u32 = 64 * 1024;

/// One virtio-net NIC backed by a persistent host TAP (made by the `vmnet` crate), plus the
/// guest's address, passed on the kernel command line as `chrysalis.ip=<ip_cidr>
/// chrysalis.gw=<gateway> chrysalis.mac=<mac>` (guest-init configures `eth0` from it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// Host TAP device name (≤ 15 chars); QEMU opens it by name.
    pub tap: String,
    /// Guest MAC, `xx:xx:xx:xx:xx:xx`.
    pub mac: String,
    /// Named network namespace (`/run/netns/<name>`) holding the TAP; the hypervisor is started
    /// inside it. `None` = the caller's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// Guest address with prefix, e.g. `10.88.0.5/24`.
    pub ip_cidr: String,
    /// Default gateway, e.g. `10.88.0.1`.
    pub gateway: String,
}

impl NicSpec {
    /// Checks every field's syntax (they end up on QEMU's and the kernel's command lines).
    pub fn validate(&self) -> Result<(), DriverError> {
        let bad = |what: &str, v: &str| Err(DriverError::Invalid(format!("nic: {what} {v:?} is malformed")));
        let ifname_ok = !self.tap.is_empty()
            && self.tap.len() < 16
            && self.tap.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ifname_ok || self.tap == "." || self.tap == ".." {
            return bad("tap name", &self.tap);
        }
        let mac: Vec<&str> = self.mac.split(':').collect();
        if mac.len() != 6 || !mac.iter().all(|o| o.len() == 2 && o.bytes().all(|b| b.is_ascii_hexdigit())) {
            return bad("mac", &self.mac);
        }
        if u8::from_str_radix(mac[0], 16).map(|b| b & 1 == 1).unwrap_or(true) {
            return bad("mac (multicast)", &self.mac);
        }
        if let Some(ns) = &self.netns {
            let ok = !ns.is_empty()
                && ns.len() <= 64
                && ns != "."
                && ns != ".."
                && ns.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            if !ok {
                return bad("netns name", ns);
            }
        }
        let Some((ip, prefix)) = self.ip_cidr.split_once('/') else { return bad("ip_cidr", &self.ip_cidr) };
        let prefix_ok = prefix.parse::<u8>().is_ok_and(|p| (1..=30).contains(&p)) && !prefix.starts_with('0');
        if ip.parse::<std::net::Ipv4Addr>().is_err() || !prefix_ok {
            return bad("ip_cidr", &self.ip_cidr);
        }
        if self.gateway.parse::<std::net::Ipv4Addr>().is_err() {
            return bad("gateway", &self.gateway);
        }
        Ok(())
    }

    /// The namespace file, if any: `/run/netns/<netns>`.
    pub fn netns_path(&self) -> Option<PathBuf> {
        self.netns.as_ref().map(|n| Path::new("/run/netns").join(n))
    }

    /// The guest kernel arguments: `chrysalis.ip=… chrysalis.gw=… chrysalis.mac=…`.
    pub fn kernel_args(&self) -> String {
        format!("chrysalis.ip={} chrysalis.gw={} chrysalis.mac={}", self.ip_cidr, self.gateway, self.mac)
    }
}

/// Options of [`Driver::restore_with`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreOptions {
    /// The clone's own NIC. Required when the snapshot's VM had one (the clone cannot share the
    /// parent's TAP); not allowed when it had none. The guest keeps the parent's MAC and address
    /// until it is re-addressed (`guest-init net-config <ip/prefix> <gw> <mac>` through the agent).
    pub nic: Option<NicSpec>,
}

impl RestoreOptions {
    /// Checks these options against `snapshot`: a clone has a NIC iff its parent had one (the
    /// saved device set holds it); its TAP is the parent's only once the parent is gone.
    pub fn check_against(&self, snapshot: &Snapshot) -> Result<(), DriverError> {
        match (&snapshot.spec.nic, &self.nic) {
            (Some(_), None) => Err(DriverError::Invalid(format!(
                "snapshot {} has a NIC: restore it with RestoreOptions {{ nic: Some(the clone's own) }}",
                snapshot.dir.display()
            ))),
            (None, Some(_)) => Err(DriverError::Invalid(format!(
                "snapshot {} has no NIC: a clone cannot add one",
                snapshot.dir.display()
            ))),
            (_, Some(nic)) => nic.validate(),
            (None, None) => Ok(()),
        }
    }
}

impl BootSpec {
    /// Builds a spec from the catalog entry for `name_or_alias` (alias resolved) at `size`,
    /// with the accelerator preference from `CHRYSALIS_ACCEL` (default `auto`).
    pub fn from_template(catalog: &Catalog, name_or_alias: &str, size: SizeClass) -> Result<Self, CatalogError> {
        let (name, t) = catalog.resolve(name_or_alias)?;
        Ok(BootSpec {
            overlay_bytes: None,
            name: name.to_string(),
            kernel: t.kernel.clone(),
            initrd: t.initrd.clone(),
            rootfs: t.rootfs.clone(),
            overlay_base: t.overlay_base.clone(),
            cmdline: t.cmdline.clone(),
            size,
            accel: AccelPreference::from_env(),
            nic: None,
            rng: true,
            volumes: true,
            ram: Ram::Anonymous,
        })
    }
}

/// Where a VM is in its lifecycle ([`crate::lifecycle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// The driver is booting or restoring it; the hypervisor pid may not be recorded yet
    /// (`pid == 0`) and the QMP / agent sockets may not exist. Only [`Driver::kill`] (or
    /// [`Driver::shutdown`], which then kills) applies.
    Creating,
    /// Boot or restore completed. Records written before lifecycle states existed load as this.
    #[default]
    Running,
}

/// One VM a driver started (or re-attached to). Serialised as `vm.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    /// The VM id (also its directory name under `<state_dir>/vms/`).
    pub id: VmId,
    /// The hypervisor running it.
    pub backend: Backend,
    /// The accelerator actually used.
    pub accel: Accel,
    /// The hypervisor process id.
    pub pid: u32,
    /// Start time of `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot), to defeat pid reuse.
    pub pid_start_time: u64,
    /// `<state_dir>/vms/<id>/`.
    pub dir: PathBuf,
    /// The hypervisor's control socket (QMP for QEMU, REST API for cloud-hypervisor).
    pub control_socket: PathBuf,
    /// Hybrid-vsock Unix socket: connect, write `CONNECT <port>\n`, read `OK …\n`.
    pub vsock_socket: PathBuf,
    /// Serial console log: the current segment of a size-capped log (`<path>.1` holds the
    /// previous one). Read it with [`crate::console::tail`] / [`crate::console::tail_text`].
    pub console_log: PathBuf,
    /// The spec it was booted from (for a clone: the parent's).
    pub spec: BootSpec,
    /// Snapshot directory this VM was restored from, if it is a clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_from: Option<PathBuf>,
    /// Wall-clock creation time, seconds since the Unix epoch.
    pub created_at_epoch_secs: u64,
    /// Lifecycle state; absent in old records, which mean `running`.
    #[serde(default)]
    pub state: VmState,
}

/// A VM's saved state on disk: `<dir>/snapshot.json` plus backend-specific files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Directory holding the snapshot.
    pub dir: PathBuf,
    /// The backend that wrote it (only that backend can restore it).
    pub backend: Backend,
    /// Accelerator of the source VM (restore must use the same).
    pub accel: Accel,
    /// The id of the VM the snapshot was taken from.
    pub source: VmId,
    /// The source VM's boot spec.
    pub spec: BootSpec,
    /// Writable disk state of the source at snapshot time (inside `dir`), if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<PathBuf>,
    /// Wall-clock creation time, seconds since the Unix epoch.
    pub created_at_epoch_secs: u64,
}

impl Snapshot {
    /// File name of the snapshot description inside [`Snapshot::dir`].
    pub const FILE: &'static str = "snapshot.json";

    /// Reads `<dir>/snapshot.json`.
    pub fn load(dir: &Path) -> Result<Self, RecordError> {
        crate::record::read_json(&dir.join(Self::FILE))
    }
}

/// What to do with the source VM after a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterSnapshot {
    /// Leave it paused.
    Paused,
    /// Resume it.
    Resumed,
}

/// Errors of every [`Driver`] operation.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A filesystem or socket operation failed.
    #[error("{what}")]
    Io {
        /// What we were doing, naming the path.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The hypervisor (or a helper like `qemu-img`) could not be started or failed.
    #[error("running {program} failed: {detail}")]
    Spawn {
        /// The program.
        program: String,
        /// Exit status / stderr excerpt.
        detail: String,
    },
    /// The hypervisor's control channel (QMP, REST) refused or broke.
    #[error("vm {vm}: control channel: {message}")]
    Control {
        /// The VM.
        vm: VmId,
        /// What went wrong.
        message: String,
    },
    /// The hypervisor process exited when it should run.
    #[error("vm {vm}: hypervisor exited: {detail}")]
    Exited {
        /// The VM.
        vm: VmId,
        /// Exit status and the end of its console/log.
        detail: String,
    },
    /// An operation did not finish in time.
    #[error("vm {vm}: timed out after {after:?} waiting for {what}")]
    Timeout {
        /// The VM.
        vm: VmId,
        /// What we waited for.
        what: String,
        /// How long we waited.
        after: Duration,
    },
    /// No live VM with that id under this driver's state dir.
    #[error("vm {0}: not found (or not alive)")]
    NotFound(VmId),
    /// Dialling the guest agent failed.
    #[error("vm {vm}: agent")]
    Agent {
        /// The VM.
        vm: VmId,
        /// The cause.
        #[source]
        source: DialError,
    },
    /// A socket of the VM (API, console, vsock) is not served by the VM's hypervisor — a
    /// symbolic link, or another process's socket in its place ([`crate::peer`]). Nothing was
    /// sent to it.
    #[error("vm {vm}: refusing its socket")]
    Peer {
        /// The VM.
        vm: VmId,
        /// The socket, who should and who did answer.
        #[source]
        source: crate::peer::PeerError,
    },
    /// The guest agent answered something we did not expect.
    #[error("vm {vm}: agent protocol: {message}")]
    AgentProtocol {
        /// The VM.
        vm: VmId,
        /// What was wrong.
        message: String,
    },
    /// Reading or writing a `vm.json` / `snapshot.json` failed.
    #[error("state record")]
    Record(#[from] RecordError),
    /// The hypervisor's jail (user, cgroup, descriptors) could not be prepared.
    #[error("preparing the VM's jail")]
    Jail(#[from] crate::jail::JailError),
    /// The spec or snapshot cannot be used by this driver.
    #[error("invalid: {0}")]
    Invalid(String),
    /// This driver cannot do that (yet).
    #[error("{backend} driver does not support {what}")]
    Unsupported {
        /// The backend.
        backend: Backend,
        /// The operation.
        what: String,
    },
}

impl DriverError {
    /// Shorthand for [`DriverError::Io`].
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        DriverError::Io { what: what.into(), source }
    }
}

/// Anything a byte stream to the guest agent can be.
pub trait AgentIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> AgentIo for T {}

/// A connected stream to a guest port, past the `CONNECT`/`OK` handshake.
pub struct AgentStream(Box<dyn AgentIo>);

impl AgentStream {
    /// Wraps any byte stream (a Unix socket in production, a duplex pipe in tests).
    pub fn new(io: impl AgentIo + 'static) -> Self {
        AgentStream(Box::new(io))
    }
}

impl fmt::Debug for AgentStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentStream")
    }
}

impl AsyncRead for AgentStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

/// How often [`Driver::wait_agent`] retries.
pub const WAIT_AGENT_INTERVAL: Duration = Duration::from_millis(20);

/// A hypervisor driver. Object safe: use it as `Arc<dyn Driver>`.
#[async_trait]
pub trait Driver: Send + Sync {
    /// Which hypervisor this driver runs.
    fn backend(&self) -> Backend;

    /// The accelerator this driver uses for [`AccelPreference::Auto`] (probed once at construction).
    fn accel(&self) -> Accel;

    /// Boots a VM; returns once the hypervisor process runs (the guest may still be booting).
    async fn boot(&self, spec: &BootSpec) -> Result<Vm, DriverError>;

    /// Dials `port` in the guest: hybrid-vsock `CONNECT port\n` → `OK …\n` on [`Vm::vsock_socket`].
    async fn connect(&self, vm: &Vm, port: u32) -> Result<AgentStream, DriverError> {
        crate::agent::dial(&vm.vsock_socket, port)
            .await
            .map(AgentStream::new)
            .map_err(|source| DriverError::Agent { vm: vm.id.clone(), source })
    }

    /// Dials the agent and asks `info` every [`WAIT_AGENT_INTERVAL`] until it answers or `timeout` passes.
    async fn wait_agent(&self, vm: &Vm, timeout: Duration) -> Result<AgentInfo, DriverError> {
        let deadline = Instant::now() + timeout;
        let mut last: Option<String> = None;
        loop {
            let attempt = async {
                let mut s = self.connect(vm, AGENT_PORT).await?;
                crate::agent::info(&mut s).await.map_err(|source| DriverError::Agent { vm: vm.id.clone(), source })
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left.max(Duration::from_millis(1)), attempt).await {
                Ok(Ok(info)) => return Ok(info),
                Ok(Err(e)) => last = Some(crate::error_chain(&e)),
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                tracing::debug!(vm = %vm.id, last_error = ?last, "agent did not answer");
                return Err(DriverError::Timeout {
                    vm: vm.id.clone(),
                    what: match last {
                        Some(e) => format!("the guest agent (last error: {e})"),
                        None => "the guest agent".into(),
                    },
                    after: timeout,
                });
            }
            tokio::time::sleep(WAIT_AGENT_INTERVAL).await;
        }
    }

    /// Pauses the vCPUs.
    async fn pause(&self, vm: &Vm) -> Result<(), DriverError>;

    /// Sets the VM's CPU weight against this driver's other VMs (its cgroup leaf): a VM being
    /// made for a pool runs at [`CpuWeight::Background`], one a user holds at `Normal`. A
    /// driver whose VMs have no cgroup leaf of their own (not jailed) does nothing.
    async fn set_cpu_weight(&self, vm: &Vm, weight: CpuWeight) -> Result<(), DriverError> {
        let _ = (vm, weight);
        Ok(())
    }

    /// Resumes the vCPUs.
    async fn resume(&self, vm: &Vm) -> Result<(), DriverError>;

    /// Whether the VM's vCPUs are stopped by a [`Driver::pause`] (`false` for a driver that
    /// cannot tell: its VMs are then never taken for paused ones).
    async fn is_paused(&self, vm: &Vm) -> Result<bool, DriverError> {
        let _ = vm;
        Ok(false)
    }

    /// Saves the VM's memory, device and disk state into `dir` (created if missing) and writes
    /// `dir/snapshot.json`. The VM is left paused or resumed as `after` says.
    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError>;

    /// Starts a new VM `id` from `snapshot` (a clone: the source may keep running). Returns
    /// once the clone's vCPUs run. Its guest agent restarts its session on the fresh host connection.
    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError>;

    /// [`Driver::restore`] with options (the clone's own NIC). Drivers without NIC support
    /// refuse a NIC; without one this is [`Driver::restore`].
    async fn restore_with(&self, snapshot: &Snapshot, id: &VmId, opts: &RestoreOptions) -> Result<Vm, DriverError> {
        if opts.nic.is_some() {
            return Err(DriverError::Unsupported { backend: self.backend(), what: "a NIC on restore".into() });
        }
        self.restore(snapshot, id).await
    }

    /// Asks the guest to power off (ACPI / `system_powerdown`), kills the hypervisor after
    /// `timeout`, then removes the VM's directory.
    async fn shutdown(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError>;

    /// Kills the hypervisor at once and removes the VM's directory. Works on a
    /// [`VmState::Creating`] VM too, even one whose pid was never recorded.
    async fn kill(&self, vm: &Vm) -> Result<(), DriverError>;

    /// The VMs under this driver's state dir that may have a running hypervisor: `running`
    /// ones whose process lives, and `creating` ones (a boot or restore in flight, or one whose
    /// owner died mid-way and left a hypervisor behind — [`Driver::kill`] it). Records of dead
    /// VMs are omitted; [`Driver::prune`] removes them.
    async fn list(&self) -> Result<Vec<Vm>, DriverError>;

    /// Removes the directories of dead VM records (hypervisor gone, and for `creating` ones
    /// also the owner) and returns their ids. Never removes a directory a live process names.
    /// Drivers without on-disk state have nothing to prune.
    async fn prune(&self) -> Result<Vec<VmId>, DriverError> {
        Ok(Vec::new())
    }

    /// Hot-plugs a volume into a running VM (whose spec has `volumes`). Idempotent per slot:
    /// a slot that holds the same image already is done.
    async fn attach_volume(&self, vm: &Vm, volume: &VolumeAttach) -> Result<(), DriverError> {
        let _ = volume;
        Err(DriverError::Unsupported { backend: self.backend(), what: format!("volumes (vm {})", vm.id) })
    }

    /// Unplugs the volume in `slot`; an empty slot is done.
    async fn detach_volume(&self, vm: &Vm, slot: u16) -> Result<(), DriverError> {
        let _ = slot;
        Err(DriverError::Unsupported { backend: self.backend(), what: format!("volumes (vm {})", vm.id) })
    }

    /// Re-attaches to a live VM after our own process restarted (reconnects the control
    /// channel, restarts host-side helpers such as the vsock bridge).
    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError>;
}

#[cfg(test)]
mod tests;

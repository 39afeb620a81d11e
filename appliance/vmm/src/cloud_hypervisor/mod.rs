//! The cloud-hypervisor driver: one `cloud-hypervisor` process per VM, driven over its REST
//! API socket, guest agent over cloud-hypervisor's native hybrid vsock.
//!
//! # Production only
//!
//! This is the production hypervisor path (KVM hosts). It cannot run on the development
//! machines (no cloud-hypervisor binary, PVM-only KVM), where the [`crate::qemu`] driver runs
//! the same guests under TCG. There is therefore no end-to-end test here; instead:
//!
//! - every request body is built by pure code ([`config`]) and checked against recorded
//!   cloud-hypervisor request shapes in `src/cloud_hypervisor/fixtures/` (API version 0.3.0,
//!   see the README there);
//! - the driver itself runs against a fake API server (`fake_api.rs`, test-only) on a Unix
//!   socket that records every request and answers with recorded response shapes, and against a
//!   fake `cloud-hypervisor` shell script that serves its `--api-socket` (and `console.sock`,
//!   `vsock.sock`) itself by relaying to that server and to the test — so process spawning,
//!   readiness, the peer check, error mapping, teardown and re-attach are exercised for real;
//! - a missing binary is tested to give the typed [`ProcessError::BinaryNotFound`].
//!
//! # Jail
//!
//! Whenever the jail resolves ([`JailSettings::resolve`]: root, the VM user exists,
//! `CHRYSALIS_JAIL` not `0`), cloud-hypervisor runs as the VM user (`chrysalis-vm`, no
//! supplementary groups) with no capabilities, `PR_SET_NO_NEW_PRIVS`, its own seccomp filters
//! (`--seccomp true`, never `false`), a session of its own, the VM's cgroup leaf with the
//! limits of its size class, and the NIC's network namespace — the same [`SpawnPlan`] as
//! QEMU's. Unlike QEMU it still opens its files **by path** (no descriptor passing yet), so
//! what it opens is laid out for that user:
//!
//! | path | owner | mode | who writes it |
//! |------|-------|------|---------------|
//! | `<vmdir>/` | root, group VM | 0710 | the driver; the VM user may only pass through |
//! | `<vmdir>/vm.json`, `console.log`(`.1`), `vmm.log`(`.1`) | root | 0600 (`vm.json` 0644) | the driver only |
//! | `<vmdir>/jail/` | VM user | 0700 | cloud-hypervisor: `api.sock`, `vsock.sock`, `console.sock` |
//! | `<vmdir>/jail/overlay.raw` | VM user | 0600 | the guest (read-write disk) |
//! | `<vmdir>/restore/` (a clone) | root, group VM | 0750; `config.json` 0640 | the driver; links into the snapshot |
//! | `<snapshot>/` taken by [`Driver::snapshot`] | root, group VM | 0750; CH's files 0640, `overlay.raw` and `snapshot.json` root's | see below |
//!
//! - **Root's files stay in root's directory.** The VM user can replace anything in a
//!   directory it owns, so nothing the driver later reads or writes (`vm.json`, whose pid the
//!   driver signals; the logs) lives in `jail/`. The driver writes into `jail/` only before
//!   handing it over (the overlay copy, then `chown` of the file, then of the directory, each
//!   through an `O_NOFOLLOW` descriptor), and reads from it once: the snapshot's copy of the
//!   overlay, opened `O_NOFOLLOW` and refused unless a regular file with one link owned by the
//!   VM user ([`disk::clone_file_nofollow`]) — no link can make root copy its own files out.
//!   Teardown is `remove_dir_all`, which does not follow links.
//! - **Snapshots.** cloud-hypervisor writes `config.json`, `state.json` and `memory-ranges` as
//!   the VM user, so the destination directory is handed to the VM user (0700) just for
//!   `vm.snapshot` and taken back whatever happened ([`Jail::take_back_dir`]): the directory
//!   becomes root's (group VM, 0750) first, then each regular single-link file of the VM
//!   user's becomes root's, group VM, 0640 — readable by the VM user for clones, writable by
//!   nobody but root. A symbolic link, a hard link, a directory or a foreign file there fails
//!   the snapshot ([`crate::jail::JailError::Unexpected`]) untouched. Only then does the
//!   driver write `overlay.raw` and `snapshot.json` there.
//! - **Read-only inputs** (kernel, initrd, rootfs, the snapshot files a clone links to) are
//!   not copied or changed: the VM user must be able to read them, which is checked (mode
//!   bits of the file and every directory above it; ACLs not consulted) before anything is
//!   spawned, failing with [`crate::jail::JailError::Unreachable`] naming the path and the
//!   directory in the way. The state directory's ancestors must be searchable by the VM user
//!   too. `/dev/kvm` and `/dev/net/tun` must be usable by it (the usual udev mode 0666).
//! - **The TAP** of a [`BootSpec::nic`]: before the spawn the driver (root) attaches to the
//!   persistent TAP in its netns and sets its owner and group to the VM user's
//!   ([`crate::jail::set_owner`]), so the unprivileged process, started inside the NIC's
//!   netns, may attach to it by name (`vm.create`'s `net`; a clone's restored config gets
//!   its own TAP, [`config::rewrite_snapshot_config`]).
//! - **Its own output** goes through a pipe into the capped `vmm.log`
//!   ([`crate::jail::output`], 64 KiB), never a file it holds.
//! - **Its sockets are checked, not trusted.** The driver connects as root to `api.sock`,
//!   `console.sock` and `vsock.sock` in `jail/`, which the VM user may replace — by a link to,
//!   or a hard link or rename of, another process's socket (another service's API, another
//!   VM's console). Every connection to them goes through [`crate::peer::connect`]: the path
//!   is opened `O_PATH | O_NOFOLLOW` and a symbolic link refused, the connection made through
//!   that descriptor, and then the peer's `SO_PEERCRED` must be the VM's recorded
//!   cloud-hypervisor pid (the VM user's uid where no pid is recorded yet, jail on). A Unix
//!   socket cannot be opened `O_NOFOLLOW`, so this check after connecting is the guarantee.
//!   A mismatch is [`DriverError::Peer`] (naming the socket, the expected and the found pid
//!   and uid; through [`api::ApiError::Peer`], [`crate::agent::DialError::Peer`] or
//!   [`ProcessError::ApiPeer`], which fails a start at once), logged with the VM's id, and
//!   nothing is sent; the console drain drops such a connection and dials again only after
//!   [`crate::console::REFUSED_REDIAL`]. (QEMU's sockets are bound by the driver in root's
//!   directories and passed as descriptors: nobody else can replace them, and their peer is
//!   the driver, so QEMU dials unchecked.)
//!
//! What remains open: every VM shares the one VM user, so a compromised cloud-hypervisor can
//! reach other VMs' `jail/` directories (their sockets too: the peer check keeps the *driver*
//! from talking to the wrong process, not one VM's process from connecting to another's
//! sockets) and every snapshot readable by the VM group. Passing the sockets to
//! cloud-hypervisor as descriptors would take them out of `jail/` altogether. There is no
//! cloud-hypervisor binary here: the jail is tested with a fake `cloud-hypervisor` script
//! that runs in it and serves its sockets itself (a Perl relay it `exec`s, so the pid that
//! listens is the one spawned: `fake_api.rs`).
//!
//! # Lifecycle
//!
//! - **boot**: copy the template's overlay base into `<vmdir>/jail/overlay.raw` ([`disk`]);
//!   hand `jail/` to the VM user; spawn `cloud-hypervisor --api-socket <vmdir>/jail/api.sock`
//!   ([`process`]); wait for `vmm.ping`; write
//!   `vm.json`; `PUT /vm.create` (kernel, initramfs, cmdline, vCPUs and memory from the size
//!   class, shared memory, rootfs read-only + overlay disks, serial to the socket
//!   `<vmdir>/jail/console.sock` (the driver dials it and drains it into the capped
//!   `<vmdir>/console.log`, [`crate::console`]; again on attach), console off, vsock
//!   `{cid, socket: <vmdir>/jail/vsock.sock}`); `PUT /vm.boot`.
//! - **agent**: [`crate::agent::dial_checked`] on `<vmdir>/jail/vsock.sock` (`CONNECT 2048\n` →
//!   `OK …`), its peer checked (see "Jail").
//! - **snapshot**: `GET /vm.info`; `PUT /vm.pause` unless already paused; hand `<dir>` to the
//!   VM user; `PUT /vm.snapshot {destination_url: "file://<dir>"}`; take `<dir>` back; copy the
//!   overlay into `<dir>/overlay.raw`; write
//!   `<dir>/snapshot.json`; `PUT /vm.resume` if asked.
//! - **restore / clone**: copy the snapshot's overlay; build `<vmdir>/restore/` — the snapshot's
//!   `config.json` rewritten to the clone's own vsock socket, serial log and overlay, the other
//!   snapshot files symlinked; spawn a new process; `PUT /vm.restore {source_url}`; `PUT /vm.resume`.
//! - **shutdown**: `POWEROFF` on the guest control port ([`crate::agent::request_poweroff`]) and
//!   wait for the process to exit; if the control channel fails, `PUT /vm.shutdown`,
//!   `PUT /vmm.shutdown`; SIGKILL if the process is still there after the timeout; **kill**: SIGKILL. Both remove `<vmdir>`. No process outlives shutdown,
//!   kill, or a failed boot/restore.
//! - **record**: `vm.json` is written `creating` right after the directory is made, gains the
//!   pid right after `fork`, and turns `running` once boot/restore finished ([`crate::lifecycle`]).
//! - **list / attach / prune**: `vm.json` records under `<state_dir>/vms/`, liveness by pid +
//!   start time (a `creating` one is listed while anything may run for it, and can be killed);
//!   attach also pings the API (its peer checked against the recorded pid, and the pid
//!   `vmm.ping` reports too); prune removes dead records.
//!
//! # Errors
//!
//! A non-2xx REST answer is [`api::ApiError::Status`] (endpoint, HTTP status, cloud-hypervisor's
//! body — a JSON array of messages); the driver surfaces it as [`DriverError::Control`] whose
//! message is `"<METHOD> /<endpoint> answered HTTP <status>: <body>"` ([`api_error`]). An API
//! deadline becomes [`DriverError::Timeout`]; a VMM that exits while starting becomes
//! [`DriverError::Exited`] with the end of `<vmdir>/vmm.log`; a socket not served by the VM's
//! cloud-hypervisor becomes [`DriverError::Peer`].

pub mod api;
pub mod config;
pub mod disk;
pub mod process;
mod snapshot;
mod stop;

#[cfg(test)]
pub mod fake_api;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use cloud_hypervisor_client::models::VmState as ChVmState;
use tracing::Instrument;

use crate::accel::{Accel, AccelPreference, KvmFacts};
use crate::console::ConsoleDrain;
use crate::driver::{
    AfterSnapshot, AgentStream, Backend, BootSpec, Driver, DriverError, RestoreOptions, Snapshot, Vm, VmId, VmState,
};
use crate::jail::{Jail, JailError, JailSettings, SpawnPlan};
use crate::lifecycle::{self, VmRecord};
use crate::peer::{Peer, PeerCheck};
use crate::record::{self, RecordError, VM_JSON};
use api::{ApiClient, ApiError};
use config::{CloneRewrite, VmPlan};
pub use process::ProcessError;
use process::VmmProcess;

/// `<vmdir>/jail/api.sock`: cloud-hypervisor's REST API.
pub const API_SOCKET: &str = "api.sock";
/// `<vmdir>/jail/vsock.sock`: the hybrid-vsock socket.
pub const VSOCK_SOCKET: &str = "vsock.sock";
/// `<vmdir>/console.log`: the guest's serial console, capped ([`crate::console`]).
pub const CONSOLE_LOG: &str = "console.log";
/// `<vmdir>/jail/console.sock`: the serial port's socket (cloud-hypervisor listens, the driver
/// drains).
pub const CONSOLE_SOCKET: &str = crate::console::CONSOLE_SOCKET;
/// `<vmdir>/vmm.log`: cloud-hypervisor's own stdout/stderr, capped ([`process::LOG_CAP`]).
pub const VMM_LOG: &str = "vmm.log";
/// `<vmdir>/jail/overlay.raw` (and `<snapshot>/overlay.raw`): the writable overlay disk.
pub const OVERLAY: &str = "overlay.raw";
/// `<vmdir>/jail/`: the VM user's directory (0700): cloud-hypervisor's sockets and the
/// overlay, everything of the VM it opens or creates by path and may write.
pub const JAIL_DIR: &str = "jail";
/// `<vmdir>/restore/`: the clone's view of the snapshot it restores.
pub const RESTORE_DIR: &str = "restore";
/// The snapshot file cloud-hypervisor writes with the VM configuration.
pub const SNAPSHOT_CONFIG: &str = "config.json";
/// How long processes found for a `creating` VM may take to die after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Settings of the driver.
#[derive(Debug, Clone)]
pub struct CloudHypervisorConfig {
    /// `$CHRYSALIS_STATE`; VMs live under `<state_dir>/vms/<id>/`.
    pub state_dir: PathBuf,
    /// `$CLOUD_HYPERVISOR_BIN` (path or name); `None` → `cloud-hypervisor`.
    pub binary: Option<OsString>,
    /// `$PATH` used to look the binary up.
    pub path_var: Option<OsString>,
    /// Deadline of each ordinary API call.
    pub api_timeout: Duration,
    /// Deadline of `vm.snapshot` and `vm.restore` (they move all guest memory).
    pub snapshot_timeout: Duration,
    /// How long a fresh process may take to answer `vmm.ping`.
    pub start_timeout: Duration,
    /// Map guest memory shared (`memory.shared`), needed for snapshots and clones.
    pub shared_memory: bool,
    /// Bytes of serial console each VM keeps on disk ([`crate::console::DEFAULT_CONSOLE_CAP`]).
    pub console_cap: u64,
    /// The jail settings ([`crate::jail`]): cloud-hypervisor runs as the VM user with no
    /// capabilities, no new privileges, in its own session, cgroup leaf and the NIC's netns
    /// (see the module docs' "Jail").
    pub jail: JailSettings,
}

impl CloudHypervisorConfig {
    /// Defaults, with the binary from `$CLOUD_HYPERVISOR_BIN` / `$PATH`.
    pub fn from_env(state_dir: PathBuf) -> Self {
        CloudHypervisorConfig {
            state_dir,
            binary: std::env::var_os(process::BIN_ENV),
            path_var: std::env::var_os("PATH"),
            api_timeout: Duration::from_secs(30),
            snapshot_timeout: Duration::from_secs(120),
            start_timeout: Duration::from_secs(10),
            shared_memory: true,
            console_cap: crate::console::DEFAULT_CONSOLE_CAP,
            jail: JailSettings::from_env(),
        }
    }
}

/// The cloud-hypervisor [`Driver`].
#[derive(Debug)]
pub struct CloudHypervisor {
    cfg: CloudHypervisorConfig,
    binary: PathBuf,
    /// Processes we spawned or adopted, so we reap what we start.
    procs: Mutex<HashMap<VmId, VmmProcess>>,
    /// The console drains of the VMs we started or adopted.
    consoles: Mutex<HashMap<VmId, ConsoleDrain>>,
}

fn now_epoch_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A guest CID ≥ 3 derived from the VM id (FNV-1a), stable across restarts of the host side.
pub fn vsock_cid(id: &VmId) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in id.as_str().bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    3 + h % (1 << 31)
}

/// Maps a REST failure to the driver error: an HTTP error keeps its status and body.
pub fn api_error(vm: &VmId, e: ApiError) -> DriverError {
    match e {
        ApiError::Timeout { endpoint, after } => {
            DriverError::Timeout { vm: vm.clone(), what: format!("cloud-hypervisor {endpoint}"), after }
        }
        e @ ApiError::Status { .. } => DriverError::Control { vm: vm.clone(), message: e.to_string() },
        e @ ApiError::Transport { .. } => DriverError::Control { vm: vm.clone(), message: crate::error_chain(&e) },
        ApiError::Peer { source, .. } => DriverError::Peer { vm: vm.clone(), source },
    }
}

/// Maps a process failure to the driver error.
pub fn process_error(vm: &VmId, e: ProcessError) -> DriverError {
    match e {
        ProcessError::BinaryNotFound { ref wanted } => {
            DriverError::Spawn { program: wanted.to_string_lossy().into_owned(), detail: e.to_string() }
        }
        ProcessError::Spawn { bin, source } => DriverError::io(format!("starting {}", bin.display()), source),
        ProcessError::ExitedEarly { status, log_tail, .. } => {
            DriverError::Exited { vm: vm.clone(), detail: format!("{status}; log: {log_tail}") }
        }
        ProcessError::ApiNotReady { after, last, .. } => DriverError::Timeout {
            vm: vm.clone(),
            what: match last {
                Some(l) => format!("the cloud-hypervisor API (last error: {})", crate::error_chain(&l)),
                None => "the cloud-hypervisor API".into(),
            },
            after,
        },
        ProcessError::ApiPeer { source, .. } => DriverError::Peer { vm: vm.clone(), source },
        ProcessError::Stop { pid, source } => DriverError::io(format!("stopping cloud-hypervisor pid {pid}"), source),
        ProcessError::Unkillable { after, .. } => {
            DriverError::Timeout { vm: vm.clone(), what: "cloud-hypervisor to die after SIGKILL".into(), after }
        }
    }
}

fn disk_error(e: disk::DiskError) -> DriverError {
    let what = e.to_string();
    match e {
        disk::DiskError::Copy { source, .. } => DriverError::io(what, source),
    }
}

impl CloudHypervisor {
    /// A driver with `cfg`; fails with [`ProcessError::BinaryNotFound`] when there is no
    /// cloud-hypervisor binary. Logs the accelerator (always KVM: cloud-hypervisor has no TCG).
    pub fn new(cfg: CloudHypervisorConfig) -> Result<Self, ProcessError> {
        let binary = process::resolve_binary(cfg.binary.as_deref(), cfg.path_var.as_deref())?;
        match KvmFacts::gather().unusable_reason() {
            None => {
                tracing::info!(accel = %Accel::Kvm, binary = %binary.display(), "cloud-hypervisor driver ready")
            }
            Some(why) => {
                tracing::warn!(accel = %Accel::Kvm, kvm_unusable = %why, binary = %binary.display(),
                "cloud-hypervisor driver: KVM looks unusable here; boots will fail")
            }
        }
        Ok(CloudHypervisor { cfg, binary, procs: Mutex::new(HashMap::new()), consoles: Mutex::new(HashMap::new()) })
    }

    /// The binary this driver spawns.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    fn vms_dir(&self) -> PathBuf {
        record::vms_dir(&self.cfg.state_dir)
    }

    fn vm_dir(&self, id: &VmId) -> PathBuf {
        self.vms_dir().join(id.as_str())
    }

    /// Who must answer `vm`'s sockets: its recorded cloud-hypervisor pid; before that is
    /// known, the jail's VM user (if the jail is on). See [`crate::peer`].
    fn peer_check(&self, vm: &Vm) -> Option<PeerCheck> {
        let expected = match vm.pid {
            0 => Peer::Uid(self.cfg.jail.resolve().ok().flatten()?.uid),
            pid => Peer::Pid(pid),
        };
        Some(PeerCheck { vm: vm.id.clone(), expected })
    }

    fn api(&self, vm: &Vm) -> ApiClient {
        ApiClient::new(&vm.control_socket, self.cfg.api_timeout, self.peer_check(vm))
    }

    fn slow_api(&self, vm: &Vm) -> ApiClient {
        ApiClient::new(&vm.control_socket, self.cfg.snapshot_timeout, self.peer_check(vm))
    }

    fn procs(&self) -> std::sync::MutexGuard<'_, HashMap<VmId, VmmProcess>> {
        // A poisoned map only means another task panicked mid-insert; the map is still valid.
        self.procs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn consoles(&self) -> std::sync::MutexGuard<'_, HashMap<VmId, ConsoleDrain>> {
        // A poisoned map is still consistent (inserts/removes only).
        self.consoles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts draining `vm`'s console socket into its capped log, unless a drain runs already.
    fn drain_console(&self, vm: &Vm) -> Result<(), DriverError> {
        let mut consoles = self.consoles();
        if consoles.contains_key(&vm.id) {
            return Ok(());
        }
        let sock = vm.control_socket.with_file_name(CONSOLE_SOCKET);
        let drain =
            ConsoleDrain::dial(&sock, &vm.console_log, self.cfg.console_cap, self.peer_check(vm)).map_err(|e| {
                DriverError::io(format!("vm {}: opening the console log {}", vm.id, vm.console_log.display()), e)
            })?;
        consoles.insert(vm.id.clone(), drain);
        Ok(())
    }

    /// Takes our handle on `vm`'s process, or adopts it by pid + start time.
    fn take_process(&self, vm: &Vm) -> VmmProcess {
        self.procs().remove(&vm.id).unwrap_or_else(|| VmmProcess::adopt(vm.pid, vm.pid_start_time))
    }

    /// Refuses records whose directory is not ours (we delete it on stop).
    fn check_owned(&self, vm: &Vm) -> Result<(), DriverError> {
        if vm.backend != Backend::CloudHypervisor {
            return Err(DriverError::Invalid(format!("vm {} runs on {}, not cloud-hypervisor", vm.id, vm.backend)));
        }
        if vm.dir != self.vm_dir(&vm.id) {
            return Err(DriverError::Invalid(format!(
                "vm {} directory {} is not under {}",
                vm.id,
                vm.dir.display(),
                self.vms_dir().display()
            )));
        }
        Ok(())
    }

    fn skeleton(&self, id: &VmId, dir: &Path, spec: &BootSpec) -> Result<Vm, DriverError> {
        let socks = crate::sockdir::socket_dir(&dir.join(JAIL_DIR))?;
        Ok(Vm {
            id: id.clone(),
            backend: Backend::CloudHypervisor,
            accel: Accel::Kvm,
            pid: 0,
            pid_start_time: 0,
            dir: dir.to_path_buf(),
            control_socket: socks.join(API_SOCKET),
            vsock_socket: socks.join(VSOCK_SOCKET),
            console_log: dir.join(CONSOLE_LOG),
            spec: spec.clone(),
            restored_from: None,
            created_at_epoch_secs: now_epoch_secs(),
            state: VmState::Creating,
        })
    }

    /// Spawns the process for `rec` (in `jail`, if any), records its pid in `vm.json` at
    /// once, and waits for its API. On error the process (if any) is already killed; the caller
    /// removes the directory.
    async fn start_process(&self, rec: &mut VmRecord, jail: Option<&Jail>) -> Result<VmmProcess, DriverError> {
        let log = rec.vm.dir.join(VMM_LOG);
        let leaf = match jail {
            Some(jail) => Some(jail.leaf(rec.vm.id.as_str(), rec.vm.spec.size, Accel::Kvm)?),
            None => None,
        };
        let netns = match Self::prepare_nic(&rec.vm, jail) {
            Ok(n) => n,
            Err(e) => {
                if let Some(leaf) = leaf {
                    leaf.remove();
                }
                return Err(e);
            }
        };
        // The VM user (no capabilities, no new privileges), its session, cgroup leaf and netns.
        let mut plan = SpawnPlan::new(jail, leaf.as_ref());
        plan.netns = netns.as_ref().map(|f| f.as_raw_fd());
        let spawned = VmmProcess::spawn(&self.binary, &rec.vm.control_socket, &log, plan);
        drop(netns);
        let mut proc = match spawned {
            Ok(p) => p,
            Err(e) => {
                if let Some(leaf) = leaf {
                    leaf.remove();
                }
                return Err(process_error(&rec.vm.id, e));
            }
        };
        let recorded = rec.spawned(proc.pid(), proc.start_time()).and_then(|()| rec.store());
        let result = match recorded {
            Ok(()) => {
                // The pid is recorded: only the process just spawned may answer.
                let api = ApiClient::new(
                    &rec.vm.control_socket,
                    self.cfg.api_timeout.min(Duration::from_secs(1)),
                    self.peer_check(&rec.vm),
                );
                match proc.wait_api(&api, &log, self.cfg.start_timeout).await {
                    Ok(ping) => {
                        tracing::debug!(vm = %rec.vm.id, pid = rec.vm.pid, version = %ping.version, "cloud-hypervisor API up");
                        Ok(())
                    }
                    Err(e) => Err(process_error(&rec.vm.id, e)),
                }
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => Ok(proc),
            Err(e) => {
                Self::discard(&rec.vm.id, &mut proc).await;
                Err(e)
            }
        }
    }

    /// Makes the VM's directories below `<vmdir>` (created by [`lifecycle::create_vm_dir`]) as
    /// the module docs' "Jail" lays them out: `<vmdir>/jail/` with the overlay copied from
    /// `overlay_src`, both handed to the VM user only once the driver has written everything it
    /// writes there, and `<vmdir>` itself root's, group the VM group, 0710. Then checks that
    /// the VM user reaches its directory and the template's kernel, initrd and rootfs. Returns
    /// the overlay's path.
    fn prepare_dirs(vm: &Vm, jail: Option<&Jail>, overlay_src: Option<&Path>) -> Result<Option<PathBuf>, DriverError> {
        use std::os::unix::fs::DirBuilderExt;
        let jdir = vm.dir.join(JAIL_DIR);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&jdir)
            .map_err(|e| DriverError::io(format!("creating {}", jdir.display()), e))?;
        let overlay = match overlay_src {
            Some(src) => {
                let to = jdir.join(OVERLAY);
                let size = crate::disk::overlay_size(&vm.spec, src)?;
                disk::clone_file(src, &to).map_err(disk_error)?;
                size.map_or(Ok(()), |b| crate::disk::grow_raw(&to, b))?;
                Some(to)
            }
            None => None,
        };
        if let Some(j) = jail {
            if let Some(o) = &overlay {
                j.hand_over(o, 0o600)?;
            }
            j.hand_over(&jdir, 0o700)?;
            j.take_back(&vm.dir, 0o710)?;
            j.check_reach(&jdir, true)?;
            let inputs = [Some(&vm.spec.kernel), Some(&vm.spec.initrd), vm.spec.rootfs.as_ref()];
            for input in inputs.into_iter().flatten() {
                j.check_reach(input, false)?;
            }
        }
        Ok(overlay)
    }

    /// Kills a process after a failed start, logging (not returning) a failure to kill.
    async fn discard(id: &VmId, proc: &mut VmmProcess) {
        if let Err(e) = proc.kill().await {
            tracing::error!(vm = %id, pid = proc.pid(), error = %crate::error_chain(&e), "could not kill cloud-hypervisor after a failed start");
        }
    }

    /// Removes a VM's directory and its cgroup leaf (a leaf that will not go is logged and
    /// counted, [`crate::jail::cgroup::cleanup_failures`]).
    fn remove_dir(&self, dir: &Path) -> Result<(), DriverError> {
        if let (Some(cgroups), Some(id)) = (self.cfg.jail.cgroups(), dir.file_name().and_then(|n| n.to_str())) {
            cgroups.leaf_of(id).remove();
        }
        crate::sockdir::release(&dir.join(JAIL_DIR));
        crate::sockdir::release(dir);
        match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DriverError::io(format!("removing {}", dir.display()), e)),
        }
    }

    /// Runs `steps` on a started VM, then marks its record `running`; on error kills the
    /// process and removes the directory.
    async fn finish_start(
        &self,
        mut rec: VmRecord,
        mut proc: VmmProcess,
        steps: impl std::future::Future<Output = Result<(), DriverError>>,
    ) -> Result<Vm, DriverError> {
        let done = async {
            steps.await?;
            self.drain_console(&rec.vm)?;
            rec.running()?;
            rec.store()
        }
        .await;
        match done {
            Ok(()) => {
                self.procs().insert(rec.vm.id.clone(), proc);
                Ok(rec.vm)
            }
            Err(e) => {
                self.consoles().remove(&rec.vm.id);
                Self::discard(&rec.vm.id, &mut proc).await;
                if let Err(rm) = self.remove_dir(&rec.vm.dir) {
                    tracing::warn!(vm = %rec.vm.id, error = %crate::error_chain(&rm), "leaving directory of failed vm");
                }
                Err(e)
            }
        }
    }
}

#[async_trait]
impl Driver for CloudHypervisor {
    fn backend(&self) -> Backend {
        Backend::CloudHypervisor
    }

    fn accel(&self) -> Accel {
        Accel::Kvm
    }

    /// The default dial, with the peer of `vsock.sock` checked ([`crate::peer`]).
    async fn connect(&self, vm: &Vm, port: u32) -> Result<AgentStream, DriverError> {
        crate::agent::dial_checked(&vm.vsock_socket, port, self.peer_check(vm).as_ref())
            .await
            .map(AgentStream::new)
            .map_err(|source| DriverError::Agent { vm: vm.id.clone(), source })
    }

    async fn boot(&self, spec: &BootSpec) -> Result<Vm, DriverError> {
        if spec.accel == AccelPreference::Tcg {
            return Err(DriverError::Unsupported {
                backend: Backend::CloudHypervisor,
                what: "TCG (cloud-hypervisor needs KVM)".into(),
            });
        }
        let id = VmId::generate(&spec.name);
        let span = tracing::info_span!("ch_boot", vm = %id, template = %spec.name, size = %spec.size);
        self.boot_as(spec, id).instrument(span).await
    }

    async fn pause(&self, vm: &Vm) -> Result<(), DriverError> {
        self.api(vm).pause().await.map_err(|e| api_error(&vm.id, e))
    }

    async fn resume(&self, vm: &Vm) -> Result<(), DriverError> {
        self.api(vm).resume().await.map_err(|e| api_error(&vm.id, e))
    }

    async fn is_paused(&self, vm: &Vm) -> Result<bool, DriverError> {
        let state = self.api(vm).info().await.map_err(|e| api_error(&vm.id, e))?.state;
        Ok(state == ChVmState::Paused)
    }

    async fn set_cpu_weight(&self, vm: &Vm, weight: crate::jail::CpuWeight) -> Result<(), DriverError> {
        Ok(self.cfg.jail.set_cpu_weight(vm.id.as_str(), weight)?)
    }

    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        let span = tracing::info_span!("ch_snapshot", vm = %vm.id, dir = %dir.display());
        self.snapshot_to(vm, dir, after).instrument(span).await
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        self.restore_with(snapshot, id, &RestoreOptions::default()).await
    }

    async fn restore_with(&self, snapshot: &Snapshot, id: &VmId, opts: &RestoreOptions) -> Result<Vm, DriverError> {
        let span =
            tracing::info_span!("ch_restore", vm = %id, source = %snapshot.source, template = %snapshot.spec.name);
        self.restore_as(snapshot, id, opts).instrument(span).await
    }

    async fn shutdown(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        let span = tracing::info_span!("ch_shutdown", vm = %vm.id, pid = vm.pid);
        self.shutdown_within(vm, timeout).instrument(span).await
    }

    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        self.kill_now(vm).await
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        lifecycle::list(&self.vms_dir(), Backend::CloudHypervisor, &self.finder())
    }

    async fn prune(&self) -> Result<Vec<VmId>, DriverError> {
        let pruned =
            lifecycle::prune(&self.vms_dir(), Backend::CloudHypervisor, &self.finder(), lifecycle::PRUNE_GRACE)?;
        let (mut a, mut b) = (self.procs(), self.consoles());
        for id in &pruned {
            a.remove(id);
            b.remove(id);
        }
        self.cfg.jail.release_leaves(&pruned, lifecycle::PRUNE_GRACE);
        Ok(pruned)
    }

    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        let path = self.vm_dir(id).join(VM_JSON);
        let vm: Vm = match record::read_json(&path) {
            Ok(vm) => vm,
            Err(RecordError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Err(DriverError::NotFound(id.clone()))
            }
            Err(e) => return Err(e.into()),
        };
        if &vm.id != id {
            return Err(DriverError::Invalid(format!("{} records vm {}", path.display(), vm.id)));
        }
        self.check_owned(&vm)?;
        if vm.state == VmState::Creating {
            return Err(DriverError::Invalid(format!(
                "vm {id} is still being created (its owner may have died mid-way): kill it"
            )));
        }
        if !record::is_alive(vm.pid, vm.pid_start_time) {
            return Err(DriverError::NotFound(id.clone()));
        }
        let ping = self.api(&vm).ping().await.map_err(|e| api_error(id, e))?;
        if let Some(pid) = ping.pid {
            if i64::from(vm.pid) != pid {
                return Err(DriverError::Control {
                    vm: id.clone(),
                    message: format!(
                        "{} is answered by pid {pid}, but the record says pid {}",
                        vm.control_socket.display(),
                        vm.pid
                    ),
                });
            }
        }
        self.procs().entry(id.clone()).or_insert_with(|| VmmProcess::adopt(vm.pid, vm.pid_start_time));
        self.drain_console(&vm)?;
        tracing::info!(vm = %id, pid = vm.pid, version = %ping.version, "re-attached");
        Ok(vm)
    }
}

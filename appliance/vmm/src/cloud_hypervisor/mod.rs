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
//!   fake `cloud-hypervisor` shell script that links its `--api-socket` to that server — so
//!   process spawning, readiness, error mapping, teardown and re-attach are exercised for real;
//! - a missing binary is tested to give the typed [`ProcessError::BinaryNotFound`].
//!
//! # Lifecycle
//!
//! - **boot**: copy the template's overlay base into `<vmdir>/overlay.raw` ([`disk`]); spawn
//!   `cloud-hypervisor --api-socket <vmdir>/api.sock` ([`process`]); wait for `vmm.ping`; write
//!   `vm.json`; `PUT /vm.create` (kernel, initramfs, cmdline, vCPUs and memory from the size
//!   class, shared memory, rootfs read-only + overlay disks, serial to the socket
//!   `<vmdir>/console.sock` (the driver dials it and drains it into the capped
//!   `<vmdir>/console.log`, [`crate::console`]; again on attach), console off, vsock
//!   `{cid, socket: <vmdir>/vsock.sock}`); `PUT /vm.boot`.
//! - **agent**: [`crate::agent::dial`] on `<vmdir>/vsock.sock` (`CONNECT 2048\n` → `OK …`).
//! - **snapshot**: `GET /vm.info`; `PUT /vm.pause` unless already paused; `PUT /vm.snapshot
//!   {destination_url: "file://<dir>"}`; copy the overlay into `<dir>/overlay.raw`; write
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
//!   attach also pings the API and checks the answering pid; prune removes dead records.
//!
//! # Errors
//!
//! A non-2xx REST answer is [`api::ApiError::Status`] (endpoint, HTTP status, cloud-hypervisor's
//! body — a JSON array of messages); the driver surfaces it as [`DriverError::Control`] whose
//! message is `"<METHOD> /<endpoint> answered HTTP <status>: <body>"` ([`api_error`]). An API
//! deadline becomes [`DriverError::Timeout`]; a VMM that exits while starting becomes
//! [`DriverError::Exited`] with the end of `<vmdir>/vmm.log`.

pub mod api;
pub mod config;
pub mod disk;
pub mod process;

#[cfg(test)]
pub mod fake_api;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use cloud_hypervisor_client::models::VmState as ChVmState;
use tracing::Instrument;

use crate::accel::{Accel, AccelPreference, KvmFacts};
use crate::console::ConsoleDrain;
use crate::driver::{AfterSnapshot, Backend, BootSpec, Driver, DriverError, Snapshot, Vm, VmId, VmState};
use crate::lifecycle::{self, VmRecord};
use crate::record::{self, RecordError, VM_JSON};
use api::{ApiClient, ApiError};
use config::{CloneRewrite, VmPlan};
pub use process::ProcessError;
use process::VmmProcess;

/// `<vmdir>/api.sock`: cloud-hypervisor's REST API.
pub const API_SOCKET: &str = "api.sock";
/// `<vmdir>/vsock.sock`: the hybrid-vsock socket.
pub const VSOCK_SOCKET: &str = "vsock.sock";
/// `<vmdir>/console.log`: the guest's serial console, capped ([`crate::console`]).
pub const CONSOLE_LOG: &str = "console.log";
/// `<vmdir>/console.sock`: the serial port's socket (cloud-hypervisor listens, the driver drains).
pub const CONSOLE_SOCKET: &str = crate::console::CONSOLE_SOCKET;
/// `<vmdir>/vmm.log`: cloud-hypervisor's own stdout/stderr.
pub const VMM_LOG: &str = "vmm.log";
/// `<vmdir>/overlay.raw` (and `<snapshot>/overlay.raw`): the writable overlay disk.
pub const OVERLAY: &str = "overlay.raw";
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

    fn api(&self, vm: &Vm) -> ApiClient {
        ApiClient::new(&vm.control_socket, self.cfg.api_timeout)
    }

    fn slow_api(&self, vm: &Vm) -> ApiClient {
        ApiClient::new(&vm.control_socket, self.cfg.snapshot_timeout)
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
        let drain = ConsoleDrain::dial(&sock, &vm.console_log, self.cfg.console_cap).map_err(|e| {
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
        let socks = crate::sockdir::socket_dir(dir)?;
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

    /// Spawns the process for `rec`, records its pid in `vm.json` at once, and waits for its
    /// API. On error the process (if any) is already killed; the caller removes the directory.
    async fn start_process(&self, rec: &mut VmRecord) -> Result<VmmProcess, DriverError> {
        let log = rec.vm.dir.join(VMM_LOG);
        let mut proc =
            VmmProcess::spawn(&self.binary, &rec.vm.control_socket, &log).map_err(|e| process_error(&rec.vm.id, e))?;
        let recorded = rec.spawned(proc.pid(), proc.start_time()).and_then(|()| rec.store());
        let result = match recorded {
            Ok(()) => {
                let api = ApiClient::new(&rec.vm.control_socket, self.cfg.api_timeout.min(Duration::from_secs(1)));
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

    /// Kills a process after a failed start, logging (not returning) a failure to kill.
    async fn discard(id: &VmId, proc: &mut VmmProcess) {
        if let Err(e) = proc.kill().await {
            tracing::error!(vm = %id, pid = proc.pid(), error = %crate::error_chain(&e), "could not kill cloud-hypervisor after a failed start");
        }
    }

    fn remove_dir(dir: &Path) -> Result<(), DriverError> {
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
                if let Err(rm) = Self::remove_dir(&rec.vm.dir) {
                    tracing::warn!(vm = %rec.vm.id, error = %crate::error_chain(&rm), "leaving directory of failed vm");
                }
                Err(e)
            }
        }
    }

    /// Builds `<vmdir>/restore/` for a clone of `snapshot`.
    fn prepare_restore_dir(snapshot: &Snapshot, vm: &Vm, overlay: Option<PathBuf>) -> Result<PathBuf, DriverError> {
        let rdir = vm.dir.join(RESTORE_DIR);
        std::fs::create_dir(&rdir).map_err(|e| DriverError::io(format!("creating {}", rdir.display()), e))?;
        let src_cfg = snapshot.dir.join(SNAPSHOT_CONFIG);
        let mut cfg: serde_json::Value = record::read_json(&src_cfg)?;
        config::rewrite_snapshot_config(
            &mut cfg,
            &CloneRewrite {
                vsock_socket: vm.vsock_socket.clone(),
                serial_socket: vm.control_socket.with_file_name(CONSOLE_SOCKET),
                overlay,
            },
        )
        .map_err(|e| DriverError::Invalid(format!("{}: {e}", src_cfg.display())))?;
        record::write_json_atomic(&rdir.join(SNAPSHOT_CONFIG), &cfg)?;
        let entries = std::fs::read_dir(&snapshot.dir)
            .map_err(|e| DriverError::io(format!("reading {}", snapshot.dir.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| DriverError::io(format!("reading {}", snapshot.dir.display()), e))?;
            let name = entry.file_name();
            if name == SNAPSHOT_CONFIG || name == Snapshot::FILE || name == OVERLAY {
                continue;
            }
            let link = rdir.join(&name);
            std::os::unix::fs::symlink(entry.path(), &link)
                .map_err(|e| DriverError::io(format!("linking {}", link.display()), e))?;
        }
        Ok(rdir)
    }

    async fn boot_as(&self, spec: &BootSpec, id: VmId) -> Result<Vm, DriverError> {
        let mut rec = VmRecord::creating(self.skeleton(&id, &self.vm_dir(&id), spec)?);
        lifecycle::create_vm_dir(&rec)?;
        let dir = rec.vm.dir.clone();
        let overlay = match &spec.overlay_base {
            Some(base) => {
                let to = dir.join(OVERLAY);
                if let Err(e) = disk::clone_file(base, &to) {
                    let _ = Self::remove_dir(&dir);
                    return Err(disk_error(e));
                }
                Some(to)
            }
            None => None,
        };
        let plan = VmPlan {
            kernel: spec.kernel.clone(),
            initramfs: spec.initrd.clone(),
            cmdline: config::kernel_cmdline(&spec.cmdline, spec.rootfs.is_some(), overlay.is_some()),
            vcpus: spec.size.vcpus(),
            memory_bytes: spec.size.memory_mib() << 20,
            shared_memory: self.cfg.shared_memory,
            rootfs: spec.rootfs.clone(),
            overlay,
            serial_socket: rec.vm.control_socket.with_file_name(CONSOLE_SOCKET),
            vsock_cid: vsock_cid(&id),
            vsock_socket: rec.vm.vsock_socket.clone(),
        };
        let proc = match self.start_process(&mut rec).await {
            Ok(p) => p,
            Err(e) => {
                let _ = Self::remove_dir(&dir);
                return Err(e);
            }
        };
        let api = self.api(&rec.vm);
        let steps = async {
            api.create(plan.to_vm_config()).await.map_err(|e| api_error(&id, e))?;
            api.boot().await.map_err(|e| api_error(&id, e))
        };
        let vm = self.finish_start(rec, proc, steps).await?;
        tracing::info!(pid = vm.pid, accel = %vm.accel, "vm booted");
        Ok(vm)
    }

    async fn snapshot_to(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        self.check_owned(vm)?;
        let dir = std::path::absolute(dir).map_err(|e| DriverError::io(format!("resolving {}", dir.display()), e))?;
        std::fs::create_dir_all(&dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
        let api = self.api(vm);
        let state = api.info().await.map_err(|e| api_error(&vm.id, e))?.state;
        let was_paused = state == ChVmState::Paused;
        if !was_paused {
            api.pause().await.map_err(|e| api_error(&vm.id, e))?;
        }
        let saved = async {
            self.slow_api(vm).snapshot(&dir).await.map_err(|e| api_error(&vm.id, e))?;
            let overlay = if vm.spec.overlay_base.is_some() {
                let to = dir.join(OVERLAY);
                disk::clone_file(&vm.dir.join(OVERLAY), &to).map_err(disk_error)?;
                Some(to)
            } else {
                None
            };
            let snap = Snapshot {
                dir: dir.clone(),
                backend: Backend::CloudHypervisor,
                accel: vm.accel,
                source: vm.id.clone(),
                spec: vm.spec.clone(),
                overlay,
                created_at_epoch_secs: now_epoch_secs(),
            };
            record::write_json_atomic(&dir.join(Snapshot::FILE), &snap)?;
            Ok::<_, DriverError>(snap)
        }
        .await;
        let resume = match (&saved, after) {
            (Ok(_), AfterSnapshot::Resumed) => true,
            (Ok(_), AfterSnapshot::Paused) => false,
            // A failed snapshot leaves the VM as it found it.
            (Err(_), _) => !was_paused,
        };
        if resume {
            let r = api.resume().await.map_err(|e| api_error(&vm.id, e));
            if let (Ok(_), Err(e)) = (&saved, r) {
                return Err(e);
            }
        }
        let snap = saved?;
        tracing::info!(?after, "snapshot written");
        Ok(snap)
    }

    async fn restore_as(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        if snapshot.backend != Backend::CloudHypervisor {
            return Err(DriverError::Invalid(format!(
                "snapshot {} was taken by {}, not cloud-hypervisor",
                snapshot.dir.display(),
                snapshot.backend
            )));
        }
        let mut vm = self.skeleton(id, &self.vm_dir(id), &snapshot.spec)?;
        vm.accel = snapshot.accel;
        vm.restored_from = Some(snapshot.dir.clone());
        let mut rec = VmRecord::creating(vm);
        lifecycle::create_vm_dir(&rec)?;
        let dir = rec.vm.dir.clone();
        let prepared = (|| {
            let overlay = match &snapshot.overlay {
                Some(src) => {
                    let to = dir.join(OVERLAY);
                    disk::clone_file(src, &to).map_err(disk_error)?;
                    Some(to)
                }
                None => None,
            };
            Self::prepare_restore_dir(snapshot, &rec.vm, overlay)
        })();
        let rdir = match prepared {
            Ok(r) => r,
            Err(e) => {
                let _ = Self::remove_dir(&dir);
                return Err(e);
            }
        };
        let proc = match self.start_process(&mut rec).await {
            Ok(p) => p,
            Err(e) => {
                let _ = Self::remove_dir(&dir);
                return Err(e);
            }
        };
        let api = self.api(&rec.vm);
        let slow = self.slow_api(&rec.vm);
        let steps = async {
            slow.restore(&rdir).await.map_err(|e| api_error(id, e))?;
            api.resume().await.map_err(|e| api_error(id, e))
        };
        let vm = self.finish_start(rec, proc, steps).await?;
        tracing::info!(pid = vm.pid, "vm restored");
        Ok(vm)
    }

    async fn shutdown_within(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        self.check_owned(vm)?;
        if vm.state == VmState::Creating {
            // No guest to ask yet.
            return self.kill_now(vm).await;
        }
        let mut proc = self.take_process(vm);
        let t0 = Instant::now();
        let deadline = t0 + timeout;
        if proc.is_running() {
            let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            // 1. The guest control port: silkd has guest-init power off, and cloud-hypervisor
            //    exits with the guest. A VM without a reachable guest fails the dial at once.
            let path = match crate::agent::request_poweroff(&vm.vsock_socket, crate::agent::control_budget(timeout))
                .await
            {
                Ok(()) => "control",
                Err(e) => {
                    // 2. The REST API.
                    tracing::info!(
                        error = %crate::error_chain(&e),
                        "control channel failed; falling back to vm.shutdown"
                    );
                    let api = ApiClient::new(&vm.control_socket, left().min(self.cfg.api_timeout));
                    if let Err(e) = api.shutdown_vm().await {
                        tracing::warn!(error = %crate::error_chain(&e), "vm.shutdown failed; stopping the VMM anyway");
                    }
                    let api = ApiClient::new(&vm.control_socket, left().min(self.cfg.api_timeout));
                    if let Err(e) = api.shutdown_vmm().await {
                        tracing::warn!(error = %crate::error_chain(&e), "vmm.shutdown failed; will kill");
                    }
                    "vm.shutdown"
                }
            };
            if proc.wait_exit(left()).await {
                tracing::info!(path, ms = t0.elapsed().as_millis() as u64, "cloud-hypervisor exited");
            } else {
                // 3. SIGKILL, below.
                tracing::warn!(path, ?timeout, "cloud-hypervisor still running after shutdown; killing");
            }
        }
        if let Err(e) = proc.kill().await {
            // Keep our handle so a later kill() can retry.
            self.procs().insert(vm.id.clone(), proc);
            return Err(process_error(&vm.id, e));
        }
        self.consoles().remove(&vm.id);
        Self::remove_dir(&vm.dir)?;
        tracing::info!("vm shut down");
        Ok(())
    }

    /// SIGKILLs the VM's process — for a `creating` VM also any process naming its directory
    /// (its pid may never have been recorded) — and removes the directory.
    async fn kill_now(&self, vm: &Vm) -> Result<(), DriverError> {
        self.check_owned(vm)?;
        // The caller's copy may predate the pid being recorded.
        let vm = &lifecycle::freshest(vm);
        let mut proc = self.take_process(vm);
        if let Err(e) = proc.kill().await {
            self.procs().insert(vm.id.clone(), proc);
            return Err(process_error(&vm.id, e));
        }
        if vm.state == VmState::Creating || vm.pid == 0 {
            let rest = lifecycle::vm_processes(&vm.dir, None, None);
            if !lifecycle::kill_all(&rest, KILL_WAIT).await {
                return Err(DriverError::Timeout {
                    vm: vm.id.clone(),
                    what: format!("processes {rest:?} of a half-created vm to die after SIGKILL"),
                    after: KILL_WAIT,
                });
            }
        }
        self.consoles().remove(&vm.id);
        Self::remove_dir(&vm.dir)?;
        tracing::info!(vm = %vm.id, pid = vm.pid, "vm killed");
        Ok(())
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

    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        let span = tracing::info_span!("ch_snapshot", vm = %vm.id, dir = %dir.display());
        self.snapshot_to(vm, dir, after).instrument(span).await
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        let span =
            tracing::info_span!("ch_restore", vm = %id, source = %snapshot.source, template = %snapshot.spec.name);
        self.restore_as(snapshot, id).instrument(span).await
    }

    async fn shutdown(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        let span = tracing::info_span!("ch_shutdown", vm = %vm.id, pid = vm.pid);
        self.shutdown_within(vm, timeout).instrument(span).await
    }

    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        self.kill_now(vm).await
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        lifecycle::list(&self.vms_dir(), Backend::CloudHypervisor, None)
    }

    async fn prune(&self) -> Result<Vec<VmId>, DriverError> {
        let pruned = lifecycle::prune(&self.vms_dir(), Backend::CloudHypervisor, None, lifecycle::PRUNE_GRACE)?;
        let mut procs = self.procs();
        let mut consoles = self.consoles();
        for id in &pruned {
            procs.remove(id);
            consoles.remove(id);
        }
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

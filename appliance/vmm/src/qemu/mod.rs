//! QEMU `-M microvm` driver: QMP control ([`qmp`], on the `qapi` crate), daemonized processes
//! ([`process`]), command lines ([`cmdline`]).
//!
//! Guest agent transport: one virtio-serial port (`org.chrysalis.agent.0`) whose QEMU chardev is
//! `<vmdir>/agent-serial.sock`; the driver serves `<vmdir>/vsock.sock` with an
//! [`agent_mux::bridge::Bridge`] so callers dial it like a cloud-hypervisor vsock socket.
//! Snapshots are QMP `stop` + `migrate` to `exec:cat > <dir>/state` + a copy of the overlay;
//! restore starts QEMU with `-incoming defer`, `migrate-incoming`, then `cont`.

pub mod cmdline;
pub mod process;
pub mod qmp;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agent_mux::bridge::Bridge;
use async_trait::async_trait;
use tracing::Instrument;

use crate::accel::{self, Accel, AccelPreference};
use crate::driver::{AfterSnapshot, Backend, BootSpec, Driver, DriverError, Snapshot, Vm, VmId};
use crate::record;
use cmdline::{files, Launch};
use qmp::{Qmp, QmpError};

/// How long a QMP connect may take.
const QMP_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a migration (snapshot or restore) may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How long to wait for a killed QEMU to disappear.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Driver configuration.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// `$CHRYSALIS_STATE`: VMs live under `<state_dir>/vms/<id>/`.
    pub state_dir: PathBuf,
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// The `qemu-img` binary.
    pub qemu_img: PathBuf,
    /// Accelerator preference for specs that say `auto`.
    pub accel: AccelPreference,
    /// Host TSC kHz for TCG guests; `None` probes the host.
    pub tsc_khz: Option<u64>,
    /// How long the vsock bridge waits for the guest's mux to answer.
    pub agent_hello_timeout: Duration,
    /// Start VMs with vCPUs paused (`-S`); restore leaves them paused too. For tests.
    pub start_paused: bool,
    /// Boot only the microvm firmware, no kernel (process lifecycle tests without images).
    pub firmware_only: bool,
}

impl QemuConfig {
    /// Defaults: `$CHRYSALIS_STATE`, binaries from `PATH`, `CHRYSALIS_ACCEL`.
    pub fn from_env() -> Self {
        QemuConfig {
            state_dir: record::default_state_dir(),
            qemu: "qemu-system-x86_64".into(),
            qemu_img: "qemu-img".into(),
            accel: AccelPreference::from_env(),
            tsc_khz: None,
            agent_hello_timeout: Duration::from_secs(120),
            start_paused: false,
            firmware_only: false,
        }
    }
}

/// The QEMU driver.
pub struct QemuDriver {
    cfg: QemuConfig,
    accel: Accel,
    tsc_khz: Option<u64>,
    bridges: Mutex<HashMap<VmId, Bridge>>,
}

/// Removes a half-created VM (kills its process, deletes its dir) unless disarmed.
/// Synchronous so that it also runs when the boot future is dropped.
struct Pending {
    dir: PathBuf,
    pid: Option<(u32, u64)>,
    armed: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some((pid, st)) = self.pid {
            process::signal(pid, st, libc::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(5);
            while record::is_alive(pid, st) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn control(vm: &VmId) -> impl Fn(QmpError) -> DriverError + '_ {
    move |e| DriverError::Control { vm: vm.clone(), message: crate::error_chain(&e) }
}

/// Single-quotes `p` for `/bin/sh` (used in `exec:` migration URIs).
fn sh_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

impl QemuDriver {
    /// Creates the driver; probes the accelerator (logged) and, under TCG, the host TSC.
    pub fn new(cfg: QemuConfig) -> Self {
        let accel = accel::resolve(cfg.accel);
        let tsc_khz = cfg.tsc_khz.or_else(|| if accel == Accel::Tcg { cmdline::host_tsc_khz() } else { None });
        tracing::info!(%accel, ?tsc_khz, state_dir = %cfg.state_dir.display(), "qemu driver ready");
        QemuDriver { cfg, accel, tsc_khz, bridges: Mutex::new(HashMap::new()) }
    }

    fn vms_dir(&self) -> PathBuf {
        record::vms_dir(&self.cfg.state_dir)
    }

    fn resolve_accel(&self, pref: AccelPreference) -> Accel {
        match pref {
            AccelPreference::Auto => self.accel,
            p => accel::resolve(p),
        }
    }

    fn check_inputs(&self, spec: &BootSpec) -> Result<(), DriverError> {
        let mut need: Vec<&Path> = Vec::new();
        if !self.cfg.firmware_only {
            need.extend([spec.kernel.as_path(), spec.initrd.as_path()]);
        }
        need.extend(spec.rootfs.as_deref());
        need.extend(spec.overlay_base.as_deref());
        for p in need {
            if !p.is_file() {
                return Err(DriverError::Invalid(format!("template {}: {} is missing", spec.name, p.display())));
            }
        }
        Ok(())
    }

    fn new_vm_dir(&self, id: &VmId) -> Result<Pending, DriverError> {
        let vms = self.vms_dir();
        std::fs::create_dir_all(&vms).map_err(|e| DriverError::io(format!("creating {}", vms.display()), e))?;
        let dir = vms.join(id.as_str());
        std::fs::create_dir(&dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
        Ok(Pending { dir, pid: None, armed: true })
    }

    fn make_vm(
        &self,
        id: &VmId,
        dir: &Path,
        accel: Accel,
        pid: (u32, u64),
        spec: &BootSpec,
        from: Option<PathBuf>,
    ) -> Vm {
        Vm {
            id: id.clone(),
            backend: Backend::Qemu,
            accel,
            pid: pid.0,
            pid_start_time: pid.1,
            dir: dir.to_path_buf(),
            control_socket: dir.join(files::QMP),
            vsock_socket: dir.join(files::VSOCK),
            console_log: dir.join(files::CONSOLE),
            spec: spec.clone(),
            restored_from: from,
            created_at_epoch_secs: now_secs(),
        }
    }

    fn start_bridge(&self, vm: &Vm) -> Result<(), DriverError> {
        let b = Bridge::spawn(&vm.vsock_socket, &vm.dir.join(files::AGENT_SERIAL), self.cfg.agent_hello_timeout)
            .map_err(|e| {
                DriverError::io(format!("vm {}: vsock bridge", vm.id), std::io::Error::other(crate::error_chain(&e)))
            })?;
        self.lock_bridges().insert(vm.id.clone(), b);
        Ok(())
    }

    fn lock_bridges(&self) -> std::sync::MutexGuard<'_, HashMap<VmId, Bridge>> {
        // A poisoned map is still consistent (inserts/removes only).
        self.bridges.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn qmp(&self, vm: &Vm) -> Result<Qmp, DriverError> {
        if !record::is_alive(vm.pid, vm.pid_start_time) {
            return Err(DriverError::NotFound(vm.id.clone()));
        }
        Qmp::connect(&vm.control_socket, QMP_CONNECT_TIMEOUT).await.map_err(control(&vm.id))
    }

    fn console_tail(dir: &Path) -> String {
        let s = std::fs::read_to_string(dir.join(files::CONSOLE)).unwrap_or_default();
        let tail: Vec<&str> = s.lines().rev().take(15).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Polls `query-migrate` until completed; `failed`/`cancelled` is an error.
    async fn wait_migration(&self, id: &VmId, q: &Qmp, what: &str) -> Result<(), DriverError> {
        use qapi::qmp::MigrationStatus as S;
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            let (status, err) = q.migration().await.map_err(control(id))?;
            match status {
                Some(S::completed) => return Ok(()),
                Some(S::failed) | Some(S::cancelled) => {
                    return Err(DriverError::Control {
                        vm: id.clone(),
                        message: format!("{what} failed: {}", err.unwrap_or_else(|| "no reason given".into())),
                    })
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(DriverError::Timeout { vm: id.clone(), what: what.to_string(), after: MIGRATION_TIMEOUT });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn boot_inner(&self, id: &VmId, spec: &BootSpec, pending: &mut Pending) -> Result<Vm, DriverError> {
        let accel = self.resolve_accel(spec.accel);
        self.check_inputs(spec)?;
        let dir = pending.dir.clone();
        let overlay = match &spec.overlay_base {
            Some(base) => {
                let o = dir.join(files::OVERLAY);
                let args: Vec<String> = vec![
                    "create".into(),
                    "-q".into(),
                    "-f".into(),
                    "qcow2".into(),
                    "-F".into(),
                    "raw".into(),
                    "-b".into(),
                    base.display().to_string(),
                    o.display().to_string(),
                ];
                process::run(&self.cfg.qemu_img, &args).await?;
                Some(o)
            }
            None => None,
        };
        let args = cmdline::qemu_args(&Launch {
            name: id.as_str(),
            dir: &dir,
            spec,
            accel,
            tsc_khz: self.tsc_khz,
            overlay,
            incoming: false,
            paused: self.cfg.start_paused,
            firmware_only: self.cfg.firmware_only,
        });
        tracing::debug!(?args, "starting qemu");
        let pid = process::start_daemonized(&self.cfg.qemu, &args, &dir.join(files::PID)).await?;
        pending.pid = Some(pid);
        let vm = self.make_vm(id, &dir, accel, pid, spec, None);
        record::write_json_atomic(&dir.join(record::VM_JSON), &vm)?;
        self.start_bridge(&vm)?;
        Ok(vm)
    }

    async fn restore_inner(&self, snap: &Snapshot, id: &VmId, pending: &mut Pending) -> Result<Vm, DriverError> {
        let dir = pending.dir.clone();
        let overlay = match &snap.overlay {
            Some(parent) => {
                let o = dir.join(files::OVERLAY);
                let args: Vec<String> = vec![
                    "create".into(),
                    "-q".into(),
                    "-f".into(),
                    "qcow2".into(),
                    "-F".into(),
                    "qcow2".into(),
                    "-b".into(),
                    parent.display().to_string(),
                    o.display().to_string(),
                ];
                process::run(&self.cfg.qemu_img, &args).await?;
                Some(o)
            }
            None => None,
        };
        let args = cmdline::qemu_args(&Launch {
            name: id.as_str(),
            dir: &dir,
            spec: &snap.spec,
            accel: snap.accel,
            tsc_khz: self.tsc_khz,
            overlay,
            incoming: true,
            paused: true,
            firmware_only: self.cfg.firmware_only,
        });
        let pid = process::start_daemonized(&self.cfg.qemu, &args, &dir.join(files::PID)).await?;
        pending.pid = Some(pid);
        let vm = self.make_vm(id, &dir, snap.accel, pid, &snap.spec, Some(snap.dir.clone()));
        let q = self.qmp(&vm).await?;
        let state = snap.dir.join(files::STATE);
        q.migrate_incoming(&format!("exec:cat {}", sh_quote(&state))).await.map_err(control(id))?;
        self.wait_migration(id, &q, "incoming migration").await?;
        if !self.cfg.start_paused {
            q.cont().await.map_err(control(id))?;
        }
        record::write_json_atomic(&dir.join(record::VM_JSON), &vm)?;
        self.start_bridge(&vm)?;
        Ok(vm)
    }

    /// Stops the process (if still ours and alive) and removes the VM's directory and bridge.
    async fn destroy(&self, vm: &Vm) -> Result<(), DriverError> {
        self.lock_bridges().remove(&vm.id);
        if !process::kill_and_wait(vm.pid, vm.pid_start_time, KILL_WAIT).await {
            return Err(DriverError::Timeout {
                vm: vm.id.clone(),
                what: format!("qemu pid {} to exit after SIGKILL", vm.pid),
                after: KILL_WAIT,
            });
        }
        match std::fs::remove_dir_all(&vm.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DriverError::io(format!("removing {}", vm.dir.display()), e)),
        }
    }
}

#[async_trait]
impl Driver for QemuDriver {
    fn backend(&self) -> Backend {
        Backend::Qemu
    }

    fn accel(&self) -> Accel {
        self.accel
    }

    async fn boot(&self, spec: &BootSpec) -> Result<Vm, DriverError> {
        let id = VmId::generate(&spec.name);
        let span = tracing::info_span!("vm_boot", vm = %id, template = %spec.name, size = %spec.size);
        async {
            let t0 = Instant::now();
            let mut pending = self.new_vm_dir(&id)?;
            match self.boot_inner(&id, spec, &mut pending).await {
                Ok(vm) => {
                    pending.armed = false;
                    tracing::info!(accel = %vm.accel, pid = vm.pid, ms = t0.elapsed().as_millis() as u64, "vm started");
                    Ok(vm)
                }
                Err(e) => {
                    self.lock_bridges().remove(&id);
                    let console = Self::console_tail(&pending.dir);
                    tracing::warn!(error = %crate::error_chain(&e), %console, "boot failed; cleaning up");
                    drop(pending);
                    Err(e)
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn pause(&self, vm: &Vm) -> Result<(), DriverError> {
        self.qmp(vm).await?.stop().await.map_err(control(&vm.id))
    }

    async fn resume(&self, vm: &Vm) -> Result<(), DriverError> {
        self.qmp(vm).await?.cont().await.map_err(control(&vm.id))
    }

    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        let span = tracing::info_span!("vm_snapshot", vm = %vm.id, dir = %dir.display());
        async {
            let t0 = Instant::now();
            let q = self.qmp(vm).await?;
            let was_running = q.status().await.map_err(control(&vm.id))?.running;
            q.stop().await.map_err(control(&vm.id))?;
            let result = async {
                std::fs::create_dir_all(dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
                let state = dir.join(files::STATE);
                q.migrate(&format!("exec:cat > {}", sh_quote(&state))).await.map_err(control(&vm.id))?;
                self.wait_migration(&vm.id, &q, "migration to file").await?;
                let src_overlay = vm.dir.join(files::OVERLAY);
                let overlay = if src_overlay.exists() {
                    let dst = dir.join(files::OVERLAY);
                    std::fs::copy(&src_overlay, &dst).map_err(|e| {
                        DriverError::io(format!("copying {} to {}", src_overlay.display(), dst.display()), e)
                    })?;
                    Some(dst)
                } else {
                    None
                };
                let snap = Snapshot {
                    dir: dir.to_path_buf(),
                    backend: Backend::Qemu,
                    accel: vm.accel,
                    source: vm.id.clone(),
                    spec: vm.spec.clone(),
                    overlay,
                    created_at_epoch_secs: now_secs(),
                };
                record::write_json_atomic(&dir.join(Snapshot::FILE), &snap)?;
                Ok(snap)
            }
            .await;
            if after == AfterSnapshot::Resumed || (result.is_err() && was_running) {
                q.cont().await.map_err(control(&vm.id))?;
            }
            if result.is_ok() {
                tracing::info!(ms = t0.elapsed().as_millis() as u64, "snapshot written");
            }
            result
        }
        .instrument(span)
        .await
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        if snapshot.backend != Backend::Qemu {
            return Err(DriverError::Invalid(format!(
                "snapshot {} was written by {}",
                snapshot.dir.display(),
                snapshot.backend
            )));
        }
        let span = tracing::info_span!("vm_restore", vm = %id, from = %snapshot.source, template = %snapshot.spec.name);
        async {
            let t0 = Instant::now();
            self.check_inputs(&snapshot.spec)?;
            let mut pending = self.new_vm_dir(id)?;
            match self.restore_inner(snapshot, id, &mut pending).await {
                Ok(vm) => {
                    pending.armed = false;
                    tracing::info!(accel = %vm.accel, pid = vm.pid, ms = t0.elapsed().as_millis() as u64, "vm restored");
                    Ok(vm)
                }
                Err(e) => {
                    self.lock_bridges().remove(id);
                    tracing::warn!(error = %crate::error_chain(&e), "restore failed; cleaning up");
                    drop(pending);
                    Err(e)
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn shutdown(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        let span = tracing::info_span!("vm_shutdown", vm = %vm.id, pid = vm.pid);
        async {
            let t0 = Instant::now();
            let deadline = t0 + timeout;
            let left = || deadline.saturating_duration_since(Instant::now());
            if record::is_alive(vm.pid, vm.pid_start_time) {
                // 1. The guest control port: silkd has guest-init power off.
                let path = match crate::agent::request_poweroff(&vm.vsock_socket, crate::agent::control_budget(timeout)).await {
                    Ok(()) => "control",
                    Err(e) => {
                        // 2. ACPI, for guests without the control port.
                        tracing::info!(error = %crate::error_chain(&e), "control channel failed; falling back to system_powerdown");
                        match self.qmp(vm).await {
                            Ok(q) => {
                                if let Err(e) = q.system_powerdown().await {
                                    tracing::debug!(error = %e, "system_powerdown failed");
                                }
                            }
                            Err(e) => tracing::debug!(error = %crate::error_chain(&e), "no QMP for powerdown"),
                        }
                        "system_powerdown"
                    }
                };
                if process::wait_gone(vm.pid, vm.pid_start_time, left()).await {
                    tracing::info!(path, ms = t0.elapsed().as_millis() as u64, "guest powered off");
                } else {
                    // 3. SIGKILL (in destroy).
                    tracing::warn!(path, "guest did not power off in {timeout:?}; killing");
                }
            }
            self.destroy(vm).await
        }
        .instrument(span)
        .await
    }

    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        self.destroy(vm).instrument(tracing::info_span!("vm_kill", vm = %vm.id)).await
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        let vms = self.vms_dir();
        let entries = match std::fs::read_dir(&vms) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(DriverError::io(format!("listing {}", vms.display()), e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| DriverError::io(format!("listing {}", vms.display()), e))?;
            let path = entry.path().join(record::VM_JSON);
            if !path.exists() {
                continue; // a boot in progress (or its leftovers): not a VM yet
            }
            let vm: Vm = record::read_json(&path)?;
            if vm.backend == Backend::Qemu && record::is_alive(vm.pid, vm.pid_start_time) {
                out.push(vm);
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        let path = self.vms_dir().join(id.as_str()).join(record::VM_JSON);
        if !path.exists() {
            return Err(DriverError::NotFound(id.clone()));
        }
        let vm: Vm = record::read_json(&path)?;
        if vm.backend != Backend::Qemu || !record::is_alive(vm.pid, vm.pid_start_time) {
            return Err(DriverError::NotFound(id.clone()));
        }
        let q = self.qmp(&vm).await?;
        let status = q.status().await.map_err(control(id))?;
        tracing::info!(vm = %id, running = status.running, "re-attached");
        if !self.lock_bridges().contains_key(id) {
            self.start_bridge(&vm)?;
        }
        Ok(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(sh_quote(Path::new("/a b/c")), "'/a b/c'");
        assert_eq!(sh_quote(Path::new("/it's")), r"'/it'\''s'");
    }
}

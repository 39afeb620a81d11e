//! QEMU `-M microvm` driver: QMP control ([`qmp`], on the `qapi` crate), jailed processes
//! ([`process`], [`crate::jail`]), command lines ([`cmdline`]).
//!
//! QEMU runs jailed: as the VM user with no capabilities and no new privileges, in its own
//! session and cgroup leaf, under its seccomp sandbox (`-sandbox on,…,spawn=deny,…`). It opens
//! no path of ours: the driver binds the listening sockets (QMP, console, agent port) at their
//! usual paths and opens the kernel, the disks with their backing chain (`-add-fd` +
//! `-blockdev …file.filename=/dev/fdset/N`), the TAP and migration streams, and QEMU inherits
//! the descriptors ([`cmdline::Fds`]).
//!
//! Guest agent transport: one virtio-serial port (`org.chrysalis.agent.0`) whose QEMU chardev
//! serves `<vmdir>/agent-serial.sock`; the driver serves `<vmdir>/vsock.sock` with an
//! [`agent_mux::bridge::Bridge`] so callers dial it like a cloud-hypervisor vsock socket.
//! Snapshots are QMP `stop` + `getfd` (the driver's `<dir>/state`, passed over the QMP socket) +
//! `migrate fd:` + a copy of the overlay; restore starts QEMU with `-incoming defer` and the
//! state file inherited, `migrate-incoming fd:N`, then `cont`.
//!
//! A [`BootSpec::nic`] adds `-netdev tap,fd=N` (the driver attaches to the TAP inside the NIC's
//! netns) + `virtio-net-device` (the last device) and `chrysalis.ip/gw/mac` kernel arguments;
//! QEMU is spawned inside the NIC's netns too.
//! A clone of a NIC'd VM is restored with its own NIC ([`Driver::restore_with`]); its guest keeps
//! the parent's MAC/IP until re-addressed (`guest-init net-config`).
//!
//! Serial console: QEMU serves `<vmdir>/console.sock` (a listening socket the driver bound and
//! passed in), which the driver dials and drains into a size-capped `console.log`
//! ([`crate::console`], [`QemuConfig::console_cap`]); the first dial waits in the socket's
//! backlog from before QEMU runs, and [`Driver::attach`] dials again after a restart.
//!
//! Boot and restore share one path ([`QemuDriver`]'s `create`): the `creating` record is written
//! right after `mkdir`, the QEMU pid (the driver writes `qemu.pid` too) right after spawn,
//! `running` at the end ([`crate::lifecycle`]). `list` shows
//! `creating` VMs too, `kill` finds an unrecorded QEMU through its pid file or its command line,
//! and `prune` removes dead records — so a `kill -9` of the owner mid-boot leaks nothing.

pub mod cmdline;
mod disks;
mod memory;
pub mod process;
pub mod qmp;
mod snapshot;
mod volumes;
use disks::Origin;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agent_mux::bridge::Bridge;
use async_trait::async_trait;
use tracing::Instrument;

use crate::accel::{self, Accel, AccelPreference};
use crate::console::ConsoleDrain;
use crate::driver::{
    AfterSnapshot, Backend, BootSpec, Driver, DriverError, NicSpec, Ram, RestoreOptions, Snapshot, Vm, VmId, VmState,
};
use crate::jail::{JailError, JailSettings, Leaf, SpawnPlan};
use crate::lifecycle::{self, Finder, VmRecord};
use crate::record;
use cmdline::{files, DiskLayer, Launch};
use qmp::{Qmp, QmpError};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

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
    /// Bytes of serial console each VM keeps on disk ([`crate::console::DEFAULT_CONSOLE_CAP`]).
    pub console_cap: u64,
    /// The jail QEMU runs in ([`crate::jail`]; `CHRYSALIS_JAIL`, `CHRYSALIS_VM_USER`,
    /// `CHRYSALIS_VM_CGROUP`).
    pub jail: JailSettings,
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
            console_cap: crate::console::DEFAULT_CONSOLE_CAP,
            jail: JailSettings::from_env(),
        }
    }
}

/// The QEMU driver.
pub struct QemuDriver {
    cfg: QemuConfig,
    accel: Accel,
    tsc_khz: Option<u64>,
    bridges: Mutex<HashMap<VmId, Bridge>>,
    consoles: Mutex<HashMap<VmId, ConsoleDrain>>,
    shared_ram: memory::SharedRam,
    /// The QMP connection a [`Driver::pause`] kept open, so the resume of a paused warm VM
    /// (inside a claim) is one `cont`; any other QMP use closes it first (QEMU serves one QMP
    /// client at a time).
    parked: Mutex<HashMap<VmId, Qmp>>,
}

/// Removes a half-created VM (kills its processes, deletes its dir) unless disarmed.
/// Synchronous so that it also runs when the boot future is dropped. (A `kill -9` of our own
/// process skips it: then the `creating` record lets the next owner find the VM.)
struct Pending {
    dir: PathBuf,
    pid: Option<(u32, u64)>,
    /// The console drain, handed to the driver's map on success (dropped, and so stopped, otherwise).
    console: Option<ConsoleDrain>,
    /// The VM's cgroup leaf, removed with it.
    leaf: Option<Leaf>,
    /// The jail's cgroups, where a child not yet exec'd is found.
    cgroups: Option<crate::jail::CgroupLayout>,
    armed: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Also the daemon whose pid was not recorded yet (future dropped mid-spawn).
        let find = Finder { pidfile: Some(files::PID), cgroups: self.cgroups.as_ref() };
        let procs = lifecycle::vm_processes(&self.dir, self.pid, &find);
        if !lifecycle::kill_all_blocking(&procs, Duration::from_secs(5)) {
            tracing::error!(dir = %self.dir.display(), ?procs, "a half-created VM's QEMU survived SIGKILL; keeping its dir");
            return;
        }
        if let Some(leaf) = &self.leaf {
            leaf.remove();
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

impl QemuDriver {
    /// Creates the driver; probes the accelerator (logged) and, under TCG, the host TSC.
    pub fn new(cfg: QemuConfig) -> Self {
        let accel = accel::resolve(cfg.accel);
        let tsc_khz = cfg.tsc_khz.or_else(|| if accel == Accel::Tcg { cmdline::host_tsc_khz() } else { None });
        tracing::info!(%accel, ?tsc_khz, state_dir = %cfg.state_dir.display(), "qemu driver ready");
        QemuDriver {
            cfg,
            accel,
            tsc_khz,
            bridges: Mutex::new(HashMap::new()),
            consoles: Mutex::new(HashMap::new()),
            shared_ram: memory::SharedRam::default(),
            parked: Mutex::new(HashMap::new()),
        }
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
        if let Some(nic) = &spec.nic {
            nic.validate()?;
        }
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

    fn vm_dir(&self, id: &VmId) -> PathBuf {
        self.vms_dir().join(id.as_str())
    }

    /// Creates the VM directory holding its `creating` record, guarded by [`Pending`].
    fn new_vm_dir(&self, rec: &VmRecord) -> Result<Pending, DriverError> {
        lifecycle::create_vm_dir(rec)?;
        let cgroups = self.cfg.jail.cgroups().cloned();
        Ok(Pending { dir: rec.vm.dir.clone(), pid: None, console: None, leaf: None, cgroups, armed: true })
    }

    fn make_vm(&self, id: &VmId, accel: Accel, spec: &BootSpec, from: Option<PathBuf>) -> Result<Vm, DriverError> {
        let dir = self.vm_dir(id);
        let socks = crate::sockdir::socket_dir(&dir)?;
        Ok(Vm {
            id: id.clone(),
            backend: Backend::Qemu,
            accel,
            pid: 0,
            pid_start_time: 0,
            control_socket: socks.join(files::QMP),
            vsock_socket: socks.join(files::VSOCK),
            console_log: dir.join(files::CONSOLE),
            dir,
            spec: spec.clone(),
            restored_from: from,
            created_at_epoch_secs: now_secs(),
            state: VmState::Creating,
        })
    }

    /// Refuses a `Vm` whose directory is not ours (we delete it on stop).
    fn check_owned(&self, vm: &Vm) -> Result<(), DriverError> {
        if vm.backend != Backend::Qemu || vm.dir != self.vm_dir(&vm.id) {
            return Err(DriverError::Invalid(format!(
                "vm {} ({} in {}) is not a QEMU VM under {}",
                vm.id,
                vm.backend,
                vm.dir.display(),
                self.vms_dir().display()
            )));
        }
        Ok(())
    }

    fn start_bridge(&self, vm: &Vm) -> Result<(), DriverError> {
        let b = Bridge::spawn(
            &vm.vsock_socket,
            &vm.vsock_socket.with_file_name(files::AGENT_SERIAL),
            self.cfg.agent_hello_timeout,
        )
        .map_err(|e| {
            DriverError::io(format!("vm {}: vsock bridge", vm.id), std::io::Error::other(crate::error_chain(&e)))
        })?;
        self.lock_bridges().insert(vm.id.clone(), b);
        Ok(())
    }

    /// Dials the VM's console socket (QEMU serves it) and drains it into its capped log.
    fn console_drain(&self, vm: &Vm) -> Result<ConsoleDrain, DriverError> {
        ConsoleDrain::dial(
            &vm.control_socket.with_file_name(files::CONSOLE_SOCK),
            &vm.console_log,
            self.cfg.console_cap,
            // The driver listened on QEMU's console socket, in root's directory, and passed
            // QEMU the descriptor: its peer is the driver, and nobody else can replace it.
            None,
        )
        .map_err(|e| DriverError::io(format!("vm {}: opening the console log {}", vm.id, vm.console_log.display()), e))
    }

    fn lock_consoles(&self) -> std::sync::MutexGuard<'_, HashMap<VmId, ConsoleDrain>> {
        // A poisoned map is still consistent (inserts/removes only).
        self.consoles.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_bridges(&self) -> std::sync::MutexGuard<'_, HashMap<VmId, Bridge>> {
        // A poisoned map is still consistent (inserts/removes only).
        self.bridges.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn qmp(&self, vm: &Vm) -> Result<Qmp, DriverError> {
        drop(self.unpark(&vm.id));
        if !record::is_alive(vm.pid, vm.pid_start_time) {
            return Err(DriverError::NotFound(vm.id.clone()));
        }
        Qmp::connect(&vm.control_socket, QMP_CONNECT_TIMEOUT).await.map_err(control(&vm.id))
    }

    /// Takes the connection [`Driver::pause`] kept for `id`, if any.
    fn unpark(&self, id: &VmId) -> Option<Qmp> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner()).remove(id)
    }

    fn console_tail(dir: &Path) -> String {
        crate::console::tail_text(&dir.join(files::CONSOLE), 15)
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

    /// Boot and restore: `creating` record → overlay → QEMU → pid recorded → (restore: incoming
    /// migration, `cont`) → `running` record → vsock bridge. Errors and drops are cleaned up by
    /// `pending`; a `kill -9` of our process leaves the `creating` record for [`Driver::list`].
    async fn create(&self, id: &VmId, origin: Origin<'_>) -> Result<Vm, DriverError> {
        let t0 = Instant::now();
        let (spec, accel, from) = match origin {
            Origin::Boot(spec) => (spec.clone(), self.resolve_accel(spec.accel), None),
            Origin::Restore(snap, nic) => {
                let mut spec = snap.spec.clone();
                spec.nic = nic.cloned();
                spec.ram = snap.spec.ram.restored();
                (spec, snap.accel, Some(snap.dir.clone()))
            }
        };
        self.check_inputs(&spec)?;
        let mut rec = VmRecord::creating(self.make_vm(id, accel, &spec, from)?);
        let mut pending = self.new_vm_dir(&rec)?;
        match self.create_inner(&mut rec, origin, &mut pending).await {
            Ok(()) => {
                pending.armed = false;
                if let Some(drain) = pending.console.take() {
                    self.lock_consoles().insert(id.clone(), drain);
                }
                let what = if matches!(origin, Origin::Boot(_)) { "vm started" } else { "vm restored" };
                tracing::info!(accel = %rec.vm.accel, pid = rec.vm.pid, ms = t0.elapsed().as_millis() as u64, "{what}");
                Ok(rec.vm)
            }
            Err(e) => {
                self.lock_bridges().remove(id);
                let console = Self::console_tail(&pending.dir);
                tracing::warn!(error = %crate::error_chain(&e), %console, "start failed; cleaning up");
                drop(pending);
                Err(e)
            }
        }
    }

    async fn create_inner(
        &self,
        rec: &mut VmRecord,
        origin: Origin<'_>,
        pending: &mut Pending,
    ) -> Result<(), DriverError> {
        let dir = rec.vm.dir.clone();
        let backing = match origin {
            Origin::Boot(spec) => match spec.overlay_base.as_deref() {
                Some(b) => Some((b, "raw", crate::disk::overlay_size(spec, b)?)),
                None => None,
            },
            Origin::Restore(snap, _) => snap.overlay.as_deref().map(|o| (o, "qcow2", None)),
        };
        let overlay = match backing {
            Some((b, fmt, size)) => Some(self.create_overlay(&dir, b, fmt, size).await?),
            None => None,
        };
        let incoming = matches!(origin, Origin::Restore(..));
        let jail = self.cfg.jail.resolve()?;
        if let Some(j) = &jail {
            pending.leaf = Some(j.leaf(rec.vm.id.as_str(), rec.vm.spec.size, rec.vm.accel)?);
        }
        let sock_dir = rec.vm.control_socket.parent().unwrap_or(&dir).to_path_buf();
        let owner = jail.as_ref().map(|j| (j.uid, j.gid));
        let opened = self.open_fds(&rec.vm, &sock_dir, overlay.as_deref(), origin, owner).await?;
        let args = cmdline::qemu_args(&Launch {
            name: rec.vm.id.as_str(),
            dir: &dir,
            spec: &rec.vm.spec,
            accel: rec.vm.accel,
            tsc_khz: self.tsc_khz,
            fds: &opened.fds,
            incoming,
            paused: incoming || self.cfg.start_paused,
            firmware_only: self.cfg.firmware_only,
        });
        tracing::debug!(?args, jailed = jail.is_some(), "starting qemu");
        let netns = match rec.vm.spec.nic.as_ref().and_then(|n| n.netns_path()) {
            Some(path) => Some(
                std::fs::File::open(&path)
                    .map_err(|e| DriverError::io(format!("opening network namespace {}", path.display()), e))?,
            ),
            None => None,
        };
        let mut plan = SpawnPlan::new(jail.as_ref(), pending.leaf.as_ref());
        plan.inherit = opened.owned.iter().map(|f| f.as_raw_fd()).collect();
        plan.netns = netns.as_ref().map(|f| f.as_raw_fd());
        let log = dir.join(files::LOG);
        let (mut child, output) = process::spawn(&self.cfg.qemu, &args, &log, plan)?;
        let mut output = Some(output);
        // QEMU holds its own copies now; ours close, so a dead QEMU breaks every socket.
        let incoming_fd = opened.fds.incoming;
        drop(opened);
        drop(netns);
        let pid = child.id().unwrap_or(0);
        let start_time = record::pid_start_time(pid).unwrap_or(0);
        process::write_pidfile(&dir.join(files::PID), pid)?;
        pending.pid = Some((pid, start_time));
        rec.spawned(pid, start_time)?;
        rec.store()?;
        // Dialled now, the console connection waits in QEMU's backlog: boot output is kept.
        pending.console = Some(self.console_drain(&rec.vm)?);
        process::wait_ready(&self.cfg.qemu, &mut child, &mut output, &rec.vm.control_socket, &log).await?;
        if let Origin::Restore(snap, _) = origin {
            let id = &rec.vm.id;
            let q = self.qmp(&rec.vm).await?;
            let fd = incoming_fd.ok_or_else(|| DriverError::Invalid("restore without a migration stream".into()))?;
            if snap.spec.ram == Ram::SharedFile {
                // The stream holds no RAM: it is the golden's file, mapped already.
                q.ignore_shared(true).await.map_err(control(id))?;
            }
            q.migrate_incoming(&format!("fd:{fd}")).await.map_err(control(id))?;
            self.wait_migration(id, &q, "incoming migration").await?;
            if !self.cfg.start_paused {
                q.cont().await.map_err(control(id))?;
            }
        }
        rec.running()?;
        rec.store()?;
        self.start_bridge(&rec.vm)
    }

    /// Removes the VM's cgroup leaf, if the jail gives it one (a failure is logged and counted).
    fn remove_leaf(&self, id: &VmId) {
        if let Some(cgroups) = self.cfg.jail.cgroups() {
            cgroups.leaf_of(id.as_str()).remove();
        }
    }

    /// Where this driver's VM processes are found besides their records.
    fn finder(&self) -> Finder<'_> {
        Finder { pidfile: Some(files::PID), cgroups: self.cfg.jail.cgroups() }
    }

    /// Stops every process of the VM (the recorded pid; for a `creating` VM also the pid file's
    /// and any naming its directory) and removes its directory and bridge.
    async fn destroy(&self, vm: &Vm) -> Result<(), DriverError> {
        self.check_owned(vm)?;
        self.lock_bridges().remove(&vm.id);
        self.lock_consoles().remove(&vm.id);
        drop(self.unpark(&vm.id));
        // The caller's copy may predate the pid being recorded.
        let vm = &lifecycle::freshest(vm);
        let recorded = (vm.pid != 0).then_some((vm.pid, vm.pid_start_time));
        let procs = if vm.state == VmState::Running && recorded.is_some() {
            recorded.into_iter().collect()
        } else {
            lifecycle::vm_processes(&vm.dir, recorded, &self.finder())
        };
        if !lifecycle::kill_all(&procs, KILL_WAIT).await {
            return Err(DriverError::Timeout {
                vm: vm.id.clone(),
                what: format!("qemu processes {procs:?} to exit after SIGKILL"),
                after: KILL_WAIT,
            });
        }
        self.remove_leaf(&vm.id);
        crate::sockdir::release(&vm.dir);
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
        self.create(&id, Origin::Boot(spec)).instrument(span).await
    }

    async fn pause(&self, vm: &Vm) -> Result<(), DriverError> {
        let q = self.qmp(vm).await?;
        q.stop().await.map_err(control(&vm.id))?;
        self.parked.lock().unwrap_or_else(|p| p.into_inner()).insert(vm.id.clone(), q);
        Ok(())
    }

    async fn is_paused(&self, vm: &Vm) -> Result<bool, DriverError> {
        let q = self.qmp(vm).await?;
        let st = q.status().await.map_err(control(&vm.id))?;
        Ok(st.status == qapi::qmp::RunState::paused)
    }

    async fn set_cpu_weight(&self, vm: &Vm, weight: crate::jail::CpuWeight) -> Result<(), DriverError> {
        Ok(self.cfg.jail.set_cpu_weight(vm.id.as_str(), weight)?)
    }

    /// Resumes the vCPUs. A snapshot whose caller died mid-way may still be migrating the
    /// VM to its file: that migration is let finish (its result does not matter) first, since
    /// QEMU leaves the VM paused when it ends.
    async fn resume(&self, vm: &Vm) -> Result<(), DriverError> {
        use qapi::qmp::MigrationStatus as S;
        // Paused by us, with nothing run since: one `cont` on the kept connection.
        if let Some(q) = self.unpark(&vm.id) {
            match q.cont().await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(vm = %vm.id, error = %crate::error_chain(&e), "the kept QMP connection failed; dialling again")
                }
            }
        }
        let q = self.qmp(vm).await?;
        let (status, _) = q.migration().await.map_err(control(&vm.id))?;
        if !matches!(status, None | Some(S::none | S::completed | S::failed | S::cancelled)) {
            if let Err(e) = self.wait_migration(&vm.id, &q, "an interrupted snapshot").await {
                tracing::warn!(vm = %vm.id, error = %crate::error_chain(&e), "an interrupted snapshot did not finish");
            }
        }
        q.cont().await.map_err(control(&vm.id))
    }

    async fn attach_volume(&self, vm: &Vm, volume: &crate::driver::VolumeAttach) -> Result<(), DriverError> {
        self.plug_volume(vm, volume).await
    }

    async fn detach_volume(&self, vm: &Vm, slot: u16) -> Result<(), DriverError> {
        self.unplug_volume(vm, slot).await
    }

    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        self.snapshot_to(vm, dir, after).await
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        self.restore_with(snapshot, id, &RestoreOptions::default()).await
    }

    async fn restore_with(&self, snapshot: &Snapshot, id: &VmId, opts: &RestoreOptions) -> Result<Vm, DriverError> {
        if snapshot.backend != Backend::Qemu {
            return Err(DriverError::Invalid(format!(
                "snapshot {} was written by {}",
                snapshot.dir.display(),
                snapshot.backend
            )));
        }
        // The migration stream holds the device set: a clone has a NIC iff its parent had one.
        opts.check_against(snapshot)?;
        let span = tracing::info_span!("vm_restore", vm = %id, from = %snapshot.source, template = %snapshot.spec.name);
        self.create(id, Origin::Restore(snapshot, opts.nic.as_ref())).instrument(span).await
    }

    async fn shutdown(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        let span = tracing::info_span!("vm_shutdown", vm = %vm.id, pid = vm.pid);
        async {
            let t0 = Instant::now();
            let deadline = t0 + timeout;
            let left = || deadline.saturating_duration_since(Instant::now());
            // A VM still being created has no guest to ask: kill it.
            if vm.state == VmState::Running && record::is_alive(vm.pid, vm.pid_start_time) {
                // 1. The guest control port: silkd has guest-init power off.
                let path = match crate::agent::request_poweroff(&vm.vsock_socket, crate::agent::control_budget(timeout), None).await {
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
        lifecycle::list(&self.vms_dir(), Backend::Qemu, &self.finder())
    }

    async fn prune(&self) -> Result<Vec<VmId>, DriverError> {
        let pruned = lifecycle::prune(&self.vms_dir(), Backend::Qemu, &self.finder(), lifecycle::PRUNE_GRACE)?;
        let (mut a, mut b) = (self.lock_bridges(), self.lock_consoles());
        for id in &pruned {
            a.remove(id);
            b.remove(id);
        }
        self.cfg.jail.release_leaves(&pruned, lifecycle::PRUNE_GRACE);
        Ok(pruned)
    }

    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        let Some(VmRecord { vm, .. }) = VmRecord::load(&self.vm_dir(id))? else {
            return Err(DriverError::NotFound(id.clone()));
        };
        if &vm.id != id || vm.backend != Backend::Qemu {
            return Err(DriverError::NotFound(id.clone()));
        }
        if vm.state == VmState::Creating {
            return Err(DriverError::Invalid(format!(
                "vm {id} is still being created (its owner may have died mid-way): kill it"
            )));
        }
        if !record::is_alive(vm.pid, vm.pid_start_time) {
            return Err(DriverError::NotFound(id.clone()));
        }
        // A VM with a long directory is addressed through a link a temp cleaner may have removed.
        crate::sockdir::socket_dir(&vm.dir)?;
        let q = self.qmp(&vm).await?;
        let status = q.status().await.map_err(control(id))?;
        tracing::info!(vm = %id, running = status.running, "re-attached");
        if !self.lock_bridges().contains_key(id) {
            self.start_bridge(&vm)?;
        }
        // QEMU re-dials its console socket every second until this listener answers.
        if !self.lock_consoles().contains_key(id) {
            let drain = self.console_drain(&vm)?;
            self.lock_consoles().insert(id.clone(), drain);
        }
        Ok(vm)
    }
}

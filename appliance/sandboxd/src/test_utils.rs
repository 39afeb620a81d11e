//! Test doubles: [`FakeDriver`], an in-memory [`vmm::Driver`] with settable failures whose
//! VMs answer [`vmm::Driver::connect`] with an in-process silkd stand-in ([`fake_silkd`])
//! over a `tokio::io::duplex` pipe.
//!
//! The stand-in speaks real `wire` frames and knows a few commands:
//! - `echo ARGS…` → stdout `ARGS…\n`, exit 0; `cat` → echoes stdin until `stdin_close`;
//! - `fail` → stderr `boom`, exit 3; `sleep` → runs until `kill`ed (exit 137);
//! - `flood` → 9 × 1 MiB of stdout, then runs until killed;
//! - `port_forward` on port 7 is an echo server (`data` back, `done` after `data_end`),
//!   port 9 says `hello` and closes; other ports answer `not_found`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use vmm::{Accel, AfterSnapshot, AgentInfo, AgentStream, Backend, BootSpec, Driver, DriverError, Snapshot, Vm, VmId};
use wire::codec::{decode_request, encode_response, FrameSplitter};
use wire::{Bytes64, ErrorKind, Request, Response};

/// Operations whose failure a test can switch on.
#[derive(Debug, Clone, Default)]
pub struct Failures {
    /// `boot` fails.
    pub boot: bool,
    /// `restore` fails.
    pub restore: bool,
    /// `snapshot` fails.
    pub snapshot: bool,
    /// `wait_agent` times out.
    pub wait_agent: bool,
    /// `connect` fails (guest unreachable).
    pub connect: bool,
    /// `list` fails.
    pub list: bool,
    /// `attach` fails.
    pub attach: bool,
}

/// How often each operation ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calls {
    /// Cold boots.
    pub boots: usize,
    /// Clones.
    pub restores: usize,
    /// Snapshots.
    pub snapshots: usize,
    /// Kills and shutdowns.
    pub kills: usize,
    /// Attaches.
    pub attaches: usize,
    /// Lists.
    pub lists: usize,
}

#[derive(Debug, Default)]
struct State {
    vms: BTreeMap<VmId, Vm>,
    paused: std::collections::BTreeSet<VmId>,
    /// VMs at the background CPU weight.
    background: Vec<VmId>,
    fail: Failures,
    calls: Calls,
}

/// Processes of one fake guest that can be killed from another connection.
#[derive(Debug, Default)]
pub struct Procs {
    next: AtomicU32,
    running: Mutex<HashMap<u32, Arc<Notify>>>,
    /// `reseed` requests answered.
    pub reseeds: std::sync::atomic::AtomicU64,
    /// `set_clock` requests answered.
    pub clock_sets: std::sync::atomic::AtomicU64,
    /// What `fs_read /proc/meminfo` answers (in 64 KiB `data` frames); `None`: unimplemented.
    pub meminfo: Mutex<Option<Vec<u8>>>,
}

impl Procs {
    fn spawn(&self) -> (u32, Arc<Notify>) {
        let pid = 100 + self.next.fetch_add(1, Ordering::Relaxed);
        let n = Arc::new(Notify::new());
        lock(&self.running).insert(pid, Arc::clone(&n));
        (pid, n)
    }

    fn kill(&self, pid: u32) -> bool {
        match lock(&self.running).remove(&pid) {
            Some(n) => {
                n.notify_one();
                true
            }
            None => false,
        }
    }

    fn exited(&self, pid: u32) {
        lock(&self.running).remove(&pid);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Test double: a poisoned lock still holds usable data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An in-memory driver. Clone-free: share it as `Arc<FakeDriver>` (also across a simulated
/// restart, so VMs "survive").
#[derive(Debug)]
pub struct FakeDriver {
    dir: PathBuf,
    state: Mutex<State>,
    procs: Mutex<HashMap<VmId, Arc<Procs>>>,
}

impl FakeDriver {
    /// A driver whose VM dirs would live under `dir` (nothing is written but snapshots).
    pub fn new(dir: &Path) -> Arc<Self> {
        Arc::new(FakeDriver {
            dir: dir.to_path_buf(),
            state: Mutex::new(State::default()),
            procs: Mutex::new(HashMap::new()),
        })
    }

    /// Changes the failure switches.
    pub fn set_fail(&self, f: impl FnOnce(&mut Failures)) {
        f(&mut lock(&self.state).fail);
    }

    /// Operation counts so far.
    pub fn calls(&self) -> Calls {
        lock(&self.state).calls.clone()
    }

    /// Ids of live VMs.
    pub fn live(&self) -> Vec<VmId> {
        lock(&self.state).vms.keys().cloned().collect()
    }

    /// Whether a live VM's vCPUs are stopped (paused and not resumed since).
    pub fn is_paused(&self, id: &VmId) -> bool {
        lock(&self.state).paused.contains(id)
    }

    /// Whether a VM is live.
    pub fn is_live(&self, id: &VmId) -> bool {
        lock(&self.state).vms.contains_key(id)
    }

    /// Adds a live VM out of band (a leftover from a previous run).
    pub fn add_vm(&self, id: &str) -> VmId {
        // Test helper: callers pass literal valid ids.
        #[allow(clippy::unwrap_used)]
        let id = VmId::new(id).unwrap();
        let vm = self.make_vm(id.clone(), &fake_spec("base"), None);
        lock(&self.state).vms.insert(id.clone(), vm);
        id
    }

    fn make_vm(&self, id: VmId, spec: &BootSpec, restored_from: Option<PathBuf>) -> Vm {
        let dir = self.dir.join("vms").join(id.as_str());
        Vm {
            backend: Backend::Qemu,
            accel: Accel::Tcg,
            pid: 1,
            pid_start_time: 0,
            control_socket: dir.join("qmp.sock"),
            vsock_socket: dir.join("vsock.sock"),
            console_log: dir.join("console.log"),
            dir,
            spec: spec.clone(),
            restored_from,
            created_at_epoch_secs: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            state: vmm::VmState::Running,
            id,
        }
    }

    /// `reseed` requests the fake guest `id` answered.
    pub fn reseeds(&self, id: &VmId) -> u64 {
        self.procs_of(id).reseeds.load(Ordering::Relaxed)
    }

    /// Whether VM `id` runs at the background CPU weight.
    pub fn is_background(&self, id: &VmId) -> bool {
        lock(&self.state).background.contains(id)
    }

    /// `set_clock` requests the fake guest `id` answered.
    pub fn clock_sets(&self, id: &VmId) -> u64 {
        self.procs_of(id).clock_sets.load(Ordering::Relaxed)
    }

    /// Processes still running in every fake guest (exec children not yet exited or killed).
    pub fn running_procs(&self) -> usize {
        lock(&self.procs).values().map(|p| lock(&p.running).len()).sum()
    }

    /// The stand-in state of VM `id`'s guest.
    pub fn procs_of(&self, id: &VmId) -> Arc<Procs> {
        Arc::clone(lock(&self.procs).entry(id.clone()).or_default())
    }
}

/// A boot spec with dummy paths.
pub fn fake_spec(name: &str) -> BootSpec {
    BootSpec {
        overlay_bytes: None,
        name: name.into(),
        kernel: "/fake/vmlinux".into(),
        initrd: "/fake/initrd".into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        size: vmm::SizeClass::Small,
        accel: vmm::AccelPreference::Tcg,
        nic: None,
        rng: true,
        volumes: true,
        ram: vmm::Ram::Anonymous,
    }
}

/// Timings for tests over the fake driver: ticks of 20 ms, probes of a second, retries of
/// a fraction of one.
pub fn fast_timing() -> crate::node::Timing {
    crate::node::Timing {
        tick: Duration::from_millis(20),
        reap: Duration::from_millis(100),
        clone_probe: Duration::from_secs(1),
        cold_probe: Duration::from_secs(1),
        golden_retry: Duration::from_millis(200),
        reconcile_retry: Duration::from_millis(50),
        park: Duration::from_millis(200),
        relay_drain: Duration::from_secs(1),
        snapshot_gc: Duration::from_millis(200),
        idle_check: Duration::from_millis(100),
    }
}

/// A catalog holding `base` and `rt` (dummy paths) and the alias
/// `ghcr.io/cocoonstack/sandbox/rt:24.04` → `rt`.
pub fn fake_catalog() -> vmm::Catalog {
    let t = |name: &str| vmm::catalog::Template {
        kernel: "/fake/vmlinux".into(),
        initrd: format!("/fake/{name}.cpio.gz").into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        digest: format!("sha256:{name}"),
    };
    let mut c = vmm::Catalog::default();
    c.templates.insert("base".into(), t("base"));
    c.templates.insert("rt".into(), t("rt"));
    c.aliases.insert("ghcr.io/cocoonstack/sandbox/rt:24.04".into(), "rt".into());
    c
}

fn not_found(id: &VmId) -> DriverError {
    DriverError::NotFound(id.clone())
}

#[async_trait]
impl Driver for FakeDriver {
    fn backend(&self) -> Backend {
        Backend::Qemu
    }

    fn accel(&self) -> Accel {
        Accel::Tcg
    }

    async fn boot(&self, spec: &BootSpec) -> Result<Vm, DriverError> {
        let mut s = lock(&self.state);
        s.calls.boots += 1;
        if s.fail.boot {
            return Err(DriverError::Spawn { program: "fake".into(), detail: "boot failure injected".into() });
        }
        let vm = self.make_vm(VmId::generate(&spec.name), spec, None);
        s.vms.insert(vm.id.clone(), vm.clone());
        Ok(vm)
    }

    async fn connect(&self, vm: &Vm, _port: u32) -> Result<AgentStream, DriverError> {
        {
            let s = lock(&self.state);
            if s.fail.connect || !s.vms.contains_key(&vm.id) {
                return Err(DriverError::Invalid(format!("vm {}: agent unreachable (fake)", vm.id)));
            }
        }
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        tokio::spawn(fake_silkd(theirs, self.procs_of(&vm.id)));
        Ok(AgentStream::new(ours))
    }

    async fn wait_agent(&self, vm: &Vm, timeout: Duration) -> Result<AgentInfo, DriverError> {
        let s = lock(&self.state);
        if s.fail.wait_agent || !s.vms.contains_key(&vm.id) {
            return Err(DriverError::Timeout {
                vm: vm.id.clone(),
                what: "the guest agent (fake)".into(),
                after: timeout,
            });
        }
        Ok(AgentInfo { version: "fake".into(), proto: 2, uptime_secs: 0, procs: 0, sessions: 0 })
    }

    async fn pause(&self, vm: &Vm) -> Result<(), DriverError> {
        let mut s = lock(&self.state);
        if !s.vms.contains_key(&vm.id) {
            return Err(not_found(&vm.id));
        }
        s.paused.insert(vm.id.clone());
        Ok(())
    }

    async fn is_paused(&self, vm: &Vm) -> Result<bool, DriverError> {
        let s = lock(&self.state);
        if !s.vms.contains_key(&vm.id) {
            return Err(not_found(&vm.id));
        }
        Ok(s.paused.contains(&vm.id))
    }

    async fn resume(&self, vm: &Vm) -> Result<(), DriverError> {
        let mut s = lock(&self.state);
        if !s.vms.contains_key(&vm.id) {
            return Err(not_found(&vm.id));
        }
        s.paused.remove(&vm.id);
        Ok(())
    }

    async fn set_cpu_weight(&self, vm: &Vm, weight: vmm::jail::CpuWeight) -> Result<(), DriverError> {
        let mut s = lock(&self.state);
        if !s.vms.contains_key(&vm.id) {
            return Err(not_found(&vm.id));
        }
        s.background.retain(|id| *id != vm.id);
        if weight == vmm::jail::CpuWeight::Background {
            s.background.push(vm.id.clone());
        }
        Ok(())
    }

    async fn snapshot(&self, vm: &Vm, dir: &Path, _after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        {
            let mut s = lock(&self.state);
            s.calls.snapshots += 1;
            if s.fail.snapshot || !s.vms.contains_key(&vm.id) {
                return Err(DriverError::Control { vm: vm.id.clone(), message: "snapshot failure injected".into() });
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
        let snap = Snapshot {
            dir: dir.to_path_buf(),
            backend: Backend::Qemu,
            accel: Accel::Tcg,
            source: vm.id.clone(),
            spec: vm.spec.clone(),
            overlay: Some(dir.join("overlay.qcow2")),
            created_at_epoch_secs: 0,
        };
        let json = serde_json::to_vec(&snap).map_err(|e| DriverError::Invalid(e.to_string()))?;
        std::fs::write(dir.join(Snapshot::FILE), json).map_err(|e| DriverError::io("writing snapshot.json", e))?;
        Ok(snap)
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        let mut s = lock(&self.state);
        s.calls.restores += 1;
        if s.fail.restore {
            return Err(DriverError::Control { vm: id.clone(), message: "restore failure injected".into() });
        }
        if !snapshot.dir.join(Snapshot::FILE).exists() {
            return Err(DriverError::Invalid(format!("no snapshot in {}", snapshot.dir.display())));
        }
        let vm = self.make_vm(id.clone(), &snapshot.spec, Some(snapshot.dir.clone()));
        s.vms.insert(id.clone(), vm.clone());
        Ok(vm)
    }

    /// Like the QEMU driver: a clone has a NIC iff its snapshot's VM had one, recorded in the
    /// clone's spec.
    async fn restore_with(
        &self,
        snapshot: &Snapshot,
        id: &VmId,
        opts: &vmm::RestoreOptions,
    ) -> Result<Vm, DriverError> {
        if snapshot.spec.nic.is_some() != opts.nic.is_some() {
            return Err(DriverError::Invalid("a clone has a NIC iff its snapshot's VM had one".into()));
        }
        let mut snap = snapshot.clone();
        snap.spec.nic = opts.nic.clone();
        self.restore(&snap, id).await
    }

    async fn shutdown(&self, vm: &Vm, _timeout: Duration) -> Result<(), DriverError> {
        self.kill(vm).await
    }

    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        let mut s = lock(&self.state);
        s.calls.kills += 1;
        s.vms.remove(&vm.id).map(|_| ()).ok_or_else(|| not_found(&vm.id))
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        let mut s = lock(&self.state);
        s.calls.lists += 1;
        if s.fail.list {
            return Err(DriverError::io("listing vms (fake)", std::io::Error::other("list failure injected")));
        }
        Ok(s.vms.values().cloned().collect())
    }

    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        let mut s = lock(&self.state);
        s.calls.attaches += 1;
        if s.fail.attach {
            return Err(DriverError::Control { vm: id.clone(), message: "attach failure injected".into() });
        }
        s.vms.get(id).cloned().ok_or_else(|| not_found(id))
    }
}

struct Io<S> {
    s: S,
    split: FrameSplitter,
    buf: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Io<S> {
    /// The next request; `None` at EOF or on a broken stream.
    async fn next(&mut self) -> Option<Result<Request, String>> {
        loop {
            if let Some(f) = self.split.next_frame() {
                return Some(match f {
                    Ok(line) => decode_request(&line).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                });
            }
            let n = self.s.read(&mut self.buf).await.ok()?;
            if n == 0 {
                return None;
            }
            self.split.push(&self.buf[..n]);
        }
    }

    async fn send(&mut self, r: Response) -> bool {
        match encode_response(&r) {
            Ok(b) => self.s.write_all(&b).await.is_ok(),
            Err(_) => false,
        }
    }
}

/// The silkd stand-in: serves one proto-2 connection until EOF.
pub async fn fake_silkd<S: AsyncRead + AsyncWrite + Unpin>(s: S, procs: Arc<Procs>) {
    let mut io = Io { s, split: FrameSplitter::new(), buf: vec![0; 64 * 1024] };
    while let Some(req) = io.next().await {
        let ok = match req {
            Err(e) => io.send(Response::error(ErrorKind::BadRequest, format!("parse: {e}"))).await,
            Ok(Request::Info) => {
                io.send(Response::Info { version: "fake".into(), proto: 2, uptime_secs: 1, procs: 0, sessions: 0 })
                    .await
            }
            Ok(Request::Exec { argv, .. }) => exec(&mut io, &procs, argv).await,
            Ok(Request::Kill { pid, .. }) => {
                if procs.kill(pid) {
                    io.send(Response::Done).await
                } else {
                    io.send(Response::error(ErrorKind::NotFound, "no such pid")).await
                }
            }
            Ok(Request::PortForward { port }) => port_forward(&mut io, port).await,
            Ok(Request::Reseed { data }) if (1..=wire::RESEED_MAX_BYTES).contains(&data.0.len()) => {
                procs.reseeds.fetch_add(1, Ordering::Relaxed);
                io.send(Response::Done).await
            }
            Ok(Request::SetClock { unix_ns }) if unix_ns >= wire::SET_CLOCK_MIN_UNIX_SECS * 1_000_000_000 => {
                procs.clock_sets.fetch_add(1, Ordering::Relaxed);
                io.send(Response::Done).await
            }
            Ok(Request::FsRead { path }) if path == "/proc/meminfo" && lock(&procs.meminfo).is_some() => {
                let text = lock(&procs.meminfo).clone().unwrap_or_default();
                let mut ok = true;
                for chunk in text.chunks(64 * 1024) {
                    ok = ok && io.send(Response::Data { data: wire::Bytes64(chunk.to_vec()) }).await;
                }
                ok && io.send(Response::Done).await
            }
            Ok(r) if r.is_continuation() => true,
            Ok(r) => io.send(Response::error(ErrorKind::Unimplemented, format!("{} (fake silkd)", r.op()))).await,
        };
        if !ok {
            break;
        }
    }
    let _ = io.s.shutdown().await;
}

async fn exec<S: AsyncRead + AsyncWrite + Unpin>(io: &mut Io<S>, procs: &Procs, argv: Vec<String>) -> bool {
    let Some(cmd) = argv.first().cloned() else {
        return io.send(Response::error(ErrorKind::BadRequest, "argv must not be empty")).await;
    };
    let out = |s: &str| Response::Stdout { data: Bytes64(s.as_bytes().to_vec()) };
    match cmd.as_str() {
        "echo" => {
            let (pid, _) = procs.spawn();
            procs.exited(pid);
            io.send(Response::Started { pid }).await
                && io.send(out(&format!("{}\n", argv[1..].join(" ")))).await
                && io.send(Response::Exit { code: 0 }).await
        }
        // The clone re-addressing of egress VMs.
        "/.chrysalis/guest-init" if argv.get(1).map(String::as_str) == Some("net-config") && argv.len() == 5 => {
            let (pid, _) = procs.spawn();
            procs.exited(pid);
            io.send(Response::Started { pid }).await && io.send(Response::Exit { code: 0 }).await
        }
        "fail" => {
            let (pid, _) = procs.spawn();
            procs.exited(pid);
            io.send(Response::Started { pid }).await
                && io.send(Response::Stderr { data: Bytes64(b"boom".to_vec()) }).await
                && io.send(Response::Exit { code: 3 }).await
        }
        "cat" => {
            let (pid, _) = procs.spawn();
            if !io.send(Response::Started { pid }).await {
                return false;
            }
            loop {
                match io.next().await {
                    Some(Ok(Request::Stdin { data })) => {
                        if !io.send(Response::Stdout { data }).await {
                            return false;
                        }
                    }
                    Some(Ok(Request::StdinClose)) | None => break,
                    Some(_) => {}
                }
            }
            procs.exited(pid);
            io.send(Response::Exit { code: 0 }).await
        }
        "sleep" | "flood" => {
            let (pid, killed) = procs.spawn();
            if !io.send(Response::Started { pid }).await {
                return false;
            }
            if cmd == "flood" {
                let mib = Bytes64(vec![b'x'; 1024 * 1024]);
                for _ in 0..9 {
                    if !io.send(Response::Stdout { data: mib.clone() }).await {
                        return false;
                    }
                }
            }
            killed.notified().await;
            io.send(Response::Exit { code: 137 }).await
        }
        other => io.send(Response::error(ErrorKind::NotFound, format!("exec: {other}: not found"))).await,
    }
}

async fn port_forward<S: AsyncRead + AsyncWrite + Unpin>(io: &mut Io<S>, port: u16) -> bool {
    match port {
        7 => {
            if !io.send(Response::Ready).await {
                return false;
            }
            loop {
                match io.next().await {
                    Some(Ok(Request::Data { data })) => {
                        if !io.send(Response::Data { data }).await {
                            return false;
                        }
                    }
                    Some(Ok(Request::DataEnd)) => return io.send(Response::Done).await,
                    None => return false,
                    Some(_) => {}
                }
            }
        }
        9 => {
            io.send(Response::Ready).await
                && io.send(Response::Data { data: Bytes64(b"hello".to_vec()) }).await
                && io.send(Response::Done).await
        }
        _ => {
            io.send(Response::error(ErrorKind::NotFound, format!("connect 127.0.0.1:{port}: connection refused"))).await
        }
    }
}

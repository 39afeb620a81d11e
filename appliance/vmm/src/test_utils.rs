//! Test doubles: [`FakeDriver`], an in-memory [`Driver`] with settable failures and an in-process
//! fake agent, for sandboxd tests and benches.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, DuplexStream};

use crate::accel::Accel;
use crate::driver::{
    AfterSnapshot, AgentStream, Backend, BootSpec, Driver, DriverError, RestoreOptions, Snapshot, Vm, VmId, AGENT_PORT,
};

/// A [`Driver`] operation, for failure injection and call counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Driver::boot`].
    Boot,
    /// [`Driver::connect`] (also used by `wait_agent`).
    Connect,
    /// [`Driver::pause`].
    Pause,
    /// [`Driver::resume`].
    Resume,
    /// [`Driver::snapshot`].
    Snapshot,
    /// [`Driver::restore`].
    Restore,
    /// [`Driver::shutdown`].
    Shutdown,
    /// [`Driver::kill`].
    Kill,
    /// [`Driver::list`].
    List,
    /// [`Driver::attach`].
    Attach,
}

/// Serves one accepted agent stream for `port` (the `OK` handshake is already done).
pub type AgentFn = Arc<dyn Fn(u32, DuplexStream) + Send + Sync>;

#[derive(Default)]
struct State {
    vms: HashMap<VmId, (Vm, bool)>, // (vm, paused)
    failures: HashMap<Op, VecDeque<String>>,
    calls: HashMap<Op, usize>,
    next_pid: u32,
}

/// An in-memory driver. VMs "run" until killed; `connect` reaches an in-process fake agent that
/// answers silkd `info` on port 2048 (replaceable with [`FakeDriver::set_agent`]).
pub struct FakeDriver {
    state: Mutex<State>,
    agent: Mutex<AgentFn>,
    dir: PathBuf,
}

impl Default for FakeDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeDriver {
    /// A fake with no VMs.
    pub fn new() -> Self {
        FakeDriver {
            state: Mutex::new(State { next_pid: 1000, ..Default::default() }),
            agent: Mutex::new(Arc::new(info_agent)),
            dir: PathBuf::from("/fake/vms"),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic in a test thread must not hide later assertions.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the next call of `op` fail with `message` (queued: call repeatedly for more).
    pub fn fail_next(&self, op: Op, message: impl Into<String>) {
        self.st().failures.entry(op).or_default().push_back(message.into());
    }

    /// How often `op` was called.
    pub fn calls(&self, op: Op) -> usize {
        self.st().calls.get(&op).copied().unwrap_or(0)
    }

    /// Replaces the fake agent.
    pub fn set_agent(&self, f: AgentFn) {
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = f;
    }

    /// Whether `id` is paused.
    pub fn is_paused(&self, id: &VmId) -> Option<bool> {
        self.st().vms.get(id).map(|(_, p)| *p)
    }

    /// Simulates the VM process dying behind our back.
    pub fn crash(&self, id: &VmId) {
        self.st().vms.remove(id);
    }

    fn enter(&self, op: Op, vm: Option<&VmId>) -> Result<(), DriverError> {
        let mut st = self.st();
        *st.calls.entry(op).or_default() += 1;
        if let Some(msg) = st.failures.get_mut(&op).and_then(|q| q.pop_front()) {
            return Err(DriverError::Control {
                vm: vm.cloned().unwrap_or_else(|| VmId::generate("fake")),
                message: msg,
            });
        }
        if let Some(id) = vm {
            if !st.vms.contains_key(id) {
                return Err(DriverError::NotFound(id.clone()));
            }
        }
        Ok(())
    }

    fn add(&self, id: VmId, spec: &BootSpec, from: Option<PathBuf>) -> Vm {
        let mut st = self.st();
        st.next_pid += 1;
        let dir = self.dir.join(id.as_str());
        let vm = Vm {
            id: id.clone(),
            backend: Backend::Qemu,
            accel: Accel::Tcg,
            pid: st.next_pid,
            pid_start_time: 0,
            control_socket: dir.join("qmp.sock"),
            vsock_socket: dir.join("vsock.sock"),
            console_log: dir.join("console.log"),
            dir,
            spec: spec.clone(),
            restored_from: from,
            created_at_epoch_secs: 0,
            state: crate::driver::VmState::Running,
        };
        st.vms.insert(id, (vm.clone(), false));
        vm
    }
}

/// The default fake agent: on port 2048 answers every line with a silkd `info` frame.
fn info_agent(port: u32, s: DuplexStream) {
    if port != AGENT_PORT {
        return;
    }
    tokio::spawn(async move {
        let (r, mut w) = tokio::io::split(s);
        let mut lines = tokio::io::BufReader::new(r).lines();
        while let Ok(Some(_)) = lines.next_line().await {
            let reply =
                b"{\"type\":\"info\",\"version\":\"fake\",\"proto\":2,\"uptime_secs\":0,\"procs\":0,\"sessions\":0}\n";
            if w.write_all(reply).await.is_err() {
                break;
            }
        }
    });
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
        self.enter(Op::Boot, None)?;
        Ok(self.add(VmId::generate(&spec.name), spec, None))
    }

    async fn connect(&self, vm: &Vm, port: u32) -> Result<AgentStream, DriverError> {
        self.enter(Op::Connect, Some(&vm.id))?;
        if self.is_paused(&vm.id) == Some(true) {
            return Err(DriverError::Timeout {
                vm: vm.id.clone(),
                what: "a paused guest".into(),
                after: Duration::ZERO,
            });
        }
        let (ours, theirs) = tokio::io::duplex(256 * 1024);
        let f = self.agent.lock().unwrap_or_else(|p| p.into_inner()).clone();
        f(port, theirs);
        Ok(AgentStream::new(ours))
    }

    async fn pause(&self, vm: &Vm) -> Result<(), DriverError> {
        self.enter(Op::Pause, Some(&vm.id))?;
        if let Some(v) = self.st().vms.get_mut(&vm.id) {
            v.1 = true;
        }
        Ok(())
    }

    async fn resume(&self, vm: &Vm) -> Result<(), DriverError> {
        self.enter(Op::Resume, Some(&vm.id))?;
        if let Some(v) = self.st().vms.get_mut(&vm.id) {
            v.1 = false;
        }
        Ok(())
    }

    async fn snapshot(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        self.enter(Op::Snapshot, Some(&vm.id))?;
        if let Some(v) = self.st().vms.get_mut(&vm.id) {
            v.1 = after == AfterSnapshot::Paused;
        }
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            backend: Backend::Qemu,
            accel: Accel::Tcg,
            source: vm.id.clone(),
            spec: vm.spec.clone(),
            overlay: None,
            created_at_epoch_secs: 0,
        })
    }

    async fn restore(&self, snapshot: &Snapshot, id: &VmId) -> Result<Vm, DriverError> {
        self.restore_with(snapshot, id, &RestoreOptions::default()).await
    }

    /// Like the QEMU driver: a clone has a NIC iff the snapshot's VM had one; it is recorded in
    /// the clone's spec.
    async fn restore_with(&self, snapshot: &Snapshot, id: &VmId, opts: &RestoreOptions) -> Result<Vm, DriverError> {
        self.enter(Op::Restore, None)?;
        if snapshot.spec.nic.is_some() != opts.nic.is_some() {
            return Err(DriverError::Invalid("a clone has a NIC iff its snapshot's VM had one".into()));
        }
        if self.st().vms.contains_key(id) {
            return Err(DriverError::Invalid(format!("vm {id} exists")));
        }
        let mut spec = snapshot.spec.clone();
        spec.nic = opts.nic.clone();
        Ok(self.add(id.clone(), &spec, Some(snapshot.dir.clone())))
    }

    async fn shutdown(&self, vm: &Vm, _timeout: Duration) -> Result<(), DriverError> {
        self.enter(Op::Shutdown, None)?;
        self.st().vms.remove(&vm.id);
        Ok(())
    }

    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        self.enter(Op::Kill, None)?;
        self.st().vms.remove(&vm.id);
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        self.enter(Op::List, None)?;
        let mut v: Vec<Vm> = self.st().vms.values().map(|(vm, _)| vm.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(v)
    }

    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        self.enter(Op::Attach, Some(id))?;
        self.st().vms.get(id).map(|(vm, _)| vm.clone()).ok_or_else(|| DriverError::NotFound(id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AccelPreference, SizeClass};

    fn spec() -> BootSpec {
        BootSpec {
            name: "base".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            rootfs: None,
            overlay_base: None,
            cmdline: String::new(),
            size: SizeClass::Small,
            accel: AccelPreference::Auto,
            nic: None,
        }
    }

    #[tokio::test]
    async fn lifecycle_and_injected_failures() {
        let d: Arc<dyn Driver> = Arc::new(FakeDriver::new());
        let vm = d.boot(&spec()).await.expect("boot");
        let info = d.wait_agent(&vm, Duration::from_secs(1)).await.expect("agent");
        assert_eq!(info.version, "fake");
        assert_eq!(d.list().await.expect("list").len(), 1);
        let snap = d.snapshot(&vm, Path::new("/snap"), AfterSnapshot::Resumed).await.expect("snap");
        let clone = d.restore(&snap, &VmId::new("clone-1").expect("id")).await.expect("restore");
        assert_eq!(clone.restored_from.as_deref(), Some(Path::new("/snap")));
        d.kill(&vm).await.expect("kill");
        assert!(matches!(d.attach(&vm.id).await, Err(DriverError::NotFound(_))));
        assert_eq!(d.list().await.expect("list"), vec![clone.clone()]);

        // A NIC'd VM's clone needs its own NIC, recorded in its spec.
        let mut nspec = spec();
        nspec.nic = Some(crate::NicSpec {
            tap: "ct-parent".into(),
            mac: "02:00:00:00:00:01".into(),
            netns: None,
            ip_cidr: "10.88.0.2/24".into(),
            gateway: "10.88.0.1".into(),
        });
        let nvm = d.boot(&nspec).await.expect("boot");
        let nsnap = d.snapshot(&nvm, Path::new("/snap2"), AfterSnapshot::Resumed).await.expect("snap");
        let cid = VmId::new("clone-2").expect("id");
        assert!(matches!(d.restore(&nsnap, &cid).await, Err(DriverError::Invalid(_))), "clone without its own NIC");
        let own = crate::NicSpec { tap: "ct-clone".into(), ..nspec.nic.clone().expect("nic") };
        let opts = RestoreOptions { nic: Some(own.clone()) };
        let nclone = d.restore_with(&nsnap, &cid, &opts).await.expect("restore_with");
        assert_eq!(nclone.spec.nic, Some(own));
        assert!(matches!(d.restore_with(&snap, &cid, &opts).await, Err(DriverError::Invalid(_))), "no NIC to replace");

        let fake = FakeDriver::new();
        fake.fail_next(Op::Boot, "no capacity");
        assert!(
            matches!(fake.boot(&spec()).await, Err(DriverError::Control { message, .. }) if message == "no capacity")
        );
        assert!(fake.boot(&spec()).await.is_ok(), "failure is one-shot");
        assert_eq!(fake.calls(Op::Boot), 2);
        fake.fail_next(Op::List, "disk gone");
        assert!(fake.list().await.is_err(), "list errors are errors, not empty lists");
        let vm = fake.boot(&spec()).await.expect("boot");
        fake.pause(&vm).await.expect("pause");
        assert!(fake.wait_agent(&vm, Duration::from_millis(100)).await.is_err(), "paused guest does not answer");
    }
}

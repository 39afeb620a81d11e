//! A vk-cocoon virtual node on the test control plane, for the end-to-end suite:
//! [`CocoonEnv::up`] creates a network namespace of its own (`vkc-e2e-<pid>`: the bridge, the
//! TAPs and every QEMU live in it, so no VM packet leaves it), a `COCOON_ROOT_DIR` under /tmp
//! with the built catalog's `rt` imported as `ubuntu-dev-base` and `base` as `base`, starts the
//! cluster on its own port and the real `vk-cocoon` binary joined with the bootstrap token
//! ([`CocoonProvider`], restartable and killable), and waits for the Node to be Ready. The node,
//! its provider and the kubectl helpers are the shared [`VirtualNode`] (`CocoonEnv` derefs to
//! it). [`CocoonEnv::down`] stops all of it, kills every QEMU under the root, deletes the netns and
//! reports whatever survived.
//!
//! Guest access goes through the provider's own agent socket (`<root>/vms/<instance>/vsock.sock`,
//! served by the provider's QEMU driver): vk-cocoon's instance ids are `<vm id>-<8 hex>`.

use std::io::Read as _;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use silkd_client::{AgentConn, ExecOptions};
use vmm::AGENT_PORT;

use crate::netns::Netns;
use crate::sandboxd::free_port;
use crate::suite::{derefs_to_virtual_node, VirtualNode};

/// The vk-cocoon child process.
pub type CocoonProvider = crate::provider_process::ProviderProcess;

/// What [`CocoonEnv::up`] starts.
pub struct CocoonSpec<'a> {
    /// The apiserver port.
    pub port: u16,
    pub node_name: &'a str,
    pub provider_bin: PathBuf,
}

/// The running node.
pub struct CocoonEnv {
    _dir: tempfile::TempDir,
    /// Scratch space (under /tmp: QEMU socket paths must stay short).
    pub dir: PathBuf,
    /// `COCOON_ROOT_DIR`.
    pub root: PathBuf,
    /// The netns holding the bridge, TAPs and VMs.
    pub netns: Netns,
    /// Cluster, provider and node name.
    pub node: VirtualNode,
    /// `VK_METRICS_ADDR`: vk-cocoon's `/metrics` in plain HTTP ([`CocoonEnv::metrics`]).
    pub metrics_addr: SocketAddr,
    rt: tokio::runtime::Runtime,
    stopped: bool,
}

derefs_to_virtual_node!(CocoonEnv, node);

impl CocoonEnv {
    /// Netns, image library, cluster, provider; waits for the Node to be Ready.
    pub fn up(spec: CocoonSpec<'_>) -> Result<CocoonEnv, String> {
        let dir_guard = tempfile::Builder::new().prefix("vkc").tempdir_in("/tmp").map_err(|e| e.to_string())?;
        let dir = dir_guard.path().to_path_buf();
        // Long on purpose: VM socket paths under it exceed `sun_path` (as under a real
        // `~/.cache/chrysalis/vk-cocoon/<node>` root), so the suite covers vmm's short socket links.
        let root = dir.join("root-directory-long-enough-that-vm-socket-paths-exceed-sun-path");
        // Deleted on every way out of here (a guard), and by `down`.
        let netns = Netns::create(&format!("vkc-e2e-{}", std::process::id()))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let images = root.join("images");
        let imported = (|| -> Result<(), String> {
            let catalog = crate::catalog().map_err(|e| format!("{e:#}"))?;
            let store = images::Store::open(&images).map_err(|e| format!("image store: {e}"))?;
            for (template, name) in [("rt", "ubuntu-dev-base"), ("base", "base")] {
                let (_, t) = catalog.resolve(template).map_err(|e| format!("catalog: {e}"))?;
                store.import_catalog_template(name, t).map_err(|e| format!("importing {template} as {name}: {e}"))?;
            }
            Ok(())
        })();
        imported?;
        let (opts, cluster) = VirtualNode::cluster_up(&dir, spec.port, true)?;
        cluster.bind_node("vk-cocoon", spec.node_name).map_err(|e| format!("binding the node's RBAC: {e}"))?;
        let args = VirtualNode::join_args(&cluster, &dir)?;
        let s = |p: &Path| p.display().to_string();
        let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let envs: Vec<(String, String)> = vec![
            ("VK_NODE_NAME".into(), spec.node_name.into()),
            ("VK_NODE_IP".into(), "127.0.0.1".into()),
            ("VK_KUBELET_PORT".into(), free_port().to_string()),
            ("VK_NETNS".into(), netns.name().to_string()),
            // A loaded CI machine may take longer than the default 30 s between a restart and
            // the test's second kill; the scenario is about the rule, not the figure.
            ("VK_RESTART_COOLDOWN".into(), "600".into()),
            // Low, so that the per-Pod cap on streams is reached with a few execs under TCG.
            ("VK_MAX_STREAMS_PER_POD".into(), "3".into()),
            ("VK_CONSOLE_LOG_KIB".into(), crate::kubelet_streams::SUITE_CONSOLE_KIB.to_string()),
            ("COCOON_ROOT_DIR".into(), s(&root)),
            ("VK_METRICS_ADDR".into(), metrics_addr.to_string()),
            // The snapshot GC at test speed: every 3 s, removing what is 40 s old and unreferenced
            // (every scenario that clones does so within seconds of the save, and the Pods
            // naming a snapshot keep it).
            ("VK_SNAPSHOT_GC_INTERVAL".into(), "3s".into()),
            ("VK_SNAPSHOT_RETENTION".into(), "40s".into()),
            ("VK_TLS_CERT".into(), s(&dir.join("vk/tls.crt"))),
            ("VK_TLS_KEY".into(), s(&dir.join("vk/tls.key"))),
        ];
        let provider = CocoonProvider::new(
            "vk-cocoon",
            spec.provider_bin,
            args,
            envs,
            "info,vk_cocoon=debug,vnode=info",
            dir.clone(),
        );
        let mut env = CocoonEnv {
            _dir: dir_guard,
            dir,
            root,
            netns,
            node: VirtualNode {
                opts,
                cluster,
                provider,
                node_name: spec.node_name.into(),
                ready_within: Duration::from_secs(120),
            },
            metrics_addr,
            rt,
            stopped: false,
        };
        env.provider.ensure_running()?;
        env.wait_node_ready().map_err(|e| format!("{e}\n{}", env.provider.log_tail(60)))?;
        Ok(env)
    }

    /// Stops the provider (SIGTERM), the cluster, every QEMU under the root, and deletes the
    /// netns. Returns what survived (empty = clean).
    pub fn down(mut self) -> Vec<String> {
        self.stop_all()
    }

    fn stop_all(&mut self) -> Vec<String> {
        if std::mem::replace(&mut self.stopped, true) {
            return Vec::new();
        }
        let mut left = Vec::new();
        if let Err(e) = self.node.stop() {
            left.push(e);
        }
        for pid in crate::qemu_processes_under(&self.root) {
            // SAFETY: kill(2) on a QEMU pid naming this environment's root.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        let qemus = crate::sandboxd::wait_for_gone(&self.root.display().to_string());
        if !qemus.is_empty() {
            left.push(format!("QEMU processes survived SIGKILL: {qemus:?}"));
        }
        if let Err(e) = self.netns.delete() {
            left.push(e);
        }
        left
    }

    // ------------------------------------------------------------------------ VMs and guests

    /// The live hypervisor instances (`<root>/vms/<id>-<8 hex>/vm.json`) of VM `id`.
    pub fn instances(&self, id: &str) -> Vec<vmm::Vm> {
        let Ok(rd) = std::fs::read_dir(self.root.join("vms")) else { return Vec::new() };
        rd.flatten()
            .filter_map(|e| vmm::lifecycle::VmRecord::load(&e.path()).ok().flatten())
            .map(|r| r.vm)
            .filter(|vm| {
                vm.id.as_str().rsplit_once('-').is_some_and(|(owner, sfx)| owner == id && sfx.len() == 8)
                    && vmm::record::is_alive(vm.pid, vm.pid_start_time)
            })
            .collect()
    }

    /// Every live QEMU under the root.
    pub fn qemus(&self) -> Vec<u32> {
        crate::qemu_processes_under(&self.root)
    }

    /// Whether vk-cocoon holds a record of VM `id` (`<root>/cocoon/<id>.json`).
    pub fn has_record(&self, id: &str) -> bool {
        self.root.join("cocoon").join(format!("{id}.json")).exists()
    }

    /// The lease of `id` in `<root>/net/leases.json`, as JSON.
    pub fn lease(&self, id: &str) -> Option<Value> {
        let text = std::fs::read_to_string(self.root.join("net/leases.json")).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        v["leases"].get(id).cloned()
    }

    /// One scrape of `VK_METRICS_ADDR`'s `/metrics`, the body (HTTP/1.0: never chunked).
    pub fn metrics(&self) -> Result<String, String> {
        use std::io::Write as _;
        let err = |e: std::io::Error| format!("scraping http://{}/metrics: {e}", self.metrics_addr);
        let mut c = TcpStream::connect_timeout(&self.metrics_addr, Duration::from_secs(5)).map_err(err)?;
        c.set_read_timeout(Some(Duration::from_secs(10))).map_err(err)?;
        write!(c, "GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", self.metrics_addr).map_err(err)?;
        let mut out = String::new();
        c.read_to_string(&mut out).map_err(err)?;
        let (head, body) = out.split_once("\r\n\r\n").ok_or_else(|| format!("not an HTTP answer: {out:.200}"))?;
        if !head.lines().next().is_some_and(|l| l.starts_with("HTTP/1.") && l.contains(" 200")) {
            return Err(format!("/metrics answered {}", head.lines().next().unwrap_or_default()));
        }
        Ok(body.to_owned())
    }

    /// The image library.
    pub fn store(&self) -> Result<images::Store, String> {
        images::Store::open(self.root.join("images")).map_err(|e| e.to_string())
    }

    fn one_instance(&self, id: &str) -> Result<vmm::Vm, String> {
        let mut v = self.instances(id);
        match v.len() {
            1 => Ok(v.remove(0)),
            n => Err(format!("VM {id} has {n} live instances")),
        }
    }

    /// Runs `sh -c script` in VM `id`'s guest through its agent; stdout on exit 0.
    pub fn guest_sh(&self, id: &str, script: &str) -> Result<String, String> {
        let vm = self.one_instance(id)?;
        self.rt.block_on(async {
            let s = vmm::agent::dial(&vm.vsock_socket, AGENT_PORT).await.map_err(|e| format!("dial {id}: {e}"))?;
            let out = tokio::time::timeout(
                Duration::from_secs(60),
                AgentConn::new(s).exec(&["sh", "-c", script], ExecOptions::default(), b""),
            )
            .await
            .map_err(|_| format!("{id}: {script}: timed out"))?
            .map_err(|e| format!("{id}: exec: {e}"))?;
            if out.code != 0 {
                return Err(format!("{id}: {script}: exit {}: {}", out.code, String::from_utf8_lossy(&out.stderr)));
            }
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        })
    }

    /// Starts `argv` detached in VM `id`'s guest.
    pub fn guest_spawn(&self, id: &str, argv: &[&str]) -> Result<(), String> {
        let vm = self.one_instance(id)?;
        self.rt.block_on(async {
            let s = vmm::agent::dial(&vm.vsock_socket, AGENT_PORT).await.map_err(|e| format!("dial {id}: {e}"))?;
            AgentConn::new(s)
                .exec_detached(argv, ExecOptions::default())
                .await
                .map(|_pid| ())
                .map_err(|e| format!("{id}: detached exec: {e}"))
        })
    }

    /// Connects from inside the netns to `ip:port` (retrying up to `within`) and returns what
    /// the server wrote before closing. Sends nothing: a server closing with unread input
    /// would answer with a reset that can discard its reply.
    pub fn tcp_from_netns(&self, ip: &str, port: u16, within: Duration) -> Result<String, String> {
        let addr: Ipv4Addr = ip.parse().map_err(|_| format!("{ip} is not an IPv4 address"))?;
        let ns_path = Path::new("/run/netns").join(self.netns.name());
        std::thread::spawn(move || -> Result<String, String> {
            let f = std::fs::File::open(&ns_path).map_err(|e| format!("{}: {e}", ns_path.display()))?;
            // SAFETY: setns(2) on a namespace file we hold open; it switches only this thread.
            if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns: {}", std::io::Error::last_os_error()));
            }
            let deadline = Instant::now() + within;
            let mut last = String::new();
            while Instant::now() < deadline {
                match TcpStream::connect_timeout(&SocketAddr::from((addr, port)), Duration::from_secs(3)) {
                    Ok(mut s) => {
                        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                        let mut buf = Vec::new();
                        match s.read_to_end(&mut buf) {
                            Ok(_) if !buf.is_empty() => return Ok(String::from_utf8_lossy(&buf).into_owned()),
                            other => last = format!("read: {other:?}"),
                        }
                    }
                    Err(e) => last = format!("connect: {e}"),
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(format!("no answer from {addr}:{port} within {within:?} ({last})"))
        })
        .join()
        .map_err(|_| "the netns thread panicked".to_string())?
    }
}

impl Drop for CocoonEnv {
    fn drop(&mut self) {
        let left = self.stop_all();
        if !left.is_empty() {
            eprintln!("vk-cocoon environment teardown left: {left:?}");
        }
    }
}

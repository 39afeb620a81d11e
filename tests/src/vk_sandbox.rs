//! A vk-sandbox virtual node on the test control plane, as the end-to-end suite and the
//! benchmarks use it: [`NodeEnv::up`] starts the cluster on its own port and state directory, a
//! real `sandboxd` with the given pools ([`crate::sandboxd::Harness`]) and the real `vk-sandbox`
//! binary joined with the bootstrap token and the pinned CA hash ([`Provider`], restartable and
//! killable), then waits for the Node to be Ready. Also the kubectl helpers the scenarios share.
//! [`NodeEnv::down`] stops all of it and checks that no QEMU is left.

use std::collections::BTreeMap;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::{Cluster, Options};
use crate::sandboxd::{free_port, Harness};

/// The vk-sandbox child process.
pub type Provider = crate::provider_process::ProviderProcess;

/// How long a Pod may take to go from created to Running (controller + scheduler + provider).
pub const RUNNING: Duration = Duration::from_secs(90);

/// What [`NodeEnv::up`] starts.
pub struct NodeSpec<'a> {
    /// The apiserver port (each suite its own; see `test_infra::cluster`).
    pub port: u16,
    pub node_name: &'a str,
    /// sandboxd's `pools` config.
    pub pools: Value,
    /// `sandboxd` and `vk-sandbox` binaries.
    pub sandboxd_bin: PathBuf,
    pub provider_bin: PathBuf,
    /// Extra flags for vk-sandbox.
    pub extra_args: Vec<String>,
}

/// A binary of the target directory this test executable was built into
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`; `cargo xtask test` builds them first).
pub fn sibling_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // target/<profile>/deps/<test>-<hash> → target/<profile>/<name>
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join(name)).ok_or("odd test path")?;
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} is not built: run `cargo build -p {name}` first (cargo xtask test does)", bin.display()))
    }
}

/// The running node: cluster, sandboxd, provider. Dropping it without [`NodeEnv::down`] (a
/// panic) stops everything too.
pub struct NodeEnv {
    _dir: tempfile::TempDir,
    /// Scratch space of this environment (under /tmp: QEMU socket paths must stay short).
    pub dir: PathBuf,
    pub opts: Options,
    pub cluster: Cluster,
    pub sandboxd: Harness,
    pub provider: Provider,
    pub node_name: String,
    stopped: bool,
}

impl NodeEnv {
    /// Starts everything and waits for the pools to fill and the Node to be Ready.
    pub fn up(spec: NodeSpec<'_>) -> Result<NodeEnv, String> {
        let dir_guard = tempfile::Builder::new().prefix("vknode").tempdir_in("/tmp").map_err(|e| e.to_string())?;
        let dir = dir_guard.path().to_path_buf();
        let opts = Options { state_dir: dir.join("cluster"), port: spec.port, ..Options::default() };
        let cluster = Cluster::up_with(&opts).map_err(|e| format!("cluster up: {e}"))?;
        let sandboxd = Harness::new(&spec.sandboxd_bin, spec.pools.clone());
        for pool in spec.pools.as_array().into_iter().flatten() {
            if let Some(t) = pool["template"].as_str() {
                sandboxd.wait_full(t);
            }
        }
        let token_file = dir.join("bootstrap-token");
        std::fs::write(&token_file, &cluster.token).map_err(|e| e.to_string())?;
        let sandboxd_token = sandboxd.dir.path().join("token");
        let s = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = vec![
            "--node-name".into(),
            spec.node_name.into(),
            "--listen-addr".into(),
            format!("127.0.0.1:{}", free_port()),
            "--sandboxd-url".into(),
            format!("http://{}", sandboxd.addr),
            "--sandboxd-token-file".into(),
            s(&sandboxd_token),
            "--state-path".into(),
            s(&dir.join("vk/claims.json")),
            "--join-server".into(),
            cluster.endpoint.clone(),
            "--join-token-file".into(),
            s(&token_file),
            "--join-ca-hash".into(),
            cluster.ca_hash.clone(),
            "--credentials-dir".into(),
            s(&dir.join("vk/pki")),
        ];
        args.extend(spec.extra_args);
        let provider = Provider::new(
            "vk-sandbox",
            spec.provider_bin,
            args,
            Vec::new(),
            "info,vk_sandbox=debug,vnode=debug",
            dir.clone(),
        );
        let mut env = NodeEnv {
            _dir: dir_guard,
            dir,
            opts,
            cluster,
            sandboxd,
            provider,
            node_name: spec.node_name.into(),
            stopped: false,
        };
        env.provider.ensure_running()?;
        env.wait_node_ready()?;
        Ok(env)
    }

    /// Stops the provider (SIGTERM), the cluster, sandboxd and every QEMU of this environment.
    pub fn down(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        self.provider.stop();
        if let Err(e) = Cluster::down_with(&self.opts) {
            eprintln!("cluster down: {e}");
        }
        self.sandboxd.kill_everything();
        let left = crate::sandboxd::wait_for_gone(&self.sandboxd.dir.path().display().to_string());
        if !left.is_empty() {
            eprintln!("QEMU processes survived teardown: {left:?}");
        }
    }

    pub fn kubectl(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        self.cluster.kubectl().args(args).output()
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String, String> {
        self.cluster.kubectl_ok(args)
    }

    /// `kubectl get … -o json`, `None` when it does not exist.
    pub fn get(&self, args: &[&str]) -> Result<Option<Value>, String> {
        self.cluster.get_json(args)
    }

    /// `kubectl apply` of a JSON object (or List) into `ns`.
    pub fn apply(&self, ns: &str, object: &Value) -> Result<(), String> {
        self.cluster.apply_json(ns, object)
    }

    pub fn wait_node_ready(&self) -> Result<Value, String> {
        poll(&format!("node {} Ready", self.node_name), RUNNING, || {
            let node = self.get(&["node", &self.node_name])?;
            Ok(node.filter(|n| condition(n, "Ready").is_some_and(|c| c["status"] == "True")))
        })
    }

    pub fn pod(&self, ns: &str, name: &str) -> Result<Option<Value>, String> {
        self.get(&["pod", name, "-n", ns])
    }

    /// Waits for the pod to satisfy `f`.
    pub fn wait_pod(&self, ns: &str, name: &str, what: &str, f: impl Fn(&Value) -> bool) -> Result<Value, String> {
        poll(&format!("pod {ns}/{name} {what}"), RUNNING, || Ok(self.pod(ns, name)?.filter(|p| f(p))))
    }

    pub fn wait_running(&self, ns: &str, name: &str) -> Result<Value, String> {
        self.wait_pod(ns, name, "Running", |p| p["status"]["phase"] == "Running")
    }

    /// Events about `pod` as (type, reason, message).
    pub fn events(&self, ns: &str, pod: &str) -> Result<Vec<(String, String, String)>, String> {
        self.cluster.events(ns, pod)
    }

    /// sandboxd's claims whose `claim_ref` is in namespace `ns`: claim_ref → ids.
    pub fn claims_in(&self, ns: &str) -> BTreeMap<String, Vec<Value>> {
        let rows = self.sandboxd.root("GET", "/v1/sandboxes", None);
        let mut out: BTreeMap<String, Vec<Value>> = BTreeMap::new();
        for row in rows["sandboxes"].as_array().cloned().unwrap_or_default() {
            if let Some(r) = row["claim_ref"].as_str() {
                if r.starts_with(&format!("{ns}/")) {
                    out.entry(r.to_string()).or_default().push(row.clone());
                }
            }
        }
        out
    }

    /// Waits until the base pool is back at target (claims released, VMs refilled).
    pub fn wait_pool_full(&self, template: &str) {
        self.sandboxd.wait_full(template);
    }
}

impl Drop for NodeEnv {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Polls `f` every 200 ms until it yields a value or `timeout` passes.
pub fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    let until = Instant::now() + timeout;
    let mut last_err = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = e,
        }
        if Instant::now() >= until {
            return Err(format!("timed out after {timeout:?} waiting for {what} {last_err}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == kind)
}

pub fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj["metadata"]["annotations"][key].as_str()
}

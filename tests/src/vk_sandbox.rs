//! A vk-sandbox virtual node on the test control plane, as the end-to-end suite and the
//! benchmarks use it: [`NodeEnv::up`] starts the cluster on its own port and state directory, a
//! real `sandboxd` with the given pools ([`crate::sandboxd::Harness`]) and the real `vk-sandbox`
//! binary joined with the bootstrap token and the pinned CA hash ([`Provider`], restartable and
//! killable), then waits for the Node to be Ready. The node, its provider and the kubectl
//! helpers are the shared [`VirtualNode`] (`NodeEnv` derefs to it). [`NodeEnv::down`] stops all
//! of it and checks that no QEMU is left.

use std::collections::BTreeMap;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandboxd_api::{PoolConfig, SandboxList, SandboxRow};
use serde_json::Value;

use crate::sandboxd::{free_port, Harness};
use crate::suite::{derefs_to_virtual_node, VirtualNode};

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
    pub pools: Vec<PoolConfig>,
    /// `sandboxd` and `vk-sandbox` binaries.
    pub sandboxd_bin: PathBuf,
    pub provider_bin: PathBuf,
    /// Extra flags for vk-sandbox.
    pub extra_args: Vec<String>,
    /// Run metrics-server beside the cluster (`kubectl top`); a benchmark leaves it off.
    pub metrics_server: bool,
    /// Changes sandboxd's config after the harness set its own keys.
    pub sandboxd_config: fn(&mut sandboxd_api::Config),
}

/// The running node: cluster, sandboxd, provider. Dropping it without [`NodeEnv::down`] (a
/// panic) stops everything too.
pub struct NodeEnv {
    _dir: tempfile::TempDir,
    /// Scratch space of this environment (under /tmp: QEMU socket paths must stay short).
    pub dir: PathBuf,
    /// Cluster, provider and node name.
    pub node: VirtualNode,
    pub sandboxd: Harness,
    /// The binaries, for [`NodeEnv::add_box`].
    bins: (PathBuf, PathBuf),
    stopped: bool,
}

/// Another box of the fleet on the same control plane ([`NodeEnv::add_box`]): its own sandboxd
/// (same node token as every harness) and vk-sandbox joined as its own node. Dropping it
/// kills both and its VMs.
pub struct FleetBox {
    _dir: tempfile::TempDir,
    pub node_name: String,
    pub sandboxd: Harness,
    pub provider: Provider,
}

impl FleetBox {
    /// `kill -9` of its sandboxd and its vk-sandbox (the VMs stay, as on a box that died).
    pub fn kill9(&mut self) {
        self.sandboxd.kill9();
        self.provider.kill9();
    }
}

impl Drop for FleetBox {
    fn drop(&mut self) {
        self.provider.stop();
        self.sandboxd.kill_everything();
        let left = crate::sandboxd::wait_for_gone(&self.sandboxd.dir.path().display().to_string());
        if !left.is_empty() {
            eprintln!("QEMU processes of box {} survived teardown: {left:?}", self.node_name);
        }
    }
}

derefs_to_virtual_node!(NodeEnv, node);

impl NodeEnv {
    /// Starts everything and waits for the pools to fill and the Node to be Ready.
    pub fn up(spec: NodeSpec<'_>) -> Result<NodeEnv, String> {
        let dir_guard = tempfile::Builder::new().prefix("vknode").tempdir_in("/tmp").map_err(|e| e.to_string())?;
        let dir = dir_guard.path().to_path_buf();
        let (opts, cluster) = VirtualNode::cluster_up(&dir, spec.port, spec.metrics_server)?;
        cluster.bind_node("vk-sandbox", spec.node_name).map_err(|e| format!("binding the node's RBAC: {e}"))?;
        let sandboxd = Harness::with_config(&spec.sandboxd_bin, spec.pools.clone(), spec.sandboxd_config);
        for pool in &spec.pools {
            sandboxd.wait_full(&pool.template);
        }
        let args = provider_args(spec.node_name, &sandboxd, &dir, &cluster, spec.extra_args)?;
        let provider = Provider::new(
            "vk-sandbox",
            spec.provider_bin.clone(),
            args,
            Vec::new(),
            "info,vk_sandbox=debug,vnode=debug,kstream=debug,silkd_client=debug",
            dir.clone(),
        );
        let node = VirtualNode { opts, cluster, provider, node_name: spec.node_name.into(), ready_within: RUNNING };
        let bins = (spec.sandboxd_bin, spec.provider_bin);
        let mut env = NodeEnv { _dir: dir_guard, dir, node, sandboxd, bins, stopped: false };
        env.provider.ensure_running()?;
        env.wait_node_ready()?;
        Ok(env)
    }

    /// Starts another box on this control plane: a sandboxd with `pools` (filled before it
    /// returns) and a vk-sandbox joined as `node_name` with `extra_args`; waits for its Node to
    /// be Ready.
    pub fn add_box(
        &self,
        node_name: &str,
        pools: Vec<PoolConfig>,
        extra_args: Vec<String>,
    ) -> Result<FleetBox, String> {
        let dir_guard = tempfile::Builder::new().prefix("vkbox").tempdir_in("/tmp").map_err(|e| e.to_string())?;
        let dir = dir_guard.path().to_path_buf();
        self.cluster.bind_node("vk-sandbox", node_name).map_err(|e| format!("binding the node's RBAC: {e}"))?;
        let sandboxd = Harness::with_config(&self.bins.0, pools.clone(), |_| {});
        for pool in &pools {
            sandboxd.wait_full(&pool.template);
        }
        let args = provider_args(node_name, &sandboxd, &dir, &self.cluster, extra_args)?;
        let mut provider =
            Provider::new("vk-sandbox", self.bins.1.clone(), args, Vec::new(), "info,vk_sandbox=debug", dir.clone());
        provider.ensure_running()?;
        let b = FleetBox { _dir: dir_guard, node_name: node_name.into(), sandboxd, provider };
        crate::suite::poll(&format!("node {node_name} Ready"), RUNNING, || {
            let node = self.get(&["node", node_name])?;
            Ok(node.filter(|n| crate::suite::condition(n, "Ready").is_some_and(|c| c["status"] == "True")))
        })?;
        Ok(b)
    }

    /// Stops the provider (SIGTERM), the cluster, sandboxd and every QEMU of this environment.
    pub fn down(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        if let Err(e) = self.node.stop() {
            eprintln!("{e}");
        }
        self.sandboxd.kill_everything();
        let left = crate::sandboxd::wait_for_gone(&self.sandboxd.dir.path().display().to_string());
        if !left.is_empty() {
            eprintln!("QEMU processes survived teardown: {left:?}");
        }
    }

    pub fn wait_running(&self, ns: &str, name: &str) -> Result<Value, String> {
        self.wait_pod(ns, name, "Running", RUNNING, |p| p["status"]["phase"] == "Running")
    }

    /// sandboxd's claims whose `claim_ref` is in namespace `ns`: claim_ref → rows.
    pub fn claims_in(&self, ns: &str) -> BTreeMap<String, Vec<SandboxRow>> {
        let list: SandboxList = self.sandboxd.root_as("GET", "/v1/sandboxes", None);
        let mut out: BTreeMap<String, Vec<SandboxRow>> = BTreeMap::new();
        for row in list.sandboxes {
            if let Some(r) = row.claim_ref.clone().filter(|r| r.starts_with(&format!("{ns}/"))) {
                out.entry(r).or_default().push(row);
            }
        }
        out
    }

    /// Waits until the base pool is back at target (claims released, VMs refilled).
    pub fn wait_pool_full(&self, template: &str) {
        self.sandboxd.wait_full(template);
    }
}

/// vk-sandbox's flags for node `node` in front of `sandboxd`, state under `dir`.
fn provider_args(
    node: &str,
    sandboxd: &Harness,
    dir: &Path,
    cluster: &crate::cluster::Cluster,
    extra: Vec<String>,
) -> Result<Vec<String>, String> {
    let s = |p: &Path| p.display().to_string();
    let mut args: Vec<String> = vec![
        "--node-name".into(),
        node.into(),
        "--listen-addr".into(),
        format!("127.0.0.1:{}", free_port()),
        "--sandboxd-url".into(),
        format!("http://{}", sandboxd.addr),
        "--sandboxd-token-file".into(),
        s(&sandboxd.dir.path().join("token")),
        "--state-path".into(),
        s(&dir.join("vk/claims.json")),
    ];
    args.extend(VirtualNode::join_args(cluster, dir)?);
    args.extend(extra);
    Ok(args)
}

impl Drop for NodeEnv {
    fn drop(&mut self) {
        self.stop_all();
    }
}

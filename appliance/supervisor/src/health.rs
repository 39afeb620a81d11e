//! The appliance's health snapshot ([`Health`]) and the probes that fill it:
//! * services: from the supervisor;
//! * sandboxd: `GET /healthz` (is it answering) and `GET /v1/info` ([`sandboxd_api::Info`]: each
//!   pool's warm count and target; `GET /v1/pools` only lists the configured pools, without
//!   warm counts), with the root token, over HTTPS verified against sandboxd's certificate when
//!   it serves TLS;
//! * virtual nodes: with each node's own kubeconfig (`<state>/<svc>/pki/kubeconfig`,
//!   [`foundation::KUBECONFIG_FILE`], written by the join), the Node's `Ready` condition and
//!   its `kube-node-lease` Lease renewed within [`LEASE_FRESH`].
//!
//! "API server unreachable" (connect error, timeout, TLS failure) is kept apart from "reachable
//! but NotReady" ([`Health::api_reachable`]): the update gate treats an offline box by the
//! `update.offline` rule, never as a bad image.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::http::{self, Endpoint};
use crate::services::ServiceName;
use crate::supervise::ServiceStatus;

/// A Lease renewed longer ago than this is stale.
pub const LEASE_FRESH: Duration = Duration::from_secs(40);
/// Per-request limit of the probes.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a node probe failed (kept as text in [`NodeHealth::error`]).
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// The kubeconfig could not be loaded.
    #[error("loading {}", .path.display())]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The client could not be built.
    #[error("building the API client")]
    Client(#[source] kube::Error),
    /// A request failed.
    #[error("reading {what}")]
    Request {
        /// What was read.
        what: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

/// One warm pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHealth {
    /// Template.
    pub template: String,
    /// Size class.
    pub size: String,
    /// Network lane.
    pub net: String,
    /// Warm VMs now.
    pub warm: usize,
    /// Warm target.
    pub target: usize,
}

/// One virtual node as the cluster sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeHealth {
    /// Node name.
    pub name: String,
    /// The service behind it.
    pub service: String,
    /// `Ready` condition is `True`.
    pub ready: bool,
    /// Lease renewed within 40 s.
    pub lease_fresh: bool,
    /// The API server answered this probe.
    pub api_reachable: bool,
    /// What went wrong, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The snapshot the API, metrics and the update gate read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// Supervisor ready: every enabled service running and sandboxd (when enabled) answering.
    pub ready: bool,
    /// The services.
    pub services: Vec<ServiceStatus>,
    /// The configured virtual nodes.
    pub nodes: Vec<NodeHealth>,
    /// sandboxd's pools.
    pub pools: Vec<PoolHealth>,
    /// `None` without a cluster; `Some(false)` when the API server cannot be reached.
    pub api_reachable: Option<bool>,
    /// sandboxd answers `/healthz` (`None` when disabled).
    pub sandboxd_answers: Option<bool>,
    /// Why the pools could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools_error: Option<String>,
    /// The hypervisor sandboxd's VMs run under, with its accelerator (`qemu (tcg)`), from
    /// `GET /v1/info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<String>,
    /// Unix time of the snapshot.
    pub checked_at: u64,
}

impl Health {
    /// Every pool is at its warm target (and they could be read).
    pub fn pools_at_target(&self) -> bool {
        self.pools_error.is_none() && self.pools.iter().all(|p| p.warm >= p.target)
    }

    /// Every configured node is Ready with a fresh Lease.
    pub fn nodes_ready(&self) -> bool {
        self.nodes.iter().all(|n| n.ready && n.lease_fresh)
    }

    /// The update gate's notion of healthy: ready, nodes Ready, pools at target.
    pub fn healthy(&self) -> bool {
        self.ready && self.nodes_ready() && self.pools_at_target()
    }

    /// Local health is fine but the cluster cannot be reached (the `offline` rule applies).
    pub fn offline_but_locally_healthy(&self) -> bool {
        self.ready && self.pools_at_target() && self.api_reachable == Some(false)
    }
}

/// A node to probe.
#[derive(Debug, Clone)]
pub struct NodeTarget {
    /// The service.
    pub service: ServiceName,
    /// The node name.
    pub name: String,
    /// Its credentials directory.
    pub pki_dir: PathBuf,
}

/// Probes sandboxd and the cluster.
pub struct Prober {
    sandboxd: Option<Endpoint>,
    sandboxd_tls: Option<http::TlsClient>,
    sandboxd_token: Option<String>,
    nodes: Vec<NodeTarget>,
    endpoint: Option<String>,
    clients: Mutex<HashMap<PathBuf, (SystemTime, kube::Client)>>,
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober").field("sandboxd", &self.sandboxd).field("nodes", &self.nodes).finish_non_exhaustive()
    }
}

/// `host:port` of `https://host[:port][/]`.
pub fn endpoint_authority(endpoint: &str) -> Option<String> {
    let a = endpoint.strip_prefix("https://")?.trim_end_matches('/');
    if a.is_empty() {
        return None;
    }
    let has_port = if a.starts_with('[') { a.contains("]:") } else { a.contains(':') };
    Some(if has_port { a.to_string() } else { format!("{a}:443") })
}

fn kube_chain(e: &dyn std::error::Error) -> String {
    crate::error_chain(e)
}

impl Prober {
    /// A prober for sandboxd at `sandboxd` (with its root token) and these nodes of the
    /// cluster at `endpoint`.
    pub fn new(
        sandboxd: Option<Endpoint>,
        sandboxd_token: Option<String>,
        nodes: Vec<NodeTarget>,
        endpoint: Option<String>,
    ) -> Self {
        Prober { sandboxd, sandboxd_tls: None, sandboxd_token, nodes, endpoint, clients: Mutex::new(HashMap::new()) }
    }

    /// The same prober verifying an `https://` sandboxd with `tls`.
    pub fn with_sandboxd_tls(mut self, tls: http::TlsClient) -> Self {
        self.sandboxd_tls = Some(tls);
        self
    }

    /// Whether sandboxd answers `/healthz` (`None` when it is not configured).
    pub async fn sandboxd_answers(&self) -> Option<bool> {
        let ep = self.sandboxd.as_ref()?;
        let r = http::send(
            ep,
            self.sandboxd_tls.as_ref(),
            hyper::Method::GET,
            "/healthz",
            self.sandboxd_token.as_deref(),
            http::empty(),
            Duration::from_secs(2),
        )
        .await;
        Some(matches!(r, Ok(resp) if resp.status.is_success()))
    }

    /// sandboxd's pools from `GET /v1/info` (empty when sandboxd is not configured), and the
    /// hypervisor it names (`qemu (tcg)`; `None` from a sandboxd that does not say).
    pub async fn pools(&self) -> Result<(Vec<PoolHealth>, Option<String>), String> {
        let Some(ep) = &self.sandboxd else { return Ok((Vec::new(), None)) };
        let r = http::send(
            ep,
            self.sandboxd_tls.as_ref(),
            hyper::Method::GET,
            "/v1/info",
            self.sandboxd_token.as_deref(),
            http::empty(),
            PROBE_TIMEOUT,
        )
        .await
        .map_err(|e| crate::error_chain(&e))?;
        if !r.status.is_success() {
            return Err(format!("sandboxd answered GET /v1/info with {}", r.status));
        }
        let info: sandboxd_api::Info =
            serde_json::from_slice(&r.body).map_err(|e| format!("sandboxd's GET /v1/info: {e}"))?;
        let hypervisor = (!info.hypervisor.is_empty()).then(|| format!("{} ({})", info.hypervisor, info.accel));
        let pools = info
            .pools
            .into_iter()
            .map(|p| PoolHealth {
                template: p.key.template,
                size: p.key.size,
                net: p.key.net,
                warm: p.warm,
                target: p.target,
            })
            .collect();
        Ok((pools, hypervisor))
    }

    async fn client(&self, kubeconfig: &PathBuf) -> Result<kube::Client, HealthError> {
        let mtime = std::fs::metadata(kubeconfig).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut cache = self.clients.lock().await;
        if let Some((t, c)) = cache.get(kubeconfig) {
            if *t == mtime {
                return Ok(c.clone());
            }
        }
        let kc = kube::config::Kubeconfig::read_from(kubeconfig)
            .map_err(|source| HealthError::Kubeconfig { path: kubeconfig.clone(), source })?;
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|source| HealthError::Kubeconfig { path: kubeconfig.clone(), source })?;
        cfg.connect_timeout = Some(PROBE_TIMEOUT);
        cfg.read_timeout = Some(PROBE_TIMEOUT);
        cfg.write_timeout = Some(PROBE_TIMEOUT);
        let client = kube::Client::try_from(cfg).map_err(HealthError::Client)?;
        cache.insert(kubeconfig.clone(), (mtime, client.clone()));
        Ok(client)
    }

    async fn node(&self, t: &NodeTarget) -> NodeHealth {
        let mut h = NodeHealth {
            name: t.name.clone(),
            service: t.service.to_string(),
            ready: false,
            lease_fresh: false,
            api_reachable: false,
            error: None,
        };
        let kubeconfig = t.pki_dir.join(foundation::KUBECONFIG_FILE);
        if !kubeconfig.exists() {
            h.error = Some(format!("not joined yet (no {})", kubeconfig.display()));
            return h;
        }
        let client = match self.client(&kubeconfig).await {
            Ok(c) => c,
            Err(e) => {
                h.error = Some(kube_chain(&e));
                return h;
            }
        };
        let nodes: kube::Api<Node> = kube::Api::all(client.clone());
        match tokio::time::timeout(PROBE_TIMEOUT * 2, nodes.get_opt(&t.name)).await {
            Err(_) => {
                h.error = Some("the API server did not answer in time".into());
                return h;
            }
            Ok(Err(kube::Error::Api(s))) => {
                h.api_reachable = true;
                h.error = Some(format!("reading node {}: {} ({})", t.name, s.message, s.code));
                return h;
            }
            Ok(Err(source)) => {
                h.error = Some(kube_chain(&HealthError::Request { what: format!("node {}", t.name), source }));
                return h;
            }
            Ok(Ok(None)) => {
                h.api_reachable = true;
                h.error = Some(format!("node {} is not registered", t.name));
                return h;
            }
            Ok(Ok(Some(node))) => {
                h.api_reachable = true;
                h.ready = node
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                if !h.ready {
                    h.error = Some(format!("node {} is NotReady", t.name));
                }
            }
        }
        let leases: kube::Api<Lease> = kube::Api::namespaced(client, "kube-node-lease");
        match tokio::time::timeout(PROBE_TIMEOUT * 2, leases.get_opt(&t.name)).await {
            Ok(Ok(Some(lease))) => {
                let renewed = lease.spec.and_then(|s| s.renew_time).map(|t| t.0);
                let now = k8s_openapi::jiff::Timestamp::now();
                h.lease_fresh = renewed.is_some_and(|r| {
                    let age = now.duration_since(r);
                    age.as_secs() < LEASE_FRESH.as_secs() as i64
                });
                if !h.lease_fresh && h.error.is_none() {
                    h.error = Some(format!("lease kube-node-lease/{} is stale", t.name));
                }
            }
            Ok(Ok(None)) => {
                h.error.get_or_insert_with(|| format!("no lease kube-node-lease/{}", t.name));
            }
            Ok(Err(e)) => {
                h.error.get_or_insert_with(|| kube_chain(&e));
            }
            Err(_) => {
                h.error.get_or_insert_with(|| "the API server did not answer in time".into());
            }
        }
        h
    }

    /// Every configured node, and whether the API server is reachable (`None` without a
    /// cluster).
    pub async fn nodes(&self) -> (Vec<NodeHealth>, Option<bool>) {
        let Some(endpoint) = &self.endpoint else { return (Vec::new(), None) };
        let nodes = futures::future::join_all(self.nodes.iter().map(|t| self.node(t))).await;
        let reachable = if nodes.iter().any(|n| n.api_reachable) {
            true
        } else {
            // No node got an answer (or none has credentials yet): can we connect at all?
            match endpoint_authority(endpoint) {
                Some(a) => {
                    matches!(tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(a)).await, Ok(Ok(_)))
                        && nodes.iter().all(|n| n.error.as_deref().is_some_and(|e| e.starts_with("not joined")))
                }
                None => false,
            }
        };
        (nodes, Some(reachable))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn pool(warm: usize, target: usize) -> PoolHealth {
        PoolHealth { template: "base".into(), size: "small".into(), net: "none".into(), warm, target }
    }

    fn node(ready: bool, fresh: bool) -> NodeHealth {
        NodeHealth {
            name: "n".into(),
            service: "vk-sandbox".into(),
            ready,
            lease_fresh: fresh,
            api_reachable: true,
            error: None,
        }
    }

    #[test]
    fn healthy_needs_ready_nodes_and_pools() {
        let mut h = Health { ready: true, pools: vec![pool(1, 1)], nodes: vec![node(true, true)], ..Health::default() };
        assert!(h.healthy());
        h.pools[0].warm = 0;
        assert!(!h.healthy() && !h.pools_at_target());
        h.pools[0].warm = 1;
        h.nodes[0].lease_fresh = false;
        assert!(!h.healthy() && !h.nodes_ready());
        h.nodes[0].lease_fresh = true;
        h.pools_error = Some("x".into());
        assert!(!h.healthy());
        h.pools_error = None;
        h.ready = false;
        assert!(!h.healthy());
        let offline =
            Health { ready: true, api_reachable: Some(false), nodes: vec![node(false, false)], ..Health::default() };
        assert!(offline.offline_but_locally_healthy() && !offline.healthy());
    }

    #[test]
    fn endpoint_authorities() {
        assert_eq!(endpoint_authority("https://10.0.2.100:16443").as_deref(), Some("10.0.2.100:16443"));
        assert_eq!(endpoint_authority("https://k8s/").as_deref(), Some("k8s:443"));
        assert_eq!(endpoint_authority("https://[fd00::1]:6443").as_deref(), Some("[fd00::1]:6443"));
        assert_eq!(endpoint_authority("https://[fd00::1]").as_deref(), Some("[fd00::1]:443"));
        assert_eq!(endpoint_authority("http://x:1"), None);
    }

    #[tokio::test]
    async fn unjoined_nodes_and_unreachable_api() {
        let dir = tempfile::tempdir().unwrap();
        // Reserve a port, then free it: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let target =
            NodeTarget { service: ServiceName::VkSandbox, name: "box-sandbox".into(), pki_dir: dir.path().into() };
        let p = Prober::new(None, None, vec![target.clone()], Some(format!("https://127.0.0.1:{port}")));
        let (nodes, reachable) = p.nodes().await;
        assert_eq!(reachable, Some(false));
        assert!(nodes[0].error.as_deref().unwrap().starts_with("not joined yet"), "{nodes:?}");
        // Something listens: reachable, nodes still not joined.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let p = Prober::new(None, None, vec![target], Some(format!("https://{}", l.local_addr().unwrap())));
        assert_eq!(p.nodes().await.1, Some(true));
        // No cluster: nothing to say.
        assert_eq!(Prober::new(None, None, vec![], None).nodes().await, (vec![], None));
        assert_eq!(Prober::new(None, None, vec![], None).sandboxd_answers().await, None);
    }
}

//! What a caller hands [`crate::run`]: the Node's identity and shape ([`NodeConfig`]), the
//! runtime's knobs ([`RuntimeConfig`]), and [`NodeHandle`], the provider's way to change the
//! Node's extra conditions and extra resources and ask for an immediate status patch.

use crate::auth::AuthConfig;
use crate::streams::StreamLimits;
use k8s_openapi::api::core::v1::{NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use rustls::pki_types::CertificateDer;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// The Node this runtime registers and keeps alive.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The Node name; the client identity must be `system:node:<name>` under NodeRestriction.
    pub name: String,
    /// Provider labels. The runtime adds `type=virtual-kubelet` and
    /// `kubernetes.io/hostname=<name>` (never `kubernetes.io/role=agent`: NodeRestriction
    /// refuses it when a node registers itself).
    pub labels: BTreeMap<String, String>,
    /// Set at registration only: NodeRestriction forbids a node from changing its taints later.
    pub taints: Vec<Taint>,
    /// capacity = allocatable (`cpu`, `memory`, `pods`, …). Zero allocatable rejects every pod.
    pub capacity: BTreeMap<String, Quantity>,
    /// The address the API server dials for logs, exec, attach and port-forward: published as
    /// the Node's only address, `InternalIP`. Without one the Node lists `Hostname` (= `name`),
    /// which works only where the API server can resolve that name
    /// ([`crate::host_ip`] finds this host's address).
    pub internal_ip: Option<IpAddr>,
    /// `status.daemonEndpoints.kubeletEndpoint.port`.
    pub kubelet_port: u16,
    /// `status.nodeInfo.kubeletVersion`.
    pub kubelet_version: String,
    /// `spec.providerID`, set at registration.
    pub provider_id: Option<String>,
    /// Conditions besides `Ready` (e.g. pressure conditions); the heartbeat and transition
    /// times are stamped by the runtime. [`NodeHandle::set_conditions`] replaces them later.
    pub extra_conditions: Vec<NodeCondition>,
    /// Lets the provider trigger a status patch or change `extra_conditions` while running.
    pub handle: NodeHandle,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            name: String::new(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            capacity: BTreeMap::new(),
            internal_ip: None,
            kubelet_port: 10260,
            kubelet_version: concat!("v0.0.0-vnode-", env!("CARGO_PKG_VERSION")).to_string(),
            provider_id: None,
            extra_conditions: Vec::new(),
            handle: NodeHandle::default(),
        }
    }
}

/// The runtime's knobs (`docs/virtual-node.md` §1, §2.1, §5 #5).
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Token-bucket rate of each pod queue: `< 0` = per-key backoff only (no bucket), `0` =
    /// client-go's 5 qps / burst 10, otherwise this rate with `kube_api_burst`.
    pub kube_api_qps: f64,
    /// Token-bucket burst of each pod queue (at least 1).
    pub kube_api_burst: u32,
    /// Concurrent workers per pod queue.
    pub workers: usize,
    /// `true`: only Warning events are recorded (each Normal event is an API write).
    pub disable_pod_events: bool,
    /// The kubelet HTTPS endpoint.
    pub listen_addr: SocketAddr,
    /// Serving certificate and key (PEM). Unset or unreadable → a self-signed P-256 pair for
    /// the node name, node IP and 127.0.0.1.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (DER) a client certificate on the kubelet port must chain to (the
    /// kubelet's `--client-ca-file`). Empty: no client certificate is accepted (401), bearer
    /// tokens still are. [`crate::session::Session::run`] fills it with the cluster CA.
    pub client_ca: Vec<CertificateDer<'static>>,
    /// The kubelet port's review caches and caps ([`crate::auth`]).
    pub kubelet_auth: AuthConfig,
    /// The kubelet port's connection cap and timeouts ([`crate::kubelet::default_limits`]).
    pub kubelet_limits: httpd::Limits,
    /// The kubelet port's caps on open logs, exec, attach and port-forward sessions.
    pub stream_limits: StreamLimits,
    /// What `/stats/summary`, `/metrics/resource` and `/metrics` serve ([`crate::stats`]).
    pub stats: crate::stats::StatsConfig,
    /// `spec.leaseDurationSeconds` of the node Lease.
    pub lease_duration: Duration,
    /// How often the Lease is renewed.
    pub lease_renew: Duration,
    /// How often `nodes/status` is patched (also on [`NodeHandle::notify`]).
    pub status_interval: Duration,
    /// How often every pod is re-enqueued on the sync queue.
    pub resync: Duration,
    /// How often the API server is pinged; while it fails, Lease and status updates pause.
    pub ping_interval: Duration,
    /// How long a clean stop waits for workers to finish the item they are on.
    pub shutdown_grace: Duration,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            kube_api_qps: 200.0,
            kube_api_burst: 400,
            workers: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            disable_pod_events: false,
            listen_addr: SocketAddr::from(([0, 0, 0, 0], 10260)),
            tls_cert: None,
            tls_key: None,
            client_ca: Vec::new(),
            kubelet_auth: AuthConfig::default(),
            kubelet_limits: crate::kubelet::default_limits(),
            stream_limits: StreamLimits::default(),
            stats: crate::stats::StatsConfig::default(),
            lease_duration: Duration::from_secs(40),
            lease_renew: Duration::from_secs(10),
            status_interval: Duration::from_secs(60),
            resync: Duration::from_secs(60),
            ping_interval: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// A cheap, cloneable handle to the running Node's status loop.
#[derive(Debug, Clone, Default)]
pub struct NodeHandle(Arc<HandleInner>);

#[derive(Debug, Default)]
struct HandleInner {
    wake: Notify,
    conditions: Mutex<Option<Vec<NodeCondition>>>,
    resources: Mutex<BTreeMap<String, Quantity>>,
}

impl NodeHandle {
    /// Patch `nodes/status` now (still skipped while the API server is unreachable).
    pub fn notify(&self) {
        self.0.wake.notify_one();
    }

    /// Replaces the extra conditions and patches the status now.
    pub fn set_conditions(&self, conditions: Vec<NodeCondition>) {
        // A poisoned lock only means another setter panicked mid-assignment; the value is
        // still a whole Option, so keep going with it.
        let mut slot = self.0.conditions.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(conditions);
        drop(slot);
        self.notify();
    }

    /// Replaces the extra resources: merged into the Node's capacity and allocatable beside
    /// [`NodeConfig::capacity`] (which wins on a shared name), e.g. extended resources a
    /// provider counts. A resource dropped here is removed from the Node by the next status
    /// patch. Patches the status now when they changed; returns whether they did.
    pub fn set_extra_resources(&self, resources: BTreeMap<String, Quantity>) -> bool {
        // Replaced whole under the lock: a poisoned one still holds a whole map.
        let mut slot = self.0.resources.lock().unwrap_or_else(|p| p.into_inner());
        if *slot == resources {
            return false;
        }
        *slot = resources;
        drop(slot);
        self.notify();
        true
    }

    /// The resources set through [`NodeHandle::set_extra_resources`] (empty until then).
    pub fn extra_resources(&self) -> BTreeMap<String, Quantity> {
        self.0.resources.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The conditions set through [`NodeHandle::set_conditions`], if any.
    pub(crate) fn conditions(&self) -> Option<Vec<NodeCondition>> {
        self.0.conditions.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) async fn notified(&self) {
        self.0.wake.notified().await;
    }
}

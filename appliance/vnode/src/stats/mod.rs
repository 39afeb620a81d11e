//! What `kubectl top` and Prometheus read on the kubelet port: `GET /stats/summary`
//! ([`summary`], the Summary API, CPU and memory), `GET /metrics/resource` ([`resource`], what
//! metrics-server scrapes) and `GET /metrics` ([`runtime`], the runtime's own figures).
//!
//! The node's figures come from `/proc` ([`foundation::procfs`]); each Pod's from the provider
//! through [`PodMetrics`] (vk-cocoon measures its VMs, vk-sandbox asks sandboxd). A provider
//! that has none reports no Pods. The routes sit behind the kubelet port's guard like every
//! other: `/stats/…` is authorized as `nodes/stats`, `/metrics…` as `nodes/metrics`
//! ([`crate::auth::attributes`]).

pub mod resource;
pub mod runtime;
pub mod summary;
mod usage;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use foundation::procfs::Procfs;

pub use runtime::RuntimeMetrics;
use summary::{NodeSample, Rates};
pub use usage::{PodMetrics, PodUsage};

/// How long a provider may take to measure its Pods before a scrape goes on without them.
pub const POD_USAGE_TIMEOUT: Duration = Duration::from_secs(10);

/// The stats sources a runtime serves: the provider's [`PodMetrics`] (none: no Pods are
/// reported) and the runtime's own [`RuntimeMetrics`].
#[derive(Clone, Default)]
pub struct StatsConfig {
    /// The provider's measurements.
    pub pod_metrics: Option<Arc<dyn PodMetrics>>,
    /// The runtime's counters, shared across restarts.
    pub runtime: Arc<RuntimeMetrics>,
}

impl std::fmt::Debug for StatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatsConfig").field("pod_metrics", &self.pod_metrics.is_some()).finish_non_exhaustive()
    }
}

/// The routes' state: where samples come from and the previous CPU samples.
pub struct Stats {
    node: String,
    config: StatsConfig,
    procfs: Procfs,
    rates: Mutex<Rates>,
}

impl Stats {
    /// The runtime's own counters.
    pub(crate) fn runtime(&self) -> &RuntimeMetrics {
        &self.config.runtime
    }

    /// The stats of node `node`, from this host's `/proc`.
    pub fn new(node: &str, config: StatsConfig) -> Stats {
        Stats::with_procfs(node, config, Procfs::default())
    }

    /// The same, from `/proc`-shaped files elsewhere (tests).
    pub fn with_procfs(node: &str, config: StatsConfig, procfs: Procfs) -> Stats {
        Stats { node: node.to_owned(), config, procfs, rates: Mutex::new(Rates::default()) }
    }

    /// The node's sample, or why there is none.
    fn node_sample(&self) -> Result<NodeSample, foundation::procfs::ProcfsError> {
        let n = self.procfs.node()?;
        Ok(NodeSample {
            name: self.node.clone(),
            boot_time: (n.boot_time_secs > 0).then(|| UNIX_EPOCH + Duration::from_secs(n.boot_time_secs)),
            at: SystemTime::now(),
            cpu_usage_nanos: n.cpu_usage_nanos,
            memory_working_set_bytes: n.memory_working_set_bytes,
            memory_usage_bytes: n.memory_usage_bytes,
            memory_available_bytes: n.memory_available_bytes,
        })
    }

    /// The provider's Pods, and whether asking failed (it took too long).
    async fn pods(&self) -> (Vec<PodUsage>, bool) {
        let Some(source) = &self.config.pod_metrics else { return (Vec::new(), false) };
        match tokio::time::timeout(POD_USAGE_TIMEOUT, source.pod_usage()).await {
            Ok(pods) => (pods, false),
            Err(_) => {
                tracing::warn!(timeout = ?POD_USAGE_TIMEOUT, "the provider did not measure its pods in time");
                (Vec::new(), true)
            }
        }
    }
}

/// `/stats/summary`, `/metrics/resource` and `/metrics` over `stats`.
pub fn routes(stats: Arc<Stats>) -> Router {
    Router::new()
        .route("/stats/summary", get(summary_route))
        .route("/metrics/resource", get(resource_route))
        .route("/metrics", get(metrics_route))
        .with_state(stats)
}

/// Only `/metrics`, for a plain-HTTP metrics listener (vk-cocoon's `VK_METRICS_ADDR`).
pub fn metrics_router(runtime: Arc<RuntimeMetrics>) -> Router {
    Router::new()
        .route("/metrics", get(|State(m): State<Arc<RuntimeMetrics>>| async move { render(&m) }))
        .with_state(runtime)
}

/// The connection cap of a plain-HTTP metrics listener: a few scrapers.
pub const METRICS_MAX_CONNECTIONS: usize = 64;

/// Binds a plain-HTTP metrics listener on `addr` (vk-cocoon's `VK_METRICS_ADDR`).
pub async fn bind_metrics(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serves [`metrics_router`] on `listener`, plain HTTP/1.1 without authentication (the text
/// holds counters only), through `httpd::serve`'s limits, until `shutdown`.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    runtime: Arc<RuntimeMetrics>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let limits = httpd::Limits { max_connections: METRICS_MAX_CONNECTIONS, ..httpd::Limits::default() };
    let opts = httpd::ServeOptions { name: "metrics", limits, protocol: httpd::Protocol::Http1, tls: None };
    httpd::serve(listener, metrics_router(runtime), opts, Arc::new(httpd::ConnStats::default()), shutdown).await;
}

async fn summary_route(State(stats): State<Arc<Stats>>) -> Response {
    let node = match stats.node_sample() {
        Ok(n) => n,
        Err(e) => {
            let msg = format!("cannot read the node's usage: {}\n", foundation::error_chain(&e));
            return (StatusCode::INTERNAL_SERVER_ERROR, msg).into_response();
        }
    };
    let (pods, _) = stats.pods().await;
    let summary = stats.rates.lock().unwrap_or_else(|p| p.into_inner()).summary(node, &pods);
    axum::Json(summary).into_response()
}

async fn resource_route(State(stats): State<Arc<Stats>>) -> Response {
    let node = stats.node_sample();
    if let Err(e) = &node {
        tracing::warn!(error = %foundation::error_chain(e), "cannot read the node's usage");
    }
    let (pods, late) = stats.pods().await;
    let text = resource::encode(node.as_ref().ok(), &pods, node.is_err() || late);
    ([(header::CONTENT_TYPE, resource::CONTENT_TYPE)], text).into_response()
}

async fn metrics_route(State(stats): State<Arc<Stats>>) -> Response {
    render(&stats.config.runtime)
}

fn render(m: &RuntimeMetrics) -> Response {
    match m.render() {
        Ok(text) => ([(header::CONTENT_TYPE, runtime::CONTENT_TYPE)], text).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics\n").into_response(),
    }
}

#[cfg(test)]
mod tests;

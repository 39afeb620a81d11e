//! The kubelet port's streaming routes (issue #15): what `kubectl logs`, `exec`, `attach` and
//! `port-forward` reach once the API server proxies them to this node unchanged (the Node
//! declares `ExtendWebSocketsToKubelet`, [`crate::node::DECLARED_FEATURES`]).
//!
//! The provider supplies two things through [`PodStreams`]: a fresh byte stream to a Pod's guest
//! agent and the Pod's console log. Everything else is here, over `kstream`'s protocols:
//!
//! - `logs`: `GET /containerLogs/{ns}/{pod}/{container}`, the log streamed as `text/plain`;
//! - `exec`: `/exec/…` and `/attach/…`, WebSocket with the `v5`/`v4.channel.k8s.io` channel
//!   protocol, a silkd session behind exec and the live console behind attach (output only);
//! - `portforward`: `/portForward/{ns}/{pod}`, SPDY/3.1 tunnelled in WebSocket binary
//!   messages, each requested port dialled through silkd;
//! - `checks`: what is refused before the provider is asked (a Pod not here, a container not
//!   in its spec, a Pod not Running) and every refusal's status;
//! - `upgrade`: the WebSocket handshake (subprotocol choice, message caps) and `sessions`, the
//!   per-Pod and per-node caps on open streams.
//!
//! Nothing here outlives its connection: a session's tasks end when either side goes.

mod checks;
mod exec;
mod logs;
mod portforward;
mod sessions;
mod upgrade;

use crate::provider::{PodKey, Provider};
use axum::routing::get;
use axum::Router;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

pub use kstream::logs::ValidLogQuery;
pub use sessions::StreamLimits;

/// A byte stream in both directions (what [`PodStreams::dial_agent`] returns).
pub trait Duplex: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Duplex for T {}

/// A connection to a Pod's guest agent (silkd).
pub type AgentIo = Box<dyn Duplex>;

/// A container log as it streams: chunks of text, an IO error ends it.
pub type LogBody = futures::stream::BoxStream<'static, Result<bytes::Bytes, std::io::Error>>;

/// Why a Pod's streams cannot be served. Each message names the fix; the kubelet port answers
/// `NoPod`/`NoContainer` with 404, `NotRunning` with 400 and `Unavailable` with 502.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("pod {0} is not on this node (check its spec.nodeName)")]
    NoPod(PodKey),
    #[error("pod {pod} has no container {container:?} (pick one of its spec.containers)")]
    NoContainer { pod: PodKey, container: String },
    #[error("pod {pod} is {phase}, not Running: wait until it runs")]
    NotRunning { pod: PodKey, phase: String },
    #[error("{0}")]
    Unavailable(String),
}

/// What a provider serves a Pod's streams with.
#[async_trait::async_trait]
pub trait PodStreams: Send + Sync + 'static {
    /// A fresh byte stream to the guest agent (silkd) of the Pod's VM.
    async fn dial_agent(&self, pod: &PodKey) -> Result<AgentIo, StreamError>;
    /// The Pod's container log (the VM's serial console, timestamped per line by the host),
    /// `query` applied; with `follow` it ends when the VM goes away.
    async fn container_logs(&self, pod: &PodKey, query: &ValidLogQuery) -> Result<LogBody, StreamError>;
}

/// A provider's streams with the Pods the API server has bound to the node (the runtime's
/// informer cache), so that a Pod the provider does not track (its VM could not be made) is
/// answered "not Running", with its status, rather than "not on this node".
#[derive(Clone)]
pub struct Bound {
    streams: Arc<dyn PodStreams>,
    bound: Option<Store<Pod>>,
}

impl Bound {
    /// `streams`, with `bound` the informer's cache of the node's Pods.
    pub fn new(streams: Arc<dyn PodStreams>, bound: Store<Pod>) -> Bound {
        Bound { streams, bound: Some(bound) }
    }

    /// `streams` alone: only the provider's Pods are known.
    pub fn unwatched(streams: Arc<dyn PodStreams>) -> Bound {
        Bound { streams, bound: None }
    }
}

/// What every streaming route holds: the Pods, their streams, the caps and the open sessions.
#[derive(Clone)]
struct Streaming {
    provider: Arc<dyn Provider>,
    bound: Option<Store<Pod>>,
    streams: Arc<dyn PodStreams>,
    sessions: Arc<sessions::Sessions>,
}

/// The streaming routes over `provider` (which Pods are here) and `streams` (their agent and
/// log, and the Pods bound here), within `limits`; `open` counts the open sessions. The caller
/// puts them behind authentication.
pub fn routes(
    provider: Arc<dyn Provider>,
    streams: Bound,
    limits: StreamLimits,
    open: prometheus_client::metrics::gauge::Gauge,
) -> Router {
    let Bound { streams, bound } = streams;
    let state = Streaming { provider, bound, streams, sessions: Arc::new(sessions::Sessions::new(limits, open)) };
    Router::new()
        .route("/containerLogs/{ns}/{pod}/{container}", get(logs::container_logs))
        .route(
            "/exec/{ns}/{pod}/{container}",
            get(exec::channel_route::<{ exec::EXEC }>).post(exec::channel_route::<{ exec::EXEC }>),
        )
        .route(
            "/attach/{ns}/{pod}/{container}",
            get(exec::channel_route::<{ exec::ATTACH }>).post(exec::channel_route::<{ exec::ATTACH }>),
        )
        .route("/portForward/{ns}/{pod}", get(portforward::port_forward).post(portforward::port_forward))
        .with_state(state)
}

#[cfg(test)]
pub(crate) mod tests;

//! The streaming routes against fakes: a provider with a table of Pods, streams whose agent is
//! an in-memory duplex and whose logs are scripted, served by `httpd` on a loopback port.

mod logs;
mod ws;

use super::{routes, AgentIo, LogBody, PodStreams, StreamError, StreamLimits, ValidLogQuery};
use crate::provider::{PodKey, PodNotifier, Provider, ProviderError};
use bytes::Bytes;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Pods by key.
#[derive(Default)]
pub(crate) struct FakeProvider(Mutex<Vec<Pod>>);

impl FakeProvider {
    pub(crate) fn with(self, ns: &str, name: &str, phase: &str) -> Self {
        let mut p = Pod::default();
        p.metadata.namespace = Some(ns.into());
        p.metadata.name = Some(name.into());
        p.spec = Some(PodSpec {
            containers: vec![Container { name: "main".into(), ..Default::default() }],
            ..Default::default()
        });
        p.status = Some(PodStatus { phase: Some(phase.into()), ..Default::default() });
        self.0.lock().expect("lock").push(p);
        self
    }
}

#[async_trait::async_trait]
impl Provider for FakeProvider {
    async fn create_pod(&self, _: &Pod) -> Result<(), ProviderError> {
        Ok(())
    }
    async fn update_pod(&self, _: &Pod) -> Result<(), ProviderError> {
        Ok(())
    }
    async fn delete_pod(&self, _: &Pod) -> Result<(), ProviderError> {
        Ok(())
    }
    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.0.lock().expect("lock").iter().find(|p| PodKey::of(p) == *key).cloned()
    }
    fn get_pods(&self) -> Vec<Pod> {
        self.0.lock().expect("lock").clone()
    }
    fn notify_pods(&self, _: PodNotifier) {}
}

/// What the fake streams serve: each log request gets the next scripted body (chunks, then
/// either the end or, with `hold`, a stream that stays open until the test drops its sender).
#[derive(Default)]
pub(crate) struct FakeStreams {
    pub(super) logs: Mutex<Vec<Vec<&'static str>>>,
    pub(super) held: Mutex<Vec<mpsc::Sender<Bytes>>>,
    pub(super) queries: Mutex<Vec<ValidLogQuery>>,
    /// `None`: dialling the agent fails.
    pub(super) agent: Mutex<Option<mpsc::UnboundedSender<tokio::io::DuplexStream>>>,
}

#[async_trait::async_trait]
impl PodStreams for FakeStreams {
    async fn dial_agent(&self, pod: &PodKey) -> Result<AgentIo, StreamError> {
        let agent = self.agent.lock().expect("lock").clone();
        let Some(agent) = agent else {
            return Err(StreamError::Unavailable(format!("the VM of {pod} does not answer")));
        };
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        agent.send(theirs).map_err(|_| StreamError::Unavailable("the fake agent is gone".into()))?;
        Ok(Box::new(ours))
    }

    async fn container_logs(&self, _: &PodKey, query: &ValidLogQuery) -> Result<LogBody, StreamError> {
        self.queries.lock().expect("lock").push(query.clone());
        let chunks = self.logs.lock().expect("lock").pop();
        let first =
            futures::stream::iter(chunks.unwrap_or_default().into_iter().map(|c| Ok(Bytes::from_static(c.as_bytes()))));
        if !query.follow {
            return Ok(first.boxed());
        }
        let (tx, rx) = mpsc::channel(4);
        self.held.lock().expect("lock").push(tx);
        Ok(first.chain(tokio_stream_of(rx)).boxed())
    }
}

fn tokio_stream_of(mut rx: mpsc::Receiver<Bytes>) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|b| b.map(Ok)))
}

/// The routes served over plain HTTP/1.1 on a loopback port.
pub(super) struct Server {
    pub(super) addr: SocketAddr,
    pub(super) streams: Arc<FakeStreams>,
    cancel: CancellationToken,
}

impl Server {
    pub(super) async fn start(provider: FakeProvider, streams: FakeStreams, limits: StreamLimits) -> Server {
        Server::start_bound(provider, streams, limits, None).await
    }

    /// With `bound` as the informer's cache of the Pods bound to the node.
    pub(super) async fn start_bound(
        provider: FakeProvider,
        streams: FakeStreams,
        limits: StreamLimits,
        bound: Option<kube::runtime::reflector::Store<Pod>>,
    ) -> Server {
        let streams = Arc::new(streams);
        let dyn_streams: Arc<dyn PodStreams> = streams.clone();
        let bound = match bound {
            Some(b) => super::Bound::new(dyn_streams, b),
            None => super::Bound::unwatched(dyn_streams),
        };
        let router = routes(Arc::new(provider), bound, limits, Default::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cancel = CancellationToken::new();
        let opts = httpd::ServeOptions {
            name: "kubelet-test",
            limits: httpd::Limits::default(),
            protocol: httpd::Protocol::Http1,
            tls: None,
        };
        tokio::spawn(httpd::serve(
            listener,
            router,
            opts,
            Arc::new(httpd::ConnStats::default()),
            cancel.clone().cancelled_owned(),
        ));
        Server { addr, streams, cancel }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A plain request: status, headers and the whole body.
pub(super) async fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, http::HeaderMap, String) {
    use http_body_util::BodyExt as _;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await.expect("handshake");
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "kubelet")
        .body(http_body_util::Empty::<Bytes>::new())
        .expect("request");
    let resp = send.send_request(req).await.expect("response");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status.as_u16(), parts.headers, String::from_utf8_lossy(&body).into_owned())
}

/// The default fakes: `ns/vm` Running, `ns/booting` Pending.
pub(super) fn pods() -> FakeProvider {
    FakeProvider::default().with("ns", "vm", "Running").with("ns", "booting", "Pending")
}

//! A typed, time-bounded client for one cloud-hypervisor process's REST API socket.
//!
//! Thin wrapper over [`cloud_hypervisor_client`] (generated from cloud-hypervisor's OpenAPI
//! document, API version 0.3.0): every call names its endpoint, is bounded by a timeout, and a
//! non-2xx answer becomes [`ApiError::Status`] carrying the HTTP status and the raw body.
//! cloud-hypervisor answers errors with a JSON array of messages, outermost first
//! (`["Error from API","The VM could not boot", …]`); [`ApiError::messages`] decodes it.
//!
//! Connections go through [`PeerConnector`]: with a [`PeerCheck`] every connection is made by
//! [`crate::peer::connect`] (no symbolic link followed, the peer's credentials checked), and a
//! socket not served by the VM's cloud-hypervisor fails the call with [`ApiError::Peer`].

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use cloud_hypervisor_client::apis::configuration::Configuration;
use cloud_hypervisor_client::apis::{DefaultApi, DefaultApiClient, Error as ClientError};
use cloud_hypervisor_client::models::{RestoreConfig, VmConfig, VmInfo, VmSnapshotConfig, VmmPingResponse};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::peer::{ConnectError, PeerCheck, PeerError};

/// Errors of one REST call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// cloud-hypervisor answered with a non-success status.
    #[error("{endpoint} answered HTTP {status}: {body}")]
    Status {
        /// The endpoint, e.g. `PUT /vm.boot`.
        endpoint: &'static str,
        /// The HTTP status code.
        status: u16,
        /// The response body as sent (cloud-hypervisor: a JSON array of messages).
        body: String,
    },
    /// The request could not be sent or the answer not read or decoded.
    #[error("{endpoint} failed")]
    Transport {
        /// The endpoint.
        endpoint: &'static str,
        /// The cause (socket missing, connection reset, bad JSON, …).
        #[source]
        source: ClientError,
    },
    /// The API socket is not served by the VM's cloud-hypervisor (a link, or another
    /// process's socket put in its place): nothing was sent.
    #[error("{endpoint} refused: the API socket is not the VM's cloud-hypervisor's")]
    Peer {
        /// The endpoint.
        endpoint: &'static str,
        /// The socket, who should and who did answer.
        #[source]
        source: PeerError,
    },
    /// No answer within the deadline.
    #[error("{endpoint} did not answer within {after:?}")]
    Timeout {
        /// The endpoint.
        endpoint: &'static str,
        /// The deadline.
        after: Duration,
    },
}

impl ApiError {
    /// The endpoint the failed call went to.
    pub fn endpoint(&self) -> &'static str {
        match self {
            ApiError::Status { endpoint, .. }
            | ApiError::Transport { endpoint, .. }
            | ApiError::Peer { endpoint, .. }
            | ApiError::Timeout { endpoint, .. } => endpoint,
        }
    }

    /// The HTTP status, if cloud-hypervisor answered at all.
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// cloud-hypervisor's error messages (outermost first) when the body is its JSON array of
    /// strings; otherwise the raw body as the one message. Empty for non-HTTP failures.
    pub fn messages(&self) -> Vec<String> {
        match self {
            ApiError::Status { body, .. } => match serde_json::from_str::<Vec<String>>(body) {
                Ok(msgs) => msgs,
                Err(_) if body.is_empty() => Vec::new(),
                Err(_) => vec![body.clone()],
            },
            _ => Vec::new(),
        }
    }
}

/// The `PUT`/`GET` endpoints this driver uses, as named in errors and logs.
pub mod endpoint {
    /// `GET /vmm.ping`
    pub const PING: &str = "GET /vmm.ping";
    /// `PUT /vm.create`
    pub const CREATE: &str = "PUT /vm.create";
    /// `PUT /vm.boot`
    pub const BOOT: &str = "PUT /vm.boot";
    /// `PUT /vm.pause`
    pub const PAUSE: &str = "PUT /vm.pause";
    /// `PUT /vm.resume`
    pub const RESUME: &str = "PUT /vm.resume";
    /// `PUT /vm.snapshot`
    pub const SNAPSHOT: &str = "PUT /vm.snapshot";
    /// `PUT /vm.restore`
    pub const RESTORE: &str = "PUT /vm.restore";
    /// `GET /vm.info`
    pub const INFO: &str = "GET /vm.info";
    /// `PUT /vm.shutdown`
    pub const SHUTDOWN_VM: &str = "PUT /vm.shutdown";
    /// `PUT /vmm.shutdown`
    pub const SHUTDOWN_VMM: &str = "PUT /vmm.shutdown";
}

/// The hyper connector of an [`ApiClient`]: connects to its one socket with
/// [`crate::peer::connect`] (whatever the request URI says), checking the peer if it has a
/// [`PeerCheck`].
#[derive(Debug, Clone)]
pub struct PeerConnector {
    socket: Arc<PathBuf>,
    check: Option<Arc<PeerCheck>>,
}

impl tower_service::Service<hyper::Uri> for PeerConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let (socket, check) = (self.socket.clone(), self.check.clone());
        Box::pin(async move { crate::peer::connect(&socket, check.as_deref()).await.map(TokioIo::new) })
    }
}

/// A client for one API socket. Cheap to create; connections are made per call (hyper pool).
pub struct ApiClient {
    socket: PathBuf,
    inner: DefaultApiClient<PeerConnector>,
    timeout: Duration,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient").field("socket", &self.socket).field("timeout", &self.timeout).finish()
    }
}

impl ApiClient {
    /// A client for the API socket at `socket`; each call fails after `timeout`. With `check`,
    /// each connection refuses a symbolic link at `socket` and a peer other than
    /// `check.expected` ([`ApiError::Peer`]); the driver always passes one.
    pub fn new(socket: &Path, timeout: Duration, check: Option<PeerCheck>) -> Self {
        let connector = PeerConnector { socket: Arc::new(socket.to_path_buf()), check: check.map(Arc::new) };
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
        // The connector ignores the URI's authority; the path prefix is the API's.
        let config = Configuration { base_path: "http://localhost/api/v1".into(), user_agent: None, client };
        ApiClient { socket: socket.to_path_buf(), inner: DefaultApiClient::new(Arc::new(config)), timeout }
    }

    /// The API socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn call<T>(
        &self,
        endpoint: &'static str,
        fut: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ApiError> {
        tracing::trace!(endpoint, socket = %self.socket.display(), "cloud-hypervisor api call");
        match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => Err(ApiError::Timeout { endpoint, after: self.timeout }),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(ClientError::Api(e))) => Err(ApiError::Status { endpoint, status: e.code.as_u16(), body: e.body }),
            Ok(Err(ClientError::HyperClient(e))) => match crate::peer::find_in(&e) {
                Some(source) => Err(ApiError::Peer { endpoint, source }),
                None => Err(ApiError::Transport { endpoint, source: ClientError::HyperClient(e) }),
            },
            Ok(Err(source)) => Err(ApiError::Transport { endpoint, source }),
        }
    }

    /// `GET /vmm.ping`: the VMM's version (and pid, on recent versions).
    pub async fn ping(&self) -> Result<VmmPingResponse, ApiError> {
        self.call(endpoint::PING, self.inner.vmm_ping_get()).await
    }

    /// `PUT /vm.create` with the full VM configuration.
    pub async fn create(&self, config: VmConfig) -> Result<(), ApiError> {
        self.call(endpoint::CREATE, self.inner.create_vm(config)).await
    }

    /// `PUT /vm.boot`.
    pub async fn boot(&self) -> Result<(), ApiError> {
        self.call(endpoint::BOOT, self.inner.boot_vm()).await
    }

    /// `PUT /vm.pause`.
    pub async fn pause(&self) -> Result<(), ApiError> {
        self.call(endpoint::PAUSE, self.inner.pause_vm()).await
    }

    /// `PUT /vm.resume`.
    pub async fn resume(&self) -> Result<(), ApiError> {
        self.call(endpoint::RESUME, self.inner.resume_vm()).await
    }

    /// `PUT /vm.snapshot {destination_url: "file://<dir>"}` (the VM must be paused).
    pub async fn snapshot(&self, dir: &Path) -> Result<(), ApiError> {
        let cfg = VmSnapshotConfig { destination_url: Some(file_url(dir)) };
        self.call(endpoint::SNAPSHOT, self.inner.vm_snapshot_put(cfg)).await
    }

    /// `PUT /vm.restore {source_url: "file://<dir>"}`; the restored VM stays paused.
    pub async fn restore(&self, dir: &Path) -> Result<(), ApiError> {
        let cfg = RestoreConfig::new(file_url(dir));
        self.call(endpoint::RESTORE, self.inner.vm_restore_put(cfg)).await
    }

    /// `GET /vm.info`.
    pub async fn info(&self) -> Result<VmInfo, ApiError> {
        self.call(endpoint::INFO, self.inner.vm_info_get()).await
    }

    /// `PUT /vm.shutdown`: stops the VM (the VMM process keeps running).
    pub async fn shutdown_vm(&self) -> Result<(), ApiError> {
        self.call(endpoint::SHUTDOWN_VM, self.inner.shutdown_vm()).await
    }

    /// `PUT /vmm.shutdown`: the VMM process exits.
    pub async fn shutdown_vmm(&self) -> Result<(), ApiError> {
        self.call(endpoint::SHUTDOWN_VMM, self.inner.shutdown_vmm()).await
    }
}

/// `file://` URL of an absolute directory, as cloud-hypervisor's snapshot/restore expect.
pub fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

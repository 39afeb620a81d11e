//! A typed client of the supervisor API (what the `chrysalis` verbs call): Unix socket by
//! default, or `https://host:port` (`http://` on loopback) with a bearer token.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper::{Method, StatusCode};
use serde::de::DeserializeOwned;

use crate::http::{self, Endpoint, HttpError};
use crate::logs::LogLine;
use crate::state::Status;
use crate::update::{UpdateOutcome, UpdateState, UpdateStatus};

/// Ordinary requests.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// Applying a bundle (write + verify a root image).
pub const APPLY_TIMEOUT: Duration = Duration::from_secs(3600);

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No answer (the supervisor is not running, or not at that address).
    #[error("cannot reach the supervisor API")]
    Http(#[from] HttpError),
    /// The API answered with an error.
    #[error("{message}")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// The error `kind`.
        kind: String,
        /// The error text.
        message: String,
    },
    /// The answer is not what this client expects (a version mismatch).
    #[error("unexpected answer to {what}")]
    Decode {
        /// The request.
        what: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A local file could not be read.
    #[error("reading {}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The client.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
    tls: Option<http::TlsClient>,
}

/// A sandboxd token as the API hands it out (`GET /v1/tokens/{name}`).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenView {
    /// Which token (`sandboxd`).
    pub name: String,
    /// The token.
    pub token: String,
    /// The file it is kept in on the box.
    pub file: String,
}

impl std::fmt::Debug for TokenView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenView")
            .field("name", &self.name)
            .field("token", &"<redacted>")
            .field("file", &self.file)
            .finish()
    }
}

impl Client {
    /// A client of `endpoint` (the token is only sent over the network).
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Self {
        Client { endpoint, token, tls: None }
    }

    /// The same client verifying an `https://` endpoint with `tls`.
    pub fn with_tls(mut self, tls: http::TlsClient) -> Self {
        self.tls = Some(tls);
        self
    }

    /// A client with the token read from `token_file`.
    pub fn with_token_file(endpoint: Endpoint, token_file: Option<&Path>) -> Result<Self, ClientError> {
        let token = match token_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|source| ClientError::Read { path: p.to_path_buf(), source })?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        Ok(Client::new(endpoint, token))
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    async fn raw(
        &self,
        method: Method,
        path: &str,
        body: http::Body,
        timeout: Duration,
    ) -> Result<bytes::Bytes, ClientError> {
        let token = if self.endpoint.is_network() { self.token.as_deref() } else { None };
        let r = http::send(&self.endpoint, self.tls.as_ref(), method, path, token, body, timeout).await?;
        if r.status.is_success() {
            return Ok(r.body);
        }
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        Err(ClientError::Api {
            status: r.status,
            kind: v["kind"].as_str().unwrap_or("http").to_string(),
            message: v["error"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("{} answered {}", self.endpoint, r.status)),
        })
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: http::Body,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let b = self.raw(method.clone(), path, body, timeout).await?;
        serde_json::from_slice(&b).map_err(|source| ClientError::Decode { what: format!("{method} {path}"), source })
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<Status, ClientError> {
        self.json(Method::GET, "/v1/status", http::empty(), TIMEOUT).await
    }

    /// `GET /v1/logs/{service}?tail=N`.
    pub async fn logs(&self, service: &str, tail: usize) -> Result<Vec<LogLine>, ClientError> {
        #[derive(serde::Deserialize)]
        struct Logs {
            lines: Vec<LogLine>,
        }
        let l: Logs =
            self.json(Method::GET, &format!("/v1/logs/{service}?tail={tail}"), http::empty(), TIMEOUT).await?;
        Ok(l.lines)
    }

    /// `GET /v1/update`.
    pub async fn update_status(&self) -> Result<UpdateStatus, ClientError> {
        self.json(Method::GET, "/v1/update", http::empty(), TIMEOUT).await
    }

    /// `POST /v1/update/apply` with the bundle file streamed. Asks `GET /v1/update` first so a
    /// box without updates answers before gigabytes are sent.
    pub async fn update_apply(&self, bundle: &Path) -> Result<UpdateOutcome, ClientError> {
        let st = self.update_status().await?;
        if st.state == UpdateState::Unavailable {
            return Err(ClientError::Api {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "updates_unavailable".into(),
                message: st.message.unwrap_or_else(|| crate::update::UNAVAILABLE.into()),
            });
        }
        let f = tokio::fs::File::open(bundle)
            .await
            .map_err(|source| ClientError::Read { path: bundle.to_path_buf(), source })?;
        self.json(Method::POST, "/v1/update/apply", http::file(f), APPLY_TIMEOUT).await
    }

    /// `POST /v1/update/rollback`.
    pub async fn update_rollback(&self) -> Result<UpdateOutcome, ClientError> {
        self.json(Method::POST, "/v1/update/rollback", http::empty(), TIMEOUT).await
    }

    /// `POST /v1/reboot`.
    pub async fn reboot(&self) -> Result<(), ClientError> {
        self.raw(Method::POST, "/v1/reboot", http::empty(), TIMEOUT).await.map(|_| ())
    }

    /// `GET /v1/config`.
    pub async fn config(&self) -> Result<serde_json::Value, ClientError> {
        self.json(Method::GET, "/v1/config", http::empty(), TIMEOUT).await
    }

    /// `GET /v1/tokens/{name}`: a token the box keeps (e.g. sandboxd's root token).
    pub async fn token(&self, name: &str) -> Result<TokenView, ClientError> {
        self.json(Method::GET, &format!("/v1/tokens/{name}"), http::empty(), TIMEOUT).await
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let b = self.raw(Method::GET, "/metrics", http::empty(), TIMEOUT).await?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

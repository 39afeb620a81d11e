//! The sandboxd HTTP client (`docs/virtual-node.md` §2.3, shapes in
//! `docs/sandboxd.md` §5.1): claim, release, list, info, and the console as a container log
//! (§7.1, streamed: only the answer's head is bounded by the per-call time), and the peer report
//! (`PUT /v1/peers`, the other boxes of the fleet, [`crate::inventory`]). Bodies are [`sandboxd_api`]
//! types, the ones sandboxd itself serves. One pooled HTTP/1.1 client
//! (64 idle connections per host, 90 s idle), every call bounded by 10 s including its body.
//!
//! `https://` URLs are verified against a trust file (`--sandboxd-ca-file`: sandboxd's own
//! certificate, which then need not name the address dialled, or a CA; see
//! [`httpd::tls::Trust::File`]); there is no unverified HTTPS. On the appliance the supervisor
//! passes the box certificate sandboxd serves.
//!
//! Node routes carry the node token (`--sandboxd-token-file`) when one is configured; release
//! carries the claim's own token. A claim always carries `no_redirect: true`: its Pod is bound
//! to this node, so sandboxd serves it here or refuses it, never redirects it to a peer. No capacity (`429`, or `200` with an empty `id` and a
//! `redirect`) is the typed [`SandboxdError::NoCapacity`]; other failures carry sandboxd's
//! `{"error": …}` text.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, TryStreamExt as _};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::jiff::Timestamp;
use kstream::logs::LogQuery;
use sandboxd_api::{ClaimReply, ClaimRequest, ErrorBody, PeerReport, Peers, SandboxList};

/// A granted claim (its token is the release credential: `Debug` leaves it out), the info
/// answer and a listing row, as sandboxd sends them.
pub use sandboxd_api::{Grant, Info, SandboxRow, Stats};

use crate::annotations::ClaimSpec;

/// Per-call bound (request, response head and body).
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest listing read (`GET /v1/sandboxes`).
pub const LIST_LIMIT: usize = 16 << 20;
/// Largest body read from any other route.
const BODY_LIMIT: usize = 1 << 20;

/// Why a sandboxd call failed.
#[derive(Debug, thiserror::Error)]
pub enum SandboxdError {
    /// The configured URL is unusable.
    #[error("sandboxd URL {url:?}: {reason}")]
    Url { url: String, reason: &'static str },
    /// The trust file for an `https://` URL is unusable.
    #[error("sandboxd CA file")]
    Trust(#[source] httpd::tls::TlsError),
    /// Connecting or sending failed.
    #[error("sandboxd {what}: request failed")]
    Transport {
        what: &'static str,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// No complete answer in time.
    #[error("sandboxd {what}: no answer within {timeout:?}")]
    Timeout { what: &'static str, timeout: Duration },
    /// sandboxd answered `101` but the connection could not be taken over.
    #[error("sandboxd {what}: the upgraded connection failed: {reason}")]
    Upgrade { what: &'static str, reason: String },
    /// The body could not be read.
    #[error("sandboxd {what}: reading the response body failed")]
    Body {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The body exceeded its cap.
    #[error("sandboxd {what}: response larger than {limit} bytes")]
    TooLarge { what: &'static str, limit: usize },
    /// The pool has no warm capacity (`429`, or a redirect to peers).
    #[error(
        "sandboxd has no warm capacity for template {template:?} (net {net:?}, size {size:?}): {detail}; \
         the pod stays Pending until the pool refills"
    )]
    NoCapacity { template: String, net: String, size: String, detail: String },
    /// Any other refusal, with sandboxd's own message.
    #[error("sandboxd {what}: HTTP {status}: {message}")]
    Status { what: &'static str, status: u16, message: String },
    /// The task running the call ended without an answer.
    #[error("sandboxd {what}: the call was aborted")]
    Aborted { what: &'static str },
    /// A success body that does not decode.
    #[error("sandboxd {what}: malformed response")]
    Decode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A query that does not encode.
    #[error("sandboxd {what}: the query does not encode")]
    Query {
        what: &'static str,
        #[source]
        source: serde_urlencoded::ser::Error,
    },
}

/// A lease end in sandboxd's answers, parsed (`None` when sandboxd's value does not parse).
pub trait Deadline {
    /// The lease end.
    fn deadline_time(&self) -> Option<Timestamp>;
}

impl Deadline for Grant {
    fn deadline_time(&self) -> Option<Timestamp> {
        self.deadline.parse().ok()
    }
}

impl Deadline for SandboxRow {
    fn deadline_time(&self) -> Option<Timestamp> {
        self.deadline.parse().ok()
    }
}

/// A listed sandbox's first grant, parsed.
pub fn claimed_at(row: &SandboxRow) -> Option<Timestamp> {
    row.claimed_at.parse().ok()
}

/// The client of the node's sandboxd.
#[derive(Clone)]
pub struct SandboxdClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    base: String,
    host_port: String,
    node_token: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for SandboxdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxdClient").field("base", &self.base).finish_non_exhaustive()
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters and `/` pass).
fn query_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// sandboxd's `{"error": …}` text, else the body itself (trimmed, ≤ 300 chars).
fn error_text(body: &[u8]) -> String {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.error,
        Err(_) => String::from_utf8_lossy(body).trim().chars().take(300).collect(),
    }
}

impl SandboxdClient {
    /// A client of `url` (`http://host:port`), sending `node_token` on node routes.
    pub fn new(url: &str, node_token: Option<String>) -> Result<SandboxdClient, SandboxdError> {
        Self::with_ca(url, node_token, None)
    }

    /// A client of `url`, `http://host:port` or `https://host:port` (then verified against
    /// `ca_file`, required), sending `node_token` on node routes.
    pub fn with_ca(
        url: &str,
        node_token: Option<String>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<SandboxdClient, SandboxdError> {
        let bad = |reason| SandboxdError::Url { url: url.to_owned(), reason };
        let uri: hyper::Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let (scheme, default_port) = match uri.scheme_str() {
            Some("http") => ("http", 80),
            Some("https") => ("https", 443),
            _ => return Err(bad("the scheme must be http:// or https://")),
        };
        let tls = match (scheme, ca_file) {
            ("https", None) => {
                return Err(bad("https needs --sandboxd-ca-file (sandboxd's certificate, or the CA that issued it)"))
            }
            // No ALPN here: the connector offers http/1.1 itself (enable_http1).
            ("https", Some(f)) => {
                httpd::tls::client_config(&httpd::tls::Trust::File(f.to_owned()), &[]).map_err(SandboxdError::Trust)?
            }
            // Plain HTTP: the TLS side is never used; it trusts nothing.
            _ => std::sync::Arc::new(
                rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|_| bad("no TLS protocol versions"))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
            ),
        };
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let host_port = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:{default_port}", authority.host()),
        };
        let path = uri.path().trim_end_matches('/');
        let base = format!("{scheme}://{}{}", authority.as_str(), path);
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(TIMEOUT));
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(64)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(SandboxdClient { http, base, host_port, node_token: node_token.filter(|t| !t.is_empty()), timeout: TIMEOUT })
    }

    /// The same client with another per-call bound (tests).
    pub fn with_timeout(mut self, timeout: Duration) -> SandboxdClient {
        self.timeout = timeout;
        self
    }

    /// `host:port` of the configured URL (the default advertise address).
    pub fn host_port(&self) -> &str {
        &self.host_port
    }

    fn request(
        &self,
        method: Method,
        path_and_query: &str,
        bearer: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Result<Request<Full<Bytes>>, SandboxdError> {
        let uri = format!("{}{}", self.base, path_and_query);
        let mut req = Request::builder().method(method).uri(&uri);
        if let Some(t) = bearer {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        req.body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|_| SandboxdError::Url { url: uri, reason: "cannot build a request for it" })
    }

    /// A whole body, under `limit` bytes.
    async fn collect(what: &'static str, body: Incoming, limit: usize) -> Result<Bytes, SandboxdError> {
        let bytes = Limited::new(body, limit).collect().await.map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                SandboxdError::TooLarge { what, limit }
            } else {
                SandboxdError::Body { what, source: e }
            }
        })?;
        Ok(bytes.to_bytes())
    }

    async fn send(
        &self,
        what: &'static str,
        method: Method,
        path_and_query: &str,
        bearer: Option<&str>,
        body: Option<Vec<u8>>,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), SandboxdError> {
        let req = self.request(method, path_and_query, bearer, body)?;
        let call = async {
            let resp = self.http.request(req).await.map_err(|source| SandboxdError::Transport { what, source })?;
            let status = resp.status();
            Ok((status, Self::collect(what, resp.into_body(), limit).await?))
        };
        let timeout = self.timeout;
        tokio::time::timeout(timeout, call).await.map_err(|_| SandboxdError::Timeout { what, timeout })?
    }

    /// `POST /v1/claim` with `claim_ref` (the pod key).
    #[tracing::instrument(skip_all, fields(template = %spec.template, claim_ref))]
    pub async fn claim(&self, spec: &ClaimSpec, claim_ref: &str) -> Result<Grant, SandboxdError> {
        const WHAT: &str = "claim";
        let non_empty = |s: &str| Some(s.to_owned()).filter(|s| !s.is_empty());
        let body = ClaimRequest {
            net: non_empty(&spec.net),
            size: non_empty(&spec.size),
            ttl_seconds: Some(i64::try_from(spec.ttl_seconds).unwrap_or(i64::MAX)),
            claim_ref: Some(claim_ref.to_owned()),
            // The Pod is bound to this node: a redirect to a peer must never bounce it.
            no_redirect: Some(true),
            ..ClaimRequest::new(spec.template.as_str())
        };
        let body = serde_json::to_vec(&body).map_err(|source| SandboxdError::Decode { what: WHAT, source })?;
        let (status, bytes) =
            self.send(WHAT, Method::POST, "/v1/claim", self.node_token.as_deref(), Some(body), BODY_LIMIT).await?;
        let no_capacity = |detail: String| SandboxdError::NoCapacity {
            template: spec.template.clone(),
            net: spec.net.clone(),
            size: spec.size.clone(),
            detail,
        };
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(no_capacity(error_text(&bytes)));
        }
        if !status.is_success() {
            return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
        }
        let ClaimReply { grant: reply, redirect } =
            serde_json::from_slice(&bytes).map_err(|source| SandboxdError::Decode { what: WHAT, source })?;
        if reply.id.is_empty() {
            if redirect.is_empty() {
                return Err(SandboxdError::Status {
                    what: WHAT,
                    status: status.as_u16(),
                    message: "a grant without an id and without a redirect".into(),
                });
            }
            return Err(no_capacity(format!("no warm VM here (sandboxd redirects to {})", redirect.join(", "))));
        }
        if reply.token.is_empty() {
            // A grant without its credential: the VM cannot be released by us; say so loudly.
            tracing::error!(claim = %reply.id, "sandboxd granted a claim without a token");
            return Err(SandboxdError::Status {
                what: WHAT,
                status: status.as_u16(),
                message: format!("claim {} was granted without a token", reply.id),
            });
        }
        Ok(reply)
    }

    /// `POST /v1/sandboxes/{id}/release` with the claim's token: `204` and `404` both mean the
    /// VM is gone.
    #[tracing::instrument(skip_all, fields(claim = %id))]
    pub async fn release(&self, id: &str, token: &str) -> Result<(), SandboxdError> {
        const WHAT: &str = "release";
        let path = format!("/v1/sandboxes/{}/release", query_escape(id).replace('/', "%2F"));
        let (status, bytes) = self.send(WHAT, Method::POST, &path, Some(token), None, BODY_LIMIT).await?;
        match status {
            s if s.is_success() || s == StatusCode::NOT_FOUND => Ok(()),
            s => Err(SandboxdError::Status { what: WHAT, status: s.as_u16(), message: error_text(&bytes) }),
        }
    }

    /// `GET /v1/sandboxes[?claim_ref=]`. A failure is an error, never an empty list.
    pub async fn list(&self, claim_ref: Option<&str>) -> Result<Vec<SandboxRow>, SandboxdError> {
        const WHAT: &str = "list";
        let path = match claim_ref {
            Some(r) if !r.is_empty() => format!("/v1/sandboxes?claim_ref={}", query_escape(r)),
            _ => "/v1/sandboxes".to_owned(),
        };
        let (status, bytes) = self.send(WHAT, Method::GET, &path, self.node_token.as_deref(), None, LIST_LIMIT).await?;
        if !status.is_success() {
            return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
        }
        let reply: SandboxList =
            serde_json::from_slice(&bytes).map_err(|source| SandboxdError::Decode { what: WHAT, source })?;
        Ok(reply.sandboxes)
    }

    /// `GET /v1/sandboxes/{id}` with the node token: the row and, when that token is sandboxd's
    /// root token, the claim's token. `None` when sandboxd does not know the id.
    pub async fn get(&self, id: &str) -> Result<Option<(SandboxRow, Option<String>)>, SandboxdError> {
        let path = format!("/v1/sandboxes/{}", query_escape(id).replace('/', "%2F"));
        let Some(mut row) = self.get_optional::<SandboxRow>("get", &path).await? else { return Ok(None) };
        let token = row.token.take().filter(|t| !t.is_empty());
        Ok(Some((row, token)))
    }

    /// `GET /v1/sandboxes/{id}/stats` with the node token (`cpu_usage_nanos` and
    /// `memory_working_set_bytes` are present when sandboxd measured the VM). `None` when
    /// sandboxd does not know the id.
    pub async fn stats(&self, id: &str) -> Result<Option<Stats>, SandboxdError> {
        let path = format!("/v1/sandboxes/{}/stats", query_escape(id).replace('/', "%2F"));
        self.get_optional("stats", &path).await
    }

    /// `GET path` with the node token, decoded; `None` on `404`.
    async fn get_optional<T: serde::de::DeserializeOwned>(
        &self,
        what: &'static str,
        path: &str,
    ) -> Result<Option<T>, SandboxdError> {
        let (status, bytes) = self.send(what, Method::GET, path, self.node_token.as_deref(), None, BODY_LIMIT).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(SandboxdError::Status { what, status: status.as_u16(), message: error_text(&bytes) });
        }
        serde_json::from_slice(&bytes).map(Some).map_err(|source| SandboxdError::Decode { what, source })
    }

    /// `GET /v1/sandboxes/{id}/console?<query>` with the node token (sandboxd's root token: a
    /// sandbox route): the sandbox's serial console as a container log, `query` applied by
    /// sandboxd. The answer's head (and an error's body) must come within the per-call bound;
    /// the body then streams for as long as sandboxd sends it (with `follow`, until the VM is
    /// destroyed). A refusal is [`SandboxdError::Status`] (`400` for a query sandboxd refuses,
    /// `404` for an unknown sandbox).
    pub async fn console(
        &self,
        id: &str,
        token: &str,
        query: &LogQuery,
    ) -> Result<impl Stream<Item = io::Result<Bytes>> + Send + 'static, SandboxdError> {
        const WHAT: &str = "console";
        let q = serde_urlencoded::to_string(query).map_err(|source| SandboxdError::Query { what: WHAT, source })?;
        let path = format!("/v1/sandboxes/{}/console?{q}", query_escape(id).replace('/', "%2F"));
        let req = self.request(Method::GET, &path, Some(token), None)?;
        let head = async {
            let resp =
                self.http.request(req).await.map_err(|source| SandboxdError::Transport { what: WHAT, source })?;
            let status = resp.status();
            if !status.is_success() {
                let bytes = Self::collect(WHAT, resp.into_body(), BODY_LIMIT).await?;
                return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
            }
            Ok(resp.into_body())
        };
        let timeout = self.timeout;
        let body =
            tokio::time::timeout(timeout, head).await.map_err(|_| SandboxdError::Timeout { what: WHAT, timeout })??;
        Ok(body.into_data_stream().map_err(io::Error::other))
    }

    /// `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd` and the claim's `token`: a raw
    /// byte stream to the sandbox's guest agent (`docs/sandboxd.md` §6). Only the `101` must
    /// arrive within the per-call bound; the stream then lives as long as its user keeps it.
    pub async fn agent(&self, id: &str, token: &str) -> Result<TokioIo<hyper::upgrade::Upgraded>, SandboxdError> {
        const WHAT: &str = "agent relay";
        let path = format!("/v1/sandboxes/{}/agent", query_escape(id).replace('/', "%2F"));
        let mut req = self.request(Method::GET, &path, Some(token), None)?;
        req.headers_mut().insert(hyper::header::UPGRADE, hyper::header::HeaderValue::from_static("silkd"));
        req.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("Upgrade"));
        let upgrade = async {
            let resp =
                self.http.request(req).await.map_err(|source| SandboxdError::Transport { what: WHAT, source })?;
            let status = resp.status();
            if status != hyper::StatusCode::SWITCHING_PROTOCOLS {
                let bytes = Self::collect(WHAT, resp.into_body(), BODY_LIMIT).await?;
                return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
            }
            hyper::upgrade::on(resp).await.map_err(|e| SandboxdError::Upgrade { what: WHAT, reason: e.to_string() })
        };
        let timeout = self.timeout;
        let upgraded = tokio::time::timeout(timeout, upgrade)
            .await
            .map_err(|_| SandboxdError::Timeout { what: WHAT, timeout })??;
        Ok(TokioIo::new(upgraded))
    }

    /// `PUT /v1/peers` with the node token (sandboxd's root token): the other boxes of the
    /// fleet. Returns the peer addresses sandboxd now holds.
    pub async fn put_peers(&self, report: &PeerReport) -> Result<Vec<String>, SandboxdError> {
        const WHAT: &str = "peer report";
        let body = serde_json::to_vec(report).map_err(|source| SandboxdError::Decode { what: WHAT, source })?;
        let (status, bytes) =
            self.send(WHAT, Method::PUT, "/v1/peers", self.node_token.as_deref(), Some(body), BODY_LIMIT).await?;
        if !status.is_success() {
            return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
        }
        let peers: Peers =
            serde_json::from_slice(&bytes).map_err(|source| SandboxdError::Decode { what: WHAT, source })?;
        Ok(peers.peers)
    }

    /// `GET /v1/info`.
    pub async fn info(&self) -> Result<Info, SandboxdError> {
        const WHAT: &str = "info";
        let (status, bytes) =
            self.send(WHAT, Method::GET, "/v1/info", self.node_token.as_deref(), None, BODY_LIMIT).await?;
        if !status.is_success() {
            return Err(SandboxdError::Status { what: WHAT, status: status.as_u16(), message: error_text(&bytes) });
        }
        serde_json::from_slice(&bytes).map_err(|source| SandboxdError::Decode { what: WHAT, source })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

//! The local API: HTTP on the Unix socket (`supervisor.api_socket`, mode 0600, no token: file
//! permissions are the access control) and, when `supervisor.api_listen` is set, the same
//! routes over TCP behind `Authorization: Bearer <api_token_file>` (constant-time compare),
//! served by [`httpd::serve`] ([`API_LIMITS`]; TLS beyond loopback, see `crate::secrets`).
//!
//! | route | answer |
//! |---|---|
//! | `GET /v1/status` | [`Status`]: supervisor, config errors, health (services, nodes, pools), update |
//! | `GET /v1/logs/{service}?tail=N` | `{"service","lines":[{ts_ms,stream,line}]}` (N ≤ 2000, default 200) |
//! | `GET /v1/update` | [`crate::update::UpdateStatus`] |
//! | `POST /v1/update/apply` | body = the bundle (streamed) → [`crate::update::UpdateOutcome`] |
//! | `POST /v1/update/rollback` | [`crate::update::UpdateOutcome`] |
//! | `POST /v1/reboot` | `202 {"rebooting":true}` |
//! | `GET /v1/config` | `{"config", "sources"}`: the effective configuration (secrets are only ever file paths) |
//! | `GET /v1/tokens/{name}` | `{"name","token","file"}`: a token the box keeps (`sandboxd`: its root token), `Cache-Control: no-store`; never part of `/v1/status` or `/v1/config` |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | `200 ok`; `503` when the main loop has not turned for 10 s |
//!
//! Errors are `{"error": "...", "kind": "..."}`; the status comes from one exhaustive match
//! ([`ApiError`]).
//!
//! Bodies: only `POST /v1/update/apply` reads one, streamed to the updater under
//! [`UploadLimits`]: a size cap ([`MAX_BUNDLE_BYTES`]) and an idle timeout between chunks
//! ([`UPLOAD_IDLE`]), not a total deadline (a bundle over a slow link takes minutes).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use subtle::ConstantTimeEq as _;
use tokio::sync::{mpsc, oneshot};

use crate::logs::RING_LINES;
use crate::state::Shared;
use crate::update::{UpdateControl, UpdateError};

/// The main loop stalled when it has not turned for this long.
pub const STALL: Duration = Duration::from_secs(10);
/// The remote API's limits: an admin API needs few connections.
pub const API_LIMITS: httpd::Limits = httpd::Limits {
    max_connections: 64,
    header_timeout: Duration::from_secs(10),
    handshake_timeout: Duration::from_secs(10),
};
/// `metrics_listen`'s limits: a scraper or two.
pub const METRICS_LIMITS: httpd::Limits = httpd::Limits {
    max_connections: 16,
    header_timeout: Duration::from_secs(10),
    handshake_timeout: Duration::from_secs(10),
};
/// The largest bundle `POST /v1/update/apply` reads (a root slot is at most a few GiB).
pub const MAX_BUNDLE_BYTES: u64 = 4 << 30;
/// How long an upload may send nothing before it is cut off.
pub const UPLOAD_IDLE: Duration = Duration::from_secs(60);

/// The bounds of a streamed upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadLimits {
    /// Bytes at most.
    pub max_bytes: u64,
    /// Longest pause between two chunks.
    pub idle: Duration,
}

impl Default for UploadLimits {
    fn default() -> Self {
        UploadLimits { max_bytes: MAX_BUNDLE_BYTES, idle: UPLOAD_IDLE }
    }
}

/// Why an upload was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UploadError {
    /// More than the cap.
    #[error("the bundle is larger than {limit} bytes")]
    TooLarge {
        /// The cap.
        limit: u64,
    },
    /// Nothing arrived for too long.
    #[error("the upload sent nothing for {} s", .limit.as_secs())]
    Idle {
        /// The idle limit.
        limit: Duration,
    },
}

/// Requests the API makes of the main loop.
#[derive(Debug)]
pub enum Command {
    /// Stop the services and reboot; the reply says whether the reboot was accepted.
    Reboot {
        /// Why (logged).
        reason: String,
        /// Accepted or refused (with the reason).
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// What the handlers work on.
#[derive(Clone)]
pub struct ApiState {
    /// Shared state.
    pub shared: Arc<Shared>,
    /// The update side.
    pub update: Arc<dyn UpdateControl>,
    /// To the main loop.
    pub commands: mpsc::Sender<Command>,
    /// Limits of the streamed bundle upload.
    pub upload: UploadLimits,
}

/// An API error.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No such service.
    #[error("unknown service {0:?} (known: sandboxd, vk-sandbox, vk-cocoon)")]
    UnknownService(String),
    /// No such route.
    #[error("no such route")]
    NotFound,
    /// Missing or wrong bearer token (TCP only).
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A bad query or body.
    #[error("{0}")]
    BadRequest(String),
    /// No such token.
    #[error("unknown token {0:?} (known: sandboxd)")]
    UnknownToken(String),
    /// The token file could not be read.
    #[error("reading {}", .path.display())]
    TokenUnreadable {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The upload was cut off.
    #[error(transparent)]
    Upload(UploadError),
    /// The reboot was refused.
    #[error("reboot refused: {0}")]
    RebootRefused(String),
    /// The main loop is gone (shutting down).
    #[error("the supervisor is shutting down")]
    ShuttingDown,
    /// An update operation failed.
    #[error(transparent)]
    Update(#[from] UpdateError),
    /// Metrics could not be rendered.
    #[error("rendering metrics")]
    Metrics(#[source] crate::metrics::MetricsError),
}

impl ApiError {
    /// HTTP status and machine-readable kind.
    pub fn status_kind(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::UnknownService(_) => (StatusCode::NOT_FOUND, "unknown_service"),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::UnknownToken(_) => (StatusCode::NOT_FOUND, "unknown_token"),
            ApiError::TokenUnreadable { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "token_unreadable"),
            ApiError::Upload(UploadError::TooLarge { .. }) => (StatusCode::PAYLOAD_TOO_LARGE, "bundle_too_large"),
            ApiError::Upload(UploadError::Idle { .. }) => (StatusCode::REQUEST_TIMEOUT, "upload_idle"),
            ApiError::RebootRefused(_) => (StatusCode::CONFLICT, "reboot_refused"),
            ApiError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
            ApiError::Update(UpdateError::Unavailable(_)) => (StatusCode::SERVICE_UNAVAILABLE, "updates_unavailable"),
            ApiError::Update(UpdateError::BadBundle(_)) => (StatusCode::UNPROCESSABLE_ENTITY, "bad_bundle"),
            ApiError::Update(UpdateError::Downgrade { .. }) => (StatusCode::UNPROCESSABLE_ENTITY, "downgrade_refused"),
            ApiError::Update(UpdateError::Conflict(_)) => (StatusCode::CONFLICT, "update_conflict"),
            ApiError::Update(UpdateError::Busy) => (StatusCode::CONFLICT, "update_busy"),
            ApiError::Update(UpdateError::Internal { .. }) => (StatusCode::INTERNAL_SERVER_ERROR, "update_failed"),
            ApiError::Metrics(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status_kind();
        let msg = crate::error_chain(&self);
        if status.is_server_error() {
            tracing::warn!(kind, error = %msg, "API request failed");
        }
        (status, Json(serde_json::json!({"error": msg, "kind": kind}))).into_response()
    }
}

async fn status(State(s): State<ApiState>) -> Response {
    Json(s.shared.status(s.update.status().await)).into_response()
}

#[derive(Debug, Deserialize)]
struct TailQuery {
    tail: Option<String>,
}

async fn logs(
    State(s): State<ApiState>,
    Path(service): Path<String>,
    Query(q): Query<TailQuery>,
) -> Result<Response, ApiError> {
    let log = s.shared.logs.get(&service).ok_or(ApiError::UnknownService(service.clone()))?;
    let n = match q.tail.as_deref() {
        None => 200,
        Some(t) => {
            t.parse::<usize>().map_err(|_| ApiError::BadRequest(format!("tail={t:?} is not a number of lines")))?
        }
    };
    Ok(Json(serde_json::json!({"service": service, "lines": log.tail(n.min(RING_LINES))})).into_response())
}

async fn update_status(State(s): State<ApiState>) -> Response {
    Json(s.update.status().await).into_response()
}

async fn reboot_via(s: &ApiState, reason: String) -> Result<(), ApiError> {
    let (reply, rx) = oneshot::channel();
    s.commands.send(Command::Reboot { reason, reply }).await.map_err(|_| ApiError::ShuttingDown)?;
    rx.await.map_err(|_| ApiError::ShuttingDown)?.map_err(ApiError::RebootRefused)
}

/// `body` as a stream of chunks that ends in an error past `limits` (and records which limit).
fn limited_upload(
    body: Body,
    limits: UploadLimits,
    cut: Arc<std::sync::Mutex<Option<UploadError>>>,
) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send {
    use futures::StreamExt as _;
    let fail = move |e: UploadError| {
        *cut.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        Some((Err(std::io::Error::other(e)), None))
    };
    let state = Some((body.into_data_stream(), 0u64));
    futures::stream::unfold(state, move |state| {
        let fail = fail.clone();
        async move {
            let (mut stream, seen) = state?;
            match tokio::time::timeout(limits.idle, stream.next()).await {
                Err(_) => fail(UploadError::Idle { limit: limits.idle }),
                Ok(None) => None,
                Ok(Some(Err(e))) => Some((Err(std::io::Error::other(e)), None)),
                Ok(Some(Ok(chunk))) => {
                    let seen = seen + chunk.len() as u64;
                    if seen > limits.max_bytes {
                        return fail(UploadError::TooLarge { limit: limits.max_bytes });
                    }
                    Some((Ok(chunk), Some((stream, seen))))
                }
            }
        }
    })
}

async fn update_apply(State(s): State<ApiState>, body: Body) -> Result<Response, ApiError> {
    let cut = Arc::new(std::sync::Mutex::new(None));
    let reader = tokio_util::io::StreamReader::new(limited_upload(body, s.upload, cut.clone()));
    let result = s.update.apply(Box::pin(reader)).await;
    if let Some(e) = *cut.lock().unwrap_or_else(|p| p.into_inner()) {
        tracing::warn!(error = %e, "bundle upload cut off");
        return Err(ApiError::Upload(e));
    }
    let outcome = result?;
    tracing::info!(message = %outcome.message, reboot = outcome.reboot, "update applied");
    if outcome.reboot {
        if let Err(e) = reboot_via(&s, format!("update applied: {}", outcome.message)).await {
            tracing::warn!(error = %e, "the update asked for a reboot that was refused");
        }
    }
    Ok(Json(outcome).into_response())
}

async fn update_rollback(State(s): State<ApiState>) -> Result<Response, ApiError> {
    let outcome = s.update.rollback().await?;
    tracing::info!(message = %outcome.message, reboot = outcome.reboot, "rollback armed");
    if outcome.reboot {
        if let Err(e) = reboot_via(&s, format!("rollback: {}", outcome.message)).await {
            tracing::warn!(error = %e, "the rollback asked for a reboot that was refused");
        }
    }
    Ok(Json(outcome).into_response())
}

async fn reboot(State(s): State<ApiState>) -> Result<Response, ApiError> {
    reboot_via(&s, "requested through the API".into()).await?;
    Ok((StatusCode::ACCEPTED, Json(serde_json::json!({"rebooting": true}))).into_response())
}

async fn config(State(s): State<ApiState>) -> Response {
    Json(s.shared.config_view.clone()).into_response()
}

async fn token(State(s): State<ApiState>, Path(name): Path<String>) -> Result<Response, ApiError> {
    let path = match (name.as_str(), &s.shared.sandboxd_token_file) {
        (SANDBOXD_TOKEN_NAME, Some(p)) => p.clone(),
        _ => return Err(ApiError::UnknownToken(name)),
    };
    let text = tokio::fs::read_to_string(&path)
        .await
        .map_err(|source| ApiError::TokenUnreadable { path: path.clone(), source })?;
    tracing::info!(token = %name, "token read through the API");
    let body = serde_json::json!({"name": name, "token": text.trim(), "file": path});
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response())
}

/// The token name of sandboxd's root token in `GET /v1/tokens/{name}`.
pub const SANDBOXD_TOKEN_NAME: &str = "sandboxd";

async fn metrics(State(s): State<ApiState>) -> Result<Response, ApiError> {
    let update = s.update.status().await.state;
    let text = crate::metrics::render(&s.shared.health(), s.shared.uptime(), update).map_err(ApiError::Metrics)?;
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response())
}

async fn healthz(State(s): State<ApiState>) -> Response {
    let since = s.shared.since_tick();
    if since > STALL {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("main loop stalled for {} s\n", since.as_secs()))
            .into_response();
    }
    "ok\n".into_response()
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

/// The router (no authentication; see [`with_token`]).
pub fn app(state: ApiState) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/logs/{service}", get(logs))
        .route("/v1/update", get(update_status))
        .route("/v1/update/apply", post(update_apply).layer(DefaultBodyLimit::disable()))
        .route("/v1/update/rollback", post(update_rollback))
        .route("/v1/reboot", post(reboot))
        .route("/v1/config", get(config))
        .route("/v1/tokens/{name}", get(token))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .with_state(state)
}

/// Only `/metrics` (for `supervisor.metrics_listen`).
pub fn metrics_app(state: ApiState) -> Router {
    Router::new().route("/metrics", get(metrics)).fallback(not_found).with_state(state)
}

/// Whether `headers` carry `Authorization: Bearer <token>` (constant-time).
pub fn bearer_ok(headers: &HeaderMap, token: &str) -> bool {
    let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some((scheme, t)) = v.trim().split_once(' ') else { return false };
    scheme.eq_ignore_ascii_case("bearer") && bool::from(t.trim().as_bytes().ct_eq(token.as_bytes()))
}

/// `router` behind a bearer token (the TCP API). An empty token (an unreadable or emptied
/// token file) lets nobody in.
pub fn with_token(router: Router, token: String) -> Router {
    let token = Arc::new(token);
    router.layer(axum::middleware::from_fn(move |req: Request, next: Next| {
        let token = token.clone();
        async move {
            if !token.is_empty() && bearer_ok(req.headers(), &token) {
                next.run(req).await
            } else {
                ApiError::Unauthorized.into_response()
            }
        }
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

//! The HTTP API (spec §4–§7): [`app`] builds the axum `Router` (tests drive it with
//! `tower::ServiceExt::oneshot`), [`serve`] runs it on a listener with HTTP/1.1 upgrades.
//!
//! Handlers are thin: authenticate ([`auth`]), decode, call [`crate::node::Node`], encode.
//! Every failure is an [`ApiError`] whose status comes from one exhaustive match.

pub mod auth;
pub mod error;
mod exec;
mod relay;
mod routes;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::{any, get, post, put};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;

pub use error::ApiError;

use crate::node::Node;

/// Request body cap (`400 invalid request body` above it).
pub const BODY_LIMIT: usize = 1024 * 1024;
/// How long a client may take to send a request head.
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Builds the router over a node.
pub fn app(node: Arc<Node>) -> Router {
    let unimplemented = |feature: &'static str| any(move || async move { ApiError::NotImplemented(feature) });
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(routes::metrics))
        .route("/v1/claim", post(routes::claim))
        .route("/v1/info", get(routes::info))
        .route("/v1/drain", post(routes::drain).delete(routes::uncordon))
        .route("/v1/pools", put(routes::put_pools).get(routes::get_pools))
        .route("/v1/peers", get(routes::peers))
        .route("/v1/sandboxes", get(routes::list))
        .route("/v1/sandboxes/{id}", get(routes::get_one))
        .route("/v1/sandboxes/{id}/release", post(routes::release))
        .route("/v1/sandboxes/{id}/renew", post(routes::renew))
        .route("/v1/sandboxes/{id}/owner", get(routes::owner))
        .route("/v1/sandboxes/{id}/stats", get(routes::stats))
        .route("/v1/sandboxes/{id}/agent", get(relay::agent))
        .route("/v1/sandboxes/{id}/ports/{port}", get(relay::ports))
        .route("/v1/sandboxes/{id}/exec", post(exec::exec))
        .route("/v1/sandboxes/{id}/fork", unimplemented("fork"))
        .route("/v1/sandboxes/{id}/checkpoint", unimplemented("checkpoint"))
        .route("/v1/sandboxes/{id}/promote", unimplemented("promote"))
        .route("/v1/sandboxes/{id}/hibernate", unimplemented("hibernate"))
        .route("/v1/sandboxes/{id}/wake", unimplemented("wake"))
        .route("/v1/sandboxes/{id}/preview", unimplemented("preview"))
        .route("/v1/sandboxes/{id}/volumes", unimplemented("volumes"))
        .route("/v1/volumes", unimplemented("volumes"))
        .route("/v1/templates", unimplemented("templates"))
        .route("/v1/checkpoints", unimplemented("checkpoints"))
        .route("/v1/checkpoints/{*rest}", unimplemented("checkpoints"))
        .route("/p/{*rest}", unimplemented("preview"))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .with_state(node)
}

/// Reads a JSON body under [`BODY_LIMIT`]; an empty body decodes as `empty` when given.
pub(crate) async fn read_json<T: DeserializeOwned>(body: Body, empty: Option<T>) -> Result<T, ApiError> {
    let bytes = axum::body::to_bytes(body, BODY_LIMIT)
        .await
        .map_err(|_| ApiError::BadRequest("invalid request body".into()))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        if let Some(v) = empty {
            return Ok(v);
        }
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// Serves `app` on `listener` (HTTP/1.1 with upgrades) until `shutdown` resolves. Relays in
/// flight are not waited for (the process exit closes them; VMs keep running).
pub async fn serve(listener: TcpListener, app: Router, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .title_case_headers(true)
        .auto_date_header(false)
        .timer(TokioTimer::new())
        .header_read_timeout(READ_HEADER_TIMEOUT);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(TokioIo::new(stream), service).with_upgrades();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

//! The HTTP API (`docs/sandboxd.md` §4–§7): [`app`] builds the axum `Router` (tests drive it with
//! `tower::ServiceExt::oneshot`), [`serve`] runs it on a listener through [`httpd::serve`]
//! (connection cap, head/idle timeout, TLS, HTTP/1.1 upgrades); every body is read under a
//! size cap and a deadline ([`read_json`]).
//!
//! Handlers are thin: authenticate ([`auth`]), decode, call [`crate::node::Node`], encode.
//! Every body, both ways, is a [`sandboxd_api`] type; every failure is an [`ApiError`] whose
//! status comes from one exhaustive match.

pub mod auth;
mod branch;
mod console;
pub mod error;
mod exec;
mod preview;
mod relay;
mod routes;
mod volumes;

pub use routes::OwnerAddr;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;

pub use error::ApiError;

use crate::node::Node;

/// Request body cap (`400 invalid request body` above it).
pub const BODY_LIMIT: usize = 1024 * 1024;
/// The longest a TLS handshake may take (shorter when `header_timeout_secs` is).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
        .route("/v1/peers", get(routes::peers).put(routes::put_peers))
        .route("/v1/sandboxes", get(routes::list))
        .route("/v1/sandboxes/{id}", get(routes::get_one))
        .route("/v1/sandboxes/{id}/release", post(routes::release))
        .route("/v1/sandboxes/{id}/renew", post(routes::renew))
        .route("/v1/sandboxes/{id}/owner", get(routes::owner))
        .route("/v1/sandboxes/{id}/stats", get(routes::stats))
        .route("/v1/sandboxes/{id}/console", get(console::console))
        .route("/v1/sandboxes/{id}/agent", get(relay::agent))
        .route("/v1/sandboxes/{id}/ports/{port}", get(relay::ports))
        .route("/v1/sandboxes/{id}/exec", post(exec::exec))
        .route("/v1/sandboxes/{id}/fork", post(branch::fork))
        .route("/v1/sandboxes/{id}/checkpoint", post(branch::checkpoint))
        .route("/v1/sandboxes/{id}/promote", post(branch::promote))
        .route("/v1/sandboxes/{id}/hibernate", post(branch::hibernate))
        .route("/v1/sandboxes/{id}/wake", post(branch::wake))
        .route("/v1/sandboxes/{id}/preview", post(preview::create))
        .route("/v1/sandboxes/{id}/volumes", get(volumes::sandbox).put(volumes::sandbox).patch(volumes::sandbox))
        .route("/v1/volumes", get(volumes::catalog))
        .route("/v1/templates", delete(branch::delete_template))
        .route("/v1/checkpoints", get(branch::list))
        .route("/v1/checkpoints/{id}", delete(branch::delete))
        .route("/v1/checkpoints/{id}/claim", post(branch::claim))
        .route("/v1/checkpoints/{id}/blob", unimplemented("checkpoint blobs"))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .with_state(node)
}

/// Reads a JSON body under [`BODY_LIMIT`] and the node's body deadline; an empty body decodes
/// as `empty` when given.
pub(crate) async fn read_json<T: DeserializeOwned>(node: &Node, body: Body, empty: Option<T>) -> Result<T, ApiError> {
    let deadline = node.limits().http.body_timeout;
    let bytes = httpd::read_body(body, BODY_LIMIT, deadline).await.map_err(|e| match e {
        httpd::BodyError::Timeout { limit } => {
            crate::metrics::inc(&node.metrics.body_timeouts);
            ApiError::RequestTimeout(format!(
                "request body not received within {} s (body_timeout_secs)",
                limit.as_secs_f64()
            ))
        }
        httpd::BodyError::TooLarge { .. } | httpd::BodyError::Read(_) => {
            ApiError::BadRequest("invalid request body".into())
        }
    })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        if let Some(v) = empty {
            return Ok(v);
        }
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// A JSON response whose object keys are sorted, as [`serde_json::Value`] writes them: the
/// bodies sandboxd has always built as values (listings, stats, the pool list, exec results)
/// keep their exact bytes. (Nothing here can fail to become a value: string keys only.)
pub(crate) fn sorted_json<T: Serialize>(body: &T) -> Result<Response, ApiError> {
    let value = serde_json::to_value(body).map_err(|e| ApiError::internal("encode", e))?;
    Ok(axum::Json(value).into_response())
}

/// The server options of a node's listener: HTTP/1.1 only (upgrades), the node's limits, TLS
/// when given.
pub fn serve_options(node: &Node, tls: Option<Arc<rustls::ServerConfig>>) -> httpd::ServeOptions {
    let http = node.limits().http;
    httpd::ServeOptions {
        name: "sandboxd",
        limits: httpd::Limits {
            max_connections: http.max_connections,
            header_timeout: http.header_timeout,
            handshake_timeout: http.header_timeout.min(HANDSHAKE_TIMEOUT),
        },
        protocol: httpd::Protocol::Http1,
        tls,
    }
}

/// Serves the node's API on `listener` through [`httpd::serve`] (connection cap, request-head
/// and idle keep-alive timeout, TLS with ALPN `http/1.1` when `tls` is given, HTTP/1.1
/// upgrades) until `shutdown` resolves. Relays in flight are not waited for (the process exit
/// closes them; VMs keep running). Connection counts go to [`Node::conn_stats`].
pub async fn serve(
    listener: TcpListener,
    node: Arc<Node>,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()>,
) {
    serve_as(listener, node, tls, None, shutdown).await;
}

/// [`serve`], handing out `owner` as the `owner_addr` of claims and `…/owner` (the plain
/// `local_listen` listener names itself, so its clients stay on it).
pub async fn serve_as(
    listener: TcpListener,
    node: Arc<Node>,
    tls: Option<Arc<rustls::ServerConfig>>,
    owner: Option<String>,
    shutdown: impl Future<Output = ()>,
) {
    let opts = serve_options(&node, tls);
    let stats = Arc::clone(&node.conn_stats);
    let mut router = app(node);
    if let Some(o) = owner {
        router = router.layer(axum::Extension(OwnerAddr(o)));
    }
    httpd::serve(listener, router, opts, stats, shutdown).await;
}

/// Serves preview URLs (`/p/<token>/…`) on `listener` (plain HTTP, the node's connection
/// limits) until `shutdown` resolves.
pub async fn serve_previews(listener: TcpListener, node: Arc<Node>, shutdown: impl Future<Output = ()>) {
    let mut opts = serve_options(&node, None);
    opts.name = "sandboxd-preview";
    let stats = Arc::clone(&node.conn_stats);
    httpd::serve(listener, preview::preview_app(node), opts, stats, shutdown).await;
}

/// The preview router, for in-process tests.
pub fn preview_app(node: Arc<Node>) -> Router {
    preview::preview_app(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sorted_json_keeps_the_byte_order_of_value_bodies() {
        let body = sandboxd_api::ExecResult { exit_code: 0, stdout: "hi\n".into(), stderr: String::new() };
        let resp = sorted_json(&body).expect("encode");
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
        assert_eq!(&bytes[..], br#"{"exit_code":0,"stderr":"","stdout":"hi\n"}"#);
    }
}

//! Preview URLs: `POST …/{id}/preview {token, port, ttl_seconds?}` → `{url}` on the API, and
//! the proxy behind `preview_listen` (`/p/<token>/<path>`), which forwards each HTTP request
//! (WebSocket and other upgrades included) to the guest port over silkd's `port_forward`.
//!
//! The proxy answers `404` for a bad, expired or foreign token and for a sandbox that ended
//! (nothing tells them apart), `502` when the guest port does not answer. A hibernated
//! sandbox wakes on a preview request. Each request opens its own guest connection; bodies
//! stream both ways; the request path has the `/p/<token>` prefix removed.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tracing::Instrument as _;

use super::auth;
use super::error::ApiError;
use super::read_json;
use crate::node::Node;
use crate::preview::DEFAULT_TTL;

/// The `POST …/{id}/preview` body.
#[derive(Deserialize)]
pub(super) struct PreviewRequest {
    #[serde(default)]
    token: String,
    #[serde(default)]
    port: i64,
    #[serde(default)]
    ttl_seconds: Option<i64>,
}

/// Its `200`.
#[derive(Serialize)]
struct PreviewReply {
    url: String,
}

pub(super) async fn create(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let previews = node.previews().ok_or_else(|| {
        ApiError::Unavailable(
            "preview URLs are not served by this node: set preview_listen (and preview_url, the origin clients reach it \
             at) in sandboxd's config"
                .into(),
        )
    })?;
    let b: PreviewRequest = read_json(&node, body, None).await?;
    let claim = super::branch::body_token(&node, &id, &b.token)?;
    let port = u16::try_from(b.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::BadRequest(format!("invalid port {} (want 1-65535)", b.port)))?;
    let ttl = match b.ttl_seconds {
        None | Some(0) => DEFAULT_TTL,
        Some(s) if s < 0 => return Err(ApiError::BadRequest("ttl_seconds must not be negative".into())),
        Some(s) => std::time::Duration::from_secs(s.unsigned_abs()),
    };
    // Clamped to the claim's lease: a URL never outlives its sandbox's deadline.
    let now = SystemTime::now();
    let left = claim.rec.deadline_unix_ms.saturating_sub(crate::claims::unix_ms(now));
    let url = previews.url(&claim.rec.id, port, ttl.min(std::time::Duration::from_millis(left)), now);
    Ok(axum::Json(PreviewReply { url }).into_response())
}

/// The router of `preview_listen`.
pub fn preview_app(node: Arc<Node>) -> Router {
    Router::new()
        .route("/p/{token}", any(proxy_root))
        .route("/p/{token}/", any(proxy_root))
        .route("/p/{token}/{*rest}", any(proxy))
        .fallback(|| async { ApiError::NotFound("no such preview".into()) })
        .with_state(node)
}

async fn proxy_root(state: State<Arc<Node>>, Path(token): Path<String>, req: Request) -> Response {
    forward(state, token, String::new(), req).await.unwrap_or_else(IntoResponse::into_response)
}

async fn proxy(state: State<Arc<Node>>, Path((token, rest)): Path<(String, String)>, req: Request) -> Response {
    forward(state, token, rest, req).await.unwrap_or_else(IntoResponse::into_response)
}

async fn forward(
    State(node): State<Arc<Node>>,
    token: String,
    rest: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    let gone = || ApiError::NotFound("no such preview".into());
    let previews = node.previews().ok_or_else(gone)?;
    let grant = previews.verify(&token, SystemTime::now()).map_err(|_| gone())?;
    let claim = node.sandbox(&grant.sandbox).ok_or_else(gone)?;
    let span = tracing::info_span!("preview", claim = %grant.sandbox, port = grant.port);
    async move {
        let unreachable = |e: String| ApiError::BadGateway(format!("preview: guest port {}: {e}", grant.port));
        let vm = node.vm_waking(&claim).await?;
        let agent = node.driver().connect(&vm, vmm::AGENT_PORT).await.map_err(|e| unreachable(vmm::error_chain(&e)))?;
        let guest = silkd_client::port_stream(silkd_client::AgentConn::new(agent), grant.port)
            .await
            .map_err(|e| unreachable(vmm::error_chain(&e)))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(guest)).await.map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(conn.with_upgrades());
        // The guest sees its own path: `/p/<token>` removed, the query kept.
        let path = match req.uri().query() {
            Some(q) => format!("/{rest}?{q}"),
            None => format!("/{rest}"),
        };
        let client_upgrade = hyper::upgrade::on(&mut req);
        let (mut parts, body) = req.into_parts();
        parts.uri = path.parse::<Uri>().map_err(|e| ApiError::BadRequest(format!("invalid path: {e}")))?;
        let outbound = hyper::Request::from_parts(parts, body);
        let mut resp = sender.send_request(outbound).await.map_err(|e| unreachable(e.to_string()))?;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let guest_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(
                async move {
                    match tokio::try_join!(client_upgrade, guest_upgrade) {
                        Ok((client, guest)) => {
                            let (mut c, mut g) = (TokioIo::new(client), TokioIo::new(guest));
                            let _ = tokio::io::copy_bidirectional(&mut c, &mut g).await;
                        }
                        Err(e) => tracing::debug!(error = %e, "preview upgrade did not complete"),
                    }
                }
                .in_current_span(),
            );
        }
        let (parts, body) = resp.into_parts();
        Ok(Response::from_parts(parts, Body::new(body)))
    }
    .instrument(span)
    .await
}

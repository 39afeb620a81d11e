//! Thin handlers of the control routes: claim, release, renew, listings, info, drain, pools,
//! peers, metrics. Request and response bodies are [`sandboxd_api`] types.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandboxd_api as api;

use super::auth;
use super::error::ApiError;
use super::{read_json, sorted_json};
use crate::claims::{self, ClaimError};
use crate::node::{ClaimRequest, Node};
use crate::pool::PoolKey;

type Node_ = State<Arc<Node>>;

/// The `owner_addr` a listener hands out instead of the node's advertised address: a client of
/// the plain loopback listener (`local_listen`) must come back to it, not to the TLS `listen`.
#[derive(Debug, Clone)]
pub struct OwnerAddr(pub String);

pub(super) fn owner_addr(node: &Node, over: Option<&Extension<OwnerAddr>>) -> String {
    over.map_or_else(|| node.advertise_addr().to_string(), |Extension(OwnerAddr(a))| a.clone())
}

pub(super) async fn claim(
    State(node): Node_,
    over: Option<Extension<OwnerAddr>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let b: api::ClaimRequest = read_json(&node, body, None).await?;
    let req = (|| -> Result<ClaimRequest, ClaimError> {
        let key = PoolKey::parse(&b.template, b.net.as_deref(), b.size.as_deref())?;
        Ok(ClaimRequest { key, ttl: claims::ttl(b.ttl_seconds)?, claim_ref: b.claim_ref })
    })()
    .inspect_err(|_| crate::metrics::inc(&node.metrics.claims_failed))?;
    if b.require_promoted == Some(true) && !node.is_promoted(req.key.template()) {
        crate::metrics::inc(&node.metrics.claims_failed);
        return Err(ApiError::NotFound(format!("{:?} is not a promoted template on this node", req.key.template())));
    }
    let volumes = b.volumes.unwrap_or_default();
    let attach_only = b.volumes_attach_only == Some(true);
    if let Err(e) = node.check_volumes(&volumes, attach_only) {
        crate::metrics::inc(&node.metrics.claims_failed);
        return Err(e.into());
    }
    if b.no_redirect != Some(true) {
        let redirect = node.redirect_for(&req.key);
        if !redirect.is_empty() {
            crate::metrics::inc(&node.metrics.claims_redirected);
            tracing::info!(template = %req.key.template(), ?redirect, "warm miss: the claim is redirected to peers with warm VMs");
            return Ok(Json(api::ClaimReply { grant: api::Grant::default(), redirect }).into_response());
        }
    }
    let mut grant = node.claim(req).await?;
    // Volumes are attached (and mounted) before the grant goes out; a claim whose volumes
    // fail is released again, so the caller never holds half of what it asked for.
    if !volumes.is_empty() {
        let mut failed = std::collections::BTreeMap::new();
        if let Err(e) = node.set_volumes(&grant.id, &volumes, attach_only, &mut failed).await {
            crate::metrics::inc(&node.metrics.claims_failed);
            if let Err(r) = node.release(&grant.id).await {
                tracing::warn!(claim = %grant.id, error = %r, "releasing a claim whose volumes failed");
            }
            return Err(e.into());
        }
        grant.volumes =
            node.sandbox(&grant.id).map(|c| c.rec.volumes.iter().map(|v| v.spec()).collect()).unwrap_or_default();
    }
    grant.owner_addr = owner_addr(&node, over.as_ref());
    Ok(Json(grant).into_response())
}

pub(super) async fn release(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    auth::sandbox_route(&node, &headers, &id)?;
    node.release(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn renew(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    auth::sandbox_route(&node, &headers, &id)?;
    let b: api::RenewRequest = read_json(&node, body, Some(api::RenewRequest::default())).await?;
    let deadline = node.renew(&id, claims::ttl(b.ttl_seconds)?)?;
    Ok(Json(api::Renewed { deadline }).into_response())
}

pub(super) async fn list(
    State(node): Node_,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let sandboxes = node.list(q.get("claim_ref").map(String::as_str));
    sorted_json(&api::SandboxList { sandboxes })
}

pub(super) async fn get_one(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let claim = node.sandbox(&id).ok_or_else(ApiError::no_sandbox)?;
    let mut row = claim.row();
    if auth::is_root(&node, &headers) {
        row.token = Some(claim.rec.token.clone());
    }
    Ok(Json(row).into_response())
}

pub(super) async fn owner(
    State(node): Node_,
    over: Option<Extension<OwnerAddr>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::sandbox_route(&node, &headers, &id).map_err(|e| match e {
        ApiError::NotFound(_) => ApiError::NotFound("not owned here".into()),
        other => other,
    })?;
    Ok(Json(api::Owner { owner_addr: owner_addr(&node, over.as_ref()) }).into_response())
}

pub(super) async fn stats(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let claim = node.sandbox(&id).ok_or_else(ApiError::no_sandbox)?;
    let size = claim.rec.key.size();
    let mem_total_bytes = size.memory_mib() * 1024 * 1024;
    // After a restart the VM is attached on first use; a VM that cannot be found is unmeasured.
    let vm = node.vm_for(&claim).await.ok();
    // A handful of small /proc and cgroupfs reads: cheap enough for the handler itself.
    let usage = vm.as_ref().and_then(|vm| match vmm::usage::UsageReader::default().vm(vm) {
        Ok(u) => Some(u),
        Err(e) => {
            tracing::debug!(sandbox = %id, error = %vmm::error_chain(&e), "the VM could not be measured");
            None
        }
    });
    // The guest's own view, through its agent (bounded in time and size).
    let guest_used = match &vm {
        Some(vm) => crate::guest_memory::used_bytes(node.driver().as_ref(), vm, mem_total_bytes)
            .await
            .inspect_err(|e| tracing::debug!(sandbox = %id, error = %vmm::error_chain(e), "guest memory not read"))
            .ok(),
        None => None,
    };
    sorted_json(&api::Stats {
        id,
        cpu_count: size.vcpus(),
        mem_total_bytes,
        mem_used_bytes: guest_used.unwrap_or(0),
        mem_used_measured: guest_used.is_some(),
        hibernated: claim.rec.hibernate_snap.is_some(),
        measured_at: claims::rfc3339(claims::unix_ms(usage.map_or_else(std::time::SystemTime::now, |u| u.measured_at))),
        cpu_usage_nanos: usage.map(|u| u.cpu_usage_nanos),
        memory_working_set_bytes: usage.map(|u| u.memory_working_set_bytes),
    })
}

pub(super) async fn info(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    Ok(Json(node.info()).into_response())
}

pub(super) async fn drain(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    Ok(Json(node.drain().await).into_response())
}

pub(super) async fn uncordon(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    Ok(Json(node.uncordon()).into_response())
}

pub(super) async fn put_pools(State(node): Node_, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    auth::root_only(&node, &headers, "PUT /v1/pools")?;
    let b: api::PoolList = read_json(&node, body, None).await?;
    Ok(Json(node.put_pools(b.pools).await?).into_response())
}

pub(super) async fn get_pools(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    sorted_json(&api::PoolList { pools: node.pool_configs() })
}

pub(super) async fn peers(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    Ok(Json(api::Peers { peers: node.peer_addrs() }).into_response())
}

/// `PUT /v1/peers` (root): the provider's report of the other boxes (`node::peers`).
pub(super) async fn put_peers(State(node): Node_, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    auth::root_only(&node, &headers, "PUT /v1/peers")?;
    let report: api::PeerReport = read_json(&node, body, None).await?;
    let n = node.set_peers(report).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    tracing::debug!(peers = n, "peer report");
    Ok(Json(api::Peers { peers: node.peer_addrs() }).into_response())
}

pub(super) async fn metrics(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], node.render_metrics())
        .into_response())
}

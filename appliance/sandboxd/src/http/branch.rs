//! Thin handlers of fork, the checkpoint routes, hibernate and wake (`docs/sandboxd.md` §5.2):
//! for fork and checkpoint the node token in the header and the sandbox token in the body;
//! hibernate and wake are sandbox routes (its token or root in the header). Bodies are
//! [`sandboxd_api`] types; the work is [`Node::fork`] and its neighbours.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use sandboxd_api as api;

use super::auth;
use super::error::ApiError;
use super::routes::{owner_addr, OwnerAddr};
use super::{read_json, sorted_json};
use crate::claims::{self, Claim};
use crate::node::{BranchError, HibernateError, Node, PromoteError};

type Node_ = State<Arc<Node>>;

impl From<BranchError> for ApiError {
    fn from(e: BranchError) -> Self {
        match e {
            e @ BranchError::Count { .. } => ApiError::BadRequest(e.to_string()),
            e @ (BranchError::Egress(_) | BranchError::Hibernated(_) | BranchError::Volumes(..)) => {
                ApiError::Conflict(e.to_string())
            }
            e @ (BranchError::Draining | BranchError::Budget(_)) => ApiError::TooManyRequests(e.to_string()),
            e @ BranchError::NoCheckpoint => ApiError::NotFound(e.to_string()),
            e @ (BranchError::Snapshot(_) | BranchError::Restore(_) | BranchError::Io(_)) => {
                ApiError::internal("branch", e)
            }
            e @ BranchError::Journal(_) => ApiError::internal("claim", e),
        }
    }
}

impl From<HibernateError> for ApiError {
    fn from(e: HibernateError) -> Self {
        match e {
            HibernateError::NotFound => ApiError::no_sandbox(),
            e @ (HibernateError::Egress(_) | HibernateError::Volumes(..)) => ApiError::Conflict(e.to_string()),
            e @ HibernateError::Budget(_) => ApiError::TooManyRequests(e.to_string()),
            e @ (HibernateError::Snapshot(_) | HibernateError::Io(_) | HibernateError::Journal(_)) => {
                ApiError::internal("hibernate", e)
            }
            e @ HibernateError::Restore(_) => {
                ApiError::BadGateway(format!("sandbox unreachable: {}", vmm::error_chain(&e)))
            }
        }
    }
}

impl From<PromoteError> for ApiError {
    fn from(e: PromoteError) -> Self {
        match e {
            e @ PromoteError::Name(_) => ApiError::BadRequest(e.to_string()),
            e @ (PromoteError::CatalogName(_) | PromoteError::Pooled(_)) => ApiError::Conflict(e.to_string()),
            e @ PromoteError::NotFound(_) => ApiError::NotFound(e.to_string()),
            PromoteError::Branch(b) => b.into(),
            e @ PromoteError::Io(_) => ApiError::internal("promote", e),
        }
    }
}

/// The sandbox's own token in the body (the caller checked the node token in the header);
/// `404` for an unknown id or a wrong token alike.
pub(super) fn body_token(node: &Node, id: &str, token: &str) -> Result<Claim, ApiError> {
    node.sandbox(id).filter(|c| auth::ct_eq(token, &c.rec.token)).ok_or_else(ApiError::no_sandbox)
}

/// A request body that carries the sandbox's token.
pub(super) trait WithToken: serde::de::DeserializeOwned {
    fn token(&self) -> &str;
}

impl WithToken for api::ForkRequest {
    fn token(&self) -> &str {
        &self.token
    }
}

impl WithToken for api::CheckpointRequest {
    fn token(&self) -> &str {
        &self.token
    }
}

impl WithToken for api::PromoteRequest {
    fn token(&self) -> &str {
        &self.token
    }
}

/// The node token in the header, then the body, then the sandbox's token in it: the request
/// and the sandbox it names.
pub(super) async fn authorized<T: WithToken>(
    node: &Node,
    headers: &HeaderMap,
    id: &str,
    body: Body,
) -> Result<(T, Claim), ApiError> {
    auth::node_route(node, headers)?;
    let b: T = read_json(node, body, None).await?;
    let claim = body_token(node, id, b.token())?;
    Ok((b, claim))
}

pub(super) async fn fork(
    State(node): Node_,
    over: Option<Extension<OwnerAddr>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (b, parent) = authorized::<api::ForkRequest>(&node, &headers, &id, body).await?;
    let ttl = claims::ttl(b.ttl_seconds)?;
    let mut children = node.fork(&parent, b.count, ttl, b.claim_ref_prefix).await?;
    for c in &mut children {
        c.owner_addr = owner_addr(&node, over.as_ref());
    }
    sorted_json(&api::ForkReply { children })
}

pub(super) async fn checkpoint(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (b, claim) = authorized::<api::CheckpointRequest>(&node, &headers, &id, body).await?;
    let checkpoint = node.checkpoint(&claim, b.name).await?;
    sorted_json(&api::CheckpointReply { checkpoint })
}

pub(super) async fn promote(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (b, claim) = authorized::<api::PromoteRequest>(&node, &headers, &id, body).await?;
    let mut rec = node.promote(&claim, &b.template).await?;
    rec.key.template = rec.name.clone();
    sorted_json(&api::PromoteReply { key: rec.key, content_digest: rec.content_digest })
}

/// `DELETE /v1/templates?template=…&net=…&size=…`.
#[derive(serde::Deserialize)]
pub(super) struct TemplateQuery {
    #[serde(default)]
    template: String,
}

pub(super) async fn delete_template(
    State(node): Node_,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<TemplateQuery>,
) -> Result<StatusCode, ApiError> {
    auth::node_route(&node, &headers)?;
    node.delete_template(&q.template)?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn list(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    sorted_json(&api::CheckpointList { checkpoints: node.checkpoints() })
}

pub(super) async fn claim(
    State(node): Node_,
    over: Option<Extension<OwnerAddr>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let b: api::CheckpointClaimRequest = read_json(&node, body, Some(api::CheckpointClaimRequest::default())).await?;
    let mut grant = node.claim_checkpoint(&id, claims::ttl(b.ttl_seconds)?).await?;
    grant.owner_addr = owner_addr(&node, over.as_ref());
    Ok(axum::response::IntoResponse::into_response(axum::Json(grant)))
}

pub(super) async fn hibernate(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    auth::sandbox_route(&node, &headers, &id)?;
    node.hibernate(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn wake(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    auth::sandbox_route(&node, &headers, &id)?;
    node.wake(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn delete(
    State(node): Node_,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    auth::node_route(&node, &headers)?;
    node.delete_checkpoint(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

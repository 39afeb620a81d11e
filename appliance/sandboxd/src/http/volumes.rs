//! Thin handlers of the volume routes (`docs/sandboxd.md` §5.1): `GET /v1/volumes` and
//! `GET/PUT/PATCH /v1/sandboxes/{id}/volumes`, node routes (the SDK sends the node token, not
//! the sandbox's). Every answer of `…/volumes`, errors included, is the whole
//! [`api::SandboxVolumes`] view, with `error` naming the refusal; the work is
//! [`Node::set_volumes`].

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandboxd_api as api;

use super::auth;
use super::error::ApiError;
use super::read_json;
use crate::node::{Node, VolumeError};
use crate::volumes::CatalogError;

type Node_ = State<Arc<Node>>;

/// The status a volume error answers with.
pub(crate) fn status(e: &VolumeError) -> StatusCode {
    match e {
        VolumeError::NotFound | VolumeError::Catalog(CatalogError::Unknown(_)) => StatusCode::NOT_FOUND,
        VolumeError::Invalid(_) | VolumeError::Catalog(CatalogError::BadName(_)) => StatusCode::BAD_REQUEST,
        VolumeError::Conflict { .. } => StatusCode::CONFLICT,
        VolumeError::Wake(_) => StatusCode::BAD_GATEWAY,
        VolumeError::Catalog(_) | VolumeError::Apply { .. } | VolumeError::Journal(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

impl From<VolumeError> for ApiError {
    fn from(e: VolumeError) -> Self {
        let msg = vmm::error_chain(&e);
        match status(&e) {
            StatusCode::NOT_FOUND => ApiError::NotFound(msg),
            StatusCode::BAD_REQUEST => ApiError::BadRequest(msg),
            StatusCode::CONFLICT => ApiError::Conflict(msg),
            StatusCode::BAD_GATEWAY => ApiError::BadGateway(msg),
            _ => ApiError::internal("volumes", e),
        }
    }
}

pub(super) async fn catalog(State(node): Node_, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    let c = node.volume_catalog().map_err(|e| ApiError::internal("list volumes", e))?;
    Ok(Json(c).into_response())
}

pub(super) async fn sandbox(
    State(node): Node_,
    Path(id): Path<String>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    auth::node_route(&node, &headers)?;
    if node.sandbox(&id).is_none() {
        return Err(ApiError::no_sandbox());
    }
    let want: Vec<api::VolumeSpec> = match method {
        Method::GET => return Ok(Json(node.volume_view(&id, None, &BTreeMap::new())).into_response()),
        Method::PUT => read_json::<api::VolumesPut>(&node, body, None).await?.volumes,
        Method::PATCH => {
            let p: api::VolumesPatch = read_json(&node, body, Some(api::VolumesPatch::default())).await?;
            node.patched(&id, p.add.unwrap_or_default(), p.remove.unwrap_or_default())?
        }
        _ => return Err(ApiError::NotFound("no such route".into())),
    };
    // A mount point is kept as the request spells it; attach-only is a claim-time choice.
    let mut failed = BTreeMap::new();
    let r = node.set_volumes(&id, &want, false, &mut failed).await;
    let mut view = node.volume_view(&id, Some(&want), &failed);
    match r {
        Ok(()) => Ok(Json(view).into_response()),
        Err(e) => {
            tracing::debug!(claim = %id, error = %vmm::error_chain(&e), "volume request refused");
            let code = status(&e);
            view.error = Some(vmm::error_chain(&e));
            Ok((code, Json(view)).into_response())
        }
    }
}

//! `GET /v1/sandboxes/{id}/console` (Chrysalis extension, `docs/sandboxd.md` §7.4): the
//! sandbox's serial console as a container log, streamed.
//!
//! The query is [`kstream::logs::LogQuery`]'s (`follow`, `tailLines`, `sinceSeconds`,
//! `sinceTime`, `timestamps`, `limitBytes`), applied by [`vmm::console::read_log`] to the
//! VM's capped, line-stamped console file. A sandbox route: the sandbox's token or the root
//! token. `400` for a query that does not decode or validate and for `previous` (a sandbox's
//! VM has no previous instance); `404` for an unknown sandbox; `502` when its VM is not
//! attached. With `follow` the body ends when the VM is destroyed (release, expiry).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use kstream::logs::LogQuery;

use super::auth;
use super::error::ApiError;
use crate::node::Node;

pub(super) async fn console(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    query: Result<Query<LogQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let claim = auth::sandbox_route(&node, &headers, &id)?;
    let Query(q) = query.map_err(|e| ApiError::BadRequest(format!("invalid console query: {}", e.body_text())))?;
    if q.previous {
        return Err(ApiError::BadRequest("previous: a sandbox's VM has no previous instance".into()));
    }
    let q = q.validate().map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let vm = node
        .vm_for(&claim)
        .await
        .map_err(|e| ApiError::BadGateway(format!("sandbox unreachable: {}", vmm::error_chain(&e))))?;
    // A follow ends (with an error) when the VM's hypervisor dies, even though its files stay.
    let (pid, started) = (vm.pid, vm.pid_start_time);
    let log = vmm::console::read_log_while(&vm.console_log, &q, move || vmm::record::is_alive(pid, started));
    let body = Body::from_stream(log);
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response())
}

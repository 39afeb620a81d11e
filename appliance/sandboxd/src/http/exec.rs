//! `POST /v1/sandboxes/{id}/exec` (`docs/sandboxd.md` §7): a buffered exec over one silkd connection.
//!
//! [`ExecRequest`] `{argv, cwd?, env?, timeout_seconds?}` (strict) → [`ExecResult`]
//! `{exit_code, stdout, stderr}` (lossy UTF-8).
//! `400` empty argv / negative timeout / a timeout over `exec_max_timeout_secs` / unknown field /
//! silkd `bad_request`; `413` output over 8 MiB; `429` at `max_execs_per_claim` concurrent
//! calls; `504` past the timeout (absent or 0 = `exec_default_timeout_secs`, not "none": every
//! exec ends); `502` unreachable or any other silkd error. On timeout or cap the child is killed
//! via silkd (on a second connection) first.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use sandboxd_api::{ExecRequest, ExecResult};
use silkd_client::{AgentConn, ClientError, OutputBuffer, Stream};
use vmm::{Vm, AGENT_PORT};
use wire::{ErrorKind, Request as Frame, Response as Reply};

use super::auth;
use super::error::ApiError;
use super::{read_json, sorted_json};
use crate::metrics::inc;
use crate::node::Node;
use crate::slots::Use;

/// Output cap (stdout + stderr): the host-side collectors' shared default, 8 MiB.
pub const MAX_OUTPUT: usize = silkd_client::DEFAULT_OUTPUT_CAP;
/// How long the kill after a timeout may take.
const KILL_BUDGET: Duration = Duration::from_secs(5);

enum Outcome {
    Exit(i32),
    TooLarge,
}

pub(super) async fn exec(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let claim = auth::sandbox_route(&node, &headers, &id)?;
    let b: ExecRequest = read_json(&node, body, None).await?;
    if b.argv.is_empty() {
        return Err(ApiError::BadRequest("argv must not be empty".into()));
    }
    let limits = node.limits().exec;
    let timeout = match b.timeout_seconds {
        Some(t) if !t.is_finite() || t < 0.0 => {
            return Err(ApiError::BadRequest("timeout_seconds must not be negative".into()))
        }
        None | Some(0.0) => limits.default,
        Some(t) if t > limits.max.as_secs_f64() => {
            return Err(ApiError::BadRequest(format!(
                "timeout_seconds {t} is over the maximum of {} s (exec_max_timeout_secs)",
                limits.max.as_secs()
            )))
        }
        Some(t) => Duration::from_secs_f64(t),
    };
    let _slot = node.acquire_slot(&id, Use::Exec).inspect_err(|_| inc(&node.metrics.execs_refused))?;
    inc(&node.metrics.execs);
    let unreachable = |e: String| ApiError::BadGateway(format!("sandbox unreachable: {e}"));
    let vm = node.vm_waking(&claim).await?;
    let stream = node.driver().connect(&vm, AGENT_PORT).await.map_err(|e| unreachable(vmm::error_chain(&e)))?;
    let mut conn = AgentConn::new(stream);
    let req = Frame::Exec { argv: b.argv, cwd: b.cwd, env: b.env, user: None, detach: None, session: None };
    let agent_err = |e: ClientError| match e {
        ClientError::Agent { kind: ErrorKind::BadRequest, message } => ApiError::BadRequest(message),
        other => ApiError::BadGateway(format!("exec: {}", vmm::error_chain(&other))),
    };
    conn.send(&req).await.map_err(agent_err)?;
    conn.send(&Frame::StdinClose).await.map_err(agent_err)?;
    let mut output = OutputBuffer::new(MAX_OUTPUT);
    // Armed once the guest names the child: if this request ends any way but the child's exit
    // (the client hung up and the handler was dropped included), the child is killed.
    let mut child = ChildGuard { node: Arc::clone(&node), vm: vm.clone(), pid: None };
    let run = async {
        loop {
            match conn.recv().await? {
                Reply::Started { pid: p } => child.pid = Some(p),
                Reply::Stdout { data } => {
                    if output.push(Stream::Stdout, &data.0).is_err() {
                        return Ok(Outcome::TooLarge);
                    }
                }
                Reply::Stderr { data } => {
                    if output.push(Stream::Stderr, &data.0).is_err() {
                        return Ok(Outcome::TooLarge);
                    }
                }
                Reply::Exit { code } => return Ok(Outcome::Exit(code)),
                other => {
                    return Err(ClientError::Unexpected { expected: "exec output", got: other.type_name().to_string() })
                }
            }
        }
    };
    let result = tokio::time::timeout(timeout, run).await.ok();
    if !matches!(result, Some(Ok(Outcome::Exit(_)))) {
        // Killed here, awaited; the guard stays armed in case this request is dropped meanwhile.
        kill(&node, &vm, child.pid).await;
    }
    child.pid = None;
    match result {
        Some(Ok(Outcome::Exit(code))) => {
            let (out, err) = output.into_parts();
            sorted_json(&ExecResult {
                exit_code: code,
                stdout: String::from_utf8_lossy(&out).into_owned(),
                stderr: String::from_utf8_lossy(&err).into_owned(),
            })
        }
        Some(Ok(Outcome::TooLarge)) => Err(ApiError::TooLarge("exec output exceeds 8 MiB".into())),
        Some(Err(e)) => Err(agent_err(e)),
        None => Err(ApiError::GatewayTimeout(format!("command did not finish within {}s", timeout.as_secs_f64()))),
    }
}

/// The exec's child in the guest, killed when dropped while still armed (`pid` set).
struct ChildGuard {
    node: Arc<Node>,
    vm: Vm,
    pid: Option<u32>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let Some(pid) = self.pid.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (node, vm) = (Arc::clone(&self.node), self.vm.clone());
        tracing::debug!(pid, vm = %vm.id, "exec request ended before its child exited; killing it");
        rt.spawn(async move { kill(&node, &vm, Some(pid)).await });
    }
}

/// Kills `pid` in the guest over a fresh connection (the exec's own is mid-RPC).
async fn kill(node: &Node, vm: &Vm, pid: Option<u32>) {
    let Some(pid) = pid else { return };
    let attempt = async {
        let stream = node.driver().connect(vm, AGENT_PORT).await.map_err(|e| vmm::error_chain(&e))?;
        let mut c = AgentConn::new(stream);
        c.call(&Frame::Kill { pid, signal: None }).await.map_err(|e| vmm::error_chain(&e))
    };
    match tokio::time::timeout(KILL_BUDGET, attempt).await {
        Ok(Ok(_)) => tracing::debug!(pid, "killed the exec child"),
        Ok(Err(e)) => tracing::warn!(pid, error = %e, "killing the exec child failed"),
        Err(_) => tracing::warn!(pid, "killing the exec child timed out"),
    }
}

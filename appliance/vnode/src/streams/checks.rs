//! What the streaming routes refuse before the provider is asked, and the status of every
//! refusal (one exhaustive match, so a new error needs a chosen status to compile).

use super::sessions::Busy;
use super::{StreamError, Streaming};
use crate::provider::PodKey;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::Pod;

/// Why a streaming request is refused.
#[derive(Debug, thiserror::Error)]
pub(super) enum RouteError {
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error("a sandbox VM has no previous instance to read logs from: drop --previous")]
    Previous,
    #[error("bad query: {0}")]
    Query(String),
    #[error("{route} needs a WebSocket upgrade offering {speaks}; this node does not serve SPDY")]
    NotWebSocket { route: &'static str, speaks: &'static str },
    #[error("no WebSocket subprotocol this node speaks was offered ({offered:?}); it speaks {speaks}")]
    NoSubprotocol { offered: String, speaks: &'static str },
}

impl RouteError {
    fn status(&self) -> StatusCode {
        match self {
            RouteError::Stream(StreamError::NoPod(_) | StreamError::NoContainer { .. }) => StatusCode::NOT_FOUND,
            RouteError::Stream(StreamError::NotRunning { .. }) => StatusCode::BAD_REQUEST,
            RouteError::Stream(StreamError::Unavailable(_)) => StatusCode::BAD_GATEWAY,
            RouteError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            RouteError::Previous
            | RouteError::Query(_)
            | RouteError::NotWebSocket { .. }
            | RouteError::NoSubprotocol { .. } => StatusCode::BAD_REQUEST,
        }
    }
}

impl IntoResponse for RouteError {
    fn into_response(self) -> Response {
        let status = self.status();
        tracing::debug!(status = status.as_u16(), error = %self, "streaming request refused");
        (status, format!("{self}\n")).into_response()
    }
}

/// The Pod `key` as the provider tracks it or, when it does not (its VM could not be made),
/// as the API server bound it here; neither: not on this node.
fn find(s: &Streaming, key: &PodKey) -> Result<(Pod, bool), StreamError> {
    if let Some(pod) = s.provider.get_pod(key) {
        return Ok((pod, true));
    }
    let bound = s.bound.as_ref().and_then(|b| crate::status::lookup(b, key));
    bound.map(|p| ((*p).clone(), false)).ok_or_else(|| StreamError::NoPod(key.clone()))
}

/// Why `pod` is not Running, with the status's reason and message when it has them (a
/// provider's failure is there: `Pending (ProviderFailed: …)`).
fn not_running(key: &PodKey, pod: &Pod, tracked: bool) -> StreamError {
    let status = pod.status.as_ref();
    let mut phase = status.and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into());
    if !tracked && phase == "Running" {
        phase = "not yet known to the provider".into();
    }
    if let Some(reason) = status.and_then(|s| s.reason.as_deref()) {
        let message = status.and_then(|s| s.message.as_deref()).unwrap_or_default();
        phase = format!("{phase} ({reason}: {message})");
    }
    StreamError::NotRunning { pod: key.clone(), phase }
}

/// The Pod `key`, when it is on this node and Running.
pub(super) fn running_pod(s: &Streaming, key: &PodKey) -> Result<Pod, StreamError> {
    let (pod, tracked) = find(s, key)?;
    running(key, pod, tracked)
}

fn running(key: &PodKey, pod: Pod, tracked: bool) -> Result<Pod, StreamError> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if !tracked || phase != Some("Running") {
        return Err(not_running(key, &pod, tracked));
    }
    Ok(pod)
}

/// The Pod `key`, when it is on this node, has `container` in its spec and is Running (the
/// container is checked first: a typo is answered 404 whatever the phase).
pub(super) fn running_container(s: &Streaming, key: &PodKey, container: &str) -> Result<Pod, StreamError> {
    let (pod, tracked) = find(s, key)?;
    let known = pod.spec.as_ref().is_some_and(|s| s.containers.iter().any(|c| c.name == container));
    if !known {
        return Err(StreamError::NoContainer { pod: key.clone(), container: container.into() });
    }
    running(key, pod, tracked)
}

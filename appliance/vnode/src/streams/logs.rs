//! `GET /containerLogs/{ns}/{pod}/{container}`: the Pod's console log, the kubelet's query
//! applied by the provider, streamed (chunked) as `text/plain`. A follow holds a session slot
//! until the client or the VM goes.

use super::checks::{running_container, RouteError};
use super::Streaming;
use crate::provider::PodKey;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use kstream::logs::LogQuery;

pub(super) async fn container_logs(
    State(s): State<Streaming>,
    Path((ns, pod, container)): Path<(String, String, String)>,
    query: Result<Query<LogQuery>, QueryRejection>,
) -> Result<Response, RouteError> {
    let Query(query) = query.map_err(|e| RouteError::Query(e.body_text()))?;
    if query.previous {
        return Err(RouteError::Previous);
    }
    let valid = query.validate().map_err(|e| RouteError::Query(foundation::error_chain(&e)))?;
    let key = PodKey::new(ns, pod);
    running_container(&s, &key, &container)?;
    let guard = s.sessions.open(&key)?;
    let body = s.streams.container_logs(&key, &valid).await?;
    // The slot is held by the body: freed when the stream ends or the client goes.
    let body = body.map(move |chunk| {
        let _held = &guard;
        chunk
    });
    Ok(([(CONTENT_TYPE, "text/plain; charset=utf-8")], Body::from_stream(body)).into_response())
}

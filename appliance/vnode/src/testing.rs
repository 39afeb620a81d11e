//! Test doubles for code that talks to the API server (feature `test-utils`, and this crate's
//! own tests): [`fake_api`], a `kube::Client` over an in-process service that records every
//! request and answers it from a closure. No socket, no TLS.

use std::sync::{Arc, Mutex};

use kube::client::Body;
use serde_json::Value;

/// Every request the fake saw: (method, path with its query, JSON body or `null`).
pub type Calls = Arc<Mutex<Vec<(String, String, Value)>>>;

/// A client whose requests are recorded in `calls` and answered by `answer(method, path
/// without the query, how many requests came before)` with (status, JSON body).
pub fn fake_api(
    calls: Calls,
    answer: impl Fn(&str, &str, usize) -> (u16, Value) + Send + Sync + 'static,
) -> kube::Client {
    let answer = Arc::new(answer);
    let svc = tower::service_fn(move |req: http::Request<Body>| {
        let (calls, answer) = (calls.clone(), answer.clone());
        async move {
            let method = req.method().to_string();
            let path = req.uri().path().to_string();
            let full = req.uri().path_and_query().map(|p| p.to_string()).unwrap_or_else(|| path.clone());
            let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let n = {
                let mut c = calls.lock().unwrap_or_else(|p| p.into_inner());
                c.push((method.clone(), full, body));
                c.len() - 1
            };
            let (code, json) = answer(&method, &path, n);
            let resp = http::Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&json).unwrap_or_default()))
                .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) })?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(resp)
        }
    });
    kube::Client::new(svc, "default")
}

/// The path of a recorded call, without its query.
pub fn path_of(full: &str) -> &str {
    full.split('?').next().unwrap_or(full)
}

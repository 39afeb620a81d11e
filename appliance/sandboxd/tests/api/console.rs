//! `GET /v1/sandboxes/{id}/console`: the VM's stamped console file served with a container-log
//! query, over the fake driver (the test writes the console file as the drain would).

use super::*;
use std::time::SystemTime;
use vmm::console::CappedLog;

fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// A claimed sandbox whose console holds `line-1` … `line-3`, line `i` stamped at second `i`.
async fn with_console() -> (H, String, String, CappedLog, std::path::PathBuf) {
    let h = start(&[("base", 1)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let (id, token) = (c["id"].as_str().expect("id").to_string(), c["token"].as_str().expect("token").to_string());
    let claim = h.node.sandbox(&id).expect("claim");
    let vm = h.node.vm_for(&claim).await.expect("vm");
    std::fs::create_dir_all(vm.console_log.parent().expect("dir")).expect("vm dir");
    let mut log = CappedLog::open(&vm.console_log, vmm::console::DEFAULT_CONSOLE_CAP).expect("log");
    for i in 1..=3 {
        log.write_at(at(i), format!("line-{i}\n").as_bytes()).expect("write");
    }
    (h, id, token, log, vm.dir)
}

#[tokio::test]
async fn the_console_is_served_with_the_query_applied() {
    let (h, id, token, _log, _) = with_console().await;
    let get = |q: &str| {
        let path = format!("/v1/sandboxes/{id}/console{q}");
        let (h, token) = (&h, token.clone());
        async move { h.call("GET", &path, Some(&token), None).await }
    };
    assert_eq!(get("").await, (StatusCode::OK, json!("line-1\nline-2\nline-3\n")));
    assert_eq!(get("?tailLines=2").await, (StatusCode::OK, json!("line-2\nline-3\n")));
    assert_eq!(get("?tailLines=0").await, (StatusCode::OK, json!("")));
    assert_eq!(get("?sinceTime=1970-01-01T00:00:02Z").await, (StatusCode::OK, json!("line-2\nline-3\n")));
    assert_eq!(get("?limitBytes=9").await, (StatusCode::OK, json!("line-1\nli")));
    assert_eq!(
        get("?timestamps=true&tailLines=1").await,
        (StatusCode::OK, json!("1970-01-01T00:00:03.000000000Z line-3\n"))
    );
    // The root token reads it too.
    let (s, _) = h.call("GET", &format!("/v1/sandboxes/{id}/console"), Some(ROOT), None).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn a_bad_query_is_400_and_an_unknown_sandbox_404() {
    let (h, id, token, _log, _) = with_console().await;
    for (q, says) in [
        ("tailLines=-1", "tailLines must not be negative"),
        ("tailLines=many", "invalid console query"),
        ("limitBytes=0", "limitBytes must be greater than 0"),
        ("sinceSeconds=5&sinceTime=1970-01-01T00:00:02Z", "at most one of sinceTime or sinceSeconds"),
        ("sinceTime=yesterday", "sinceTime \"yesterday\""),
        ("follow=yes", "invalid console query"),
        ("previous=true", "no previous instance"),
    ] {
        let (s, v) = h.call("GET", &format!("/v1/sandboxes/{id}/console?{q}"), Some(&token), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{q}: {v}");
        let msg = v["error"].as_str().unwrap_or_else(|| panic!("{q}: an ErrorBody, got {v}"));
        assert!(msg.contains(says), "{q}: {msg}");
    }
    let (s, v) = h.call("GET", "/v1/sandboxes/sb_ffffffffffffffff/console", Some(ROOT), None).await;
    assert_eq!((s, v), (StatusCode::NOT_FOUND, json!({"error": "sandbox not found"})));
}

#[tokio::test]
async fn following_streams_new_lines_and_ends_with_the_vm() {
    use futures::StreamExt as _;
    let (h, id, token, mut log, vm_dir) = with_console().await;
    let req = Request::builder()
        .uri(format!("/v1/sandboxes/{id}/console?follow=true&tailLines=1"))
        .header("authorization", format!("Bearer {token}"))
        .body(Body::empty())
        .expect("request");
    let resp = h.app.clone().oneshot(req).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/plain; charset=utf-8");
    let mut body = resp.into_body().into_data_stream();
    let mut got = Vec::new();
    let mut until = async |got: &mut Vec<u8>, want: &[u8]| {
        while !got.ends_with(want) {
            let chunk = tokio::time::timeout(Duration::from_secs(10), body.next()).await.expect("in time");
            got.extend_from_slice(&chunk.expect("open").expect("chunk"));
        }
    };
    until(&mut got, b"line-3\n").await;
    log.write_at(at(4), b"line-4\n").expect("write");
    until(&mut got, b"line-4\n").await;
    assert_eq!(got, b"line-3\nline-4\n");
    // The VM's files go (what destroying it does): the body ends.
    drop(log);
    std::fs::remove_dir_all(&vm_dir).expect("remove");
    let end = tokio::time::timeout(Duration::from_secs(10), body.next()).await.expect("ends in time");
    assert!(end.is_none(), "{end:?}");
}

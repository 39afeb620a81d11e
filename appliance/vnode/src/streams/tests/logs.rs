use super::*;

#[tokio::test]
async fn logs_are_refused_before_the_provider_is_asked() {
    let srv = Server::start(pods(), FakeStreams::default(), StreamLimits::default()).await;
    for (path, want, says) in [
        ("/containerLogs/ns/gone/main", 404, "pod ns/gone is not on this node"),
        ("/containerLogs/ns/vm/sidecar", 404, "has no container \"sidecar\""),
        ("/containerLogs/ns/booting/main", 400, "pod ns/booting is Pending, not Running"),
        ("/containerLogs/ns/vm/main?previous=true", 400, "no previous instance"),
        ("/containerLogs/ns/vm/main?tailLines=-1", 400, "bad query"),
        ("/containerLogs/ns/vm/main?follow=maybe", 400, "bad query"),
    ] {
        let (status, _, body) = request(srv.addr, "GET", path).await;
        assert_eq!(status, want, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }
    assert!(srv.streams.queries.lock().expect("lock").is_empty(), "the provider was never asked");
}

#[tokio::test]
async fn logs_stream_as_chunked_text_with_the_query_applied_by_the_provider() {
    let streams = FakeStreams::default();
    streams.logs.lock().expect("lock").push(vec!["booted\n", "ready\n"]);
    let srv = Server::start(pods(), streams, StreamLimits::default()).await;
    let (status, headers, body) =
        request(srv.addr, "GET", "/containerLogs/ns/vm/main?tailLines=5&timestamps=true").await;
    assert_eq!((status, body.as_str()), (200, "booted\nready\n"));
    assert_eq!(headers["content-type"], "text/plain; charset=utf-8");
    assert_eq!(headers["transfer-encoding"], "chunked");
    let q = srv.streams.queries.lock().expect("lock")[0].clone();
    assert_eq!((q.follow, q.timestamps, q.tail_lines), (false, true, Some(5)));
}

#[tokio::test]
async fn the_per_pod_cap_answers_429_until_a_session_ends() {
    let limits = StreamLimits { per_pod: 1, ..StreamLimits::default() };
    let srv = Server::start(pods(), FakeStreams::default(), limits).await;
    // A follow holds the Pod's one slot while its body streams.
    let follow = {
        let addr = srv.addr;
        tokio::spawn(async move { request(addr, "GET", "/containerLogs/ns/vm/main?follow=true").await })
    };
    for _ in 0..200 {
        if !srv.streams.held.lock().expect("lock").is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (status, _, body) = request(srv.addr, "GET", "/containerLogs/ns/vm/main").await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("ns/vm already has 1 open streaming sessions"), "{body}");
    // The VM goes away: the follow ends and frees the slot.
    let tx = srv.streams.held.lock().expect("lock").pop().expect("held");
    tx.send(Bytes::from_static(b"last\n")).await.expect("send");
    drop(tx);
    let (status, _, body) = follow.await.expect("join");
    assert_eq!((status, body.as_str()), (200, "last\n"));
    assert_eq!(request(srv.addr, "GET", "/containerLogs/ns/vm/main").await.0, 200);
}

#[tokio::test]
async fn a_bound_pod_the_provider_does_not_track_is_not_running_with_its_status() {
    let (store, mut writer) = kube::runtime::reflector::store();
    let mut failed = FakeProvider::default().with("ns", "novm", "Pending").get_pods().remove(0);
    if let Some(s) = failed.status.as_mut() {
        s.reason = Some("ProviderFailed".into());
        s.message = Some("annotation sandbox.cocoonstack.io/template is missing".into());
    }
    writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(failed));
    let srv = Server::start_bound(pods(), FakeStreams::default(), StreamLimits::default(), Some(store)).await;
    for (path, want, says) in [
        (
            "/containerLogs/ns/novm/main",
            400,
            "pod ns/novm is Pending (ProviderFailed: annotation sandbox.cocoonstack.io/template is missing), not Running",
        ),
        ("/containerLogs/ns/novm/sidecar", 404, "has no container \"sidecar\""),
        ("/exec/ns/novm/main?command=true&stdout=1", 400, "not Running"),
        ("/portForward/ns/novm", 400, "not Running"),
        ("/containerLogs/ns/gone/main", 404, "pod ns/gone is not on this node"),
    ] {
        let (status, _, body) = request(srv.addr, "GET", path).await;
        assert_eq!(status, want, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }
}

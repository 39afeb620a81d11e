use super::*;
use crate::test_utils::{ClaimMode, FakeSandboxd};

fn spec(template: &str) -> ClaimSpec {
    ClaimSpec { template: template.into(), net: String::new(), size: "small".into(), ttl_seconds: 86_400 }
}

#[test]
fn urls_are_validated() {
    assert!(SandboxdClient::new("http://127.0.0.1:7777", None).is_ok());
    assert_eq!(SandboxdClient::new("http://127.0.0.1:7777/", None).unwrap().host_port(), "127.0.0.1:7777");
    assert_eq!(SandboxdClient::new("http://sandboxd", None).unwrap().host_port(), "sandboxd:80");
    for bad in ["127.0.0.1:7777", "https://127.0.0.1:7777", "ftp://x", "not a url"] {
        assert!(matches!(SandboxdClient::new(bad, None), Err(SandboxdError::Url { .. })), "{bad} accepted");
    }
    let e = SandboxdClient::new("https://127.0.0.1:7777", None).unwrap_err();
    assert!(e.to_string().contains("--sandboxd-ca-file"), "{e}");
    let e = SandboxdClient::with_ca("https://127.0.0.1:7777", None, Some(std::path::Path::new("/nonexistent")))
        .unwrap_err();
    assert!(matches!(e, SandboxdError::Trust(_)), "{e:?}");
    assert_eq!(query_escape("ns/name"), "ns/name");
    assert_eq!(query_escape("a b&c"), "a%20b%26c");
}

#[tokio::test]
async fn claim_sends_the_request_shape_with_no_redirect_and_returns_the_grant() {
    let fake = FakeSandboxd::start(Some("node-secret")).await;
    let c = SandboxdClient::new(&fake.url(), Some("node-secret".into())).unwrap();
    let g = c.claim(&spec("rt:24.04"), "default/sb-1").await.unwrap();
    assert!(g.id.starts_with("sb_") && !g.token.is_empty(), "{g:?}");
    assert!(g.deadline_time().is_some());
    assert_eq!(g.owner_addr, fake.owner_addr());
    assert!(!format!("{g:?}").contains(&g.token), "the token leaked into Debug");
    let body = fake.last_claim_body().unwrap();
    assert_eq!(
        body,
        serde_json::json!({"template": "rt:24.04", "size": "small", "ttl_seconds": 86400, "claim_ref": "default/sb-1",
            "no_redirect": true}),
        "a Pod bound here is never redirected to a peer"
    );
    // Without the node token the fake answers 401 with sandboxd's error text.
    let anon = SandboxdClient::new(&fake.url(), None).unwrap();
    match anon.claim(&spec("rt"), "default/x").await {
        Err(e @ SandboxdError::Status { status: 401, .. }) => {
            assert!(e.to_string().contains("missing bearer token"))
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn https_is_verified_against_the_ca_file() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    // The box certificate names the hostname only: trusted as the exact certificate.
    httpd::tls::ensure_self_signed(&cert, &key, &["box".to_string()]).unwrap();
    let server = httpd::tls::server_config_from_files(&cert, &key, httpd::tls::ALPN_HTTP1).unwrap();
    let fake = FakeSandboxd::start_tls(Some("node-secret"), server).await;
    assert!(fake.url().starts_with("https://127.0.0.1:"));
    let c = SandboxdClient::with_ca(&fake.url(), Some("node-secret".into()), Some(&cert)).unwrap();
    assert_eq!(c.info().await.unwrap().claimed, 0);
    let g = c.claim(&spec("rt"), "ns/a").await.unwrap();
    c.release(&g.id, &g.token).await.unwrap();
    // Another certificate in the CA file: the handshake fails, nothing is sent.
    let other = dir.path().join("other.pem");
    std::fs::write(&other, httpd::tls::self_signed(&["127.0.0.1".to_string()]).unwrap().cert_pem).unwrap();
    let c = SandboxdClient::with_ca(&fake.url(), Some("node-secret".into()), Some(&other)).unwrap();
    assert!(matches!(c.info().await, Err(SandboxdError::Transport { .. })));
    // Plain HTTP to a TLS port fails too (no downgrade).
    let plain = SandboxdClient::new(&fake.url().replace("https", "http"), None).unwrap();
    assert!(plain.info().await.is_err());
}

#[tokio::test]
async fn no_capacity_is_typed_for_429_and_for_a_redirect() {
    let fake = FakeSandboxd::start(None).await;
    let c = SandboxdClient::new(&fake.url(), None).unwrap();
    fake.set_claim_mode(ClaimMode::TooMany);
    match c.claim(&spec("rt"), "ns/a").await {
        Err(e @ SandboxdError::NoCapacity { .. }) => assert!(e.to_string().contains("no warm VM"), "{e}"),
        other => panic!("{other:?}"),
    }
    fake.set_claim_mode(ClaimMode::Redirect);
    match c.claim(&spec("rt"), "ns/a").await {
        Err(e @ SandboxdError::NoCapacity { .. }) => assert!(e.to_string().contains("10.0.0.9:7777"), "{e}"),
        other => panic!("{other:?}"),
    }
    fake.set_claim_mode(ClaimMode::Fail(400, "bad size \"huge\""));
    match c.claim(&spec("rt"), "ns/a").await {
        Err(e @ SandboxdError::Status { status: 400, .. }) => {
            assert!(e.to_string().contains("bad size \"huge\""), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn net_egress_passes_through_and_sandboxds_refusal_is_shown() {
    let fake = FakeSandboxd::start(None).await;
    let c = SandboxdClient::new(&fake.url(), None).unwrap();
    let egress = ClaimSpec { net: "egress".into(), ..spec("rt") };
    c.claim(&egress, "ns/e").await.unwrap();
    assert_eq!(fake.last_claim_body().unwrap()["net"], "egress", "the lane goes to sandboxd as asked");
    // A node without an uplink refuses it; the provider shows sandboxd's words (key and fix).
    fake.set_claim_mode(ClaimMode::Fail(409, "net egress is not available on this node: set network.uplink"));
    match c.claim(&egress, "ns/e").await {
        Err(e @ SandboxdError::Status { status: 409, .. }) => {
            assert!(e.to_string().contains("network.uplink"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn release_takes_the_claim_token_and_404_is_success() {
    let fake = FakeSandboxd::start(Some("node-secret")).await;
    let c = SandboxdClient::new(&fake.url(), Some("node-secret".into())).unwrap();
    let g = c.claim(&spec("rt"), "ns/a").await.unwrap();
    // A wrong token looks like an unknown id (404) and therefore "gone" — but the VM stays.
    c.release(&g.id, "wrong").await.unwrap();
    assert!(fake.holds(&g.id));
    c.release(&g.id, &g.token).await.unwrap();
    assert!(!fake.holds(&g.id));
    c.release(&g.id, &g.token).await.unwrap();
    fake.set_release_fails(true);
    let g2 = c.claim(&spec("rt"), "ns/b").await.unwrap();
    assert!(matches!(c.release(&g2.id, &g2.token).await, Err(SandboxdError::Status { status: 500, .. })));
    assert!(fake.holds(&g2.id));
}

#[tokio::test]
async fn list_filters_by_claim_ref_and_a_failure_is_an_error() {
    let fake = FakeSandboxd::start(None).await;
    let c = SandboxdClient::new(&fake.url(), None).unwrap();
    let a = c.claim(&spec("rt"), "ns/a").await.unwrap();
    let b = c.claim(&spec("rt"), "ns/b").await.unwrap();
    let all = c.list(None).await.unwrap();
    assert_eq!(all.len(), 2);
    let only_b = c.list(Some("ns/b")).await.unwrap();
    assert_eq!(only_b.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [b.id.as_str()]);
    assert_eq!(only_b[0].claim_ref.as_deref(), Some("ns/b"));
    assert!(only_b[0].deadline_time().is_some());
    assert_ne!(a.id, b.id);
    fake.set_list_fails(true);
    assert!(matches!(c.list(None).await, Err(SandboxdError::Status { status: 500, .. })));
    let info = {
        fake.set_list_fails(false);
        c.info().await.unwrap()
    };
    assert_eq!(info.claimed, 2);
}

#[tokio::test]
async fn stats_carry_the_measured_fields_and_404_is_none() {
    let fake = FakeSandboxd::start(Some("node-token")).await;
    let c = SandboxdClient::new(&fake.url(), Some("node-token".into())).unwrap();
    assert!(c.stats("sb_none").await.unwrap().is_none());
    let grant = c.claim(&spec("rt"), "ns/a").await.unwrap();
    let s = c.stats(&grant.id).await.unwrap().unwrap();
    assert_eq!((s.cpu_usage_nanos, s.memory_working_set_bytes), (None, None), "not measured");
    fake.set_usage(&grant.id, 5, 6);
    let s = c.stats(&grant.id).await.unwrap().unwrap();
    assert_eq!((s.cpu_usage_nanos, s.memory_working_set_bytes), (Some(5), Some(6)));
    let wrong = SandboxdClient::new(&fake.url(), Some("other".into())).unwrap();
    assert!(matches!(wrong.stats(&grant.id).await, Err(SandboxdError::Status { status: 401, .. })));
}

#[tokio::test]
async fn get_returns_the_token_only_to_the_root_token() {
    let fake = FakeSandboxd::start(Some("node-secret")).await;
    let c = SandboxdClient::new(&fake.url(), Some("node-secret".into())).unwrap();
    let g = c.claim(&spec("rt"), "ns/a").await.unwrap();
    let (row, token) = c.get(&g.id).await.unwrap().unwrap();
    assert_eq!((row.id.as_str(), row.claim_ref.as_deref()), (g.id.as_str(), Some("ns/a")));
    assert_eq!(token.as_deref(), Some(g.token.as_str()));
    assert!(c.get("sb_ffffffffffffffff").await.unwrap().is_none());
    let open = FakeSandboxd::start(None).await;
    let c = SandboxdClient::new(&open.url(), None).unwrap();
    let g = c.claim(&spec("rt"), "ns/a").await.unwrap();
    assert_eq!(c.get(&g.id).await.unwrap().unwrap().1, None, "a token without the root token");
}

#[tokio::test]
async fn console_streams_past_the_call_bound_with_the_query_sent() {
    use futures::StreamExt as _;
    let fake = FakeSandboxd::start(Some("node-secret")).await;
    let c =
        SandboxdClient::new(&fake.url(), Some("node-secret".into())).unwrap().with_timeout(Duration::from_millis(300));
    let g = c.claim(&spec("rt"), "ns/a").await.unwrap();
    let q = LogQuery {
        follow: true,
        tail_lines: Some(10),
        since_time: Some("2024-01-02T03:04:05Z".into()),
        ..LogQuery::default()
    };
    let body = c.console(&g.id, &g.token, &q).await.unwrap();
    // The body outlives the per-call bound: the last line comes 500 ms after the head.
    let chunks: Vec<io::Result<Bytes>> = body.collect().await;
    let text: String = chunks.into_iter().map(|c| String::from_utf8(c.unwrap().to_vec()).unwrap()).collect();
    assert_eq!(
        text,
        "query follow=true&previous=false&timestamps=false&tailLines=10&sinceTime=2024-01-02T03%3A04%3A05Z\n\
         line-1\nline-2\n"
    );
    // sandboxd's refusals keep its words.
    let bad = LogQuery { tail_lines: Some(-1), ..LogQuery::default() };
    match c.console(&g.id, &g.token, &bad).await.map(|_| ()) {
        Err(e @ SandboxdError::Status { status: 400, .. }) => assert!(e.to_string().contains("tailLines"), "{e}"),
        other => panic!("{other:?}"),
    }
    match c.console("sb_ffffffffffffffff", "node-secret", &LogQuery::default()).await.map(|_| ()) {
        Err(SandboxdError::Status { status: 404, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn oversized_listing_and_silent_server_are_bounded() {
    let fake = FakeSandboxd::start(None).await;
    let c = SandboxdClient::new(&fake.url(), None).unwrap();
    fake.set_list_padding(LIST_LIMIT + 1);
    assert!(matches!(c.list(None).await, Err(SandboxdError::TooLarge { .. })));
    // A listener that accepts and never answers: the call ends at the timeout.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let c = SandboxdClient::new(&format!("http://{addr}"), None).unwrap().with_timeout(Duration::from_millis(300));
    let started = std::time::Instant::now();
    assert!(matches!(c.info().await, Err(SandboxdError::Timeout { .. })));
    assert!(started.elapsed() < Duration::from_secs(5));
}

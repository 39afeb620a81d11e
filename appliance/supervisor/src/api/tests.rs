//! The router driven with `oneshot`, no socket.

use std::collections::BTreeMap;
use std::sync::Mutex;

use axum::http::Method;
use tokio::io::AsyncReadExt as _;
use tower::ServiceExt as _;

use super::*;
use crate::health::Health;
use crate::logs::{ServiceLog, Stream};
use crate::update::{BundleStream, GateVerdict, NoUpdates, UpdateOutcome, UpdateState, UpdateStatus};

/// Records the bundle bytes it is given; answers per `mode`.
#[derive(Default)]
struct FakeUpdates {
    got: Mutex<Vec<u8>>,
    mode: Mutex<&'static str>,
}

#[async_trait::async_trait]
impl UpdateControl for FakeUpdates {
    async fn status(&self) -> UpdateStatus {
        UpdateStatus { state: UpdateState::Confirmed, slot: Some("a".into()), ..UpdateStatus::unavailable("") }
    }
    async fn apply(&self, mut bundle: BundleStream) -> Result<UpdateOutcome, UpdateError> {
        let mut buf = Vec::new();
        bundle
            .read_to_end(&mut buf)
            .await
            .map_err(|e| UpdateError::Internal { message: "read".into(), source: Some(Box::new(e)) })?;
        *self.got.lock().unwrap() = buf;
        let mode = *self.mode.lock().unwrap();
        let status = self.status().await;
        match mode {
            "bad" => Err(UpdateError::BadBundle("signature does not verify".into())),
            "busy" => Err(UpdateError::Busy),
            "reboot" => Ok(UpdateOutcome { message: "armed b".into(), reboot: true, status }),
            _ => Ok(UpdateOutcome { message: "armed b".into(), reboot: false, status }),
        }
    }
    async fn rollback(&self) -> Result<UpdateOutcome, UpdateError> {
        Err(UpdateError::Conflict("the other slot holds no image".into()))
    }
    async fn on_health(&self, _: &Health) -> GateVerdict {
        GateVerdict::Continue
    }
}

struct Rig {
    state: ApiState,
    commands: mpsc::Receiver<Command>,
    _dir: tempfile::TempDir,
}

const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn rig(update: Arc<dyn UpdateControl>) -> Rig {
    let log = Arc::new(ServiceLog::memory("sandboxd"));
    for i in 0..5 {
        log.push(Stream::Stdout, &format!("line {i}"));
    }
    let logs = BTreeMap::from([("sandboxd".to_string(), log)]);
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("secrets/sandboxd-token");
    foundation::write_secret(&token_file, format!("{TOKEN}\n").as_bytes()).unwrap();
    let tls = vec![crate::secrets::TlsCert {
        fingerprint: "AB:CD".into(),
        certificate: "/state/tls/cert.pem".into(),
        minted: true,
        surfaces: vec!["api".into(), "sandboxd".into()],
    }];
    let config = serde_json::json!({"config": {"a": 1, "sandboxd": {"api_token_file": token_file}}});
    let shared = Arc::new(Shared::new(logs, config, Vec::new(), "/state".into()).with_secrets(Some(token_file), tls));
    shared.tick();
    let (tx, rx) = mpsc::channel(4);
    Rig { state: ApiState { shared, update, commands: tx, upload: UploadLimits::default() }, commands: rx, _dir: dir }
}

async fn call(
    router: Router,
    method: Method,
    uri: &str,
    body: Body,
    token: Option<&str>,
) -> (StatusCode, serde_json::Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let resp = router.oneshot(req.body(body).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::Null), text)
}

async fn get_json(r: &Rig, uri: &str) -> (StatusCode, serde_json::Value) {
    let (s, j, _) = call(app(r.state.clone()), Method::GET, uri, Body::empty(), None).await;
    (s, j)
}

#[tokio::test]
async fn status_logs_config_healthz() {
    let r = rig(Arc::new(NoUpdates));
    let (s, j) = get_json(&r, "/v1/status").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(j["update"]["state"], "unavailable");
    assert_eq!(j["supervisor"]["state_dir"], "/state");
    assert_eq!(j["health"]["ready"], false);
    let (s, j) = get_json(&r, "/v1/logs/sandboxd?tail=2").await;
    assert_eq!(s, StatusCode::OK);
    let lines: Vec<&str> = j["lines"].as_array().unwrap().iter().map(|l| l["line"].as_str().unwrap()).collect();
    assert_eq!(lines, ["line 3", "line 4"]);
    assert_eq!(j["lines"][0]["stream"], "stdout");
    let (s, j) = get_json(&r, "/v1/logs/sandboxd").await;
    assert_eq!((s, j["lines"].as_array().unwrap().len()), (StatusCode::OK, 5));
    let (s, j) = get_json(&r, "/v1/logs/nope").await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_service")));
    assert!(j["error"].as_str().unwrap().contains("nope"));
    let (s, j) = get_json(&r, "/v1/logs/sandboxd?tail=x").await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")));
    let (s, j) = get_json(&r, "/v1/config").await;
    assert_eq!((s, &j["config"]["a"]), (StatusCode::OK, &serde_json::json!(1)));
    let (s, _, text) = call(app(r.state.clone()), Method::GET, "/healthz", Body::empty(), None).await;
    assert_eq!((s, text.as_str()), (StatusCode::OK, "ok\n"));
    let (s, j) = get_json(&r, "/v1/nothing").await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let (s, _, text) = call(app(r.state.clone()), Method::GET, "/metrics", Body::empty(), None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(text.contains("chrysalis_update_state{state=\"unavailable\"} 1.0"), "{text}");
}

#[tokio::test]
async fn no_updates_is_a_typed_503() {
    let r = rig(Arc::new(NoUpdates));
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from("bundle"), None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(j, serde_json::json!({"error": crate::update::UNAVAILABLE, "kind": "updates_unavailable"}));
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/rollback", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("updates_unavailable")));
    let (s, j) = get_json(&r, "/v1/update").await;
    assert_eq!((s, j["state"].as_str()), (StatusCode::OK, Some("unavailable")));
}

#[tokio::test]
async fn apply_streams_the_body_and_maps_errors() {
    let fake = Arc::new(FakeUpdates::default());
    let mut r = rig(fake.clone());
    let big = vec![7u8; 3 << 20]; // above axum's default 2 MiB body limit
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from(big.clone()), None).await;
    assert_eq!((s, j["message"].as_str()), (StatusCode::OK, Some("armed b")), "{j}");
    assert_eq!(*fake.got.lock().unwrap(), big);
    *fake.mode.lock().unwrap() = "bad";
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from("x"), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::UNPROCESSABLE_ENTITY, Some("bad_bundle")));
    assert!(j["error"].as_str().unwrap().contains("signature"), "{j}");
    *fake.mode.lock().unwrap() = "busy";
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from("x"), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::CONFLICT, Some("update_busy")));
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/update/rollback", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::CONFLICT, Some("update_conflict")));
    // An outcome asking for a reboot goes to the main loop.
    *fake.mode.lock().unwrap() = "reboot";
    let app = app(r.state.clone());
    let req = tokio::spawn(call(app, Method::POST, "/v1/update/apply", Body::from("x"), None));
    let Some(Command::Reboot { reason, reply }) = r.commands.recv().await else { panic!("no reboot command") };
    assert!(reason.contains("armed b"), "{reason}");
    reply.send(Ok(())).unwrap();
    assert_eq!(req.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn reboot_is_accepted_or_refused_by_the_main_loop() {
    let mut r = rig(Arc::new(NoUpdates));
    let app1 = app(r.state.clone());
    let req = tokio::spawn(call(app1, Method::POST, "/v1/reboot", Body::empty(), None));
    let Some(Command::Reboot { reply, .. }) = r.commands.recv().await else { panic!("no command") };
    reply.send(Err("not running as the appliance's service".into())).unwrap();
    let (s, j, _) = req.await.unwrap();
    assert_eq!((s, j["kind"].as_str()), (StatusCode::CONFLICT, Some("reboot_refused")));
    let app2 = app(r.state.clone());
    let req = tokio::spawn(call(app2, Method::POST, "/v1/reboot", Body::empty(), None));
    let Some(Command::Reboot { reply, .. }) = r.commands.recv().await else { panic!("no command") };
    reply.send(Ok(())).unwrap();
    let (s, j, _) = req.await.unwrap();
    assert_eq!((s, j), (StatusCode::ACCEPTED, serde_json::json!({"rebooting": true})));
    drop(r.commands);
    let (s, j, _) = call(app(r.state.clone()), Method::POST, "/v1/reboot", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("shutting_down")));
}

#[tokio::test]
async fn the_tcp_api_needs_the_token() {
    let r = rig(Arc::new(NoUpdates));
    let tcp = with_token(app(r.state.clone()), "s3cret".into());
    let (s, j, _) = call(tcp.clone(), Method::GET, "/v1/status", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (s, _, _) = call(tcp.clone(), Method::GET, "/v1/status", Body::empty(), Some("s3cre")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(tcp.clone(), Method::GET, "/metrics", Body::empty(), Some("wrong")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(tcp, Method::GET, "/v1/status", Body::empty(), Some("s3cret")).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = call(metrics_app(r.state.clone()), Method::GET, "/v1/status", Body::empty(), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "the metrics listener serves only /metrics");
    // An empty token (an emptied token file) opens nothing.
    let empty = with_token(app(r.state.clone()), String::new());
    for h in ["Bearer ", "Bearer", "bearer \t"] {
        let req = Request::builder().uri("/v1/status").header(header::AUTHORIZATION, h).body(Body::empty()).unwrap();
        assert_eq!(empty.clone().oneshot(req).await.unwrap().status(), StatusCode::UNAUTHORIZED, "{h:?}");
    }
    let (s, _, _) = call(empty, Method::GET, "/v1/status", Body::empty(), Some("")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn sandboxd_token_on_the_socket_and_behind_the_bearer_token_never_in_config_or_status() {
    let r = rig(Arc::new(NoUpdates));
    // The Unix socket: file permissions are the access control.
    let (s, j, _) = call(app(r.state.clone()), Method::GET, "/v1/tokens/sandboxd", Body::empty(), None).await;
    assert_eq!(s, StatusCode::OK, "{j}");
    assert_eq!((j["name"].as_str(), j["token"].as_str()), (Some("sandboxd"), Some(TOKEN)));
    assert!(j["file"].as_str().unwrap().ends_with("secrets/sandboxd-token"));
    let resp = app(r.state.clone())
        .oneshot(Request::builder().uri("/v1/tokens/sandboxd").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.headers().get(header::CACHE_CONTROL).unwrap(), "no-store");
    let (s, j, _) = call(app(r.state.clone()), Method::GET, "/v1/tokens/api", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_token")));
    // TCP: 401 without or with a wrong bearer token, the token with the right one.
    let tcp = with_token(app(r.state.clone()), "admin".into());
    for bad in [None, Some("wrong"), Some(TOKEN)] {
        let (s, j, text) = call(tcp.clone(), Method::GET, "/v1/tokens/sandboxd", Body::empty(), bad).await;
        assert_eq!((s, j["kind"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{bad:?}");
        assert!(!text.contains(TOKEN));
    }
    let (s, j, _) = call(tcp.clone(), Method::GET, "/v1/tokens/sandboxd", Body::empty(), Some("admin")).await;
    assert_eq!((s, j["token"].as_str()), (StatusCode::OK, Some(TOKEN)));
    // Status and config name the file and the fingerprint, never the token.
    for uri in ["/v1/status", "/v1/config"] {
        let (s, j, text) = call(tcp.clone(), Method::GET, uri, Body::empty(), Some("admin")).await;
        assert_eq!(s, StatusCode::OK, "{uri}");
        assert!(!text.contains(TOKEN), "{uri} shows the token: {text}");
        if uri == "/v1/status" {
            assert_eq!(j["tls"][0]["fingerprint"], "AB:CD");
            assert_eq!(j["tls"][0]["surfaces"], serde_json::json!(["api", "sandboxd"]));
        }
    }
    // An unreadable token file is a typed 500, not an empty token.
    std::fs::remove_file(r.state.shared.sandboxd_token_file.as_ref().unwrap()).unwrap();
    let (s, j, _) = call(app(r.state.clone()), Method::GET, "/v1/tokens/sandboxd", Body::empty(), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::INTERNAL_SERVER_ERROR, Some("token_unreadable")));
}

#[tokio::test]
async fn the_bundle_upload_has_a_size_cap_and_an_idle_timeout() {
    use futures::StreamExt as _;
    let fake = Arc::new(FakeUpdates::default());
    let mut r = rig(fake.clone());
    r.state.upload = UploadLimits { max_bytes: 1 << 20, idle: Duration::from_millis(300) };
    // At the cap: accepted whole.
    let (s, _, _) =
        call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from(vec![1u8; 1 << 20]), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(fake.got.lock().unwrap().len(), 1 << 20);
    // One byte over: 413, typed.
    let (s, j, _) =
        call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from(vec![1u8; (1 << 20) + 1]), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("bundle_too_large")), "{j}");
    // A slow but steady upload (a chunk every 100 ms, 1.5 s in all) is not cut off: no total deadline.
    let steady = futures::stream::iter(0..15).then(|_| async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"chunk"))
    });
    let (s, _, _) = call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from_stream(steady), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(fake.got.lock().unwrap().len(), 75);
    // One chunk, then silence: 408 after the idle limit.
    let stalled = futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"head"))])
        .chain(futures::stream::pending());
    let started = std::time::Instant::now();
    let (s, j, _) =
        call(app(r.state.clone()), Method::POST, "/v1/update/apply", Body::from_stream(stalled), None).await;
    assert_eq!((s, j["kind"].as_str()), (StatusCode::REQUEST_TIMEOUT, Some("upload_idle")), "{j}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(r.commands.try_recv().is_err(), "a cut-off upload asks for nothing");
}

#[tokio::test]
async fn bearer_tokens_parse() {
    let mut h = HeaderMap::new();
    assert!(!bearer_ok(&h, "t"));
    h.insert(header::AUTHORIZATION, "bearer t".parse().unwrap());
    assert!(bearer_ok(&h, "t"));
    h.insert(header::AUTHORIZATION, "Basic t".parse().unwrap());
    assert!(!bearer_ok(&h, "t"));
}

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
}

fn rig(update: Arc<dyn UpdateControl>) -> Rig {
    let log = Arc::new(ServiceLog::memory("sandboxd"));
    for i in 0..5 {
        log.push(Stream::Stdout, &format!("line {i}"));
    }
    let logs = BTreeMap::from([("sandboxd".to_string(), log)]);
    let shared = Arc::new(Shared::new(logs, serde_json::json!({"config": {"a": 1}}), Vec::new(), "/state".into()));
    shared.tick();
    let (tx, rx) = mpsc::channel(4);
    Rig { state: ApiState { shared, update, commands: tx }, commands: rx }
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

//! HTTP-level tests of sandboxd over the fake driver: the router driven with `oneshot`, and
//! relays over a loopback socket with the same `serve` the binary uses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use sandboxd::config::PoolConfig;
use sandboxd::node::{Node, NodeOptions};
use sandboxd::test_utils::{fake_catalog, FakeDriver};
use serde_json::{json, Value};
use tempfile::TempDir;
use tower::ServiceExt as _;
use vmm::Driver as _;

struct H {
    dir: TempDir,
    driver: Arc<FakeDriver>,
    node: Arc<Node>,
    app: Router,
    token: Option<String>,
}

/// A root token for the tests that need one (32+ characters, like the daemon demands).
const ROOT: &str = "root-token-0123456789abcdef012345";

fn pool(template: &str, warm: usize) -> PoolConfig {
    PoolConfig::warm(template, warm)
}

fn opts(dir: &TempDir, pools: &[(&str, usize)], token: Option<&str>) -> NodeOptions {
    let mut o = NodeOptions::new(dir.path().join("data"), fake_catalog());
    o.pools = pools.iter().map(|(t, w)| pool(t, *w)).collect();
    o.api_token = token.map(str::to_string);
    o.advertise_addr = "10.0.0.1:7777".into();
    o.timing = sandboxd::test_utils::fast_timing();
    o
}

async fn start(pools: &[(&str, usize)], token: Option<&str>) -> H {
    start_with(pools, token, |_| {}).await
}

/// [`start`] with the options adjusted first (limits, timings).
async fn start_with(pools: &[(&str, usize)], token: Option<&str>, adjust: impl FnOnce(&mut NodeOptions)) -> H {
    let dir = tempfile::tempdir().expect("tempdir");
    let driver = FakeDriver::new(dir.path());
    let mut o = opts(&dir, pools, token);
    adjust(&mut o);
    let node = Node::start(driver.clone(), o).await.expect("start");
    let app = sandboxd::http::app(node.clone());
    H { dir, driver, node, app, token: token.map(str::to_string) }
}

impl H {
    /// A second node over the same data dir and driver (a simulated restart).
    async fn restart(&self, pools: &[(&str, usize)]) -> (Arc<Node>, Router) {
        self.node.shutdown();
        let node =
            Node::start(self.driver.clone(), opts(&self.dir, pools, self.token.as_deref())).await.expect("restart");
        let app = sandboxd::http::app(node.clone());
        (node, app)
    }

    async fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<Value>) -> (StatusCode, Value) {
        call(&self.app, method, path, token, body.map(|b| b.to_string())).await
    }

    async fn claim(&self, body: Value) -> Value {
        let (s, v) = self.call("POST", "/v1/claim", self.token.as_deref(), Some(body)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<String>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let req = b.body(body.map_or_else(Body::empty, Body::from)).expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A pool's wire key as `template|net|size`.
fn key_str(k: &sandboxd_api::Key) -> String {
    format!("{}|{}|{}", k.template, k.net, k.size)
}

fn warm(node: &Node, template: &str) -> usize {
    node.info().pools.iter().find(|p| p.key.template == template).map_or(0, |p| p.warm)
}

async fn wait_warm(node: &Node, template: &str, n: usize) {
    wait_for(&format!("{template} warm = {n}"), || warm(node, template) == n).await;
}

fn deadline_secs_from_now(v: &Value) -> i64 {
    let d = humantime::parse_rfc3339(v["deadline"].as_str().expect("deadline")).expect("rfc3339");
    let now = std::time::SystemTime::now();
    match d.duration_since(now) {
        Ok(x) => i64::try_from(x.as_secs()).expect("secs"),
        Err(e) => -i64::try_from(e.duration().as_secs()).expect("secs"),
    }
}

#[tokio::test]
async fn claim_list_renew_release() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let c = h.claim(json!({"template": "base", "claim_ref": "job-1"})).await;
    let id = c["id"].as_str().expect("id").to_string();
    let token = c["token"].as_str().expect("token").to_string();
    assert!(id.starts_with("sb_") && id.len() == 19, "{id}");
    assert_eq!(token.len(), 32);
    assert_eq!(c["owner_addr"], "10.0.0.1:7777");
    assert_eq!(c["template_digest"], "sha256:base");
    assert!((295..=300).contains(&deadline_secs_from_now(&c)), "{c}");
    // The claim kicks the refill back to target.
    wait_warm(&h.node, "base", 2).await;
    let other = h.claim(json!({"template": "base", "size": "small", "net": "none"})).await;

    let (s, v) = h.call("GET", "/v1/sandboxes", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["sandboxes"].as_array().expect("rows").len(), 2);
    assert!(v.to_string().find(&token).is_none(), "listing leaks a token: {v}");
    let (_, v) = h.call("GET", "/v1/sandboxes?claim_ref=job-1", None, None).await;
    let rows = v["sandboxes"].as_array().expect("rows");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["id"], id.as_str());
    assert_eq!(rows[0]["key"], json!({"template": "base", "net": "none", "size": "small"}));
    assert_eq!(rows[0]["claim_ref"], "job-1");
    assert_eq!(rows[0]["hibernated"], false);

    let (s, v) = h.call("GET", "/v1/info", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["claimed"], 2);
    assert_eq!(v["pools"][0]["target"], 2);
    assert_eq!(v["pools"][0]["golden"], true);

    let (s, v) =
        h.call("POST", &format!("/v1/sandboxes/{id}/renew"), Some(&token), Some(json!({"ttl_seconds": 60}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!((55..=60).contains(&deadline_secs_from_now(&v)), "{v}");
    // Absent body = default TTL.
    let (s, v) = h.call("POST", &format!("/v1/sandboxes/{id}/renew"), Some(&token), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!((295..=300).contains(&deadline_secs_from_now(&v)), "{v}");

    let (s, v) = h.call("GET", &format!("/v1/sandboxes/{id}/owner"), Some(&token), None).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"owner_addr": "10.0.0.1:7777"})));

    let vm = h.node.sandbox(&id).expect("claim").rec.vm;
    assert!(h.driver.is_live(&vm));
    let (s, _) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(&token), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert!(!h.driver.is_live(&vm), "release destroys the VM");
    let (s, v) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(&token), None).await;
    assert_eq!((s, v), (StatusCode::NOT_FOUND, json!({"error": "sandbox not found"})));
    let (_, v) = h.call("GET", "/v1/sandboxes", None, None).await;
    assert_eq!(v["sandboxes"][0]["id"], other["id"]);
}

#[tokio::test]
async fn ttl_rules() {
    let h = start(&[("base", 3)], None).await;
    wait_warm(&h.node, "base", 3).await;
    for bad in [json!(-1), json!(1.5), json!("10")] {
        let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "base", "ttl_seconds": bad}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(v["error"].is_string(), "{v}");
    }
    assert_eq!(warm(&h.node, "base"), 3, "refused claims take no VM");
    let c = h.claim(json!({"template": "base", "ttl_seconds": 0})).await;
    assert!((295..=300).contains(&deadline_secs_from_now(&c)));
    let c = h.claim(json!({"template": "base", "ttl_seconds": 10_000_000})).await;
    assert!((86_395..=86_400).contains(&deadline_secs_from_now(&c)));
    let c = h.claim(json!({"template": "base", "ttl_seconds": 42})).await;
    assert!((37..=42).contains(&deadline_secs_from_now(&c)));
    let token = c["token"].as_str().expect("token");
    let id = c["id"].as_str().expect("id");
    let (s, _) =
        h.call("POST", &format!("/v1/sandboxes/{id}/renew"), Some(token), Some(json!({"ttl_seconds": -5}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn error_shapes() {
    let h = start(&[("base", 1), ("rt", 0)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let cases = [
        (json!({"template": "nginx"}), StatusCode::NOT_FOUND, json!({"error": "unknown template \"nginx\""})),
        (json!({"template": "base", "size": "huge"}), StatusCode::BAD_REQUEST, Value::Null),
        (json!({"template": "-bad"}), StatusCode::BAD_REQUEST, Value::Null),
        (json!({"template": "base", "net": "wifi"}), StatusCode::BAD_REQUEST, Value::Null),
        (json!({}), StatusCode::BAD_REQUEST, Value::Null),
        // A catalog template without a pool: no capacity, not unknown.
        (
            json!({"template": "base", "size": "large"}),
            StatusCode::TOO_MANY_REQUESTS,
            json!({"error": "no warm capacity for base|none|large"}),
        ),
        (json!({"template": "base", "net": "egress"}), StatusCode::CONFLICT, Value::Null),
        // A volume is checked against the catalog before any VM is taken.
        (
            json!({"template": "base", "volumes": ["v1"]}),
            StatusCode::NOT_FOUND,
            json!({"error": "no volume \"v1\" in this node's catalog (GET /v1/volumes lists it; config key volumes makes one)"}),
        ),
        (
            json!({"template": "base", "volumes": [{"name": "v1", "mode": "wx"}]}),
            StatusCode::BAD_REQUEST,
            json!({"error": "volume \"v1\": mode \"wx\": want rw or ro"}),
        ),
    ];
    for (body, status, want) in cases {
        let (s, v) = h.call("POST", "/v1/claim", None, Some(body.clone())).await;
        assert_eq!(s, status, "{body}: {v}");
        assert!(v["error"].is_string(), "{body}: {v}");
        if !want.is_null() {
            assert_eq!(v, want, "{body}");
        }
    }
    assert_eq!(warm(&h.node, "base"), 1);
    // A pool with no warm VM (rt keeps none) makes one for the claim, as upstream does.
    let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "rt"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Unknown claim fields are accepted (vk-sandbox sends metadata, on_expire, egress).
    let g = h.claim(json!({"template": "base", "metadata": {"a": "b"}, "on_expire": "x", "no_redirect": true})).await;
    // Its volumes: none; asking for one the catalog lacks is a 404 carrying the whole view.
    let path = format!("/v1/sandboxes/{}/volumes", g["id"].as_str().expect("id"));
    let empty = json!({"volumes_want": [], "volumes": [], "states": [], "converging": false});
    assert_eq!(h.call("GET", &path, None, None).await, (StatusCode::OK, empty.clone()));
    assert_eq!(h.call("PUT", &path, None, Some(json!({"volumes": []}))).await, (StatusCode::OK, empty));
    let (s, v) = h.call("PATCH", &path, None, Some(json!({"add": [{"name": "nope"}]}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["volumes_want"], json!([{"name": "nope"}]));
    assert_eq!(v["volumes"], json!([]));
    assert_eq!(v["states"], json!([{"name": "nope", "state": "pending"}]));
    assert!(v["error"].as_str().expect("error").contains("no volume \"nope\""), "{v}");

    let big = format!("{{\"template\":\"base\",\"pad\":\"{}\"}}", "x".repeat(1024 * 1024 + 10));
    let (s, v) = call(&h.app, "POST", "/v1/claim", None, Some(big)).await;
    assert_eq!((s, v), (StatusCode::BAD_REQUEST, json!({"error": "invalid request body"})));
    let (s, _) = call(&h.app, "POST", "/v1/claim", None, Some("{nope".into())).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    // Volumes: an empty catalog; an unknown sandbox's volumes are a 404.
    let (s, v) = h.call("GET", "/v1/volumes", None, None).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"volumes": []})));
    let (s, v) = h.call("PUT", "/v1/sandboxes/sb_1/volumes", None, Some(json!({"volumes": []}))).await;
    assert_eq!((s, v), (StatusCode::NOT_FOUND, json!({"error": "sandbox not found"})));
    for (m, p, feature) in [("GET", "/v1/checkpoints/ck_1/blob", "checkpoint blobs")] {
        let (s, v) = h.call(m, p, None, None).await;
        assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{m} {p}");
        assert_eq!(v, json!({"error": format!("{feature} is not implemented on this node")}));
    }
    let (s, v) = h.call("GET", "/healthz", None, None).await;
    assert_eq!((s, v), (StatusCode::OK, Value::String("ok".into())));
    let (s, v) = h.call("GET", "/v1/peers", None, None).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"peers": []})));
    let (s, v) = h.call("GET", "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let text = v.as_str().expect("text");
    assert!(text.contains("sandboxd_claims_total{result=\"granted\",tier=\"warm\"} 1"), "{text}");
    assert!(text.contains("sandboxd_claims_total{result=\"granted\",tier=\"on_demand\"} 1"), "{text}");
    assert!(text.contains("sandboxd_claims_total{result=\"no_capacity\",tier=\"\"} 1"), "{text}");
    assert!(text.contains("sandboxd_pool_target{template=\"base\",net=\"none\",size=\"small\"} 1"), "{text}");
    // Every claim that reached the node is timed, granted or refused.
    let timed = text.lines().find_map(|l| l.strip_prefix("sandboxd_claim_duration_seconds_count "));
    assert!(timed.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 3), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[tokio::test]
async fn auth_matrix() {
    let root = "root-token";
    let h = start(&[("base", 2)], Some(root)).await;
    wait_warm(&h.node, "base", 2).await;
    let body = || Some(json!({"template": "base"}));
    let (s, v) = h.call("POST", "/v1/claim", None, body()).await;
    assert_eq!((s, v), (StatusCode::UNAUTHORIZED, json!({"error": "missing bearer token"})));
    let (s, v) = h.call("POST", "/v1/claim", Some("nope"), body()).await;
    assert_eq!((s, v), (StatusCode::UNAUTHORIZED, json!({"error": "invalid api token"})));
    for path in ["/v1/info", "/v1/sandboxes", "/metrics", "/v1/peers"] {
        let (s, _) = h.call("GET", path, Some("nope"), None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        let (s, _) = h.call("GET", path, Some(root), None).await;
        assert_eq!(s, StatusCode::OK, "{path}");
    }
    let (s, _) = h.call("GET", "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);

    let (s, a) = h.call("POST", "/v1/claim", Some(root), body()).await;
    assert_eq!(s, StatusCode::OK);
    let (_, b) = h.call("POST", "/v1/claim", Some(root), body()).await;
    let (a_id, a_tok) = (a["id"].as_str().expect("id"), a["token"].as_str().expect("token"));
    let b_tok = b["token"].as_str().expect("token");
    let renew = format!("/v1/sandboxes/{a_id}/renew");
    let (s, v) = h.call("POST", &renew, None, None).await;
    assert_eq!((s, v), (StatusCode::UNAUTHORIZED, json!({"error": "missing bearer token"})));
    for wrong in ["nope", b_tok] {
        let (s, v) = h.call("POST", &renew, Some(wrong), None).await;
        assert_eq!((s, v), (StatusCode::NOT_FOUND, json!({"error": "sandbox not found"})), "{wrong}");
    }
    let (s, _) = h.call("POST", "/v1/sandboxes/sb_0000000000000000/renew", Some(a_tok), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = h.call("POST", &renew, Some(a_tok), None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = h.call("POST", &renew, Some(root), None).await;
    assert_eq!(s, StatusCode::OK, "root may act on any sandbox");
    // The per-id read is a root route and shows the token to the root.
    let (s, v) = h.call("GET", &format!("/v1/sandboxes/{a_id}"), Some(root), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["token"], a_tok);
    let (s, _) = h.call("GET", &format!("/v1/sandboxes/{a_id}"), Some(a_tok), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, v) = h.call("GET", &format!("/v1/sandboxes/{a_id}/owner"), Some(b_tok), None).await;
    assert_eq!((s, v), (StatusCode::NOT_FOUND, json!({"error": "not owned here"})));

    // Without a root token node routes are open, but sandbox routes still need the sandbox token.
    let open = start(&[("base", 1)], None).await;
    wait_warm(&open.node, "base", 1).await;
    let c = open.claim(json!({"template": "base"})).await;
    let (s, v) = open.call("GET", &format!("/v1/sandboxes/{}", c["id"].as_str().expect("id")), None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.get("token").is_none(), "{v}");
    let (s, _) =
        open.call("POST", &format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id")), None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn drain_and_uncordon() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let c = h.claim(json!({"template": "base"})).await;
    wait_warm(&h.node, "base", 2).await;
    let warm_ids: Vec<_> = h.node.pools()[0].warm_ids();
    let (s, v) = h.call("POST", "/v1/drain", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["draining"], true);
    assert_eq!(v["pools"][0]["warm"], 0);
    assert_eq!(v["claimed"], 1);
    for id in &warm_ids {
        assert!(!h.driver.is_live(id), "warm VM {id} survived the drain");
    }
    let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "base"}))).await;
    assert_eq!((s, v), (StatusCode::TOO_MANY_REQUESTS, json!({"error": "node draining"})));
    // No refill while draining.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(warm(&h.node, "base"), 0);
    // Live claims run on.
    let vm = h.node.sandbox(c["id"].as_str().expect("id")).expect("claim").rec.vm;
    assert!(h.driver.is_live(&vm));
    let (s, v) = h.call("DELETE", "/v1/drain", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["draining"], false);
    wait_warm(&h.node, "base", 2).await;
    h.claim(json!({"template": "base"})).await;
}

#[tokio::test]
async fn put_pools_replaces_and_persists() {
    let h = start(&[("base", 2)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 2).await;
    let base_ids = h.node.pools()[0].warm_ids();
    let (s, _) = h
        .call("PUT", "/v1/pools", Some(ROOT), Some(json!({"pools": [{"template": "rt", "warm": 1, "bogus": 1}]})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "strict decode");
    let (s, _) =
        h.call("PUT", "/v1/pools", Some(ROOT), Some(json!({"pools": [{"template": "rt", "size": "huge"}]}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v) = h
        .call("PUT", "/v1/pools", Some(ROOT), Some(json!({"pools": [{"template": "rt", "warm": 1, "size": "medium"}]})))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["pools"].as_array().expect("pools").len(), 1);
    assert_eq!(v["pools"][0]["key"], json!({"template": "rt", "net": "none", "size": "medium"}));
    for id in &base_ids {
        assert!(!h.driver.is_live(id), "omitted pool's VM {id} survived");
    }
    wait_warm(&h.node, "rt", 1).await;
    let (s, _) = h.call("POST", "/v1/claim", Some(ROOT), Some(json!({"template": "base"}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    h.claim(json!({"template": "rt", "size": "medium"})).await;
    assert!(h.dir.path().join("data/pools.json").exists());
    // pools.json overrides the config file's pools after a restart.
    let (node2, _) = h.restart(&[("base", 2)]).await;
    let keys: Vec<String> = node2.info().pools.iter().map(|p| key_str(&p.key)).collect();
    assert_eq!(keys, vec!["rt|none|medium"]);
}

#[tokio::test]
async fn claim_is_not_granted_unless_journaled() {
    let h = start(&[("base", 1)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let data = h.dir.path().join("data");
    let log = data.join(sandboxd::journal::CLAIMS_LOG);
    std::fs::create_dir_all(log.join("blocker")).expect("block the journal");
    let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "base"}))).await;
    assert_eq!((s, v), (StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "claim failed"})));
    assert_eq!(warm(&h.node, "base"), 1, "the VM went back to the pool");
    assert_eq!(h.node.claimed(), 0);
    std::fs::remove_dir_all(&log).expect("unblock");
    let c = h.claim(json!({"template": "base"})).await;
    let on_disk = sandboxd::journal::read_claims(&data).expect("journal");
    assert_eq!(on_disk.claims.len(), 1, "{on_disk:?}");
    assert_eq!(on_disk.claims[0].id, c["id"].as_str().expect("id"));
    assert_eq!(on_disk.claims[0].token, c["token"].as_str().expect("token"));
    let stray: Vec<_> = std::fs::read_dir(h.dir.path().join("data"))
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(stray.is_empty(), "temp files left behind");
}

/// Every reply of claim, renew and release comes after the journal on disk has the change.
#[tokio::test]
async fn replies_come_after_the_journal_has_the_change() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let data = h.dir.path().join("data");
    let on_disk = || sandboxd::journal::read_claims(&data).expect("journal").claims;
    let c = h.claim(json!({"template": "base", "ttl_seconds": 60, "claim_ref": "r"})).await;
    let id = c["id"].as_str().expect("id");
    let tok = c["token"].as_str();
    let rows = on_disk();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].id.as_str(), rows[0].token.as_str(), rows[0].claim_ref.as_deref()),
        (id, tok.unwrap_or(""), Some("r"))
    );
    let before = rows[0].deadline_unix_ms;
    let (s, _) = h.call("POST", &format!("/v1/sandboxes/{id}/renew"), tok, Some(json!({"ttl_seconds": 3600}))).await;
    assert_eq!(s, StatusCode::OK);
    let after = on_disk()[0].deadline_unix_ms;
    assert!(after >= before + 3_500_000, "renew journaled: {before} → {after}");
    let (s, _) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), tok, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert!(on_disk().is_empty(), "release journaled");
    // What a restart reads is what the node had.
    let c2 = h.claim(json!({"template": "base"})).await;
    h.node.shutdown();
    let (node2, _) = h.restart(&[("base", 2)]).await;
    let rows = node2.list(None);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].id, c2["id"].as_str().expect("id"));
}

#[tokio::test]
async fn restart_readopts_claims_and_destroys_unowned_vms() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let a = h.claim(json!({"template": "base", "ttl_seconds": 600, "claim_ref": "keep"})).await;
    let b = h.claim(json!({"template": "base"})).await;
    wait_warm(&h.node, "base", 2).await;
    let a_id = a["id"].as_str().expect("id");
    let a_vm = h.node.sandbox(a_id).expect("a").rec.vm;
    let b_vm = h.node.sandbox(b["id"].as_str().expect("id")).expect("b").rec.vm;
    let old_warm = h.node.pools()[0].warm_ids();
    let leftover = h.driver.add_vm("sbx-gb-0123-00000001");
    let foreign = h.driver.add_vm("other-vm-1");
    // b's VM dies while sandboxd is down.
    h.node.shutdown();
    let b_rec = h.driver.attach(&b_vm).await.expect("b live");
    h.driver.kill(&b_rec).await.expect("kill b");
    // A claim was resuming one warm VM when sandboxd died: it runs, and no claim names it.
    assert!(old_warm.iter().all(|id| h.driver.is_paused(id)), "warm VMs wait paused");
    let resumed = h.driver.attach(&old_warm[0]).await.expect("warm live");
    h.driver.resume(&resumed).await.expect("resume");

    let (node2, app2) = h.restart(&[("base", 2)]).await;
    assert!(node2.reconciled());
    let rows = node2.list(None);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].id, a_id);
    assert_eq!(rows[0].deadline, a["deadline"].as_str().expect("deadline"), "deadline kept");
    assert_eq!(rows[0].claim_ref.as_deref(), Some("keep"));
    assert!(h.driver.is_live(&a_vm), "a claimed VM is never destroyed");
    assert!(!h.driver.is_live(&leftover));
    assert!(h.driver.is_live(&foreign), "only sbx- VMs are ours");
    // The paused warm VM is warm again (not rebuilt); the running one is not taken for one.
    assert!(!h.driver.is_live(&old_warm[0]), "an unclaimed running VM was kept");
    assert!(h.driver.is_live(&old_warm[1]), "a paused warm VM was destroyed");
    assert!(node2.pools()[0].warm_ids().contains(&old_warm[1]), "a paused warm VM is not back in its pool");
    // The re-adopted sandbox still answers, with its old token.
    let (s, v) = call(
        &app2,
        "POST",
        &format!("/v1/sandboxes/{a_id}/exec"),
        a["token"].as_str(),
        Some(json!({"argv": ["echo", "alive"]}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "alive\n");
    // The dropped row is gone from the journal too, and the pool refills.
    let on_disk = sandboxd::journal::read_claims(&h.dir.path().join("data")).expect("journal");
    let ids: Vec<&str> = on_disk.claims.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, vec![a_id]);
    wait_warm(&node2, "base", 2).await;
}

#[tokio::test]
async fn failed_listing_destroys_nothing() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let a = h.claim(json!({"template": "base"})).await;
    wait_warm(&h.node, "base", 2).await;
    let before = h.driver.live();
    let leftover = h.driver.add_vm("sbx-old-00000001");
    h.node.shutdown();
    h.driver.set_fail(|f| f.list = true);
    let boots = h.driver.calls();
    let (node2, app2) = h.restart(&[("base", 2)]).await;
    assert!(!node2.reconciled());
    tokio::time::sleep(Duration::from_millis(200)).await;
    for id in before.iter().chain([&leftover]) {
        assert!(h.driver.is_live(id), "{id} destroyed on a failed listing");
    }
    let after = h.driver.calls();
    assert_eq!((after.boots, after.restores), (boots.boots, boots.restores), "no refill before reconcile");
    assert_eq!(node2.claimed(), 1, "journaled claim kept");
    // The sandbox is served meanwhile (attached on demand).
    let (s, v) = call(
        &app2,
        "POST",
        &format!("/v1/sandboxes/{}/exec", a["id"].as_str().expect("id")),
        a["token"].as_str(),
        Some(json!({"argv": ["echo", "ok"]}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    h.driver.set_fail(|f| f.list = false);
    wait_for("reconcile retry", || node2.reconciled()).await;
    assert!(!h.driver.is_live(&leftover));
    wait_warm(&node2, "base", 2).await;
    assert_eq!(node2.claimed(), 1);
}

#[tokio::test]
async fn reaper_ends_a_two_second_lease() {
    let h = start(&[("base", 1)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base", "ttl_seconds": 2})).await;
    let vm = h.node.sandbox(c["id"].as_str().expect("id")).expect("claim").rec.vm;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(h.node.claimed(), 1, "reaped early");
    let until = Instant::now() + Duration::from_secs(3);
    while h.node.claimed() > 0 {
        assert!(Instant::now() < until, "lease not reaped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!h.driver.is_live(&vm), "reaped VM still live");
    let (s, _) = h
        .call("POST", &format!("/v1/sandboxes/{}/renew", c["id"].as_str().expect("id")), c["token"].as_str(), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn refill_clones_from_a_golden_and_falls_back_to_cold_boots() {
    let h = start(&[("base", 3)], None).await;
    wait_warm(&h.node, "base", 3).await;
    let calls = h.driver.calls();
    assert_eq!(calls.snapshots, 1, "{calls:?}");
    assert_eq!(calls.restores, 3, "{calls:?}");
    assert_eq!(calls.boots, 1, "only the golden is cold-booted: {calls:?}");
    let hash = h.node.pools()[0].hash.clone();
    let golden = h.dir.path().join("data/goldens").join(&hash);
    assert!(golden.join("snapshot.json").exists());
    let names: Vec<String> = std::fs::read_dir(h.dir.path().join("data/goldens"))
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![hash.clone()], "staging dirs left behind");
    assert!(h.driver.live().iter().all(|id| id.as_str().starts_with("sbx-")));
    // The golden builder is gone after its snapshot.
    assert!(!h.driver.live().iter().any(|id| id.as_str().starts_with("sbx-gb-")));
    // Every clone was reseeded once before it was pooled.
    for id in h.driver.live() {
        assert_eq!(h.driver.reseeds(&id), 1, "{id} reseeded once");
    }

    // Clones fail: cold boots keep the pool full, and the golden is eventually dropped.
    h.driver.set_fail(|f| f.restore = true);
    for _ in 0..3 {
        h.claim(json!({"template": "base"})).await;
        wait_warm(&h.node, "base", 3).await;
    }
    assert!(h.driver.calls().boots >= 4);

    // A restarted node keeps its three paused warm VMs and clones only the fourth (from a
    // golden on disk, or rebuilt if the failures above dropped it).
    h.driver.set_fail(|f| f.restore = false);
    let before = h.driver.calls();
    let (node2, _) = h.restart(&[("base", 4)]).await;
    wait_warm(&node2, "base", 4).await;
    assert!(node2.info().pools[0].golden);
    let after = h.driver.calls();
    assert_eq!(after.restores - before.restores, 1, "{after:?}");
}

#[tokio::test]
async fn a_clone_that_cannot_be_reseeded_is_destroyed_and_the_slot_cold_boots() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    // The guest agent stops answering dials: clones restore and answer `info`, but cannot be
    // reseeded, so none of them may enter the pool.
    h.driver.set_fail(|f| f.connect = true);
    let before = h.driver.calls();
    h.claim(json!({"template": "base"})).await;
    wait_warm(&h.node, "base", 2).await;
    let after = h.driver.calls();
    assert!(after.restores > before.restores, "a clone was tried: {after:?}");
    assert!(after.boots > before.boots, "the slot cold-booted instead: {after:?}");
    let (_, metrics) = h.call("GET", "/metrics", None, None).await;
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    let line = metrics.lines().find(|l| l.starts_with("sandboxd_clone_reseed_failures_total")).unwrap_or_default();
    assert!(!line.ends_with(" 0") && !line.is_empty(), "{line:?}");
}

#[tokio::test]
async fn failing_boots_back_off_and_report_at_capacity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let driver = FakeDriver::new(dir.path());
    driver.set_fail(|f| f.boot = true);
    let mut o = opts(&dir, &[("base", 2)], None);
    o.clone = false;
    let node = Node::start(driver.clone(), o).await.expect("start");
    wait_for("at_capacity", || node.info().at_capacity).await;
    let info = node.info();
    assert!(info.at_capacity_reason.as_deref().is_some_and(|r| r.contains("boot failure injected")), "{info:?}");
    let n = driver.calls().boots;
    assert!(n >= 8, "{n}");
    // Backing off: far fewer attempts than ticks.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(driver.calls().boots - n <= 4, "not backing off: {} more boots", driver.calls().boots - n);
    driver.set_fail(|f| f.boot = false);
    wait_for("recovery", || node.info().pools[0].warm == 2).await;
    assert!(!node.info().at_capacity);

    // A template missing from the catalog parks the pool with a reason instead of spinning.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let d2 = FakeDriver::new(dir2.path());
    let node2 = Node::start(d2.clone(), opts(&dir2, &[("ghost", 1)], None)).await.expect("start");
    wait_for("parked", || node2.info().at_capacity).await;
    assert!(node2.info().at_capacity_reason.expect("reason").contains("not in the image catalog"));
    assert_eq!(d2.calls().boots, 0);
}

mod exec {
    use super::*;

    async fn exec(h: &H, c: &Value, body: Value) -> (StatusCode, Value) {
        h.call(
            "POST",
            &format!("/v1/sandboxes/{}/exec", c["id"].as_str().expect("id")),
            c["token"].as_str(),
            Some(body),
        )
        .await
    }

    #[tokio::test]
    async fn exec_shapes() {
        let h = start(&[("base", 1)], None).await;
        wait_warm(&h.node, "base", 1).await;
        let c = h.claim(json!({"template": "base"})).await;
        let (s, v) = exec(&h, &c, json!({"argv": ["echo", "hi", "there"], "cwd": "/", "env": {"A": "1"}})).await;
        assert_eq!((s, v), (StatusCode::OK, json!({"exit_code": 0, "stdout": "hi there\n", "stderr": ""})));
        let (s, v) = exec(&h, &c, json!({"argv": ["fail"]})).await;
        assert_eq!((s, v), (StatusCode::OK, json!({"exit_code": 3, "stdout": "", "stderr": "boom"})));
        let (s, v) = exec(&h, &c, json!({"argv": []})).await;
        assert_eq!((s, v), (StatusCode::BAD_REQUEST, json!({"error": "argv must not be empty"})));
        let (s, _) = exec(&h, &c, json!({"argv": ["echo"], "user": "root"})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "strict decode");
        let (s, _) = exec(&h, &c, json!({"argv": ["echo"], "timeout_seconds": -1})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let (s, v) = exec(&h, &c, json!({"argv": ["missing-binary"]})).await;
        assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
        let t = Instant::now();
        let (s, v) = exec(&h, &c, json!({"argv": ["sleep"], "timeout_seconds": 0.2})).await;
        assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{v}");
        assert!(t.elapsed() < Duration::from_secs(3));
        let (s, v) = exec(&h, &c, json!({"argv": ["flood"]})).await;
        assert_eq!((s, v), (StatusCode::PAYLOAD_TOO_LARGE, json!({"error": "exec output exceeds 8 MiB"})));
        h.driver.set_fail(|f| f.connect = true);
        let (s, _) = exec(&h, &c, json!({"argv": ["echo"]})).await;
        assert_eq!(s, StatusCode::BAD_GATEWAY);
        let (s, _) =
            h.call("POST", "/v1/sandboxes/sb_x/exec", c["token"].as_str(), Some(json!({"argv": ["echo"]}))).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
    }
}

#[path = "api/console.rs"]
mod console;

#[path = "api/relay.rs"]
mod relay;

#[path = "api/secure.rs"]
mod secure;

#[path = "api/peers.rs"]
mod peers;

/// The public Python SDK (`cocoonstack-sandbox` 0.1.19 from PyPI), unmodified, against a
/// loopback server. `cargo xtask test` installs it in a venv and points `CHRYSALIS_PYTHON` at
/// that venv's interpreter; a plain `cargo test` reports this test as ignored, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "sdk-tests"), ignore = "needs the public Python SDK: run through `cargo xtask test`")]
async fn public_sdk_smoke() {
    let python = std::env::var("CHRYSALIS_PYTHON")
        .expect("CHRYSALIS_PYTHON must name a python with cocoonstack-sandbox installed (cargo xtask test sets it)");
    let root = "sdk-root";
    let dir = tempfile::tempdir().expect("tempdir");
    let driver = FakeDriver::new(dir.path());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let mut o = opts(&dir, &[("base", 2)], Some(root));
    o.advertise_addr = addr.to_string();
    let node = Node::start(driver, o).await.expect("start");
    wait_warm(&node, "base", 2).await;
    tokio::spawn(sandboxd::http::serve(l, node.clone(), None, std::future::pending()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/smoke.py");
    let out = tokio::process::Command::new(&python).arg(script).arg(addr.to_string()).arg(root).output();
    let out =
        tokio::time::timeout(Duration::from_secs(60), out).await.expect("sdk smoke in time").expect("run python3");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "sdk smoke failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("sdk smoke ok"), "{stdout}\n{stderr}");
}

#[tokio::test]
async fn aliases_and_short_names_claim_from_their_templates_pool() {
    const ALIAS: &str = "ghcr.io/cocoonstack/sandbox/rt:24.04";
    let h = start(&[("rt", 2)], None).await;
    wait_warm(&h.node, "rt", 2).await;
    // The full reference and the SDK's short name both take the rt pool's warm VMs.
    for name in [ALIAS, "rt:24.04"] {
        let c = h.claim(json!({"template": name})).await;
        assert_eq!(c["template_digest"], "sha256:rt", "{name}: {c}");
        let id = c["id"].as_str().expect("id");
        let (_, v) = h.call("GET", "/v1/sandboxes", None, None).await;
        let row = v["sandboxes"].as_array().expect("rows").iter().find(|r| r["id"] == id).cloned().expect("row");
        assert_eq!(row["key"]["template"], "rt", "{name}: {row}");
        wait_warm(&h.node, "rt", 2).await;
    }
    assert_eq!(h.node.info().pools.len(), 1, "no pool is made for an alias");
    // Another tag, or a partial path, is not a name the catalog knows.
    for name in ["rt:23.10", "sandbox/rt:24.04"] {
        let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": name}))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{name}: {v}");
    }

    // A pool kept under the alias serves claims by the template's own name and short name.
    let h = start(&[(ALIAS, 1)], None).await;
    wait_warm(&h.node, ALIAS, 1).await;
    for name in ["rt", "rt:24.04"] {
        let c = h.claim(json!({"template": name})).await;
        assert_eq!(c["template_digest"], "sha256:rt", "{name}: {c}");
        wait_warm(&h.node, ALIAS, 1).await;
    }
}

/// Snapshot directories under the node's data dir.
fn snapshot_dirs(h: &H) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(h.dir.path().join("data/snapshots"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test]
async fn fork_is_all_or_nothing_and_children_diverge_from_the_parent() {
    let h = start(&[("base", 2)], None).await;
    wait_warm(&h.node, "base", 2).await;
    let p = h.claim(json!({"template": "base", "claim_ref": "parent"})).await;
    let (pid, ptok) = (p["id"].as_str().expect("id").to_string(), p["token"].as_str().expect("token").to_string());
    let fork_path = format!("/v1/sandboxes/{pid}/fork");
    let fork = |body: Value| h.call("POST", &fork_path, None, Some(body));

    let (s, v) = fork(json!({"token": ptok, "count": 3, "ttl_seconds": 60, "claim_ref_prefix": "branch"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let children = v["children"].as_array().expect("children").clone();
    assert_eq!(children.len(), 3);
    for c in &children {
        assert!(c["id"].as_str().expect("id").starts_with("sb_") && c["token"].as_str().expect("t").len() == 32, "{c}");
        assert_eq!(c["owner_addr"], "10.0.0.1:7777");
        assert_eq!(c["template_digest"], "sha256:base");
        assert!((55..=60).contains(&deadline_secs_from_now(c)), "{c}");
    }
    let (_, rows) = h.call("GET", "/v1/sandboxes", None, None).await;
    let mut refs: Vec<String> = rows["sandboxes"]
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r["claim_ref"].as_str().map(String::from))
        .collect();
    refs.sort();
    assert_eq!(refs, ["branch-0", "branch-1", "branch-2", "parent"]);
    // Each child is its own VM, restored from the fork's snapshot; the parent keeps its VM.
    let parent_vm = h.node.sandbox(&pid).expect("parent").rec.vm;
    assert!(h.driver.is_live(&parent_vm));
    let child_vms: std::collections::BTreeSet<_> =
        children.iter().map(|c| h.node.sandbox(c["id"].as_str().expect("id")).expect("child").rec.vm).collect();
    assert_eq!(child_vms.len(), 3);
    assert!(!child_vms.contains(&parent_vm));
    for vm in &child_vms {
        assert_eq!(h.driver.reseeds(vm), 1, "each child gets fresh entropy");
    }
    assert_eq!(snapshot_dirs(&h).len(), 1, "{:?}", snapshot_dirs(&h));

    // Bad input: a typed error each, and nothing made.
    for (count, status) in [(0, 400), (17, 400), (-1, 400)] {
        let (s, v) = fork(json!({"token": ptok, "count": count})).await;
        assert_eq!(s.as_u16(), status, "count {count}: {v}");
        assert!(v["error"].as_str().expect("msg").contains("max_fork_count"), "{v}");
    }
    let (s, _) = fork(json!({"token": "0".repeat(32), "count": 1})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "a wrong sandbox token");
    let other = h.claim(json!({"template": "base"})).await;
    let (s, _) = fork(json!({"token": other["token"], "count": 1})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another sandbox's token");
    let (s, _) = fork(json!({"count": 1})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "no body token");
    // A restore that fails mid-fork destroys the children made so far and grants none.
    let before = h.node.claimed();
    h.driver.set_fail(|f| f.restore = true);
    let (s, v) = fork(json!({"token": ptok, "count": 2})).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    h.driver.set_fail(|f| f.restore = false);
    assert_eq!(h.node.claimed(), before);

    // The children's snapshot goes once the last child is gone.
    for c in &children {
        let (s, _) = h
            .call(
                "POST",
                &format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id")),
                c["token"].as_str(),
                None,
            )
            .await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
    wait_for("the fork snapshots to be collected", || snapshot_dirs(&h).is_empty()).await;
}

/// A claim on an empty pool is served by a VM made for it (counted as `on_demand`, its wait in
/// the claim latency) while the node budget has room; past it, 429 names the budget.
#[tokio::test]
async fn a_warm_miss_is_served_on_demand_until_the_budget_is_full() {
    let h = start_with(&[("base", 1)], None, |o| o.limits.budget.max_vms = 2).await;
    wait_warm(&h.node, "base", 1).await;
    // A warm VM waits paused; the claim resumes it.
    let live = h.driver.live();
    assert_eq!(live.len(), 1, "{live:?}");
    let warm_vm = live[0].clone();
    assert!(h.driver.is_paused(&warm_vm), "a warm VM waits with its vCPUs stopped");
    assert!(h.driver.is_background(&warm_vm), "a VM made for the pool runs at the background CPU weight");
    let sets_before = h.driver.clock_sets(&warm_vm);
    let first = h.claim(json!({"template": "base"})).await;
    let claimed = h.node.sandbox(first["id"].as_str().expect("id")).expect("claim").rec.vm;
    assert_eq!(claimed, warm_vm);
    assert!(!h.driver.is_paused(&claimed), "a claimed VM runs");
    // Its clock stood still while it waited: the claim has it set, on a task of its own.
    let mut waited = 0;
    while h.driver.clock_sets(&claimed) <= sets_before && waited < 200 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        waited += 1;
    }
    assert!(h.driver.clock_sets(&claimed) > sets_before, "the resumed guest's clock was set");
    assert!(!h.driver.is_background(&claimed), "a claimed VM runs at the normal CPU weight");
    // The refill of the pool may take the second VM first; either way one more claim is served.
    h.claim(json!({"template": "base"})).await;
    let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "base"}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    let msg = v["error"].as_str().expect("msg");
    assert!(msg.starts_with("no warm VM for base|none|small, and none can be started now"), "{msg}");
    assert!(msg.contains("max_vms = 2"), "{msg}");
    let m = h.node.render_metrics();
    let granted = |tier: &str| {
        m.lines()
            .find(|l| l.starts_with(&format!("sandboxd_claims_total{{result=\"granted\",tier=\"{tier}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(granted("warm") + granted("on_demand"), 2, "{m}");
    assert!(m.contains("sandboxd_claims_total{result=\"no_capacity\",tier=\"\"} 1"), "{m}");
}

#[tokio::test]
async fn fork_over_the_budget_is_refused_whole() {
    let h = start_with(&[("base", 1)], None, |o| o.limits.budget.max_vms = 3).await;
    wait_warm(&h.node, "base", 1).await;
    let p = h.claim(json!({"template": "base"})).await;
    let path = format!("/v1/sandboxes/{}/fork", p["id"].as_str().expect("id"));
    let (s, v) = h.call("POST", &path, None, Some(json!({"token": p["token"], "count": 5}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(v["error"].as_str().expect("msg").contains("max_vms = 3"), "{v}");
    assert_eq!(h.node.claimed(), 1, "no child granted");
}

#[tokio::test]
async fn checkpoints_are_claimed_many_times_survive_a_restart_and_are_deleted() {
    let h = start(&[("base", 1)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let (id, token) = (c["id"].as_str().expect("id").to_string(), c["token"].as_str().expect("t").to_string());
    let path = format!("/v1/sandboxes/{id}/checkpoint");
    let (s, v) = h.call("POST", &path, None, Some(json!({"token": token, "name": "after-setup"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let ck = v["checkpoint"].clone();
    let ck_id = ck["id"].as_str().expect("id").to_string();
    assert!(ck_id.starts_with("ck_") && ck_id.len() == 19, "{ck}");
    assert_eq!((ck["name"].as_str(), ck["sandbox_id"].as_str()), (Some("after-setup"), Some(id.as_str())));
    assert_eq!(ck["key"], json!({"template": "base", "net": "none", "size": "small"}));
    // Another sandbox's token, or none, is a 404.
    wait_warm(&h.node, "base", 1).await;
    let other = h.claim(json!({"template": "base"})).await;
    let (s, _) = h.call("POST", &path, None, Some(json!({"token": other["token"]}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let claim_path = format!("/v1/checkpoints/{ck_id}/claim");
    let mut from = Vec::new();
    for _ in 0..2 {
        let (s, g) = h.call("POST", &claim_path, None, None).await;
        assert_eq!(s, StatusCode::OK, "{g}");
        assert_eq!(g["from_checkpoint"], ck_id.as_str());
        from.push(g);
    }
    let (_, rows) = h.call("GET", "/v1/sandboxes", None, None).await;
    let with_ck =
        rows["sandboxes"].as_array().expect("rows").iter().filter(|r| r["from_checkpoint"] == ck_id.as_str()).count();
    assert_eq!(with_ck, 2, "{rows}");
    let (s, list) = h.call("GET", "/v1/checkpoints", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["checkpoints"][0]["id"], ck_id.as_str());
    let (_, info) = h.call("GET", "/v1/info", None, None).await;
    assert!(info["checkpoint_disk_bytes"].as_u64().is_some(), "{info}");
    // Which hypervisor the node drives, and under which accelerator.
    assert_eq!((info["hypervisor"].as_str(), info["accel"].as_str()), (Some("qemu"), Some("tcg")), "{info}");

    // A restart keeps the checkpoint and its claims.
    let (node, app) = h.restart(&[("base", 1)]).await;
    let (s, list) = call(&app, "GET", "/v1/checkpoints", None, None).await;
    assert_eq!((s, list["checkpoints"].as_array().map(Vec::len)), (StatusCode::OK, Some(1)));
    let (s, g) = call(&app, "POST", &claim_path, None, Some(json!({"ttl_seconds": 30}).to_string())).await;
    assert_eq!(s, StatusCode::OK, "{g}");

    // Delete: unlisted at once, a claim from it is a 404, and a second delete too; its files
    // stay while sandboxes claimed from it run.
    let (s, _) = call(&app, "DELETE", &format!("/v1/checkpoints/{ck_id}"), None, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(&app, "POST", &claim_path, None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(&app, "DELETE", &format!("/v1/checkpoints/{ck_id}"), None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(&app, "POST", "/v1/checkpoints/ck_..%2F..%2Fetc/claim", None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(snapshot_dirs(&h), [ck_id.as_str()], "kept while claimed sandboxes use it");
    for g in from.iter().chain([&g]) {
        let id = g["id"].as_str().expect("id");
        let (s, _) = call(&app, "POST", &format!("/v1/sandboxes/{id}/release"), g["token"].as_str(), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
    wait_for("the deleted checkpoint's files to go", || snapshot_dirs(&h).is_empty()).await;
    drop(node);
}

#[tokio::test]
async fn a_half_made_checkpoint_is_removed_at_start() {
    let h = start(&[("base", 1)], None).await;
    // What a crash between the snapshot and its record leaves: a directory without
    // checkpoint.json.
    let stray = h.dir.path().join("data/snapshots/ck_00000000000000aa");
    std::fs::create_dir_all(&stray).expect("mkdir");
    std::fs::write(stray.join("state"), b"half").expect("write");
    let (_node, app) = h.restart(&[("base", 1)]).await;
    wait_for("the half-made checkpoint to be removed", || !stray.exists()).await;
    let (_, list) = call(&app, "GET", "/v1/checkpoints", None, None).await;
    assert_eq!(list["checkpoints"], json!([]));
}

mod hibernation {
    use super::*;

    async fn post(h: &H, c: &Value, verb: &str) -> StatusCode {
        let path = format!("/v1/sandboxes/{}/{verb}", c["id"].as_str().expect("id"));
        h.call("POST", &path, c["token"].as_str(), None).await.0
    }

    async fn echo(h: &H, c: &Value) -> (StatusCode, Value) {
        let path = format!("/v1/sandboxes/{}/exec", c["id"].as_str().expect("id"));
        h.call("POST", &path, c["token"].as_str(), Some(json!({"argv": ["echo", "awake"]}))).await
    }

    fn row(h: &H, c: &Value) -> Option<sandboxd::claims::Claim> {
        h.node.sandbox(c["id"].as_str().expect("id"))
    }

    #[tokio::test]
    async fn hibernate_frees_the_vm_and_a_guest_call_wakes_it() {
        let h = start(&[("base", 1)], None).await;
        wait_warm(&h.node, "base", 1).await;
        let c = h.claim(json!({"template": "base", "ttl_seconds": 600})).await;
        let before = row(&h, &c).expect("claim");
        wait_warm(&h.node, "base", 1).await;
        let vms_before = h.node.usage().vms;

        assert_eq!(post(&h, &c, "hibernate").await, StatusCode::NO_CONTENT);
        assert_eq!(post(&h, &c, "hibernate").await, StatusCode::NO_CONTENT, "idempotent");
        let hib = row(&h, &c).expect("still claimed");
        assert!(hib.vm.is_none() && hib.rec.hibernate_snap.is_some() && hib.rec.pending_snap.is_none());
        assert!(!h.driver.is_live(&before.rec.vm), "no VM process while hibernated");
        assert_eq!(hib.rec.token, before.rec.token);
        assert_eq!(hib.rec.deadline_unix_ms, before.rec.deadline_unix_ms, "the lease is kept");
        assert_eq!(h.node.usage().vms, vms_before - 1, "no budget held");
        let (_, info) = h.call("GET", "/v1/info", None, None).await;
        assert_eq!((info["claimed"].as_u64(), info["hibernated"].as_u64()), (Some(1), Some(1)), "{info}");
        let (_, rows) = h.call("GET", "/v1/sandboxes", None, None).await;
        assert_eq!(rows["sandboxes"][0]["hibernated"], true);
        let (s, st) =
            h.call("GET", &format!("/v1/sandboxes/{}/stats", c["id"].as_str().expect("id")), None, None).await;
        assert_eq!((s, &st["hibernated"]), (StatusCode::OK, &json!(true)), "{st}");
        // A plain request on the relay route never wakes it; nor do fork and checkpoint.
        let (s, _) = h
            .call("GET", &format!("/v1/sandboxes/{}/agent", c["id"].as_str().expect("id")), c["token"].as_str(), None)
            .await;
        assert_eq!(s, StatusCode::UPGRADE_REQUIRED);
        let (s, v) = h
            .call(
                "POST",
                &format!("/v1/sandboxes/{}/fork", c["id"].as_str().expect("id")),
                None,
                Some(json!({"token": c["token"], "count": 1})),
            )
            .await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(row(&h, &c).expect("claim").rec.hibernate_snap.is_some());

        // A guest call wakes it, with a new VM restored from its snapshot.
        let (s, v) = echo(&h, &c).await;
        assert_eq!((s, v["stdout"].as_str()), (StatusCode::OK, Some("awake\n")), "{v}");
        let woke = row(&h, &c).expect("claim");
        assert!(woke.rec.hibernate_snap.is_none());
        let vm = woke.vm.expect("attached");
        assert!(h.driver.is_live(&vm.id) && vm.id != before.rec.vm);
        assert_eq!(h.driver.reseeds(&vm.id), 1, "a woken VM gets fresh entropy");
        assert_eq!(post(&h, &c, "wake").await, StatusCode::NO_CONTENT, "waking an awake sandbox");
        assert_eq!(h.node.usage().vms, vms_before);

        // Explicit hibernate then wake, and a restart in between keeps it hibernated.
        assert_eq!(post(&h, &c, "hibernate").await, StatusCode::NO_CONTENT);
        let (node, app) = h.restart(&[("base", 1)]).await;
        let c2 = node.sandbox(c["id"].as_str().expect("id")).expect("survives the restart");
        assert!(c2.rec.hibernate_snap.is_some());
        let (s, _) = call(&app, "POST", &format!("/v1/sandboxes/{}/wake", c2.rec.id), Some(&c2.rec.token), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        let c3 = node.sandbox(&c2.rec.id).expect("claim");
        assert!(c3.rec.hibernate_snap.is_none() && h.driver.is_live(&c3.vm.expect("vm").id));
        // Released: the snapshots go.
        let (s, _) =
            call(&app, "POST", &format!("/v1/sandboxes/{}/release", c2.rec.id), Some(&c2.rec.token), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        wait_for("the hibernation snapshots to be collected", || snapshot_dirs(&h).is_empty()).await;
    }

    #[tokio::test]
    async fn a_failed_snapshot_leaves_the_sandbox_running() {
        let h = start(&[("base", 1)], None).await;
        wait_warm(&h.node, "base", 1).await;
        let c = h.claim(json!({"template": "base"})).await;
        h.driver.set_fail(|f| f.snapshot = true);
        assert_eq!(post(&h, &c, "hibernate").await, StatusCode::INTERNAL_SERVER_ERROR);
        h.driver.set_fail(|f| f.snapshot = false);
        let r = row(&h, &c).expect("claim");
        assert!(r.rec.hibernate_snap.is_none() && r.rec.pending_snap.is_none());
        assert!(h.driver.is_live(&r.rec.vm));
        assert_eq!(echo(&h, &c).await.0, StatusCode::OK);
        assert!(snapshot_dirs(&h).is_empty(), "{:?}", snapshot_dirs(&h));
    }

    #[tokio::test]
    async fn idle_sandboxes_hibernate_and_a_wake_racing_a_release_leaves_nothing() {
        let h = start_with(&[], None, |o| {
            o.pools = vec![PoolConfig { idle_hibernate_seconds: Some(1), ..PoolConfig::warm("base", 2) }];
        })
        .await;
        wait_warm(&h.node, "base", 2).await;
        let idle = h.claim(json!({"template": "base"})).await;
        wait_for("the idle sandbox to hibernate", || row(&h, &idle).is_some_and(|c| c.rec.hibernate_snap.is_some()))
            .await;
        // A wake and a release at once: whichever order, no claim and no VM of it remain.
        let (wake, release) = tokio::join!(post(&h, &idle, "wake"), post(&h, &idle, "release"));
        assert!(matches!(wake, StatusCode::NO_CONTENT | StatusCode::NOT_FOUND), "{wake}");
        assert_eq!(release, StatusCode::NO_CONTENT);
        assert!(row(&h, &idle).is_none());
        wait_warm(&h.node, "base", 2).await;
        assert_eq!(h.driver.live().len(), 2, "only the warm pool: {:?}", h.driver.live());
    }
}

#[tokio::test]
async fn preview_urls_are_501_without_preview_listen_and_tokens_are_checked() {
    let h = start(&[("base", 1)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let path = format!("/v1/sandboxes/{}/preview", c["id"].as_str().expect("id"));
    let (s, v) = h.call("POST", &path, None, Some(json!({"token": c["token"], "port": 8000}))).await;
    assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{v}");
    assert!(v["error"].as_str().expect("msg").contains("preview_listen"), "{v}");

    let h = start_with(&[("base", 1)], None, |o| {
        o.previews = Some(sandboxd::preview::Previews::with_key([9; 32], "http://preview.test:8080"));
    })
    .await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let path = format!("/v1/sandboxes/{}/preview", c["id"].as_str().expect("id"));
    let (s, v) = h.call("POST", &path, None, Some(json!({"token": c["token"], "port": 8000, "ttl_seconds": 60}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let url = v["url"].as_str().expect("url").to_string();
    assert!(url.starts_with("http://preview.test:8080/p/") && url.ends_with('/'), "{url}");
    for (body, status) in [
        (json!({"token": c["token"], "port": 0}), StatusCode::BAD_REQUEST),
        (json!({"token": c["token"], "port": 70000}), StatusCode::BAD_REQUEST),
        (json!({"token": c["token"], "port": 80, "ttl_seconds": -1}), StatusCode::BAD_REQUEST),
        (json!({"token": "0".repeat(32), "port": 80}), StatusCode::NOT_FOUND),
        (json!({"port": 80}), StatusCode::NOT_FOUND),
    ] {
        let (s, v) = h.call("POST", &path, None, Some(body.clone())).await;
        assert_eq!(s, status, "{body}: {v}");
    }
    // The proxy: a forged, truncated or unknown token is a 404, and so is a released sandbox's.
    let previews = sandboxd::http::preview_app(h.node.clone());
    let token_path = url.trim_start_matches("http://preview.test:8080");
    for bad in ["/p/nope/", "/p/a.b/x", "/", "/v1/info"] {
        let (s, _) = call(&previews, "GET", bad, None, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{bad}");
    }
    let forged = format!("{}x/", token_path.trim_end_matches('/'));
    assert_eq!(call(&previews, "GET", &forged, None, None).await.0, StatusCode::NOT_FOUND);
    let (s, _) = h
        .call("POST", &format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id")), c["token"].as_str(), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert_eq!(call(&previews, "GET", token_path, None, None).await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn promoted_templates_are_pooled_required_and_deleted() {
    let h = start(&[("base", 1)], None).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let path = format!("/v1/sandboxes/{}/promote", c["id"].as_str().expect("id"));
    let (s, v) = h.call("POST", &path, None, Some(json!({"token": c["token"], "template": "my-agent"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["key"], json!({"template": "my-agent", "net": "none", "size": "small"}));
    let digest = v["content_digest"].as_str().expect("digest").to_string();
    assert!(digest.starts_with("sha256:") && digest.len() == 71, "{v}");
    for (body, status) in [
        (json!({"token": c["token"], "template": "base"}), StatusCode::CONFLICT),
        (json!({"token": c["token"], "template": "ghcr.io/cocoonstack/sandbox/rt:24.04"}), StatusCode::CONFLICT),
        (json!({"token": c["token"], "template": ""}), StatusCode::BAD_REQUEST),
        (json!({"token": "0".repeat(32), "template": "x"}), StatusCode::NOT_FOUND),
    ] {
        let (s, v) = h.call("POST", &path, None, Some(body.clone())).await;
        assert_eq!(s, status, "{body}: {v}");
    }
    let (s, v) = h.call("POST", "/v1/claim", None, Some(json!({"template": "base", "require_promoted": true}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    // A pool keeps it warm (after a restart, as a PUT would): its clones start from it.
    let (node, app) = h.restart(&[("base", 1), ("my-agent", 1)]).await;
    wait_for("the promoted pool to fill", || {
        node.info().pools.iter().any(|p| p.key.template == "my-agent" && p.warm == 1)
    })
    .await;
    let (s, g) = call(
        &app,
        "POST",
        "/v1/claim",
        None,
        Some(json!({"template": "my-agent", "require_promoted": true}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{g}");
    assert_eq!(g["template_digest"], digest.as_str());
    let vm = node.sandbox(g["id"].as_str().expect("id")).expect("claim").vm.expect("vm");
    assert!(vm.restored_from.as_deref().is_some_and(|d| d.ends_with("templates/my-agent")), "{vm:?}");
    // While pooled: neither replaced nor deleted.
    let c2 = node.sandbox(c["id"].as_str().expect("id")).expect("claim");
    let (s, _) =
        call(&app, "POST", &path, None, Some(json!({"token": c2.rec.token, "template": "my-agent"}).to_string())).await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, _) = call(&app, "DELETE", "/v1/templates?template=my-agent&net=none&size=small", None, None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    drop((node, app));
    let (_node, app) = h.restart(&[("base", 1)]).await;
    let (s, _) = call(&app, "DELETE", "/v1/templates?template=my-agent", None, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(&app, "DELETE", "/v1/templates?template=my-agent", None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

//! Secure by default, over the fake driver: auth on every route, the node budget, the lease
//! horizon, per-claim caps (hit and freed), exec timeouts, the body deadline, relay idle
//! timeouts, the HTTP server's connection cap and head timeout, TLS (claims and upgrades), and
//! the modes of the data dir. Each cap has a test that hits it.

use std::os::unix::fs::PermissionsExt as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use sandboxd::limits::Budget;
use sandboxd::slots::ClaimCaps;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tower::ServiceExt as _;

use super::relay::{frame, head, read_error, serve, SWITCHING};
use super::{call, deadline_secs_from_now, key_str, start, start_with, wait_for, wait_warm, warm, H, ROOT};

/// One request through the router, with an optional `Upgrade` header.
async fn req(
    app: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
    upgrade: Option<&str>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    if let Some(u) = upgrade {
        b = b.header("connection", "Upgrade").header("upgrade", u);
    }
    let body = body.map_or_else(Body::empty, |v| Body::from(v.to_string()));
    let resp = app.clone().oneshot(b.body(body).expect("request")).await.expect("infallible");
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

fn ok(s: StatusCode) -> bool {
    s.is_success() || s == StatusCode::SWITCHING_PROTOCOLS
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Root token when one is configured; open otherwise.
    Node,
    /// Root token; refused (403) on a node without one.
    RootOnly,
    /// The sandbox's token (or root).
    Sandbox,
    /// Nothing.
    Open,
}

/// A route to try: method, path, body, `Upgrade` protocol, kind.
type Route = (&'static str, String, Option<Value>, Option<&'static str>, Kind);

/// Every route of the API but release (which ends the sandbox; checked on its own), fork and
/// checkpoint (the sandbox token goes in their body: `fork_is_all_or_nothing…` and
/// `checkpoints_are_claimed…` feed them wrong and foreign tokens).
fn routes(id: &str) -> Vec<Route> {
    use Kind::*;
    vec![
        ("POST", "/v1/claim".into(), Some(json!({"template": "base"})), None, Node),
        ("GET", "/v1/sandboxes".into(), None, None, Node),
        ("GET", "/v1/sandboxes?claim_ref=x".into(), None, None, Node),
        ("GET", format!("/v1/sandboxes/{id}"), None, None, Node),
        ("GET", format!("/v1/sandboxes/{id}/stats"), None, None, Node),
        ("GET", "/v1/info".into(), None, None, Node),
        ("GET", "/v1/pools".into(), None, None, Node),
        ("PUT", "/v1/pools".into(), Some(json!({"pools": [{"template": "base", "warm": 4}]})), None, RootOnly),
        ("GET", "/v1/peers".into(), None, None, Node),
        ("PUT", "/v1/peers".into(), Some(json!({"peers": [], "ttl_seconds": 30})), None, RootOnly),
        ("GET", "/metrics".into(), None, None, Node),
        ("POST", "/v1/drain".into(), None, None, Node),
        ("DELETE", "/v1/drain".into(), None, None, Node),
        ("GET", "/healthz".into(), None, None, Open),
        ("POST", format!("/v1/sandboxes/{id}/renew"), Some(json!({"ttl_seconds": 600})), None, Sandbox),
        ("GET", format!("/v1/sandboxes/{id}/owner"), None, None, Sandbox),
        ("GET", format!("/v1/sandboxes/{id}/agent"), None, Some("silkd"), Sandbox),
        ("GET", format!("/v1/sandboxes/{id}/ports/7"), None, Some("tcp"), Sandbox),
        ("POST", format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["echo", "x"]})), None, Sandbox),
        ("GET", format!("/v1/sandboxes/{id}/console?tailLines=5"), None, None, Sandbox),
        ("GET", "/v1/checkpoints".into(), None, None, Node),
        // Last: a hibernated sandbox wakes on the next guest call, but not on the routes above.
        ("POST", format!("/v1/sandboxes/{id}/hibernate"), None, None, Sandbox),
        ("POST", format!("/v1/sandboxes/{id}/wake"), None, None, Sandbox),
    ]
}

/// Every route × {no token, a wrong token, another sandbox's token, the right token}, with a
/// root token configured and without one (loopback development).
#[tokio::test]
async fn auth_on_every_route() {
    for root in [Some(ROOT), None] {
        let h = start(&[("base", 4)], root).await;
        wait_warm(&h.node, "base", 4).await;
        let a = h.claim(json!({"template": "base", "ttl_seconds": 600})).await;
        let b = h.claim(json!({"template": "base", "ttl_seconds": 600})).await;
        let (a_id, a_tok) = (a["id"].as_str().expect("id"), a["token"].as_str().expect("token"));
        let b_tok = b["token"].as_str().expect("token");
        wait_warm(&h.node, "base", 4).await;
        for (method, path, body, upgrade, kind) in routes(a_id) {
            let right = match kind {
                Kind::Sandbox => a_tok,
                _ => root.unwrap_or("anything"),
            };
            let cases =
                [("no token", None), ("a wrong token", Some("wrong")), ("another sandbox's token", Some(b_tok))];
            for (what, token) in cases {
                let (s, v) = req(&h.app, method, &path, token, body.as_ref(), upgrade).await;
                let ctx = format!("{method} {path} with {what} (root configured: {})", root.is_some());
                match (kind, root, token) {
                    (Kind::Open, ..) | (Kind::Node, None, _) => assert!(ok(s), "{ctx}: {s} {v}"),
                    (Kind::RootOnly, None, _) => {
                        assert_eq!(s, StatusCode::FORBIDDEN, "{ctx}: {v}");
                        assert!(v["error"].as_str().expect("msg").contains("api_token_file"), "{ctx}: {v}");
                    }
                    (Kind::Node | Kind::RootOnly, Some(_), None) | (Kind::Sandbox, _, None) => {
                        assert_eq!(
                            (s, v),
                            (StatusCode::UNAUTHORIZED, json!({"error": "missing bearer token"})),
                            "{ctx}"
                        )
                    }
                    (Kind::Node | Kind::RootOnly, Some(_), Some(_)) => {
                        assert_eq!((s, v), (StatusCode::UNAUTHORIZED, json!({"error": "invalid api token"})), "{ctx}")
                    }
                    // A wrong token and another sandbox's token look exactly like an unknown id.
                    (Kind::Sandbox, _, Some(_)) => {
                        assert_eq!(s, StatusCode::NOT_FOUND, "{ctx}: {v}");
                        let want = if path.ends_with("/owner") { "not owned here" } else { "sandbox not found" };
                        assert_eq!(v, json!({"error": want}), "{ctx}");
                    }
                }
            }
            let (s, v) = req(&h.app, method, &path, Some(right), body.as_ref(), upgrade).await;
            let ctx = format!("{method} {path} with the right token (root configured: {})", root.is_some());
            match (kind, root) {
                (Kind::RootOnly, None) => assert_eq!(s, StatusCode::FORBIDDEN, "{ctx}: {v}"),
                _ => assert!(ok(s), "{ctx}: {s} {v}"),
            }
            // Root may act on any sandbox, as the spec's root token allows.
            if let (Kind::Sandbox, Some(r)) = (kind, root) {
                let (s, v) = req(&h.app, method, &path, Some(r), body.as_ref(), upgrade).await;
                assert!(ok(s), "{method} {path} with the root token: {s} {v}");
            }
        }
        // Unknown ids answer like wrong tokens.
        let (s, _) = req(&h.app, "POST", "/v1/sandboxes/sb_0000000000000000/renew", Some(a_tok), None, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        // Release last: wrong tokens are 404 and leave the sandbox alone; the right one ends it.
        let release = format!("/v1/sandboxes/{a_id}/release");
        for t in [Some("wrong"), Some(b_tok)] {
            let (s, _) = req(&h.app, "POST", &release, t, None, None).await;
            assert_eq!(s, StatusCode::NOT_FOUND);
        }
        let (s, _) = req(&h.app, "POST", &release, None, None, None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert!(h.node.sandbox(a_id).is_some(), "a refused release ended the sandbox");
        let (s, _) = req(&h.app, "POST", &release, Some(a_tok), None, None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        if let Some(r) = root {
            let b_release = format!("/v1/sandboxes/{}/release", b["id"].as_str().expect("id"));
            let (s, _) = req(&h.app, "POST", &b_release, Some(r), None, None).await;
            assert_eq!(s, StatusCode::NO_CONTENT, "root releases any sandbox");
            let (_, m) = req(&h.app, "GET", "/metrics", Some(r), None, None).await;
            assert!(m.as_str().expect("text").contains("sandboxd_auth_failures_total "), "{m}");
        }
    }
}

/// `PUT /v1/pools` over the budget is a 422 naming the limit and the numbers; nothing changes,
/// nothing is persisted, and a restart brings back the pools that were in force.
#[tokio::test]
async fn put_pools_over_the_budget_is_refused_and_nothing_is_persisted() {
    let h = start_with(&[("base", 2)], Some(ROOT), |o| {
        o.limits.budget = Budget { max_vms: 4, max_memory_mib: 4096, max_disk_mib: 1 << 20 };
    })
    .await;
    wait_warm(&h.node, "base", 2).await;
    let (s, v) =
        h.call("PUT", "/v1/pools", Some(ROOT), Some(json!({"pools": [{"template": "base", "warm": 3}]}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let pools_json = h.dir.path().join("data/pools.json");
    let before = std::fs::read(&pools_json).expect("pools.json");
    let configs = h.node.pool_configs();
    let (s, v) =
        h.call("PUT", "/v1/pools", Some(ROOT), Some(json!({"pools": [{"template": "base", "warm": 100_000}]}))).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let msg = v["error"].as_str().expect("msg");
    assert!(msg.contains("100000 VMs") && msg.contains("max_vms = 4"), "{msg}");
    let big = json!({"pools": [{"template": "base", "warm": 1}, {"template": "rt", "size": "large", "warm": 1}]});
    let (s, v) = h.call("PUT", "/v1/pools", Some(ROOT), Some(big)).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let msg = v["error"].as_str().expect("msg");
    assert!(msg.contains("4608 MiB") && msg.contains("max_memory_mib = 4096"), "{msg}");
    assert_eq!(std::fs::read(&pools_json).expect("pools.json"), before, "pools.json changed");
    assert_eq!(h.node.pool_configs(), configs);
    assert_eq!(h.node.info().pools.iter().map(|p| p.target).collect::<Vec<_>>(), vec![3]);
    let (node2, _) = h.restart(&[("base", 2)]).await;
    assert_eq!(
        node2.info().pools.iter().map(|p| (key_str(&p.key), p.target)).collect::<Vec<_>>(),
        vec![("base|none|small".to_string(), 3)]
    );
}

/// Warm + refilling + claimed VMs (golden builders included) never exceed the budget: refill
/// stops at it and says so; a release frees room and refill resumes.
#[tokio::test]
async fn refill_stops_at_the_budget() {
    let h = start_with(&[("base", 2), ("rt", 2)], None, |o| {
        o.limits.budget = Budget { max_vms: 3, max_memory_mib: 8192, max_disk_mib: 1 << 20 };
    })
    .await;
    let (stop, most) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let watcher = {
        let (d, stop, most) = (h.driver.clone(), Arc::clone(&stop), Arc::clone(&most));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                most.fetch_max(d.live().len(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let total = |h: &H| warm(&h.node, "base") + warm(&h.node, "rt");
    wait_for("3 warm VMs and at_capacity", || total(&h) == 3 && h.node.info().at_capacity).await;
    let info = h.node.info();
    let reason = info.at_capacity_reason.clone().expect("reason");
    assert!(reason.contains("node budget reached (max_vms = 3)"), "{reason}");
    assert_eq!((info.budget.vms, info.budget.max_vms), (3, 3), "{info:?}");
    let (_, m) = h.call("GET", "/metrics", None, None).await;
    let m = m.as_str().expect("text").to_string();
    assert!(m.contains("sandboxd_budget_vms 3") && m.contains("sandboxd_budget_max_vms 3"), "{m}");
    assert!(!m.contains("sandboxd_refill_budget_blocked_total 0"), "{m}");
    // A claim moves a VM: nothing is refilled past the budget.
    let template = if warm(&h.node, "base") > 0 { "base" } else { "rt" };
    let c = h.claim(json!({"template": template})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(total(&h), 2, "refilled past the budget");
    assert_eq!(h.node.usage().vms, 3);
    // A release frees one: refill takes it.
    let path = format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id"));
    let (s, _) = h.call("POST", &path, c["token"].as_str(), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    wait_for("refill after the release", || total(&h) == 3).await;
    stop.store(true, Ordering::Relaxed);
    watcher.await.expect("watcher");
    assert!(most.load(Ordering::Relaxed) <= 3, "{} VMs were alive at once", most.load(Ordering::Relaxed));
}

/// Each VM counts the most its writable overlay can grow to against `max_disk_mib`: refill
/// stops there, says which limit, and `/v1/info` and `/metrics` show the disk held.
#[tokio::test]
async fn refill_stops_at_the_disk_budget() {
    let images = tempfile::tempdir().expect("tempdir");
    let base = images.path().join("overlay.ext4");
    std::fs::File::create(&base).expect("create").set_len(100 << 20).expect("len");
    let each = vmm::disk::mib_ceil(vmm::disk::cap_for_virtual_size(100 << 20));
    let h = start_with(&[("base", 5)], None, |o| {
        o.catalog.templates.get_mut("base").expect("base").overlay_base = Some(base.clone());
        // Room for two overlays and a half: two VMs, never a third.
        o.limits.budget = Budget { max_vms: 64, max_memory_mib: 1 << 20, max_disk_mib: each * 5 / 2 };
    })
    .await;
    wait_for("2 warm VMs and at_capacity", || warm(&h.node, "base") == 2 && h.node.info().at_capacity).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.driver.live().len(), 2, "booted past the disk budget");
    let info = h.node.info();
    let reason = info.at_capacity_reason.clone().expect("reason");
    assert!(reason.contains(&format!("max_disk_mib = {}", each * 5 / 2)), "{reason}");
    assert_eq!(info.budget.disk_mib, 2 * each, "{info:?}");
    let (_, m) = h.call("GET", "/metrics", None, None).await;
    let m = m.as_str().expect("text").to_string();
    assert!(m.contains(&format!("sandboxd_budget_disk_mib {}", 2 * each)), "{m}");
    // A claim keeps its VM's disk counted; its release frees the room and refill resumes.
    let c = h.claim(json!({"template": "base"})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.driver.live().len(), 2, "refilled past the disk budget");
    let path = format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id"));
    let (s, _) = h.call("POST", &path, c["token"].as_str(), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    wait_for("refill after the release", || warm(&h.node, "base") == 2).await;
    assert_eq!(h.driver.live().len(), 2);
}

/// A claim-and-renew loop stops at the lease horizon, with a 409 naming it.
#[tokio::test]
async fn renew_stops_at_the_lease_horizon() {
    let h = start_with(&[("base", 1)], None, |o| o.limits.max_lifetime = Duration::from_secs(2)).await;
    wait_warm(&h.node, "base", 1).await;
    let t0 = Instant::now();
    let c = h.claim(json!({"template": "base", "ttl_seconds": 600})).await;
    assert!(deadline_secs_from_now(&c) <= 2, "the first lease is capped by the horizon: {c}");
    let renew = format!("/v1/sandboxes/{}/renew", c["id"].as_str().expect("id"));
    let token = c["token"].as_str();
    // The default TTL (300 s) is past the horizon at once.
    let (s, v) = h.call("POST", &renew, token, None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let msg = v["error"].as_str().expect("msg");
    assert!(msg.contains("max_lifetime_secs = 2") && msg.contains("renew refused"), "{msg}");
    let mut renewed = 0;
    let refused_after = loop {
        let (s, v) = h.call("POST", &renew, token, Some(json!({"ttl_seconds": 1}))).await;
        match s {
            StatusCode::OK => renewed += 1,
            StatusCode::CONFLICT => break t0.elapsed(),
            other => panic!("renew answered {other}: {v}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the loop never hit the horizon");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(renewed >= 3, "only {renewed} renewals before the horizon");
    assert!(refused_after >= Duration::from_millis(900), "refused too early: {refused_after:?}");
    // The lease still ends at the horizon, and the reaper takes it.
    wait_for("the reaper", || h.node.claimed() == 0).await;
}

/// `/exec` without a timeout gets the default; over the maximum is a 400; a claim's concurrent
/// execs are capped (429) and the slot comes back when the exec ends.
#[tokio::test]
async fn exec_timeouts_and_cap() {
    let h = start_with(&[("base", 1)], None, |o| {
        o.limits.exec.default = Duration::from_millis(300);
        o.limits.exec.max = Duration::from_secs(2);
        o.limits.caps = ClaimCaps { agent_relays: 16, port_relays: 16, execs: 1 };
    })
    .await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let id = c["id"].as_str().expect("id").to_string();
    let path = format!("/v1/sandboxes/{id}/exec");
    let token = c["token"].as_str().expect("token").to_string();
    let t = Instant::now();
    let (s, v) = h.call("POST", &path, Some(&token), Some(json!({"argv": ["sleep"]}))).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{v}");
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let (s, v) = h.call("POST", &path, Some(&token), Some(json!({"argv": ["sleep"], "timeout_seconds": 0}))).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "0 is the default, not forever: {v}");
    let (s, v) = h.call("POST", &path, Some(&token), Some(json!({"argv": ["echo"], "timeout_seconds": 3}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"], "timeout_seconds 3 is over the maximum of 2 s (exec_max_timeout_secs)");
    // The cap: one exec in flight, the next refused, then free again.
    let long = {
        let (app, path, token) = (h.app.clone(), path.clone(), token.clone());
        tokio::spawn(async move {
            call(&app, "POST", &path, Some(&token), Some(json!({"argv": ["sleep"], "timeout_seconds": 1}).to_string()))
                .await
        })
    };
    wait_for("the exec to hold its slot", || h.node.open_uses(&id)[2] == 1).await;
    let (s, v) = h.call("POST", &path, Some(&token), Some(json!({"argv": ["echo", "x"]}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(
        v["error"],
        "too many concurrent /exec calls for this sandbox: 1 already open (max_execs_per_claim = 1)"
    );
    let (s, _) = long.await.expect("join");
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(h.node.open_uses(&id), [0, 0, 0]);
    let (s, v) = h.call("POST", &path, Some(&token), Some(json!({"argv": ["echo", "x"]}))).await;
    assert_eq!((s, v["stdout"].as_str()), (StatusCode::OK, Some("x\n")));
}

/// Nothing a client starts outlives it: an `/exec` whose client hangs up has its child killed
/// in the guest (the agent itself would let it run), and its slot comes back.
#[tokio::test]
async fn an_exec_whose_client_leaves_has_its_child_killed() {
    let h = start_with(&[("base", 1)], None, |o| {
        o.limits.exec.default = Duration::from_secs(60);
        o.limits.exec.max = Duration::from_secs(120);
    })
    .await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let id = c["id"].as_str().expect("id").to_string();
    let path = format!("/v1/sandboxes/{id}/exec");
    let token = c["token"].as_str().expect("token").to_string();
    let client = {
        let (app, path, token) = (h.app.clone(), path.clone(), token.clone());
        tokio::spawn(async move {
            call(&app, "POST", &path, Some(&token), Some(json!({"argv": ["sleep"]}).to_string())).await
        })
    };
    wait_for("the exec child to run", || h.driver.running_procs() == 1).await;
    client.abort();
    wait_for("the child of the abandoned exec to be killed", || h.driver.running_procs() == 0).await;
    wait_for("the exec slot to come back", || h.node.open_uses(&id) == [0, 0, 0]).await;
}

async fn upgrade(addr: std::net::SocketAddr, path: &str, proto: &str, token: &str) -> BufReader<TcpStream> {
    let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    r.get_mut().write_all(head(path, Some(proto), token).as_bytes()).await.expect("write");
    r
}

async fn switched<R: AsyncRead + Unpin>(r: &mut R, proto: &str) {
    let want = format!("HTTP/1.1 101 Switching Protocols\r\nUpgrade: {proto}\r\nConnection: Upgrade\r\n\r\n");
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(5), r.read_exact(&mut got)).await.expect("101 in time").expect("101");
    assert_eq!(String::from_utf8_lossy(&got), want);
}

/// Per-claim relay caps: the next relay is a 429 naming the cap; closing one frees its slot.
#[tokio::test]
async fn relay_caps_are_hit_and_freed() {
    let h = start_with(&[("base", 1)], None, |o| {
        o.limits.caps = ClaimCaps { agent_relays: 2, port_relays: 1, execs: 8 };
    })
    .await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let addr = serve(&h).await;
    let (id, token) = (c["id"].as_str().expect("id").to_string(), c["token"].as_str().expect("token").to_string());
    let agent = format!("/v1/sandboxes/{id}/agent");
    let mut a1 = upgrade(addr, &agent, "silkd", &token).await;
    switched(&mut a1, "silkd").await;
    let mut a2 = upgrade(addr, &agent, "silkd", &token).await;
    switched(&mut a2, "silkd").await;
    let mut a3 = upgrade(addr, &agent, "silkd", &token).await;
    let (code, body) = read_error(&mut a3).await;
    assert_eq!(code, 429, "{body}");
    assert_eq!(
        body["error"],
        "too many concurrent /agent relays for this sandbox: 2 already open (max_agent_relays_per_claim = 2)"
    );
    // The open relays still work.
    a2.get_mut().write_all(b"{\"v\":1,\"op\":\"info\"}\n").await.expect("write");
    assert_eq!(frame(&mut a2).await["type"], "info");
    drop(a1);
    wait_for("the closed relay's slot", || h.node.open_uses(&id)[0] == 1).await;
    let mut a4 = upgrade(addr, &agent, "silkd", &token).await;
    switched(&mut a4, "silkd").await;

    let ports = format!("/v1/sandboxes/{id}/ports/7");
    let mut p1 = upgrade(addr, &ports, "tcp", &token).await;
    switched(&mut p1, "tcp").await;
    let mut p2 = upgrade(addr, &ports, "tcp", &token).await;
    let (code, body) = read_error(&mut p2).await;
    assert_eq!(code, 429, "{body}");
    assert!(body["error"].as_str().expect("msg").contains("max_port_relays_per_claim = 1"), "{body}");
    // Half-close: the guest echo ends, the relay ends, the slot is freed.
    p1.get_mut().shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), p1.read_to_end(&mut rest)).await.expect("eof").expect("read");
    wait_for("the ended port relay's slot", || h.node.open_uses(&id)[1] == 0).await;
    let mut p3 = upgrade(addr, &ports, "tcp", &token).await;
    switched(&mut p3, "tcp").await;
    let (_, m) = h.call("GET", "/metrics", None, None).await;
    let m = m.as_str().expect("text");
    assert!(m.contains("sandboxd_relays_refused_total{kind=\"agent\"} 1"), "{m}");
    assert!(m.contains("sandboxd_relays_refused_total{kind=\"port\"} 1"), "{m}");
}

/// A relay with no byte either way for `relay_idle_timeout_secs` is closed and frees its slot;
/// a relay that keeps talking stays open past it.
#[tokio::test]
async fn idle_relays_are_closed_busy_ones_are_not() {
    let idle = Duration::from_millis(400);
    let h = start_with(&[("base", 1)], None, |o| o.limits.http.relay_idle = idle).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let addr = serve(&h).await;
    let (id, token) = (c["id"].as_str().expect("id").to_string(), c["token"].as_str().expect("token").to_string());
    let agent = format!("/v1/sandboxes/{id}/agent");
    // Idle: closed by the server after the idle timeout.
    for (path, proto) in [(agent.clone(), "silkd"), (format!("/v1/sandboxes/{id}/ports/7"), "tcp")] {
        let mut r = upgrade(addr, &path, proto, &token).await;
        switched(&mut r, proto).await;
        let t = Instant::now();
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut rest)).await.expect("closed").expect("read");
        assert!(t.elapsed() >= idle - Duration::from_millis(50), "closed before the idle timeout: {:?}", t.elapsed());
        assert!(rest.is_empty(), "unsolicited bytes on an idle relay: {rest:?}");
    }
    wait_for("the idle relays' slots", || h.node.open_uses(&id) == [0, 0, 0]).await;
    // Busy: an info round trip every 100 ms keeps it open for three idle periods.
    let mut r = upgrade(addr, &agent, "silkd", &token).await;
    switched(&mut r, "silkd").await;
    let t = Instant::now();
    while t.elapsed() < idle * 3 {
        r.get_mut().write_all(b"{\"v\":1,\"op\":\"info\"}\n").await.expect("write: closed while busy");
        assert_eq!(frame(&mut r).await["type"], "info");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, m) = h.call("GET", "/metrics", None, None).await;
    assert!(m.as_str().expect("text").contains("sandboxd_relays_idle_closed_total 2"), "{m}");
}

/// A body trickled byte by byte is cut off at the body deadline (408), and takes no VM.
#[tokio::test]
async fn slow_bodies_are_cut_off() {
    let h = start_with(&[("base", 1)], None, |o| o.limits.http.body_timeout = Duration::from_millis(300)).await;
    wait_warm(&h.node, "base", 1).await;
    let trickle = futures::stream::unfold(0u32, |n| async move {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Some((Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b" ")), n + 1))
    });
    let request = Request::post("/v1/claim").body(Body::from_stream(trickle)).expect("request");
    let t = Instant::now();
    let resp = h.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
    let v: Value = serde_json::from_slice(&bytes).expect("json");
    assert!(v["error"].as_str().expect("msg").contains("body_timeout_secs"), "{v}");
    assert_eq!(warm(&h.node, "base"), 1);
    assert_eq!(h.node.claimed(), 0);
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).expect("metadata").permissions().mode() & 0o7777
}

/// The data dir is 0700 and every journal file 0600, fresh or left looser by an older version.
#[tokio::test]
async fn data_dir_and_journal_modes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for (name, body) in [
        ("claims.json", r#"{"version":2,"seq":0,"claims":[]}"#),
        ("pools.json", r#"{"pools":[{"template":"base","warm":2}]}"#),
    ] {
        std::fs::write(data.join(name), body).expect("write");
        std::fs::set_permissions(data.join(name), std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    let driver = sandboxd::test_utils::FakeDriver::new(dir.path());
    let node = sandboxd::Node::start(driver, super::opts(&dir, &[("base", 2)], Some(ROOT))).await.expect("start");
    let app = sandboxd::http::app(node.clone());
    wait_warm(&node, "base", 2).await;
    let claim = || call(&app, "POST", "/v1/claim", Some(ROOT), Some(json!({"template": "base"}).to_string()));
    let (_, a) = claim().await;
    let (_, b) = claim().await;
    let renew = format!("/v1/sandboxes/{}/renew", a["id"].as_str().expect("id"));
    let (s, _) = call(&app, "POST", &renew, a["token"].as_str(), None).await;
    assert_eq!(s, StatusCode::OK);
    let release = format!("/v1/sandboxes/{}/release", b["id"].as_str().expect("id"));
    let (s, _) = call(&app, "POST", &release, b["token"].as_str(), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(
        &app,
        "PUT",
        "/v1/pools",
        Some(ROOT),
        Some(json!({"pools": [{"template": "base", "warm": 1}]}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(mode(&data), 0o700, "data dir");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&data).expect("ls") {
        let e = e.expect("entry");
        if e.file_type().expect("type").is_file() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert_eq!(mode(&e.path()), 0o600, "{name}");
            files.push(name);
        }
    }
    files.sort();
    assert_eq!(files, ["claims.json", "claims.log", "pools.json"], "unexpected files in the data dir");
    // Every token in the journal: only the owner can read them.
    let log = std::fs::read_to_string(data.join("claims.log")).expect("log");
    assert!(log.contains(a["token"].as_str().expect("token")));
}

/// The connection cap closes one connection too many at once; a slow request head (slowloris)
/// and an idle connection are cut off at the head timeout; claims go on meanwhile.
#[tokio::test]
async fn connection_cap_and_head_timeout() {
    let h = start_with(&[("base", 1)], None, |o| {
        o.limits.http.max_connections = 8;
        o.limits.http.header_timeout = Duration::from_secs(1);
    })
    .await;
    wait_warm(&h.node, "base", 1).await;
    let addr = serve(&h).await;
    let open = || h.node.conn_stats.open.load(Ordering::Relaxed);
    // The cap.
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    wait_for("8 connections open", || open() == 8).await;
    let mut extra = TcpStream::connect(addr).await.expect("connect");
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_millis(500), extra.read(&mut buf)).await.expect("closed at once");
    assert!(matches!(n, Ok(0) | Err(_)), "the connection over the cap was served: {n:?}");
    assert_eq!(h.node.conn_stats.refused.load(Ordering::Relaxed), 1);
    // Idle connections go at the head timeout.
    for s in &mut idle {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await.expect("idle closed");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    }
    drop(idle);
    wait_for("the idle connections to go", || open() == 0).await;
    // Slowloris: a header line every 200 ms never finishes the head.
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.expect("write");
    let t = Instant::now();
    let cut = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if slow.write_all(b"X-Slow: 1\r\n").await.is_err() {
            break t.elapsed();
        }
        match tokio::time::timeout(Duration::from_millis(1), slow.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break t.elapsed(),
            Ok(Ok(_)) => panic!("the slow head was answered"),
            Err(_) => {}
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the slowloris client was never cut off");
    };
    assert!(cut >= Duration::from_millis(800), "cut before the head timeout: {cut:?}");
    assert!(h.node.conn_stats.timed_out.load(Ordering::Relaxed) >= 9, "idle and slow connections count as timed out");
    // Claims still go through.
    let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    let body = r#"{"template":"base"}"#;
    let req = format!("POST /v1/claim HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    r.get_mut().write_all(req.as_bytes()).await.expect("write");
    let (code, v) = read_error(&mut r).await;
    assert_eq!(code, 200, "{v}");
}

/// 2,000 idle connections do not stop a claim from succeeding within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_block_claims() {
    httpd::raise_nofile_limit().expect("raising RLIMIT_NOFILE");
    let h = start(&[("base", 1)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 1).await;
    let addr = serve(&h).await;
    let mut idle = Vec::with_capacity(2000);
    for _ in 0..2000 {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    wait_for("2000 connections open", || h.node.conn_stats.open.load(Ordering::Relaxed) >= 2000).await;
    let t = Instant::now();
    let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    let body = r#"{"template":"base"}"#;
    let req = format!(
        "POST /v1/claim HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROOT}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    r.get_mut().write_all(req.as_bytes()).await.expect("write");
    let (code, v) = read_error(&mut r).await;
    assert_eq!(code, 200, "{v}");
    assert!(t.elapsed() < Duration::from_secs(1), "the claim took {:?} with 2000 idle connections", t.elapsed());
    drop(idle);
}

async fn tls_connect(
    addr: std::net::SocketAddr,
    cert: &rustls::pki_types::CertificateDer<'static>,
) -> BufReader<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).expect("root");
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.expect("handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]), "ALPN http/1.1");
    BufReader::new(tls)
}

async fn write_all<S: AsyncWrite + Unpin>(s: &mut S, b: &[u8]) {
    s.write_all(b).await.expect("write");
    s.flush().await.expect("flush");
}

/// Over TLS (ALPN http/1.1): a claim, the `/agent` upgrade (the client waits for the 101 before
/// sending, as the SDK does over TLS) and the `/ports` upgrade.
#[tokio::test]
async fn tls_claims_and_upgrades() {
    let h = start(&[("base", 1)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 1).await;
    let pair = httpd::tls::self_signed(&["127.0.0.1".into()]).expect("mint");
    let (chain, key) = httpd::tls::pair_der(&pair).expect("der");
    let cert = chain[0].clone();
    let tls = httpd::tls::server_config(chain, key, httpd::tls::ALPN_HTTP1, None).expect("tls");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(sandboxd::http::serve(l, h.node.clone(), Some(tls), std::future::pending()));

    let mut s = tls_connect(addr, &cert).await;
    let body = r#"{"template":"base"}"#;
    let req = format!(
        "POST /v1/claim HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROOT}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    write_all(s.get_mut(), req.as_bytes()).await;
    let (code, c) = read_error(&mut s).await;
    assert_eq!(code, 200, "{c}");
    let (id, token) = (c["id"].as_str().expect("id"), c["token"].as_str().expect("token"));
    // Keep-alive over TLS: a second request on the same connection.
    write_all(
        s.get_mut(),
        format!("GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROOT}\r\n\r\n").as_bytes(),
    )
    .await;
    let (code, info) = read_error(&mut s).await;
    assert_eq!((code, info["claimed"].as_u64()), (200, Some(1)), "{info}");

    let mut a = tls_connect(addr, &cert).await;
    write_all(a.get_mut(), head(&format!("/v1/sandboxes/{id}/agent"), Some("silkd"), token).as_bytes()).await;
    let mut got = vec![0u8; SWITCHING.len()];
    a.read_exact(&mut got).await.expect("101");
    assert_eq!(got, SWITCHING);
    write_all(a.get_mut(), b"{\"v\":1,\"op\":\"info\"}\n").await;
    assert_eq!(frame(&mut a).await["type"], "info");

    let mut p = tls_connect(addr, &cert).await;
    write_all(p.get_mut(), head(&format!("/v1/sandboxes/{id}/ports/7"), Some("tcp"), token).as_bytes()).await;
    switched(&mut p, "tcp").await;
    write_all(p.get_mut(), b"over-tls").await;
    let mut echo = [0u8; 8];
    p.read_exact(&mut echo).await.expect("echo");
    assert_eq!(&echo, b"over-tls");
}

/// Claims through the plain loopback listener (`local_listen`) name that listener as their
/// owner, so SDK clients stay on the scheme they dialled.
#[tokio::test]
async fn local_listener_names_itself_as_owner() {
    let h = start(&[("base", 1)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 1).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(sandboxd::http::serve_as(l, h.node.clone(), None, Some(addr.to_string()), std::future::pending()));
    let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    let body = r#"{"template":"base"}"#;
    let req = format!(
        "POST /v1/claim HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROOT}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    write_all(r.get_mut(), req.as_bytes()).await;
    let (code, c) = read_error(&mut r).await;
    assert_eq!((code, c["owner_addr"].as_str()), (200, Some(addr.to_string().as_str())), "{c}");
    let path = format!("/v1/sandboxes/{}/owner", c["id"].as_str().expect("id"));
    let req =
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n", c["token"].as_str().expect("t"));
    write_all(r.get_mut(), req.as_bytes()).await;
    let (code, o) = read_error(&mut r).await;
    assert_eq!((code, o), (200, json!({"owner_addr": addr.to_string()})));
    // The router without the override keeps the advertised address.
    let (_, o) = h.call("GET", &path, c["token"].as_str(), None).await;
    assert_eq!(o, json!({"owner_addr": "10.0.0.1:7777"}));
}

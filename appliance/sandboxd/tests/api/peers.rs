//! `PUT /v1/peers` (root), `GET /v1/peers` and the redirect of a warm miss (issue #19).

use super::*;

fn report(peers: Value, ttl: u64) -> Value {
    json!({"peers": peers, "ttl_seconds": ttl})
}

fn base_on(addr: &str, warm: usize) -> Value {
    json!({"addr": addr, "pools": [{"key": {"template": "base", "net": "none", "size": "small"}, "warm": warm}]})
}

#[tokio::test]
async fn a_warm_miss_redirects_to_the_warmest_fresh_peers_and_no_redirect_is_served_here() {
    // No warm VM here (target 0), so every claim is a miss.
    let h = start(&[("base", 0)], Some(ROOT)).await;
    let (s, v) = h.call("GET", "/v1/peers", Some(ROOT), None).await;
    assert_eq!((s, v["peers"].clone()), (StatusCode::OK, json!([])), "a lone box has no peers");
    // A lone box answers as before: the miss is served on demand.
    let alone = h.claim(json!({"template": "base"})).await;
    assert!(alone["id"].as_str().is_some_and(|i| !i.is_empty()), "{alone}");

    let peers = json!([
        base_on("10.0.0.2:7777", 1),
        base_on("10.0.0.3:7777", 3),
        base_on("10.0.0.4:7777", 0),
        base_on("10.0.0.1:7777", 9),
        base_on("10.0.0.5:7777", 2)
    ]);
    let (s, v) = h.call("PUT", "/v1/peers", Some(ROOT), Some(report(peers, 60))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let listed = v["peers"].as_array().expect("peers").len();
    assert_eq!(listed, 4, "the node's own address (10.0.0.1:7777) is no peer: {v}");
    let (_, info) = h.call("GET", "/v1/info", Some(ROOT), None).await;
    assert_eq!(info["peers"].as_array().map(Vec::len), Some(4), "{info}");

    let (s, v) = h.call("POST", "/v1/claim", Some(ROOT), Some(json!({"template": "base"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["redirect"], json!(["10.0.0.3:7777", "10.0.0.5:7777"]), "the two warmest, most first: {v}");
    assert!(v["id"].as_str().unwrap_or_default().is_empty() && v.get("token").is_none_or(|t| t == ""), "{v}");
    // Another pool's miss, or a pool no peer has warm: served here.
    let served = h.claim(json!({"template": "base", "no_redirect": true})).await;
    assert!(served["id"].as_str().is_some_and(|i| !i.is_empty()), "no_redirect is served here: {served}");
    let m = h.node.render_metrics();
    assert!(m.contains("sandboxd_claims_total{result=\"redirected\",tier=\"\"} 1"), "{m}");
}

#[tokio::test]
async fn a_report_runs_out_a_warm_pool_is_served_here_and_bad_reports_are_refused() {
    let h = start(&[("base", 1)], Some(ROOT)).await;
    wait_warm(&h.node, "base", 1).await;
    let (s, _) = h.call("PUT", "/v1/peers", Some(ROOT), Some(report(json!([base_on("10.0.0.2:7777", 5)]), 1))).await;
    assert_eq!(s, StatusCode::OK);
    // A warm VM here: no redirect, whatever the peers have.
    let hit = h.claim(json!({"template": "base"})).await;
    assert!(hit["id"].as_str().is_some_and(|i| !i.is_empty()), "{hit}");
    // The report runs out: the box is alone again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (_, v) = h.call("GET", "/v1/peers", Some(ROOT), None).await;
    assert_eq!(v["peers"], json!([]), "{v}");
    let (s, v) = h.call("POST", "/v1/claim", Some(ROOT), Some(json!({"template": "base"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v.get("redirect").is_none(), "no redirect on a stale report: {v}");
    for (bad, why) in [
        (report(json!([]), 0), "ttl_seconds"),
        (report(json!([{"addr": "", "pools": []}]), 5), "address"),
        (
            report(json!([{"addr": "a:1", "pools": [{"key": {"template": "", "net": "", "size": ""}, "warm": 1}]}]), 5),
            "pool key",
        ),
        (json!({"peers": [], "ttl_seconds": 5, "extra": 1}), "unknown field"),
    ] {
        let (s, v) = h.call("PUT", "/v1/peers", Some(ROOT), Some(bad)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert!(v["error"].as_str().is_some_and(|e| e.contains(why)), "{why}: {v}");
    }
}

#[tokio::test]
async fn every_cap_of_a_report_is_hit_and_refused_and_extremes_do_not_panic() {
    let h = start(&[("base", 0)], Some(ROOT)).await;
    let put = |body: Value| h.call("PUT", "/v1/peers", Some(ROOT), Some(body));
    // MAX_PEERS (1024) peers are taken, one more is refused.
    let many =
        |n: usize| Value::Array((0..n).map(|i| base_on(&format!("10.1.{}.{}:7777", i / 256, i % 256), 1)).collect());
    let (s, v) = put(report(many(1024), 60)).await;
    assert_eq!((s, v["peers"].as_array().map(Vec::len)), (StatusCode::OK, Some(1024)), "{v}");
    let (s, v) = put(report(many(1025), 60)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("more than 1024 peers")), "{v}");
    // An address of 512 bytes is taken, 513 refused.
    let long = |n: usize| format!("{}:1", "a".repeat(n - 2));
    let (s, v) = put(report(json!([base_on(&long(512), 1)]), 60)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = put(report(json!([base_on(&long(513), 1)]), 60)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("address")), "{v}");
    // 256 pools on one peer are taken, 257 refused.
    let pools = |n: usize| -> Value {
        let p: Vec<Value> = (0..n)
            .map(|i| json!({"key": {"template": format!("t{i}"), "net": "none", "size": "small"}, "warm": 1}))
            .collect();
        json!([{"addr": "10.0.0.9:7777", "pools": p}])
    };
    let (s, v) = put(report(pools(256), 60)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = put(report(pools(257), 60)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("more than 256 pools")), "{v}");
    // The largest counts, a key listed twice and the longest ttl: no overflow, no panic; the
    // ttl is held at a day.
    let max = usize::MAX;
    let key = json!({"template": "base", "net": "none", "size": "small"});
    let extreme = json!([
        {"addr": "10.0.0.7:7777", "pools": [{"key": key, "warm": max}, {"key": key, "warm": max}, {"key": key, "warm": 1}]},
        {"addr": "10.0.0.8:7777", "pools": [{"key": key, "warm": max}], "ttl_seconds": u64::MAX}
    ]);
    let (s, v) = put(report(extreme, u64::MAX)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, v) = h.call("POST", "/v1/claim", Some(ROOT), Some(json!({"template": "base"}))).await;
    assert_eq!(v["redirect"], json!(["10.0.0.7:7777", "10.0.0.8:7777"]), "{v}");
}

#[tokio::test]
async fn the_own_address_padded_is_no_peer_and_a_peer_near_staleness_runs_out_first() {
    let h = start(&[("base", 0)], Some(ROOT)).await;
    let own = h.node.advertise_addr().to_owned();
    assert!(!own.is_empty(), "the harness advertises an address");
    let mut near = base_on("10.0.0.3:7777", 1);
    near["ttl_seconds"] = json!(1);
    let peers = json!([base_on(&format!(" {own} "), 5), base_on("10.0.0.2:7777", 1), near]);
    let (s, v) = h.call("PUT", "/v1/peers", Some(ROOT), Some(report(peers, 60))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["peers"], json!(["10.0.0.2:7777", "10.0.0.3:7777"]), "the own address, padded, is left out: {v}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (_, v) = h.call("GET", "/v1/peers", Some(ROOT), None).await;
    assert_eq!(v["peers"], json!(["10.0.0.2:7777"]), "the peer whose own ttl ran out is gone, the rest hold: {v}");
}

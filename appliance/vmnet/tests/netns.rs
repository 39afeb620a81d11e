//! Root-only: the bridge and TAPs are made inside a network namespace this test creates itself
//! (`ip netns add`, deleted on drop), checked with `ip -j` inside it, and shown absent from the
//! root namespace. Run with `cargo test -p vmnet --features netns-tests` (as root); without the
//! feature these tests are reported as ignored, with the reason.

mod support;

use std::net::Ipv4Addr;

use support::{ip_in, ipv4_addrs, link_json, TestNetns};
use vmnet::{NetConfig, Network, VmnetError};

fn unique_bridge() -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("vt{:08x}", nanos ^ std::process::id())
}

#[tokio::test]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates a netns: cargo test -p vmnet --features netns-tests"
)]
async fn bridge_and_tap_live_in_the_test_netns_only() {
    let ns = TestNetns::new("br");
    let dir = tempfile::tempdir().expect("tmp");
    let bridge = unique_bridge();
    let cfg = NetConfig {
        bridge: bridge.clone(),
        netns: Some(ns.name.clone()),
        ..NetConfig::new("10.88.0.0/24".parse().expect("cidr"), dir.path().join("leases.json"))
    };
    let net = Network::ensure(&cfg).await.expect("ensure");
    Network::ensure(&cfg).await.expect("ensure is idempotent");

    let br = link_json(Some(&ns.name), &bridge).expect("bridge exists in the netns");
    assert_eq!(br["linkinfo"]["info_kind"], "bridge", "{br}");
    assert!(br["flags"].as_array().expect("flags").iter().any(|f| f == "UP"), "bridge is up: {br}");
    assert_eq!(ipv4_addrs(&ns.name, &bridge), vec!["10.88.0.1/24".to_string()], "gateway address, once");
    assert!(link_json(None, &bridge).is_none(), "bridge {bridge} leaked into the root netns");

    let lease = net.allocate("vk-default-web-0").expect("lease");
    assert_eq!(lease.ip, Ipv4Addr::new(10, 88, 0, 2));
    net.create_tap(&lease).await.expect("create tap");
    net.create_tap(&lease).await.expect("create_tap is idempotent while no QEMU holds it");
    let tap = link_json(Some(&ns.name), &lease.tap).expect("tap exists in the netns");
    assert_eq!(tap["linkinfo"]["info_kind"], "tun", "{tap}");
    assert_eq!(tap["linkinfo"]["info_data"]["type"], "tap", "{tap}");
    assert_eq!(tap["linkinfo"]["info_data"]["persist"], true, "{tap}");
    assert_eq!(tap["master"], bridge.as_str(), "enslaved to the bridge: {tap}");
    assert!(tap["flags"].as_array().expect("flags").iter().any(|f| f == "UP"), "tap is up: {tap}");
    assert!(link_json(None, &lease.tap).is_none(), "tap {} leaked into the root netns", lease.tap);
    assert_eq!(tap["linkinfo"]["info_slave_data"]["learning"], false, "learning off: {tap}");
    let fdb = support::fdb_static(&ns.name, &lease.tap);
    assert_eq!(fdb, vec![lease.mac.to_string()], "the lease's MAC is pinned to its TAP");

    // What we did not make is never deleted, and a non-bridge is never used as the bridge.
    ip_in(&ns.name, &["link", "add", "vt-a", "type", "veth", "peer", "name", "vt-b"]);
    assert!(matches!(net.delete_tap("vt-a").await, Err(VmnetError::Config(_))));
    assert!(matches!(net.delete_tap("lo").await, Err(VmnetError::Config(_))));
    assert!(link_json(Some(&ns.name), "vt-a").is_some());
    let not_a_bridge = NetConfig { bridge: "vt-a".into(), ..cfg.clone() };
    assert!(matches!(Network::ensure(&not_a_bridge).await, Err(VmnetError::Config(_))));

    assert!(net.delete_tap(&lease.tap).await.expect("delete"), "deleted");
    assert!(!net.delete_tap(&lease.tap).await.expect("delete again"), "already gone");
    assert!(link_json(Some(&ns.name), &lease.tap).is_none());
    assert_eq!(net.release("vk-default-web-0").expect("release"), Some(lease));
}

#[tokio::test]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates a netns: cargo test -p vmnet --features netns-tests"
)]
async fn tap_without_bridge_is_a_clear_error_and_run_in_sees_the_netns() {
    let ns = TestNetns::new("nob");
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = NetConfig {
        bridge: unique_bridge(),
        netns: Some(ns.name.clone()),
        ..NetConfig::new("10.89.0.0/29".parse().expect("cidr"), dir.path().join("leases.json"))
    };
    let net = Network::new(cfg).expect("net");
    let lease = net.allocate("a").expect("lease");
    assert!(matches!(net.create_tap(&lease).await, Err(VmnetError::Config(m)) if m.contains("ensure")));
    assert!(link_json(Some(&ns.name), &lease.tap).is_none(), "no TAP made without its bridge");

    // Code run through run_in sees only the test netns's links (just `lo`).
    ip_in(&ns.name, &["link", "add", "marker0", "type", "veth", "peer", "name", "marker1"]);
    let seen = vmnet::netns::run_in(Some(&ns.name), || async {
        let h = vmnet::link::connect()?;
        Ok((vmnet::link::get(&h, "marker0").await?.is_some(), vmnet::link::get(&h, "lo").await?.is_some()))
    })
    .await
    .expect("run_in");
    assert_eq!(seen, (true, true));
    assert!(link_json(None, "marker0").is_none());
}

//! `net: egress` pools over the fake driver and a real [`vmnet::Network`] inside a network
//! namespace this test creates (root and `nft` needed; otherwise the test says why and passes):
//! every VM of an egress pool gets a lease and a TAP, every destroy gives them back, a restart
//! releases leases no VM holds, and a node without an uplink refuses egress.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandboxd::config::{NetworkConfig, PoolConfig};
use sandboxd::node::{ClaimRequest, Node, NodeOptions};
use sandboxd::pool::PoolKey;
use sandboxd::test_utils::{fake_catalog, FakeDriver};
use test_infra::netns::Netns;
use vmm::Driver as _;

fn usable() -> Option<&'static str> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (network namespaces, TAPs, nft)");
    }
    if std::process::Command::new("nft").arg("--version").output().is_err() {
        return Some("needs nft");
    }
    None
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ip(ns: &str, args: &[&str]) {
    let out = std::process::Command::new("ip").args(["-n", ns]).args(args).output().expect("ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn links(ns: &str) -> String {
    let out = std::process::Command::new("ip").args(["-n", ns, "-o", "link"]).output().expect("ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn egress_pool(warm: usize) -> PoolConfig {
    PoolConfig { net: Some("egress".into()), ..PoolConfig::warm("base", warm) }
}

fn opts(data: &std::path::Path, ns: &str, uplink: Option<&str>) -> NodeOptions {
    let mut o = NodeOptions::new(data, fake_catalog());
    o.timing = sandboxd::test_utils::fast_timing();
    o.pools = vec![egress_pool(2), PoolConfig::warm("base", 1)];
    let section = NetworkConfig {
        netns: Some(ns.to_owned()),
        cidr: Some("10.91.0.0/24".into()),
        bridge: Some("sbxbr0".into()),
        uplink: uplink.map(str::to_owned),
        ..NetworkConfig::default()
    };
    o.network = Some(sandboxd::config::net_config(&section, data).expect("net config"));
    if uplink.is_none() {
        o.pools.truncate(0);
    }
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_vms_get_a_nic_and_give_it_back() {
    if let Some(why) = usable() {
        foundation::testing::skip(why);
        return;
    }
    let ns = Netns::create(&format!("sbx-eg-{}", std::process::id())).expect("netns");
    ip(ns.name(), &["link", "add", "up0", "type", "veth", "peer", "name", "up0p"]);
    ip(ns.name(), &["link", "set", "up0", "up"]);
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    let driver = FakeDriver::new(dir.path());
    let node = Node::start(driver.clone(), opts(&data, ns.name(), Some("up0"))).await.expect("start");
    let net = node.network().expect("network").clone();
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &std::path::Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&data.join("network")), 0o700, "the lease directory is private");
        let leases = data.join("network/leases.json");
        wait_for("the lease file", || leases.exists()).await;
        assert_eq!(mode(&leases), 0o600, "the lease file is 0600");
    }
    let egress = PoolKey::parse("base", Some("egress"), None).expect("key");
    let none = PoolKey::parse("base", None, None).expect("key");
    let warm = |k: &PoolKey| node.pool(k).map_or(0, |p| p.info().warm);
    wait_for("2 warm egress VMs and 1 plain", || warm(&egress) == 2 && warm(&none) == 1).await;

    // Every live VM of the egress pool has a NIC whose lease and TAP exist; the plain one none.
    let live = driver.list().await.expect("list");
    let with_nic: Vec<_> = live.iter().filter(|v| v.spec.nic.is_some()).collect();
    assert_eq!(with_nic.len(), 2, "{live:?}");
    let leases = net.leases().expect("leases");
    assert_eq!(leases.len(), 2, "the golden builder's lease went with it: {leases:?}");
    for v in &with_nic {
        let nic = v.spec.nic.as_ref().expect("nic");
        assert!(nic.tap.starts_with("sb-"), "{}", nic.tap);
        let lease = leases.values().find(|l| l.tap == nic.tap).expect("a lease per NIC");
        assert!(lease.egress && lease.group.is_none(), "egress, isolated: {lease:?}");
        assert_eq!(nic.ip_cidr, format!("{}/24", lease.ip));
        assert!(links(ns.name()).contains(&format!("{}:", nic.tap)), "TAP {} exists", nic.tap);
    }

    // A claim of an egress VM, then its release: TAP and lease go with the VM.
    let grant = node
        .claim(ClaimRequest { key: egress.clone(), ttl: Duration::from_secs(60), claim_ref: None })
        .await
        .expect("egress claim on a node with an uplink");
    let vm = node.sandbox(&grant.id).and_then(|c| c.vm).expect("claimed vm");
    let tap = vm.spec.nic.as_ref().expect("nic").tap.clone();
    node.release(&grant.id).await.expect("release");
    assert!(!net.leases().expect("leases").values().any(|l| l.tap == tap), "lease released");
    assert!(!links(ns.name()).contains(&format!("{tap}:")), "TAP deleted");
    wait_for("the pool refilled", || warm(&egress) == 2).await;

    // A restart: leases no VM holds (a VM gone while sandboxd was down) are released, the
    // warm VMs' leases kept.
    node.shutdown();
    let stale = net.allocate_with("sbx-gone-00000000", &vmnet::VmPolicy { group: None, egress: true }).expect("stale");
    let node2 = Node::start(driver.clone(), opts(&data, ns.name(), Some("up0"))).await.expect("restart");
    wait_for("reconciled", || node2.reconciled()).await;
    let after = net.leases().expect("leases");
    assert!(!after.contains_key("sbx-gone-00000000"), "stale lease {} released: {after:?}", stale.ip);
    let held: Vec<String> =
        driver.list().await.expect("list").iter().filter_map(|v| v.spec.nic.as_ref().map(|n| n.tap.clone())).collect();
    for tap in &held {
        assert!(after.values().any(|l| &l.tap == tap), "a live VM's lease ({tap}) is kept");
    }
    node2.drain().await;
    // The drain destroys every warm VM, and a refill still in flight destroys its VM on landing.
    wait_for("every lease released after the drain", || net.leases().expect("leases").is_empty()).await;
    node2.shutdown();
    let _: Arc<Node> = node2;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_uplink_egress_is_refused_naming_the_key() {
    if let Some(why) = usable() {
        foundation::testing::skip(why);
        return;
    }
    let ns = Netns::create(&format!("sbx-nu-{}", std::process::id())).expect("netns");
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    let driver = FakeDriver::new(dir.path());
    let node = Node::start(driver, opts(&data, ns.name(), None)).await.expect("start");
    assert!(!node.egress());
    let egress = PoolKey::parse("base", Some("egress"), None).expect("key");
    let e = node
        .claim(ClaimRequest { key: egress, ttl: Duration::from_secs(60), claim_ref: None })
        .await
        .expect_err("refused");
    assert!(matches!(e, sandboxd::claims::ClaimError::Egress), "{e:?}");
    assert!(e.to_string().contains("network.uplink"), "{e}");
    let put = node.put_pools(vec![egress_pool(1)]).await.expect_err("an egress pool without an uplink");
    assert!(vmm::error_chain(&put).contains("network.uplink"), "{}", vmm::error_chain(&put));
    node.shutdown();
}

//! Shared by the root-only suites: a network namespace of the test's own, removed on drop, and
//! `ip -j` queries that check what our code did independently of it.
#![allow(dead_code)]

use std::process::Command;

/// Fails the test unless we are root (these suites create namespaces and devices).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "this suite creates network namespaces and TAPs: run it as root");
}

fn ip(args: &[&str]) -> std::process::Output {
    Command::new("ip").args(args).output().expect("running ip (iproute2)")
}

/// A named network namespace (`ip netns add`), deleted with everything in it on drop.
pub struct TestNetns {
    pub name: String,
}

impl TestNetns {
    pub fn new(tag: &str) -> Self {
        require_root();
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let name = format!("vmnet-{tag}-{}-{:05x}", std::process::id(), nanos & 0xfffff);
        let out = ip(&["netns", "add", &name]);
        assert!(out.status.success(), "ip netns add {name}: {}", String::from_utf8_lossy(&out.stderr));
        let ns = TestNetns { name };
        let out = ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        assert!(out.status.success(), "lo up: {}", String::from_utf8_lossy(&out.stderr));
        ns
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let out = ip(&["netns", "del", &self.name]);
        if !out.status.success() {
            eprintln!("WARNING: ip netns del {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// `ip -j -d [-n ns] link show dev <name>` → the link's JSON object, `None` if it does not exist.
pub fn link_json(netns: Option<&str>, name: &str) -> Option<serde_json::Value> {
    let mut args = vec!["-j", "-d"];
    if let Some(ns) = netns {
        args.extend(["-n", ns]);
    }
    args.extend(["link", "show", "dev", name]);
    let out = ip(&args);
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output is JSON");
    v.as_array().and_then(|a| a.first().cloned())
}

/// The IPv4 `address/prefix`es on `name` inside `netns`.
pub fn ipv4_addrs(netns: &str, name: &str) -> Vec<String> {
    let out = ip(&["-j", "-n", netns, "-4", "addr", "show", "dev", name]);
    assert!(out.status.success(), "ip addr show: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or("?"), a["prefixlen"]))
        .collect()
}

/// Runs `ip -n <netns> <args…>` and asserts success.
pub fn ip_in(netns: &str, args: &[&str]) {
    let mut full = vec!["-n", netns];
    full.extend_from_slice(args);
    let out = ip(&full);
    assert!(out.status.success(), "ip {full:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The static (`master static`) FDB MACs on bridge port `dev` inside `netns`.
pub fn fdb_static(netns: &str, dev: &str) -> Vec<String> {
    let out = Command::new("bridge")
        .args(["-j", "-n", netns, "fdb", "show", "dev", dev])
        .output()
        .expect("running bridge (iproute2)");
    assert!(out.status.success(), "bridge fdb show: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["state"] == "static" && e["flags"].as_array().is_none_or(|f| !f.iter().any(|x| x == "self")))
        .filter_map(|e| e["mac"].as_str().map(String::from))
        .collect()
}

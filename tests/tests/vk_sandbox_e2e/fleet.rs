//! Issue #19: a second box on this suite's control plane (its own sandboxd and vk-sandbox, its
//! own node), both publishing `NodeInventory` and warm capacity. The pool `base/none/medium` is
//! warm only on box B (box A, the suite's node, has none): the scheduler puts ten Sandboxes
//! asking for its warm capacity on B, the unmodified SDK pointed at A is redirected to B, and a
//! lookup from A finds the sandbox there. Then B dies (`kill -9` of its sandboxd and provider):
//! its inventory goes stale, A stops naming it, and A's own Pods run on. Throughout, a forged
//! inventory (no Node of its name, the most warm VMs) is never believed.

use std::time::Duration;

use sandboxd_api::{Peers, PoolConfig};
use serde_json::{json, Value};
use test_infra::ensure;
use test_infra::sandboxd::TOKEN;
use test_infra::suite::{poll, Outcome};

use super::{sandbox, Env, BASE, NODE};

/// Box B's node name.
const B_NODE: &str = "vk-e2e-b";
const MEDIUM: &str = "medium";
/// Box B's warm VMs of `base/none/medium`: one per Sandbox of the placement check.
const WARM_B: usize = 10;
/// The extended resource a Pod template asks for to land where `base/none/medium` is warm.
const WARM_MEDIUM: &str = "sandbox.cocoonstack.io/warm-base-none-medium";
const WARM_SMALL: &str = "sandbox.cocoonstack.io/warm-base-none-small";
/// How long inventories, capacities and peers take to follow (a few 2 s publish periods).
const FOLLOW: Duration = Duration::from_secs(60);
/// A NodeInventory no Node vouches for, and the address it names.
const FORGED: &str = "vk-e2e-forged";
const FORGED_ADDR: &str = "127.0.0.1:1";

/// The forged inventory: fresh for over a minute (stamped 50 s ahead, inside the allowed skew),
/// claiming more warm VMs of B's pool than anyone.
fn forged() -> Value {
    let at = humantime::format_rfc3339_seconds(std::time::SystemTime::now() + Duration::from_secs(50)).to_string();
    json!({"apiVersion": "sandbox.cocoonstack.io/v1beta1", "kind": "NodeInventory", "metadata": {"name": FORGED},
        "node": FORGED, "address": FORGED_ADDR, "publishedAt": at,
        "pools": [{"template": BASE, "net": "none", "size": MEDIUM, "warm": 1000, "target": 1000}], "entries": []})
}

/// The vk-sandbox flags of both boxes: publish every 2 s, a peer is stale after 20 s (a loaded
/// TCG box may publish late; the dead-box check waits that long).
pub(super) fn fleet_args() -> Vec<String> {
    ["--publish-inventory", "--publish-interval", "2s", "--inventory-stale-after", "20s"].map(String::from).to_vec()
}

fn inventory(env: &Env, node: &str) -> Result<Option<Value>, String> {
    env.get(&["nodeinventories.sandbox.cocoonstack.io", node])
}

fn warm_of(inv: &Value, size: &str) -> Option<u64> {
    let pools = inv["pools"].as_array()?;
    pools.iter().find(|p| p["template"] == BASE && p["size"] == size).and_then(|p| p["warm"].as_u64())
}

fn entries(inv: &Value) -> usize {
    inv["entries"].as_array().map_or(0, Vec::len)
}

/// The node's allocatable `resource` (0 when absent).
fn allocatable(env: &Env, node: &str, resource: &str) -> Result<u64, String> {
    let n = env.get(&["node", node])?.ok_or(format!("no node {node}"))?;
    Ok(n["status"]["allocatable"][resource].as_str().and_then(|q| q.parse().ok()).unwrap_or(0))
}

/// A Sandbox of `size` that asks for one unit of `resource`.
fn placed(name: &str, size: &str, resource: &str) -> Value {
    let one = json!({ resource: "1" });
    sandbox(
        name,
        json!({"sandbox.cocoonstack.io/template": BASE, "sandbox.cocoonstack.io/size": size}),
        json!({"containers": [{"name": "agent", "image": BASE, "resources": {"requests": one, "limits": one}}]}),
    )
}

pub(super) fn fleet(env: &mut Env, ns: &str) -> Outcome {
    let pools = vec![PoolConfig { size: Some(MEDIUM.into()), ..PoolConfig::warm(BASE, WARM_B) }];
    let mut b = env.add_box(B_NODE, pools, fleet_args())?;
    let (a_addr, b_addr) = (env.sandboxd.addr.clone(), b.sandboxd.addr.clone());
    let result = fleet_with(env, ns, &mut b, &a_addr, &b_addr);
    let _ = env.kubectl(&["delete", "nodeinventories.sandbox.cocoonstack.io", FORGED, "--wait=false"]);
    drop(b);
    // B's Node would linger NotReady; its NodeInventory goes with it (owner reference).
    let _ = env.kubectl(&["delete", "node", B_NODE, "--wait=false"]);
    result
}

fn fleet_with(
    env: &mut Env,
    ns: &str,
    b: &mut test_infra::vk_sandbox::FleetBox,
    a_addr: &str,
    b_addr: &str,
) -> Outcome {
    // 0. A node may write only its own inventory (manifests/nodeinventory-policy.yaml): B's
    //    identity is refused A's name. Then a forged inventory, written by the admin, which the
    //    policy does not bind: the readers must not believe it either.
    let file = env.sandboxd.dir.path().join("forged-as-b.json");
    let mut as_a = forged();
    as_a["metadata"]["name"] = json!(NODE);
    as_a["node"] = json!(NODE);
    std::fs::write(&file, as_a.to_string()).map_err(|e| format!("writing {}: {e}", file.display()))?;
    let user = format!("--as=system:node:{B_NODE}");
    let out = env
        .kubectl(&[
            &user,
            "--as-group=system:nodes",
            "--as-group=system:authenticated",
            "apply",
            "-f",
            &file.to_string_lossy(),
        ])
        .map_err(|e| format!("kubectl: {e}"))?;
    let said = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && said.contains("only the NodeInventory named after itself"),
        "B's identity wrote A's NodeInventory: {said}"
    );
    env.apply(ns, &forged())?;
    // 1. Both boxes publish their inventory and their warm capacity.
    poll("NodeInventory objects of both boxes with their warm VMs", FOLLOW, || {
        let (Some(a), Some(bi)) = (inventory(env, NODE)?, inventory(env, B_NODE)?) else { return Ok(None) };
        let ok = a["address"] == a_addr && bi["address"] == b_addr && warm_of(&bi, MEDIUM) == Some(WARM_B as u64);
        Ok(ok.then_some(()))
    })?;
    poll("B advertises its warm medium VMs, A none", FOLLOW, || {
        let (on_a, on_b) = (allocatable(env, NODE, WARM_MEDIUM)?, allocatable(env, B_NODE, WARM_MEDIUM)?);
        Ok((on_a == 0 && on_b == WARM_B as u64).then_some(()))
    })?;
    poll("A names B as a peer, never the forged box", FOLLOW, || {
        let peers: Peers = env.sandboxd.root_as("GET", "/v1/peers", None);
        if peers.peers.iter().any(|p| p == FORGED_ADDR) {
            return Err(format!("A believes a NodeInventory no Node vouches for: {:?}", peers.peers));
        }
        Ok(peers.peers.iter().any(|p| p == b_addr).then_some(()))
    })?;
    // 2. Ten Sandboxes asking for warm medium capacity all land on B, served from its pool.
    for i in 0..WARM_B {
        env.apply(ns, &placed(&format!("f{i}"), MEDIUM, WARM_MEDIUM))?;
    }
    for i in 0..WARM_B {
        let p = env.wait_running(ns, &format!("f{i}"))?;
        ensure!(p["spec"]["nodeName"] == B_NODE, "f{i} landed on {}", p["spec"]["nodeName"]);
    }
    poll("B's NodeInventory lists the ten claims", FOLLOW, || {
        Ok(inventory(env, B_NODE)?.filter(|i| entries(i) >= WARM_B).map(|_| ()))
    })?;
    // 3. The inventory follows the releases; B's pool fills again (its VMs wait warm, paused).
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", ns, "--wait=true", "--timeout=240s"])?;
    poll("B's NodeInventory follows the releases", FOLLOW, || {
        Ok(inventory(env, B_NODE)?.filter(|i| entries(i) == 0).map(|_| ()))
    })?;
    b.sandboxd.wait_full(BASE);
    poll("B's NodeInventory shows its pool warm again", FOLLOW, || {
        Ok(inventory(env, B_NODE)?.filter(|i| warm_of(i, MEDIUM) == Some(WARM_B as u64)).map(|_| ()))
    })?;
    // A learns B's refilled pool at its next push (every 2 s): until then a medium claim at A
    // has nowhere to go (429, nothing claimed).
    poll("A redirects a medium claim to B", FOLLOW, || {
        let (_, v) =
            env.sandboxd.call("POST", "/v1/claim", Some(TOKEN), Some(json!({"template": BASE, "size": MEDIUM})));
        if let (Some(id), Some(token)) = (v["id"].as_str().filter(|i| !i.is_empty()), v["token"].as_str()) {
            env.sandboxd.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(token), None);
        }
        Ok((v["redirect"] == json!([b_addr])).then_some(()))
    })?;
    // 4. The unmodified SDK at A: redirected to B, commands run there, lookup from A finds it.
    let python = std::env::var_os("CHRYSALIS_PYTHON").ok_or("CHRYSALIS_PYTHON is unset (cargo xtask test sets it)")?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vk_sandbox_e2e/fleet.py");
    let args = [a_addr.to_string(), b_addr.to_string(), TOKEN.to_string()];
    env.sandboxd.run_python(&python, &script, &args, "fleet-sdk", Duration::from_secs(300), "fleet sdk ok");
    // 5. A Pod on A, then B dies: its inventory goes stale, A stops naming it, A's Pod runs on.
    env.apply(ns, &placed("on-a", "small", WARM_SMALL))?;
    let on_a = env.wait_running(ns, "on-a")?;
    ensure!(on_a["spec"]["nodeName"] == NODE, "on-a landed on {}", on_a["spec"]["nodeName"]);
    b.kill9();
    poll("A drops the dead box from its peers", FOLLOW, || {
        let peers: Peers = env.sandboxd.root_as("GET", "/v1/peers", None);
        Ok((!peers.peers.iter().any(|p| p == b_addr)).then_some(()))
    })?;
    let (s, v) = env.sandboxd.call("POST", "/v1/claim", Some(TOKEN), Some(json!({"template": BASE, "size": MEDIUM})));
    ensure!(v.get("redirect").is_none(), "A still redirects to the dead box: {s} {v}");
    if let (Some(id), Some(token)) = (v["id"].as_str(), v["token"].as_str()) {
        env.sandboxd.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(token), None);
    }
    std::thread::sleep(Duration::from_secs(3));
    let on_a = env.pod(ns, "on-a")?.ok_or("on-a is gone")?;
    ensure!(on_a["status"]["phase"] == "Running", "A's Pod after B died: {}", on_a["status"]);
    Ok(())
}

//! The fleet loop: the object, the peer report and the warm capacity as pure functions, then
//! whole passes against the fake sandboxd and a fake API server (recording every request).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::DynamicObject;
use sandboxd_api::{Info, Key, PeerBox, PeerPool, PoolInfo, SandboxRow};
use serde_json::{json, Value};
use vnode::Provider as _;

use super::*;
use crate::annotations::TEMPLATE;
use crate::authority::KubeOwners;
use crate::provider::{HeldClaim, ProviderConfig};
use crate::test_utils::FakeSandboxd;

fn key(template: &str, net: &str, size: &str) -> Key {
    Key { template: template.into(), net: net.into(), size: size.into() }
}

fn pool(template: &str, size: &str, warm: usize, target: usize) -> PoolInfo {
    PoolInfo { key: key(template, "none", size), warm, target, ..PoolInfo::default() }
}

fn row(id: &str, claim_ref: Option<&str>, k: Key) -> SandboxRow {
    SandboxRow {
        id: id.into(),
        key: k,
        deadline: "2030-01-01T00:10:00.123Z".into(),
        claimed_at: "2030-01-01T00:00:00Z".into(),
        claim_ref: claim_ref.map(str::to_owned),
        ..SandboxRow::default()
    }
}

fn now() -> Timestamp {
    "2030-01-01T00:05:00Z".parse().unwrap()
}

/// A Pod of `name` asking for `resources` (1 each, requests and limits).
fn pod(name: &str, resources: &[&str]) -> Pod {
    let one: BTreeMap<String, Quantity> = resources.iter().map(|r| (r.to_string(), Quantity("1".into()))).collect();
    let mut p = Pod {
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                resources: Some(ResourceRequirements {
                    requests: Some(one.clone()),
                    limits: Some(one),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    p.metadata.namespace = Some("ns".into());
    p.metadata.name = Some(name.into());
    p.metadata.uid = Some(format!("uid-{name}"));
    p.metadata.annotations = Some(BTreeMap::from([(TEMPLATE.to_owned(), "base".to_owned())]));
    p
}

const SMALL: &str = "sandbox.cocoonstack.io/warm-base-none-small";
const MEDIUM: &str = "sandbox.cocoonstack.io/warm-base-none-medium";

#[test]
fn the_inventory_object_is_built_from_info_and_sandboxes() {
    let info = Info { pools: vec![pool("base", "small", 2, 3), pool("base", "medium", 0, 1)], ..Info::default() };
    let rows = vec![
        row("sb_2", Some("ns/b"), key("base", "none", "small")),
        row("sb_1", None, key("base", "none", "small")),
        SandboxRow {
            deadline: "soon".into(),
            claimed_at: String::new(),
            ..row("sb_3", Some("ns/a"), key("rt", "egress", "large"))
        },
    ];
    let owner = object::NodeOwner { name: "box-a".into(), uid: "n-uid".into() };
    let obj = object::inventory("box-a", "10.0.0.5:7777", &info, &rows, Some(&owner), now());
    assert_eq!(obj["apiVersion"], "sandbox.cocoonstack.io/v1beta1");
    assert_eq!(obj["kind"], "NodeInventory");
    assert_eq!(obj["metadata"]["name"], "box-a");
    assert_eq!(
        obj["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": "box-a", "uid": "n-uid"}])
    );
    assert_eq!((obj["node"].as_str(), obj["address"].as_str()), (Some("box-a"), Some("10.0.0.5:7777")));
    assert_eq!(obj["publishedAt"], "2030-01-01T00:05:00Z");
    assert!(obj.get("spec").is_none() && obj.get("status").is_none(), "upstream's object has neither");
    assert_eq!(
        obj["pools"],
        json!([
            {"template": "base", "net": "none", "size": "small", "warm": 2, "target": 3},
            {"template": "base", "net": "none", "size": "medium", "warm": 0, "target": 1},
        ])
    );
    let entries = obj["entries"].as_array().unwrap();
    let names: Vec<&str> = entries.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["ns/a", "ns/b", "sb_1"], "name = claim_ref, else the id; sorted");
    assert_eq!(
        entries[1],
        json!({"name": "ns/b", "id": "sb_2", "phase": "Running", "template": "base", "claimRef": "ns/b",
            "addr": "10.0.0.5:7777", "deadline": "2030-01-01T00:10:00Z", "claimedAt": "2030-01-01T00:00:00Z"})
    );
    assert!(entries[2].get("claimRef").is_none());
    assert!(
        entries[0].get("deadline").is_none() && entries[0].get("claimedAt").is_none(),
        "unparseable times are left out"
    );
    let unowned = object::inventory("box-a", "a:1", &Info::default(), &[], None, now());
    assert!(unowned["metadata"].get("ownerReferences").is_none());
    assert_eq!((unowned["pools"].clone(), unowned["entries"].clone()), (json!([]), json!([])));
}

/// A listed `NodeInventory` as another box writes it.
fn listed(name: &str, address: &str, published: Option<&str>, pools: Value) -> DynamicObject {
    let mut o = DynamicObject::new(name, &object::resource());
    o.data = json!({"node": name, "address": address, "pools": pools, "entries": []});
    if let Some(p) = published {
        o.data["publishedAt"] = p.into();
    }
    o
}

/// The Nodes of `boxes` (name, address host), each vouching for its own inventory.
fn nodes(boxes: &[(&str, &str)]) -> BTreeMap<String, peers::NodeFacts> {
    boxes
        .iter()
        .map(|(n, host)| {
            (n.to_string(), peers::NodeFacts { uid: format!("uid-{n}"), addresses: vec![host.to_string()] })
        })
        .collect()
}

fn peer(addr: &str, pools: Vec<PeerPool>, ttl: u64) -> PeerBox {
    PeerBox { addr: addr.into(), pools, ttl_seconds: Some(ttl) }
}

#[test]
fn stale_missing_and_own_inventories_are_left_out_of_the_peer_report() {
    let warm = |w: u64| json!([{"template": "base", "net": "none", "size": "small", "warm": w, "target": 3}]);
    let objects = vec![
        listed("box-a", "10.0.0.5:7777", Some("2030-01-01T00:05:00Z"), warm(9)), // this node
        listed("box-b", "10.0.0.6:7777", Some("2030-01-01T00:04:00Z"), warm(2)), // 60 s old: fresh
        listed("box-c", "10.0.0.7:7777", Some("2030-01-01T00:03:00Z"), warm(5)), // 120 s old: stale
        listed("box-d", "10.0.0.8:7777", None, warm(5)),                         // never stamped: stale
        listed("box-e", "10.0.0.9:7777", Some("yesterday"), warm(5)),            // unparseable: stale
        listed("box-f", "", Some("2030-01-01T00:05:00Z"), warm(5)),              // no address
        listed("box-g", "10.0.0.5:7777", Some("2030-01-01T00:05:00Z"), warm(5)), // our address
        listed(
            "box-h",
            "10.0.0.10:7777",
            Some("2030-01-01T00:06:00Z"),
            json!([
                {"template": "base", "warm": 1, "target": 1},
                {"template": "-bad", "warm": 4, "target": 4},
                {"template": "base", "net": "wifi", "warm": 4, "target": 4},
                {"template": "base", "size": "huge", "warm": 4, "target": 4},
                {"template": "rt", "net": "egress", "size": "2xlarge"},
                {"template": "base", "net": "none", "size": "small", "warm": 3},
            ]),
        ), // a minute ahead of our clock: fresh; bad pools dropped, defaults filled, a key twice: the larger
        listed("box-i", "10.0.0.11:7777", Some("2099-01-01T00:00:00Z"), warm(5)), // far ahead: never stale, so left out
    ];
    let fleet = nodes(&[
        ("box-b", "10.0.0.6"),
        ("box-b2", "10.0.0.6"),
        ("box-c", "10.0.0.7"),
        ("box-h", "10.0.0.10"),
        ("box-i", "10.0.0.11"),
    ]);
    let report = peers::peer_report(&objects, &fleet, "box-a", "10.0.0.5:7777", now(), Duration::from_secs(90));
    assert_eq!(report.ttl_seconds, 90);
    assert_eq!(
        report.peers,
        vec![
            peer(
                "10.0.0.10:7777",
                vec![
                    PeerPool { key: key("base", "none", "small"), warm: 3 },
                    PeerPool { key: key("rt", "egress", "2xlarge"), warm: 0 },
                ],
                90
            ),
            peer("10.0.0.6:7777", vec![PeerPool { key: key("base", "none", "small"), warm: 2 }], 30),
        ],
        "each peer holds until its own window ends"
    );
    // A wider window takes box-c back; the same address twice keeps the fresher object.
    let mut twice = objects.clone();
    twice.push(listed("box-b2", "10.0.0.6:7777", Some("2030-01-01T00:04:30Z"), warm(7)));
    let report = peers::peer_report(&twice, &fleet, "box-a", "10.0.0.5:7777", now(), Duration::from_millis(150_500));
    assert_eq!(report.ttl_seconds, 151, "whole seconds, rounded up");
    let addrs: Vec<(&str, usize, Option<u64>)> =
        report.peers.iter().map(|p| (p.addr.as_str(), p.pools[0].warm, p.ttl_seconds)).collect();
    assert_eq!(
        addrs,
        [("10.0.0.10:7777", 3, Some(151)), ("10.0.0.6:7777", 7, Some(121)), ("10.0.0.7:7777", 5, Some(31))]
    );
    // An empty fleet is an empty report, not none.
    let alone = peers::peer_report(&objects[..1], &fleet, "box-a", "10.0.0.5:7777", now(), Duration::from_secs(90));
    assert!(alone.peers.is_empty() && alone.ttl_seconds == 90);
    assert_eq!(
        peers::candidates(&twice, "box-a", now(), Duration::from_secs(90)),
        ["box-b", "box-b2", "box-f", "box-g", "box-h"],
        "the Nodes to read: fresh objects of other names"
    );
}

#[test]
fn an_inventory_its_node_does_not_vouch_for_is_left_out() {
    let warm = json!([{"template": "base", "warm": 9}]);
    let at = Some("2030-01-01T00:05:00Z");
    let fresh = |name: &str, addr: &str| listed(name, addr, at, warm.clone());
    let owned = |name: &str, addr: &str, owner: &str, uid: &str| {
        let mut o = fresh(name, addr);
        o.metadata.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: owner.into(),
            uid: uid.into(),
            ..Default::default()
        }]);
        o
    };
    let mut another_node = fresh("box-b", "10.0.0.6:7777");
    another_node.data["node"] = "box-c".into();
    let fleet = nodes(&[("box-b", "10.0.0.6"), ("box-c", "10.0.0.7"), ("box-d", "sbx-d.example")]);
    let report = |objects: Vec<DynamicObject>| {
        peers::peer_report(&objects, &fleet, "box-a", "10.0.0.5:7777", now(), Duration::from_secs(90)).peers
    };
    for (obj, why) in [
        (fresh("box-z", "10.0.0.6:7777"), "no Node of its name"),
        (fresh("box-b", "10.0.0.66:7777"), "an address not on its Node (another box's, or the writer's own)"),
        (fresh("box-b", "evil.example:7777"), "a name its Node does not list"),
        (another_node, "its `node` names another Node"),
        (owned("box-b", "10.0.0.6:7777", "box-b", "uid-old"), "owned by an earlier Node of its name"),
        (owned("box-b", "10.0.0.6:7777", "box-c", "uid-box-c"), "owned by another Node"),
    ] {
        assert_eq!(report(vec![obj]), vec![], "{why}");
    }
    let believed = report(vec![
        owned("box-b", "10.0.0.6:7777", "box-b", "uid-box-b"),
        fresh("box-c", "http://10.0.0.7:7777"),
        fresh("box-d", "SBX-D.example:7777"),
    ]);
    let addrs: Vec<&str> = believed.iter().map(|p| p.addr.as_str()).collect();
    assert_eq!(addrs, ["10.0.0.6:7777", "SBX-D.example:7777", "http://10.0.0.7:7777"]);
    // Pools past the cap are dropped.
    let many: Vec<Value> = (0..300).map(|i| json!({"template": format!("t{i}"), "warm": 1})).collect();
    let big = report(vec![listed("box-b", "10.0.0.6:7777", at, Value::Array(many))]);
    assert_eq!(big[0].pools.len(), peers::MAX_PEER_POOLS);
}

#[test]
fn resource_names_are_sanitized_and_bounded() {
    assert_eq!(warm::resource_name(&key("base", "none", "small")), SMALL);
    assert_eq!(warm::resource_name(&key("base", "", "")), SMALL, "sandboxd's defaults");
    assert_eq!(
        warm::resource_name(&key("ghcr.io/org/img:1.2_x", "egress", "2xlarge")),
        "sandbox.cocoonstack.io/warm-ghcr.io-org-img-1.2_x-egress-2xlarge"
    );
    let long_a = format!("{}a", "t".repeat(62));
    let long_b = format!("{}b", "t".repeat(62));
    let (a, b) =
        (warm::resource_name(&key(&long_a, "none", "small")), warm::resource_name(&key(&long_b, "none", "small")));
    for n in [&a, &b] {
        let name = n.strip_prefix("sandbox.cocoonstack.io/").unwrap();
        assert!(name.len() <= 63, "{name} is {} long", name.len());
        assert!(name.starts_with("warm-tttt") && name.chars().last().unwrap().is_ascii_alphanumeric(), "{name}");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)), "{name}");
    }
    assert_ne!(a, b, "the key hash keeps cut names apart");
    assert_eq!(a, warm::resource_name(&key(&long_a, "none", "small")), "stable");
}

#[test]
fn warm_counts_add_the_vms_held_by_pods_requesting_them() {
    let info = Info { pools: vec![pool("base", "small", 2, 3), pool("base", "medium", 0, 2)], ..Info::default() };
    let small = key("base", "none", "small");
    let rows = vec![
        row("sb_1", Some("ns/p1"), small.clone()),   // held by a Pod asking for small
        row("sb_2", Some("ns/p2"), small.clone()),   // its Pod asks for medium
        row("sb_3", Some("ns/p3"), small.clone()),   // its Pod asks for nothing
        row("sb_4", Some("ns/p4"), small.clone()),   // preserved: no Pod
        row("sb_5", Some("other/x"), small.clone()), // not this provider's
        row("sb_6", Some("ns/p6"), key("gone", "none", "small")), // a pool sandboxd no longer lists
    ];
    let held = |id: &str, pod: Option<Pod>| HeldClaim { key: String::new(), id: id.into(), pod };
    let held = vec![
        held("sb_1", Some(self::pod("p1", &[SMALL]))),
        held("sb_2", Some(self::pod("p2", &[MEDIUM]))),
        held("sb_3", Some(self::pod("p3", &[]))),
        held("sb_4", None),
        held("sb_6", Some(self::pod("p6", &["sandbox.cocoonstack.io/warm-gone-none-small", "cpu"]))),
    ];
    let got = warm::warm_resources(&info, &rows, &held);
    let want: BTreeMap<String, Quantity> =
        [(SMALL, "3"), (MEDIUM, "0"), ("sandbox.cocoonstack.io/warm-gone-none-small", "1")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.into())))
            .collect();
    assert_eq!(got, want);
    assert_eq!(warm::requested(&pod("p", &[SMALL, "cpu", "memory"])).into_iter().collect::<Vec<_>>(), [SMALL]);
}

use vnode::testing::Calls;
/// Answers a request (method, path) → (status, body).
type Answer = Arc<dyn Fn(&str, &str) -> (u16, Value) + Send + Sync>;

fn fake_api(calls: Calls, answer: Answer) -> kube::Client {
    vnode::testing::fake_api(calls, move |method, path, _| answer(method, path))
}

fn status(code: u16) -> (u16, Value) {
    (code, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": "fake"}))
}

const INV: &str = "/apis/sandbox.cocoonstack.io/v1beta1/nodeinventories";

/// The fleet as the fake API server lists it: this node, a fresh peer, a stale one, a fresh one
/// without a Node.
fn fleet() -> Value {
    let fresh = Timestamp::now() - SignedDuration::from_secs(5);
    let stale = Timestamp::now() - SignedDuration::from_secs(600);
    let pools = json!([{"template": "base", "net": "none", "size": "small", "warm": 4, "target": 4}]);
    let item = |name: &str, addr: &str, at: Timestamp| {
        json!({"apiVersion": "sandbox.cocoonstack.io/v1beta1", "kind": "NodeInventory", "metadata": {"name": name},
            "node": name, "address": addr, "publishedAt": object::rfc3339(at), "pools": pools, "entries": []})
    };
    json!({"apiVersion": "sandbox.cocoonstack.io/v1beta1", "kind": "NodeInventoryList", "metadata": {},
        "items": [item("box-a", "10.0.0.5:7777", fresh), item("box-b", "10.0.0.6:7777", fresh),
            item("box-c", "10.0.0.7:7777", stale), item("box-d", "10.0.0.8:7777", fresh)]})
}

/// An API server with the Node `box-a` (uid `n-uid`), applying and listing as `inv` says.
fn cluster(inv_patch: u16, inv_list: u16) -> Answer {
    Arc::new(move |method: &str, path: &str| match (method, path) {
        ("GET", "/api/v1/nodes/box-a") => {
            (200, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "box-a", "uid": "n-uid"}}))
        }
        ("GET", "/api/v1/nodes/box-b") => (
            200,
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "box-b", "uid": "b-uid"},
                "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.6"}]}}),
        ),
        ("PATCH", p) if p == format!("{INV}/box-a") && inv_patch == 200 => (
            200,
            json!({"apiVersion": "sandbox.cocoonstack.io/v1beta1", "kind": "NodeInventory", "metadata": {"name": "box-a"}}),
        ),
        ("GET", INV) if inv_list == 200 => (200, fleet()),
        ("PATCH", _) => status(inv_patch),
        ("GET", INV) => status(inv_list),
        _ => status(404),
    })
}

struct Rig {
    fake: FakeSandboxd,
    provider: Arc<SandboxProvider>,
    publisher: Arc<Publisher>,
    node: vnode::NodeHandle,
    calls: Calls,
    _dir: tempfile::TempDir,
}

async fn rig(publish: bool, answer: Answer) -> Rig {
    rig_with(publish, answer, |_| {}).await
}

async fn rig_with(publish: bool, answer: Answer, adjust: impl FnOnce(&mut InventoryConfig)) -> Rig {
    let fake = FakeSandboxd::start(Some("root")).await;
    fake.set_pools(vec![pool("base", "small", 2, 3)]);
    let dir = tempfile::tempdir().unwrap();
    let client = SandboxdClient::new(&fake.url(), Some("root".into())).unwrap();
    let pcfg = ProviderConfig::new(dir.path().join("claims.json"), "10.0.0.5".into());
    let provider = Arc::new(SandboxProvider::new(client.clone(), Arc::new(KubeOwners::new()), pcfg).unwrap());
    let mut cfg = InventoryConfig::new("box-a".into(), "10.0.0.5:7777".into());
    cfg.publish = publish;
    cfg.settle = Duration::from_millis(20);
    adjust(&mut cfg);
    let node = vnode::NodeHandle::default();
    let publisher = Arc::new(Publisher::new(cfg, client, provider.clone(), node.clone()));
    let calls = Calls::default();
    publisher.set_client(fake_api(calls.clone(), answer));
    Rig { fake, provider, publisher, node, calls, _dir: dir }
}

impl Rig {
    fn calls(&self) -> Vec<(String, String, Value)> {
        self.calls.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn a_pass_applies_the_owned_object_and_sends_the_fresh_peers() {
    let r = rig(true, cluster(200, 200)).await;
    r.fake.insert_in("sb_1", Some("ns/p1"), key("base", "none", "small"));
    let pass = r.publisher.pass().await.unwrap();
    assert_eq!(pass, Pass { resources: Some(1), published: true, peers: Some(1), absent: false });
    let calls = r.calls();
    let (_, query, body) = calls.iter().find(|(m, _, _)| m == "PATCH").unwrap();
    assert!(query.starts_with(&format!("{INV}/box-a?")), "{query}");
    assert!(query.contains("fieldManager=vk-sandbox") && query.contains("force=true"), "{query}");
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "n-uid");
    assert_eq!(body["address"], "10.0.0.5:7777");
    assert_eq!(body["pools"][0]["warm"], 2);
    assert_eq!(body["entries"][0]["name"], "ns/p1");
    let mut reports = r.fake.peer_reports();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].ttl_seconds, 90);
    let ttl = reports[0].peers.first().and_then(|p| p.ttl_seconds).unwrap_or(0);
    assert!((80..=85).contains(&ttl), "the peer published ~5 s ago holds ~85 s more: {ttl}");
    reports[0].peers.iter_mut().for_each(|p| p.ttl_seconds = None);
    assert_eq!(
        reports[0].peers,
        vec![PeerBox {
            addr: "10.0.0.6:7777".into(),
            pools: vec![PeerPool { key: key("base", "none", "small"), warm: 4 }],
            ttl_seconds: None,
        }],
        "not this node, not the stale box, not the box without a Node (box-d)"
    );
    assert_eq!(r.node.extra_resources(), BTreeMap::from([(SMALL.to_string(), Quantity("2".into()))]));
}

#[tokio::test]
async fn a_missing_crd_is_logged_once_and_waited_out_while_warm_capacity_goes_on() {
    let r = rig(true, cluster(404, 404)).await;
    let pass = r.publisher.pass().await.unwrap();
    assert!(pass.absent && !pass.published && pass.peers.is_none(), "{pass:?}");
    let before = r.calls().len();
    r.fake.set_pools(vec![pool("base", "small", 5, 5)]);
    let pass = r.publisher.pass().await.unwrap();
    assert!(pass.absent, "{pass:?}");
    assert_eq!(r.calls().len(), before, "the API is not asked again within the minute");
    assert_eq!(r.node.extra_resources()[SMALL], Quantity("5".into()));
    assert!(r.fake.peer_reports().is_empty());
    // Forbidden is the same story.
    let r = rig(true, cluster(403, 403)).await;
    assert!(r.publisher.pass().await.unwrap().absent);
}

#[tokio::test]
async fn a_failed_listing_sends_no_report_and_a_failed_sandboxd_read_changes_nothing() {
    let r = rig(true, cluster(200, 500)).await;
    match r.publisher.pass().await {
        Err(InventoryError::List(_)) => {}
        other => panic!("{other:?}"),
    }
    assert!(r.fake.peer_reports().is_empty(), "the previous report runs out by itself");
    let set = r.node.extra_resources();
    assert_eq!(set[SMALL], Quantity("2".into()));
    r.fake.set_pools(vec![]);
    r.fake.set_info_fails(true);
    let calls = r.calls().len();
    match r.publisher.pass().await {
        Err(InventoryError::Sandboxd(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(r.node.extra_resources(), set, "kept");
    assert_eq!(r.calls().len(), calls, "nothing applied");
}

#[tokio::test]
async fn without_publishing_only_the_warm_capacity_is_set_and_a_removed_pool_goes() {
    let r = rig(false, cluster(200, 200)).await;
    r.fake.set_pools(vec![pool("base", "small", 2, 3), pool("base", "medium", 1, 1)]);
    let pass = r.publisher.pass().await.unwrap();
    assert_eq!(pass, Pass { resources: Some(2), ..Pass::default() });
    assert!(r.calls().is_empty() && r.fake.peer_reports().is_empty());
    r.fake.set_pools(vec![pool("base", "small", 2, 3)]);
    r.publisher.pass().await.unwrap();
    assert_eq!(r.node.extra_resources().keys().collect::<Vec<_>>(), [SMALL], "vnode nulls the medium one");
}

#[tokio::test]
async fn a_claim_and_a_release_move_the_capacity_soon_after() {
    let r = rig(false, cluster(200, 200)).await;
    r.provider.notify_pods(vnode::PodNotifier::channel().0);
    // Passes every 30 s (never reached here), and 20 ms after a change.
    let task = tokio::spawn(r.publisher.clone().run());
    let want = |n: &str| {
        let node = r.node.clone();
        let n = Quantity(n.into());
        async move {
            for _ in 0..200 {
                if node.extra_resources().get(SMALL) == Some(&n) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            false
        }
    };
    assert!(want("2").await, "the first pass runs at once");
    // The fake's warm count stays 2: the claimed VM held by a Pod asking for it adds one.
    let p = pod("p1", &[SMALL]);
    r.provider.create_pod(&p).await.unwrap();
    assert!(want("3").await, "a claim is published without waiting for the interval");
    r.provider.delete_pod(&p).await.unwrap();
    assert!(want("2").await, "so is a release");
    task.abort();
}

#[tokio::test]
async fn a_failed_apply_still_reports_the_peers_and_a_draining_box_offers_nothing() {
    let r = rig(true, cluster(500, 200)).await;
    match r.publisher.pass().await {
        Err(InventoryError::Apply { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(r.fake.peer_reports().len(), 1, "the others are still listed and reported");
    // Draining: no claim is taken here, so neither the Node nor the object offers a warm VM.
    let r = rig(true, cluster(200, 200)).await;
    r.fake.set_draining(true);
    r.publisher.pass().await.unwrap();
    assert_eq!(r.node.extra_resources(), BTreeMap::from([(SMALL.to_string(), Quantity("0".into()))]));
    let calls = r.calls();
    let (_, _, body) = calls.iter().find(|(m, _, _)| m == "PATCH").unwrap();
    assert_eq!(body["pools"][0]["warm"], 0, "{body}");
    assert_eq!(body["pools"][0]["target"], 3, "{body}");
}

#[tokio::test]
async fn a_sandboxd_silent_for_the_stale_window_has_its_warm_capacity_zeroed() {
    let r = rig_with(false, cluster(200, 200), |c| c.stale_after = Duration::from_millis(300)).await;
    r.publisher.pass().await.unwrap();
    assert_eq!(r.node.extra_resources()[SMALL], Quantity("2".into()));
    r.fake.set_info_fails(true);
    assert!(r.publisher.pass().await.is_err());
    assert_eq!(r.node.extra_resources()[SMALL], Quantity("2".into()), "a blip changes nothing");
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(r.publisher.pass().await.is_err());
    assert_eq!(r.node.extra_resources()[SMALL], Quantity("0".into()), "silent for the window: 0");
    r.fake.set_info_fails(false);
    r.publisher.pass().await.unwrap();
    assert_eq!(r.node.extra_resources()[SMALL], Quantity("2".into()), "back when it answers");
}

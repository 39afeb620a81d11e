//! The other boxes of the fleet, from their `NodeInventory` objects, as the [`PeerReport`]
//! sandboxd takes on `PUT /v1/peers` (it redirects a warm miss to them).
//!
//! A peer is left out when it is this node (by object name, `node` or `address`), has no usable
//! `address`, or is **stale**: its `publishedAt` is missing, does not parse, is older than the
//! stale-after window (a box that stopped publishing, e.g. killed, drops out within it) or
//! further ahead of this clock than [`MAX_SKEW`] (a wrong clock, or a stamp meant to stay fresh).
//!
//! **An inventory is believed only where its Node agrees** ([`NodeFacts`]): every node may write
//! `NodeInventory` objects, so one box could publish an object in another's name, or point the
//! fleet's SDK clients (and the tokens they send) at an address of its choosing. A Node is
//! written only by its own node (the `NodeRestriction` admission plugin), so a peer is taken only
//! when the object's name, `node` and Node owner (if any) name a Node that exists with that UID,
//! and the host of its `address` is one of that Node's addresses. What is left out is logged.
//!
//! A pool whose key sandboxd would refuse is left out of its peer (one bad object must not
//! spoil the report); a peer lists at most [`MAX_PEER_POOLS`] pools. The report holds for the
//! window (`ttl_seconds`), and each peer only until its own window ends
//! ([`PeerBox::ttl_seconds`]), so a provider that stops pushing leaves its sandboxd alone again.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::DynamicObject;
use sandboxd_api::{Key, PeerBox, PeerPool, PeerReport};
use serde_json::Value;

/// Most peers a report carries (sandboxd refuses more).
pub const MAX_PEERS: usize = 1024;
/// Most pools one peer carries (sandboxd refuses more).
pub const MAX_PEER_POOLS: usize = 256;
/// How far ahead of this clock a `publishedAt` may be and still count.
pub const MAX_SKEW: Duration = Duration::from_secs(60);

/// What the cluster says of a peer's Node (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// Its UID.
    pub uid: String,
    /// Its `status.addresses` (IPs, host names).
    pub addresses: Vec<String>,
}

impl NodeFacts {
    /// The facts of a Node object.
    pub fn of(node: &k8s_openapi::api::core::v1::Node) -> NodeFacts {
        let addresses =
            node.status.iter().flat_map(|s| s.addresses.iter().flatten()).map(|a| a.address.clone()).collect();
        NodeFacts { uid: node.metadata.uid.clone().unwrap_or_default(), addresses }
    }
}

/// The object's `publishedAt`, parsed.
pub fn published_at(obj: &DynamicObject) -> Option<Timestamp> {
    obj.data.get("publishedAt")?.as_str()?.parse().ok()
}

/// How long `obj` stays fresh from `now`: its stale-after window minus its age; `None` when it is
/// stale (see the module docs; a stamp up to [`MAX_SKEW`] ahead counts as just published).
pub fn fresh_for(obj: &DynamicObject, now: Timestamp, stale_after: Duration) -> Option<Duration> {
    let at = published_at(obj)?;
    let window = SignedDuration::try_from(stale_after).unwrap_or(SignedDuration::MAX);
    let skew = SignedDuration::try_from(MAX_SKEW).unwrap_or(SignedDuration::ZERO);
    let age = now.duration_since(at);
    if age < -skew || age > window {
        return None;
    }
    Duration::try_from(window - age.max(SignedDuration::ZERO)).ok()
}

/// Whether `obj` was published within `stale_after` of `now` ([`fresh_for`]).
pub fn is_fresh(obj: &DynamicObject, now: Timestamp, stale_after: Duration) -> bool {
    fresh_for(obj, now, stale_after).is_some()
}

/// Whole seconds, rounded up, at least 1.
fn secs_up(d: Duration) -> u64 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
}

/// The names of the fresh objects of other boxes: the Nodes [`peer_report`] needs the facts of.
pub fn candidates(objects: &[DynamicObject], own_node: &str, now: Timestamp, stale_after: Duration) -> Vec<String> {
    let mut names: Vec<String> = objects
        .iter()
        .filter(|o| is_fresh(o, now, stale_after))
        .filter_map(|o| o.metadata.name.clone())
        .filter(|n| n != own_node)
        .collect();
    names.sort();
    names.dedup();
    names.truncate(MAX_PEERS);
    names
}

/// Why the Node named by `obj` does not vouch for it, if it does not.
fn disowned(
    obj: &DynamicObject,
    name: &str,
    node: &str,
    addr: &str,
    facts: Option<&NodeFacts>,
) -> Option<&'static str> {
    if node != name {
        return Some("its `node` is not its name");
    }
    let Some(facts) = facts else { return Some("no Node of its name") };
    let owners = obj.metadata.owner_references.iter().flatten().filter(|o| o.kind == "Node");
    if owners.into_iter().any(|o| o.name != name || o.uid != facts.uid) {
        return Some("owned by another Node, or an earlier one of its name");
    }
    let host = crate::status::host_of(addr);
    if !facts.addresses.iter().any(|a| a.eq_ignore_ascii_case(&host)) {
        return Some("its address is not one of its Node's addresses");
    }
    None
}

/// sandboxd's pool key rules (`template` `^[a-zA-Z0-9][a-zA-Z0-9._:/-]{0,62}$`, `net` none or
/// egress, `size` a size class; empty `net`/`size` take the defaults), normalized.
fn pool_key(v: &Value) -> Option<Key> {
    let template = v.get("template")?.as_str()?;
    let b = template.as_bytes();
    let template_ok = !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[1..].iter().all(|c| c.is_ascii_alphanumeric() || b"._:/-".contains(c));
    let net = match v.get("net").and_then(Value::as_str).unwrap_or("") {
        "" | "none" => "none",
        "egress" => "egress",
        _ => return None,
    };
    let size = match v.get("size").and_then(Value::as_str).unwrap_or("") {
        "" => "small",
        s @ ("small" | "medium" | "large" | "xlarge" | "2xlarge") => s,
        _ => return None,
    };
    template_ok.then(|| Key { template: template.into(), net: net.into(), size: size.into() })
}

/// An address sandboxd takes: `host:port` or an origin, no blanks or controls, ≤ 512 bytes.
fn usable_address(a: &str) -> bool {
    !a.is_empty() && a.len() <= 512 && !a.chars().any(|c| c.is_whitespace() || c.is_control())
}

/// The peer one object describes, if it is a fresh other box its Node vouches for.
fn peer_of(
    obj: &DynamicObject,
    nodes: &BTreeMap<String, NodeFacts>,
    own_node: &str,
    own_address: &str,
    now: Timestamp,
    stale_after: Duration,
) -> Option<PeerBox> {
    let name = obj.metadata.name.as_deref().unwrap_or_default();
    let node = obj.data.get("node").and_then(Value::as_str).unwrap_or(name);
    let addr = obj.data.get("address").and_then(Value::as_str).unwrap_or("").trim();
    if name == own_node || node == own_node || addr == own_address.trim() || !usable_address(addr) {
        return None;
    }
    let Some(fresh) = fresh_for(obj, now, stale_after) else {
        tracing::debug!(peer = %name, published_at = ?obj.data.get("publishedAt"), "stale NodeInventory left out");
        return None;
    };
    if let Some(why) = disowned(obj, name, node, addr, nodes.get(name)) {
        tracing::warn!(peer = %name, address = %addr, why, "NodeInventory left out: its Node does not vouch for it");
        return None;
    }
    let mut warm: BTreeMap<Key, usize> = BTreeMap::new();
    for p in obj.data.get("pools").and_then(Value::as_array).into_iter().flatten() {
        let Some(key) = pool_key(p) else { continue };
        if warm.len() == MAX_PEER_POOLS && !warm.contains_key(&key) {
            break;
        }
        let w = usize::try_from(p.get("warm").and_then(Value::as_u64).unwrap_or(0)).unwrap_or(usize::MAX);
        let slot = warm.entry(key).or_insert(0);
        *slot = w.max(*slot);
    }
    let pools = warm.into_iter().map(|(key, warm)| PeerPool { key, warm }).collect();
    Some(PeerBox { addr: addr.to_owned(), pools, ttl_seconds: Some(secs_up(fresh)) })
}

/// The whole report: every fresh other box its Node vouches for (`nodes`, by name: the facts of
/// the Nodes [`candidates`] named), one per address (the freshest wins), sorted by address;
/// `ttl_seconds` is the stale-after window in whole seconds (at least 1).
pub fn peer_report(
    objects: &[DynamicObject],
    nodes: &BTreeMap<String, NodeFacts>,
    own_node: &str,
    own_address: &str,
    now: Timestamp,
    stale_after: Duration,
) -> PeerReport {
    let mut by_addr: BTreeMap<String, (Option<Timestamp>, PeerBox)> = BTreeMap::new();
    for obj in objects {
        let Some(peer) = peer_of(obj, nodes, own_node, own_address, now, stale_after) else { continue };
        let at = published_at(obj);
        match by_addr.get(&peer.addr) {
            Some((prev, _)) if *prev >= at => {}
            _ => {
                by_addr.insert(peer.addr.clone(), (at, peer));
            }
        }
    }
    let peers = by_addr.into_values().map(|(_, p)| p).take(MAX_PEERS).collect();
    PeerReport { peers, ttl_seconds: secs_up(stale_after) }
}

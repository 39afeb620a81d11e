//! The other boxes of the fleet, from their `NodeInventory` objects, as the [`PeerReport`]
//! sandboxd takes on `PUT /v1/peers` (it redirects a warm miss to them).
//!
//! A peer is left out when it is this node (by object name, `node` or `address`), has no usable
//! `address`, or is **stale**: its `publishedAt` is missing, does not parse, or is older than
//! the stale-after window (a box that stopped publishing, e.g. killed, drops out within it).
//! A pool whose key sandboxd would refuse is left out of its peer (one bad object must not
//! spoil the report). The report holds for the window (`ttl_seconds`), so a provider that
//! stops pushing leaves its sandboxd alone again.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::DynamicObject;
use sandboxd_api::{Key, PeerBox, PeerPool, PeerReport};
use serde_json::Value;

/// Most peers a report carries (sandboxd refuses more).
const MAX_PEERS: usize = 1024;

/// The object's `publishedAt`, parsed.
pub fn published_at(obj: &DynamicObject) -> Option<Timestamp> {
    obj.data.get("publishedAt")?.as_str()?.parse().ok()
}

/// Whether `obj` was published within `stale_after` of `now` (a stamp ahead of `now`, a clock
/// skew, counts as fresh).
pub fn is_fresh(obj: &DynamicObject, now: Timestamp, stale_after: Duration) -> bool {
    let Some(at) = published_at(obj) else { return false };
    let window = SignedDuration::try_from(stale_after).unwrap_or(SignedDuration::MAX);
    now.duration_since(at) <= window
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

/// The peer one object describes, if it is a fresh other box.
fn peer_of(
    obj: &DynamicObject,
    own_node: &str,
    own_address: &str,
    now: Timestamp,
    stale_after: Duration,
) -> Option<PeerBox> {
    let name = obj.metadata.name.as_deref().unwrap_or_default();
    let node = obj.data.get("node").and_then(Value::as_str).unwrap_or(name);
    let addr = obj.data.get("address").and_then(Value::as_str).unwrap_or("").trim();
    if name == own_node || node == own_node || addr == own_address || !usable_address(addr) {
        return None;
    }
    if !is_fresh(obj, now, stale_after) {
        tracing::debug!(peer = %name, published_at = ?obj.data.get("publishedAt"), "stale NodeInventory left out");
        return None;
    }
    let pools = obj
        .data
        .get("pools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let key = pool_key(p)?;
            let warm = p.get("warm").and_then(Value::as_u64).unwrap_or(0);
            Some(PeerPool { key, warm: usize::try_from(warm).unwrap_or(usize::MAX) })
        })
        .collect();
    Some(PeerBox { addr: addr.to_owned(), pools })
}

/// The whole report: every fresh other box, one per address (the freshest wins), sorted by
/// address; `ttl_seconds` is the stale-after window in whole seconds (at least 1).
pub fn peer_report(
    objects: &[DynamicObject],
    own_node: &str,
    own_address: &str,
    now: Timestamp,
    stale_after: Duration,
) -> PeerReport {
    let mut by_addr: BTreeMap<String, (Option<Timestamp>, PeerBox)> = BTreeMap::new();
    for obj in objects {
        let Some(peer) = peer_of(obj, own_node, own_address, now, stale_after) else { continue };
        let at = published_at(obj);
        match by_addr.get(&peer.addr) {
            Some((prev, _)) if *prev >= at => {}
            _ => {
                by_addr.insert(peer.addr.clone(), (at, peer));
            }
        }
    }
    let peers = by_addr.into_values().map(|(_, p)| p).take(MAX_PEERS).collect();
    let ttl_seconds = stale_after.as_secs() + u64::from(stale_after.subsec_nanos() > 0);
    PeerReport { peers, ttl_seconds: ttl_seconds.max(1) }
}

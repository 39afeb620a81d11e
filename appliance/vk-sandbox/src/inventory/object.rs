//! The `NodeInventory` object (`sandbox.cocoonstack.io/v1beta1`, cluster-scoped, named after the
//! node; `manifests/nodeinventory-crd.yaml`), as upstream's publisher writes it: no spec and no
//! status, every field at the top level: `node`, `address` (the sandboxd advertise address),
//! `publishedAt`, `pools[]` (`template`, `net`, `size`, `warm`, `target`) from `GET /v1/info`
//! and `entries[]` (`name`, `id`, `phase`, `template`, `claimRef`, `addr`, `deadline`,
//! `claimedAt`) from `GET /v1/sandboxes`. Pure functions: [`super::Publisher`] applies it.

use k8s_openapi::jiff::Timestamp;
use kube::api::ApiResource;
use serde_json::{json, Value};

use crate::sandboxd::{claimed_at, Deadline as _, Info, SandboxRow};

/// The API group of `NodeInventory`.
pub const GROUP: &str = "sandbox.cocoonstack.io";
/// Its version.
pub const VERSION: &str = "v1beta1";
/// Its kind.
pub const KIND: &str = "NodeInventory";
/// The server-side-apply field manager (upstream's).
pub const FIELD_MANAGER: &str = "vk-sandbox";

/// `sandbox.cocoonstack.io/v1beta1`, `NodeInventory` (plural `nodeinventories`).
pub fn resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.into(),
        plural: "nodeinventories".into(),
    }
}

/// The Node owning the object: deleting the Node deletes its inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOwner {
    /// The Node's name.
    pub name: String,
    /// The Node's UID.
    pub uid: String,
}

/// RFC 3339 in UTC to the second, as Kubernetes writes a `metav1.Time`.
pub fn rfc3339(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// One `entries[]` item for a listed sandbox (`name` = its `claim_ref`, else its id).
fn entry(row: &SandboxRow, address: &str) -> Value {
    let claim_ref = row.claim_ref.as_deref().filter(|r| !r.is_empty());
    let mut e = json!({
        "name": claim_ref.unwrap_or(&row.id),
        "id": row.id,
        "phase": if row.hibernated { "Hibernated" } else { "Running" },
        "template": row.key.template,
        "addr": address,
    });
    if let Some(r) = claim_ref {
        e["claimRef"] = r.into();
    }
    if let Some(d) = row.deadline_time() {
        e["deadline"] = rfc3339(d).into();
    }
    if let Some(c) = claimed_at(row) {
        e["claimedAt"] = rfc3339(c).into();
    }
    e
}

/// The object to apply for node `node` (entries sorted by name, pools in sandboxd's order);
/// owned by `owner` when given. A draining sandboxd publishes `warm: 0` (it takes no claim, so
/// no peer should send one).
pub fn inventory(
    node: &str,
    address: &str,
    info: &Info,
    rows: &[SandboxRow],
    owner: Option<&NodeOwner>,
    now: Timestamp,
) -> Value {
    let pools: Vec<Value> = info
        .pools
        .iter()
        .map(|p| {
            let warm = if info.draining { 0 } else { p.warm };
            json!({"template": p.key.template, "net": p.key.net, "size": p.key.size, "warm": warm, "target": p.target})
        })
        .collect();
    let mut entries: Vec<Value> = rows.iter().map(|r| entry(r, address)).collect();
    entries.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()).then(a["id"].as_str().cmp(&b["id"].as_str())));
    let mut metadata = json!({"name": node});
    if let Some(o) = owner {
        metadata["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Node", "name": o.name, "uid": o.uid}]);
    }
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": KIND,
        "metadata": metadata,
        "node": node,
        "address": address,
        "publishedAt": rfc3339(now),
        "pools": pools,
        "entries": entries,
    })
}

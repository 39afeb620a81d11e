//! The node's view (`docs/sandboxd.md` §5.1): `GET /v1/info` (also the answer of `POST/DELETE /v1/drain`
//! and `PUT /v1/pools`), `GET/PUT /v1/pools`, `GET /v1/peers`.

use serde::{Deserialize, Serialize};

use crate::config::PoolConfig;

/// A pool key on the wire, the `key` object: `{"template", "net", "size"}`. sandboxd always
/// writes all three; it validates what it reads into its own `PoolKey` (an empty `net` or
/// `size` there means `none` / `small`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Key {
    /// Template name.
    #[serde(default)]
    pub template: String,
    /// `none` or `egress`.
    #[serde(default)]
    pub net: String,
    /// A size class.
    #[serde(default)]
    pub size: String,
}

/// A pool's row in [`Info`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolInfo {
    /// The pool.
    pub key: Key,
    /// Warm VMs.
    pub warm: usize,
    /// Refills in flight.
    pub refilling: usize,
    /// Warm target.
    pub target: usize,
    /// A golden snapshot exists.
    pub golden: bool,
    /// The pool cannot fill right now (omitted when false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub at_capacity: bool,
    /// Why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_capacity_reason: Option<String>,
}

/// `budget` in [`Info`]: the node budget and what warm + refilling + claimed VMs hold of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BudgetInfo {
    /// `max_vms`.
    pub max_vms: usize,
    /// `max_memory_mib`.
    pub max_memory_mib: u64,
    /// `max_disk_mib`.
    pub max_disk_mib: u64,
    /// VMs held or booting.
    pub vms: usize,
    /// Their memory, MiB.
    pub memory_mib: u64,
    /// Their writable disks at most, MiB.
    pub disk_mib: u64,
}

/// `GET /v1/info`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Info {
    /// Pools.
    pub pools: Vec<PoolInfo>,
    /// Live claims (hibernated and archived included).
    pub claimed: usize,
    /// Hibernated claims (always 0 on this node).
    pub hibernated: usize,
    /// Archived claims (always 0 on this node).
    pub archived: usize,
    /// The node refuses claims.
    pub draining: bool,
    /// Some pool cannot fill (omitted when false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub at_capacity: bool,
    /// Why (the first pool's reason).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_capacity_reason: Option<String>,
    /// Peers (a lone node has none).
    pub peers: Vec<String>,
    /// The advertised address (omitted when empty).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub advertise_addr: String,
    /// The node budget and its use.
    pub budget: BudgetInfo,
    /// Chrysalis extension: checkpoints on this node.
    pub checkpoints: usize,
    /// Chrysalis extension: bytes the snapshots (checkpoints, fork snapshots, hibernated
    /// sandboxes) hold on disk.
    pub checkpoint_disk_bytes: u64,
    /// Chrysalis extension: the hypervisor VMs run under (`qemu`, `cloud-hypervisor`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hypervisor: String,
    /// Chrysalis extension: its accelerator (`kvm`, `tcg`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub accel: String,
}

/// `GET /v1/pools` and the `PUT /v1/pools` body (decoded strictly): the configured pools.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolList {
    /// The pools; omitted ones are drained by a `PUT`.
    pub pools: Vec<PoolConfig>,
}

/// `GET /v1/peers` (`[]` on a lone node).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Peers {
    /// Peer addresses.
    pub peers: Vec<String>,
}

/// Chrysalis extension, `PUT /v1/peers` (root): the other boxes of the cluster as the node's
/// provider reads them from their `NodeInventory` objects. It replaces what the node knew and
/// holds for `ttl_seconds` (a provider that stops pushing leaves the node alone again).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerReport {
    /// The other boxes (fresh ones only; the node drops its own address if listed).
    pub peers: Vec<PeerBox>,
    /// How long the report holds, seconds (at least 1).
    pub ttl_seconds: u64,
}

/// One other box in a [`PeerReport`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerBox {
    /// Its sandboxd's advertised address (`host:port`, or an origin), where the SDK resends a
    /// redirected claim.
    pub addr: String,
    /// Its pools' warm VMs.
    #[serde(default)]
    pub pools: Vec<PeerPool>,
    /// How long this peer stays fresh, seconds, when sooner than the report's `ttl_seconds`
    /// (a box that last published long ago runs out when its stale-after window ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// A pool of a [`PeerBox`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerPool {
    /// The pool.
    pub key: Key,
    /// Its warm VMs when the box last published.
    pub warm: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info() -> Info {
        Info {
            pools: vec![PoolInfo {
                key: Key { template: "base".into(), net: "none".into(), size: "small".into() },
                warm: 2,
                refilling: 1,
                target: 3,
                golden: true,
                at_capacity: false,
                at_capacity_reason: None,
            }],
            claimed: 1,
            hibernated: 0,
            archived: 0,
            draining: false,
            at_capacity: false,
            at_capacity_reason: None,
            peers: Vec::new(),
            advertise_addr: String::new(),
            budget: BudgetInfo {
                max_vms: 8,
                max_memory_mib: 4096,
                max_disk_mib: 9000,
                vms: 4,
                memory_mib: 2048,
                disk_mib: 0,
            },
            checkpoints: 0,
            checkpoint_disk_bytes: 0,
            hypervisor: String::new(),
            accel: String::new(),
        }
    }

    #[test]
    fn info_omits_the_optional_fields_as_before() {
        assert_eq!(
            serde_json::to_string(&info()).expect("ser"),
            concat!(
                r#"{"pools":[{"key":{"template":"base","net":"none","size":"small"},"warm":2,"refilling":1,"target":3,"golden":true}],"#,
                r#""claimed":1,"hibernated":0,"archived":0,"draining":false,"peers":[],"#,
                r#""budget":{"max_vms":8,"max_memory_mib":4096,"max_disk_mib":9000,"vms":4,"memory_mib":2048,"disk_mib":0},"#,
                r#""checkpoints":0,"checkpoint_disk_bytes":0}"#
            )
        );
        let mut full = info();
        full.at_capacity = true;
        full.at_capacity_reason = Some("node budget".into());
        full.advertise_addr = "10.0.0.5:7777".into();
        full.pools[0].at_capacity = true;
        full.pools[0].at_capacity_reason = Some("node budget".into());
        let v = serde_json::to_value(&full).expect("ser");
        assert_eq!(v["at_capacity"], true);
        assert_eq!(v["advertise_addr"], "10.0.0.5:7777");
        assert_eq!(v["pools"][0]["at_capacity_reason"], "node budget");
        assert_eq!(serde_json::from_value::<Info>(v).expect("round trip"), full);
    }

    #[test]
    fn info_decodes_leniently() {
        let i: Info = serde_json::from_value(json!({"pools": [{"key": {"template": "rt"}, "warm": 1}], "claimed": 2}))
            .expect("lenient");
        assert_eq!((i.claimed, i.pools[0].warm, i.pools[0].key.net.as_str()), (2, 1, ""));
        assert_eq!(i.budget, BudgetInfo::default());
    }

    #[test]
    fn pool_list_is_strict_and_peers_are_a_list() {
        let l: PoolList = serde_json::from_str(r#"{"pools":[{"template":"base","warm":2}]}"#).expect("parse");
        assert_eq!(l.pools[0].warm, Some(2));
        assert_eq!(serde_json::to_string(&l).expect("ser"), r#"{"pools":[{"template":"base","warm":2}]}"#);
        assert!(serde_json::from_str::<PoolList>(r#"{"pools":[],"extra":1}"#).is_err());
        assert!(serde_json::from_str::<PoolList>(r#"{"pools":[{"template":"b","wram":1}]}"#).is_err());
        assert_eq!(serde_json::to_string(&Peers::default()).expect("ser"), r#"{"peers":[]}"#);
    }
}

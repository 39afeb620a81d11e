//! Per-sandbox reads (`docs/sandboxd.md` §5.1): `GET /v1/sandboxes[?claim_ref=]`, `GET /v1/sandboxes/{id}`,
//! `…/owner`, `…/stats`.

use serde::{Deserialize, Serialize};

use crate::info::Key;

/// A claim's row in listings. `token` is set only on `GET /v1/sandboxes/{id}` answered to the
/// root token; `Debug` leaves it out.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxRow {
    /// Sandbox id.
    pub id: String,
    /// Its pool.
    pub key: Key,
    /// Lease end, RFC 3339.
    pub deadline: String,
    /// First grant, RFC 3339.
    pub claimed_at: String,
    /// Hibernated (never, on this node).
    pub hibernated: bool,
    /// The caller's reference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<String>,
    /// The checkpoint it was claimed from, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_checkpoint: Option<String>,
    /// The sandbox token (root only, per-id read only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The volumes it holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::VolumeSpec>,
}

impl std::fmt::Debug for SandboxRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxRow")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("deadline", &self.deadline)
            .field("claimed_at", &self.claimed_at)
            .field("hibernated", &self.hibernated)
            .field("claim_ref", &self.claim_ref)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// `GET /v1/sandboxes`: the rows, sorted by id, never with tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxList {
    /// The rows.
    pub sandboxes: Vec<SandboxRow>,
}

/// `GET /v1/sandboxes/{id}/owner`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Owner {
    /// Where sandbox-scoped calls go (`host:port` or an origin).
    pub owner_addr: String,
}

/// `GET /v1/sandboxes/{id}/stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// Sandbox id.
    pub id: String,
    /// vCPUs of its size class.
    pub cpu_count: u32,
    /// Memory of its size class, bytes.
    pub mem_total_bytes: u64,
    /// Memory in use, bytes (0 when not measured).
    pub mem_used_bytes: u64,
    /// Whether `mem_used_bytes` was measured.
    pub mem_used_measured: bool,
    /// Hibernated.
    pub hibernated: bool,
    /// When, RFC 3339.
    pub measured_at: String,
    /// Chrysalis extension: CPU time the VM has used since it started, nanoseconds, measured
    /// on the host (its cgroup leaf, or its hypervisor process). Omitted when not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_usage_nanos: Option<u64>,
    /// Chrysalis extension: the VM's memory working set on the host, bytes (guest RAM it has
    /// touched plus the hypervisor's own, minus droppable page cache). Omitted when not
    /// measured. Not the guest's view: `mem_used_bytes` stays what the SDK reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_working_set_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row() -> SandboxRow {
        SandboxRow {
            id: "sb_0123456789abcdef".into(),
            key: Key { template: "base".into(), net: "none".into(), size: "small".into() },
            deadline: "2030-01-01T00:05:00Z".into(),
            claimed_at: "2030-01-01T00:00:00Z".into(),
            hibernated: false,
            claim_ref: None,
            from_checkpoint: None,
            token: None,
            volumes: Vec::new(),
        }
    }

    #[test]
    fn rows_omit_claim_ref_and_token_when_absent() {
        let r = row();
        assert_eq!(
            serde_json::to_string(&r).expect("ser"),
            r#"{"id":"sb_0123456789abcdef","key":{"template":"base","net":"none","size":"small"},"deadline":"2030-01-01T00:05:00Z","claimed_at":"2030-01-01T00:00:00Z","hibernated":false}"#
        );
        let full = SandboxRow { claim_ref: Some("ns/a".into()), token: Some("secret-token".into()), ..r };
        let v = serde_json::to_value(&full).expect("ser");
        assert_eq!((v["claim_ref"].as_str(), v["token"].as_str()), (Some("ns/a"), Some("secret-token")));
        assert_eq!(serde_json::from_value::<SandboxRow>(v).expect("round trip"), full);
        assert!(!format!("{full:?}").contains("secret-token"), "the token leaked into Debug");
    }

    #[test]
    fn a_listing_decodes_leniently() {
        let list: SandboxList = serde_json::from_value(json!({
            "sandboxes": [{"id": "sb_1", "deadline": "d", "archived": false}], "padding": "x"
        }))
        .expect("lenient");
        assert_eq!(list.sandboxes[0].id, "sb_1");
        assert_eq!(list.sandboxes[0].claimed_at, "", "a missing field takes its default");
        let back: SandboxList =
            serde_json::from_str(&serde_json::to_string(&SandboxList { sandboxes: vec![row()] }).expect("ser"))
                .expect("round trip");
        assert_eq!(back.sandboxes, vec![row()]);
    }

    #[test]
    fn owner_and_stats() {
        let o = Owner { owner_addr: "10.0.0.5:7777".into() };
        assert_eq!(serde_json::to_string(&o).expect("ser"), r#"{"owner_addr":"10.0.0.5:7777"}"#);
        let s = Stats {
            id: "sb_1".into(),
            cpu_count: 2,
            mem_total_bytes: 1 << 30,
            mem_used_bytes: 0,
            mem_used_measured: false,
            hibernated: false,
            measured_at: "2030-01-01T00:00:00Z".into(),
            cpu_usage_nanos: None,
            memory_working_set_bytes: None,
        };
        let v = serde_json::to_value(&s).expect("ser");
        assert_eq!(
            v,
            json!({"id": "sb_1", "cpu_count": 2, "mem_total_bytes": 1073741824u64, "mem_used_bytes": 0,
                   "mem_used_measured": false, "hibernated": false, "measured_at": "2030-01-01T00:00:00Z"}),
            "the extension fields are omitted when not measured, never null"
        );
        assert_eq!(serde_json::from_value::<Stats>(v).expect("round trip"), s);
        let measured = Stats { cpu_usage_nanos: Some(2_500_000_000), memory_working_set_bytes: Some(1 << 29), ..s };
        let v = serde_json::to_value(&measured).expect("ser");
        assert_eq!(
            (v["cpu_usage_nanos"].as_u64(), v["memory_working_set_bytes"].as_u64()),
            (Some(2_500_000_000), Some(1 << 29))
        );
        assert_eq!(serde_json::from_value::<Stats>(v).expect("round trip"), measured);
    }
}

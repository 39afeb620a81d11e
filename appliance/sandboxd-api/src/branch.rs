//! Branching a sandbox: `POST …/{id}/fork` and the checkpoint routes (`docs/sandboxd.md` §5.2).
//! Each carries the sandbox token in the body (the header holds the node token); `Debug`
//! leaves it out.

use serde::{Deserialize, Serialize};

use crate::{Grant, Key};

/// The `POST /v1/sandboxes/{id}/fork` body.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// The parent's sandbox token.
    #[serde(default)]
    pub token: String,
    /// How many children: 1 to the node's `max_fork_count`.
    #[serde(default)]
    pub count: i64,
    /// The children's lease, seconds (absent or 0: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<i64>,
    /// Children get `claim_ref` `<prefix>-<n>` (n from 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref_prefix: Option<String>,
}

impl std::fmt::Debug for ForkRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkRequest")
            .field("token", &"<redacted>")
            .field("count", &self.count)
            .field("ttl_seconds", &self.ttl_seconds)
            .field("claim_ref_prefix", &self.claim_ref_prefix)
            .finish()
    }
}

/// The `200` of a fork: one claim per child, all granted or none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForkReply {
    /// The children.
    pub children: Vec<Grant>,
}

/// The `POST /v1/sandboxes/{id}/checkpoint` body.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// The sandbox token.
    #[serde(default)]
    pub token: String,
    /// A label (listed; need not be unique).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl std::fmt::Debug for CheckpointRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointRequest").field("token", &"<redacted>").field("name", &self.name).finish()
    }
}

/// One checkpoint: a sandbox's memory and disk at an instant, claimable any number of times.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Checkpoint {
    /// `ck_` + 16 hex characters.
    pub id: String,
    /// The label it was given (may be empty).
    pub name: String,
    /// The sandbox it was taken from.
    pub sandbox_id: String,
    /// That sandbox's pool key (claims from it get the same).
    pub key: Key,
    /// When, RFC 3339.
    pub created_at: String,
    /// Chrysalis extension: bytes it holds on disk (memory state and disk overlay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// The `200` of `POST …/{id}/checkpoint`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointReply {
    /// The new checkpoint.
    pub checkpoint: Checkpoint,
}

/// `GET /v1/checkpoints`: newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointList {
    /// The checkpoints.
    pub checkpoints: Vec<Checkpoint>,
}

/// The `POST /v1/checkpoints/{id}/claim` body (absent: the default lease). Unknown fields
/// (`no_redirect`) are accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointClaimRequest {
    /// The lease, seconds (absent or 0: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<i64>,
}

/// The `POST /v1/sandboxes/{id}/promote` body.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromoteRequest {
    /// The sandbox token.
    #[serde(default)]
    pub token: String,
    /// The new template's name.
    #[serde(default)]
    pub template: String,
}

impl std::fmt::Debug for PromoteRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromoteRequest").field("token", &"<redacted>").field("template", &self.template).finish()
    }
}

/// The `200` of a promote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PromoteReply {
    /// The pool key a pool of the template uses.
    pub key: Key,
    /// `sha256:` of the template's content.
    pub content_digest: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sdk_bodies_parse_and_tokens_stay_out_of_debug() {
        let f: ForkRequest =
            serde_json::from_value(json!({"token": "secret", "count": 4, "ttl_seconds": 60})).expect("fork");
        assert_eq!((f.count, f.ttl_seconds, f.claim_ref_prefix.as_deref()), (4, Some(60), None));
        assert!(!format!("{f:?}").contains("secret"));
        let c: CheckpointRequest = serde_json::from_value(json!({"token": "secret"})).expect("checkpoint");
        assert_eq!(c.name, None);
        assert!(!format!("{c:?}").contains("secret"));
        let _: CheckpointClaimRequest = serde_json::from_value(json!({"no_redirect": true})).expect("claim");
        let ck = Checkpoint { id: "ck_0".into(), ..Checkpoint::default() };
        let v = serde_json::to_value(CheckpointReply { checkpoint: ck }).expect("reply");
        assert_eq!(v["checkpoint"]["id"], "ck_0");
        assert!(v["checkpoint"].get("size_bytes").is_none());
    }
}

//! `POST /v1/claim` and `POST /v1/sandboxes/{id}/renew` (`docs/sandboxd.md` §5.1).

use serde::{Deserialize, Serialize};

/// The `POST /v1/claim` body. Unknown fields are accepted: the SDK and vk-sandbox may send
/// `metadata`, `on_expire`, `egress`, which this node does not read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRequest {
    /// Template name (an empty or malformed one is refused, `400`).
    #[serde(default)]
    pub template: String,
    /// `none` (absent or empty) or `egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// A size class (absent or empty: `small`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// The lease, seconds: absent or 0 → 300, capped at 86400, negative → `400`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<i64>,
    /// The caller's reference; listings filter on it exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<String>,
    /// Claim only from a promoted template (`404` for any other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_promoted: Option<bool>,
    /// Catalog volumes to attach (and mount, unless `volumes_attach_only`) before the grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<Vec<crate::VolumeSpec>>,
    /// Attach the volumes without mounting them (the SDK's `mount=False`): each disk is
    /// linked at `/dev/volumes/<name>` in the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes_attach_only: Option<bool>,
    /// Serve the claim here, never answer with a redirect (the SDK sets it on the resend to a
    /// peer; vk-sandbox always: its Pod is bound to this node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_redirect: Option<bool>,
}

impl ClaimRequest {
    /// A claim on `template`'s default pool (`net` none, `size` small, default lease).
    pub fn new(template: impl Into<String>) -> Self {
        ClaimRequest { template: template.into(), ..ClaimRequest::default() }
    }
}

/// A granted claim: the `200` of `POST /v1/claim`. The token is the sandbox's credential, so
/// `Debug` leaves it out.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Grant {
    /// Sandbox id (`sb_` + 16 hex characters).
    pub id: String,
    /// Sandbox token (32 hex characters).
    pub token: String,
    /// Lease end, RFC 3339.
    pub deadline: String,
    /// Where to send sandbox-scoped calls (empty: the address dialled).
    pub owner_addr: String,
    /// Content digest of the template, when the catalog knows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_digest: Option<String>,
    /// The checkpoint it was claimed from, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_checkpoint: Option<String>,
    /// The volumes it holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::VolumeSpec>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("id", &self.id)
            .field("token", &"<redacted>")
            .field("deadline", &self.deadline)
            .field("owner_addr", &self.owner_addr)
            .field("template_digest", &self.template_digest)
            .field("from_checkpoint", &self.from_checkpoint)
            .finish()
    }
}

/// A client's view of the `200` of `POST /v1/claim`: a [`Grant`], or (a node of a mesh with
/// no warm VM) an empty id and the peers to try, `{"redirect": [addr…]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimReply {
    /// The grant (empty `id` with a redirect).
    #[serde(flatten)]
    pub grant: Grant,
    /// Peers to resend the claim to, with `no_redirect`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redirect: Vec<String>,
}

/// The `POST /v1/sandboxes/{id}/renew` body (an absent body is the default: 300 s).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewRequest {
    /// The new lease from now, seconds (as [`ClaimRequest::ttl_seconds`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<i64>,
}

/// The `200` of `POST /v1/sandboxes/{id}/renew`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Renewed {
    /// The new lease end, RFC 3339.
    pub deadline: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wire<T: Serialize>(v: &T) -> String {
        serde_json::to_string(v).expect("serialize")
    }

    #[test]
    fn claim_request_omits_what_is_absent_and_accepts_unknown_fields() {
        assert_eq!(wire(&ClaimRequest::new("rt")), r#"{"template":"rt"}"#);
        let full = ClaimRequest {
            template: "rt:24.04".into(),
            net: Some("egress".into()),
            size: Some("large".into()),
            ttl_seconds: Some(600),
            claim_ref: Some("ns/pod".into()),
            require_promoted: None,
            volumes: None,
            volumes_attach_only: None,
            no_redirect: None,
        };
        assert_eq!(
            wire(&full),
            r#"{"template":"rt:24.04","net":"egress","size":"large","ttl_seconds":600,"claim_ref":"ns/pod"}"#
        );
        let back: ClaimRequest = serde_json::from_str(&wire(&full)).expect("round trip");
        assert_eq!(back, full);
        // What the SDK and vk-sandbox may add is read past.
        let sdk: ClaimRequest = serde_json::from_value(json!({
            "template": "base", "no_redirect": true, "metadata": {"a": "b"}, "volumes": [{"name": "v"}], "net": null
        }))
        .expect("unknown fields");
        assert_eq!((sdk.template.as_str(), sdk.no_redirect), ("base", Some(true)));
        assert_eq!(sdk.net, None, "null is absent");
        assert_eq!(sdk.volumes.map(|v| v.len()), Some(1));
        assert_eq!(serde_json::from_str::<ClaimRequest>("{}").expect("empty"), ClaimRequest::default());
    }

    #[test]
    fn grant_shape_and_redacted_debug() {
        let g = Grant {
            id: "sb_0123456789abcdef".into(),
            token: "0123456789abcdef0123456789abcdef".into(),
            deadline: "2030-01-01T00:00:00Z".into(),
            owner_addr: "10.0.0.5:7777".into(),
            template_digest: None,
            from_checkpoint: None,
            volumes: Vec::new(),
        };
        assert_eq!(
            wire(&g),
            r#"{"id":"sb_0123456789abcdef","token":"0123456789abcdef0123456789abcdef","deadline":"2030-01-01T00:00:00Z","owner_addr":"10.0.0.5:7777"}"#,
            "template_digest is omitted when unknown"
        );
        let with_digest = Grant { template_digest: Some("sha256:ab".into()), ..g.clone() };
        assert!(wire(&with_digest).ends_with(r#","template_digest":"sha256:ab"}"#));
        assert_eq!(serde_json::from_str::<Grant>(&wire(&with_digest)).expect("round trip"), with_digest);
        assert!(!format!("{g:?}").contains(&g.token), "the token leaked into Debug");
    }

    #[test]
    fn claim_reply_reads_a_grant_or_a_redirect() {
        let r: ClaimReply = serde_json::from_value(json!({
            "id": "sb_1", "token": "t", "deadline": "d", "owner_addr": "o", "net_route": "ignored"
        }))
        .expect("grant");
        assert_eq!((r.grant.id.as_str(), r.grant.token.as_str()), ("sb_1", "t"));
        assert!(r.redirect.is_empty());
        let r: ClaimReply = serde_json::from_str(r#"{"redirect":["10.0.0.9:7777"]}"#).expect("redirect");
        assert_eq!(r.grant, Grant::default());
        assert_eq!(r.redirect, ["10.0.0.9:7777"]);
        assert_eq!(wire(&r), r#"{"id":"","token":"","deadline":"","owner_addr":"","redirect":["10.0.0.9:7777"]}"#);
    }

    #[test]
    fn renew_bodies() {
        assert_eq!(wire(&RenewRequest::default()), "{}");
        assert_eq!(serde_json::from_str::<RenewRequest>(r#"{"ttl_seconds":-1}"#).expect("parse").ttl_seconds, Some(-1));
        let r = Renewed { deadline: "2030-01-01T00:00:00Z".into() };
        assert_eq!(wire(&r), r#"{"deadline":"2030-01-01T00:00:00Z"}"#);
        assert_eq!(serde_json::from_str::<Renewed>(&wire(&r)).expect("round trip"), r);
    }
}

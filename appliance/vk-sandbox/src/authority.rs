//! Delete authority (`docs/virtual-node.md` §2.7, §5 pitfalls 1 and 4): **pod deletion
//! is not VM authority**. Deleting a Pod releases (destroys) its VM only when the Pod's
//! controller owner confirms the workload is over.
//!
//! # Expected flow
//! 1. [`controller_owner`] picks the Pod's controller ownerRef (none: a bare Pod).
//! 2. [`OwnerLookup::lookup`] reads that owner through the dynamic API, at the resource
//!    [`api_resource`] builds from the ref (real English plurals: [`plural`]).
//! 3. [`verdict`] — a pure function — decides Release or Preserve.
//!
//! # Guarantees
//! Release only on a positive signal: no controller owner; a structured NotFound naming the
//! owner (`details.name`); the owner in teardown (`deletionTimestamp`); a different owner UID
//! under the same name; a Sandbox owner Ready=False with reason `SandboxExpired`.
//! Everything else preserves: owner alive, a 404 without `details.name` (wrong resource guess,
//! not "owner gone"), any other error, no client.

use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::Status;

use crate::state::OwnerRef;

/// Why an owner read could not be made at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    /// The ownerRef's apiVersion does not parse as `[group/]version`.
    #[error("owner {kind}/{name}: apiVersion {api_version:?} is not of the form [group/]version")]
    BadApiVersion { api_version: String, kind: String, name: String },
}

/// The decision for one deletion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The owner is confirmed gone or done: release the claim (destroys the VM).
    Release,
    /// Keep the claim and its token for a same-name replacement Pod to adopt.
    Preserve,
}

/// A verdict and why (logged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub verdict: Verdict,
    pub reason: String,
}

/// What reading the owner returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The owner object exists.
    Found(OwnerState),
    /// `404`; `details_name` is the status's `details.name` (empty when absent).
    NotFound { details_name: String },
    /// Any other failure (network, 403, 5xx, a ref we cannot map).
    Failed(String),
    /// No API client is configured.
    NoClient,
}

/// The parts of a live owner the verdict reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerState {
    pub uid: String,
    pub deleting: bool,
    /// A `Sandbox` whose `Ready` condition is `False` with reason `SandboxExpired`.
    pub sandbox_expired: bool,
}

/// The Pod's controller ownerRef, if any.
pub fn controller_owner(pod: &k8s_openapi::api::core::v1::Pod) -> Option<OwnerRef> {
    pod.metadata.owner_references.as_ref()?.iter().find(|r| r.controller == Some(true)).map(|r| OwnerRef {
        api_version: r.api_version.clone(),
        kind: r.kind.clone(),
        name: r.name.clone(),
        uid: r.uid.clone(),
    })
}

/// The REST resource name of `kind`: lowercase, then English plural rules
/// (`Sandbox`→`sandboxes`, `NetworkPolicy`→`networkpolicies`, `Gateway`→`gateways`).
pub fn plural(kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    // The few core kinds whose resource name is not a regular plural.
    match lower.as_str() {
        "endpoints" => return lower,
        "" => return lower,
        _ => {}
    }
    let ends = |s: &str| lower.ends_with(s);
    if ends("s") || ends("x") || ends("z") || ends("ch") || ends("sh") {
        return format!("{lower}es");
    }
    if let Some(stem) = lower.strip_suffix('y') {
        if stem.chars().last().is_some_and(|c| !"aeiou".contains(c)) {
            return format!("{stem}ies");
        }
    }
    format!("{lower}s")
}

/// The dynamic resource of `owner` (group/version from its apiVersion, plural from its kind).
pub fn api_resource(owner: &OwnerRef) -> Result<ApiResource, AuthorityError> {
    let bad = || AuthorityError::BadApiVersion {
        api_version: owner.api_version.clone(),
        kind: owner.kind.clone(),
        name: owner.name.clone(),
    };
    let (group, version) = match owner.api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", owner.api_version.as_str()),
    };
    if version.is_empty()
        || version.contains('/')
        || owner.kind.is_empty()
        || (owner.api_version.contains('/') && group.is_empty())
    {
        return Err(bad());
    }
    Ok(ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: owner.api_version.clone(),
        kind: owner.kind.clone(),
        plural: plural(&owner.kind),
    })
}

/// The verdict-relevant state of a fetched owner object.
pub fn owner_state(obj: &DynamicObject) -> OwnerState {
    let kind = obj.types.as_ref().map(|t| t.kind.as_str()).unwrap_or("");
    OwnerState {
        uid: obj.metadata.uid.clone().unwrap_or_default(),
        deleting: obj.metadata.deletion_timestamp.is_some(),
        sandbox_expired: kind == "Sandbox" && sandbox_expired(&obj.data),
    }
}

/// Whether a Sandbox's `status.conditions` has Ready=False, reason `SandboxExpired`.
fn sandbox_expired(data: &serde_json::Value) -> bool {
    data["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "False" && c["reason"] == "SandboxExpired")
    })
}

/// The decision for deleting a Pod whose controller owner is `owner`, given what reading
/// that owner returned (`lookup` is not consulted for a bare Pod).
pub fn verdict(owner: Option<&OwnerRef>, lookup: &Lookup) -> Decision {
    let release = |reason: String| Decision { verdict: Verdict::Release, reason };
    let preserve = |reason: String| Decision { verdict: Verdict::Preserve, reason };
    let Some(o) = owner else {
        return release("bare pod (no controller owner): its deletion is the teardown".into());
    };
    let who = format!("owner {} {}", o.kind, o.name);
    match lookup {
        Lookup::NoClient => preserve(format!("{who}: no API client, owner state unverifiable")),
        Lookup::Failed(e) => preserve(format!("{who}: read failed ({e}); preserving")),
        Lookup::NotFound { details_name } if !details_name.is_empty() && *details_name == o.name => {
            release(format!("{who} confirmed gone (structured NotFound)"))
        }
        Lookup::NotFound { details_name } => preserve(format!(
            "{who}: 404 without a matching details.name ({details_name:?}): the resource guess may be wrong; preserving"
        )),
        Lookup::Found(s) if s.deleting => release(format!("{who} is being deleted")),
        Lookup::Found(s) if !o.uid.is_empty() && s.uid != o.uid => {
            release(format!("{who} was replaced (uid {} ≠ referenced {})", s.uid, o.uid))
        }
        Lookup::Found(s) if s.sandbox_expired => release(format!("{who} expired (Ready=False, SandboxExpired)")),
        Lookup::Found(_) => preserve(format!("{who} is alive: pod deletion is not VM authority")),
    }
}

/// Maps a kube error to a [`Lookup`].
pub fn lookup_of_error(e: &kube::Error) -> Lookup {
    match e {
        kube::Error::Api(status) if is_not_found(status) => {
            Lookup::NotFound { details_name: status.details.as_ref().map(|d| d.name.clone()).unwrap_or_default() }
        }
        other => Lookup::Failed(other.to_string()),
    }
}

fn is_not_found(s: &Status) -> bool {
    s.code == 404 || s.reason == "NotFound"
}

/// Reads a Pod's owner. A trait so the provider's tests can answer without an API server.
#[async_trait::async_trait]
pub trait OwnerLookup: Send + Sync + 'static {
    /// Reads `owner` in `namespace`.
    async fn lookup(&self, namespace: &str, owner: &OwnerRef) -> Lookup;
}

/// The production lookup: the dynamic API over a swappable client (replaced when the node
/// credentials rotate).
#[derive(Default)]
pub struct KubeOwners {
    client: std::sync::RwLock<Option<kube::Client>>,
}

impl KubeOwners {
    /// A lookup with no client yet (every lookup answers [`Lookup::NoClient`]).
    pub fn new() -> KubeOwners {
        KubeOwners::default()
    }

    /// Installs (or replaces) the client.
    pub fn set_client(&self, client: kube::Client) {
        let mut g = self.client.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        *g = Some(client);
    }
}

#[async_trait::async_trait]
impl OwnerLookup for KubeOwners {
    async fn lookup(&self, namespace: &str, owner: &OwnerRef) -> Lookup {
        let client = self.client.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let Some(client) = client else {
            return Lookup::NoClient;
        };
        let ar = match api_resource(owner) {
            Ok(ar) => ar,
            Err(e) => return Lookup::Failed(e.to_string()),
        };
        let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &ar);
        match api.get(&owner.name).await {
            Ok(obj) => Lookup::Found(owner_state(&obj)),
            Err(e) => lookup_of_error(&e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn sandbox(uid: &str) -> OwnerRef {
        OwnerRef {
            api_version: "agents.x-k8s.io/v1beta1".into(),
            kind: "Sandbox".into(),
            name: "sb-1".into(),
            uid: uid.into(),
        }
    }

    fn alive(uid: &str) -> Lookup {
        Lookup::Found(OwnerState { uid: uid.into(), ..OwnerState::default() })
    }

    #[test]
    fn plurals_follow_english_rules() {
        for (kind, want) in [
            ("Sandbox", "sandboxes"),
            ("SandboxClaim", "sandboxclaims"),
            ("SandboxWarmPool", "sandboxwarmpools"),
            ("NetworkPolicy", "networkpolicies"),
            ("PodSecurityPolicy", "podsecuritypolicies"),
            ("Gateway", "gateways"),
            ("Ingress", "ingresses"),
            ("Status", "statuses"),
            ("Match", "matches"),
            ("Mesh", "meshes"),
            ("Blitz", "blitzes"),
            ("ReplicaSet", "replicasets"),
            ("StatefulSet", "statefulsets"),
            ("Job", "jobs"),
            ("CocoonSet", "cocoonsets"),
            ("Endpoints", "endpoints"),
        ] {
            assert_eq!(plural(kind), want, "{kind}");
        }
    }

    #[test]
    fn api_resource_from_the_owner_ref() {
        let ar = api_resource(&sandbox("u")).unwrap();
        assert_eq!(
            (ar.group.as_str(), ar.version.as_str(), ar.plural.as_str()),
            ("agents.x-k8s.io", "v1beta1", "sandboxes")
        );
        let core = OwnerRef { api_version: "v1".into(), kind: "ReplicationController".into(), ..sandbox("u") };
        let ar = api_resource(&core).unwrap();
        assert_eq!((ar.group.as_str(), ar.version.as_str()), ("", "v1"));
        for bad in ["", "a/b/c", "/v1", "apps/"] {
            let o = OwnerRef { api_version: bad.into(), ..sandbox("u") };
            assert!(api_resource(&o).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn release_rows() {
        let o = sandbox("uid-1");
        // Bare pod.
        assert_eq!(verdict(None, &Lookup::NoClient).verdict, Verdict::Release);
        // Structured NotFound naming the owner.
        assert_eq!(verdict(Some(&o), &Lookup::NotFound { details_name: "sb-1".into() }).verdict, Verdict::Release);
        // Owner in teardown.
        let deleting = Lookup::Found(OwnerState { uid: "uid-1".into(), deleting: true, sandbox_expired: false });
        assert_eq!(verdict(Some(&o), &deleting).verdict, Verdict::Release);
        // Same name, another UID.
        assert_eq!(verdict(Some(&o), &alive("uid-2")).verdict, Verdict::Release);
        // Expired Sandbox.
        let expired = Lookup::Found(OwnerState { uid: "uid-1".into(), deleting: false, sandbox_expired: true });
        assert_eq!(verdict(Some(&o), &expired).verdict, Verdict::Release);
    }

    #[test]
    fn preserve_rows() {
        let o = sandbox("uid-1");
        assert_eq!(verdict(Some(&o), &alive("uid-1")).verdict, Verdict::Preserve);
        // 404 without details.name, or naming something else: the endpoint guess, not the owner.
        assert_eq!(verdict(Some(&o), &Lookup::NotFound { details_name: String::new() }).verdict, Verdict::Preserve);
        assert_eq!(verdict(Some(&o), &Lookup::NotFound { details_name: "other".into() }).verdict, Verdict::Preserve);
        assert_eq!(verdict(Some(&o), &Lookup::Failed("403 forbidden".into())).verdict, Verdict::Preserve);
        assert_eq!(verdict(Some(&o), &Lookup::NoClient).verdict, Verdict::Preserve);
        // A ref without a UID cannot detect replacement: alive preserves.
        let no_uid = sandbox("");
        assert_eq!(verdict(Some(&no_uid), &alive("uid-9")).verdict, Verdict::Preserve);
    }

    #[test]
    fn owner_state_reads_deletion_uid_and_sandbox_expiry() {
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
            "metadata": {"name": "sb-1", "uid": "uid-1"},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "SandboxExpired"}]},
        }))
        .unwrap();
        assert_eq!(owner_state(&obj), OwnerState { uid: "uid-1".into(), deleting: false, sandbox_expired: true });
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
            "metadata": {"name": "sb-1", "uid": "uid-1", "deletionTimestamp": "2030-01-01T00:00:00Z"},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "SandboxPodNotReady"}]},
        }))
        .unwrap();
        assert_eq!(owner_state(&obj), OwnerState { uid: "uid-1".into(), deleting: true, sandbox_expired: false });
        // Another kind with the same condition is not an expired Sandbox.
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "example.io/v1", "kind": "Thing", "metadata": {"name": "t", "uid": "u"},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "SandboxExpired"}]},
        }))
        .unwrap();
        assert!(!owner_state(&obj).sandbox_expired);
    }

    #[test]
    fn kube_errors_map_to_lookups() {
        let nf = Status::failure("sandboxes \"sb-1\" not found", "NotFound").with_code(404).with_details(
            kube::core::response::StatusDetails {
                name: "sb-1".into(),
                group: "agents.x-k8s.io".into(),
                kind: "sandboxes".into(),
                uid: String::new(),
                causes: vec![],
                retry_after_seconds: 0,
            },
        );
        assert_eq!(lookup_of_error(&kube::Error::Api(nf.boxed())), Lookup::NotFound { details_name: "sb-1".into() });
        let bare404 = Status::failure("the server could not find the requested resource", "NotFound").with_code(404);
        assert_eq!(
            lookup_of_error(&kube::Error::Api(bare404.boxed())),
            Lookup::NotFound { details_name: String::new() }
        );
        let forbidden = Status::failure("forbidden", "Forbidden").with_code(403);
        assert!(matches!(lookup_of_error(&kube::Error::Api(forbidden.boxed())), Lookup::Failed(_)));
    }

    #[test]
    fn controller_owner_is_the_controller_ref_only() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let mut pod = k8s_openapi::api::core::v1::Pod::default();
        assert_eq!(controller_owner(&pod), None);
        let r = |name: &str, controller: Option<bool>| OwnerReference {
            api_version: "agents.x-k8s.io/v1beta1".into(),
            kind: "Sandbox".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller,
            ..OwnerReference::default()
        };
        pod.metadata.owner_references = Some(vec![r("a", None), r("b", Some(false))]);
        assert_eq!(controller_owner(&pod), None);
        pod.metadata.owner_references = Some(vec![r("a", None), r("c", Some(true))]);
        assert_eq!(controller_owner(&pod).unwrap().name, "c");
    }
}

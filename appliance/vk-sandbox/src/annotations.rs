//! The Pod contract's input annotations (`docs/virtual-node.md` §2.4, prefix
//! `sandbox.cocoonstack.io/`): which runtime the Pod asks for and which warm pool it claims
//! from. Parsing is pure; every refusal tells the pod author what to change.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

/// `sandbox.cocoonstack.io/runtime`: absent or `sandboxd`.
pub const RUNTIME: &str = "sandbox.cocoonstack.io/runtime";
/// `sandbox.cocoonstack.io/template`: the pool template (required).
pub const TEMPLATE: &str = "sandbox.cocoonstack.io/template";
/// `sandbox.cocoonstack.io/net`: the pool network lane.
pub const NET: &str = "sandbox.cocoonstack.io/net";
/// `sandbox.cocoonstack.io/size`: the pool size class.
pub const SIZE: &str = "sandbox.cocoonstack.io/size";
/// `sandbox.cocoonstack.io/ttl-seconds`: the claim lease (absent or empty → 86400).
pub const TTL_SECONDS: &str = "sandbox.cocoonstack.io/ttl-seconds";
/// `sandbox.cocoonstack.io/claim-id`: written back on the pushed Pod copy.
pub const CLAIM_ID: &str = "sandbox.cocoonstack.io/claim-id";

/// The one runtime this node serves.
pub const RUNTIME_SANDBOXD: &str = "sandboxd";
/// The lease asked for when the Pod names none: sandboxd's maximum for an ordinary claim.
pub const DEFAULT_TTL_SECONDS: u64 = 86_400;

/// What a Pod asks sandboxd for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimSpec {
    /// Pool template (the claim axis, not the container image).
    pub template: String,
    /// Network lane; empty = sandboxd's default.
    pub net: String,
    /// Size class; empty = sandboxd's default.
    pub size: String,
    /// Lease in seconds; 0 = sandboxd's five-minute default.
    pub ttl_seconds: u64,
}

/// Why a Pod's annotations cannot be served. The text becomes the Pod's `ProviderFailed`
/// message, so each variant names the annotation and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    /// A runtime other than sandboxd.
    #[error(
        "annotation {RUNTIME}={0:?}: this node serves runtime sandboxd only; set it to \"sandboxd\" (or remove it), \
         or schedule the pod onto a node serving that runtime"
    )]
    WrongRuntime(String),
    /// No template.
    #[error(
        "annotation {TEMPLATE} is missing: name the sandboxd pool template to claim from \
         (e.g. ghcr.io/cocoonstack/sandbox/rt:24.04)"
    )]
    MissingTemplate,
    /// A TTL that is not a non-negative integer.
    #[error(
        "annotation {TTL_SECONDS}={0:?} is not a non-negative integer number of seconds: remove it for 86400, \
         use 0 for sandboxd's five-minute default, or give a whole number of seconds"
    )]
    BadTtl(String),
}

fn annotations(pod: &Pod) -> Option<&BTreeMap<String, String>> {
    pod.metadata.annotations.as_ref()
}

/// Checks `sandbox.cocoonstack.io/runtime` (absent or empty = sandboxd).
pub fn check_runtime(pod: &Pod) -> Result<(), AnnotationError> {
    match annotations(pod).and_then(|a| a.get(RUNTIME)).map(|v| v.trim()) {
        None | Some("") | Some(RUNTIME_SANDBOXD) => Ok(()),
        Some(other) => Err(AnnotationError::WrongRuntime(other.to_owned())),
    }
}

fn value<'a>(pod: &'a Pod, key: &str) -> &'a str {
    annotations(pod).and_then(|a| a.get(key)).map(|v| v.trim()).unwrap_or("")
}

/// Parses the Pod's claim annotations (runtime checked first).
pub fn claim_spec(pod: &Pod) -> Result<ClaimSpec, AnnotationError> {
    check_runtime(pod)?;
    let template = value(pod, TEMPLATE);
    if template.is_empty() {
        return Err(AnnotationError::MissingTemplate);
    }
    // An empty value reads as absent (as upstream's annotation lookup does).
    let ttl_seconds = match value(pod, TTL_SECONDS) {
        "" => DEFAULT_TTL_SECONDS,
        raw => raw.parse::<u64>().map_err(|_| AnnotationError::BadTtl(raw.to_owned()))?,
    };
    Ok(ClaimSpec {
        template: template.to_owned(),
        net: value(pod, NET).to_owned(),
        size: value(pod, SIZE).to_owned(),
        ttl_seconds,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn pod(anns: &[(&str, &str)]) -> Pod {
        let mut p = Pod::default();
        p.metadata.annotations = Some(anns.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect());
        p
    }

    #[test]
    fn runtime_absent_or_sandboxd_is_served_anything_else_refused() {
        assert_eq!(check_runtime(&Pod::default()), Ok(()));
        assert_eq!(check_runtime(&pod(&[])), Ok(()));
        assert_eq!(check_runtime(&pod(&[(RUNTIME, "sandboxd")])), Ok(()));
        let err = check_runtime(&pod(&[(RUNTIME, "cocoon")])).unwrap_err();
        assert_eq!(err, AnnotationError::WrongRuntime("cocoon".into()));
        assert!(err.to_string().contains("this node serves runtime sandboxd only"), "{err}");
        // The runtime is checked before anything else.
        assert_eq!(
            claim_spec(&pod(&[(RUNTIME, "kata"), (TEMPLATE, "rt")])),
            Err(AnnotationError::WrongRuntime("kata".into()))
        );
    }

    #[test]
    fn template_is_required() {
        let err = claim_spec(&pod(&[(RUNTIME, "sandboxd")])).unwrap_err();
        assert_eq!(err, AnnotationError::MissingTemplate);
        assert!(err.to_string().contains(TEMPLATE), "{err}");
        assert_eq!(claim_spec(&pod(&[(TEMPLATE, "  ")])), Err(AnnotationError::MissingTemplate));
    }

    #[test]
    fn net_and_size_are_optional_and_passed_through() {
        let s = claim_spec(&pod(&[(TEMPLATE, "rt:24.04")])).unwrap();
        assert_eq!(
            s,
            ClaimSpec { template: "rt:24.04".into(), net: String::new(), size: String::new(), ttl_seconds: 86_400 }
        );
        let s = claim_spec(&pod(&[(TEMPLATE, "rt"), (NET, "egress"), (SIZE, "large")])).unwrap();
        assert_eq!((s.net.as_str(), s.size.as_str()), ("egress", "large"));
    }

    #[test]
    fn ttl_absent_is_a_day_zero_is_sandboxd_default_bad_values_refused() {
        let ttl = |v: &str| claim_spec(&pod(&[(TEMPLATE, "rt"), (TTL_SECONDS, v)])).map(|s| s.ttl_seconds);
        assert_eq!(claim_spec(&pod(&[(TEMPLATE, "rt")])).unwrap().ttl_seconds, 86_400);
        assert_eq!(ttl("0"), Ok(0));
        assert_eq!(ttl("3600"), Ok(3600));
        assert_eq!(ttl("-1"), Err(AnnotationError::BadTtl("-1".into())));
        assert_eq!(ttl("1.5"), Err(AnnotationError::BadTtl("1.5".into())));
        assert_eq!(ttl("1h"), Err(AnnotationError::BadTtl("1h".into())));
        assert_eq!(ttl(""), Ok(86_400), "an empty value reads as absent");
        let msg = ttl("-5").unwrap_err().to_string();
        assert!(msg.contains(TTL_SECONDS) && msg.contains("\"-5\""), "{msg}");
    }
}

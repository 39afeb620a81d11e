//! Pod status shapes (`docs/virtual-node.md` §2.6): what the provider pushes for a Pod
//! backed by a claim. Nothing here is reported by a kubelet — there is no container runtime on
//! this node — so every field is synthesized from the claim record. Pure functions.

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use vnode::pod_status::{self, Container};

use crate::annotations::CLAIM_ID;
use crate::state::ClaimRecord;

/// The lease-expiry reason on the Pod and its containers.
pub const LEASE_EXPIRED: &str = "SandboxLeaseExpired";

/// The host part of a sandboxd `owner_addr`: `host:port`, `[v6]:port`, a bare host, or a full
/// origin (`https://host:port/…`). Empty in, empty out.
pub fn host_of(addr: &str) -> String {
    let addr = addr.trim();
    let rest = addr.split_once("://").map(|(_, r)| r).unwrap_or(addr);
    let authority = rest.split('/').next().unwrap_or("");
    let authority = authority.rsplit_once('@').map(|(_, h)| h).unwrap_or(authority);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or("").to_owned();
    }
    match authority.matches(':').count() {
        1 => authority.split(':').next().unwrap_or("").to_owned(),
        _ => authority.to_owned(), // bare host, or a bare IPv6 address
    }
}

/// Pod and host IP: the claim's address (both, when there is one).
fn with_addresses(st: PodStatus, ip: &str) -> PodStatus {
    pod_status::with_addresses(st, ip, ip)
}

/// The IP a claim is reported under: the host of its `owner_addr`, else `fallback_host`.
pub fn claim_ip(rec: &ClaimRecord, fallback_host: &str) -> String {
    match host_of(&rec.address) {
        h if h.is_empty() => fallback_host.to_owned(),
        h => h,
    }
}

fn claimed_at(rec: &ClaimRecord) -> Time {
    // A record always has a claim time once created or adopted; "now" only for legacy rows.
    Time(rec.claimed_at.unwrap_or_else(Timestamp::now))
}

/// Every spec container, `imageID` `sandboxd://<claim id>`.
fn containers(pod: &Pod, rec: &ClaimRecord) -> Vec<Container> {
    Container::every_spec_container(pod, &format!("sandboxd://{}", rec.id))
}

/// `Running`: the claim's address as pod/host IP, started at the claim time, every spec
/// container ready and running, `imageID` `sandboxd://<claim id>`.
pub fn running(pod: &Pod, rec: &ClaimRecord, fallback_host: &str) -> PodStatus {
    let st = pod_status::running(pod, &containers(pod, rec), &claimed_at(rec), None);
    with_addresses(st, &claim_ip(rec, fallback_host))
}

/// `Failed`, reason `SandboxLeaseExpired`: every container Terminated with exit code 1 at the
/// lease deadline.
pub fn lease_expired(pod: &Pod, rec: &ClaimRecord, fallback_host: &str) -> PodStatus {
    let started = claimed_at(rec);
    let ended = rec.deadline.map(Time).unwrap_or_else(|| Time(Timestamp::now()));
    let message = format!("the sandbox lease of claim {} ended at {} and sandboxd no longer holds it", rec.id, ended.0);
    let st = pod_status::failed(pod, &containers(pod, rec), &started, &ended, LEASE_EXPIRED, &message);
    with_addresses(st, &claim_ip(rec, fallback_host))
}

/// `Pending`: tracked without a settled claim (the Pod's other status fields kept).
pub use vnode::pod_status::pending;

/// A copy of `pod` with `status` and the `claim-id` annotation (never the token).
pub fn pushed(pod: &Pod, status: PodStatus, claim_id: Option<&str>) -> Pod {
    pod_status::pushed(pod, status, claim_id.map(|id| (CLAIM_ID, id)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn pod() -> Pod {
        let containers =
            [("agent", "rt:24.04"), ("side", "busybox")].map(|(n, i)| serde_json::json!({"name": n, "image": i}));
        serde_json::from_value(serde_json::json!({"spec": {"containers": containers}})).unwrap()
    }

    fn rec(address: &str) -> ClaimRecord {
        ClaimRecord {
            id: "sb_0011223344556677".into(),
            token: "tok".into(),
            address: address.into(),
            pod_uid: "u".into(),
            claimed_at: Some("2030-01-01T00:00:00Z".parse().unwrap()),
            deadline: Some("2030-01-02T00:00:00Z".parse().unwrap()),
            owner: None,
        }
    }

    #[test]
    fn host_of_every_address_form() {
        for (addr, host) in [
            ("10.0.0.5:7777", "10.0.0.5"),
            ("10.0.0.5", "10.0.0.5"),
            ("node-a.example:7777", "node-a.example"),
            ("[fd00::1]:7777", "fd00::1"),
            ("fd00::1", "fd00::1"),
            ("https://10.0.0.6:8443", "10.0.0.6"),
            ("http://sbx.example/prefix", "sbx.example"),
            ("", ""),
        ] {
            assert_eq!(host_of(addr), host, "{addr}");
        }
    }

    #[test]
    fn running_shape() {
        let st = running(&pod(), &rec("10.1.2.3:7777"), "127.0.0.1");
        assert_eq!(st.phase.as_deref(), Some("Running"));
        assert_eq!(st.pod_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(st.host_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(st.pod_ips.as_ref().unwrap()[0].ip, "10.1.2.3");
        assert_eq!(st.host_ips.as_ref().unwrap()[0].ip, "10.1.2.3");
        assert_eq!(st.start_time.as_ref().unwrap().0.to_string(), "2030-01-01T00:00:00Z");
        let conds = st.conditions.as_ref().unwrap();
        for t in ["Initialized", "Ready", "ContainersReady", "PodScheduled"] {
            assert!(conds.iter().any(|c| c.type_ == t && c.status == "True"), "{t}");
        }
        let cs = st.container_statuses.as_ref().unwrap();
        assert_eq!(cs.len(), 2);
        assert_eq!((cs[0].name.as_str(), cs[0].image.as_str()), ("agent", "rt:24.04"));
        assert_eq!(cs[1].image, "busybox");
        for c in cs {
            assert!(c.ready);
            assert_eq!(c.image_id, "sandboxd://sb_0011223344556677");
            let r = c.state.as_ref().unwrap().running.as_ref().unwrap();
            assert_eq!(r.started_at.as_ref().unwrap().0.to_string(), "2030-01-01T00:00:00Z");
        }
        // Empty owner_addr: the fallback host.
        let st = running(&pod(), &rec(""), "192.168.7.7");
        assert_eq!(st.pod_ip.as_deref(), Some("192.168.7.7"));
    }

    #[test]
    fn lease_expired_shape() {
        let st = lease_expired(&pod(), &rec("10.1.2.3:7777"), "");
        assert_eq!(st.phase.as_deref(), Some("Failed"));
        assert_eq!(st.reason.as_deref(), Some(LEASE_EXPIRED));
        for c in st.container_statuses.as_ref().unwrap() {
            let t = c.state.as_ref().unwrap().terminated.as_ref().unwrap();
            assert_eq!(t.exit_code, 1);
            assert_eq!(t.finished_at.as_ref().unwrap().0.to_string(), "2030-01-02T00:00:00Z");
            assert!(!c.ready);
        }
    }

    #[test]
    fn pushed_copy_carries_the_claim_id_and_no_token() {
        let p = pushed(&pod(), running(&pod(), &rec("10.1.2.3:7777"), ""), Some("sb_0011223344556677"));
        assert_eq!(p.metadata.annotations.as_ref().unwrap()[CLAIM_ID], "sb_0011223344556677");
        assert!(!serde_json::to_string(&p).unwrap().contains("\"tok\""));
    }
}

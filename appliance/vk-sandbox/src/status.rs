//! Pod status shapes (`shared/spec/virtual-node.md` §2.6): what the provider pushes for a Pod
//! backed by a claim. Nothing here is reported by a kubelet — there is no container runtime on
//! this node — so every field is synthesized from the claim record. Pure functions.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, HostIP, Pod, PodCondition, PodIP,
    PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

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

fn condition(type_: &str, status: &str, at: &Time, reason: Option<&str>) -> PodCondition {
    PodCondition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        last_transition_time: Some(at.clone()),
        reason: reason.map(str::to_owned),
        ..PodCondition::default()
    }
}

fn with_addresses(mut st: PodStatus, ip: &str) -> PodStatus {
    if !ip.is_empty() {
        st.pod_ip = Some(ip.to_owned());
        st.pod_ips = Some(vec![PodIP { ip: ip.to_owned() }]);
        st.host_ip = Some(ip.to_owned());
        st.host_ips = Some(vec![HostIP { ip: ip.to_owned() }]);
    }
    st
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

/// `Running`: the claim's address as pod/host IP, started at the claim time, every spec
/// container ready and running, `imageID` `sandboxd://<claim id>`.
pub fn running(pod: &Pod, rec: &ClaimRecord, fallback_host: &str) -> PodStatus {
    let at = claimed_at(rec);
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    let st = PodStatus {
        phase: Some("Running".into()),
        start_time: Some(at.clone()),
        conditions: Some(vec![
            condition("PodScheduled", "True", &at, None),
            condition("Initialized", "True", &at, None),
            condition("ContainersReady", "True", &at, None),
            condition("Ready", "True", &at, None),
        ]),
        container_statuses: Some(
            containers
                .iter()
                .map(|c| ContainerStatus {
                    name: c.name.clone(),
                    image: c.image.clone().unwrap_or_default(),
                    image_id: format!("sandboxd://{}", rec.id),
                    ready: true,
                    started: Some(true),
                    restart_count: 0,
                    state: Some(ContainerState {
                        running: Some(ContainerStateRunning { started_at: Some(at.clone()) }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                })
                .collect(),
        ),
        qos_class: pod.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    };
    with_addresses(st, &claim_ip(rec, fallback_host))
}

/// `Failed`, reason `SandboxLeaseExpired`: every container Terminated with exit code 1 at the
/// lease deadline.
pub fn lease_expired(pod: &Pod, rec: &ClaimRecord, fallback_host: &str) -> PodStatus {
    let started = claimed_at(rec);
    let ended = rec.deadline.map(Time).unwrap_or_else(|| Time(Timestamp::now()));
    let message = format!("the sandbox lease of claim {} ended at {} and sandboxd no longer holds it", rec.id, ended.0);
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    let st = PodStatus {
        phase: Some("Failed".into()),
        reason: Some(LEASE_EXPIRED.into()),
        message: Some(message.clone()),
        start_time: Some(started.clone()),
        conditions: Some(vec![
            condition("PodScheduled", "True", &started, None),
            condition("Initialized", "True", &started, None),
            condition("ContainersReady", "False", &ended, Some(LEASE_EXPIRED)),
            condition("Ready", "False", &ended, Some(LEASE_EXPIRED)),
        ]),
        container_statuses: Some(
            containers
                .iter()
                .map(|c| ContainerStatus {
                    name: c.name.clone(),
                    image: c.image.clone().unwrap_or_default(),
                    image_id: format!("sandboxd://{}", rec.id),
                    ready: false,
                    started: Some(false),
                    restart_count: 0,
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            exit_code: 1,
                            reason: Some(LEASE_EXPIRED.into()),
                            message: Some(message.clone()),
                            started_at: Some(started.clone()),
                            finished_at: Some(ended.clone()),
                            ..ContainerStateTerminated::default()
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                })
                .collect(),
        ),
        qos_class: pod.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    };
    with_addresses(st, &claim_ip(rec, fallback_host))
}

/// `Pending`: tracked without a settled claim (the Pod's other status fields kept).
pub fn pending(pod: &Pod) -> PodStatus {
    let mut st = pod.status.clone().unwrap_or_default();
    st.phase = Some("Pending".into());
    st
}

/// A copy of `pod` with `status` and the `claim-id` annotation (never the token).
pub fn pushed(pod: &Pod, status: PodStatus, claim_id: Option<&str>) -> Pod {
    let mut out = pod.clone();
    if let Some(id) = claim_id {
        out.metadata.annotations.get_or_insert_with(Default::default).insert(CLAIM_ID.to_owned(), id.to_owned());
    }
    out.status = Some(status);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    fn pod() -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![
                    Container { name: "agent".into(), image: Some("rt:24.04".into()), ..Container::default() },
                    Container { name: "side".into(), image: Some("busybox".into()), ..Container::default() },
                ],
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
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

//! Pod status shapes (`virtual-node.md` §3.5): what the provider pushes for a Pod backed by a
//! VM. Pure functions.
//!
//! * **Running**: `podIP` = the VM's IP, `hostIP` = the node's IP, `startTime` = when the VM
//!   was created or adopted, `Initialized`/`PodScheduled` True, `Ready`/`ContainersReady` =
//!   probe ∧ lifecycle `ready`, and one container status named **`agent`**, always in state
//!   `running` while the VM exists (a `waiting` container would let the runtime force-delete
//!   the Pod without calling DeletePod, leaking the VM).
//! * **Pending**: no VM yet (or a failed bring-up).
//! * **Failed** (VM watcher eviction): reason `VMGone` / `RestartCooldown` / `RestartFailed`,
//!   `agent` Terminated with exit code 1.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, HostIP, Pod, PodCondition, PodIP,
    PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// The one container status every Pod reports.
pub const CONTAINER: &str = "agent";

/// What a status is built from.
#[derive(Debug, Clone)]
pub struct VmView<'a> {
    pub vm_id: &'a str,
    pub ip: Option<&'a str>,
    pub node_ip: &'a str,
    pub started_at: &'a Time,
    pub ready: bool,
}

fn condition(type_: &str, ok: bool, at: &Time, reason: Option<&str>) -> PodCondition {
    PodCondition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        last_transition_time: Some(at.clone()),
        reason: reason.map(str::to_owned),
        ..PodCondition::default()
    }
}

/// The image reported for the `agent` container: the spec container named `agent`, else the
/// first container's image.
fn image_of(pod: &Pod) -> String {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    containers
        .iter()
        .find(|c| c.name == CONTAINER)
        .or_else(|| containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

fn addresses(mut st: PodStatus, v: &VmView<'_>) -> PodStatus {
    if let Some(ip) = v.ip.filter(|ip| !ip.is_empty()) {
        st.pod_ip = Some(ip.to_owned());
        st.pod_ips = Some(vec![PodIP { ip: ip.to_owned() }]);
    }
    if !v.node_ip.is_empty() {
        st.host_ip = Some(v.node_ip.to_owned());
        st.host_ips = Some(vec![HostIP { ip: v.node_ip.to_owned() }]);
    }
    st
}

/// `Running` with readiness `v.ready`.
pub fn running(pod: &Pod, v: &VmView<'_>) -> PodStatus {
    let at = v.started_at;
    let not_ready = (!v.ready).then_some("VMNotReady");
    let st = PodStatus {
        phase: Some("Running".into()),
        start_time: Some(at.clone()),
        conditions: Some(vec![
            condition("PodScheduled", true, at, None),
            condition("Initialized", true, at, None),
            condition("ContainersReady", v.ready, at, not_ready),
            condition("Ready", v.ready, at, not_ready),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER.into(),
            image: image_of(pod),
            image_id: format!("cocoon://{}", v.vm_id),
            container_id: Some(format!("cocoon://{}", v.vm_id)),
            ready: v.ready,
            started: Some(true),
            restart_count: 0,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning { started_at: Some(at.clone()) }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        qos_class: pod.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    };
    addresses(st, v)
}

/// `Pending` (the Pod's other status fields kept).
pub fn pending(pod: &Pod) -> PodStatus {
    let mut st = pod.status.clone().unwrap_or_default();
    st.phase = Some("Pending".into());
    st
}

/// `Failed` with `reason`: the VM is gone; `agent` Terminated, exit code 1, at `ended`.
pub fn failed(pod: &Pod, v: &VmView<'_>, reason: &str, message: &str, ended: &Time) -> PodStatus {
    let at = v.started_at;
    let st = PodStatus {
        phase: Some("Failed".into()),
        reason: Some(reason.into()),
        message: Some(message.into()),
        start_time: Some(at.clone()),
        conditions: Some(vec![
            condition("PodScheduled", true, at, None),
            condition("Initialized", true, at, None),
            condition("ContainersReady", false, ended, Some(reason)),
            condition("Ready", false, ended, Some(reason)),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER.into(),
            image: image_of(pod),
            image_id: format!("cocoon://{}", v.vm_id),
            container_id: Some(format!("cocoon://{}", v.vm_id)),
            ready: false,
            started: Some(false),
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 1,
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                    started_at: Some(at.clone()),
                    finished_at: Some(ended.clone()),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        qos_class: pod.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    };
    addresses(st, v)
}

/// A copy of `pod` with `status` and the annotations vk-cocoon writes back added.
pub fn pushed(pod: &Pod, status: PodStatus, annotations: &BTreeMap<String, String>) -> Pod {
    let mut out = pod.clone();
    if !annotations.is_empty() {
        let a = out.metadata.annotations.get_or_insert_with(Default::default);
        for (k, v) in annotations {
            a.insert(k.clone(), v.clone());
        }
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
                    Container { name: "side".into(), image: Some("busybox".into()), ..Container::default() },
                    Container { name: "agent".into(), image: Some("ubuntu-dev-base".into()), ..Container::default() },
                ],
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn view(ready: bool, t: &Time) -> VmView<'_> {
        VmView { vm_id: "vm-1", ip: Some("10.88.0.3"), node_ip: "192.0.2.7", started_at: t, ready }
    }

    #[test]
    fn running_shape() {
        let t = Time("2030-01-01T00:00:00Z".parse().unwrap());
        let st = running(&pod(), &view(true, &t));
        assert_eq!(st.phase.as_deref(), Some("Running"));
        assert_eq!(st.pod_ip.as_deref(), Some("10.88.0.3"));
        assert_eq!(st.pod_ips.as_ref().unwrap()[0].ip, "10.88.0.3");
        assert_eq!(st.host_ip.as_deref(), Some("192.0.2.7"));
        assert_eq!(st.start_time.as_ref(), Some(&t));
        let cs = st.container_statuses.as_ref().unwrap();
        assert_eq!(cs.len(), 1, "exactly one container status");
        assert_eq!((cs[0].name.as_str(), cs[0].image.as_str()), ("agent", "ubuntu-dev-base"));
        assert!(cs[0].ready && cs[0].state.as_ref().unwrap().running.is_some());
        let ready = |st: &PodStatus| {
            st.conditions.as_ref().unwrap().iter().find(|c| c.type_ == "Ready").unwrap().status.clone()
        };
        assert_eq!(ready(&st), "True");
        let st = running(&pod(), &view(false, &t));
        assert_eq!(ready(&st), "False");
        let c = &st.container_statuses.as_ref().unwrap()[0];
        assert!(!c.ready && c.state.as_ref().unwrap().running.is_some(), "not ready, still running");
    }

    #[test]
    fn failed_shape_and_push() {
        let t = Time("2030-01-01T00:00:00Z".parse().unwrap());
        let end = Time("2030-01-01T01:00:00Z".parse().unwrap());
        let st = failed(&pod(), &view(true, &t), "VMGone", "the VM is gone", &end);
        assert_eq!((st.phase.as_deref(), st.reason.as_deref()), (Some("Failed"), Some("VMGone")));
        let term = st.container_statuses.as_ref().unwrap()[0].state.as_ref().unwrap().terminated.clone().unwrap();
        assert_eq!((term.exit_code, term.reason.as_deref()), (1, Some("VMGone")));
        assert_eq!(term.finished_at, Some(end));
        let p = pushed(&pod(), st, &BTreeMap::from([("k".to_string(), "v".to_string())]));
        assert_eq!(p.metadata.annotations.unwrap()["k"], "v");
        assert_eq!(pending(&Pod::default()).phase.as_deref(), Some("Pending"));
    }
}

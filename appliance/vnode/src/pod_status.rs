//! The Pod status shapes every provider pushes (`docs/virtual-node.md` §2.6, §3.5). No
//! kubelet reports anything on a virtual node, so a provider synthesizes the whole status from
//! what backs the Pod (a claim, a VM); these builders are the part that does not depend on what
//! that is. Pure functions.
//!
//! * [`running`]: phase `Running`, `PodScheduled`/`Initialized` True, `ContainersReady`/`Ready`
//!   True, or False with a reason while not ready, and every container `running` (a `waiting`
//!   container would let the runtime force-delete the Pod without calling DeletePod).
//! * [`failed`]: phase `Failed` with a reason and message, every container Terminated with exit
//!   code 1 at the end time.
//! * [`pending`]: phase `Pending`, the Pod's other status fields kept.
//! * [`with_addresses`] and [`pushed`]: the pod/host IPs, and the copy of the Pod a provider
//!   hands to [`crate::PodNotifier`] with its annotations added.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, HostIP, Pod, PodCondition, PodIP,
    PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// What a status reports about one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Container {
    pub name: String,
    pub image: String,
    /// `imageID`: what backs the Pod (`sandboxd://<claim>`, `cocoon://<vm>`).
    pub image_id: String,
    pub container_id: Option<String>,
}

impl Container {
    /// Every container of the Pod's spec, named and imaged as there, all with `image_id` and
    /// no `containerID`.
    pub fn every_spec_container(pod: &Pod, image_id: &str) -> Vec<Container> {
        spec_containers(pod)
            .iter()
            .map(|c| Container {
                name: c.name.clone(),
                image: c.image.clone().unwrap_or_default(),
                image_id: image_id.to_owned(),
                container_id: None,
            })
            .collect()
    }
}

fn spec_containers(pod: &Pod) -> &[k8s_openapi::api::core::v1::Container] {
    pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default()
}

/// The image of the spec container named `name`, else the first container's image; empty when
/// there is none.
pub fn image_of(pod: &Pod, name: &str) -> String {
    let containers = spec_containers(pod);
    containers
        .iter()
        .find(|c| c.name == name)
        .or_else(|| containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
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

/// The four conditions: scheduled and initialized at `started`, then `ContainersReady` and
/// `Ready` (`ready`, since `at`, for `reason`).
fn conditions(started: &Time, ready: bool, at: &Time, reason: Option<&str>) -> Option<Vec<PodCondition>> {
    Some(vec![
        condition("PodScheduled", true, started, None),
        condition("Initialized", true, started, None),
        condition("ContainersReady", ready, at, reason),
        condition("Ready", ready, at, reason),
    ])
}

fn statuses(
    containers: &[Container],
    ready: bool,
    started: bool,
    state: &ContainerState,
) -> Option<Vec<ContainerStatus>> {
    Some(
        containers
            .iter()
            .map(|c| ContainerStatus {
                name: c.name.clone(),
                image: c.image.clone(),
                image_id: c.image_id.clone(),
                container_id: c.container_id.clone(),
                ready,
                started: Some(started),
                restart_count: 0,
                state: Some(state.clone()),
                ..ContainerStatus::default()
            })
            .collect(),
    )
}

fn qos_class(pod: &Pod) -> Option<String> {
    pod.status.as_ref().and_then(|s| s.qos_class.clone())
}

/// `Running` since `started`: ready, or (`not_ready` = the reason) Running but not Ready, every
/// container in state `running` either way.
pub fn running(pod: &Pod, containers: &[Container], started: &Time, not_ready: Option<&str>) -> PodStatus {
    let ready = not_ready.is_none();
    let state = ContainerState {
        running: Some(ContainerStateRunning { started_at: Some(started.clone()) }),
        ..Default::default()
    };
    PodStatus {
        phase: Some("Running".into()),
        start_time: Some(started.clone()),
        conditions: conditions(started, ready, started, not_ready),
        container_statuses: statuses(containers, ready, true, &state),
        qos_class: qos_class(pod),
        ..PodStatus::default()
    }
}

/// `Failed` with `reason` and `message` at `ended`: every container Terminated, exit code 1.
pub fn failed(
    pod: &Pod,
    containers: &[Container],
    started: &Time,
    ended: &Time,
    reason: &str,
    message: &str,
) -> PodStatus {
    let state = ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: 1,
            reason: Some(reason.into()),
            message: Some(message.into()),
            started_at: Some(started.clone()),
            finished_at: Some(ended.clone()),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    };
    PodStatus {
        phase: Some("Failed".into()),
        reason: Some(reason.into()),
        message: Some(message.into()),
        start_time: Some(started.clone()),
        conditions: conditions(started, false, ended, Some(reason)),
        container_statuses: statuses(containers, false, false, &state),
        qos_class: qos_class(pod),
        ..PodStatus::default()
    }
}

/// `Pending` (the Pod's other status fields kept).
pub fn pending(pod: &Pod) -> PodStatus {
    let mut st = pod.status.clone().unwrap_or_default();
    st.phase = Some("Pending".into());
    st
}

/// `st` with `podIP(s)` = `pod_ip` and `hostIP(s)` = `host_ip`, each only when not empty.
pub fn with_addresses(mut st: PodStatus, pod_ip: &str, host_ip: &str) -> PodStatus {
    if !pod_ip.is_empty() {
        st.pod_ip = Some(pod_ip.to_owned());
        st.pod_ips = Some(vec![PodIP { ip: pod_ip.to_owned() }]);
    }
    if !host_ip.is_empty() {
        st.host_ip = Some(host_ip.to_owned());
        st.host_ips = Some(vec![HostIP { ip: host_ip.to_owned() }]);
    }
    st
}

/// The annotation a push carries to have annotations *removed* from the API Pod: their keys,
/// comma-separated. The runtime removes them and never writes this key itself (a pushed
/// annotation is otherwise added or changed, never removed: see [`crate::status::merged`]).
pub const REMOVE_ANNOTATIONS: &str = "vnode.chrysalis.dev/remove-annotations";

/// Marks `keys` on a pushed copy for removal from the API Pod (and drops them from the copy).
pub fn remove_annotations(pushed: &mut Pod, keys: &[&str]) {
    if keys.is_empty() {
        return;
    }
    let ann = pushed.metadata.annotations.get_or_insert_with(Default::default);
    for k in keys {
        ann.remove(*k);
    }
    ann.insert(REMOVE_ANNOTATIONS.to_owned(), keys.join(","));
}

/// A copy of `pod` with `status` and `annotations` added (existing ones kept unless
/// overwritten; no annotation map is created when there are none).
pub fn pushed<K, V>(pod: &Pod, status: PodStatus, annotations: impl IntoIterator<Item = (K, V)>) -> Pod
where
    K: Into<String>,
    V: Into<String>,
{
    let mut out = pod.clone();
    for (k, v) in annotations {
        out.metadata.annotations.get_or_insert_with(Default::default).insert(k.into(), v.into());
    }
    out.status = Some(status);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container as SpecContainer, PodSpec};
    use std::collections::BTreeMap;

    fn pod() -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![
                    SpecContainer { name: "side".into(), image: Some("busybox".into()), ..SpecContainer::default() },
                    SpecContainer { name: "agent".into(), image: Some("rt".into()), ..SpecContainer::default() },
                ],
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn t(s: &str) -> Time {
        Time(s.parse().unwrap())
    }

    fn cond<'a>(st: &'a PodStatus, type_: &str) -> &'a PodCondition {
        st.conditions.as_ref().unwrap().iter().find(|c| c.type_ == type_).unwrap()
    }

    #[test]
    fn containers_from_the_spec_and_the_named_image() {
        let cs = Container::every_spec_container(&pod(), "x://1");
        assert_eq!(cs.len(), 2);
        assert_eq!((cs[1].name.as_str(), cs[1].image.as_str(), cs[1].image_id.as_str()), ("agent", "rt", "x://1"));
        assert_eq!(image_of(&pod(), "agent"), "rt");
        assert_eq!(image_of(&pod(), "nope"), "busybox", "else the first container's");
        assert_eq!(image_of(&Pod::default(), "agent"), "");
    }

    #[test]
    fn running_ready_and_not_ready() {
        let at = t("2030-01-01T00:00:00Z");
        let cs = Container::every_spec_container(&pod(), "x://1");
        let st = running(&pod(), &cs, &at, None);
        assert_eq!((st.phase.as_deref(), st.start_time.as_ref()), (Some("Running"), Some(&at)));
        for c in ["PodScheduled", "Initialized", "ContainersReady", "Ready"] {
            assert_eq!((cond(&st, c).status.as_str(), cond(&st, c).reason.as_deref()), ("True", None), "{c}");
        }
        let s = st.container_statuses.as_ref().unwrap();
        assert!(s.iter().all(|c| c.ready && c.started == Some(true) && c.state.as_ref().unwrap().running.is_some()));
        let st = running(&pod(), &cs, &at, Some("NotYet"));
        assert_eq!(
            (cond(&st, "Ready").status.as_str(), cond(&st, "Ready").reason.as_deref()),
            ("False", Some("NotYet"))
        );
        assert_eq!(cond(&st, "Initialized").status, "True");
        let s = st.container_statuses.as_ref().unwrap();
        assert!(s.iter().all(|c| !c.ready && c.started == Some(true) && c.state.as_ref().unwrap().running.is_some()));
    }

    #[test]
    fn failed_terminates_every_container() {
        let (at, end) = (t("2030-01-01T00:00:00Z"), t("2030-01-01T01:00:00Z"));
        let cs = Container::every_spec_container(&pod(), "x://1");
        let st = failed(&pod(), &cs, &at, &end, "Gone", "it is gone");
        assert_eq!(
            (st.phase.as_deref(), st.reason.as_deref(), st.message.as_deref()),
            (Some("Failed"), Some("Gone"), Some("it is gone"))
        );
        assert_eq!(cond(&st, "Ready").last_transition_time.as_ref(), Some(&end));
        assert_eq!(cond(&st, "PodScheduled").last_transition_time.as_ref(), Some(&at));
        for c in st.container_statuses.as_ref().unwrap() {
            let term = c.state.as_ref().unwrap().terminated.clone().unwrap();
            assert_eq!(
                (term.exit_code, term.reason.as_deref(), term.finished_at),
                (1, Some("Gone"), Some(end.clone()))
            );
            assert!(!c.ready && c.started == Some(false));
        }
    }

    #[test]
    fn addresses_pending_and_push() {
        let st = with_addresses(PodStatus::default(), "10.0.0.2", "");
        assert_eq!((st.pod_ip.as_deref(), st.host_ip.as_deref()), (Some("10.0.0.2"), None));
        let st = with_addresses(st, "", "192.0.2.1");
        assert_eq!(st.host_ips.as_ref().unwrap()[0].ip, "192.0.2.1");
        assert_eq!(pending(&Pod::default()).phase.as_deref(), Some("Pending"));
        let p = pushed(&pod(), st.clone(), BTreeMap::from([("k", "v")]));
        assert_eq!(p.metadata.annotations.unwrap()["k"], "v");
        let p = pushed(&pod(), st, None::<(String, String)>);
        assert!(p.metadata.annotations.is_none() && p.status.is_some());
    }
}

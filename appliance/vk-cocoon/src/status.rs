//! Pod status shapes (`docs/virtual-node.md` §3.5): what the provider pushes for a Pod backed by a
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

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use vnode::pod_status::{self, Container};

pub use vnode::pod_status::pending;

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

/// The `agent` container, imaged as the spec container named `agent`, else the first one.
fn agent(pod: &Pod, v: &VmView<'_>) -> [Container; 1] {
    let id = format!("cocoon://{}", v.vm_id);
    [Container {
        name: CONTAINER.into(),
        image: pod_status::image_of(pod, CONTAINER),
        image_id: id.clone(),
        container_id: Some(id),
    }]
}

fn addresses(st: PodStatus, v: &VmView<'_>) -> PodStatus {
    pod_status::with_addresses(st, v.ip.unwrap_or_default(), v.node_ip)
}

/// `Running` with readiness `v.ready`.
pub fn running(pod: &Pod, v: &VmView<'_>) -> PodStatus {
    let not_ready = (!v.ready).then_some("VMNotReady");
    addresses(pod_status::running(pod, &agent(pod, v), v.started_at, not_ready), v)
}

/// `Failed` with `reason`: the VM is gone; `agent` Terminated, exit code 1, at `ended`.
pub fn failed(pod: &Pod, v: &VmView<'_>, reason: &str, message: &str, ended: &Time) -> PodStatus {
    addresses(pod_status::failed(pod, &agent(pod, v), v.started_at, ended, reason, message), v)
}

/// A copy of `pod` with `status` and the annotations vk-cocoon writes back added.
pub fn pushed(pod: &Pod, status: PodStatus, annotations: &BTreeMap<String, String>) -> Pod {
    pod_status::pushed(pod, status, annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn pod() -> Pod {
        let containers = [("side", "busybox"), ("agent", "ubuntu-dev-base")]
            .map(|(n, i)| serde_json::json!({"name": n, "image": i}));
        serde_json::from_value(serde_json::json!({"spec": {"containers": containers}})).unwrap()
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

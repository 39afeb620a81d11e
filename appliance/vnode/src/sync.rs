//! The sync rules of `docs/virtual-node.md` §1.2, as a pure decision on one Pod from the informer:
//!
//! 1. `deletionTimestamp` set and no container running → force-delete from the API, no
//!    provider call;
//! 2. `deletionTimestamp` otherwise → `provider.delete_pod`, then the API delete after
//!    `deletionGracePeriodSeconds`;
//! 3. phase `Failed`/`Succeeded` → skipped (Failed is terminal);
//! 4. unknown to the provider → `create_pod`, else `update_pod` (never "equal").
//!
//! Rule 5 (a failed create/update) is [`failure_phase`].

use k8s_openapi::api::core::v1::Pod;
use std::time::Duration;

/// What the sync worker does with a Pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Rule 1: delete from the API now (grace 0, UID precondition); the provider is not called.
    ForceDelete,
    /// Rule 2: `provider.delete_pod`, then delete from the API after `grace`.
    DeleteInProvider { grace: Duration },
    /// Rule 3: the pod finished; nothing to do.
    Skip,
    /// Rule 4: the provider does not know the pod.
    Create,
    /// Rule 4: the provider knows the pod.
    Update,
}

/// The rule that applies to `pod` (`provider_knows`: the provider tracks this key with this UID).
pub fn decide(pod: &Pod, provider_knows: bool) -> Action {
    if pod.metadata.deletion_timestamp.is_some() {
        if !running(pod) {
            return Action::ForceDelete;
        }
        let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(0).max(0);
        // `max(0)` above makes the cast lossless.
        return Action::DeleteInProvider { grace: Duration::from_secs(grace as u64) };
    }
    if is_finished(pod) {
        return Action::Skip;
    }
    if provider_knows {
        Action::Update
    } else {
        Action::Create
    }
}

/// virtual-kubelet's `running`: not finished, and some container neither Terminated nor Waiting.
pub fn running(pod: &Pod) -> bool {
    if is_finished(pod) {
        return false;
    }
    let Some(status) = &pod.status else { return false };
    // As in Go, where the state is a struct: an empty (or absent) state counts as running.
    status.container_statuses.iter().flatten().any(|cs| match &cs.state {
        Some(state) => state.terminated.is_none() && state.waiting.is_none(),
        None => true,
    })
}

/// Phase `Failed` or `Succeeded`: never synced to the provider nor updated again.
pub fn is_finished(pod: &Pod) -> bool {
    matches!(phase(pod), Some("Failed" | "Succeeded"))
}

pub fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

/// Rule 5: the phase a failed create/update leaves: `Failed` under `restartPolicy: Never`
/// (terminal), else `Pending` (retried).
pub fn failure_phase(pod: &Pod) -> &'static str {
    match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
        Some("Never") => "Failed",
        _ => "Pending",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus,
        PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(phase: Option<&str>, states: &[&str]) -> Pod {
        let container_statuses = states
            .iter()
            .map(|s| ContainerStatus {
                name: "c".into(),
                state: Some(match *s {
                    "running" => {
                        ContainerState { running: Some(ContainerStateRunning::default()), ..Default::default() }
                    }
                    "terminated" => {
                        ContainerState { terminated: Some(ContainerStateTerminated::default()), ..Default::default() }
                    }
                    "waiting" => {
                        ContainerState { waiting: Some(ContainerStateWaiting::default()), ..Default::default() }
                    }
                    _ => ContainerState::default(),
                }),
                ..Default::default()
            })
            .collect::<Vec<_>>();
        Pod {
            status: Some(PodStatus {
                phase: phase.map(Into::into),
                container_statuses: (!container_statuses.is_empty()).then_some(container_statuses),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn deleting(mut p: Pod, grace: i64) -> Pod {
        p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        p.metadata.deletion_grace_period_seconds = Some(grace);
        p
    }

    #[test]
    fn rule1_deleting_without_running_containers_is_force_deleted() {
        for states in [&[][..], &["terminated"], &["waiting"], &["terminated", "waiting"]] {
            for knows in [false, true] {
                assert_eq!(
                    decide(&deleting(pod(Some("Running"), states), 30), knows),
                    Action::ForceDelete,
                    "{states:?}"
                );
            }
        }
        // No status at all, and finished pods with a running container state.
        let mut bare = deleting(Pod::default(), 30);
        bare.status = None;
        assert_eq!(decide(&bare, true), Action::ForceDelete);
        assert_eq!(decide(&deleting(pod(Some("Failed"), &["running"]), 30), true), Action::ForceDelete);
        assert_eq!(decide(&deleting(pod(Some("Succeeded"), &["running"]), 30), true), Action::ForceDelete);
    }

    #[test]
    fn rule2_deleting_with_a_running_container_goes_through_the_provider() {
        let p = deleting(pod(Some("Running"), &["terminated", "running"]), 30);
        assert_eq!(decide(&p, true), Action::DeleteInProvider { grace: Duration::from_secs(30) });
        assert_eq!(decide(&p, false), Action::DeleteInProvider { grace: Duration::from_secs(30) });
        let p = deleting(pod(Some("Running"), &["running"]), -5);
        assert_eq!(decide(&p, true), Action::DeleteInProvider { grace: Duration::ZERO });
        // A container with an empty state is neither Terminated nor Waiting: running (as in Go).
        let p = deleting(pod(Some("Pending"), &["waiting", "empty"]), 1);
        assert_eq!(decide(&p, true), Action::DeleteInProvider { grace: Duration::from_secs(1) });
    }

    #[test]
    fn rule3_finished_pods_are_skipped() {
        assert_eq!(decide(&pod(Some("Failed"), &["running"]), true), Action::Skip);
        assert_eq!(decide(&pod(Some("Failed"), &[]), false), Action::Skip);
        assert_eq!(decide(&pod(Some("Succeeded"), &[]), false), Action::Skip);
    }

    #[test]
    fn rule4_create_when_unknown_else_update() {
        for phase in [None, Some("Pending"), Some("Running"), Some("Unknown")] {
            assert_eq!(decide(&pod(phase, &[]), false), Action::Create, "{phase:?}");
            assert_eq!(decide(&pod(phase, &["running"]), true), Action::Update, "{phase:?}");
        }
    }

    #[test]
    fn rule5_failure_phase_follows_the_restart_policy() {
        let mut p = pod(None, &[]);
        assert_eq!(failure_phase(&p), "Pending");
        for (policy, phase) in [("Always", "Pending"), ("OnFailure", "Pending"), ("Never", "Failed")] {
            p.spec = Some(PodSpec { restart_policy: Some(policy.into()), ..Default::default() });
            assert_eq!(failure_phase(&p), phase, "{policy}");
        }
    }
}

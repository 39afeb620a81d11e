//! The health gate: when a trial boot is committed, kept waiting, or reverted.
//!
//! A pure function of the time since boot, the deadline (`update.health_deadline_secs`), a
//! health snapshot and the offline policy (`update.offline`); the supervisor gathers the
//! snapshot and acts on the [`Decision`]. Rules:
//! - **healthy** = the supervisor is ready (all enabled services up), every warm pool is at
//!   its target, and — when virtual nodes are configured — the API server is reachable and
//!   every node is Ready with a fresh Lease → [`Decision::Commit`], at any time;
//! - not healthy before the deadline → [`Decision::Wait`];
//! - at the deadline, local health OK but the API server unreachable (connect errors, not
//!   NotReady) is "offline", not "bad image" (checklist #5): `commit-local` →
//!   [`Decision::CommitOffline`], `wait` → keep waiting (the trial stays uncommitted, so any
//!   reboot still falls back);
//! - anything else at the deadline → [`Decision::Revert`] with every failing check named.
//!
//! When the API server is unreachable the node fields are stale and ignored.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A configured virtual node, as the cluster reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeHealth {
    /// The node name.
    pub name: String,
    /// Its Ready condition is True.
    pub ready: bool,
    /// Its `kube-node-lease` Lease was renewed within its duration.
    pub lease_fresh: bool,
}

/// A warm pool of sandboxd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHealth {
    /// The pool (`base/small`).
    pub name: String,
    /// Warm VMs now.
    pub warm: u32,
    /// The target.
    pub target: u32,
}

/// What the supervisor saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthSnapshot {
    /// Every enabled service is up and ready.
    pub supervisor_ready: bool,
    /// Every configured virtual node (empty without a cluster).
    pub nodes: Vec<NodeHealth>,
    /// Every warm pool.
    pub pools: Vec<PoolHealth>,
    /// The API server answered (any HTTP answer counts; connect/TLS errors do not).
    pub api_reachable: bool,
}

/// What to do when the API server is unreachable at the deadline but the box is healthy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OfflinePolicy {
    /// Commit on local health alone.
    #[default]
    CommitLocal,
    /// Keep waiting for the API server.
    Wait,
}

/// The inputs of one decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateInput {
    /// Time since the kernel booted (CLOCK_BOOTTIME, not since the supervisor started).
    pub elapsed: Duration,
    /// `update.health_deadline_secs`.
    pub deadline: Duration,
    /// The health snapshot.
    pub health: HealthSnapshot,
    /// `update.offline`.
    pub offline: OfflinePolicy,
}

/// The gate's verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "kebab-case")]
pub enum Decision {
    /// Not yet decided: look again later.
    Wait,
    /// Healthy: commit the running slot.
    Commit,
    /// Healthy locally, API server unreachable at the deadline, policy `commit-local`.
    CommitOffline {
        /// What was unreachable.
        reason: String,
    },
    /// Unhealthy at the deadline: mark the trial bad and reboot.
    Revert {
        /// Every failing check.
        reason: String,
    },
}

/// Decides; see the module docs.
pub fn decide(input: &GateInput) -> Decision {
    let health = &input.health;
    let mut local = Vec::new();
    if !health.supervisor_ready {
        local.push("supervisor not ready".to_string());
    }
    for pool in health.pools.iter().filter(|p| p.warm < p.target) {
        local.push(format!("pool {} warm {}/{}", pool.name, pool.warm, pool.target));
    }
    let clustered = !health.nodes.is_empty();
    let offline = clustered && !health.api_reachable;
    let mut cluster = Vec::new();
    if offline {
        cluster.push("API server unreachable".to_string());
    } else {
        for node in &health.nodes {
            match (node.ready, node.lease_fresh) {
                (true, true) => {}
                (false, true) => cluster.push(format!("node {} not Ready", node.name)),
                (true, false) => cluster.push(format!("node {} lease stale", node.name)),
                (false, false) => cluster.push(format!("node {} not Ready, lease stale", node.name)),
            }
        }
    }
    if local.is_empty() && cluster.is_empty() {
        return Decision::Commit;
    }
    if input.elapsed < input.deadline {
        return Decision::Wait;
    }
    if local.is_empty() && offline {
        return match input.offline {
            OfflinePolicy::CommitLocal => Decision::CommitOffline {
                reason: format!("API server unreachable after {}s; local health OK", input.deadline.as_secs()),
            },
            OfflinePolicy::Wait => Decision::Wait,
        };
    }
    let mut reasons = local;
    reasons.extend(cluster);
    Decision::Revert { reason: format!("not healthy after {}s: {}", input.deadline.as_secs(), reasons.join("; ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(600);

    fn node(name: &str, ready: bool, lease_fresh: bool) -> NodeHealth {
        NodeHealth { name: name.into(), ready, lease_fresh }
    }

    fn pool(warm: u32, target: u32) -> PoolHealth {
        PoolHealth { name: "base/small".into(), warm, target }
    }

    fn healthy() -> HealthSnapshot {
        HealthSnapshot {
            supervisor_ready: true,
            nodes: vec![node("box-sandbox", true, true), node("box-cocoon", true, true)],
            pools: vec![pool(1, 1)],
            api_reachable: true,
        }
    }

    fn at(secs: u64, health: HealthSnapshot, offline: OfflinePolicy) -> Decision {
        decide(&GateInput { elapsed: Duration::from_secs(secs), deadline: DEADLINE, health, offline })
    }

    #[test]
    fn named_cases() {
        use OfflinePolicy::*;
        assert_eq!(at(5, healthy(), CommitLocal), Decision::Commit);
        assert_eq!(at(700, healthy(), Wait), Decision::Commit);
        // No cluster configured: local health alone, API reachability irrelevant.
        let alone = HealthSnapshot { nodes: vec![], api_reachable: false, ..healthy() };
        assert_eq!(at(5, alone, Wait), Decision::Commit);
        // A pool above target is fine; below is not.
        let over = HealthSnapshot { pools: vec![pool(3, 1)], ..healthy() };
        assert_eq!(at(5, over, CommitLocal), Decision::Commit);
        let under = HealthSnapshot { pools: vec![pool(0, 1)], ..healthy() };
        assert_eq!(at(599, under.clone(), CommitLocal), Decision::Wait);
        match at(600, under, CommitLocal) {
            Decision::Revert { reason } => assert!(reason.contains("pool base/small warm 0/1"), "{reason}"),
            other => panic!("expected Revert, got {other:?}"),
        }
        // The fault-injection bundle: the supervisor never becomes ready.
        let never = HealthSnapshot { supervisor_ready: false, ..healthy() };
        assert_eq!(at(10, never.clone(), CommitLocal), Decision::Wait);
        assert!(
            matches!(at(601, never, CommitLocal), Decision::Revert { reason } if reason.contains("supervisor not ready"))
        );
        // Offline at the deadline: the separate rule.
        let offline = HealthSnapshot { api_reachable: false, nodes: vec![node("n", false, false)], ..healthy() };
        assert_eq!(at(100, offline.clone(), CommitLocal), Decision::Wait);
        assert!(matches!(at(600, offline.clone(), CommitLocal), Decision::CommitOffline { .. }));
        assert_eq!(at(6000, offline, Wait), Decision::Wait);
        // Offline AND locally broken is a bad image.
        let both = HealthSnapshot { api_reachable: false, supervisor_ready: false, ..healthy() };
        match at(600, both, CommitLocal) {
            Decision::Revert { reason } => {
                assert!(
                    reason.contains("supervisor not ready") && reason.contains("API server unreachable"),
                    "{reason}"
                )
            }
            other => panic!("expected Revert, got {other:?}"),
        }
        // Reachable API server but a node NotReady / lease stale is not offline.
        let stale = HealthSnapshot { nodes: vec![node("a", true, false), node("b", false, true)], ..healthy() };
        match at(600, stale, CommitLocal) {
            Decision::Revert { reason } => {
                assert!(reason.contains("node a lease stale") && reason.contains("node b not Ready"), "{reason}")
            }
            other => panic!("expected Revert, got {other:?}"),
        }
        assert_eq!(
            serde_json::to_value(Decision::Revert { reason: "x".into() }).expect("json"),
            serde_json::json!({"decision": "revert", "reason": "x"})
        );
        assert_eq!(serde_json::to_value(OfflinePolicy::CommitLocal).expect("json"), "commit-local");
    }

    /// Every combination of inputs, checked against the rules stated in the module docs.
    #[test]
    fn exhaustive() {
        let node_sets: Vec<Vec<NodeHealth>> = vec![
            vec![],
            vec![node("a", true, true)],
            vec![node("a", false, true)],
            vec![node("a", true, false)],
            vec![node("a", false, false)],
            vec![node("a", true, true), node("b", false, true)],
        ];
        let pool_sets: Vec<Vec<PoolHealth>> =
            vec![vec![], vec![pool(1, 1)], vec![pool(0, 1)], vec![pool(2, 1), pool(0, 2)]];
        let mut count = 0;
        for supervisor_ready in [false, true] {
            for nodes in &node_sets {
                for pools in &pool_sets {
                    for api_reachable in [false, true] {
                        for secs in [0, 599, 600, 10_000] {
                            for offline in [OfflinePolicy::CommitLocal, OfflinePolicy::Wait] {
                                count += 1;
                                let health = HealthSnapshot {
                                    supervisor_ready,
                                    nodes: nodes.clone(),
                                    pools: pools.clone(),
                                    api_reachable,
                                };
                                let local_ok = supervisor_ready && pools.iter().all(|p| p.warm >= p.target);
                                let nodes_ok = nodes.iter().all(|n| n.ready && n.lease_fresh);
                                let is_offline = !nodes.is_empty() && !api_reachable;
                                let healthy = local_ok && (nodes.is_empty() || (api_reachable && nodes_ok));
                                let late = secs >= 600;
                                let got = at(secs, health, offline);
                                let want = if healthy {
                                    "commit"
                                } else if !late {
                                    "wait"
                                } else if local_ok && is_offline {
                                    match offline {
                                        OfflinePolicy::CommitLocal => "commit-offline",
                                        OfflinePolicy::Wait => "wait",
                                    }
                                } else {
                                    "revert"
                                };
                                let kind = match &got {
                                    Decision::Wait => "wait",
                                    Decision::Commit => "commit",
                                    Decision::CommitOffline { .. } => "commit-offline",
                                    Decision::Revert { reason } => {
                                        assert!(!reason.is_empty());
                                        if !supervisor_ready {
                                            assert!(reason.contains("supervisor not ready"), "{reason}");
                                        }
                                        "revert"
                                    }
                                };
                                assert_eq!(
                                    kind, want,
                                    "ready={supervisor_ready} nodes={nodes:?} pools={pools:?} api={api_reachable} t={secs} {offline:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(count, 2 * 6 * 4 * 2 * 4 * 2);
    }
}

//! The Node object and its status, built from a [`NodeConfig`] (pure functions).
//!
//! Status updates are a JSON **merge patch** of `nodes/status` (not virtual-kubelet's 3-way
//! strategic merge): the runtime owns every field it writes, so lists (`conditions`,
//! `addresses`) are replaced whole, and resources the Node lists (found at registration, or
//! written since) that are no longer wanted are removed with explicit `null`s: one dropped from
//! the configuration, or an extra resource the provider withdrew
//! ([`crate::NodeHandle::set_extra_resources`], merged into capacity and allocatable). The applied status
//! is still recorded in the annotation [`LAST_APPLIED_ANNOTATION`] for tools that look for it.

use crate::config::NodeConfig;
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus, NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Where the last applied node status is kept (virtual-kubelet's key).
pub const LAST_APPLIED_ANNOTATION: &str = "virtual-kubelet.io/last-applied-node-status";
/// Every virtual node carries `type=virtual-kubelet`.
pub const TYPE_LABEL: &str = "type";
pub const TYPE_VALUE: &str = "virtual-kubelet";
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// The Node's labels: the provider's, then `type=virtual-kubelet` and
/// `kubernetes.io/hostname=<name>` (these two win over a provider label of the same key).
pub fn labels(cfg: &NodeConfig) -> BTreeMap<String, String> {
    let mut labels = cfg.labels.clone();
    labels.insert(TYPE_LABEL.into(), TYPE_VALUE.into());
    labels.insert(HOSTNAME_LABEL.into(), cfg.name.clone());
    labels
}

/// Whether NodeRestriction refuses a node setting label `key` on its own Node: keys under
/// `kubernetes.io`/`k8s.io` (and their subdomains) except `kubernetes.io/{hostname,os,arch}`,
/// the instance-type and topology zone/region labels, and the `kubelet.kubernetes.io` /
/// `node.kubernetes.io` namespaces; `node-restriction.kubernetes.io` always.
pub fn label_refused_by_node_restriction(key: &str) -> bool {
    let Some((domain, _)) = key.split_once('/') else { return false };
    let under = |d: &str, ns: &str| d == ns || d.ends_with(&format!(".{ns}"));
    if under(domain, "node-restriction.kubernetes.io") {
        return true;
    }
    if !(under(domain, "kubernetes.io") || under(domain, "k8s.io")) {
        return false;
    }
    const ALLOWED: &[&str] = &[
        "kubernetes.io/hostname",
        "kubernetes.io/arch",
        "kubernetes.io/os",
        "beta.kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/instance-type",
        "node.kubernetes.io/instance-type",
        "failure-domain.beta.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/region",
        "topology.kubernetes.io/zone",
        "topology.kubernetes.io/region",
    ];
    if ALLOWED.contains(&key) {
        return false;
    }
    !(under(domain, "kubelet.kubernetes.io") || under(domain, "node.kubernetes.io"))
}

/// The `Ready` condition (times are stamped by [`Transitions`]).
pub fn ready_condition(ready: bool) -> NodeCondition {
    if ready {
        NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: Some("KubeletReady".into()),
            message: Some("Kubelet is ready".into()),
            ..Default::default()
        }
    } else {
        NodeCondition {
            type_: "Ready".into(),
            status: "False".into(),
            reason: Some("KubeletNotReady".into()),
            message: Some("the pod controller is starting".into()),
            ..Default::default()
        }
    }
}

/// Remembers when each condition type last changed status, to stamp `lastTransitionTime`;
/// every stamped condition gets `lastHeartbeatTime` = now.
#[derive(Debug, Default)]
pub struct Transitions {
    since: HashMap<String, (String, Time)>,
}

impl Transitions {
    pub fn stamp(&mut self, conditions: Vec<NodeCondition>, now: &Time) -> Vec<NodeCondition> {
        conditions
            .into_iter()
            .map(|mut c| {
                let entry = self.since.entry(c.type_.clone()).or_insert_with(|| {
                    (c.status.clone(), c.last_transition_time.clone().unwrap_or_else(|| now.clone()))
                });
                if entry.0 != c.status {
                    *entry = (c.status.clone(), now.clone());
                }
                c.last_transition_time = Some(entry.1.clone());
                c.last_heartbeat_time = Some(now.clone());
                c
            })
            .collect()
    }
}

/// `amd64`/`arm64` for the running architecture (Go's names), else Rust's.
pub fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The features the Node declares in `status.declaredFeatures`. `ExtendWebSocketsToKubelet`
/// tells the API server (1.37: `pkg/registry/core/pod/rest/subresources.go`) that this kubelet
/// speaks WebSocket itself, so it proxies kubectl's exec, attach and port-forward upgrades
/// unchanged instead of translating them to SPDY, which we do not serve.
pub const DECLARED_FEATURES: &[&str] = &["ExtendWebSocketsToKubelet"];

/// The Node's addresses: the node IP alone as `InternalIP` when known. The API server dials
/// the first address of its preferred types (`--kubelet-preferred-address-types`, `Hostname`
/// first by default), and the node name rarely resolves there, so no `Hostname` is listed
/// beside an IP; without an IP the name is all there is.
pub fn addresses(cfg: &NodeConfig) -> Vec<NodeAddress> {
    match cfg.internal_ip {
        Some(ip) => vec![NodeAddress { type_: "InternalIP".into(), address: ip.to_string() }],
        None => vec![NodeAddress { type_: "Hostname".into(), address: cfg.name.clone() }],
    }
}

/// capacity = allocatable: the provider's extra resources
/// ([`crate::NodeHandle::set_extra_resources`]) and the configured ones, which win on a shared
/// name.
pub fn resources(cfg: &NodeConfig, extra: &BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
    let mut out = extra.clone();
    out.extend(cfg.capacity.iter().map(|(k, v)| (k.clone(), v.clone())));
    out
}

/// The Node's status with the given (already stamped) conditions and the configured resources.
pub fn status(cfg: &NodeConfig, conditions: Vec<NodeCondition>) -> NodeStatus {
    status_with(cfg, conditions, &BTreeMap::new())
}

/// The Node's status with the given (already stamped) conditions and `extra` resources merged
/// into capacity and allocatable ([`resources`]).
pub fn status_with(cfg: &NodeConfig, conditions: Vec<NodeCondition>, extra: &BTreeMap<String, Quantity>) -> NodeStatus {
    let resources = resources(cfg, extra);
    NodeStatus {
        addresses: Some(addresses(cfg)),
        declared_features: Some(DECLARED_FEATURES.iter().map(|f| f.to_string()).collect()),
        capacity: Some(resources.clone()),
        allocatable: Some(resources),
        conditions: Some(conditions),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint { port: i32::from(cfg.kubelet_port) }),
        }),
        node_info: Some(NodeSystemInfo {
            architecture: go_arch().into(),
            operating_system: "linux".into(),
            kubelet_version: cfg.kubelet_version.clone(),
            ..Default::default()
        }),
        phase: Some("Running".into()),
        ..Default::default()
    }
}

/// The Node to create: labels, taints and providerID (fixed at registration) and `status`.
pub fn node(cfg: &NodeConfig, status: NodeStatus) -> Node {
    Node {
        metadata: ObjectMeta { name: Some(cfg.name.clone()), labels: Some(labels(cfg)), ..Default::default() },
        spec: Some(NodeSpec {
            taints: (!cfg.taints.is_empty()).then(|| cfg.taints.clone()),
            provider_id: cfg.provider_id.clone(),
            ..Default::default()
        }),
        status: Some(status),
    }
}

/// The resource names `node` lists in capacity or allocatable.
pub fn listed_resources(node: &Node) -> BTreeSet<String> {
    let Some(status) = &node.status else { return BTreeSet::new() };
    status.capacity.iter().chain(status.allocatable.iter()).flat_map(|m| m.keys()).cloned().collect()
}

/// Of the resources the Node may list (`listed`: what it had at registration and what this
/// runtime wrote since), those `status` no longer has: a resource dropped from the
/// configuration, or an extra resource the provider withdrew.
pub fn removed_resources(listed: &BTreeSet<String>, status: &NodeStatus) -> Vec<String> {
    let has = |k: &String| {
        status.capacity.as_ref().is_some_and(|m| m.contains_key(k))
            || status.allocatable.as_ref().is_some_and(|m| m.contains_key(k))
    };
    listed.iter().filter(|k| !has(k)).cloned().collect()
}

/// The merge patch of `nodes/status`: the whole status (with `null` for `removed` resources)
/// and the last-applied annotation.
pub fn status_patch(status: &NodeStatus, removed: &[String]) -> serde_json::Value {
    let applied = serde_json::to_string(status).unwrap_or_default();
    let mut body = serde_json::to_value(status).unwrap_or_else(|_| serde_json::json!({}));
    for field in ["capacity", "allocatable"] {
        if let Some(map) = body.get_mut(field).and_then(|v| v.as_object_mut()) {
            for key in removed {
                map.insert(key.clone(), serde_json::Value::Null);
            }
        }
    }
    serde_json::json!({
        "metadata": {"annotations": {LAST_APPLIED_ANNOTATION: applied}},
        "status": body,
    })
}

/// A merge patch of the Node's labels that adds or corrects the wanted ones (never removes).
pub fn labels_patch(existing: &Node, cfg: &NodeConfig) -> Option<serde_json::Value> {
    let have = existing.metadata.labels.clone().unwrap_or_default();
    let missing: BTreeMap<String, String> = labels(cfg).into_iter().filter(|(k, v)| have.get(k) != Some(v)).collect();
    (!missing.is_empty()).then(|| serde_json::json!({"metadata": {"labels": missing}}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Taint;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};

    fn cfg() -> NodeConfig {
        NodeConfig {
            name: "vk-test".into(),
            labels: BTreeMap::from([("sandbox.cocoonstack.io/runtime".into(), "sandboxd".into())]),
            taints: vec![Taint {
                key: "virtual-kubelet.io/provider".into(),
                value: Some("sandboxd".into()),
                effect: "NoSchedule".into(),
                ..Default::default()
            }],
            capacity: BTreeMap::from([
                ("cpu".into(), Quantity("4000".into())),
                ("memory".into(), Quantity("8Ti".into())),
                ("pods".into(), Quantity("2000".into())),
            ]),
            internal_ip: Some("10.0.0.7".parse().expect("ip")),
            kubelet_port: 10260,
            kubelet_version: "v1.2.3".into(),
            provider_id: Some("chrysalis://box-1".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_node_carries_identity_labels_taints_and_capacity() {
        let c = cfg();
        let n = node(&c, status(&c, vec![ready_condition(false)]));
        let labels = n.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels["type"], "virtual-kubelet");
        assert_eq!(labels["kubernetes.io/hostname"], "vk-test");
        assert_eq!(labels["sandbox.cocoonstack.io/runtime"], "sandboxd");
        assert!(!labels.contains_key("kubernetes.io/role"), "NodeRestriction refuses kubernetes.io/role");
        let spec = n.spec.as_ref().expect("spec");
        assert_eq!(spec.taints.as_ref().expect("taints")[0].key, "virtual-kubelet.io/provider");
        assert_eq!(spec.provider_id.as_deref(), Some("chrysalis://box-1"));
        let st = n.status.as_ref().expect("status");
        assert_eq!(st.capacity, st.allocatable);
        assert_eq!(st.capacity.as_ref().expect("capacity")["pods"], Quantity("2000".into()));
        let addrs: Vec<_> = st.addresses.iter().flatten().map(|a| (a.type_.as_str(), a.address.as_str())).collect();
        assert_eq!(addrs, [("InternalIP", "10.0.0.7")], "no Hostname the API server would dial first");
        assert_eq!(st.declared_features.as_deref(), Some(&["ExtendWebSocketsToKubelet".to_string()][..]));
        assert_eq!(st.daemon_endpoints.as_ref().and_then(|d| d.kubelet_endpoint.as_ref()).map(|e| e.port), Some(10260));
        assert_eq!(st.node_info.as_ref().map(|i| i.kubelet_version.as_str()), Some("v1.2.3"));
        assert_eq!(st.phase.as_deref(), Some("Running"));
    }

    #[test]
    fn without_an_ip_only_the_hostname_is_listed() {
        let mut c = cfg();
        c.internal_ip = None;
        let addrs = status(&c, vec![]).addresses.expect("addresses");
        assert_eq!(addrs, [NodeAddress { type_: "Hostname".into(), address: "vk-test".into() }]);
        c.internal_ip = Some("fd00::7".parse().expect("ip"));
        assert_eq!(addresses(&c), [NodeAddress { type_: "InternalIP".into(), address: "fd00::7".into() }]);
    }

    #[test]
    fn the_status_patch_declares_websockets_to_the_kubelet() {
        let c = cfg();
        let patch = status_patch(&status(&c, vec![]), &[]);
        assert_eq!(patch["status"]["declaredFeatures"], serde_json::json!(["ExtendWebSocketsToKubelet"]));
        assert_eq!(patch["status"]["addresses"], serde_json::json!([{"type": "InternalIP", "address": "10.0.0.7"}]));
    }

    #[test]
    fn ready_condition_texts() {
        let r = ready_condition(true);
        assert_eq!((r.type_.as_str(), r.status.as_str()), ("Ready", "True"));
        assert_eq!(r.reason.as_deref(), Some("KubeletReady"));
        assert_eq!(r.message.as_deref(), Some("Kubelet is ready"));
        assert_eq!(ready_condition(false).status, "False");
    }

    #[test]
    fn transitions_move_only_when_the_status_changes() {
        let t0 = Time(Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1000));
        let t1 = Time(Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1060));
        let t2 = Time(Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1120));
        let mut tr = Transitions::default();
        let a = tr.stamp(vec![ready_condition(false)], &t0);
        assert_eq!(a[0].last_transition_time, Some(t0.clone()));
        let b = tr.stamp(vec![ready_condition(false)], &t1);
        assert_eq!(b[0].last_transition_time, Some(t0.clone()), "no change, no transition");
        assert_eq!(b[0].last_heartbeat_time, Some(t1.clone()));
        let c = tr.stamp(vec![ready_condition(true)], &t2);
        assert_eq!(c[0].last_transition_time, Some(t2.clone()));
        assert_eq!(c[0].last_heartbeat_time, Some(t2));
    }

    #[test]
    fn node_restriction_label_rules() {
        for refused in [
            "kubernetes.io/role",
            "node-role.kubernetes.io/cocoon-vm",
            "foo.k8s.io/x",
            "k8s.io/x",
            "node-restriction.kubernetes.io/x",
        ] {
            assert!(label_refused_by_node_restriction(refused), "{refused}");
        }
        for allowed in [
            "kubernetes.io/hostname",
            "kubernetes.io/os",
            "topology.kubernetes.io/zone",
            "node.kubernetes.io/instance-type",
            "kubelet.kubernetes.io/anything",
            "foo.node.kubernetes.io/x",
            "type",
            "sandbox.cocoonstack.io/runtime",
            "cocoonstack.io/pool",
            "notkubernetes.io/x",
        ] {
            assert!(!label_refused_by_node_restriction(allowed), "{allowed}");
        }
    }

    #[test]
    fn status_patch_nulls_removed_resources_and_records_last_applied() {
        let c = cfg();
        let mut existing = node(&c, status(&c, vec![]));
        let st = existing.status.as_mut().expect("status");
        st.capacity.as_mut().expect("capacity").insert("nvidia.com/gpu".into(), Quantity("1".into()));
        let st = status(&c, vec![ready_condition(true)]);
        let removed = removed_resources(&listed_resources(&existing), &st);
        assert_eq!(removed, ["nvidia.com/gpu"]);
        let patch = status_patch(&st, &removed);
        assert!(patch["status"]["capacity"]["nvidia.com/gpu"].is_null());
        assert!(patch["status"]["allocatable"]["nvidia.com/gpu"].is_null());
        assert_eq!(patch["status"]["capacity"]["cpu"], "4000");
        let applied = patch["metadata"]["annotations"][LAST_APPLIED_ANNOTATION].as_str().expect("annotation");
        let back: NodeStatus = serde_json::from_str(applied).expect("the annotation is the status JSON");
        assert_eq!(back, st);
    }

    #[test]
    fn labels_patch_only_adds_what_is_missing() {
        let c = cfg();
        let mut existing = node(&c, status(&c, vec![]));
        assert_eq!(labels_patch(&existing, &c), None);
        existing.metadata.labels.as_mut().expect("labels").remove("type");
        existing.metadata.labels.as_mut().expect("labels").insert("other".into(), "kept".into());
        let p = labels_patch(&existing, &c).expect("patch");
        assert_eq!(p, serde_json::json!({"metadata": {"labels": {"type": "virtual-kubelet"}}}));
    }

    #[test]
    fn extra_resources_join_capacity_and_allocatable_and_the_configured_ones_win() {
        let c = cfg();
        let extra = BTreeMap::from([
            ("sandbox.cocoonstack.io/warm-base-none-small".to_string(), Quantity("3".into())),
            ("pods".to_string(), Quantity("1".into())),
        ]);
        let st = status_with(&c, vec![], &extra);
        for m in [st.capacity.as_ref().expect("capacity"), st.allocatable.as_ref().expect("allocatable")] {
            assert_eq!(m["sandbox.cocoonstack.io/warm-base-none-small"], Quantity("3".into()));
            assert_eq!(m["pods"], Quantity("2000".into()), "the configured capacity wins");
            assert_eq!(m["cpu"], Quantity("4000".into()));
        }
        let patch = status_patch(&st, &[]);
        assert_eq!(patch["status"]["capacity"]["sandbox.cocoonstack.io/warm-base-none-small"], "3");
        assert_eq!(patch["status"]["allocatable"]["sandbox.cocoonstack.io/warm-base-none-small"], "3");
        assert_eq!(status_with(&c, vec![], &BTreeMap::new()), status(&c, vec![]));
    }

    #[test]
    fn a_withdrawn_extra_resource_is_nulled_and_a_kept_one_is_not() {
        let c = cfg();
        let small = "sandbox.cocoonstack.io/warm-base-none-small".to_string();
        let medium = "sandbox.cocoonstack.io/warm-base-none-medium".to_string();
        let both = BTreeMap::from([(small.clone(), Quantity("2".into())), (medium.clone(), Quantity("0".into()))]);
        let written = node(&c, status_with(&c, vec![], &both));
        let listed = listed_resources(&written);
        assert!(listed.contains(&small) && listed.contains(&medium) && listed.contains("cpu"));
        // The medium pool is gone from sandboxd: the provider sets only the small one.
        let st = status_with(&c, vec![], &BTreeMap::from([(small.clone(), Quantity("1".into()))]));
        let removed = removed_resources(&listed, &st);
        assert_eq!(removed, std::slice::from_ref(&medium));
        let patch = status_patch(&st, &removed);
        assert!(patch["status"]["capacity"][&medium].is_null());
        assert!(patch["status"]["allocatable"][&medium].is_null());
        assert_eq!(patch["status"]["capacity"][&small], "1");
        // Every extra withdrawn: both go, the configured ones stay.
        let st = status(&c, vec![]);
        assert_eq!(removed_resources(&listed, &st), [medium, small]);
        assert!(removed_resources(&listed_resources(&node(&c, st.clone())), &st).is_empty());
    }

    #[test]
    fn the_handle_patches_only_when_the_extra_resources_change() {
        let h = crate::NodeHandle::default();
        assert!(h.extra_resources().is_empty());
        let m = BTreeMap::from([("example.com/foo".to_string(), Quantity("1".into()))]);
        assert!(h.set_extra_resources(m.clone()));
        assert!(!h.set_extra_resources(m.clone()), "the same map again is no change");
        assert_eq!(h.extra_resources(), m);
        assert!(h.set_extra_resources(BTreeMap::new()));
    }
}

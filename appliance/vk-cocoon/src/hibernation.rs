//! `CocoonHibernation` objects (group `cocoonset.cocoonstack.io`, version `v1`, the CRD
//! cocoon-common defines and `manifests/cocoonhibernation-crd.yaml` ships): a user asks for a
//! Pod's VM to hibernate (`spec.desire: Hibernate`) or wake (`Wake`) by naming the Pod in
//! `spec.podRef.name`, and reads the progress in `status.phase`.
//!
//! Upstream, cocoon-operator acts on these objects by patching the Pod's
//! `vm.cocoonstack.io/hibernate` annotation, which vk-cocoon then serves. Here each node acts on
//! the objects naming the Pods it tracks, directly: the desire overrides the annotation while the
//! object exists ([`crate::provider::CocoonProvider::apply_hibernations`]), so the node needs no
//! right to change Pods, only to read these objects and write their status
//! (`manifests/rbac.yaml`, bound per node by `node-rbac.yaml.in`).
//!
//! Every `interval` (2 s) one listing of every namespace's objects; the status of each object
//! naming a tracked Pod is written when it changed: `phase` (`Hibernating` → `Hibernated`,
//! `Waking` → `Active`, `Failed` when the lifecycle is `failed`), `observedGeneration` and
//! `vmName`. A cluster without the CRD, or a node not granted the objects, is logged once
//! and checked again every minute; the annotation keeps working meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};

use crate::provider::{CocoonProvider, HibernationView, Lifecycle};

/// `cocoonset.cocoonstack.io/v1`, `CocoonHibernation`.
pub fn resource() -> ApiResource {
    ApiResource {
        group: "cocoonset.cocoonstack.io".into(),
        version: "v1".into(),
        api_version: "cocoonset.cocoonstack.io/v1".into(),
        kind: "CocoonHibernation".into(),
        plural: "cocoonhibernations".into(),
    }
}

/// How long to wait before looking again for a CRD that is missing or not granted.
const ABSENT_RETRY: Duration = Duration::from_secs(60);

/// One object's request: the Pod key it names, whether it asks to sleep, its generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub namespace: String,
    pub name: String,
    pub pod_key: String,
    pub hibernate: bool,
    pub generation: i64,
}

/// The request of `obj`, or why it has none (no namespace, no `podRef.name`, another desire).
pub fn request_of(obj: &DynamicObject) -> Result<Request, String> {
    let namespace = obj.metadata.namespace.clone().ok_or("no namespace")?;
    let name = obj.metadata.name.clone().unwrap_or_default();
    let pod = obj.data["spec"]["podRef"]["name"].as_str().filter(|p| !p.is_empty()).ok_or("no spec.podRef.name")?;
    let hibernate = match obj.data["spec"]["desire"].as_str() {
        Some("Hibernate") => true,
        Some("Wake") => false,
        other => return Err(format!("spec.desire {other:?} is neither Hibernate nor Wake")),
    };
    Ok(Request {
        pod_key: format!("{namespace}/{pod}"),
        namespace,
        name,
        hibernate,
        generation: obj.metadata.generation.unwrap_or_default(),
    })
}

/// The status an object asking `hibernate` shows for its Pod's `view`.
pub fn status_for(hibernate: bool, generation: i64, view: &HibernationView) -> Value {
    let phase = match (hibernate, view) {
        (_, v) if v.lifecycle == Lifecycle::Failed && !v.busy => "Failed",
        (true, v) if v.hibernated && !v.busy => "Hibernated",
        (true, _) => "Hibernating",
        (false, v) if !v.hibernated && !v.busy && v.lifecycle == Lifecycle::Ready => "Active",
        (false, _) => "Waking",
    };
    json!({"phase": phase, "observedGeneration": generation, "vmName": view.vm_name})
}

/// Runs the loop until the task is dropped (see the module docs).
pub async fn run(client: kube::Client, provider: Arc<CocoonProvider>, interval: Duration) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
    let mut absent_logged = false;
    let mut written: BTreeMap<(String, String), Value> = BTreeMap::new();
    loop {
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                absent_logged = false;
                pass(&client, &provider, &list.items, &mut written).await;
            }
            Err(e) => {
                let status = match &e {
                    kube::Error::Api(s) => Some(s.code),
                    _ => None,
                };
                if matches!(status, Some(403 | 404)) {
                    if !absent_logged {
                        tracing::info!(
                            error = %vnode::error_chain(&e),
                            "CocoonHibernation objects are not served here (CRD not installed, or this node not granted \
                             them: apply manifests/cocoonhibernation-crd.yaml and rbac.yaml); the hibernate annotation \
                             still works"
                        );
                        absent_logged = true;
                    }
                    provider.apply_hibernations(&BTreeMap::new());
                    tokio::time::sleep(ABSENT_RETRY).await;
                    continue;
                }
                tracing::warn!(error = %vnode::error_chain(&e), "listing CocoonHibernation objects failed; retrying");
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// One pass over the listed objects: desires applied, changed statuses written.
async fn pass(
    client: &kube::Client,
    provider: &CocoonProvider,
    objects: &[DynamicObject],
    written: &mut BTreeMap<(String, String), Value>,
) {
    let mut requests = Vec::new();
    for obj in objects {
        match request_of(obj) {
            Ok(r) => requests.push(r),
            Err(why) => tracing::debug!(object = ?obj.metadata.name, why, "CocoonHibernation ignored"),
        }
    }
    // Two objects naming one Pod: the one listed last wins (the list is sorted by name).
    let mut desires = BTreeMap::new();
    for r in &requests {
        desires.insert(r.pod_key.clone(), r.hibernate);
    }
    let views = provider.apply_hibernations(&desires);
    written.retain(|(ns, name), _| requests.iter().any(|r| &r.namespace == ns && &r.name == name));
    for r in requests {
        let Some(view) = views.get(&r.pod_key) else { continue };
        let status = status_for(r.hibernate, r.generation, view);
        let id = (r.namespace.clone(), r.name.clone());
        if written.get(&id) == Some(&status) {
            continue;
        }
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &r.namespace, &resource());
        let patch = json!({"status": status});
        match api.patch_status(&r.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                tracing::info!(object = %r.name, pod = %r.pod_key, phase = %status["phase"], "CocoonHibernation status");
                written.insert(id, status);
            }
            Err(e) => {
                tracing::warn!(object = %r.name, error = %vnode::error_chain(&e), "writing a CocoonHibernation status failed")
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn obj(spec: Value) -> DynamicObject {
        let mut o = DynamicObject::new("h", &resource()).within("ns");
        o.data = json!({ "spec": spec });
        o.metadata.generation = Some(3);
        o
    }

    #[test]
    fn requests_name_a_pod_and_a_desire() {
        let r = request_of(&obj(json!({"podRef": {"name": "p"}, "desire": "Hibernate"}))).unwrap();
        assert_eq!((r.pod_key.as_str(), r.hibernate, r.generation), ("ns/p", true, 3));
        assert!(!request_of(&obj(json!({"podRef": {"name": "p"}, "desire": "Wake"}))).unwrap().hibernate);
        assert!(request_of(&obj(json!({"podRef": {"name": "p"}, "desire": "Nap"}))).is_err());
        assert!(request_of(&obj(json!({"desire": "Wake"}))).is_err());
    }

    #[test]
    fn phases_follow_the_pod() {
        let v = |hibernated, busy, lifecycle| HibernationView { vm_name: "vm".into(), hibernated, busy, lifecycle };
        let phase = |h, view: HibernationView| status_for(h, 1, &view)["phase"].as_str().unwrap().to_owned();
        assert_eq!(phase(true, v(false, false, Lifecycle::Ready)), "Hibernating");
        assert_eq!(phase(true, v(false, true, Lifecycle::Hibernating)), "Hibernating");
        assert_eq!(phase(true, v(true, false, Lifecycle::Hibernated)), "Hibernated");
        assert_eq!(phase(false, v(true, false, Lifecycle::Hibernated)), "Waking");
        assert_eq!(phase(false, v(false, true, Lifecycle::Creating)), "Waking");
        assert_eq!(phase(false, v(false, false, Lifecycle::Ready)), "Active");
        assert_eq!(phase(true, v(false, false, Lifecycle::Failed)), "Failed");
        let s = status_for(true, 7, &v(true, false, Lifecycle::Hibernated));
        assert_eq!((s["observedGeneration"].as_i64(), s["vmName"].as_str()), (Some(7), Some("vm")));
    }
}

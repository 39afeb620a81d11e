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
//! Every `interval` (2 s) one listing of every namespace's objects, [`PAGE`] (500) a page and
//! at most [`MAX_OBJECTS`] (10 000; past it a warning, and the listing is applied as incomplete:
//! desires it no longer shows are kept); the status of each object naming a tracked Pod is
//! written when it changed: `phase` (`Hibernating` → `Hibernated`, `Waking` → `Active`,
//! `Failed` when the lifecycle is `failed`), `observedGeneration` and `vmName`.
//!
//! **Only a successful listing changes desires.** A failed one (any error, 403 and 404
//! included) keeps the last known desires, so a VM hibernated through an object is never woken
//! because the objects could not be read. After a provider restart no desire is known: a Pod
//! whose lifecycle annotation says `hibernated` is held asleep until the first successful
//! listing (a CRD that is absent, a 404 before any listing succeeded, counts as one with no
//! objects; then the annotation rules). A cluster without the CRD, or a node not granted the
//! objects, is logged once and checked again every minute; the annotation keeps working
//! meanwhile (a node never granted them keeps such held Pods asleep, and says so).

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
/// Objects asked for per page of the listing.
pub const PAGE: u32 = 500;
/// The most objects one pass reads; past it the listing is cut short (a warning) and applied
/// as incomplete ([`CocoonProvider::apply_incomplete_hibernations`]).
pub const MAX_OBJECTS: usize = 10_000;

/// Why an object carries no request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("no namespace")]
    NoNamespace,
    #[error("no spec.podRef.name")]
    NoPodRef,
    #[error("spec.desire {0:?} is neither Hibernate nor Wake")]
    BadDesire(Option<String>),
}

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
pub fn request_of(obj: &DynamicObject) -> Result<Request, RequestError> {
    let namespace = obj.metadata.namespace.clone().ok_or(RequestError::NoNamespace)?;
    let name = obj.metadata.name.clone().unwrap_or_default();
    let pod = obj.data["spec"]["podRef"]["name"].as_str().filter(|p| !p.is_empty()).ok_or(RequestError::NoPodRef)?;
    let hibernate = match obj.data["spec"]["desire"].as_str() {
        Some("Hibernate") => true,
        Some("Wake") => false,
        other => return Err(RequestError::BadDesire(other.map(str::to_owned))),
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

/// Every object, `page` at a time, at most `cap` of them; `true` beside them when the listing
/// is complete.
async fn list_all(api: &Api<DynamicObject>, page: u32, cap: usize) -> Result<(Vec<DynamicObject>, bool), kube::Error> {
    let mut items = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut lp = ListParams::default().limit(page);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let list = api.list(&lp).await?;
        items.extend(list.items);
        token = list.metadata.continue_.filter(|t| !t.is_empty());
        if items.len() >= cap && (token.is_some() || items.len() > cap) {
            tracing::warn!(
                cap,
                "more CocoonHibernation objects than one pass reads; those past the cap are not acted on, and \
                 desires of objects no longer seen are kept"
            );
            items.truncate(cap);
            return Ok((items, false));
        }
        if token.is_none() {
            return Ok((items, true));
        }
    }
}

/// The loop's state between passes.
#[derive(Default)]
struct LoopState {
    absent_logged: bool,
    written: BTreeMap<(String, String), Value>,
}

/// One listing and its pass; the wait before the next.
async fn step(
    client: &kube::Client,
    provider: &CocoonProvider,
    api: &Api<DynamicObject>,
    st: &mut LoopState,
    interval: Duration,
    cap: usize,
) -> Duration {
    let e = match list_all(api, PAGE, cap).await {
        Ok((items, complete)) => {
            st.absent_logged = false;
            pass(client, provider, &items, complete, &mut st.written).await;
            return interval;
        }
        Err(e) => e,
    };
    // A failed listing changes no desire: what objects asked for stays asked (nothing is
    // woken on a guess). Only a CRD absent before any listing succeeded counts as a first
    // pass with no objects, so that the annotation rules.
    let status = match &e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    };
    if status == Some(404) && !provider.hibernation_desires_known() {
        provider.apply_hibernations(&BTreeMap::new());
    }
    if !matches!(status, Some(403 | 404)) {
        tracing::warn!(error = %vnode::error_chain(&e), "listing CocoonHibernation objects failed; desires kept, retrying");
        return interval;
    }
    if !st.absent_logged {
        tracing::info!(
            error = %vnode::error_chain(&e),
            "CocoonHibernation objects are not served here (CRD not installed, or this node not granted them: apply \
             manifests/cocoonhibernation-crd.yaml and rbac.yaml); the hibernate annotation still works, and the \
             desires of objects listed before are kept"
        );
        if status == Some(403) && !provider.hibernation_desires_known() {
            tracing::warn!(
                "until a CocoonHibernation listing succeeds, pods whose lifecycle says hibernated stay asleep"
            );
        }
        st.absent_logged = true;
    }
    ABSENT_RETRY
}

/// Runs the loop until the task is dropped (see the module docs).
pub async fn run(client: kube::Client, provider: Arc<CocoonProvider>, interval: Duration) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
    let mut st = LoopState::default();
    loop {
        let wait = step(&client, &provider, &api, &mut st, interval, MAX_OBJECTS).await;
        tokio::time::sleep(wait).await;
    }
}

/// One pass over the listed objects: desires applied, changed statuses written.
async fn pass(
    client: &kube::Client,
    provider: &CocoonProvider,
    objects: &[DynamicObject],
    complete: bool,
    written: &mut BTreeMap<(String, String), Value>,
) {
    let mut requests = Vec::new();
    for obj in objects {
        match request_of(obj) {
            Ok(r) => requests.push(r),
            Err(why) => tracing::debug!(object = ?obj.metadata.name, %why, "CocoonHibernation ignored"),
        }
    }
    // Two objects naming one Pod: the one listed last wins (the list is sorted by name).
    let mut desires = BTreeMap::new();
    for r in &requests {
        desires.insert(r.pod_key.clone(), r.hibernate);
    }
    let views =
        if complete { provider.apply_hibernations(&desires) } else { provider.apply_incomplete_hibernations(&desires) };
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
        let nap = request_of(&obj(json!({"podRef": {"name": "p"}, "desire": "Nap"}))).unwrap_err();
        assert_eq!(nap, RequestError::BadDesire(Some("Nap".into())));
        assert_eq!(request_of(&obj(json!({"desire": "Wake"}))).unwrap_err(), RequestError::NoPodRef);
        let mut no_ns = obj(json!({"podRef": {"name": "p"}, "desire": "Wake"}));
        no_ns.metadata.namespace = None;
        assert_eq!(request_of(&no_ns).unwrap_err(), RequestError::NoNamespace);
    }

    // ---- the loop against a fake API server

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use k8s_openapi::api::core::v1::Pod;
    use vnode::Provider as _;

    use crate::annotations::{IMAGE, MANAGED, MODE, VM_NAME};
    use crate::provider::ProviderConfig;
    use crate::test_utils::FakeBackend;

    fn item(name: &str, pod: &str, desire: &str) -> Value {
        json!({
            "apiVersion": "cocoonset.cocoonstack.io/v1", "kind": "CocoonHibernation",
            "metadata": {"name": name, "namespace": "ns", "generation": 1},
            "spec": {"podRef": {"name": pod}, "desire": desire}
        })
    }

    fn page(items: Vec<Value>, next: &str) -> (u16, Value) {
        let list = json!({
            "apiVersion": "cocoonset.cocoonstack.io/v1", "kind": "CocoonHibernationList",
            "metadata": {"continue": next}, "items": items
        });
        (200, list)
    }

    fn refused(code: u16) -> (u16, Value) {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "no", "reason": if code == 403 { "Forbidden" } else { "NotFound" }, "code": code
        });
        (code, status)
    }

    /// A provider over a fake backend tracking the running Pod `ns/a` (VM `vm-a`).
    async fn provider_with_a() -> (Arc<FakeBackend>, CocoonProvider) {
        let backend = Arc::new(FakeBackend::new());
        let provider = CocoonProvider::new(backend.clone(), ProviderConfig::new("192.0.2.7"));
        let mut pod = Pod::default();
        pod.metadata.name = Some("a".into());
        pod.metadata.namespace = Some("ns".into());
        pod.metadata.uid = Some("uid-a".into());
        let pairs = [(VM_NAME, "vm-a"), (MANAGED, "true"), (MODE, "run"), (IMAGE, "ubuntu-dev-base")];
        pod.metadata.annotations = Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        provider.create_pod(&pod).await.unwrap();
        (backend, provider)
    }

    /// A client whose listings answer `lists[n]` for the n-th (the last one after), and whose
    /// status writes succeed.
    fn api_answering(lists: Vec<(u16, Value)>) -> (kube::Client, vnode::testing::Calls) {
        let calls = vnode::testing::Calls::default();
        let n = AtomicUsize::new(0);
        let lists = Mutex::new(lists);
        let client = vnode::testing::fake_api(calls.clone(), move |method, _path, _| {
            if method != "GET" {
                return (200, item("h", "a", "Hibernate"));
            }
            let i = n.fetch_add(1, Ordering::SeqCst);
            let lists = lists.lock().unwrap();
            lists[i.min(lists.len() - 1)].clone()
        });
        (client, calls)
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_that_fails_even_with_403_or_404_wakes_nothing() {
        let (backend, provider) = provider_with_a().await;
        let (client, _) =
            api_answering(vec![page(vec![item("h", "a", "Hibernate")], ""), refused(403), refused(404), refused(500)]);
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
        let mut st = LoopState::default();
        step(&client, &provider, &api, &mut st, Duration::from_secs(2), MAX_OBJECTS).await;
        settle().await;
        assert!(backend.vms().is_empty(), "hibernated through the object");
        for code in [403, 404, 500] {
            let wait = step(&client, &provider, &api, &mut st, Duration::from_secs(2), MAX_OBJECTS).await;
            settle().await;
            assert!(backend.vms().is_empty(), "a listing answering {code} wakes nothing");
            assert_eq!(wait, if code == 500 { Duration::from_secs(2) } else { ABSENT_RETRY });
        }
        assert!(provider.hibernation_desires_known());
    }

    #[tokio::test(start_paused = true)]
    async fn only_an_absent_crd_counts_as_a_first_listing() {
        for (code, known) in [(403, false), (500, false), (404, true)] {
            let (_backend, provider) = provider_with_a().await;
            let (client, _) = api_answering(vec![refused(code)]);
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
            step(&client, &provider, &api, &mut LoopState::default(), Duration::from_secs(2), MAX_OBJECTS).await;
            assert_eq!(provider.hibernation_desires_known(), known, "{code}");
        }
    }

    #[tokio::test]
    async fn the_listing_pages_and_is_capped() {
        let two = || vec![item("h1", "a", "Wake"), item("h2", "b", "Wake")];
        let (client, calls) = api_answering(vec![page(two(), "t1"), page(two(), "t2"), page(two(), "")]);
        let api: Api<DynamicObject> = Api::all_with(client, &resource());
        let (items, complete) = list_all(&api, PAGE, MAX_OBJECTS).await.unwrap();
        assert_eq!((items.len(), complete), (6, true));
        let queries: Vec<String> = calls.lock().unwrap().iter().map(|c| c.1.clone()).collect();
        assert!(queries.iter().all(|q| q.contains("limit=500")), "{queries:?}");
        assert!(queries[1].contains("continue=t1") && queries[2].contains("continue=t2"), "{queries:?}");

        let (client, _) = api_answering(vec![page(two(), "t1"), page(two(), "t2"), page(two(), "")]);
        let api: Api<DynamicObject> = Api::all_with(client, &resource());
        let (items, complete) = list_all(&api, 2, 3).await.unwrap();
        assert_eq!((items.len(), complete), (3, false), "cut short at the cap");
        let (client, _) = api_answering(vec![page(two(), "t1"), page(two(), "")]);
        let api: Api<DynamicObject> = Api::all_with(client, &resource());
        assert!(list_all(&api, 2, 4).await.unwrap().1, "exactly the cap is complete");
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

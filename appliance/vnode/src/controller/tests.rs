//! The handlers against a fake API server (recording every request) and an in-memory
//! provider; the informer store is filled by hand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Controller;
use crate::events::Recorder;
use crate::provider::{PodKey, PodNotifier, Provider, ProviderError};
use crate::status;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::reflector;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::Event;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::testing::{path_of, Calls};

/// Answers a request: (method, path, how many requests came before) → HTTP status.
type Answer = Arc<dyn Fn(&str, &str, usize) -> u16 + Send + Sync>;

fn fake_api(calls: Calls, answer: Answer) -> kube::Client {
    crate::testing::fake_api(calls, move |method, path, n| {
        let code = answer(method, path, n);
        let json = if code >= 400 {
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                "reason": if code == 409 { "Conflict" } else { "NotFound" }, "message": "fake"})
        } else if path.contains("/events") {
            serde_json::json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e"},
                "involvedObject": {}})
        } else {
            serde_json::json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "99"}})
        };
        (code, json)
    })
}

#[derive(Default)]
struct FakeProvider {
    pods: Mutex<HashMap<PodKey, Pod>>,
    calls: Mutex<Vec<String>>,
    fail: bool,
}

impl FakeProvider {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn log(&self, what: &str, pod: &Pod) {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).push(format!(
            "{what} {} {}",
            PodKey::of(pod),
            pod.metadata.uid.as_deref().unwrap_or_default()
        ));
    }
}

#[async_trait::async_trait]
impl Provider for FakeProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.log("create", pod);
        if self.fail {
            return Err(ProviderError::new(std::io::Error::other("no capacity")));
        }
        self.pods.lock().unwrap_or_else(|p| p.into_inner()).insert(PodKey::of(pod), pod.clone());
        Ok(())
    }
    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.log("update", pod);
        Ok(())
    }
    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.log("delete", pod);
        self.pods.lock().unwrap_or_else(|p| p.into_inner()).remove(&PodKey::of(pod));
        Ok(())
    }
    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }
    fn get_pods(&self) -> Vec<Pod> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }
    fn notify_pods(&self, _: PodNotifier) {}
}

fn pod(uid: &str) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some("p".into());
    p.metadata.namespace = Some("ns".into());
    p.metadata.uid = Some(uid.into());
    p.metadata.resource_version = Some("5".into());
    p.spec = Some(PodSpec::default());
    p
}

fn running(mut p: Pod) -> Pod {
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        container_statuses: Some(vec![ContainerStatus {
            name: "c".into(),
            state: Some(ContainerState { running: Some(ContainerStateRunning::default()), ..Default::default() }),
            ..Default::default()
        }]),
        ..Default::default()
    });
    p
}

fn deleting(mut p: Pod, grace: i64) -> Pod {
    p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
    p.metadata.deletion_grace_period_seconds = Some(grace);
    p
}

struct Fixture {
    c: Arc<Controller>,
    provider: Arc<FakeProvider>,
    writer: Writer<Pod>,
    calls: Calls,
}

impl Fixture {
    fn new(provider: FakeProvider, answer: Answer) -> Fixture {
        let calls: Calls = Arc::default();
        let client = fake_api(calls.clone(), answer);
        let (store, writer) = reflector::store();
        let provider = Arc::new(provider);
        let recorder = Recorder::new(client.clone(), "vk".into(), false);
        let c =
            Arc::new(Controller::new("vk".into(), client, provider.clone(), store, recorder, None, Default::default()));
        Fixture { c, provider, writer, calls }
    }
    fn ok() -> Answer {
        Arc::new(|_: &str, _: &str, _: usize| 200)
    }
    fn apply(&mut self, p: Pod) {
        self.writer.apply_watcher_event(&Event::Apply(p));
    }
    fn remove(&mut self, p: Pod) {
        self.writer.apply_watcher_event(&Event::Delete(p));
    }
    /// API requests other than events (event writes are asynchronous).
    /// The non-event calls, paths without their query.
    fn api(&self) -> Vec<(String, String, Value)> {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls
            .iter()
            .filter(|(_, path, _)| !path.contains("/events"))
            .map(|(m, p, b)| (m.clone(), path_of(p).to_owned(), b.clone()))
            .collect()
    }
    async fn events(&self) -> Vec<Value> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls.iter().filter(|(_, path, _)| path.contains("/events")).map(|(_, _, b)| b.clone()).collect()
    }
}

fn key() -> PodKey {
    PodKey::new("ns", "p")
}

#[tokio::test]
async fn an_unknown_pod_is_created_then_updated() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    f.apply(pod("u1"));
    f.c.sync(&key()).await.expect("sync");
    f.c.sync(&key()).await.expect("sync");
    assert_eq!(f.provider.calls(), ["create ns/p u1", "update ns/p u1"]);
    assert!(f.api().is_empty(), "a successful create writes nothing but events: {:?}", f.api());
    let reasons: Vec<_> = f.events().await.iter().map(|e| e["reason"].clone()).collect();
    assert_eq!(reasons, ["ProviderCreateSuccess"], "an unchanged pod's update records no event");
}

#[tokio::test]
async fn rule1_force_delete_without_a_provider_call() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    f.apply(deleting(pod("u1"), 30));
    f.c.sync(&key()).await.expect("sync");
    assert!(f.provider.calls().is_empty());
    f.c.force_delete(&key()).await.expect("force delete");
    let api = f.api();
    assert_eq!(api.len(), 1, "{api:?}");
    let (method, path, body) = &api[0];
    assert_eq!((method.as_str(), path.as_str()), ("DELETE", "/api/v1/namespaces/ns/pods/p"));
    assert_eq!(body["gracePeriodSeconds"], 0);
    assert_eq!(body["preconditions"]["uid"], "u1");
    // Done: a second run has nothing left to delete.
    f.c.force_delete(&key()).await.expect("again");
    assert_eq!(f.api().len(), 1);
}

#[tokio::test]
async fn rule2_provider_delete_once_then_api_delete_after_the_grace() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    f.apply(running(pod("u1")));
    f.c.sync(&key()).await.expect("create");
    f.apply(deleting(running(pod("u1")), 7));
    f.c.sync(&key()).await.expect("delete");
    f.c.sync(&key()).await.expect("resync");
    assert_eq!(f.provider.calls(), ["create ns/p u1", "delete ns/p u1"], "the provider delete is not repeated");
    assert_eq!(f.c.delete_q.len(), 1);
    let reasons: Vec<_> = f.events().await.iter().map(|e| e["reason"].clone()).collect();
    assert!(reasons.contains(&Value::from("ProviderDeleteSuccess")), "{reasons:?}");
}

#[tokio::test]
async fn rule5_failures_set_pending_and_retry_or_failed_for_good() {
    let mut f = Fixture::new(FakeProvider { fail: true, ..Default::default() }, Fixture::ok());
    f.apply(pod("u1"));
    let e = f.c.sync(&key()).await.expect_err("pending is retried");
    assert!(e.to_string().contains("no capacity"), "{e}");
    let (method, path, body) = f.api()[0].clone();
    assert_eq!((method.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/p/status"));
    assert_eq!(body["status"]["phase"], "Pending");
    assert_eq!(body["status"]["reason"], "ProviderFailed");
    assert_eq!(body["status"]["message"], "no capacity");
    assert_eq!(body["metadata"]["uid"], "u1");

    let mut never = pod("u1");
    never.spec = Some(PodSpec { restart_policy: Some("Never".into()), ..Default::default() });
    f.apply(never);
    f.c.sync(&key()).await.expect("Failed is terminal: no retry");
    assert_eq!(f.api()[1].2["status"]["phase"], "Failed");
    let warnings: Vec<_> = f.events().await.into_iter().filter(|e| e["type"] == "Warning").collect();
    assert!(!warnings.is_empty() && warnings.iter().all(|e| e["reason"] == "ProviderCreateFailed"), "{warnings:?}");
    let text = f.c.metrics.render().expect("metrics");
    assert!(text.contains("vnode_pod_create_duration_seconds_count{outcome=\"error\"} 2\n"), "{text}");
}

#[tokio::test]
async fn a_pod_gone_from_the_api_is_deleted_in_the_provider() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    f.apply(pod("u1"));
    f.c.sync(&key()).await.expect("create");
    f.remove(pod("u1"));
    f.c.sync(&key()).await.expect("gone");
    assert_eq!(f.provider.calls(), ["create ns/p u1", "delete ns/p u1"]);
    f.c.sync(&key()).await.expect("nothing left");
    assert_eq!(f.provider.calls().len(), 2);
}

#[tokio::test]
async fn a_recreated_pod_replaces_the_providers_earlier_one() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    f.apply(pod("u1"));
    f.c.sync(&key()).await.expect("create");
    f.apply(pod("u2"));
    f.c.sync(&key()).await.expect("replace");
    assert_eq!(f.provider.calls(), ["create ns/p u1", "delete ns/p u1", "create ns/p u2"]);
}

#[tokio::test]
async fn startup_deletes_provider_pods_the_api_lacks() {
    let mut f = Fixture::new(FakeProvider::default(), Fixture::ok());
    let mut ghost = pod("g");
    ghost.metadata.name = Some("ghost".into());
    let stale = pod("old");
    for p in [ghost, stale] {
        f.provider.pods.lock().unwrap_or_else(|p| p.into_inner()).insert(PodKey::of(&p), p);
    }
    f.apply(pod("new"));
    f.c.reconcile_startup().await;
    let mut calls = f.provider.calls();
    calls.sort();
    assert_eq!(calls, ["delete ns/ghost g", "delete ns/p old"]);
    assert_eq!(f.c.sync_q.len(), 1, "the API pod is queued");
}

#[tokio::test]
async fn a_push_puts_the_status_with_the_api_resource_version_and_retries_a_conflict() {
    // First PUT conflicts, the re-read (GET) and second PUT succeed.
    let answer: Answer = Arc::new(|m: &str, _: &str, n: usize| if m == "PUT" && n == 0 { 409 } else { 200 });
    let mut f = Fixture::new(FakeProvider::default(), answer);
    f.apply(pod("u1"));
    let mut pushed = running(pod("u1"));
    pushed.metadata.resource_version = Some("1".into());
    pushed.metadata.annotations = Some([("claim".to_string(), "c-1".to_string())].into());
    let (notifier, rx) = PodNotifier::channel();
    let cancel = CancellationToken::new();
    let dispatcher =
        tokio::spawn(status::dispatch(rx, f.c.store.clone(), f.c.pushes.clone(), f.c.status_q.clone(), cancel.clone()));
    notifier.notify(pushed);
    let k = tokio::time::timeout(Duration::from_secs(2), f.c.status_q.get()).await.expect("queued").expect("key");
    f.c.push_status(&k).await.expect("status");
    let api = f.api();
    let shape: Vec<_> = api.iter().map(|(m, p, _)| (m.as_str(), p.as_str())).collect();
    assert_eq!(
        shape,
        [
            ("PUT", "/api/v1/namespaces/ns/pods/p/status"),
            ("GET", "/api/v1/namespaces/ns/pods/p"),
            ("PUT", "/api/v1/namespaces/ns/pods/p/status")
        ]
    );
    assert_eq!(api[0].2["metadata"]["resourceVersion"], "5", "the informer's resourceVersion");
    assert_eq!(api[0].2["status"]["phase"], "Running");
    assert_eq!(api[0].2["metadata"]["annotations"]["claim"], "c-1");
    assert_eq!(api[2].2["metadata"]["resourceVersion"], "99", "the re-read resourceVersion");
    cancel.cancel();
    dispatcher.await.expect("dispatcher");
}

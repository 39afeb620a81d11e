//! The pod controller: an informer on the Pods bound to this node (`spec.nodeName=<node>`, all
//! namespaces), three [`WorkQueue`]s (sync-from-k8s, delete-from-k8s, status-from-provider),
//! `workers` workers per queue, the start-up reconcile and the periodic resync.
//!
//! - **sync**: [`crate::sync::decide`] on the informer's copy, then the provider call, events
//!   and, on a create/update error, the `ProviderFailed` status (rule 5). A key the informer no
//!   longer has (the Pod left the API) is deleted in the provider if it still tracks it. A
//!   provider copy with another UID than the API pod (deleted and re-created under the same
//!   name) is deleted in the provider first, so the new pod is *created*.
//! - **delete**: the force-delete (grace 0, UID precondition; NotFound/Conflict = done).
//! - **status**: [`crate::status`].
//!
//! Start-up: wait for the informer's first complete list, delete in the provider every pod
//! whose key or UID the API does not have, enqueue every pod, start the workers; the caller
//! then marks the Node Ready. After every later re-list (watch reconnect) and every `resync`
//! all API pods and all provider pods are enqueued again, so a deletion missed while the watch
//! was down still reaches the provider.

use crate::error::{is_conflict, is_not_found};
use crate::events::{self, Recorder};
use crate::provider::{PodKey, Provider, ProviderError};
use crate::queue::{Retry, WorkQueue};
use crate::status::{self, lookup, PushAction, Pushes};
use crate::sync::{decide, failure_phase, Action};
use foundation::error_chain as chain;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

/// Why a queue item failed (it is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SyncError {
    #[error("provider {op} failed: {}", chain(source))]
    Provider {
        op: &'static str,
        #[source]
        source: ProviderError,
    },
    #[error("{what}: {source}")]
    Api {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

fn api_err(what: &'static str) -> impl FnOnce(kube::Error) -> SyncError {
    move |source| SyncError::Api { what, source }
}

fn uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref()
}

/// Both UIDs known and different.
fn other_uid(a: &Pod, b: &Pod) -> bool {
    matches!((uid(a), uid(b)), (Some(x), Some(y)) if x != y)
}

pub(crate) struct Controller {
    node: String,
    client: kube::Client,
    provider: Arc<dyn Provider>,
    store: Store<Pod>,
    recorder: Recorder,
    pub(crate) sync_q: Arc<WorkQueue<PodKey>>,
    pub(crate) delete_q: Arc<WorkQueue<PodKey>>,
    pub(crate) status_q: Arc<WorkQueue<PodKey>>,
    pub(crate) pushes: Arc<Pushes>,
    /// Keys waiting for the force-delete, with the UID it must match.
    pending_deletes: Mutex<HashMap<PodKey, String>>,
    /// UIDs already deleted in the provider (rule 2 is not repeated on every resync).
    provider_deleted: Mutex<HashSet<String>>,
    /// Per key, a hash of what the provider last accepted (UID, spec, labels, annotations):
    /// `update_pod` runs on every sync, but `ProviderUpdateSuccess` is recorded only when
    /// this changed, so a resync does not write one event per pod.
    accepted: Mutex<HashMap<PodKey, u64>>,
}

/// What a `ProviderUpdateSuccess` event is about: the pod's identity, spec and metadata.
fn accepted_hash(pod: &Pod) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pod.metadata.uid.hash(&mut h);
    serde_json::to_string(&pod.spec).unwrap_or_default().hash(&mut h);
    pod.metadata.labels.hash(&mut h);
    pod.metadata.annotations.hash(&mut h);
    h.finish()
}

impl Controller {
    pub(crate) fn new(
        node: String,
        client: kube::Client,
        provider: Arc<dyn Provider>,
        store: Store<Pod>,
        recorder: Recorder,
        bucket: Option<crate::queue::BucketSpec>,
    ) -> Controller {
        Controller {
            node,
            client,
            provider,
            store,
            recorder,
            sync_q: Arc::new(WorkQueue::new("syncPodsFromKubernetes", bucket)),
            delete_q: Arc::new(WorkQueue::new("deletePodsFromKubernetes", bucket)),
            status_q: Arc::new(WorkQueue::new("syncPodStatusFromProvider", bucket)),
            pushes: Arc::new(Pushes::default()),
            pending_deletes: Mutex::new(HashMap::new()),
            provider_deleted: Mutex::new(HashSet::new()),
            accepted: Mutex::new(HashMap::new()),
        }
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// Runs the informer until `cancel`; `first_sync` fires after the first complete list.
    pub(crate) async fn informer(
        self: Arc<Self>,
        writer: reflector::store::Writer<Pod>,
        first_sync: oneshot::Sender<()>,
        cancel: CancellationToken,
    ) {
        let api: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        let stream = reflector::reflector(writer, watcher::watcher(api, config).default_backoff());
        let mut stream = std::pin::pin!(stream);
        let mut first_sync = Some(first_sync);
        let mut failing = false;
        loop {
            let item = tokio::select! {
                _ = cancel.cancelled() => return,
                item = stream.next() => item,
            };
            let Some(item) = item else {
                warn!(node = %self.node, "the pod watch ended");
                return;
            };
            match item {
                Ok(event) => {
                    if failing {
                        info!(node = %self.node, "the pod watch works again");
                        failing = false;
                    }
                    match event {
                        Event::Apply(pod) => self.sync_q.add(PodKey::of(&pod)),
                        Event::Delete(pod) => self.on_deleted(&pod),
                        Event::Init | Event::InitApply(_) => {}
                        Event::InitDone => match first_sync.take() {
                            Some(tx) => {
                                let _ = tx.send(());
                            }
                            None => self.enqueue_all(),
                        },
                    }
                }
                Err(e) if !failing => {
                    warn!(node = %self.node, error = %e, "the pod watch failed; retrying with backoff");
                    failing = true;
                }
                Err(e) => debug!(node = %self.node, error = %e, "the pod watch still fails"),
            }
        }
    }

    /// The Pod left the API: forget its bookkeeping and let the sync worker delete it in the
    /// provider.
    fn on_deleted(&self, pod: &Pod) {
        let key = PodKey::of(pod);
        debug!(pod = %key, "the pod was deleted from the API");
        self.pushes.forget(&key, uid(pod));
        self.accepted.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        if let Some(u) = uid(pod) {
            self.provider_deleted.lock().unwrap_or_else(|p| p.into_inner()).remove(u);
            let mut pending = self.pending_deletes.lock().unwrap_or_else(|p| p.into_inner());
            if pending.get(&key).map(String::as_str) == Some(u) {
                pending.remove(&key);
            }
        }
        self.sync_q.add(key);
    }

    /// Every API pod and every provider pod on the sync queue.
    pub(crate) fn enqueue_all(&self) {
        for pod in self.store.state() {
            self.sync_q.add(PodKey::of(&pod));
        }
        for pod in self.provider.get_pods() {
            self.sync_q.add(PodKey::of(&pod));
        }
    }

    /// Start-up reconcile (after the first complete list): provider pods whose key or UID the
    /// API does not have are deleted in the provider; then everything is enqueued.
    pub(crate) async fn reconcile_startup(&self) {
        for pp in self.provider.get_pods() {
            let key = PodKey::of(&pp);
            let dangling = match lookup(&self.store, &key) {
                None => true,
                Some(api) => other_uid(&api, &pp),
            };
            if !dangling {
                continue;
            }
            let span = info_span!("startup", node = %self.node, pod = %key);
            async {
                info!("the provider tracks a pod the API does not have; deleting it in the provider");
                if let Err(e) = self.provider.delete_pod(&pp).await {
                    // The sync worker retries it for a key the API lacks.
                    warn!(error = %chain(&e), "deleting a dangling pod in the provider failed");
                }
            }
            .instrument(span)
            .await;
        }
        self.enqueue_all();
    }

    /// Re-enqueues everything every `period` until `cancel`.
    pub(crate) async fn resync_loop(self: Arc<Self>, period: Duration, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(period) => self.enqueue_all(),
            }
        }
    }

    /// Starts `workers` workers on each queue.
    pub(crate) fn spawn_workers(self: &Arc<Self>, workers: usize, set: &mut JoinSet<()>) {
        for _ in 0..workers.max(1) {
            let c = self.clone();
            set.spawn(work(self.sync_q.clone(), self.node.clone(), move |k| {
                let c = c.clone();
                async move { c.sync(&k).await }
            }));
            let c = self.clone();
            set.spawn(work(self.delete_q.clone(), self.node.clone(), move |k| {
                let c = c.clone();
                async move { c.force_delete(&k).await }
            }));
            let c = self.clone();
            set.spawn(work(self.status_q.clone(), self.node.clone(), move |k| {
                let c = c.clone();
                async move { c.push_status(&k).await }
            }));
        }
    }

    pub(crate) fn shutdown_queues(&self) {
        self.sync_q.shutdown();
        self.delete_q.shutdown();
        self.status_q.shutdown();
    }

    /// The sync-from-k8s handler (rules 1–5).
    pub(crate) async fn sync(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(pod) = lookup(&self.store, key) else {
            if let Some(pp) = self.provider.get_pod(key) {
                info!("the pod is gone from the API; deleting it in the provider");
                self.provider.delete_pod(&pp).await.map_err(|source| SyncError::Provider { op: "delete", source })?;
            }
            return Ok(());
        };
        let pod: Pod = (*pod).clone();
        let mut known = self.provider.get_pod(key);
        if let Some(pp) = known.as_ref().filter(|pp| other_uid(pp, &pod)) {
            info!("the provider tracks an earlier pod with this name; deleting that one first");
            self.provider.delete_pod(pp).await.map_err(|source| SyncError::Provider { op: "delete", source })?;
            known = None;
        }
        match decide(&pod, known.is_some()) {
            Action::ForceDelete => {
                debug!("deleting: no container runs; force-deleting from the API");
                self.schedule_force_delete(key, &pod, Duration::ZERO);
                Ok(())
            }
            Action::DeleteInProvider { grace } => {
                let u = uid(&pod).unwrap_or_default().to_string();
                let done = self.provider_deleted.lock().unwrap_or_else(|p| p.into_inner()).contains(&u);
                if !done {
                    match self.provider.delete_pod(&pod).await {
                        Ok(()) => {
                            info!("deleted the pod in the provider");
                            self.recorder.normal(&pod, events::DELETE_SUCCESS, "Delete pod in provider successfully");
                            self.provider_deleted.lock().unwrap_or_else(|p| p.into_inner()).insert(u);
                        }
                        Err(e) => {
                            self.recorder.warning(&pod, events::DELETE_FAILED, &chain(&e));
                            return Err(SyncError::Provider { op: "delete", source: e });
                        }
                    }
                }
                self.schedule_force_delete(key, &pod, grace);
                Ok(())
            }
            Action::Skip => Ok(()),
            Action::Create => match self.provider.create_pod(&pod).await {
                Ok(()) => {
                    info!("created the pod in the provider");
                    self.accepted.lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), accepted_hash(&pod));
                    self.recorder.normal(&pod, events::CREATE_SUCCESS, "Create pod in provider successfully");
                    Ok(())
                }
                Err(e) => self.provider_failed(&pod, "create", e).await,
            },
            Action::Update => match self.provider.update_pod(&pod).await {
                Ok(()) => {
                    debug!("updated the pod in the provider");
                    let hash = accepted_hash(&pod);
                    let before = self.accepted.lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), hash);
                    if before != Some(hash) {
                        self.recorder.normal(&pod, events::UPDATE_SUCCESS, "Update pod in provider successfully");
                    }
                    Ok(())
                }
                Err(e) => self.provider_failed(&pod, "update", e).await,
            },
        }
    }

    fn schedule_force_delete(&self, key: &PodKey, pod: &Pod, after: Duration) {
        let Some(u) = uid(pod) else { return };
        self.pending_deletes.lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), u.to_string());
        self.delete_q.add_after(key.clone(), after);
    }

    /// Rule 5: `ProviderFailed` status (Pending, or Failed under `restartPolicy: Never`) and a
    /// Warning event; Pending is retried with backoff, Failed is terminal.
    async fn provider_failed(&self, pod: &Pod, op: &'static str, e: ProviderError) -> Result<(), SyncError> {
        let message = chain(&e);
        let phase = failure_phase(pod);
        warn!(error = %message, phase, "provider {op} failed");
        let reason = if op == "create" { events::CREATE_FAILED } else { events::UPDATE_FAILED };
        self.recorder.warning(pod, reason, &message);
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        // metadata.uid in the patch makes it fail on a re-created pod of the same name.
        let patch = serde_json::json!({
            "metadata": {"uid": uid(pod)},
            "status": {"phase": phase, "reason": "ProviderFailed", "message": message},
        });
        match self.pods(&namespace).patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) if phase == "Failed" => {
                info!("restartPolicy Never: the pod is Failed for good");
                return Ok(());
            }
            Ok(_) => {}
            Err(err) if is_not_found(&err) => return Ok(()),
            Err(err) => warn!(error = %err, "could not set the ProviderFailed status"),
        }
        Err(SyncError::Provider { op, source: e })
    }

    /// The delete-from-k8s handler: grace 0, UID precondition.
    pub(crate) async fn force_delete(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(want) = self.pending_deletes.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned() else {
            return Ok(());
        };
        let forget = || {
            let mut pending = self.pending_deletes.lock().unwrap_or_else(|p| p.into_inner());
            if pending.get(key) == Some(&want) {
                pending.remove(key);
            }
        };
        match lookup(&self.store, key) {
            Some(pod) if uid(&pod) == Some(want.as_str()) => {}
            _ => {
                forget();
                return Ok(());
            }
        }
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: Some(want.clone()), resource_version: None }),
            ..DeleteParams::default()
        };
        match self.pods(&key.namespace).delete(&key.name, &params).await {
            Ok(_) => {
                info!("deleted the pod from the API");
                forget();
                Ok(())
            }
            Err(e) if is_not_found(&e) || is_conflict(&e) => {
                forget();
                Ok(())
            }
            Err(e) => Err(SyncError::Api { what: "deleting the pod from the API", source: e }),
        }
    }

    /// The status-from-provider handler.
    pub(crate) async fn push_status(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(pushed) = self.pushes.get(key) else { return Ok(()) };
        let api_pod = lookup(&self.store, key);
        let action = status::plan(api_pod.as_deref(), &pushed, k8s_openapi::jiff::Timestamp::now());
        let pods = self.pods(&key.namespace);
        match action {
            PushAction::Ignore(why) => {
                debug!(why, "status push not written");
                Ok(())
            }
            PushAction::DeleteApiPod { uid, grace } => {
                info!("the provider marked the pod deleted; deleting it from the API");
                let params = DeleteParams {
                    grace_period_seconds: grace,
                    preconditions: Some(Preconditions { uid, resource_version: None }),
                    ..DeleteParams::default()
                };
                match pods.delete(&key.name, &params).await {
                    Err(e) if !(is_not_found(&e) || is_conflict(&e)) => {
                        Err(SyncError::Api { what: "deleting the pod the provider marked deleted", source: e })
                    }
                    _ => Ok(()),
                }
            }
            PushAction::UpdateStatus(obj) => {
                match pods.replace_status(&key.name, &PostParams::default(), &obj).await {
                    Ok(_) => {
                        debug!("updated the pod status");
                        return Ok(());
                    }
                    Err(e) if is_not_found(&e) => return Ok(()),
                    Err(e) if is_conflict(&e) => debug!("status update conflicted; re-reading the pod"),
                    Err(e) => return Err(api_err("updating the pod status")(e)),
                }
                let fresh = pods.get_opt(&key.name).await.map_err(api_err("re-reading the pod"))?;
                match status::plan(fresh.as_ref(), &pushed, k8s_openapi::jiff::Timestamp::now()) {
                    PushAction::UpdateStatus(obj) => {
                        match pods.replace_status(&key.name, &PostParams::default(), &obj).await {
                            Err(e) if !is_not_found(&e) => Err(api_err("updating the pod status")(e)),
                            _ => Ok(()),
                        }
                    }
                    // Anything else: the next informer event or push decides.
                    _ => Ok(()),
                }
            }
        }
    }
}

/// One worker: take a key, run `handle` in a span with the pod key, forget or retry it.
async fn work<F, Fut>(queue: Arc<WorkQueue<PodKey>>, node: String, handle: F)
where
    F: Fn(PodKey) -> Fut,
    Fut: Future<Output = Result<(), SyncError>>,
{
    while let Some(key) = queue.get().await {
        let span = info_span!("pod", queue = queue.name(), node = %node, pod = %key);
        let result = handle(key.clone()).instrument(span.clone()).await;
        let _enter = span.enter();
        match result {
            Ok(()) => queue.forget(&key),
            Err(e) => match queue.retry(&key) {
                Retry::After(delay) => warn!(error = %e, retry_in = ?delay, "failed; retrying"),
                Retry::Dropped { failures } => {
                    error!(error = %e, failures, "failed too often; dropping the key until its next event or resync")
                }
            },
        }
        queue.done(&key);
    }
}

#[cfg(test)]
mod tests {
    //! The handlers against a fake API server (recording every request) and an in-memory
    //! provider; the informer store is filled by hand.
    use super::*;
    use crate::provider::PodNotifier;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::client::Body;
    use kube::runtime::reflector::store::Writer;
    use serde_json::Value;

    /// (method, path, JSON body)
    type Calls = Arc<Mutex<Vec<(String, String, Value)>>>;
    /// Answers a request: (method, path, how many requests came before) → HTTP status.
    type Answer = Arc<dyn Fn(&str, &str, usize) -> u16 + Send + Sync>;

    fn fake_api(calls: Calls, answer: Answer) -> kube::Client {
        let svc = tower::service_fn(move |req: http::Request<Body>| {
            let (calls, answer) = (calls.clone(), answer.clone());
            async move {
                let method = req.method().to_string();
                let path = req.uri().path().to_string();
                let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let n = {
                    let mut c = calls.lock().unwrap_or_else(|p| p.into_inner());
                    c.push((method.clone(), path.clone(), body));
                    c.len() - 1
                };
                let code = answer(&method, &path, n);
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
                let resp = http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&json).unwrap_or_default()))
                    .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) })?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(resp)
            }
        });
        kube::Client::new(svc, "default")
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
            let c = Arc::new(Controller::new("vk".into(), client, provider.clone(), store, recorder, None));
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
        fn api(&self) -> Vec<(String, String, Value)> {
            let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            calls.iter().filter(|(_, path, _)| !path.contains("/events")).cloned().collect()
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
        let dispatcher = tokio::spawn(status::dispatch(
            rx,
            f.c.store.clone(),
            f.c.pushes.clone(),
            f.c.status_q.clone(),
            cancel.clone(),
        ));
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
}

//! The informer: the watch on the Pods bound to this node, what a deletion in the API does to
//! the bookkeeping, the start-up reconcile and the periodic resync.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use super::state::{other_uid, uid, Controller};
use crate::provider::PodKey;
use crate::status::lookup;
use foundation::error_chain as chain;

impl Controller {
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
        self.accepted.lock().remove(&key);
        if let Some(u) = uid(pod) {
            self.provider_deleted.lock().remove(u);
            let mut pending = self.pending_deletes.lock();
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
}

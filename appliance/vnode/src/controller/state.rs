//! The [`Controller`]: the informer's store, the provider, the three queues and the
//! bookkeeping the handlers share; [`SyncError`], why a queue item failed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use foundation::error_chain as chain;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use kube::Api;

use crate::events::Recorder;
use crate::kit::Locked;
use crate::provider::{PodKey, Provider, ProviderError};
use crate::queue::WorkQueue;
use crate::stats::RuntimeMetrics;
use crate::status::Pushes;

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

pub(super) fn api_err(what: &'static str) -> impl FnOnce(kube::Error) -> SyncError {
    move |source| SyncError::Api { what, source }
}

pub(super) fn uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref()
}

/// Both UIDs known and different.
pub(super) fn other_uid(a: &Pod, b: &Pod) -> bool {
    matches!((uid(a), uid(b)), (Some(x), Some(y)) if x != y)
}

pub(crate) struct Controller {
    pub(super) node: String,
    pub(super) client: kube::Client,
    pub(super) provider: Arc<dyn Provider>,
    pub(super) store: Store<Pod>,
    pub(super) recorder: Recorder,
    pub(crate) sync_q: Arc<WorkQueue<PodKey>>,
    pub(crate) delete_q: Arc<WorkQueue<PodKey>>,
    pub(crate) status_q: Arc<WorkQueue<PodKey>>,
    pub(crate) pushes: Arc<Pushes>,
    /// Keys waiting for the force-delete, with the UID it must match.
    pub(super) pending_deletes: Locked<HashMap<PodKey, String>>,
    /// UIDs already deleted in the provider (rule 2 is not repeated on every resync).
    pub(super) provider_deleted: Locked<HashSet<String>>,
    /// Per key, a hash of what the provider last accepted (UID, spec, labels, annotations):
    /// `update_pod` runs on every sync, but `ProviderUpdateSuccess` is recorded only when
    /// this changed, so a resync does not write one event per pod.
    pub(super) accepted: Locked<HashMap<PodKey, u64>>,
    /// The runtime's `/metrics` (create latency, provider errors, queue depth).
    pub(super) metrics: Arc<RuntimeMetrics>,
}

/// What a `ProviderUpdateSuccess` event is about: the pod's identity, spec and metadata.
pub(super) fn accepted_hash(pod: &Pod) -> u64 {
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
        metrics: Arc<RuntimeMetrics>,
    ) -> Controller {
        let sync_q = Arc::new(WorkQueue::new("syncPodsFromKubernetes", bucket));
        let delete_q = Arc::new(WorkQueue::new("deletePodsFromKubernetes", bucket));
        let status_q = Arc::new(WorkQueue::new("syncPodStatusFromProvider", bucket));
        metrics.watch_queues(vec![sync_q.clone(), delete_q.clone(), status_q.clone()]);
        Controller {
            node,
            client,
            provider,
            store,
            recorder,
            sync_q,
            delete_q,
            status_q,
            pushes: Arc::new(Pushes::default()),
            pending_deletes: Locked::default(),
            provider_deleted: Locked::default(),
            accepted: Locked::default(),
            metrics,
        }
    }

    pub(super) fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }
}

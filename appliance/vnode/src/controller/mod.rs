//! The pod controller: an informer on the Pods bound to this node (`spec.nodeName=<node>`, all
//! namespaces), three [`WorkQueue`]s (sync-from-k8s, delete-from-k8s, status-from-provider),
//! `workers` workers per queue, the start-up reconcile and the periodic resync.
//!
//! - **sync** (`sync_pods.rs`): [`crate::sync::decide`] on the informer's copy, then the
//!   provider call, events and, on a create/update error, the `ProviderFailed` status (rule 5).
//!   A key the informer no longer has (the Pod left the API) is deleted in the provider if it
//!   still tracks it. A provider copy with another UID than the API pod (deleted and re-created
//!   under the same name) is deleted in the provider first, so the new pod is *created*.
//! - **delete** (`force_delete.rs`): the force-delete (grace 0, UID precondition;
//!   NotFound/Conflict = done).
//! - **status** (`push_status.rs`): [`crate::status`].
//! - **informer** (`informer.rs`): the watch, the start-up reconcile and the resync.
//! - `state.rs`: the [`Controller`] and its bookkeeping; this file: the workers.
//!
//! Start-up: wait for the informer's first complete list, delete in the provider every pod
//! whose key or UID the API does not have, enqueue every pod, start the workers; the caller
//! then marks the Node Ready. After every later re-list (watch reconnect) and every `resync`
//! all API pods and all provider pods are enqueued again, so a deletion missed while the watch
//! was down still reaches the provider.

mod force_delete;
mod informer;
mod push_status;
mod state;
mod sync_pods;

pub(crate) use state::{Controller, SyncError};

use std::future::Future;
use std::sync::Arc;

use tokio::task::JoinSet;
use tracing::{error, info_span, warn, Instrument};

use crate::provider::PodKey;
use crate::queue::{Retry, WorkQueue};
use crate::stats::RuntimeMetrics;

impl Controller {
    /// Starts `workers` workers on each queue.
    pub(crate) fn spawn_workers(self: &Arc<Self>, workers: usize, set: &mut JoinSet<()>) {
        for _ in 0..workers.max(1) {
            let c = self.clone();
            set.spawn(work(self.sync_q.clone(), self.node.clone(), self.metrics.clone(), move |k| {
                let c = c.clone();
                async move { c.sync(&k).await }
            }));
            let c = self.clone();
            set.spawn(work(self.delete_q.clone(), self.node.clone(), self.metrics.clone(), move |k| {
                let c = c.clone();
                async move { c.force_delete(&k).await }
            }));
            let c = self.clone();
            set.spawn(work(self.status_q.clone(), self.node.clone(), self.metrics.clone(), move |k| {
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
}

/// One worker: take a key, run `handle` in a span with the pod key, forget or retry it (a
/// failed provider call is counted in `metrics`).
async fn work<F, Fut>(queue: Arc<WorkQueue<PodKey>>, node: String, metrics: Arc<RuntimeMetrics>, handle: F)
where
    F: Fn(PodKey) -> Fut,
    Fut: Future<Output = Result<(), SyncError>>,
{
    while let Some(key) = queue.get().await {
        let span = info_span!("pod", queue = queue.name(), node = %node, pod = %key);
        let started = std::time::Instant::now();
        let result = handle(key.clone()).instrument(span.clone()).await;
        metrics.observe_work(queue.name(), started.elapsed());
        let _enter = span.enter();
        if let Err(SyncError::Provider { op, .. }) = &result {
            metrics.provider_error(op);
        }
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
mod tests;

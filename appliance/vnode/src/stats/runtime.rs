//! `GET /metrics`: the node runtime's own figures, rendered with `prometheus-client` as
//! sandboxd and the supervisor render theirs (OpenMetrics text, which Prometheus reads too).
//!
//! | sample | labels | type |
//! |---|---|---|
//! | `vnode_pod_queue_depth` | `queue` (`syncPodsFromKubernetes`, `deletePodsFromKubernetes`, `syncPodStatusFromProvider`) | gauge, read at scrape time |
//! | `vnode_pod_create_duration_seconds` | `outcome` (`success`, `error`) | histogram of `Provider::create_pod` calls (10 ms … 5 min) |
//! | `vnode_provider_errors_total` | `operation` (`create`, `update`, `delete`) | counter |
//! | `vnode_pod_queue_wait_seconds` | `queue` | histogram of the time a key waited, from due to a worker taking it (the rate limit included; 0.1 ms … 10 s) |
//! | `vnode_pod_queue_work_seconds` | `queue` | histogram of the time a worker spent on a key (`syncPodStatusFromProvider`: the `pods/status` write) |
//!
//! A provider adds samples of its own with [`RuntimeMetrics::with_provider`].
//!
//! One [`RuntimeMetrics`] lives in [`crate::RuntimeConfig`], so its counters outlast the
//! runtime's restarts after a certificate renewal; each start points it at its new queues.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::provider::PodKey;
use crate::queue::WorkQueue;

/// The content type of [`RuntimeMetrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the create-latency buckets, seconds: a warm sandbox claim takes
/// milliseconds, a cold VM boot seconds, an image pull minutes.
pub const CREATE_BUCKETS: [f64; 14] =
    [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// Upper bounds of the queue wait and work buckets, seconds: a quiet queue hands a key out in
/// microseconds, a status write takes milliseconds, a rate-limited burst seconds.
pub const QUEUE_BUCKETS: [f64; 15] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabel {
    queue: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: &'static str,
}

/// The runtime's counters, the create latency and the queues whose depth is shown.
pub struct RuntimeMetrics {
    registry: Registry,
    depth: Family<QueueLabel, Gauge>,
    create: Family<OutcomeLabel, Histogram>,
    errors: Family<OperationLabel, Counter>,
    waits: Family<QueueLabel, Histogram>,
    work: Family<QueueLabel, Histogram>,
    streams: Gauge,
    queues: Mutex<Vec<Arc<WorkQueue<PodKey>>>>,
}

impl std::fmt::Debug for RuntimeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeMetrics").finish_non_exhaustive()
    }
}

impl Default for RuntimeMetrics {
    fn default() -> Self {
        RuntimeMetrics::with_provider(|_| {})
    }
}

impl RuntimeMetrics {
    /// The runtime's samples, and the provider's that `register` adds to the same registry (one
    /// `/metrics` page per node).
    pub fn with_provider(register: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::default();
        let depth = Family::<QueueLabel, Gauge>::default();
        let create = Family::<OutcomeLabel, Histogram>::new_with_constructor(|| Histogram::new(CREATE_BUCKETS));
        let errors = Family::<OperationLabel, Counter>::default();
        registry.register("vnode_pod_queue_depth", "Pod keys waiting in each work queue.", depth.clone());
        registry.register(
            "vnode_pod_create_duration_seconds",
            "How long the provider took to create a Pod, by outcome.",
            create.clone(),
        );
        registry.register("vnode_provider_errors", "Provider calls that failed, by operation.", errors.clone());
        let streams = Gauge::default();
        registry.register(
            "vnode_stream_sessions_open",
            "Open streaming sessions on the kubelet port (logs, exec, attach, port-forward).",
            streams.clone(),
        );
        let waits = Family::<QueueLabel, Histogram>::new_with_constructor(|| Histogram::new(QUEUE_BUCKETS));
        let work = Family::<QueueLabel, Histogram>::new_with_constructor(|| Histogram::new(QUEUE_BUCKETS));
        registry.register(
            "vnode_pod_queue_wait_seconds",
            "How long a Pod key waited in each work queue before a worker took it.",
            waits.clone(),
        );
        registry.register(
            "vnode_pod_queue_work_seconds",
            "How long a worker spent on a Pod key, by queue.",
            work.clone(),
        );
        register(&mut registry);
        RuntimeMetrics { registry, depth, create, errors, waits, work, streams, queues: Mutex::new(Vec::new()) }
    }

    /// Shows the depth of `queues` from now on (the previous runtime's are forgotten).
    pub(crate) fn watch_queues(&self, queues: Vec<Arc<WorkQueue<PodKey>>>) {
        for q in &queues {
            q.observe_waits(self.waits.get_or_create(&QueueLabel { queue: q.name() }).clone());
        }
        *self.queues.lock().unwrap_or_else(|p| p.into_inner()) = queues;
    }

    /// The gauge of open streaming sessions (the kubelet port's [`crate::streams`] moves it).
    pub(crate) fn stream_sessions(&self) -> Gauge {
        self.streams.clone()
    }

    /// Records one `create_pod` call.
    pub fn observe_create(&self, took: Duration, ok: bool) {
        let outcome = if ok { "success" } else { "error" };
        self.create.get_or_create(&OutcomeLabel { outcome }).observe(took.as_secs_f64());
    }

    /// Records the time a worker of `queue` spent on one key.
    pub fn observe_work(&self, queue: &'static str, took: Duration) {
        self.work.get_or_create(&QueueLabel { queue }).observe(took.as_secs_f64());
    }

    /// Counts one failed provider call (`create`, `update` or `delete`).
    pub fn provider_error(&self, operation: &'static str) {
        self.errors.get_or_create(&OperationLabel { operation }).inc();
    }

    /// The text, with the queues' depth read now.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        for q in self.queues.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let depth = i64::try_from(q.len()).unwrap_or(i64::MAX);
            self.depth.get_or_create(&QueueLabel { queue: q.name() }).set(depth);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_latency_and_errors() {
        let m = RuntimeMetrics::with_provider(|r| {
            r.register("provider_sample", "a provider's own", Counter::<u64>::default())
        });
        let q = Arc::new(WorkQueue::new("syncPodsFromKubernetes", None));
        q.add(PodKey::new("ns", "a"));
        q.add(PodKey::new("ns", "b"));
        m.watch_queues(vec![q.clone()]);
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
        let got = rt.block_on(q.get()).expect("a key");
        q.done(&got);
        m.observe_work("syncPodStatusFromProvider", Duration::from_millis(3));
        m.observe_create(Duration::from_millis(30), true);
        m.observe_create(Duration::from_secs(400), false);
        m.provider_error("create");
        m.provider_error("create");
        m.provider_error("delete");
        let text = m.render().expect("render");
        for want in [
            "vnode_pod_queue_depth{queue=\"syncPodsFromKubernetes\"} 1\n",
            "# TYPE vnode_pod_create_duration_seconds histogram\n",
            "vnode_pod_create_duration_seconds_bucket{le=\"0.05\",outcome=\"success\"} 1\n",
            "vnode_pod_create_duration_seconds_bucket{le=\"+Inf\",outcome=\"error\"} 1\n",
            "vnode_pod_create_duration_seconds_count{outcome=\"success\"} 1\n",
            "vnode_provider_errors_total{operation=\"create\"} 2\n",
            "vnode_provider_errors_total{operation=\"delete\"} 1\n",
            "vnode_stream_sessions_open 0\n",
            "vnode_pod_queue_work_seconds_count{queue=\"syncPodStatusFromProvider\"} 1\n",
            "vnode_pod_queue_wait_seconds_count{queue=\"syncPodsFromKubernetes\"} 1\n",
            "provider_sample_total 0\n",
            "# EOF\n",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        // A restarted runtime's queues replace the old ones.
        let fresh = Arc::new(WorkQueue::new("syncPodsFromKubernetes", None));
        m.watch_queues(vec![fresh]);
        assert!(m.render().expect("render").contains("vnode_pod_queue_depth{queue=\"syncPodsFromKubernetes\"} 0\n"));
    }
}

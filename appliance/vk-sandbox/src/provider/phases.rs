//! The provider's own `/metrics` samples, served on the kubelet port beside the runtime's
//! (`vnode::stats::RuntimeMetrics::with_provider`):
//!
//! | sample | labels | type |
//! |---|---|---|
//! | `vk_sandbox_create_phase_seconds` | `phase`: `settle` (checks and any listing before the claim), `claim` (sandboxd's claim call), `record` (the claims-state write) | histogram (0.1 ms … 10 s) |
//! | `vk_sandbox_state_flush_failures_total` | | counter: claims-state flushes to disk that failed |
//!
//! With the runtime's `vnode_pod_queue_wait_seconds` (before the create) and
//! `vnode_pod_status_push_seconds` (after it) they split a Pod's way from bound to Running.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds of the phase buckets, seconds: a clean phase takes well under a millisecond, a
/// claim on a miss seconds.
const PHASE_BUCKETS: [f64; 15] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// A step of CreatePod that is timed.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub(super) enum Phase {
    Settle,
    Claim,
    Record,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

/// The phase histograms and the flush-failure counter.
#[derive(Debug, Clone)]
pub(super) struct CreatePhases {
    phases: Family<PhaseLabel, Histogram>,
    pub flush_failures: Counter,
}

impl CreatePhases {
    /// The histograms, with the claims state's flush-failure counter.
    pub fn new(flush_failures: Counter) -> CreatePhases {
        CreatePhases { phases: Family::new_with_constructor(|| Histogram::new(PHASE_BUCKETS)), flush_failures }
    }

    pub fn observe(&self, phase: Phase, took: Duration) {
        let phase = match phase {
            Phase::Settle => "settle",
            Phase::Claim => "claim",
            Phase::Record => "record",
        };
        self.phases.get_or_create(&PhaseLabel { phase }).observe(took.as_secs_f64());
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "vk_sandbox_create_phase_seconds",
            "Time of each step of a Pod's create in vk-sandbox (settle, claim, record).",
            self.phases.clone(),
        );
        registry.register(
            "vk_sandbox_state_flush_failures",
            "Flushes of the claims state to disk that failed (each is retried on the next save).",
            self.flush_failures.clone(),
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn phases_render_with_their_labels() {
        let p = CreatePhases::new(Counter::default());
        p.observe(Phase::Claim, Duration::from_micros(700));
        p.observe(Phase::Record, Duration::from_micros(90));
        p.flush_failures.inc();
        let mut r = Registry::default();
        p.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for want in [
            "vk_sandbox_create_phase_seconds_bucket{le=\"0.001\",phase=\"claim\"} 1\n",
            "vk_sandbox_create_phase_seconds_bucket{le=\"0.0001\",phase=\"record\"} 1\n",
            "vk_sandbox_state_flush_failures_total 1\n",
        ] {
            assert!(out.contains(want), "missing {want:?} in\n{out}");
        }
    }
}

//! vk-cocoon's own Prometheus samples, served with the runtime's on the kubelet port's
//! `/metrics` and on `VK_METRICS_ADDR` ([`crate::CocoonProvider::register_metrics`], registered through
//! `vnode::stats::RuntimeMetrics::with_provider`). The names are upstream vk-cocoon's
//! (`metrics/metrics.go`: namespace `cocoon`, subsystem `vk`) where upstream has the metric;
//! the library and GC samples are ours.
//!
//! | sample | labels | type |
//! |---|---|---|
//! | `cocoon_vk_pod_lifecycle_total` | `op`: `create`, `update`, `delete`; `result`: `success`, `failure` | counter: provider calls by outcome (a retried failure counts each time) |
//! | `cocoon_vk_vm_boot_duration_seconds` | `mode`: `run`, `clone`; `backend`: `qemu`, `cloud-hypervisor` | histogram (0.5 s … 300 s): a managed VM's bring-up, from the start of the boot or restore to its Pod's first Running push |
//! | `cocoon_vk_snapshot_save_total` | `result`: `success`, `failure` | counter: DeletePod's snapshot saves |
//! | `cocoon_vk_snapshot_save_duration_seconds` | | histogram (1 s … 120 s): successful saves |
//! | `cocoon_vk_orphan_vm_total` | | counter: VMs no Pod references, found by the start-up reconcile (whatever `VK_ORPHAN_POLICY` then does) |
//! | `cocoon_vk_vm_table_size` | | gauge, read at scrape: Pods the provider tracks (`provider/metrics.rs`) |
//! | `cocoon_vk_image_library_bytes` | `kind`: `image`, `snapshot` | gauge: disk bytes of the library's entries, measured by each snapshot GC pass |
//! | `cocoon_vk_snapshot_gc_removed_total` | | counter: snapshots the GC removed ([`crate::gc`]) |
//! | `cocoon_vk_snapshot_gc_runs_total` | `result`: `success`, `error` | counter: GC passes; `error` = skipped (a listing failed) or a removal failed |
//!
//! The samples are process-wide ([`metrics`]), as upstream's default registry is: one
//! provider runs per process. Call sites are one line each.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::backend::Hypervisor;

/// Upstream's boot buckets, seconds.
const BOOT_BUCKETS: [f64; 9] = [0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// Upstream's snapshot-save buckets, seconds.
const SAVE_BUCKETS: [f64; 7] = [1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0];

/// A provider call (`cocoon_vk_pod_lifecycle_total{op}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Create,
    Update,
    Delete,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LifecycleLabels {
    op: &'static str,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BootLabels {
    mode: &'static str,
    backend: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

fn outcome(ok: bool) -> &'static str {
    if ok {
        "success"
    } else {
        "failure"
    }
}

/// Every sample of the table above but the table size (read from the provider at scrape).
#[derive(Debug, Clone)]
pub struct CocoonMetrics {
    lifecycle: Family<LifecycleLabels, Counter>,
    boot: Family<BootLabels, Histogram>,
    saves: Family<ResultLabel, Counter>,
    save_seconds: Histogram,
    orphans: Counter,
    library_bytes: Family<KindLabel, Gauge>,
    gc_removed: Counter,
    gc_runs: Family<ResultLabel, Counter>,
}

impl Default for CocoonMetrics {
    fn default() -> Self {
        CocoonMetrics {
            lifecycle: Family::default(),
            boot: Family::new_with_constructor(|| Histogram::new(BOOT_BUCKETS)),
            saves: Family::default(),
            save_seconds: Histogram::new(SAVE_BUCKETS),
            orphans: Counter::default(),
            library_bytes: Family::default(),
            gc_removed: Counter::default(),
            gc_runs: Family::default(),
        }
    }
}

/// The process's samples.
pub fn metrics() -> &'static CocoonMetrics {
    static METRICS: LazyLock<CocoonMetrics> = LazyLock::new(CocoonMetrics::default);
    &METRICS
}

/// Counts a provider call's outcome and hands it on.
pub(crate) fn counted<T, E>(op: Op, r: Result<T, E>) -> Result<T, E> {
    metrics().pod_call(op, r.is_ok());
    r
}

/// Runs a snapshot save, counting its outcome and timing a success.
pub(crate) async fn timed_save<T, E>(save: impl std::future::Future<Output = Result<T, E>>) -> Result<T, E> {
    let started = std::time::Instant::now();
    let r = save.await;
    metrics().snapshot_saved(r.is_ok(), started.elapsed());
    r
}

impl CocoonMetrics {
    /// A provider call ended.
    pub fn pod_call(&self, op: Op, ok: bool) {
        let op = match op {
            Op::Create => "create",
            Op::Update => "update",
            Op::Delete => "delete",
        };
        self.lifecycle.get_or_create(&LifecycleLabels { op, result: outcome(ok) }).inc();
    }

    /// A managed VM was brought up (`clone`: restored from a snapshot) in `took`.
    pub fn vm_booted(&self, clone: bool, backend: Hypervisor, took: Duration) {
        let mode = if clone { "clone" } else { "run" };
        self.boot.get_or_create(&BootLabels { mode, backend: backend.as_str() }).observe(took.as_secs_f64());
    }

    /// A snapshot save ended (`took` is observed for a success only).
    pub fn snapshot_saved(&self, ok: bool, took: Duration) {
        self.saves.get_or_create(&ResultLabel { result: outcome(ok) }).inc();
        if ok {
            self.save_seconds.observe(took.as_secs_f64());
        }
    }

    /// The start-up reconcile found an orphan VM.
    pub fn orphan_found(&self) {
        self.orphans.inc();
    }

    /// The library's disk bytes, images and snapshots.
    pub fn library_measured(&self, image_bytes: u64, snapshot_bytes: u64) {
        for (kind, bytes) in [("image", image_bytes), ("snapshot", snapshot_bytes)] {
            self.library_bytes.get_or_create(&KindLabel { kind }).set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// A snapshot GC pass ended, having removed `removed` snapshots.
    pub fn gc_pass(&self, ok: bool, removed: u64) {
        self.gc_removed.inc_by(removed);
        let result = if ok { "success" } else { "error" };
        self.gc_runs.get_or_create(&ResultLabel { result }).inc();
    }

    /// Registers every sample (counters get their `_total` suffix from the encoder).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "cocoon_vk_pod_lifecycle",
            "Number of pod lifecycle operations by op and result.",
            self.lifecycle.clone(),
        );
        r.register(
            "cocoon_vk_vm_boot_duration_seconds",
            "Time to create a VM (run or clone), from start to Running.",
            self.boot.clone(),
        );
        r.register("cocoon_vk_snapshot_save", "Number of snapshot saves by result.", self.saves.clone());
        r.register(
            "cocoon_vk_snapshot_save_duration_seconds",
            "Time to save a VM snapshot.",
            self.save_seconds.clone(),
        );
        r.register(
            "cocoon_vk_orphan_vm",
            "Number of orphan VMs detected during startup reconcile.",
            self.orphans.clone(),
        );
        r.register(
            "cocoon_vk_image_library_bytes",
            "Disk bytes of the image library by kind (image, snapshot), as of the last snapshot GC pass.",
            self.library_bytes.clone(),
        );
        r.register("cocoon_vk_snapshot_gc_removed", "Snapshots the snapshot GC removed.", self.gc_removed.clone());
        r.register("cocoon_vk_snapshot_gc_runs", "Snapshot GC passes by result.", self.gc_runs.clone());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn every_sample_renders_under_its_upstream_or_own_name() {
        let m = CocoonMetrics::default();
        m.pod_call(Op::Create, true);
        m.pod_call(Op::Delete, false);
        m.vm_booted(true, Hypervisor::Qemu, Duration::from_millis(1500));
        m.snapshot_saved(true, Duration::from_secs(3));
        m.orphan_found();
        m.library_measured(100, 20);
        m.gc_pass(true, 2);
        m.gc_pass(false, 0);
        let mut r = Registry::default();
        m.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for want in [
            "cocoon_vk_pod_lifecycle_total{op=\"create\",result=\"success\"} 1\n",
            "cocoon_vk_pod_lifecycle_total{op=\"delete\",result=\"failure\"} 1\n",
            "cocoon_vk_vm_boot_duration_seconds_bucket{le=\"2.0\",mode=\"clone\",backend=\"qemu\"} 1\n",
            "cocoon_vk_snapshot_save_total{result=\"success\"} 1\n",
            "cocoon_vk_snapshot_save_duration_seconds_bucket{le=\"5.0\"} 1\n",
            "cocoon_vk_orphan_vm_total 1\n",
            "cocoon_vk_image_library_bytes{kind=\"image\"} 100\n",
            "cocoon_vk_image_library_bytes{kind=\"snapshot\"} 20\n",
            "cocoon_vk_snapshot_gc_removed_total 2\n",
            "cocoon_vk_snapshot_gc_runs_total{result=\"success\"} 1\n",
            "cocoon_vk_snapshot_gc_runs_total{result=\"error\"} 1\n",
        ] {
            assert!(out.contains(want), "missing {want:?} in\n{out}");
        }
    }
}

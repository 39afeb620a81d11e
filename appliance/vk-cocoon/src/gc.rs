//! The snapshot GC: a timer that removes the snapshots this provider wrote once nothing on the
//! node refers to them and they are older than `VK_SNAPSHOT_RETENTION`, then collects the
//! library's unreferenced content. Upstream vk-cocoon's reclaimer (`provider/cocoon/gc.go`)
//! runs at start and every 10 minutes, has no age limit and only logs; here the interval is
//! `VK_SNAPSHOT_GC_INTERVAL` (default upstream's 10 min), an age limit guards snapshots a Pod
//! may still clone, and each pass is counted (`crate::metrics`).
//!
//! # A pass
//! 1. List the library ([`VmBackend::library`](crate::VmBackend::library)) and set `cocoon_vk_image_library_bytes`.
//! 2. List every Pod bound to the node from the API ([`PodSource`]), and read the provider's
//!    table: its tracked Pods, the VM names being created and the VMs awaiting adoption.
//! 3. A snapshot is **kept** when any of these holds:
//!    * it records no namespace (images, and snapshots `chrysalis snapshot save` wrote without
//!      `--namespace`, are never candidates: vk-cocoon's saves always record one);
//!    * its repo is the `vm.cocoonstack.io/name` of a Pod of step 2 (any tag: `<name>:latest`
//!      DeletePod saves, `<name>:hibernate`), or `fork-<name>`; the `fork-from` and
//!      `restore-from-hibernate` annotations count as names too;
//!    * a Pod's `cocoonset.cocoonstack.io/image` names it (`repo[:tag]`, bare = `latest`: the
//!      clone source);
//!    * a live VM uses its content;
//!    * it is younger than the retention, or the retention is `0` (never remove by age).
//! 4. Remove the rest, one at a time, each just after two checks against changes since
//!    step 1: the provider's table is read again (a snapshot it now refers to is kept), and the
//!    removal is a compare-and-delete
//!    ([`VmBackend::snapshot_rm_if`](crate::VmBackend::snapshot_rm_if)) of the content step 1
//!    listed, so a name saved again since (a DeletePod's `<name>:latest`) is kept. Then collect
//!    the content no name or live VM uses
//!    ([`VmBackend::collect_garbage`](crate::VmBackend::collect_garbage)).
//!
//! # Guarantees
//! * Nothing is removed on ambiguity: a failed library listing, no API client yet, or a failed
//!   Pod listing skips the pass (logged, `cocoon_vk_snapshot_gc_runs_total{result="error"}`).
//! * The Pods come from the API, not only the provider's table, so a Pod whose create has not
//!   run yet (after a restart, or queued) keeps its snapshots like a tracked one.
//! * Age, owner and "in use" come from step 1, but only the content step 1 listed is removed:
//!   a save under the name since then (it replaces the name in the library under the store's
//!   lock, which the compare-and-delete takes too) keeps the new snapshot.
//!
//! # Caveats
//! A Pod that is not in the provider's table when its snapshot's removal starts (the API did
//! not list it at step 2 and its create has not reserved its VM name yet) and that clones a
//! snapshot older than the retention and otherwise unreferenced can lose it within the same
//! pass (milliseconds); its create then fails and is retried, reporting the snapshot missing.
//! The same holds for a clone whose create reserves its name after the table is read again
//! and before the removal (one backend call). A live VM that started using a snapshot after
//! step 1 does not keep its name, only its content (the collection keeps what live VMs use).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use vnode::error_chain;
use vnode::kit::{BackgroundLoops, Locked};

use crate::annotations::{self, FORK_FROM, IMAGE, RESTORE_FROM_HIBERNATE, VM_NAME};
use crate::backend::{BackendError, SnapshotEntry, SnapshotRef};
pub use crate::config::{GcConfig, DEFAULT_GC_INTERVAL, DEFAULT_RETENTION};
use crate::metrics::metrics;
use crate::provider::CocoonProvider;

/// The first pass runs this long after start (or one interval, when shorter).
const FIRST_PASS: Duration = Duration::from_secs(30);

/// Why a pass was skipped.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("listing the image library")]
    Library(#[source] BackendError),
    #[error("no API client yet: the node's Pods are unknown")]
    NoClient,
    #[error("listing the Pods bound to {node}")]
    Pods {
        node: String,
        #[source]
        source: kube::Error,
    },
}

/// Every Pod bound to the node, complete or an error.
#[async_trait::async_trait]
pub trait PodSource: Send + Sync + 'static {
    async fn pods(&self) -> Result<Vec<Pod>, GcError>;
}

/// [`PodSource`] over the API, with the client of the current session ([`KubePods::set_client`]).
pub struct KubePods {
    node: String,
    client: Locked<Option<kube::Client>>,
}

impl KubePods {
    /// The Pods bound to `node`; none are known until a client is set.
    pub fn new(node: impl Into<String>) -> KubePods {
        KubePods { node: node.into(), client: Locked::new(None) }
    }

    /// The client to list with from now on.
    pub fn set_client(&self, client: kube::Client) {
        *self.client.lock() = Some(client);
    }
}

#[async_trait::async_trait]
impl PodSource for KubePods {
    async fn pods(&self) -> Result<Vec<Pod>, GcError> {
        let client = self.client.lock().clone().ok_or(GcError::NoClient)?;
        let api: kube::Api<Pod> = kube::Api::all(client);
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = api.list(&lp).await.map_err(|source| GcError::Pods { node: self.node.clone(), source })?;
        Ok(list.items)
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Snapshots removed.
    pub removed: Vec<SnapshotRef>,
    /// Snapshots whose removal failed (left for the next pass).
    pub failed: Vec<SnapshotRef>,
    /// Snapshots kept.
    pub kept: usize,
    /// Disk bytes the content collection freed.
    pub freed_bytes: u64,
    /// The content collection failed (logged).
    pub collect_failed: bool,
}

impl GcReport {
    /// Every removal and the collection succeeded.
    pub fn ok(&self) -> bool {
        self.failed.is_empty() && !self.collect_failed
    }
}

/// The names and clone sources the node refers to.
#[derive(Debug, Default)]
struct Keep {
    names: BTreeSet<String>,
    sources: BTreeSet<SnapshotRef>,
}

impl Keep {
    fn add_pod(&mut self, pod: &Pod) {
        for key in [VM_NAME, FORK_FROM, RESTORE_FROM_HIBERNATE] {
            if let Some(v) = annotations::value(pod, key) {
                self.names.insert(v.to_owned());
                self.add_source(v);
            }
        }
        if let Some(image) = annotations::value(pod, IMAGE) {
            self.add_source(image);
        }
    }

    fn add_source(&mut self, s: &str) {
        if let Ok(r) = s.parse::<SnapshotRef>() {
            self.sources.insert(r);
        }
    }

    fn refers_to(&self, r: &SnapshotRef) -> bool {
        self.sources.contains(r)
            || self.names.contains(&r.repo)
            || r.repo.strip_prefix("fork-").is_some_and(|n| self.names.contains(n))
    }
}

/// Why `snap` stays, or `None`: it goes.
fn kept_because(
    snap: &SnapshotEntry,
    keep: &Keep,
    retention: Option<Duration>,
    now: SystemTime,
) -> Option<&'static str> {
    if snap.namespace.is_none() {
        return Some("no namespace recorded: not written by vk-cocoon");
    }
    if keep.refers_to(&snap.reference) {
        return Some("a pod on the node refers to it");
    }
    if snap.in_use {
        return Some("a live VM uses it");
    }
    let Some(retention) = retention else { return Some("VK_SNAPSHOT_RETENTION=0: none is removed by age") };
    // A creation time in the future counts as young.
    match now.duration_since(snap.created) {
        Ok(age) if age >= retention => None,
        _ => Some("younger than VK_SNAPSHOT_RETENTION"),
    }
}

impl CocoonProvider {
    /// One GC pass (see the module doc); `Err` = skipped, nothing removed.
    pub async fn snapshot_gc_once(
        &self,
        pods: &dyn PodSource,
        retention: Option<Duration>,
    ) -> Result<GcReport, GcError> {
        let s = &self.0;
        let library = s.backend.library().await.map_err(GcError::Library)?;
        let snapshot_bytes = library.snapshots.iter().map(|e| e.disk_bytes).sum();
        metrics().library_measured(library.image_disk_bytes, snapshot_bytes);
        // Read after the listing: a Pod that appears meanwhile is seen.
        let api = pods.pods().await?;
        let mut keep = Keep::default();
        api.iter().for_each(|p| keep.add_pod(p));
        self.add_table(&mut keep);
        let now = SystemTime::now();
        let mut report = GcReport::default();
        for snap in &library.snapshots {
            if let Some(why) = kept_because(snap, &keep, retention, now) {
                tracing::debug!(snapshot = %snap.reference, why, "snapshot kept");
                report.kept += 1;
                continue;
            }
            // The table again: a create may have started since step 2.
            let mut table = Keep::default();
            self.add_table(&mut table);
            if table.refers_to(&snap.reference) {
                tracing::debug!(snapshot = %snap.reference, "snapshot kept: the provider refers to it since the listing");
                report.kept += 1;
                continue;
            }
            match s.backend.snapshot_rm_if(&snap.reference, &snap.content).await {
                Ok(false) => {
                    tracing::info!(snapshot = %snap.reference, "snapshot kept: saved again (or removed) since the listing");
                    report.kept += 1;
                }
                Ok(true) => {
                    tracing::info!(snapshot = %snap.reference, namespace = ?snap.namespace, disk_bytes = snap.disk_bytes, "removed a snapshot nothing on the node refers to, older than VK_SNAPSHOT_RETENTION");
                    report.removed.push(snap.reference.clone());
                }
                Err(e) => {
                    tracing::warn!(snapshot = %snap.reference, error = %error_chain(&e), "removing the snapshot failed; the next pass retries");
                    report.failed.push(snap.reference.clone());
                }
            }
        }
        match s.backend.collect_garbage().await {
            Ok(freed) => report.freed_bytes = freed,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "collecting the library's content failed");
                report.collect_failed = true;
            }
        }
        Ok(report)
    }

    /// Adds what the provider's table refers to: its tracked Pods, the VM names being
    /// created and the VMs awaiting adoption.
    fn add_table(&self, keep: &mut Keep) {
        let g = self.0.lock();
        for e in g.entries.values() {
            keep.add_pod(&e.pod);
            keep.names.insert(e.spec.vm_name.clone());
            keep.names.insert(e.vm.name.clone());
        }
        keep.names.extend(g.reserved.keys().cloned());
        keep.names.extend(g.adoptable.values().map(|v| v.name.clone()));
    }

    /// Starts the GC timer: a first pass shortly after start, then one every `cfg.interval`
    /// (nothing when it is zero). Dropping the handle stops it.
    pub fn spawn_snapshot_gc(&self, pods: Arc<dyn PodSource>, cfg: GcConfig) -> BackgroundLoops {
        let mut loops = BackgroundLoops::default();
        if cfg.interval.is_zero() {
            tracing::info!("snapshot GC off (VK_SNAPSHOT_GC_INTERVAL=0)");
            return loops;
        }
        let provider = CocoonProvider(self.0.clone());
        loops.spawn(tracing::info_span!("snapshot_gc"), async move {
            tokio::time::sleep(cfg.interval.min(FIRST_PASS)).await;
            loop {
                gc_pass(&provider, pods.as_ref(), cfg.retention).await;
                tokio::time::sleep(cfg.interval).await;
            }
        });
        loops
    }
}

/// One pass, logged and counted.
async fn gc_pass(provider: &CocoonProvider, pods: &dyn PodSource, retention: Option<Duration>) {
    match provider.snapshot_gc_once(pods, retention).await {
        Ok(r) => {
            metrics().gc_pass(r.ok(), r.removed.len() as u64);
            if !r.removed.is_empty() || !r.ok() {
                tracing::info!(
                    removed = r.removed.len(),
                    failed = r.failed.len(),
                    kept = r.kept,
                    freed_bytes = r.freed_bytes,
                    "snapshot GC pass"
                );
            } else {
                tracing::debug!(kept = r.kept, freed_bytes = r.freed_bytes, "snapshot GC pass");
            }
        }
        Err(e) => {
            metrics().gc_pass(false, 0);
            tracing::warn!(error = %error_chain(&e), "snapshot GC pass skipped: nothing is removed on a guess");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

//! The GC pass over [`FakeBackend`]: what it keeps, what it removes, when it removes nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use vnode::Provider;

use super::*;
use crate::annotations::{MANAGED, MODE};
use crate::backend::CloneRequest;
use crate::test_utils::FakeBackend;
use crate::{Hypervisor, ProviderConfig, VmBackend};

const WEEK: Duration = DEFAULT_RETENTION;

/// The API's answer.
struct Pods(Option<Vec<Pod>>);

#[async_trait::async_trait]
impl PodSource for Pods {
    async fn pods(&self) -> Result<Vec<Pod>, GcError> {
        self.0.clone().ok_or(GcError::NoClient)
    }
}

fn pod(name: &str, pairs: &[(&str, &str)]) -> Pod {
    let annotations: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            uid: Some(format!("uid-{name}")),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(Default::default()),
        ..Pod::default()
    }
}

fn snap(s: &str) -> SnapshotRef {
    s.parse().unwrap()
}

struct Rig {
    backend: Arc<FakeBackend>,
    provider: CocoonProvider,
}

impl Rig {
    fn new() -> Rig {
        let backend = Arc::new(FakeBackend::new());
        let provider = CocoonProvider::new(backend.clone(), ProviderConfig::new("192.0.2.7"));
        Rig { backend, provider }
    }

    /// A snapshot of namespace `ns` (`None`: recorded without one), saved `age` ago.
    fn snapshot(&self, ns: Option<&str>, s: &str, age: Duration) {
        self.backend.add_snapshot(ns, &snap(s));
        self.backend.set_snapshot_created(&snap(s), SystemTime::now() - age);
    }

    fn left(&self) -> Vec<String> {
        self.backend.snapshots().keys().map(|r| r.to_string()).collect()
    }
}

#[tokio::test]
async fn keeps_every_snapshot_a_pod_on_the_node_refers_to() {
    let r = Rig::new();
    let old = WEEK * 2;
    for s in ["golden:v1", "vm-b:latest", "queued:hibernate", "fork-vm-b:latest", "queued:latest", "later-src:latest"] {
        r.snapshot(Some("ns"), s, old);
    }
    // A tracked Pod cloning golden:v1, under VM name vm-b.
    let tracked = pod("b", &[(VM_NAME, "vm-b"), (MANAGED, "true"), (IMAGE, "golden:v1")]);
    r.provider.create_pod(&tracked).await.unwrap();
    // Pods the API lists that the provider has not created yet: one named `queued`, one that
    // will clone `later-src` (bare = latest).
    let api = vec![
        pod("q", &[(VM_NAME, "queued"), (MANAGED, "true"), (MODE, "run"), (IMAGE, "base")]),
        pod("l", &[(VM_NAME, "later"), (MANAGED, "true"), (IMAGE, "later-src")]),
    ];
    let report = r.provider.snapshot_gc_once(&Pods(Some(api)), Some(WEEK)).await.unwrap();
    assert!(report.removed.is_empty(), "{report:?}");
    assert_eq!(report.kept, 6, "{:?}", r.left());
    assert_eq!(r.left().len(), 6);
}

#[tokio::test]
async fn removes_old_unreferenced_snapshots_and_keeps_young_foreign_and_used_ones() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "gone-vm:latest", WEEK + Duration::from_secs(60));
    r.snapshot(Some("ns"), "fresh-vm:latest", WEEK - Duration::from_secs(3600));
    r.snapshot(None, "operator-golden:latest", WEEK * 10);
    r.snapshot(Some("ns"), "used:latest", WEEK * 2);
    // A live VM restored from `used` that no Pod names (an orphan left by the policy keep).
    let req = CloneRequest {
        name: "orphan".into(),
        namespace: "ns".into(),
        snapshot: snap("used:latest"),
        network: None,
        shared_network: None,
        hypervisor: Hypervisor::Qemu,
        keep_lease: false,
    };
    r.backend.clone_vm(&req).await.unwrap();
    let before = r.backend.collections();
    let report = r.provider.snapshot_gc_once(&Pods(Some(Vec::new())), Some(WEEK)).await.unwrap();
    assert_eq!(report.removed, [snap("gone-vm:latest")]);
    assert!(report.ok() && report.kept == 3, "{report:?}");
    assert_eq!(r.left(), ["fresh-vm:latest", "operator-golden:latest", "used:latest"]);
    assert_eq!(r.backend.collections(), before + 1, "the content is collected after the removals");
}

#[tokio::test]
async fn a_zero_retention_removes_nothing_by_age() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "gone-vm:latest", WEEK * 5);
    let report = r.provider.snapshot_gc_once(&Pods(Some(Vec::new())), None).await.unwrap();
    assert!(report.removed.is_empty() && report.kept == 1, "{report:?}");
}

#[tokio::test]
async fn a_failed_listing_skips_the_pass() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "gone-vm:latest", WEEK * 5);
    // The library cannot be listed.
    r.backend.fail("library", 1);
    let e = r.provider.snapshot_gc_once(&Pods(Some(Vec::new())), Some(WEEK)).await.unwrap_err();
    assert!(matches!(e, GcError::Library(_)), "{e}");
    // The node's Pods are unknown (no client yet, or the API failed).
    let e = r.provider.snapshot_gc_once(&Pods(None), Some(WEEK)).await.unwrap_err();
    assert!(matches!(e, GcError::NoClient), "{e}");
    assert_eq!(r.left(), ["gone-vm:latest"]);
    assert_eq!(r.backend.collections(), 0, "no content collection on a skipped pass");
}

#[tokio::test]
async fn a_failed_removal_is_reported_and_the_rest_goes_on() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "a:latest", WEEK * 2);
    r.snapshot(Some("ns"), "b:latest", WEEK * 2);
    r.backend.fail("snapshot_rm_if", 1);
    let report = r.provider.snapshot_gc_once(&Pods(Some(Vec::new())), Some(WEEK)).await.unwrap();
    assert_eq!((report.failed.len(), report.removed.len()), (1, 1), "{report:?}");
    assert!(!report.ok());
}

/// An API listing during which `vm-a:latest` is saved again (a DeletePod of the name
/// finishing between the library listing and the Pod listing).
struct ResavedDuringListing(Arc<FakeBackend>);

#[async_trait::async_trait]
impl PodSource for ResavedDuringListing {
    async fn pods(&self) -> Result<Vec<Pod>, GcError> {
        self.0.add_snapshot(Some("ns"), &snap("vm-a:latest"));
        self.0.set_snapshot_created(&snap("vm-a:latest"), SystemTime::now());
        Ok(Vec::new())
    }
}

#[tokio::test]
async fn a_snapshot_saved_again_since_the_listing_is_kept() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "vm-a:latest", WEEK * 2);
    r.snapshot(Some("ns"), "gone:latest", WEEK * 2);
    let report = r.provider.snapshot_gc_once(&ResavedDuringListing(r.backend.clone()), Some(WEEK)).await.unwrap();
    assert_eq!(report.removed, [snap("gone:latest")], "{report:?}");
    assert!(report.ok() && report.kept == 1, "{report:?}");
    assert_eq!(r.left(), ["vm-a:latest"], "the new snapshot under the old name stays");
}

#[tokio::test]
async fn a_snapshot_the_provider_refers_to_since_step_2_is_kept() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "a:latest", WEEK * 2);
    r.snapshot(Some("ns"), "b:latest", WEEK * 2);
    // While `a` is removed, a create reserves the VM name `b` (it will clone `b:latest`).
    let p = CocoonProvider(r.provider.0.clone());
    r.backend.before("snapshot_rm_if", move || {
        p.0.lock().reserved.insert("b".into(), "ns/pod-b".into());
    });
    let report = r.provider.snapshot_gc_once(&Pods(Some(Vec::new())), Some(WEEK)).await.unwrap();
    assert_eq!(report.removed, [snap("a:latest")], "{report:?}");
    assert_eq!(report.kept, 1, "{report:?}");
    assert_eq!(r.left(), ["b:latest"]);
}

#[tokio::test(start_paused = true)]
async fn the_timer_runs_a_first_pass_soon_then_every_interval() {
    let r = Rig::new();
    r.snapshot(Some("ns"), "gone-vm:latest", WEEK * 2);
    let cfg = GcConfig { interval: Duration::from_secs(600), retention: Some(WEEK) };
    let _gc = r.provider.spawn_snapshot_gc(Arc::new(Pods(Some(Vec::new()))), cfg);
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert_eq!(r.left().len(), 1, "not before 30 s");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(r.left().is_empty(), "the first pass runs 30 s after start");
    r.snapshot(Some("ns"), "next:latest", WEEK * 2);
    tokio::time::sleep(Duration::from_secs(601)).await;
    assert!(r.left().is_empty(), "the next pass, one interval later");
    assert_eq!(r.backend.collections(), 2);
}

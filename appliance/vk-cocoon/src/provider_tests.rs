//! Provider tests: [`FakeBackend`] + the notifier's receiving end + recorded events; no API
//! server, no VM. Most run on tokio's paused clock, so probe and watcher timings are exact.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use tokio::sync::mpsc::UnboundedReceiver;
use vnode::{PodKey, PodNotifier, Provider};

use super::*;
use crate::annotations::*;
use crate::events::RecordedEvents;
use crate::test_utils::FakeBackend;

/// The namespace of the test Pods, recorded on the VMs and snapshots they find.
const NS: Option<&str> = Some("ns");

struct Rig {
    backend: Arc<FakeBackend>,
    provider: CocoonProvider,
    pushes: UnboundedReceiver<Pod>,
    events: Arc<RecordedEvents>,
}

impl Rig {
    fn new() -> Rig {
        Rig::tuned(|_| {})
    }

    fn tuned(tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        Rig::over(Arc::new(FakeBackend::new()), tune)
    }

    fn over(backend: Arc<FakeBackend>, tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        let mut cfg = ProviderConfig::new("192.0.2.7");
        tune(&mut cfg);
        let provider = CocoonProvider::new(backend.clone(), cfg);
        let events = Arc::new(RecordedEvents::default());
        provider.set_events(events.clone());
        let (n, pushes) = PodNotifier::channel();
        provider.notify_pods(n);
        Rig { backend, provider, pushes, events }
    }

    fn drain(&mut self) -> Vec<Pod> {
        let mut out = Vec::new();
        while let Ok(p) = self.pushes.try_recv() {
            out.push(p);
        }
        out
    }

    fn last(&mut self) -> Pod {
        self.drain().pop().expect("a push")
    }

    fn vm(&self, key: &str) -> VmInfo {
        self.provider.tracked_vm(key).expect("a tracked VM")
    }
}

fn pod(name: &str, pairs: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            uid: Some(format!("uid-{name}")),
            annotations: Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                image: Some("ubuntu-dev-base".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn run_pod(name: &str, vm: &str, extra: &[(&str, &str)]) -> Pod {
    let mut pairs = vec![(VM_NAME, vm), (MANAGED, "true"), (MODE, "run"), (IMAGE, "ubuntu-dev-base")];
    pairs.extend_from_slice(extra);
    pod(name, &pairs)
}

fn clone_pod(name: &str, vm: &str, image: &str) -> Pod {
    pod(name, &[(VM_NAME, vm), (MANAGED, "true"), (IMAGE, image)])
}

fn with_uid(mut p: Pod, uid: &str) -> Pod {
    p.metadata.uid = Some(uid.into());
    p
}

fn ann(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref().and_then(|a| a.get(key)).cloned()
}

fn phase(p: &Pod) -> String {
    p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

fn key(name: &str) -> String {
    format!("ns/{name}")
}

async fn create(r: &Rig, p: &Pod) -> Result<(), String> {
    r.provider.create_pod(p).await.map_err(|e| e.to_string())
}

async fn delete(r: &Rig, p: &Pod) -> Result<(), String> {
    r.provider.delete_pod(p).await.map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------- CreatePod

#[tokio::test(start_paused = true)]
async fn create_without_vm_name_fails_and_touches_nothing() {
    let r = Rig::new();
    let e = create(&r, &pod("a", &[(MANAGED, "true")])).await.unwrap_err();
    assert!(e.contains("vm.cocoonstack.io/name is missing"), "{e}");
    assert!(r.backend.calls().is_empty());
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
}

#[tokio::test(start_paused = true)]
async fn run_boots_the_image_and_pushes_running_with_annotations() {
    let mut r = Rig::new();
    let p = run_pod("a", "vm-a", &[]);
    create(&r, &p).await.unwrap();
    assert_eq!(r.backend.calls(), ["run vm-a ubuntu-dev-base 1x512"]);
    let pushes = r.drain();
    assert_eq!(phase(&pushes[0]), "Pending");
    assert_eq!(ann(&pushes[0], LIFECYCLE_STATE).as_deref(), Some("creating"), "creating is announced first");
    let last = pushes.last().unwrap();
    let vm = r.vm(&key("a"));
    assert_eq!(phase(last), "Running");
    assert!(ready(last), "the synchronous probe saw the agent");
    let st = last.status.as_ref().unwrap();
    assert_eq!(st.pod_ip, vm.ip);
    assert_eq!(st.host_ip.as_deref(), Some("192.0.2.7"));
    assert!(st.start_time.is_some());
    let cs = st.container_statuses.as_ref().unwrap();
    assert_eq!((cs.len(), cs[0].name.as_str()), (1, "agent"));
    assert_eq!(ann(last, VM_ID), Some(vm.id.clone()));
    assert_eq!(ann(last, VM_IP), vm.ip);
    assert_eq!(ann(last, LIFECYCLE_STATE).as_deref(), Some("ready"));
    assert_eq!(ann(last, LIFECYCLE_MESSAGE).as_deref(), Some(""), "cleared, not absent: pushes cannot remove");
    // GetPod answers the same view.
    let got = r.provider.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert_eq!(phase(&got), "Running");
    assert_eq!(r.provider.get_pods().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn run_uses_the_pod_resources() {
    let r = Rig::new();
    let mut p = run_pod("a", "vm-a", &[(STORAGE, "20Gi")]);
    let c = &mut p.spec.as_mut().unwrap().containers[0];
    c.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
        limits: Some([("cpu".to_string(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("3".into()))].into()),
        requests: Some(
            [("memory".to_string(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("2Gi".into()))].into(),
        ),
        ..Default::default()
    });
    create(&r, &p).await.unwrap();
    assert_eq!(r.backend.calls(), ["run vm-a ubuntu-dev-base 3x2048"]);
}

#[tokio::test(start_paused = true)]
async fn clone_is_the_default_takes_latest_and_configures_the_network() {
    let mut r = Rig::new();
    r.backend.add_snapshot(NS, &SnapshotRef::latest("golden"));
    create(&r, &clone_pod("b", "vm-b", "golden")).await.unwrap();
    let vm = r.vm(&key("b"));
    assert_eq!(r.backend.calls(), ["clone_vm vm-b golden:latest", &format!("configure_network {}", vm.id)]);
    assert_eq!(r.backend.source_of(&vm.id).as_deref(), Some("clone:golden:latest"));
    let last = r.last();
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("ready"));
    assert!(ready(&last));
    assert_eq!(r.events.reasons(), [events::POST_CLONE_SUCCEEDED]);
}

#[tokio::test(start_paused = true)]
async fn clone_of_a_missing_snapshot_fails_with_a_bring_up_warning() {
    let mut r = Rig::new();
    let e = create(&r, &clone_pod("b", "vm-b", "golden:v1")).await.unwrap_err();
    assert!(e.contains("snapshot golden:v1 is not in the image library"), "{e}");
    assert!(r.backend.vms().is_empty());
    assert_eq!(r.events.reasons(), [events::CREATE_BRING_UP_FAILED]);
    assert!(r.events.all()[0].warning);
    let last = r.last();
    assert_eq!(phase(&last), "Pending");
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert!(ann(&last, LIFECYCLE_MESSAGE).unwrap().contains("golden:v1"));
}

#[tokio::test(start_paused = true)]
async fn a_failed_run_is_returned_recorded_and_retried() {
    let mut r = Rig::new();
    r.backend.fail("run", 1);
    let p = run_pod("a", "vm-a", &[]);
    let e = create(&r, &p).await.unwrap_err();
    assert!(e.contains("bringing up VM vm-a (run of image ubuntu-dev-base)") && e.contains("injected"), "{e}");
    assert_eq!(r.events.reasons(), [events::CREATE_BRING_UP_FAILED]);
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none(), "nothing tracked: the runtime retries CreatePod");
    create(&r, &p).await.unwrap();
    let last = r.last();
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("ready"));
    assert_eq!(ann(&last, LIFECYCLE_MESSAGE).as_deref(), Some(""), "the failure message is cleared");
}

#[tokio::test(start_paused = true)]
async fn unmanaged_pods_are_only_tracked() {
    let mut r = Rig::new();
    let p = pod("u", &[(VM_NAME, "theirs"), (VM_ID, "ext-1"), (VM_IP, "10.9.9.9")]);
    create(&r, &p).await.unwrap();
    assert!(r.backend.calls().is_empty(), "no runtime call for an unmanaged pod");
    let last = r.last();
    assert_eq!(phase(&last), "Running");
    assert!(ready(&last), "no probe port: having an IP is Ready");
    assert_eq!(last.status.as_ref().unwrap().pod_ip.as_deref(), Some("10.9.9.9"));
    assert_eq!(ann(&last, LIFECYCLE_STATE), None, "an unmanaged pod's annotations are not ours");
    // Delete only forgets.
    delete(&r, &p).await.unwrap();
    assert!(r.backend.calls().is_empty());
    assert!(r.provider.get_pod(&PodKey::new("ns", "u")).is_none());
    // Without the pre-assigned IP: refused.
    let e = create(&r, &pod("v", &[(VM_NAME, "theirs2"), (VM_ID, "ext-2")])).await.unwrap_err();
    assert!(e.contains("vm.cocoonstack.io/ip"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn refusals_name_what_to_change() {
    let r = Rig::new();
    let e = create(&r, &run_pod("w", "vm-w", &[(OS, "windows")])).await.unwrap_err();
    assert!(e.contains("guest OS windows") && e.contains("unsupported on this node"), "{e}");
    let e = create(&r, &run_pod("c", "vm-c", &[(BACKEND, "cloud-hypervisor")])).await.unwrap_err();
    assert!(e.contains("hypervisor cloud-hypervisor is unsupported on this node (it runs: qemu)"), "{e}");
    let mut p = run_pod("k", "vm-k", &[]);
    p.spec.as_mut().unwrap().node_selector = Some([(CPU_CLASS_LABEL.to_string(), "skylake".to_string())].into());
    let e = create(&r, &p).await.unwrap_err();
    assert!(e.contains("snapshot CPU class \"skylake\""), "{e}");
    assert!(r.backend.calls().is_empty());
    // The node of that class accepts it.
    let r = Rig::tuned(|c| c.cpu_class = Some("skylake".into()));
    create(&r, &p).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_second_pod_naming_a_live_vm_adopts_it_instead_of_booting() {
    // The seed's documented constraint: no second VM, the second Pod shares the first's.
    let r = Rig::new();
    create(&r, &run_pod("a", "shared", &[])).await.unwrap();
    create(&r, &run_pod("b", "shared", &[])).await.unwrap();
    assert_eq!(r.backend.vms().len(), 1);
    assert_eq!(r.vm(&key("a")).id, r.vm(&key("b")).id);
}

#[tokio::test(start_paused = true)]
async fn a_failed_listing_fails_the_create_rather_than_boot_a_duplicate() {
    let r = Rig::new();
    r.backend.fail("list", u32::MAX);
    let e = create(&r, &run_pod("a", "vm-a", &[])).await.unwrap_err();
    assert!(e.contains("cannot be listed") && e.contains("vm-a"), "{e}");
    assert!(r.backend.vms().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_live_vm_with_the_name_is_adopted_not_booted() {
    // A VM whose create answer was lost (not in the start-up map): found by a fresh listing.
    let mut r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-a", VmState::Running);
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    assert!(r.backend.calls().is_empty(), "no run: {:?}", r.backend.calls());
    assert_eq!(r.vm(&key("a")).id, vm.id);
    assert_eq!(ann(&r.last(), VM_ID), Some(vm.id));
    assert!(r.events.reasons().is_empty(), "not a restart adoption");
}

#[tokio::test(start_paused = true)]
async fn adoption_from_the_start_up_map_by_id_then_name() {
    let mut r = Rig::new();
    let by_id = r.backend.add_vm(NS, "old-name", VmState::Running);
    let by_name = r.backend.add_vm(NS, "vm-b", VmState::Running);
    let a = run_pod("a", "vm-a", &[(VM_ID, &by_id.id), (LIFECYCLE_STATE, "ready")]);
    let b = run_pod("b", "vm-b", &[]);
    let report = r.provider.reconcile_startup(&[a.clone(), b.clone()]).await.unwrap();
    assert_eq!(report.adoptable.len(), 2);
    create(&r, &a).await.unwrap();
    create(&r, &b).await.unwrap();
    assert_eq!(r.vm(&key("a")).id, by_id.id);
    assert_eq!(r.vm(&key("b")).id, by_name.id);
    assert!(r.backend.calls().is_empty(), "{:?}", r.backend.calls());
    assert_eq!(r.events.reasons(), [events::RESUMED_AFTER_RESTART, events::RESUMED_AFTER_RESTART]);
    assert!(r.provider.adoptable().is_empty());
    assert!(r.drain().iter().any(|p| phase(p) == "Running"));
}

#[tokio::test(start_paused = true)]
async fn an_adopted_clone_that_never_got_its_network_gets_it_now() {
    let mut r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-c", VmState::Running);
    let p = pod("c", &[(VM_NAME, "vm-c"), (MANAGED, "true"), (IMAGE, "golden"), (LIFECYCLE_STATE, "creating")]);
    r.provider.reconcile_startup(std::slice::from_ref(&p)).await.unwrap();
    create(&r, &p).await.unwrap();
    assert_eq!(r.backend.calls(), [format!("configure_network {}", vm.id)]);
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("ready"));
}

#[tokio::test(start_paused = true)]
async fn a_stopped_vm_is_started_and_a_half_made_one_replaced() {
    let r = Rig::new();
    let stopped = r.backend.add_vm(NS, "vm-s", VmState::Stopped);
    create(&r, &run_pod("s", "vm-s", &[])).await.unwrap();
    assert_eq!(r.backend.calls(), [format!("start {}", stopped.id)]);
    assert_eq!(r.backend.vm(&stopped.id).unwrap().state, VmState::Running);

    r.backend.clear_calls();
    let half = r.backend.add_vm(NS, "vm-h", VmState::Creating);
    create(&r, &run_pod("h", "vm-h", &[])).await.unwrap();
    assert_eq!(
        r.backend.calls(),
        [format!("remove {}", half.id), format!("release_ip {}", half.id), "run vm-h ubuntu-dev-base 1x512".into()]
    );
    assert_ne!(r.vm(&key("h")).id, half.id);
}

#[tokio::test(start_paused = true)]
async fn a_stopped_vm_that_will_not_start_fails_the_adoption() {
    let mut r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-s", VmState::Stopped);
    let p = run_pod("s", "vm-s", &[]);
    r.provider.reconcile_startup(std::slice::from_ref(&p)).await.unwrap();
    r.backend.fail("start", 1);
    let e = create(&r, &p).await.unwrap_err();
    assert!(e.contains(&format!("starting the stopped VM {}", vm.id)), "{e}");
    assert_eq!(r.events.reasons(), [events::RESUME_START_FAILED]);
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert_eq!(r.provider.adoptable().len(), 1, "kept for the retry");
    create(&r, &p).await.unwrap();
    assert_eq!(r.vm(&key("s")).id, vm.id);
}

#[tokio::test(start_paused = true)]
async fn post_clone_exhaustion_leaves_a_hint_and_a_failed_lifecycle() {
    let mut r = Rig::new();
    r.backend.add_snapshot(NS, &SnapshotRef::latest("golden"));
    r.backend.fail("configure_network", u32::MAX);
    let started = tokio::time::Instant::now();
    create(&r, &clone_pod("b", "vm-b", "golden")).await.unwrap();
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(177) && took <= Duration::from_secs(180), "{took:?}");
    let attempts = r.backend.calls().iter().filter(|c| c.starts_with("configure_network")).count();
    assert_eq!(attempts, 61, "every 3 s from 0 s to 180 s");
    let last = r.last();
    assert_eq!(phase(&last), "Running", "the VM runs; it is just not ready");
    assert!(!ready(&last));
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert!(ann(&last, LIFECYCLE_MESSAGE).unwrap().contains("could not be configured"));
    let hint = ann(&last, POST_CLONE_HINT).unwrap();
    let hint = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(hint).unwrap()).unwrap();
    assert!(hint.contains("net-config"), "{hint}");
    assert_eq!(r.events.reasons(), [events::POST_CLONE_EXEC_EXHAUSTED]);
}

// ---------------------------------------------------------------------- probes

#[tokio::test(start_paused = true)]
async fn readiness_follows_the_agent_probe() {
    let mut r = Rig::new();
    let p = run_pod("a", "vm-a", &[]);
    create(&r, &p).await.unwrap();
    assert!(ready(&r.last()));
    let id = r.vm(&key("a")).id;
    r.backend.set_agent(&id, false);
    // Two failures (5 s apart) are tolerated.
    tokio::time::sleep(Duration::from_millis(10_100)).await;
    assert!(r.drain().is_empty());
    // The third flips Ready off.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let p1 = r.drain();
    assert_eq!(p1.len(), 1);
    assert!(!ready(&p1[0]) && phase(&p1[0]) == "Running");
    let c = &p1[0].status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0];
    assert!(c.state.as_ref().unwrap().running.is_some(), "still running: a delete must reach DeletePod");
    // Back to the fast schedule: seen within the 100 ms ×1.5 backoff.
    r.backend.set_agent(&id, true);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let p2 = r.drain();
    assert_eq!(p2.len(), 1);
    assert!(ready(&p2[0]));
}

#[tokio::test(start_paused = true)]
async fn a_slow_agent_becomes_ready_on_the_backoff_schedule() {
    let mut r = Rig::new();
    r.backend.fail("probe_agent", 4); // t=0 (synchronous), 100 ms, 250 ms, 475 ms
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    let first = r.drain();
    assert!(!ready(first.last().unwrap()), "Running but not Ready yet");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(r.drain().is_empty());
    tokio::time::sleep(Duration::from_millis(200)).await; // 812 ms: the fifth probe succeeds
    let p = r.drain();
    assert_eq!(p.len(), 1);
    assert!(ready(&p[0]));
}

#[tokio::test]
async fn a_probe_port_is_dialled() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let mut r = Rig::tuned(|c| {
        c.probe_ready_interval = Duration::from_millis(20);
        c.probe_initial = Duration::from_millis(10);
    });
    let p = pod("u", &[(VM_NAME, "theirs"), (VM_ID, "ext-1"), (VM_IP, "127.0.0.1"), (PROBE_PORT, &port)]);
    create(&r, &p).await.unwrap();
    assert!(ready(&r.last()), "the port accepts");
    drop(listener);
    let mut flipped = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Some(p) = r.drain().pop() {
            flipped = Some(p);
            break;
        }
    }
    assert!(!ready(&flipped.expect("Ready flipped off after the port closed")));
}

// ---------------------------------------------------------------------- DeletePod

#[tokio::test(start_paused = true)]
async fn delete_with_policy_always_leaves_a_snapshot_a_later_clone_boots_from() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.backend.clear_calls();
    delete(&r, &a).await.unwrap();
    assert_eq!(
        r.backend.calls(),
        [format!("snapshot_save {id} vm-a:latest"), format!("remove {id}"), format!("release_ip {id}")]
    );
    assert!(r.backend.vms().is_empty() && r.backend.leases().is_empty());
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-a")), "the snapshot survives the delete");
    // A later clone boots from it.
    create(&r, &clone_pod("b", "vm-b", "vm-a")).await.unwrap();
    let b = r.vm(&key("b"));
    assert_eq!(r.backend.source_of(&b.id).as_deref(), Some("clone:vm-a:latest"));
}

#[tokio::test(start_paused = true)]
async fn a_failed_snapshot_keeps_the_vm_and_the_delete_is_retried() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.backend.fail("snapshot_save", 1);
    let e = delete(&r, &a).await.unwrap_err();
    assert!(e.contains("saving snapshot vm-a:latest") && e.contains("the VM is kept"), "{e}");
    assert!(r.backend.vm(&id).is_some(), "the VM is kept");
    assert!(r.provider.tracked_vm(&key("a")).is_some(), "and still tracked");
    delete(&r, &a).await.unwrap();
    assert!(r.backend.vm(&id).is_none());
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-a")));
}

#[tokio::test(start_paused = true)]
async fn a_failed_remove_keeps_the_entry_and_a_gone_vm_is_fine() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[(SNAPSHOT_POLICY, "never")]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.backend.fail("remove", 1);
    let e = delete(&r, &a).await.unwrap_err();
    assert!(e.contains(&format!("removing VM {id}")), "{e}");
    assert!(r.provider.tracked_vm(&key("a")).is_some());
    // Meanwhile the VM vanished: removing an absent VM is success.
    r.backend.vanish(&id);
    delete(&r, &a).await.unwrap();
    assert!(r.provider.tracked_vm(&key("a")).is_none());
    assert!(r.backend.leases().is_empty());
}

#[tokio::test(start_paused = true)]
async fn policy_never_saves_nothing_and_drops_a_stale_snapshot_unless_kept() {
    let r = Rig::new();
    r.backend.add_snapshot(NS, &SnapshotRef::latest("vm-a"));
    let a = run_pod("a", "vm-a", &[(SNAPSHOT_POLICY, "never")]);
    create(&r, &a).await.unwrap();
    delete(&r, &a).await.unwrap();
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("snapshot_save")));
    assert!(r.backend.calls().contains(&"snapshot_rm vm-a:latest".to_string()));
    assert!(r.backend.snapshots().is_empty());

    r.backend.add_snapshot(NS, &SnapshotRef::latest("vm-k"));
    let k = run_pod("k", "vm-k", &[(SNAPSHOT_POLICY, "never"), (KEEP_SNAPSHOT_ON_DELETE, "true")]);
    create(&r, &k).await.unwrap();
    delete(&r, &k).await.unwrap();
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-k")), "kept on request");
}

#[tokio::test(start_paused = true)]
async fn main_only_snapshots_the_main_agent_only() {
    let r = Rig::new();
    let member = |name: &str, vm: &str| {
        let mut p = run_pod(name, vm, &[(SNAPSHOT_POLICY, "main-only")]);
        p.metadata.owner_references = Some(vec![OwnerReference {
            kind: "CocoonSet".into(),
            name: "set".into(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
        p
    };
    let main = member("m", "vk-ns-set-0");
    let sub = member("s", "vk-ns-set-1");
    create(&r, &main).await.unwrap();
    create(&r, &sub).await.unwrap();
    delete(&r, &main).await.unwrap();
    delete(&r, &sub).await.unwrap();
    let snaps = r.backend.snapshots();
    assert!(snaps.contains_key(&SnapshotRef::latest("vk-ns-set-0")));
    assert!(!snaps.contains_key(&SnapshotRef::latest("vk-ns-set-1")));
}

#[tokio::test(start_paused = true)]
async fn a_stopped_vm_is_removed_without_a_snapshot() {
    let r = Rig::new();
    r.backend.add_snapshot(NS, &SnapshotRef::latest("vm-a"));
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.backend.set_state(&id, VmState::Stopped);
    delete(&r, &a).await.unwrap();
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("snapshot_save")));
    assert!(r.backend.vm(&id).is_none());
    // The policy wanted a snapshot: the one from an earlier life is kept, not dropped.
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("snapshot_rm")));
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-a")));
}

#[tokio::test(start_paused = true)]
async fn a_delete_after_a_restart_removes_the_vm_found_at_start_up() {
    let r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-a", VmState::Running);
    let mut a = run_pod("a", "vm-a", &[(VM_ID, &vm.id)]);
    a.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
    r.provider.reconcile_startup(std::slice::from_ref(&a)).await.unwrap();
    delete(&r, &a).await.unwrap();
    assert!(r.backend.vm(&vm.id).is_none());
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-a")));
    assert!(r.provider.adoptable().is_empty());
    // A pod whose VM is already gone: only its lease is released.
    r.backend.clear_calls();
    delete(&r, &run_pod("z", "vm-z", &[(VM_ID, "vm-404")])).await.unwrap();
    assert_eq!(r.backend.calls(), ["release_ip vm-404"]);
}

#[tokio::test(start_paused = true)]
async fn a_delete_for_another_pod_generation_is_ignored() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.backend.clear_calls();
    delete(&r, &with_uid(a, "older")).await.unwrap();
    assert!(r.backend.calls().is_empty());
    assert!(r.provider.tracked_vm(&key("a")).is_some());
}

// ---------------------------------------------------------------------- UpdatePod

#[tokio::test(start_paused = true)]
async fn update_stores_and_answers_hibernate_once() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.drain();
    r.provider.update_pod(&a).await.unwrap();
    assert!(r.drain().is_empty(), "a plain resync pushes nothing");
    let h = run_pod("a", "vm-a", &[(HIBERNATE, "true")]);
    r.provider.update_pod(&h).await.unwrap();
    r.provider.update_pod(&h).await.unwrap();
    assert_eq!(r.events.reasons(), [events::HIBERNATE_UNSUPPORTED]);
    let p = r.drain();
    assert_eq!(p.len(), 1);
    assert!(ann(&p[0], LIFECYCLE_MESSAGE).unwrap().contains("not supported"));
    assert_eq!(ann(&p[0], LIFECYCLE_STATE).as_deref(), Some("ready"), "the VM keeps running");
    assert!(r.backend.vms().len() == 1 && r.backend.calls().len() == 1);
}

#[tokio::test(start_paused = true)]
async fn a_new_pod_under_the_key_takes_over_or_retires_the_vm() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let first = r.vm(&key("a")).id;
    // Same VM name: the new pod adopts the VM (through UpdatePod, as the runtime calls it).
    r.provider.update_pod(&with_uid(a.clone(), "uid-2")).await.unwrap();
    assert_eq!(r.vm(&key("a")).id, first);
    assert_eq!(r.backend.vms().len(), 1);
    assert!(r.events.reasons().is_empty(), "a hand-over is not a restart: {:?}", r.events.reasons());
    // Another VM name: the old VM is deleted like a DeletePod (snapshot, remove), a new one runs.
    let b = with_uid(run_pod("a", "vm-b", &[]), "uid-3");
    r.provider.update_pod(&b).await.unwrap();
    let vms = r.backend.vms();
    assert_eq!(vms.len(), 1);
    assert_eq!(vms[0].name, "vm-b");
    assert!(r.backend.snapshots().contains_key(&SnapshotRef::latest("vm-a")));
}

// ---------------------------------------------------------------------- VM watcher

#[tokio::test(start_paused = true)]
async fn a_dead_vm_is_restarted_then_evicted_within_the_cooldown() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.drain();
    r.backend.set_state(&id, VmState::Stopped);
    r.provider.watch_once().await;
    assert!(r.backend.calls().contains(&format!("start {id}")));
    assert_eq!(r.events.reasons(), [events::VM_RESTARTED]);
    let p = r.last();
    assert!(phase(&p) == "Running" && !ready(&p), "Ready off until the probe sees the agent");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(ready(&r.last()), "the probe saw it come back");
    // It dies again 10 s later: within the 30 s cooldown → removed and evicted.
    tokio::time::sleep(Duration::from_secs(10)).await;
    r.backend.set_state(&id, VmState::Stopped);
    r.provider.watch_once().await;
    assert!(r.backend.vm(&id).is_none());
    assert!(r.backend.leases().is_empty());
    let p = r.last();
    assert_eq!(phase(&p), "Failed");
    let st = p.status.as_ref().unwrap();
    assert_eq!(st.reason.as_deref(), Some(events::RESTART_COOLDOWN));
    let t = st.container_statuses.as_ref().unwrap()[0].state.as_ref().unwrap().terminated.clone().unwrap();
    assert_eq!((t.exit_code, t.reason.as_deref()), (1, Some(events::RESTART_COOLDOWN)));
    assert_eq!(r.events.reasons().last().map(String::as_str), Some(events::RESTART_COOLDOWN));
    // Failed is terminal: a resync re-pushes it and boots nothing; a delete only forgets.
    r.provider.update_pod(&a).await.unwrap();
    assert_eq!(phase(&r.last()), "Failed");
    r.backend.clear_calls();
    delete(&r, &a).await.unwrap();
    assert!(r.backend.calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_restart_after_the_cooldown_is_allowed() {
    let mut r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    r.drain();
    let id = r.vm(&key("a")).id;
    r.backend.set_state(&id, VmState::Stopped);
    r.provider.watch_once().await;
    tokio::time::sleep(Duration::from_secs(31)).await;
    r.backend.set_state(&id, VmState::Stopped);
    r.provider.watch_once().await;
    assert_eq!(r.backend.calls().iter().filter(|c| c.starts_with("start")).count(), 2);
    assert_eq!(r.backend.vm(&id).unwrap().state, VmState::Running);
    assert!(r.drain().iter().all(|p| phase(p) == "Running"));
}

#[tokio::test(start_paused = true)]
async fn a_vanished_vm_evicts_with_vm_gone_and_a_failed_start_with_restart_failed() {
    let mut r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    create(&r, &run_pod("b", "vm-b", &[])).await.unwrap();
    let (a, b) = (r.vm(&key("a")).id, r.vm(&key("b")).id);
    r.drain();
    r.backend.vanish(&a);
    r.backend.set_state(&b, VmState::Stopped);
    r.backend.fail("start", 1);
    r.provider.watch_once().await;
    let pushes = r.drain();
    let reason_of = |name: &str| {
        pushes
            .iter()
            .rfind(|p| p.metadata.name.as_deref() == Some(name))
            .and_then(|p| p.status.as_ref().and_then(|s| s.reason.clone()))
    };
    assert_eq!(reason_of("a").as_deref(), Some(events::VM_GONE));
    assert_eq!(reason_of("b").as_deref(), Some(events::RESTART_FAILED));
    assert!(r.backend.vms().is_empty() && r.backend.leases().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_watcher_never_reads_a_failed_listing_as_empty() {
    let mut r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    r.drain();
    r.backend.fail("list", 1);
    r.provider.watch_once().await;
    assert!(r.drain().is_empty());
    assert!(r.backend.calls().iter().all(|c| !c.starts_with("remove")));
    // An unlisted VM whose inspect fails is left for the next pass.
    let id = r.vm(&key("a")).id;
    r.backend.vanish(&id);
    r.backend.fail("inspect", 1);
    r.provider.watch_once().await;
    assert!(r.drain().is_empty());
    r.provider.watch_once().await;
    assert_eq!(phase(&r.last()), "Failed");
}

#[tokio::test(start_paused = true)]
async fn the_spawned_watcher_runs_on_its_period() {
    let mut r = Rig::tuned(|c| c.watch_interval = Duration::from_secs(2));
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    let id = r.vm(&key("a")).id;
    let _w = r.provider.spawn_watcher();
    r.backend.vanish(&id);
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    assert_eq!(phase(&r.last()), "Failed");
}

// ---------------------------------------------------------------------- reconcile

#[tokio::test(start_paused = true)]
async fn reconcile_adopts_referenced_vms_and_destroys_orphans() {
    let r = Rig::new();
    let by_id = r.backend.add_vm(NS, "renamed", VmState::Running);
    let by_name = r.backend.add_vm(NS, "vm-b", VmState::Stopped);
    let orphan = r.backend.add_vm(NS, "nobody", VmState::Running);
    let half = r.backend.add_vm(NS, "vm-c", VmState::Creating);
    let of_failed = r.backend.add_vm(NS, "vm-f", VmState::Running);
    let mut failed = run_pod("f", "vm-f", &[]);
    failed.status = Some(k8s_openapi::api::core::v1::PodStatus { phase: Some("Failed".into()), ..Default::default() });
    let pods =
        [run_pod("a", "vm-a", &[(VM_ID, &by_id.id)]), run_pod("b", "vm-b", &[]), run_pod("c", "vm-c", &[]), failed];
    let report = r.provider.reconcile_startup(&pods).await.unwrap();
    let mut adoptable = report.adoptable.clone();
    adoptable.sort();
    assert_eq!(adoptable, [by_id.id.clone(), by_name.id.clone()]);
    assert_eq!(report.stale_removed, std::slice::from_ref(&half.id));
    let mut destroyed = report.orphans_destroyed.clone();
    destroyed.sort();
    assert_eq!(destroyed, [orphan.id.clone(), of_failed.id.clone()], "a Failed pod references nothing");
    assert!(report.orphans_left.is_empty());
    let left: Vec<String> = r.backend.vms().into_iter().map(|v| v.id).collect();
    assert_eq!(left, [by_id.id, by_name.id]);
    for gone in [&orphan.id, &half.id, &of_failed.id] {
        assert!(!r.backend.leases().contains(gone), "{gone}'s lease released");
    }
}

#[tokio::test(start_paused = true)]
async fn orphan_policies_alert_and_keep_leave_the_vm() {
    for policy in [OrphanPolicy::Alert, OrphanPolicy::Keep] {
        let r = Rig::tuned(|c| c.orphan_policy = policy);
        let orphan = r.backend.add_vm(NS, "nobody", VmState::Running);
        let report = r.provider.reconcile_startup(&[]).await.unwrap();
        assert_eq!(report.orphans_left, std::slice::from_ref(&orphan.id), "{policy:?}");
        assert!(r.backend.vm(&orphan.id).is_some(), "{policy:?}");
        assert!(r.backend.calls().is_empty(), "{policy:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn reconcile_fails_when_the_vms_cannot_be_listed() {
    let r = Rig::new();
    r.backend.add_vm(NS, "nobody", VmState::Running);
    r.backend.fail("list", 1);
    let e = r.provider.reconcile_startup(&[]).await.unwrap_err();
    assert!(error_chain(&e).contains("cannot be listed"), "{e}");
    assert_eq!(r.backend.vms().len(), 1, "nothing destroyed on a failed listing");
}

#[tokio::test(start_paused = true)]
async fn a_crashed_provider_leaves_vms_running_and_the_next_one_readopts_them() {
    let backend = Arc::new(FakeBackend::new());
    let mut first = Rig::over(backend.clone(), |_| {});
    create(&first, &run_pod("a", "vm-a", &[])).await.unwrap();
    let vm = first.vm(&key("a"));
    // The API's copy of the pod carries what the first provider pushed.
    let api_pod = first.last();
    drop(first); // "kill -9": no DeletePod, no cleanup
    assert_eq!(backend.vm(&vm.id).map(|v| v.state), Some(VmState::Running));
    backend.clear_calls();

    let mut second = Rig::over(backend.clone(), |_| {});
    second.provider.reconcile_startup(std::slice::from_ref(&api_pod)).await.unwrap();
    create(&second, &api_pod).await.unwrap();
    assert_eq!(second.vm(&key("a")).id, vm.id);
    assert!(backend.calls().is_empty(), "no VM booted or removed: {:?}", backend.calls());
    let p = second.last();
    assert!(phase(&p) == "Running" && ready(&p));
    assert_eq!(p.status.as_ref().unwrap().start_time, api_pod.status.as_ref().unwrap().start_time, "start time kept");
    assert_eq!(second.events.reasons(), [events::RESUMED_AFTER_RESTART]);
}

// ---------------------------------------------------------------------- namespaces

/// `p` moved to namespace `ns`.
fn in_ns(mut p: Pod, ns: &str) -> Pod {
    p.metadata.namespace = Some(ns.into());
    p
}

/// A node where `ns` and `team-b` share.
fn sharing() -> Rig {
    Rig::tuned(|c| c.namespaces = NamespacePolicy::parse(Some("ns,team-b"), None).unwrap())
}

/// The refusal is Kubernetes-visible (error, Warning event, lifecycle message), names the rule
/// and the key that allows sharing, and does not name the other namespace.
fn assert_refused(r: &mut Rig, e: &str, pod: &str, owner: &str) {
    assert!(e.contains("belongs to another namespace") && e.contains("VK_SHARED_NAMESPACES"), "{e}");
    assert!(!e.contains(owner), "the owner {owner} leaks into {e}");
    let ev =
        r.events.all().into_iter().rfind(|e| e.reason == events::NAMESPACE_REFUSED).expect("a NamespaceRefused event");
    assert!(ev.warning && ev.pod == pod && ev.message.contains("VK_SHARED_NAMESPACES"), "{ev:?}");
    let last = r.last();
    assert_eq!(phase(&last), "Pending");
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert!(ann(&last, LIFECYCLE_MESSAGE).unwrap().contains("own namespace"));
}

#[tokio::test(start_paused = true)]
async fn a_pod_cannot_adopt_another_namespaces_live_vm_by_name() {
    let mut r = Rig::new();
    create(&r, &run_pod("a", "shared", &[])).await.unwrap();
    let a = r.vm(&key("a"));
    r.backend.clear_calls();
    let b = in_ns(run_pod("b", "shared", &[]), "team-b");
    let e = create(&r, &b).await.unwrap_err();
    assert!(e.contains("VM shared belongs to another namespace") && e.contains("may not adopt"), "{e}");
    assert_refused(&mut r, &e, "team-b/b", "ns/");
    assert!(r.backend.calls().is_empty(), "nothing booted or touched: {:?}", r.backend.calls());
    assert!(r.provider.tracked_vm("team-b/b").is_none());
    assert_eq!(r.backend.vm(&a.id).map(|v| v.state), Some(VmState::Running));
    // Deleting the refused Pod leaves the other namespace's VM alone.
    delete(&r, &b).await.unwrap();
    assert!(r.backend.vm(&a.id).is_some());
    // Within one namespace the seed's same-name adoption still works.
    create(&r, &run_pod("c", "shared", &[])).await.unwrap();
    assert_eq!(r.vm(&key("c")).id, a.id);
    assert!(r.events.reasons().contains(&events::VM_NAME_SHARED.to_string()));
}

#[tokio::test(start_paused = true)]
async fn sharing_namespaces_adopt_each_others_vms_and_others_still_cannot() {
    let mut r = sharing();
    create(&r, &run_pod("a", "shared", &[])).await.unwrap();
    create(&r, &in_ns(run_pod("b", "shared", &[]), "team-b")).await.unwrap();
    assert_eq!(r.vm(&key("a")).id, r.vm("team-b/b").id, "team-b shares with ns");
    let e = create(&r, &in_ns(run_pod("c", "shared", &[]), "team-c")).await.unwrap_err();
    assert_refused(&mut r, &e, "team-c/c", "team-b");
}

#[tokio::test(start_paused = true)]
async fn a_vm_found_at_start_up_is_adopted_only_by_its_namespace() {
    let mut r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-a", VmState::Running);
    // An attacker's Pod names the VM by id (annotations are the Pod author's to write) and by name.
    let by_id = in_ns(run_pod("x", "mine", &[(VM_ID, &vm.id)]), "team-b");
    let by_name = in_ns(run_pod("y", "vm-a", &[]), "team-b");
    let owner = run_pod("a", "vm-a", &[(VM_ID, &vm.id)]);
    let report = r.provider.reconcile_startup(&[by_id.clone(), by_name.clone(), owner.clone()]).await.unwrap();
    assert_eq!(report.adoptable, std::slice::from_ref(&vm.id));
    let e = create(&r, &by_id).await.unwrap_err();
    assert!(e.contains(&format!("VM {} belongs to another namespace", vm.id)), "{e}");
    assert_refused(&mut r, &e, "team-b/x", "ns/");
    let e = create(&r, &by_name).await.unwrap_err();
    assert_refused(&mut r, &e, "team-b/y", "ns/");
    assert_eq!(r.provider.adoptable().len(), 1, "still waiting for its own pod");
    assert!(r.backend.calls().is_empty(), "{:?}", r.backend.calls());
    create(&r, &owner).await.unwrap();
    assert_eq!(r.vm(&key("a")).id, vm.id);
}

#[tokio::test(start_paused = true)]
async fn a_pod_cannot_delete_another_namespaces_vm_after_a_restart() {
    let r = Rig::new();
    let vm = r.backend.add_vm(NS, "vm-a", VmState::Running);
    let attacker = in_ns(run_pod("x", "vm-a", &[(VM_ID, &vm.id)]), "team-b");
    r.provider.reconcile_startup(std::slice::from_ref(&attacker)).await.unwrap();
    delete(&r, &attacker).await.unwrap();
    assert!(r.backend.calls().is_empty(), "nothing removed, saved or released: {:?}", r.backend.calls());
    assert_eq!(r.backend.vm(&vm.id).map(|v| v.state), Some(VmState::Running));
    assert_eq!(r.provider.adoptable().len(), 1);
    let ev = r.events.all().pop().unwrap();
    assert_eq!((ev.reason.as_str(), ev.pod.as_str()), (events::NAMESPACE_REFUSED, "team-b/x"));
    assert!(ev.message.contains("may not delete") && ev.message.contains("VK_SHARED_NAMESPACES"), "{}", ev.message);
    // Its own namespace's Pod deletes it.
    delete(&r, &run_pod("a", "vm-a", &[(VM_ID, &vm.id)])).await.unwrap();
    assert!(r.backend.vm(&vm.id).is_none());
    assert_eq!(r.backend.snapshot_namespace(&SnapshotRef::latest("vm-a")).as_deref(), Some("ns"));
}

#[tokio::test(start_paused = true)]
async fn clones_need_a_snapshot_of_the_pods_namespace_or_a_sharing_one() {
    let mut r = Rig::new();
    r.backend.add_snapshot(Some("golden"), &SnapshotRef::latest("golden"));
    let e = create(&r, &clone_pod("b", "vm-b", "golden")).await.unwrap_err();
    assert!(e.contains("snapshot golden:latest belongs to another namespace") && e.contains("may not clone"), "{e}");
    assert_refused(&mut r, &e, "ns/b", "golden namespace");
    assert!(r.backend.vms().is_empty() && r.backend.calls().is_empty());
    // Allowed once golden and ns share.
    let r = Rig::tuned(|c| c.namespaces = NamespacePolicy::parse(Some("golden,ns"), None).unwrap());
    r.backend.add_snapshot(Some("golden"), &SnapshotRef::latest("golden"));
    create(&r, &clone_pod("b", "vm-b", "golden")).await.unwrap();
    let vm = r.vm(&key("b"));
    assert_eq!(vm.namespace.as_deref(), Some("ns"), "the clone belongs to the pod's namespace");
}

#[tokio::test(start_paused = true)]
async fn a_name_whose_saved_state_is_another_namespaces_is_refused() {
    // team-b's delete would save or drop vm-a:latest, which is ns's.
    let mut r = Rig::new();
    r.backend.add_snapshot(NS, &SnapshotRef::latest("vm-a"));
    let e = create(&r, &in_ns(run_pod("b", "vm-a", &[]), "team-b")).await.unwrap_err();
    assert!(
        e.contains("the name vm-a (its snapshot vm-a:latest exists)") && e.contains("may not reuse the name"),
        "{e}"
    );
    assert_refused(&mut r, &e, "team-b/b", "ns/");
    assert!(r.backend.vms().is_empty());
    // Its own namespace boots under the name.
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_delete_never_overwrites_or_drops_another_namespaces_snapshot() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    // Meanwhile another namespace's snapshot took the name (e.g. `chrysalis snapshot save --namespace`).
    r.backend.add_snapshot(Some("team-b"), &SnapshotRef::latest("vm-a"));
    r.backend.clear_calls();
    let e = delete(&r, &a).await.unwrap_err();
    assert!(
        e.contains("snapshot vm-a:latest belongs to another namespace") && e.contains("snapshot-policy: never"),
        "{e}"
    );
    assert!(r.backend.calls().is_empty(), "{:?}", r.backend.calls());
    assert!(r.backend.vm(&id).is_some() && r.provider.tracked_vm(&key("a")).is_some(), "the VM is kept");
    assert_eq!(r.events.reasons().last().map(String::as_str), Some(events::NAMESPACE_REFUSED));
    // The pod's author switches to `never`: the VM goes, the other namespace's snapshot stays.
    let never = run_pod("a", "vm-a", &[(SNAPSHOT_POLICY, "never")]);
    r.provider.update_pod(&never).await.unwrap();
    delete(&r, &never).await.unwrap();
    assert!(r.backend.vm(&id).is_none());
    assert_eq!(r.backend.snapshot_namespace(&SnapshotRef::latest("vm-a")).as_deref(), Some("team-b"));
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("snapshot_")), "{:?}", r.backend.calls());
}

#[tokio::test(start_paused = true)]
async fn snapshots_record_the_vms_owner_even_when_a_sharing_pod_deletes_it() {
    let r = sharing();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    let b = in_ns(run_pod("b", "vm-a", &[]), "team-b");
    create(&r, &b).await.unwrap();
    assert_eq!(r.vm("team-b/b").namespace.as_deref(), Some("ns"));
    delete(&r, &b).await.unwrap();
    assert_eq!(r.backend.snapshot_namespace(&SnapshotRef::latest("vm-a")).as_deref(), Some("ns"));
}

#[tokio::test(start_paused = true)]
async fn records_without_a_namespace_belong_to_the_legacy_namespace() {
    // A VM and a snapshot from before namespaces were recorded.
    let mut r = Rig::new();
    let old = r.backend.add_vm(None, "old-vm", VmState::Running);
    r.backend.add_snapshot(None, &SnapshotRef::latest("old-snap"));
    let pods = [run_pod("a", "old-vm", &[(VM_ID, &old.id)]), in_ns(run_pod("d", "old-vm", &[]), "default")];
    // Referenced only by a pod that may not use it, it would still not be destroyed.
    let report = r.provider.reconcile_startup(&pods[..1]).await.unwrap();
    assert_eq!(report.adoptable, std::slice::from_ref(&old.id));
    assert!(report.orphans_destroyed.is_empty());
    let e = create(&r, &pods[0]).await.unwrap_err();
    assert!(e.contains("recorded without a namespace") && e.contains("VK_LEGACY_NAMESPACE"), "{e}");
    assert_refused(&mut r, &e, "ns/a", "default/");
    let e = create(&r, &clone_pod("c", "vm-c", "old-snap")).await.unwrap_err();
    assert!(e.contains("recorded without a namespace"), "{e}");
    // `default` owns them.
    create(&r, &pods[1]).await.unwrap();
    assert_eq!(r.vm("default/d").id, old.id);
    create(&r, &in_ns(clone_pod("c", "vm-c", "old-snap"), "default")).await.unwrap();
    // VK_LEGACY_NAMESPACE names another owner.
    let r = Rig::tuned(|c| c.namespaces = NamespacePolicy::parse(None, Some("ns")).unwrap());
    r.backend.add_snapshot(None, &SnapshotRef::latest("old-snap"));
    create(&r, &clone_pod("c", "vm-c", "old-snap")).await.unwrap();
}

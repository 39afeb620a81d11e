//! CreatePod (run, clone, unmanaged, adoption, post-clone) and the readiness probes.

use super::*;

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
    assert_eq!(ann(last, LIFECYCLE_MESSAGE), None);
    assert_eq!(
        ann(last, vnode::pod_status::REMOVE_ANNOTATIONS).as_deref(),
        Some(LIFECYCLE_MESSAGE),
        "removed from the API Pod, as upstream"
    );
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
    assert_eq!(ann(&last, LIFECYCLE_MESSAGE), None, "the failure message is removed");
    assert_eq!(ann(&last, vnode::pod_status::REMOVE_ANNOTATIONS).as_deref(), Some(LIFECYCLE_MESSAGE));
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
    let e = create(&r, &run_pod("b", "vm-b", &[(BACKEND, "kvm")])).await.unwrap_err();
    assert!(e.contains("expected cloud-hypervisor, firecracker or qemu"), "{e}");
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

#[tokio::test(start_paused = true)]
async fn a_backend_this_node_lacks_is_served_by_its_own_with_an_event() {
    // The fake runs QEMU only, as this TCG host does.
    for asked in ["cloud-hypervisor", "firecracker"] {
        let r = Rig::new();
        create(&r, &run_pod("c", "vm-c", &[(BACKEND, asked)])).await.unwrap();
        assert_eq!(r.backend.calls(), ["run vm-c ubuntu-dev-base 1x512"], "{asked}");
        assert_eq!(r.vm("ns/c").hypervisor, crate::backend::Hypervisor::Qemu);
        let ev = r.events.all();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!((ev[0].reason.as_str(), ev[0].warning), (events::BACKEND_SUBSTITUTED, false));
        assert!(ev[0].message.contains(&format!("backend {asked} was asked for; the VM runs under qemu")), "{ev:?}");
    }
    // Named and present: no event.
    let r = Rig::new();
    create(&r, &run_pod("q", "vm-q", &[(BACKEND, "qemu")])).await.unwrap();
    assert!(r.events.all().is_empty());
}

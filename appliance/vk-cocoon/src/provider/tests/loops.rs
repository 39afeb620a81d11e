//! The VM watcher and the start-up reconcile.

use super::*;

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
    // Evicted as upstream does: the push deletes the Pod (now, no grace), so its owner makes a
    // new one.
    assert!(p.metadata.deletion_timestamp.is_some(), "the evicting push does not delete the pod");
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(0));
    // Failed is terminal: a resync re-pushes it (still deleting) and boots nothing; a delete
    // only forgets.
    r.provider.update_pod(&a).await.unwrap();
    let p = r.last();
    assert_eq!(phase(&p), "Failed");
    assert!(p.metadata.deletion_timestamp.is_some());
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
    assert!(pushes.iter().filter(|p| phase(p) == "Failed").all(|p| p.metadata.deletion_timestamp.is_some()));
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

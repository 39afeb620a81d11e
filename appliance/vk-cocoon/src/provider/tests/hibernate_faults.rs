//! Hibernate and wake when something fails or lies: a failed or crashed wake keeps the
//! address its guest carries, a Pod's `vm.cocoonstack.io/id` never names a lease to release, a
//! failed remove keeps the only copy of the VM, the `CocoonHibernation` loop backs off, and a
//! hibernate never saves a fresh guest over `<vm-name>:hibernate`.

use std::collections::BTreeMap;

use super::hibernate::hibernating;
use super::*;
use crate::provider::hibernate::hibernation_of;

fn saves(r: &Rig) -> usize {
    r.backend.calls().iter().filter(|c| c.starts_with("snapshot_save")).count()
}

fn released(r: &Rig, id: &str) -> bool {
    r.backend.calls().iter().any(|c| c == &format!("release_ip {id}"))
}

fn in_namespace(mut p: Pod, ns: &str) -> Pod {
    p.metadata.namespace = Some(ns.into());
    p
}

// ------------------------------------------------------------------- 1. the wake's lease

#[tokio::test(start_paused = true)]
async fn a_failed_wake_keeps_the_lease_and_the_retry_comes_back_with_the_same_address() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let before = r.vm(&key("a"));
    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    r.backend.fail("clone_vm", 1);
    assert!(r.provider.update_pod(&a).await.is_err(), "the first wake fails");
    assert_eq!(r.events.reasons().last().map(String::as_str), Some(events::WAKE_CLONE_FAILED));
    assert!(r.backend.leases().contains(&before.id), "the lease stays for the retry");
    r.provider.update_pod(&a).await.unwrap();
    let woken = r.vm(&key("a"));
    assert_eq!((woken.id, woken.ip), (before.id.clone(), before.ip.clone()), "the guest's address is its lease's");
    assert_eq!(ann(&r.last(), VM_IP), before.ip);
    assert!(!released(&r, &before.id), "{:?}", r.backend.calls());
}

#[tokio::test(start_paused = true)]
async fn a_wake_cut_short_by_a_crash_keeps_its_lease_at_start_up() {
    let r = Rig::new();
    // What a provider killed mid-wake leaves: the half-restored VM and the snapshot.
    let half = r.backend.add_vm(NS, "vm-a", VmState::Creating);
    r.backend.add_snapshot(NS, &hibernation_of("vm-a"));
    let other = r.backend.add_vm(NS, "vm-b", VmState::Creating);
    let report = r.provider.reconcile_startup(&[]).await.unwrap();
    assert_eq!(report.stale_removed, [half.id.clone(), other.id.clone()]);
    assert_eq!(report.leases_kept, std::slice::from_ref(&half.id));
    assert!(r.backend.leases().contains(&half.id) && !released(&r, &half.id));
    assert!(!r.backend.leases().contains(&other.id), "a plain half-made VM's lease goes");
    // The retried wake (the Pod's create) comes back under the id and address.
    let asleep = run_pod("a", "vm-a", &[(RESTORE_FROM_HIBERNATE, "true")]);
    create(&r, &asleep).await.unwrap();
    assert_eq!((r.vm(&key("a")).id, r.vm(&key("a")).ip), (half.id, half.ip));
}

// ------------------------------------------------------------- 2. ids from our own records

#[tokio::test(start_paused = true)]
async fn a_hibernated_pod_recreated_with_another_vms_id_releases_no_lease_of_it() {
    let r = Rig::new();
    // The victim: another namespace's hibernated VM (no VM runs, its lease is kept).
    let v = in_namespace(run_pod("v", "vm-v", &[]), "other");
    create(&r, &v).await.unwrap();
    let victim = r.provider.tracked_vm("other/v").unwrap();
    r.provider.update_pod(&hibernating(&v, true)).await.unwrap();
    // b: created, hibernated, deleted (the default policy keeps b:hibernate).
    let b = run_pod("b", "vm-b", &[]);
    create(&r, &b).await.unwrap();
    let own = r.vm(&key("b")).id;
    r.provider.update_pod(&hibernating(&b, true)).await.unwrap();
    delete(&r, &hibernating(&b, true)).await.unwrap();
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-b")));
    // b again, asking to sleep and naming the victim's id.
    let mut forged = with_uid(hibernating(&b, true), "uid-b2");
    forged.metadata.annotations.as_mut().unwrap().insert(VM_ID.into(), victim.id.clone());
    let e = create(&r, &forged).await.unwrap_err();
    assert!(e.contains(&victim.id) && e.contains(&own), "{e}");
    assert_eq!(r.events.reasons().last().map(String::as_str), Some(events::VM_ID_REFUSED));
    assert!(r.provider.tracked_vm(&key("b")).is_none());
    delete(&r, &forged).await.unwrap();
    assert!(!released(&r, &victim.id), "{:?}", r.backend.calls());
    assert!(r.backend.leases().contains(&victim.id));
    // Without the forged id (or with its own) the Pod is tracked asleep under its own id.
    let honest = with_uid(hibernating(&b, true), "uid-b3");
    create(&r, &honest).await.unwrap();
    assert_eq!(r.vm(&key("b")).id, own);
}

#[tokio::test(start_paused = true)]
async fn a_delete_after_a_restart_keeps_the_lease_a_hibernation_holds() {
    let backend = Arc::new(FakeBackend::new());
    let mut first = Rig::over(backend.clone(), |_| {});
    let a = run_pod("a", "vm-a", &[(KEEP_SNAPSHOT_ON_DELETE, "true")]);
    create(&first, &a).await.unwrap();
    let id = first.vm(&key("a")).id;
    first.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    let api_pod = first.last();
    drop(first);
    // A new provider gets the DeletePod before any CreatePod: no VM has the id, but the
    // hibernation snapshot (kept by the policy) still needs the address.
    let r = Rig::over(backend.clone(), |_| {});
    r.provider.reconcile_startup(&[]).await.unwrap();
    delete(&r, &api_pod).await.unwrap();
    assert!(!released(&r, &id) && backend.leases().contains(&id), "{:?}", backend.calls());
}

// ------------------------------------------------------------ 3. a remove that half-fails

#[tokio::test(start_paused = true)]
async fn a_remove_that_stops_the_vm_then_fails_keeps_the_snapshot_and_the_pod_hibernated() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let vm = r.vm(&key("a"));
    r.backend.fail_remove_after_stop(1);
    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")), "the only copy of the VM is kept");
    let last = r.last();
    assert!(!ready(&last) && phase(&last) == "Pending", "{last:?}");
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("hibernated"));
    assert_eq!(r.events.reasons(), [events::HIBERNATE_REMOVE_FAILED]);
    // The watcher neither restarts it nor evicts the Pod: it finishes the removal.
    assert_eq!(r.backend.vm(&vm.id).map(|v| v.state), Some(VmState::Stopped));
    r.provider.watch_once().await;
    assert!(r.backend.vm(&vm.id).is_none());
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("start")));
    assert!(r.backend.leases().contains(&vm.id));
    r.provider.update_pod(&a).await.unwrap();
    assert_eq!(r.vm(&key("a")).ip, vm.ip, "woken from the kept snapshot");
    assert_eq!(r.backend.source_of(&vm.id).as_deref(), Some("clone:vm-a:hibernate"));
}

// ----------------------------------------------------------------------- 4. backoff

#[tokio::test(start_paused = true)]
async fn the_cocoon_hibernation_loop_backs_off_after_a_failure_and_resets_on_success() {
    let r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    r.backend.fail("snapshot_save", u32::MAX);
    let want = BTreeMap::from([(key("a"), true)]);
    r.provider.apply_hibernations(&want);
    settle().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    r.provider.apply_hibernations(&want);
    settle().await;
    assert_eq!(saves(&r), 1, "two passes within 15 s: one save");
    tokio::time::sleep(Duration::from_secs(14)).await;
    r.provider.apply_hibernations(&want);
    settle().await;
    assert_eq!(saves(&r), 2, "retried after 15 s");
    tokio::time::sleep(Duration::from_secs(20)).await;
    r.provider.apply_hibernations(&want);
    settle().await;
    assert_eq!(saves(&r), 2, "then 30 s");
    r.backend.heal("snapshot_save");
    tokio::time::sleep(Duration::from_secs(11)).await;
    let views = r.provider.apply_hibernations(&want);
    settle().await;
    assert_eq!(saves(&r), 3);
    assert!(!views[&key("a")].hibernated);
    let g = r.provider.0.lock();
    let e = &g.entries[&key("a")];
    assert!(e.hibernated && e.retry_at.is_none() && e.retry_backoff.is_zero(), "a success resets the backoff");
}

// ------------------------------------------------------ 5. never over a hibernation snapshot

#[tokio::test(start_paused = true)]
async fn a_hibernate_never_replaces_an_existing_hibernation_snapshot() {
    let r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.backend.add_snapshot(NS, &hibernation_of("vm-a"));
    let e = r.provider.update_pod(&hibernating(&a, true)).await.unwrap_err();
    assert!(error_chain(&e).contains("vm-a:hibernate"), "{e}");
    assert_eq!(r.events.reasons(), [events::HIBERNATE_SNAPSHOT_EXISTS]);
    assert_eq!(saves(&r), 0);
    assert_eq!(r.backend.vms().len(), 1, "the VM keeps running");
}

#[tokio::test(start_paused = true)]
async fn a_stopped_vm_whose_hibernate_was_cut_short_is_served_from_its_snapshot_not_cold_booted() {
    for asleep in [true, false] {
        let mut r = Rig::new();
        // A hibernate killed between the hypervisor kill and the record's deletion.
        let vm = r.backend.add_vm(NS, "vm-a", VmState::Stopped);
        r.backend.add_snapshot(NS, &hibernation_of("vm-a"));
        let p = hibernating(&run_pod("a", "vm-a", &[(VM_ID, &vm.id)]), asleep);
        r.provider.reconcile_startup(std::slice::from_ref(&p)).await.unwrap();
        create(&r, &p).await.unwrap();
        let calls = r.backend.calls();
        assert!(!calls.iter().any(|c| c.starts_with("start") || c.starts_with("snapshot_save")), "{calls:?}");
        assert!(!released(&r, &vm.id), "{calls:?}");
        assert_eq!(r.vm(&key("a")).id, vm.id);
        if asleep {
            assert!(r.backend.vms().is_empty());
            assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
            assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("hibernated"));
        } else {
            assert_eq!(r.backend.source_of(&vm.id).as_deref(), Some("clone:vm-a:hibernate"));
            assert_eq!(r.vm(&key("a")).ip, vm.ip);
        }
    }
}

//! Hibernate, wake, restore-from-hibernate and fork-from over the fake backend.

use super::*;
use crate::provider::hibernate::{fork_of, hibernation_of};

pub(super) fn hibernating(p: &Pod, on: bool) -> Pod {
    let mut p = p.clone();
    let a = p.metadata.annotations.get_or_insert_with(Default::default);
    if on {
        a.insert(HIBERNATE.into(), "true".into());
    } else {
        a.remove(HIBERNATE);
    }
    p
}

fn removes(p: &Pod, key: &str) -> bool {
    ann(p, vnode::pod_status::REMOVE_ANNOTATIONS).is_some_and(|v| v.split(',').any(|k| k == key))
}

#[tokio::test(start_paused = true)]
async fn hibernate_saves_and_stops_the_vm_and_wake_restores_it() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    let before = r.vm(&key("a"));
    r.drain();
    r.provider.update_pod(&a).await.unwrap();
    assert!(r.drain().is_empty(), "a plain resync pushes nothing");

    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    let pushes = r.drain();
    let states: Vec<_> = pushes.iter().filter_map(|p| ann(p, LIFECYCLE_STATE)).collect();
    assert_eq!(states, ["hibernating", "hibernated"]);
    let last = pushes.last().unwrap();
    assert_eq!(phase(last), "Pending", "no VM runs, so no container does");
    assert_eq!(ann(last, VM_ID), Some(before.id.clone()));
    assert_eq!(ann(last, VM_IP), before.ip.clone(), "the address stays");
    assert!(removes(last, LIFECYCLE_MESSAGE), "an empty message is removed, not written empty");
    assert!(r.backend.vms().is_empty(), "the VM is stopped");
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
    assert!(r.backend.leases().contains(&before.id), "the lease is kept for the wake");
    assert_eq!(r.events.reasons(), [events::HIBERNATED]);
    // The watcher leaves a hibernated Pod alone (its VM is gone by design).
    r.provider.watch_once().await;
    assert_eq!(r.events.reasons(), [events::HIBERNATED]);
    // A resync while asleep does nothing.
    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    assert!(r.drain().is_empty());

    r.provider.update_pod(&a).await.unwrap();
    let last = r.last();
    assert_eq!((phase(&last), ann(&last, LIFECYCLE_STATE).as_deref()), ("Running".into(), Some("ready")));
    assert_eq!(r.events.reasons(), [events::HIBERNATED, events::WOKEN]);
    let vms = r.backend.vms();
    assert_eq!(vms.len(), 1);
    assert_eq!(r.backend.source_of(&vms[0].id).as_deref(), Some("clone:vm-a:hibernate"));
    assert!(!r.backend.snapshots().contains_key(&hibernation_of("vm-a")), "the wake drops the snapshot");
}

#[tokio::test(start_paused = true)]
async fn a_failed_save_keeps_the_vm_running_marks_failed_and_a_resync_retries() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.backend.fail("snapshot_save", 1);
    let h = hibernating(&a, true);
    assert!(r.provider.update_pod(&h).await.is_err());
    let last = r.last();
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("failed"));
    assert!(ann(&last, LIFECYCLE_MESSAGE).is_some_and(|m| m.contains("vm-a:hibernate")), "{last:?}");
    assert_eq!(r.backend.vms().len(), 1, "the VM keeps running");
    assert_eq!(r.events.reasons(), [events::HIBERNATE_SNAPSHOT_FAILED]);
    r.provider.update_pod(&h).await.unwrap();
    assert!(r.backend.vms().is_empty());
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("hibernated"));
}

#[tokio::test(start_paused = true)]
async fn a_failed_remove_of_a_running_vm_drops_the_snapshot_and_the_vm_runs_on() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.backend.fail("remove", 1);
    assert!(r.provider.update_pod(&hibernating(&a, true)).await.is_err());
    assert_eq!(r.events.reasons(), [events::HIBERNATE_REMOVE_FAILED]);
    assert!(!r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
    assert_eq!(r.backend.vms().len(), 1);
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("failed"));
}

#[tokio::test(start_paused = true)]
async fn a_restarted_provider_tracks_a_hibernated_pod_asleep_and_wakes_it_when_asked() {
    let backend = Arc::new(FakeBackend::new());
    let mut first = Rig::over(backend.clone(), |_| {});
    let a = run_pod("a", "vm-a", &[]);
    create(&first, &a).await.unwrap();
    let before = first.vm(&key("a"));
    first.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    // The API's copy of the pod carries what the first provider pushed (id, ip, hibernated).
    let asleep = hibernating(&first.last(), true);
    drop(first);

    let mut r = Rig::over(backend.clone(), |_| {});
    r.provider.reconcile_startup(std::slice::from_ref(&asleep)).await.unwrap();
    create(&r, &asleep).await.unwrap();
    assert!(r.backend.vms().is_empty(), "nothing boots for a Pod that asks to sleep");
    let last = r.last();
    assert_eq!((phase(&last), ann(&last, LIFECYCLE_STATE).as_deref()), ("Pending".into(), Some("hibernated")));
    assert_eq!(r.vm(&key("a")).id, before.id);
    // The first CocoonHibernation pass (none here): until then a Pod that was hibernated is
    // held asleep, since an object may still ask for it.
    r.provider.apply_hibernations(&Default::default());
    r.provider.update_pod(&hibernating(&asleep, false)).await.unwrap();
    assert_eq!(r.backend.vms().len(), 1);
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("ready"));
    assert_eq!((r.vm(&key("a")).id, r.vm(&key("a")).ip), (before.id.clone(), before.ip), "same VM, same address");
    // Deleting it: the VM goes like any other, and its lease with it.
    delete(&r, &asleep).await.unwrap();
    assert!(r.backend.vms().is_empty() && !r.backend.leases().contains(&before.id));
}

#[tokio::test(start_paused = true)]
async fn restore_from_hibernate_wakes_at_create_or_fails_without_the_snapshot() {
    let mut r = Rig::new();
    let p = run_pod("a", "vm-a", &[(RESTORE_FROM_HIBERNATE, "true")]);
    let e = create(&r, &p).await.unwrap_err();
    assert!(e.contains("vm-a:hibernate"), "{e}");
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("failed"));
    r.backend.add_snapshot(NS, &hibernation_of("vm-a"));
    create(&r, &p).await.unwrap();
    let vms = r.backend.vms();
    assert_eq!(r.backend.source_of(&vms[0].id).as_deref(), Some("clone:vm-a:hibernate"));
    assert!(r.events.reasons().contains(&events::WOKEN.to_owned()));
}

#[tokio::test(start_paused = true)]
async fn deleting_a_hibernated_pod_releases_its_lease_and_drops_its_snapshot_unless_kept() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[(SNAPSHOT_POLICY, "never")]);
    create(&r, &a).await.unwrap();
    let id = r.vm(&key("a")).id;
    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    r.drain();
    delete(&r, &hibernating(&a, true)).await.unwrap();
    assert!(!r.backend.leases().contains(&id));
    assert!(!r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
    assert!(r.provider.tracked_vm(&key("a")).is_none());
}

#[tokio::test(start_paused = true)]
async fn a_pod_created_asking_to_sleep_is_booted_then_hibernated() {
    let r = Rig::new();
    create(&r, &hibernating(&run_pod("a", "vm-a", &[]), true)).await.unwrap();
    assert!(r.backend.vms().is_empty());
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
}

#[tokio::test(start_paused = true)]
async fn fork_from_clones_a_snapshot_of_the_running_source_saved_once() {
    let r = Rig::new();
    create(&r, &run_pod("main", "vm-main", &[])).await.unwrap();
    let sub = |n: &str| pod(n, &[(VM_NAME, &format!("vm-{n}")), (MANAGED, "true"), (FORK_FROM, "vm-main")]);
    create(&r, &sub("s1")).await.unwrap();
    create(&r, &sub("s2")).await.unwrap();
    let saves = r.backend.calls().iter().filter(|c| c.starts_with("snapshot_save")).count();
    assert_eq!(saves, 1, "the fork snapshot is saved once: {:?}", r.backend.calls());
    assert_eq!(r.backend.source_of(&r.vm(&key("s2")).id), Some(format!("clone:{}", fork_of("vm-main"))));
    assert_eq!(r.backend.vms().len(), 3, "the source keeps running");
    // No such source: the create fails, naming it.
    let e = create(&r, &pod("x", &[(VM_NAME, "vm-x"), (MANAGED, "true"), (FORK_FROM, "vm-none")])).await.unwrap_err();
    assert!(e.contains("vm-none"), "{e}");
}

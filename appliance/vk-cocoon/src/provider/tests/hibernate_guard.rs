//! What a hibernation snapshot is served to, and when: a leftover `<vm-name>:hibernate` of
//! another image is never restored into a new Pod of the name (§3.4), and a VM hibernated
//! through a `CocoonHibernation` is not woken by a provider restart or a failed listing.

use std::collections::BTreeMap;

use super::hibernate::hibernating;
use super::*;
use crate::provider::hibernate::hibernation_of;
use vnode::error_chain;

// ------------------------------------------------------------- 1. the snapshot's image

#[tokio::test(start_paused = true)]
async fn a_leftover_hibernation_of_another_image_is_refused_not_restored_into_a_new_pod() {
    let mut r = Rig::new();
    let a = run_pod("a", "vm-a", &[]);
    create(&r, &a).await.unwrap();
    r.provider.update_pod(&hibernating(&a, true)).await.unwrap();
    // Deleted while hibernated under snapshot-policy always: the snapshot stays.
    delete(&r, &hibernating(&a, true)).await.unwrap();
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")));
    r.drain();
    r.backend.clear_calls();

    // A rollout: a new Pod of the same VM name and another image.
    let b = run_pod("b", "vm-a", &[(IMAGE, "ubuntu-next")]);
    let e = crate::provider::create::create(&r.provider.0, &b).await.unwrap_err();
    let msg = error_chain(&e);
    assert!(matches!(e, CocoonProviderError::HibernationImageMismatch { .. }), "{msg}");
    for part in
        ["ubuntu-dev-base", "ubuntu-next", "vm-a:hibernate", "chrysalis snapshot rm", "set the pod's image back"]
    {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    assert!(r.events.reasons().contains(&events::HIBERNATION_IMAGE_MISMATCH.to_owned()), "{:?}", r.events.reasons());
    assert!(r.backend.vms().is_empty(), "nothing restored, nothing booted");
    assert!(r.backend.snapshots().contains_key(&hibernation_of("vm-a")), "the snapshot is kept");
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("clone_vm") || c.starts_with("run")));
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("failed"));

    // A Pod of the image it was saved from is served from it, as before.
    let c = run_pod("c", "vm-a", &[]);
    create(&r, &c).await.unwrap();
    assert_eq!(r.backend.source_of(&r.vm(&key("c")).id).as_deref(), Some("clone:vm-a:hibernate"));
}

#[tokio::test(start_paused = true)]
async fn a_hibernation_recording_no_image_is_restored_as_before() {
    let r = Rig::new();
    r.backend.add_snapshot(NS, &hibernation_of("vm-a"));
    create(&r, &run_pod("a", "vm-a", &[(IMAGE, "ubuntu-next")])).await.unwrap();
    assert_eq!(r.backend.source_of(&r.vm(&key("a")).id).as_deref(), Some("clone:vm-a:hibernate"));
}

// ------------------------------------------------- 2. CocoonHibernation desires are kept

/// Hibernates `a` through a `CocoonHibernation` desire (its annotation never asks) and
/// returns the Pod as the API holds it then.
async fn hibernated_through_an_object(r: &mut Rig, a: &Pod) -> Pod {
    create(r, a).await.unwrap();
    r.provider.apply_hibernations(&BTreeMap::from([(key("a"), true)]));
    settle().await;
    assert!(r.backend.vms().is_empty(), "hibernated");
    let last = r.last();
    assert_eq!(ann(&last, LIFECYCLE_STATE).as_deref(), Some("hibernated"));
    last
}

#[tokio::test(start_paused = true)]
async fn a_restarted_provider_keeps_a_pod_hibernated_through_an_object_asleep_until_the_objects_are_listed() {
    let backend = Arc::new(FakeBackend::new());
    let mut first = Rig::over(backend.clone(), |_| {});
    let asleep = hibernated_through_an_object(&mut first, &run_pod("a", "vm-a", &[])).await;
    drop(first);

    let mut r = Rig::over(backend.clone(), |_| {});
    r.provider.reconcile_startup(std::slice::from_ref(&asleep)).await.unwrap();
    create(&r, &asleep).await.unwrap();
    assert!(r.backend.vms().is_empty(), "not woken before the objects were listed");
    assert_eq!(ann(&r.last(), LIFECYCLE_STATE).as_deref(), Some("hibernated"));
    r.provider.update_pod(&asleep).await.unwrap();
    settle().await;
    assert!(r.backend.vms().is_empty(), "nor by a resync");

    // The first listing still shows the object: it sleeps on.
    r.provider.apply_hibernations(&BTreeMap::from([(key("a"), true)]));
    settle().await;
    assert!(r.backend.vms().is_empty());
    // The object is gone: the annotation (awake) rules.
    r.provider.apply_hibernations(&BTreeMap::new());
    settle().await;
    assert_eq!(r.backend.vms().len(), 1, "woken once the objects no longer ask");
}

#[tokio::test(start_paused = true)]
async fn a_pod_created_while_an_object_asks_it_to_sleep_is_not_woken_at_create() {
    let backend = Arc::new(FakeBackend::new());
    let mut first = Rig::over(backend.clone(), |_| {});
    let asleep = hibernated_through_an_object(&mut first, &run_pod("a", "vm-a", &[])).await;
    drop(first);
    let r = Rig::over(backend.clone(), |_| {});
    r.provider.reconcile_startup(std::slice::from_ref(&asleep)).await.unwrap();
    // The objects were listed before the Pod's CreatePod.
    r.provider.apply_hibernations(&BTreeMap::from([(key("a"), true)]));
    create(&r, &asleep).await.unwrap();
    settle().await;
    assert!(r.backend.vms().is_empty());
    assert!(!r.backend.calls().iter().any(|c| c.starts_with("clone_vm")), "{:?}", r.backend.calls());
}

#[tokio::test(start_paused = true)]
async fn an_incomplete_listing_keeps_desires_it_does_not_show() {
    let mut r = Rig::new();
    hibernated_through_an_object(&mut r, &run_pod("a", "vm-a", &[])).await;
    r.provider.apply_incomplete_hibernations(&BTreeMap::new());
    settle().await;
    assert!(r.backend.vms().is_empty(), "a partial view wakes nothing");
    r.provider.apply_incomplete_hibernations(&BTreeMap::from([(key("a"), false)]));
    settle().await;
    assert_eq!(r.backend.vms().len(), 1, "an object it shows still acts");
}

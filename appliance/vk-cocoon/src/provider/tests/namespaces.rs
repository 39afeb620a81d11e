//! Namespace scoping: which Pods may adopt, clone, overwrite or delete which VMs and snapshots.

use super::*;

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

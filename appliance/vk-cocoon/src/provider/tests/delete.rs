//! DeletePod (snapshot policies, failures that keep the VM) and UpdatePod.

use super::*;

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

//! Parsing the Pod contract's keys.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use super::*;
use k8s_openapi::api::core::v1::{Container, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

fn pod(pairs: &[(&str, &str)]) -> Pod {
    let mut p = Pod::default();
    p.metadata.annotations = Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    p
}

fn managed(extra: &[(&str, &str)]) -> Pod {
    let mut pairs = vec![(VM_NAME, "vm-a"), (MANAGED, "true"), (IMAGE, "snap-a")];
    pairs.extend_from_slice(extra);
    pod(&pairs)
}

#[test]
fn vm_name_is_required_and_sane() {
    assert_eq!(parse(&pod(&[])).unwrap_err(), AnnotationError::MissingVmName);
    assert_eq!(parse(&pod(&[(VM_NAME, "  ")])).unwrap_err(), AnnotationError::MissingVmName);
    assert!(matches!(parse(&pod(&[(VM_NAME, "a/b")])).unwrap_err(), AnnotationError::BadVmName(_)));
    assert_eq!(parse(&managed(&[(VM_NAME, &"x".repeat(100))])).unwrap().vm_name, "x".repeat(100));
    assert!(parse(&managed(&[(VM_NAME, &"x".repeat(MAX_VM_NAME))])).is_ok());
    assert!(matches!(parse(&pod(&[(VM_NAME, &"x".repeat(256))])).unwrap_err(), AnnotationError::BadVmName(_)));
    let msg = AnnotationError::MissingVmName.to_string();
    assert!(msg.contains("vm.cocoonstack.io/name"), "{msg}");
}

#[test]
fn managed_is_true_only_for_the_literal() {
    for v in ["True", "TRUE", "yes", "1", " true"] {
        let p = pod(&[(VM_NAME, "vm-a"), (MANAGED, v), (VM_ID, "id-1"), (VM_IP, "10.0.0.2")]);
        assert!(!parse(&p).unwrap().managed, "{v:?}");
    }
    assert!(parse(&managed(&[])).unwrap().managed);
}

#[test]
fn unmanaged_needs_id_and_ip() {
    let e = parse(&pod(&[(VM_NAME, "vm-a")])).unwrap_err();
    assert_eq!(e, AnnotationError::UnmanagedWithoutVm("both"));
    let e = parse(&pod(&[(VM_NAME, "vm-a"), (VM_IP, "10.0.0.2")])).unwrap_err();
    assert_eq!(e, AnnotationError::UnmanagedWithoutVm(VM_ID));
    let e = parse(&pod(&[(VM_NAME, "vm-a"), (VM_ID, "i")])).unwrap_err();
    assert_eq!(e, AnnotationError::UnmanagedWithoutVm(VM_IP));
    let e = parse(&pod(&[(VM_NAME, "vm-a"), (VM_ID, "i"), (VM_IP, "ten")])).unwrap_err();
    assert_eq!(e, AnnotationError::BadIp("ten".into()));
    let s = parse(&pod(&[(VM_NAME, "vm-a"), (VM_ID, "i"), (VM_IP, "10.0.0.2")])).unwrap();
    assert_eq!(s.preassigned, Some(Preassigned { id: "i".into(), ip: "10.0.0.2".into() }));
    assert!(!s.managed && s.snapshot.is_none());
}

#[test]
fn mode_and_image() {
    let s = parse(&managed(&[])).unwrap();
    assert_eq!(s.mode, Mode::Clone, "clone is the default");
    assert_eq!(s.snapshot, Some(SnapshotRef::latest("snap-a")), "a bare repo is latest");
    let s = parse(&managed(&[(IMAGE, "snap-a:v3")])).unwrap();
    assert_eq!(s.snapshot, Some(SnapshotRef::new("snap-a", "v3")));
    let s = parse(&managed(&[(MODE, "run"), (IMAGE, "ubuntu-dev-base")])).unwrap();
    assert_eq!((s.mode, s.image.as_deref(), s.snapshot), (Mode::Run, Some("ubuntu-dev-base"), None));
    let no_image = pod(&[(VM_NAME, "v"), (MANAGED, "true"), (MODE, "run")]);
    assert_eq!(parse(&no_image).unwrap_err(), AnnotationError::MissingImage("run", "image to boot"));
    let no_image = pod(&[(VM_NAME, "v"), (MANAGED, "true")]);
    assert!(matches!(parse(&no_image).unwrap_err(), AnnotationError::MissingImage("clone", _)));
    assert!(matches!(parse(&managed(&[(IMAGE, "a:")])).unwrap_err(), AnnotationError::BadSnapshot(_)));
    assert_eq!(parse(&managed(&[(MODE, "fork")])).unwrap_err(), AnnotationError::BadMode("fork".into()));
    assert!(matches!(parse(&managed(&[(MODE, "static")])).unwrap_err(), AnnotationError::Unsupported { .. }));
}

#[test]
fn os_linux_only() {
    assert!(parse(&managed(&[(OS, "linux")])).is_ok());
    assert!(parse(&managed(&[(OS, "")])).is_ok(), "empty means linux");
    for os in ["windows", "android", "macos"] {
        let e = parse(&managed(&[(OS, os)])).unwrap_err();
        assert!(matches!(&e, AnnotationError::Unsupported { .. }), "{os}");
        assert!(e.to_string().contains("unsupported on this node") && e.to_string().contains(os), "{e}");
    }
    assert_eq!(parse(&managed(&[(OS, "beos")])).unwrap_err(), AnnotationError::BadOs("beos".into()));
}

#[test]
fn storage_network_policy_port_backend_keep() {
    let s = parse(&managed(&[
        (STORAGE, "10Gi"),
        (NETWORK, "lan"),
        (SNAPSHOT_POLICY, "main-only"),
        (PROBE_PORT, "8080"),
        (BACKEND, "qemu"),
        (KEEP_SNAPSHOT_ON_DELETE, "true"),
        (HIBERNATE, "true"),
    ]))
    .unwrap();
    assert_eq!(s.storage_bytes, Some(10 << 30));
    assert_eq!(s.network.as_deref(), Some("lan"));
    assert_eq!(s.snapshot_policy, SnapshotPolicy::MainOnly);
    assert_eq!(s.probe_port, Some(8080));
    assert_eq!(s.backend, Some(RequestedBackend::Qemu));
    assert!(s.keep_snapshot_on_delete && s.hibernate);
    let d = parse(&managed(&[])).unwrap();
    assert_eq!(
        (d.storage_bytes, d.network, d.snapshot_policy, d.probe_port, d.backend),
        (None, None, SnapshotPolicy::Always, None, None)
    );
    assert!(!d.keep_snapshot_on_delete && !d.hibernate);
    assert_eq!(d.shared_network, None);
    assert_eq!(parse(&managed(&[(SHARED_NETWORK, "team-1")])).unwrap().shared_network.as_deref(), Some("team-1"));
    for bad in ["Team", "a/b", "a b", &"x".repeat(64)] {
        assert_eq!(
            parse(&managed(&[(SHARED_NETWORK, bad)])).unwrap_err(),
            AnnotationError::BadSharedNetwork(bad.to_string()),
            "{bad}"
        );
    }
    assert!(!parse(&managed(&[(KEEP_SNAPSHOT_ON_DELETE, "yes")])).unwrap().keep_snapshot_on_delete);
    for b in [RequestedBackend::CloudHypervisor, RequestedBackend::Firecracker, RequestedBackend::Qemu] {
        assert_eq!(parse(&managed(&[(BACKEND, b.as_str())])).unwrap().backend, Some(b));
    }
    assert_eq!(RequestedBackend::Firecracker.hypervisor(), None);
    assert_eq!(RequestedBackend::CloudHypervisor.hypervisor(), Some(Hypervisor::CloudHypervisor));
    assert!(matches!(parse(&managed(&[(STORAGE, "ten")])).unwrap_err(), AnnotationError::BadStorage(_)));
    assert_eq!(
        parse(&managed(&[(SNAPSHOT_POLICY, "sometimes")])).unwrap_err(),
        AnnotationError::BadSnapshotPolicy("sometimes".into())
    );
    for bad in ["0", "65536", "http", "-1"] {
        assert_eq!(parse(&managed(&[(PROBE_PORT, bad)])).unwrap_err(), AnnotationError::BadProbePort(bad.into()));
    }
    let e = parse(&managed(&[(BACKEND, "kvm")])).unwrap_err();
    assert_eq!(e, AnnotationError::BadBackend("kvm".into()));
    assert!(e.to_string().contains("expected cloud-hypervisor, firecracker or qemu"), "{e}");
}

#[test]
fn vm_sources_fork_and_wake_are_parsed_and_clone_from_dir_is_refused_naming_why() {
    let e = parse(&managed(&[(CLONE_FROM_DIR, "/x")])).unwrap_err();
    assert!(matches!(e, AnnotationError::Unsupported { .. }) && e.to_string().contains("image library"), "{e}");
    let fork = parse(&managed(&[(FORK_FROM, "vm-b")])).unwrap();
    assert_eq!(fork.fork_from.as_deref(), Some("vm-b"));
    let no_image = |extra: (&str, &str)| {
        let mut p = managed(&[extra]);
        p.metadata.annotations.as_mut().unwrap().remove(IMAGE);
        parse(&p)
    };
    assert_eq!(no_image((FORK_FROM, "vm-b")).unwrap().snapshot, None, "a fork needs no image");
    assert!(no_image((RESTORE_FROM_HIBERNATE, "true")).unwrap().restore_from_hibernate);
    assert!(matches!(no_image((RESTORE_FROM_HIBERNATE, "false")).unwrap_err(), AnnotationError::MissingImage(..)));
    let e = parse(&managed(&[(FORK_FROM, "vm-b"), (MODE, "run")])).unwrap_err();
    assert!(matches!(e, AnnotationError::Unsupported { .. }), "{e}");
    assert_eq!(parse(&managed(&[(FORK_FROM, "a b")])).unwrap_err(), AnnotationError::BadVmName("a b".into()));
}

#[test]
fn snapshot_policy_and_roles() {
    let set_member = |vm: &str, role: Option<&str>| {
        let mut p = managed(&[(VM_NAME, vm), (SNAPSHOT_POLICY, "main-only")]);
        p.metadata.owner_references = Some(vec![OwnerReference {
            kind: COCOONSET_KIND.into(),
            controller: Some(true),
            name: "set".into(),
            ..OwnerReference::default()
        }]);
        if let Some(r) = role {
            p.metadata.labels = Some([(ROLE.to_string(), r.to_string())].into());
        }
        p
    };
    let check = |p: &Pod| should_snapshot(p, &parse(p).unwrap());
    assert!(check(&set_member("vk-ns-set-0", None)), "slot 0 is main");
    assert!(!check(&set_member("vk-ns-set-1", None)), "slot 1 is a sub-agent");
    assert!(check(&set_member("vk-ns-set-1", Some("main"))), "the role label wins");
    assert!(!check(&set_member("vk-ns-set-0", Some("toolbox"))));
    assert!(check(&managed(&[(SNAPSHOT_POLICY, "main-only")])), "a pod outside a set is its own main");
    assert!(check(&managed(&[])), "always");
    assert!(!check(&managed(&[(SNAPSHOT_POLICY, "never")])));
}

#[test]
fn delete_policy_is_lenient() {
    let p = managed(&[(SNAPSHOT_POLICY, "bogus"), (OS, "windows")]);
    assert_eq!(delete_policy(&p, "x"), DeletePolicy { vm_name: "vm-a".into(), save: true, keep: false });
    let p = pod(&[(SNAPSHOT_POLICY, "never"), (KEEP_SNAPSHOT_ON_DELETE, "true")]);
    assert_eq!(delete_policy(&p, "tracked"), DeletePolicy { vm_name: "tracked".into(), save: false, keep: true });
}

#[test]
fn cpu_class_and_resources() {
    let mut p = managed(&[]);
    assert_eq!(selected_cpu_class(&p), None);
    assert_eq!(run_resources(&p), (1, 512));
    let res = |limits: &[(&str, &str)], requests: &[(&str, &str)]| ResourceRequirements {
        limits: Some(limits.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect()),
        requests: Some(requests.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect()),
        ..ResourceRequirements::default()
    };
    p.spec = Some(PodSpec {
        node_selector: Some([(CPU_CLASS_LABEL.to_string(), "skylake".to_string())].into()),
        containers: vec![
            Container {
                name: "agent".into(),
                resources: Some(res(&[("cpu", "1500m"), ("memory", "2Gi")], &[("cpu", "1"), ("memory", "1Gi")])),
                ..Container::default()
            },
            Container {
                name: "side".into(),
                resources: Some(res(&[], &[("cpu", "250m"), ("memory", "100M")])),
                ..Container::default()
            },
        ],
        ..PodSpec::default()
    });
    assert_eq!(selected_cpu_class(&p), Some("skylake"));
    // CPU: limits 1.5 (side has none) → 2; memory: requests 1Gi + 100M → 1120 MiB (rounded up).
    assert_eq!(run_resources(&p), (2, 1024 + 96));
}

#[test]
fn names_follow_the_image_librarys_reference_rules() {
    let store_name = |p: &Pod| matches!(parse(p), Err(AnnotationError::StoreName { .. }));
    for bad in ["VM-A", "vm:a", "-vm", ".vm", "vm_a:hibernate", "sha256"] {
        assert!(store_name(&managed(&[(VM_NAME, bad)])), "{bad}");
    }
    let e = parse(&managed(&[(VM_NAME, "Vm")])).unwrap_err();
    assert!(e.to_string().contains("[a-z0-9._-]") && e.to_string().contains(VM_NAME), "{e}");
    assert!(parse(&managed(&[(VM_NAME, "vk-ns-pod.0_a")])).is_ok());
    // A fork adds `fork-`: its source must leave room for it (255 - 5).
    assert!(parse(&managed(&[(FORK_FROM, &"x".repeat(250))])).is_ok());
    for len in [251, 252, 255] {
        let p = managed(&[(FORK_FROM, &"x".repeat(len))]);
        let e = parse(&p).unwrap_err();
        assert!(matches!(&e, AnnotationError::StoreName { key: FORK_FROM, .. }), "{len}: {e}");
        assert!(e.to_string().contains("fork-"), "{e}");
    }
    assert!(store_name(&managed(&[(FORK_FROM, "Vm-B")])));
    assert!(store_name(&managed(&[(FORK_FROM, "-b")])), "fork--b is a name, -b is not");
}

//! PodMetrics: each tracked Pod's VM, as measured by the backend.

use std::time::{Duration, UNIX_EPOCH};

use vnode::PodMetrics as _;

use super::*;
use crate::backend::VmUsage;

#[tokio::test(start_paused = true)]
async fn each_running_pod_reports_its_vms_usage_as_its_first_container() {
    let r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    create(&r, &run_pod("b", "vm-b", &[])).await.unwrap();
    assert!(r.provider.pod_usage().await.is_empty(), "nothing measured yet");
    let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let started = Some(at - Duration::from_secs(60));
    let usage = VmUsage {
        cpu_usage_nanos: 3_000_000_000,
        memory_working_set_bytes: 300 << 20,
        measured_at: at,
        started_at: started,
    };
    r.backend.set_usage(&r.vm(&key("a")).id, usage);
    let got = r.provider.pod_usage().await;
    assert_eq!(
        got,
        [vnode::PodUsage {
            pod: PodKey::new("ns", "a"),
            uid: "uid-a".into(),
            container: "agent".into(),
            cpu_usage_nanos: 3_000_000_000,
            memory_working_set_bytes: 300 << 20,
            measured_at: at,
            started_at: started,
        }],
        "b's VM is not measured, so b is left out"
    );
    // A deleted Pod is no longer reported.
    delete(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    assert!(r.provider.pod_usage().await.iter().all(|u| u.pod.name != "a"));
}

#[tokio::test(start_paused = true)]
async fn the_registry_carries_the_cocoon_samples_and_the_table_size() {
    let r = Rig::new();
    create(&r, &run_pod("a", "vm-a", &[])).await.unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    r.provider.register_metrics(&mut registry);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    assert!(out.contains("cocoon_vk_vm_table_size 1\n"), "{out}");
    assert!(out.contains("cocoon_vk_pod_lifecycle_total{op=\"create\",result=\"success\"}"), "{out}");
}

//! `kubectl top` for cocoon Pods: [`vnode::PodMetrics`] over the backend's measurement of each
//! tracked Pod's VM (`VmBackend::usage`: its cgroup leaf or hypervisor process). A Pod that
//! is Failed, or whose VM does not run, is left out. The VM is reported as the Pod's first
//! container.

use vnode::{PodKey, PodMetrics, PodUsage};

use super::CocoonProvider;

#[async_trait::async_trait]
impl PodMetrics for CocoonProvider {
    async fn pod_usage(&self) -> Vec<PodUsage> {
        // (key, uid, container, VM id), read under the lock; measured after it is released.
        let tracked: Vec<(PodKey, String, String, String)> = self
            .0
            .lock()
            .entries
            .values()
            .filter(|e| e.terminal.is_none())
            .map(|e| {
                let container =
                    e.pod.spec.as_ref().and_then(|s| s.containers.first()).map(|c| c.name.clone()).unwrap_or_default();
                (PodKey::of(&e.pod), e.uid.clone(), container, e.vm.id.clone())
            })
            .collect();
        let ids: Vec<String> = tracked.iter().map(|t| t.3.clone()).collect();
        let measured = match self.0.backend.usage(&ids).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %vnode::error_chain(&e), "cannot measure the VMs");
                return Vec::new();
            }
        };
        tracked
            .into_iter()
            .filter_map(|(pod, uid, container, id)| {
                let (_, u) = measured.iter().find(|(m, _)| *m == id)?;
                Some(PodUsage {
                    pod,
                    uid,
                    container,
                    cpu_usage_nanos: u.cpu_usage_nanos,
                    memory_working_set_bytes: u.memory_working_set_bytes,
                    measured_at: u.measured_at,
                    started_at: u.started_at,
                })
            })
            .collect()
    }
}

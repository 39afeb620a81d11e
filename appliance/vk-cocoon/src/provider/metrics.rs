//! The provider's metrics: its samples registered in the runtime's registry
//! ([`CocoonProvider::register_metrics`]: [`crate::metrics`] and `cocoon_vk_vm_table_size`,
//! counted at scrape), and `kubectl top` for cocoon Pods: [`vnode::PodMetrics`] over the backend's measurement of each
//! tracked Pod's VM (`VmBackend::usage`: its cgroup leaf or hypervisor process). A Pod that
//! is Failed, or whose VM does not run, is left out. The VM is reported as the Pod's first
//! container.

use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use vnode::{PodKey, PodMetrics, PodUsage};

use super::CocoonProvider;
use crate::metrics::metrics;
use crate::shared::Shared;

/// `cocoon_vk_vm_table_size`, counted at scrape.
struct VmTable(Arc<Shared>);

impl std::fmt::Debug for VmTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VmTable")
    }
}

impl prometheus_client::collector::Collector for VmTable {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let n = self.0.lock().entries.len();
        let g = ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
        let m = encoder.encode_descriptor(
            "cocoon_vk_vm_table_size",
            "Number of VMs vk-cocoon currently tracks.",
            None,
            g.metric_type(),
        )?;
        g.encode(m)
    }
}

impl CocoonProvider {
    /// Registers vk-cocoon's samples ([`crate::metrics`]) in the runtime's registry.
    pub fn register_metrics(&self, registry: &mut Registry) {
        metrics().register(registry);
        registry.register_collector(Box::new(VmTable(self.0.clone())));
    }
}

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

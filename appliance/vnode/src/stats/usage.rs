//! What a provider reports per Pod ([`PodUsage`]) and the trait it reports through
//! ([`PodMetrics`]).

use std::time::SystemTime;

use crate::provider::PodKey;

/// One container's usage (a VM is one container: the Pod's first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUsage {
    /// Which Pod.
    pub pod: PodKey,
    /// Its UID.
    pub uid: String,
    /// The container's name in the Pod spec.
    pub container: String,
    /// CPU time used since the VM started, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// Memory working set, bytes.
    pub memory_working_set_bytes: u64,
    /// When measured.
    pub measured_at: SystemTime,
    /// When the VM started, if known.
    pub started_at: Option<SystemTime>,
}

/// What a provider measures of its Pods.
#[async_trait::async_trait]
pub trait PodMetrics: Send + Sync + 'static {
    /// The usage of every Pod it can measure now (a Pod it cannot measure is left out).
    async fn pod_usage(&self) -> Vec<PodUsage>;
}

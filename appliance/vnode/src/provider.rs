//! The contract between the node runtime and a provider (virtual-kubelet's `PodLifecycleHandler`
//! plus `PodNotifier`: an *async* provider that pushes every change and is never polled).

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc;

/// `namespace/name`: the key of every queue and every provider table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl PodKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> PodKey {
        PodKey { namespace: namespace.into(), name: name.into() }
    }

    /// The key of `pod` (an unnamed or namespace-less pod gets empty parts).
    pub fn of(pod: &Pod) -> PodKey {
        PodKey {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A provider call failed. Its display text becomes the Pod's `ProviderFailed` status message and
/// the Warning event's message, so it should say what was wrong and what fixes it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ProviderError(#[source] pub Box<dyn std::error::Error + Send + Sync + 'static>);

impl ProviderError {
    /// Wraps any error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> ProviderError {
        ProviderError(Box::new(e))
    }

    /// The error as the runtime shows it on the Pod: its whole chain as one message.
    pub fn reported(e: &dyn std::error::Error) -> ProviderError {
        ProviderError::new(ReportedError(error_chain(e)))
    }
}

/// A chain flattened into one message (what [`ProviderError::reported`] carries).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ReportedError(String);

/// `e: cause: cause…` on one line: the workspace's one formatter, re-exported for providers.
pub use foundation::error_chain;

/// Where a provider pushes Pod status changes (a deep copy of the Pod with the new `status`,
/// and annotations the provider writes back). Nothing polls the provider: every change it
/// wants the API to see goes through here.
#[derive(Debug, Clone)]
pub struct PodNotifier(pub(crate) mpsc::UnboundedSender<Pod>);

impl PodNotifier {
    /// A notifier and the receiving end (the runtime keeps the receiver; tests may too).
    pub fn channel() -> (PodNotifier, mpsc::UnboundedReceiver<Pod>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (PodNotifier(tx), rx)
    }

    /// Queues a status push; dropped silently only when the runtime has shut down.
    pub fn notify(&self, pod: Pod) {
        let _ = self.0.send(pod);
    }
}

/// What backs the Pods bound to a virtual node.
///
/// Create/Update/Delete are called from the pod controller's workers, at most one call per pod
/// key at a time. Get* read the provider's memory only (no backend calls).
#[async_trait::async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Give `pod` a backing (claim a VM, boot one, …) and push its status through the notifier.
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError>;
    /// Called on every resync and spec change of a pod the provider knows (never "equal").
    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError>;
    /// The pod is being deleted (or is unknown to the API at start-up). An error keeps the pod
    /// and retries the call with backoff.
    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError>;
    /// The provider's copy of a pod, if it tracks it.
    fn get_pod(&self, key: &PodKey) -> Option<Pod>;
    /// Every pod the provider tracks.
    fn get_pods(&self) -> Vec<Pod>;
    /// Hands the provider its notifier; called once, before the pod controller starts.
    fn notify_pods(&self, notifier: PodNotifier);
}

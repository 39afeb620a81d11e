//! The Pods' streams for the kubelet port (`kubectl logs/exec/attach/port-forward`): each
//! tracked Pod's VM through the backend, its guest agent for exec and port-forward
//! ([`crate::backend::VmBackend::dial_agent`]) and its console log for logs and attach
//! (`vmm::console::read_log` over [`crate::backend::VmBackend::console_log`]). vnode has
//! already checked that the Pod is this node's, Running, and names one of its containers.

use futures::StreamExt as _;
use vnode::streams::{AgentIo, LogBody, PodStreams, StreamError, ValidLogQuery};
use vnode::PodKey;

use super::CocoonProvider;
use crate::backend::BackendError;

impl CocoonProvider {
    /// The id of `pod`'s VM, while the Pod is tracked and not terminal.
    fn vm_of(&self, pod: &PodKey) -> Result<String, StreamError> {
        let g = self.0.lock();
        let entry =
            g.entries.values().find(|e| PodKey::of(&e.pod) == *pod).ok_or_else(|| StreamError::NoPod(pod.clone()))?;
        match &entry.terminal {
            Some(t) => Err(StreamError::NotRunning { pod: pod.clone(), phase: format!("{t:?}") }),
            None => Ok(entry.vm.id.clone()),
        }
    }
}

fn unavailable(pod: &PodKey, what: &str, e: &BackendError) -> StreamError {
    StreamError::Unavailable(format!("{what} of pod {pod}: {}", vnode::error_chain(e)))
}

#[async_trait::async_trait]
impl PodStreams for CocoonProvider {
    async fn dial_agent(&self, pod: &PodKey) -> Result<AgentIo, StreamError> {
        let id = self.vm_of(pod)?;
        self.0.backend.dial_agent(&id).await.map_err(|e| unavailable(pod, "the guest agent", &e))
    }

    async fn container_logs(&self, pod: &PodKey, query: &ValidLogQuery) -> Result<LogBody, StreamError> {
        let id = self.vm_of(pod)?;
        let log = self.0.backend.console_log(&id).await.map_err(|e| unavailable(pod, "the console", &e))?;
        Ok(vmm::console::read_log(&log, query).boxed())
    }
}

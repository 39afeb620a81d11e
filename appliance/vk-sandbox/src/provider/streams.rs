//! The Pods' streams for the kubelet port (logs, exec, attach, port-forward): not wired to the
//! VMs yet (issue #15), so every stream is refused with 502 and says so.

use vnode::streams::{AgentIo, LogBody, PodStreams, StreamError, ValidLogQuery};
use vnode::PodKey;

use super::SandboxProvider;

const NOT_WIRED: &str = "not wired yet: this node cannot stream logs, exec, attach or port-forward to its VMs";

#[async_trait::async_trait]
impl PodStreams for SandboxProvider {
    async fn dial_agent(&self, _: &PodKey) -> Result<AgentIo, StreamError> {
        Err(StreamError::Unavailable(NOT_WIRED.into()))
    }

    async fn container_logs(&self, _: &PodKey, _: &ValidLogQuery) -> Result<LogBody, StreamError> {
        Err(StreamError::Unavailable(NOT_WIRED.into()))
    }
}

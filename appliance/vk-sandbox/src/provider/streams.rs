//! The Pods' streams for the kubelet port (`kubectl logs/exec/attach/port-forward`): each Pod's
//! settled claim, reached through sandboxd with the claim's own token: the agent relay
//! (`GET …/agent`, `Upgrade: silkd`) for exec and port-forward, the console route
//! (`GET …/console`, a Chrysalis extension) for logs and attach. vnode has already checked that
//! the Pod is this node's, Running, and names one of its containers.

use futures::StreamExt as _;
use kstream::logs::LogQuery;
use vnode::streams::{AgentIo, LogBody, PodStreams, StreamError, ValidLogQuery};
use vnode::PodKey;

use super::SandboxProvider;
use crate::sandboxd::SandboxdError;

impl SandboxProvider {
    /// The sandbox id and token of `pod`'s settled claim.
    fn claim_of(&self, pod: &PodKey) -> Result<(String, String), StreamError> {
        let key = pod.to_string();
        let g = self.lock();
        match g.claims.get(&key) {
            Some(c) if g.settled(&key) => Ok((c.id.clone(), c.token.clone())),
            Some(_) => {
                Err(StreamError::NotRunning { pod: pod.clone(), phase: "its sandbox claim is being verified".into() })
            }
            None => Err(StreamError::NoPod(pod.clone())),
        }
    }
}

/// What sandboxd's refusal means for the kubectl user.
fn unavailable(pod: &PodKey, what: &str, e: &SandboxdError) -> StreamError {
    StreamError::Unavailable(format!("{what} of pod {pod} through sandboxd: {}", vnode::error_chain(e)))
}

#[async_trait::async_trait]
impl PodStreams for SandboxProvider {
    async fn dial_agent(&self, pod: &PodKey) -> Result<AgentIo, StreamError> {
        let (id, token) = self.claim_of(pod)?;
        let io = self.sandboxd.agent(&id, &token).await.map_err(|e| unavailable(pod, "the guest agent", &e))?;
        Ok(Box::new(io))
    }

    async fn container_logs(&self, pod: &PodKey, query: &ValidLogQuery) -> Result<LogBody, StreamError> {
        let (id, token) = self.claim_of(pod)?;
        let body = self
            .sandboxd
            .console(&id, &token, &LogQuery::from(query))
            .await
            .map_err(|e| unavailable(pod, "the console", &e))?;
        Ok(body.boxed())
    }
}

//! `kubectl top` for sandbox Pods: [`vnode::PodMetrics`] over sandboxd's `…/stats` of each
//! Pod's settled claim (its Chrysalis extension fields, `cpu_usage_nanos` and
//! `memory_working_set_bytes`). A Pod whose claim is tentative or quarantined, whose sandbox
//! sandboxd did not measure, or whose stats call failed, is left out. A few calls run at a time.
//! The VM is reported as the Pod's first container.

use std::time::SystemTime;

use futures::StreamExt as _;
use vnode::{PodKey, PodMetrics, PodUsage};

use super::SandboxProvider;

/// How many `…/stats` calls run at once.
const CONCURRENT_STATS: usize = 8;

/// What one Pod's measurement needs: its key, UID, container, sandbox id and claim time.
struct Measured {
    pod: PodKey,
    uid: String,
    container: String,
    id: String,
    started_at: Option<SystemTime>,
}

#[async_trait::async_trait]
impl PodMetrics for SandboxProvider {
    async fn pod_usage(&self) -> Vec<PodUsage> {
        let wanted: Vec<Measured> = {
            let g = self.lock();
            g.pods
                .iter()
                .filter(|(key, _)| g.settled(key))
                .filter_map(|(key, pod)| {
                    let claim = g.claims.get(key)?;
                    let container = pod.spec.as_ref()?.containers.first()?.name.clone();
                    Some(Measured {
                        pod: PodKey::of(pod),
                        uid: pod.metadata.uid.clone().unwrap_or_default(),
                        container,
                        id: claim.id.clone(),
                        started_at: claim.claimed_at.map(SystemTime::from),
                    })
                })
                .collect()
        };
        futures::stream::iter(wanted)
            .map(|m| async move {
                let stats = match self.sandboxd.stats(&m.id).await {
                    Ok(Some(s)) => s,
                    Ok(None) => return None,
                    Err(e) => {
                        tracing::debug!(pod = %m.pod, sandbox = %m.id, error = %vnode::error_chain(&e), "no stats");
                        return None;
                    }
                };
                Some(PodUsage {
                    cpu_usage_nanos: stats.cpu_usage_nanos?,
                    memory_working_set_bytes: stats.memory_working_set_bytes?,
                    measured_at: humantime::parse_rfc3339(&stats.measured_at).unwrap_or_else(|_| SystemTime::now()),
                    pod: m.pod,
                    uid: m.uid,
                    container: m.container,
                    started_at: m.started_at,
                })
            })
            .buffer_unordered(CONCURRENT_STATS)
            .filter_map(std::future::ready)
            .collect()
            .await
    }
}

//! DeletePod: the [`crate::authority`] verdict decides. Release → sandboxd release (404 =
//! converged; any other error keeps everything and fails the call); Preserve → only the Pod
//! entry goes, and the claim waits for a same-name replacement or the owner recheck.

use k8s_openapi::api::core::v1::Pod;
use vnode::kit::uid_of;
use vnode::PodKey;

use super::error::SandboxProviderError;
use super::table::SandboxProvider;
use crate::authority::{self, Lookup, Verdict};

impl SandboxProvider {
    #[tracing::instrument(name = "delete_pod", skip_all, fields(pod = %PodKey::of(pod), claim = tracing::field::Empty))]
    pub(super) async fn delete(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        let (rec, tentative) = {
            let mut g = self.lock();
            if let Some(cur) = g.pods.get(&key) {
                if uid_of(cur) != uid {
                    tracing::debug!(%uid, "ignoring a delete for a previous pod generation");
                    return Ok(());
                }
            }
            let Some(rec) = g.claims.get(&key).cloned() else {
                g.pods.remove(&key);
                return Ok(());
            };
            if !g.pods.contains_key(&key) && !rec.pod_uid.is_empty() && rec.pod_uid != uid {
                tracing::debug!(%uid, "ignoring a delete: the claim belongs to another pod generation");
                return Ok(());
            }
            (rec, g.tentative.contains(&key))
        };
        tracing::Span::current().record("claim", rec.id.as_str());
        let owner = authority::controller_owner(pod).or_else(|| rec.owner.clone());
        let decision = if tentative {
            authority::Decision {
                verdict: Verdict::Release,
                reason: "the claim was never recorded: the pod never ran on it".into(),
            }
        } else {
            let lookup = match &owner {
                Some(o) => self.owners.lookup(&PodKey::of(pod).namespace, o).await,
                None => Lookup::NoClient, // not consulted for a bare pod
            };
            authority::verdict(owner.as_ref(), &lookup)
        };
        match decision.verdict {
            Verdict::Release => {
                self.sandboxd.release(&rec.id, &rec.token).await.map_err(|source| SandboxProviderError::Release {
                    key: key.clone(),
                    id: rec.id.clone(),
                    source: Box::new(source),
                })?;
                self.lock().withdraw(&key, &rec.id);
                tracing::info!(reason = %decision.reason, "released the sandbox");
                self.changed();
                self.persist_logged("releasing a claim").await;
            }
            Verdict::Preserve => {
                {
                    let mut g = self.lock();
                    g.pods.remove(&key);
                    g.rechecks.remove(&key);
                    if let (Some(c), Some(o)) = (g.claims.get_mut(&key), owner) {
                        if c.id == rec.id {
                            c.owner = Some(o);
                        }
                    }
                }
                tracing::info!(reason = %decision.reason, "preserved the sandbox for a replacement pod");
                self.changed();
                self.persist_logged("preserving a claim").await;
            }
        }
        Ok(())
    }
}

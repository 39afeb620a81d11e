//! The sync-from-k8s handler (rules 1–5 of [`crate::sync`]): the provider call the rules
//! decide, its events, and the `ProviderFailed` status when a create or update fails.

use std::time::Duration;

use foundation::error_chain as chain;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use tracing::{debug, info, warn};

use super::state::{accepted_hash, other_uid, uid, Controller, SyncError};
use crate::error::is_not_found;
use crate::events;
use crate::provider::{PodKey, ProviderError};
use crate::status::lookup;
use crate::sync::{decide, failure_phase, Action};

impl Controller {
    /// The sync-from-k8s handler (rules 1–5).
    pub(crate) async fn sync(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(pod) = lookup(&self.store, key) else {
            if let Some(pp) = self.provider.get_pod(key) {
                info!("the pod is gone from the API; deleting it in the provider");
                self.provider.delete_pod(&pp).await.map_err(|source| SyncError::Provider { op: "delete", source })?;
            }
            return Ok(());
        };
        let pod: Pod = (*pod).clone();
        let mut known = self.provider.get_pod(key);
        if let Some(pp) = known.as_ref().filter(|pp| other_uid(pp, &pod)) {
            info!("the provider tracks an earlier pod with this name; deleting that one first");
            self.provider.delete_pod(pp).await.map_err(|source| SyncError::Provider { op: "delete", source })?;
            known = None;
        }
        match decide(&pod, known.is_some()) {
            Action::ForceDelete => {
                debug!("deleting: no container runs; force-deleting from the API");
                self.schedule_force_delete(key, &pod, Duration::ZERO);
                Ok(())
            }
            Action::DeleteInProvider { grace } => {
                let u = uid(&pod).unwrap_or_default().to_string();
                let done = self.provider_deleted.lock().contains(&u);
                if !done {
                    match self.provider.delete_pod(&pod).await {
                        Ok(()) => {
                            info!("deleted the pod in the provider");
                            self.recorder.normal(&pod, events::DELETE_SUCCESS, "Delete pod in provider successfully");
                            self.provider_deleted.lock().insert(u);
                        }
                        Err(e) => {
                            self.recorder.warning(&pod, events::DELETE_FAILED, &chain(&e));
                            return Err(SyncError::Provider { op: "delete", source: e });
                        }
                    }
                }
                self.schedule_force_delete(key, &pod, grace);
                Ok(())
            }
            Action::Skip => Ok(()),
            Action::Create => match self.timed_create(&pod).await {
                Ok(()) => {
                    info!("created the pod in the provider");
                    self.accepted.lock().insert(key.clone(), accepted_hash(&pod));
                    self.recorder.normal(&pod, events::CREATE_SUCCESS, "Create pod in provider successfully");
                    Ok(())
                }
                Err(e) => self.provider_failed(&pod, "create", e).await,
            },
            Action::Update => match self.provider.update_pod(&pod).await {
                Ok(()) => {
                    debug!("updated the pod in the provider");
                    let hash = accepted_hash(&pod);
                    let before = self.accepted.lock().insert(key.clone(), hash);
                    if before != Some(hash) {
                        self.recorder.normal(&pod, events::UPDATE_SUCCESS, "Update pod in provider successfully");
                    }
                    Ok(())
                }
                Err(e) => self.provider_failed(&pod, "update", e).await,
            },
        }
    }

    /// `create_pod`, its duration recorded in the runtime's metrics.
    async fn timed_create(&self, pod: &Pod) -> Result<(), ProviderError> {
        let started = std::time::Instant::now();
        let result = self.provider.create_pod(pod).await;
        self.metrics.observe_create(started.elapsed(), result.is_ok());
        result
    }

    fn schedule_force_delete(&self, key: &PodKey, pod: &Pod, after: Duration) {
        let Some(u) = uid(pod) else { return };
        self.pending_deletes.lock().insert(key.clone(), u.to_string());
        self.delete_q.add_after(key.clone(), after);
    }

    /// Rule 5: `ProviderFailed` status (Pending, or Failed under `restartPolicy: Never`) and a
    /// Warning event; Pending is retried with backoff, Failed is terminal.
    async fn provider_failed(&self, pod: &Pod, op: &'static str, e: ProviderError) -> Result<(), SyncError> {
        let message = chain(&e);
        let phase = failure_phase(pod);
        warn!(error = %message, phase, "provider {op} failed");
        let reason = if op == "create" { events::CREATE_FAILED } else { events::UPDATE_FAILED };
        self.recorder.warning(pod, reason, &message);
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        // metadata.uid in the patch makes it fail on a re-created pod of the same name.
        let patch = serde_json::json!({
            "metadata": {"uid": uid(pod)},
            "status": {"phase": phase, "reason": "ProviderFailed", "message": message},
        });
        match self.pods(&namespace).patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) if phase == "Failed" => {
                info!("restartPolicy Never: the pod is Failed for good");
                return Ok(());
            }
            Ok(_) => {}
            Err(err) if is_not_found(&err) => return Ok(()),
            Err(err) => warn!(error = %err, "could not set the ProviderFailed status"),
        }
        Err(SyncError::Provider { op, source: e })
    }
}

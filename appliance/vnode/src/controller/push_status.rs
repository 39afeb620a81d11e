//! The status-from-provider handler: a provider's pushed status, planned by
//! [`crate::status::plan`] against the informer's copy, written through `pods/status` (one
//! re-read on a conflict).

use kube::api::{DeleteParams, PostParams, Preconditions};
use tracing::{debug, info};

use super::state::{api_err, Controller, SyncError};
use crate::error::{is_conflict, is_not_found};
use crate::provider::PodKey;
use crate::status::{self, lookup, PushAction};

impl Controller {
    /// The status-from-provider handler.
    pub(crate) async fn push_status(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(pushed) = self.pushes.get(key) else { return Ok(()) };
        let api_pod = lookup(&self.store, key);
        let action = status::plan(api_pod.as_deref(), &pushed, k8s_openapi::jiff::Timestamp::now());
        let pods = self.pods(&key.namespace);
        match action {
            PushAction::Ignore(why) => {
                debug!(why, "status push not written");
                Ok(())
            }
            PushAction::DeleteApiPod { uid, grace } => {
                info!("the provider marked the pod deleted; deleting it from the API");
                let params = DeleteParams {
                    grace_period_seconds: grace,
                    preconditions: Some(Preconditions { uid, resource_version: None }),
                    ..DeleteParams::default()
                };
                match pods.delete(&key.name, &params).await {
                    Err(e) if !(is_not_found(&e) || is_conflict(&e)) => {
                        Err(SyncError::Api { what: "deleting the pod the provider marked deleted", source: e })
                    }
                    _ => Ok(()),
                }
            }
            PushAction::UpdateStatus(obj) => {
                match pods.replace_status(&key.name, &PostParams::default(), &obj).await {
                    Ok(_) => {
                        debug!("updated the pod status");
                        return Ok(());
                    }
                    Err(e) if is_not_found(&e) => return Ok(()),
                    Err(e) if is_conflict(&e) => debug!("status update conflicted; re-reading the pod"),
                    Err(e) => return Err(api_err("updating the pod status")(e)),
                }
                let fresh = pods.get_opt(&key.name).await.map_err(api_err("re-reading the pod"))?;
                match status::plan(fresh.as_ref(), &pushed, k8s_openapi::jiff::Timestamp::now()) {
                    PushAction::UpdateStatus(obj) => {
                        match pods.replace_status(&key.name, &PostParams::default(), &obj).await {
                            Err(e) if !is_not_found(&e) => Err(api_err("updating the pod status")(e)),
                            _ => Ok(()),
                        }
                    }
                    // Anything else: the next informer event or push decides.
                    _ => Ok(()),
                }
            }
        }
    }
}

//! The delete-from-k8s handler: the force-delete of a Pod the sync rules finished with (grace
//! 0, UID precondition; NotFound and Conflict mean done).

use kube::api::{DeleteParams, Preconditions};
use tracing::info;

use super::state::{uid, Controller, SyncError};
use crate::error::{is_conflict, is_not_found};
use crate::provider::PodKey;
use crate::status::lookup;

impl Controller {
    /// The delete-from-k8s handler: grace 0, UID precondition.
    pub(crate) async fn force_delete(&self, key: &PodKey) -> Result<(), SyncError> {
        let Some(want) = self.pending_deletes.lock().get(key).cloned() else {
            return Ok(());
        };
        let forget = || {
            let mut pending = self.pending_deletes.lock();
            if pending.get(key) == Some(&want) {
                pending.remove(key);
            }
        };
        match lookup(&self.store, key) {
            Some(pod) if uid(&pod) == Some(want.as_str()) => {}
            _ => {
                forget();
                return Ok(());
            }
        }
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: Some(want.clone()), resource_version: None }),
            ..DeleteParams::default()
        };
        match self.pods(&key.namespace).delete(&key.name, &params).await {
            Ok(_) => {
                info!("deleted the pod from the API");
                forget();
                Ok(())
            }
            Err(e) if is_not_found(&e) || is_conflict(&e) => {
                forget();
                Ok(())
            }
            Err(e) => Err(SyncError::Api { what: "deleting the pod from the API", source: e }),
        }
    }
}

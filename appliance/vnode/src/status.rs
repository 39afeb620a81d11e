//! Status pushed by the provider ([`crate::PodNotifier`]) → `pods/status`.
//!
//! Each push is kept as the key's latest copy (older pushes never overwrite newer ones) and the
//! key goes on the status queue once the informer knows the pod (checked at once, then every
//! 151 ms up to 20 times, as virtual-kubelet does; a push for a pod that never shows up is
//! dropped). The worker then [`plan`]s:
//!
//! - pod gone from the API, or the push is for another UID → nothing;
//! - API phase `Failed`/`Succeeded` → nothing (Failed is terminal);
//! - the push carries `deletionTimestamp` and the API pod does not → delete the API pod (UID
//!   precondition; grace 0 once that time has passed, else the pushed grace);
//! - else replace `pods/status` (`PUT`, the API's resourceVersion) with the API pod whose
//!   `status` is the pushed one and whose annotations include the pushed annotations (added or
//!   changed; removed only when the push names them in
//!   [`crate::pod_status::REMOVE_ANNOTATIONS`]). On a Conflict the pod is re-read and the PUT tried once more;
//!   a second failure retries through the queue's backoff.
//!
//! Annotations go through `pods/status` because a node identity may not update the pod object
//! itself (the Node authorizer only grants it `pods/status` update/patch and pod delete), while
//! the pod status strategy keeps metadata annotations from a status update and NodeRestriction
//! only refuses *label* changes there ("cannot update labels through pod status").

use crate::pod_status::REMOVE_ANNOTATIONS;
use crate::provider::PodKey;
use crate::queue::WorkQueue;
use crate::sync::is_finished;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{ObjectRef, Store};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// Wait between checks for a pushed pod to appear in the informer.
pub const NOTIFY_RETRY: Duration = Duration::from_millis(151);
/// Checks before a push for an unknown pod is dropped.
pub const NOTIFY_RETRIES: u32 = 20;

/// The informer's copy of `key`.
pub(crate) fn lookup(store: &Store<Pod>, key: &PodKey) -> Option<Arc<Pod>> {
    store.get(&ObjectRef::new(&key.name).within(&key.namespace))
}

/// The latest push per key.
#[derive(Default)]
pub(crate) struct Pushes {
    latest: Mutex<HashMap<PodKey, (u64, Pod)>>,
    seq: AtomicU64,
}

impl Pushes {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PodKey, (u64, Pod)>> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `pod` unless a newer push for the key is already kept.
    fn record(&self, key: PodKey, seq: u64, pod: Pod) {
        let mut latest = self.lock();
        match latest.get(&key) {
            Some((have, _)) if *have > seq => {}
            _ => {
                latest.insert(key, (seq, pod));
            }
        }
    }

    pub(crate) fn get(&self, key: &PodKey) -> Option<Pod> {
        self.lock().get(key).map(|(_, p)| p.clone())
    }

    /// Forgets the key's pushes (the pod left the API).
    pub(crate) fn forget(&self, key: &PodKey, uid: Option<&str>) {
        let mut latest = self.lock();
        if let Some((_, p)) = latest.get(key) {
            if uid.is_none() || p.metadata.uid.as_deref().is_none_or(|u| Some(u) == uid) {
                latest.remove(key);
            }
        }
    }
}

/// What the status worker does with the latest push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushAction {
    /// Nothing to write (why).
    Ignore(&'static str),
    /// The provider marked the pod deleted: delete the API pod with this grace (UID precondition).
    DeleteApiPod { uid: Option<String>, grace: Option<u32> },
    /// `PUT pods/status` with this object.
    UpdateStatus(Box<Pod>),
}

/// Decides what a push means for the API pod (pure).
pub fn plan(api: Option<&Pod>, pushed: &Pod, now: Timestamp) -> PushAction {
    let Some(api) = api else { return PushAction::Ignore("the pod is gone from the API") };
    if let (Some(a), Some(p)) = (api.metadata.uid.as_deref(), pushed.metadata.uid.as_deref()) {
        if a != p {
            return PushAction::Ignore("the push is for another pod with the same name");
        }
    }
    if is_finished(api) {
        return PushAction::Ignore("the pod finished (Failed/Succeeded are terminal)");
    }
    if let (Some(ts), None) = (&pushed.metadata.deletion_timestamp, &api.metadata.deletion_timestamp) {
        let grace = if ts.0 <= now {
            Some(0)
        } else {
            pushed.metadata.deletion_grace_period_seconds.map(|g| u32::try_from(g.max(0)).unwrap_or(u32::MAX))
        };
        return PushAction::DeleteApiPod { uid: api.metadata.uid.clone(), grace };
    }
    PushAction::UpdateStatus(Box::new(merged(api, pushed)))
}

/// The API pod with the pushed status and the pushed annotations (added or changed, and those
/// the push lists in [`REMOVE_ANNOTATIONS`] removed; that key itself is never written).
pub fn merged(api: &Pod, pushed: &Pod) -> Pod {
    let mut out = api.clone();
    out.status = pushed.status.clone();
    if let Some(pushed_ann) = &pushed.metadata.annotations {
        let ann = out.metadata.annotations.get_or_insert_with(Default::default);
        for (k, v) in pushed_ann {
            if k == REMOVE_ANNOTATIONS {
                for gone in v.split(',').map(str::trim).filter(|g| !g.is_empty()) {
                    ann.remove(gone);
                }
            } else if ann.get(k) != Some(v) {
                ann.insert(k.clone(), v.clone());
            }
        }
        ann.remove(REMOVE_ANNOTATIONS);
    }
    out
}

/// Feeds provider pushes to the status queue until `cancel` or the channel closes.
pub(crate) async fn dispatch(
    mut rx: mpsc::UnboundedReceiver<Pod>,
    store: Store<Pod>,
    pushes: Arc<Pushes>,
    queue: Arc<WorkQueue<PodKey>>,
    cancel: CancellationToken,
) {
    loop {
        let pod = tokio::select! {
            _ = cancel.cancelled() => return,
            p = rx.recv() => match p { Some(p) => p, None => return },
        };
        let key = PodKey::of(&pod);
        let seq = pushes.next_seq();
        if lookup(&store, &key).is_some() {
            pushes.record(key.clone(), seq, pod);
            queue.add(key);
            continue;
        }
        let (store, pushes, queue, cancel) = (store.clone(), pushes.clone(), queue.clone(), cancel.clone());
        tokio::spawn(async move {
            for _ in 0..NOTIFY_RETRIES {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(NOTIFY_RETRY) => {}
                }
                if lookup(&store, &key).is_some() {
                    pushes.record(key.clone(), seq, pod);
                    queue.add(key);
                    return;
                }
            }
            debug!(pod = %key, "dropped a status push for a pod the informer does not know");
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::SignedDuration;
    use std::collections::BTreeMap;

    fn pod(uid: &str, phase: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.namespace = Some("ns".into());
        p.metadata.uid = Some(uid.into());
        p.metadata.resource_version = Some("7".into());
        p.status = Some(PodStatus { phase: Some(phase.into()), ..Default::default() });
        p
    }

    #[test]
    fn a_push_removes_the_annotations_it_lists() {
        let mut api = pod("u", "Pending");
        api.metadata.annotations =
            Some(BTreeMap::from([("msg".to_string(), "old".to_string()), ("keep".to_string(), "k".to_string())]));
        let mut pushed = crate::pod_status::pushed(&pod("u", "Running"), PodStatus::default(), [("new", "n")]);
        crate::pod_status::remove_annotations(&mut pushed, &["msg", "absent"]);
        let PushAction::UpdateStatus(out) = plan(Some(&api), &pushed, Timestamp::now()) else {
            panic!("expected a status update")
        };
        let ann = out.metadata.annotations.expect("annotations");
        assert_eq!(ann.keys().map(String::as_str).collect::<Vec<_>>(), ["keep", "new"], "{ann:?}");
    }

    #[test]
    fn a_push_replaces_the_status_and_adds_annotations_on_the_api_copy() {
        let mut api = pod("u", "Pending");
        api.metadata.annotations =
            Some(BTreeMap::from([("keep".to_string(), "api".to_string()), ("claim".to_string(), "old".to_string())]));
        let mut pushed = pod("u", "Running");
        pushed.metadata.resource_version = Some("1".into());
        pushed.metadata.annotations = Some(BTreeMap::from([("claim".to_string(), "c-1".to_string())]));
        let PushAction::UpdateStatus(out) = plan(Some(&api), &pushed, Timestamp::now()) else {
            panic!("expected a status update")
        };
        assert_eq!(out.metadata.resource_version.as_deref(), Some("7"), "the API's resourceVersion is used");
        assert_eq!(out.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"));
        let ann = out.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(ann["claim"], "c-1");
        assert_eq!(ann["keep"], "api", "annotations the push lacks are kept");
    }

    #[test]
    fn finished_gone_and_stale_pods_are_not_updated() {
        let pushed = pod("u", "Running");
        assert!(matches!(plan(None, &pushed, Timestamp::now()), PushAction::Ignore(_)));
        assert!(matches!(plan(Some(&pod("u", "Failed")), &pushed, Timestamp::now()), PushAction::Ignore(_)));
        assert!(matches!(plan(Some(&pod("u", "Succeeded")), &pushed, Timestamp::now()), PushAction::Ignore(_)));
        assert!(matches!(plan(Some(&pod("other", "Running")), &pushed, Timestamp::now()), PushAction::Ignore(_)));
    }

    #[test]
    fn a_pushed_deletion_deletes_the_api_pod() {
        let now = Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1000);
        let mut pushed = pod("u", "Running");
        pushed.metadata.deletion_timestamp = Some(Time(now - SignedDuration::from_secs(1)));
        pushed.metadata.deletion_grace_period_seconds = Some(30);
        assert_eq!(
            plan(Some(&pod("u", "Running")), &pushed, now),
            PushAction::DeleteApiPod { uid: Some("u".into()), grace: Some(0) },
            "a deletion time in the past means now"
        );
        pushed.metadata.deletion_timestamp = Some(Time(now + SignedDuration::from_secs(30)));
        assert_eq!(
            plan(Some(&pod("u", "Running")), &pushed, now),
            PushAction::DeleteApiPod { uid: Some("u".into()), grace: Some(30) }
        );
        // Already being deleted in the API: just the status.
        let mut api = pod("u", "Running");
        api.metadata.deletion_timestamp = Some(Time(now));
        assert!(matches!(plan(Some(&api), &pushed, now), PushAction::UpdateStatus(_)));
    }

    #[test]
    fn older_pushes_never_overwrite_newer_ones() {
        let pushes = Pushes::default();
        let key = PodKey::new("ns", "p");
        let (s1, s2) = (pushes.next_seq(), pushes.next_seq());
        pushes.record(key.clone(), s2, pod("u", "Running"));
        pushes.record(key.clone(), s1, pod("u", "Pending"));
        assert_eq!(pushes.get(&key).and_then(|p| p.status).and_then(|s| s.phase).as_deref(), Some("Running"));
        pushes.forget(&key, Some("other"));
        assert!(pushes.get(&key).is_some(), "a delete of another UID keeps the push");
        pushes.forget(&key, Some("u"));
        assert!(pushes.get(&key).is_none());
    }
}

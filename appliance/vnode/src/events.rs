//! Pod events (`core/v1` Event in the pod's namespace, involvedObject = the Pod), the way
//! client-go's recorder writes them for virtual-kubelet: `Provider{Create,Update,Delete}Success`
//! (Normal, off under `disable_pod_events`) and `Provider{Create,Update,Delete}Failed`
//! (Warning). The Node authorizer's static node rules let a node identity create events.
//! Recording never blocks or fails the caller: each write runs in its own task.
//!
//! Like client-go's event correlator, a repeat of the same (pod UID, reason, message) bumps
//! `count` and `lastTimestamp` of the event already written (a merge patch) instead of
//! creating another object, so a pod failing 20 times in a row leaves one event, not 20.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tracing::{debug, warn};

pub const CREATE_SUCCESS: &str = "ProviderCreateSuccess";
pub const UPDATE_SUCCESS: &str = "ProviderUpdateSuccess";
pub const DELETE_SUCCESS: &str = "ProviderDeleteSuccess";
pub const CREATE_FAILED: &str = "ProviderCreateFailed";
pub const UPDATE_FAILED: &str = "ProviderUpdateFailed";
pub const DELETE_FAILED: &str = "ProviderDeleteFailed";

/// Longest message written (the rest is cut at a character boundary).
const MAX_MESSAGE: usize = 1024;
/// Remembered events (for aggregation); the memory is dropped whole when it grows past this.
const MAX_REMEMBERED: usize = 4096;

/// (pod UID, reason, message) → (event name, count so far).
type Seen = HashMap<(String, String, String), (String, i32)>;

/// `Normal` or `Warning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// The Event object for `pod` (pure).
pub fn build(pod: &Pod, node: &str, type_: EventType, reason: &str, message: &str, now: Timestamp) -> Event {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let mut message = message.to_string();
    if message.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    let component = format!("{node}/pod-controller");
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{name}.{:x}", now.as_nanosecond())),
            namespace: Some(namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(name),
            namespace: Some(namespace),
            uid: pod.metadata.uid.clone(),
            resource_version: pod.metadata.resource_version.clone(),
            ..Default::default()
        },
        reason: Some(reason.into()),
        message: Some(message),
        type_: Some(type_.as_str().into()),
        source: Some(EventSource { component: Some(component.clone()), host: Some(node.into()) }),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        reporting_component: Some(component),
        reporting_instance: Some(node.into()),
        ..Default::default()
    }
}

/// Writes pod events as the node.
#[derive(Clone)]
pub struct Recorder {
    client: kube::Client,
    node: String,
    normal: bool,
    seen: Arc<Mutex<Seen>>,
}

impl Recorder {
    /// `disable_normal`: record Warning events only.
    pub fn new(client: kube::Client, node: String, disable_normal: bool) -> Recorder {
        Recorder { client, node, normal: !disable_normal, seen: Arc::default() }
    }

    pub fn normal(&self, pod: &Pod, reason: &str, message: &str) {
        self.record(pod, EventType::Normal, reason, message);
    }

    pub fn warning(&self, pod: &Pod, reason: &str, message: &str) {
        self.record(pod, EventType::Warning, reason, message);
    }

    fn record(&self, pod: &Pod, type_: EventType, reason: &str, message: &str) {
        if type_ == EventType::Normal && !self.normal {
            return;
        }
        let now = Timestamp::now();
        let mut event = build(pod, &self.node, type_, reason, message, now);
        let namespace = event.metadata.namespace.clone().unwrap_or_default();
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let seen_key = (
            pod.metadata.uid.clone().unwrap_or_default(),
            reason.to_string(),
            event.message.clone().unwrap_or_default(),
        );
        let repeat = {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() >= MAX_REMEMBERED && !seen.contains_key(&seen_key) {
                seen.clear();
            }
            let name = event.metadata.name.clone().unwrap_or_default();
            let entry = seen.entry(seen_key).or_insert((name, 0));
            entry.1 += 1;
            (entry.1 > 1).then(|| entry.clone())
        };
        let pod_key = format!("{namespace}/{}", pod.metadata.name.as_deref().unwrap_or_default());
        let reason = reason.to_string();
        tokio::spawn(async move {
            if let Some((name, count)) = repeat {
                let patch = serde_json::json!({"count": count, "lastTimestamp": Time(now)});
                match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Ok(_) => {
                        debug!(pod = %pod_key, %reason, count, "event repeated");
                        return;
                    }
                    // Expired (or not written yet): write it anew under its first name.
                    Err(e) => debug!(pod = %pod_key, %reason, error = %e, "could not bump the event; creating it"),
                }
                event.metadata.name = Some(name);
                event.count = Some(count);
            }
            match api.create(&PostParams::default(), &event).await {
                Ok(_) => debug!(pod = %pod_key, %reason, "recorded event"),
                Err(e) if crate::error::is_conflict(&e) => {}
                Err(e) => warn!(pod = %pod_key, %reason, error = %e, "could not record event"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_points_at_the_pod() {
        let mut pod = Pod::default();
        pod.metadata.name = Some("p".into());
        pod.metadata.namespace = Some("ns".into());
        pod.metadata.uid = Some("u-1".into());
        let now = Timestamp::UNIX_EPOCH;
        let e = build(&pod, "vk", EventType::Warning, CREATE_FAILED, &"x".repeat(5000), now);
        assert_eq!(e.metadata.namespace.as_deref(), Some("ns"));
        assert!(e.metadata.name.as_deref().is_some_and(|n| n.starts_with("p.")));
        assert_eq!(e.involved_object.kind.as_deref(), Some("Pod"));
        assert_eq!(e.involved_object.uid.as_deref(), Some("u-1"));
        assert_eq!(e.involved_object.namespace.as_deref(), Some("ns"));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some("ProviderCreateFailed"));
        assert_eq!(e.message.as_ref().map(String::len), Some(MAX_MESSAGE));
        assert_eq!(e.source.as_ref().and_then(|s| s.host.as_deref()), Some("vk"));
        // Multibyte text is cut at a character boundary.
        let e = build(&pod, "vk", EventType::Normal, CREATE_SUCCESS, &"é".repeat(1000), now);
        assert!(e.message.as_ref().is_some_and(|m| m.len() <= MAX_MESSAGE && m.chars().all(|c| c == 'é')));
    }
}

//! Provider tests: [`FakeBackend`] + the notifier's receiving end + recorded events; no API
//! server, no VM. Most run on tokio's paused clock, so probe and watcher timings are exact.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use tokio::sync::mpsc::UnboundedReceiver;
use vnode::{PodKey, PodNotifier, Provider};

use base64::Engine;

use super::*;
use crate::annotations::*;
use crate::backend::{SnapshotRef, VmState};
use crate::config::OrphanPolicy;
use crate::events::{self, RecordedEvents};
use crate::namespaces::NamespacePolicy;
use crate::test_utils::FakeBackend;

/// The namespace of the test Pods, recorded on the VMs and snapshots they find.
const NS: Option<&str> = Some("ns");

struct Rig {
    backend: Arc<FakeBackend>,
    provider: CocoonProvider,
    pushes: UnboundedReceiver<Pod>,
    events: Arc<RecordedEvents>,
}

impl Rig {
    fn new() -> Rig {
        Rig::tuned(|_| {})
    }

    fn tuned(tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        Rig::over(Arc::new(FakeBackend::new()), tune)
    }

    fn over(backend: Arc<FakeBackend>, tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        let mut cfg = ProviderConfig::new("192.0.2.7");
        tune(&mut cfg);
        let provider = CocoonProvider::new(backend.clone(), cfg);
        let events = Arc::new(RecordedEvents::default());
        provider.set_events(events.clone());
        let (n, pushes) = PodNotifier::channel();
        provider.notify_pods(n);
        Rig { backend, provider, pushes, events }
    }

    fn drain(&mut self) -> Vec<Pod> {
        let mut out = Vec::new();
        while let Ok(p) = self.pushes.try_recv() {
            out.push(p);
        }
        out
    }

    fn last(&mut self) -> Pod {
        self.drain().pop().expect("a push")
    }

    fn vm(&self, key: &str) -> VmInfo {
        self.provider.tracked_vm(key).expect("a tracked VM")
    }
}

fn pod(name: &str, pairs: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            uid: Some(format!("uid-{name}")),
            annotations: Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                image: Some("ubuntu-dev-base".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn run_pod(name: &str, vm: &str, extra: &[(&str, &str)]) -> Pod {
    let mut pairs = vec![(VM_NAME, vm), (MANAGED, "true"), (MODE, "run"), (IMAGE, "ubuntu-dev-base")];
    pairs.extend_from_slice(extra);
    pod(name, &pairs)
}

fn clone_pod(name: &str, vm: &str, image: &str) -> Pod {
    pod(name, &[(VM_NAME, vm), (MANAGED, "true"), (IMAGE, image)])
}

fn with_uid(mut p: Pod, uid: &str) -> Pod {
    p.metadata.uid = Some(uid.into());
    p
}

fn ann(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref().and_then(|a| a.get(key)).cloned()
}

fn phase(p: &Pod) -> String {
    p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

fn key(name: &str) -> String {
    format!("ns/{name}")
}

async fn create(r: &Rig, p: &Pod) -> Result<(), String> {
    r.provider.create_pod(p).await.map_err(|e| e.to_string())
}

async fn delete(r: &Rig, p: &Pod) -> Result<(), String> {
    r.provider.delete_pod(p).await.map_err(|e| e.to_string())
}

/// Lets spawned tasks run (the clock is paused: sleeping advances it).
pub(super) async fn settle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

mod create;
mod delete;
mod hibernate;
mod hibernate_faults;
mod hibernate_guard;
mod loops;
mod metrics;
mod namespaces;

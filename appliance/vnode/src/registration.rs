//! Registering the Node (create if missing, else bring labels and status up to date) and the
//! status loop: a merge patch of `nodes/status` every `status_interval`, on
//! [`crate::NodeHandle::notify`], when the pod controller becomes ready and when the API
//! server comes back; skipped while the ping fails. A Node deleted behind our back is
//! registered again (the Lease follows its new UID).

use crate::config::NodeConfig;
use crate::error::{api_code, is_not_found, VnodeError};
use crate::node;
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Why a registration attempt did not succeed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error(transparent)]
    Fatal(VnodeError),
    #[error("talking to the API server")]
    Transient(#[source] kube::Error),
}

/// The Node's registration and status writer.
pub(crate) struct Registrar {
    api: Api<Node>,
    cfg: NodeConfig,
    ready: AtomicBool,
    transitions: Mutex<node::Transitions>,
    /// Resources the Node may list in capacity/allocatable: found at registration, or written
    /// since. Those the current status lacks are nulled by the next patch.
    listed: Mutex<BTreeSet<String>>,
    /// The registered Node's UID (the Lease's ownerRef follows it).
    uid: watch::Sender<String>,
}

impl Registrar {
    pub(crate) fn new(client: kube::Client, cfg: NodeConfig) -> Registrar {
        Registrar {
            api: Api::all(client),
            cfg,
            ready: AtomicBool::new(false),
            transitions: Mutex::new(node::Transitions::default()),
            listed: Mutex::new(BTreeSet::new()),
            uid: watch::Sender::new(String::new()),
        }
    }

    pub(crate) fn uid(&self) -> watch::Receiver<String> {
        self.uid.subscribe()
    }

    /// Marks the node Ready (the pod controller finished starting) and patches now.
    pub(crate) fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
        self.cfg.handle.notify();
    }

    fn current_status(&self) -> NodeStatus {
        let extra = self.cfg.handle.conditions().unwrap_or_else(|| self.cfg.extra_conditions.clone());
        let mut conditions: Vec<NodeCondition> = vec![node::ready_condition(self.ready.load(Ordering::SeqCst))];
        conditions.extend(extra.into_iter().filter(|c| c.type_ != "Ready"));
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let stamped = self.transitions.lock().unwrap_or_else(|p| p.into_inner()).stamp(conditions, &now);
        node::status_with(&self.cfg, stamped, &self.cfg.handle.extra_resources())
    }

    /// One registration attempt: create the Node, or bring an existing one up to date.
    pub(crate) async fn register(&self) -> Result<Node, RegisterError> {
        let name = &self.cfg.name;
        let refused = |e: &kube::Error| match e {
            kube::Error::Api(s) if s.code == 403 => {
                Some(VnodeError::NodeForbidden { node: name.clone(), message: s.message.clone() })
            }
            kube::Error::Api(s) if (400..500).contains(&s.code) && ![404, 408, 409, 429].contains(&s.code) => {
                Some(VnodeError::NodeRejected { node: name.clone(), code: s.code, message: s.message.clone() })
            }
            _ => None,
        };
        let classify = |e: kube::Error| match refused(&e) {
            Some(fatal) => RegisterError::Fatal(fatal),
            None => RegisterError::Transient(e),
        };
        let existing = self.api.get_opt(name).await.map_err(classify)?;
        let node = match existing {
            None => {
                let want = node::node(&self.cfg, self.current_status());
                match self.api.create(&PostParams::default(), &want).await {
                    Ok(created) => {
                        info!(node = %name, "registered the Node");
                        created
                    }
                    // Created by someone else in between: next attempt updates it.
                    Err(e) if api_code(&e) == Some(409) => return Err(RegisterError::Transient(e)),
                    Err(e) => return Err(classify(e)),
                }
            }
            Some(existing) => {
                info!(node = %name, "the Node exists; updating it");
                self.reconcile_existing(&existing).await;
                existing
            }
        };
        *self.listed.lock().unwrap_or_else(|p| p.into_inner()) = node::listed_resources(&node);
        self.patch_status().await.map_err(classify)?;
        self.uid.send_replace(node.metadata.uid.clone().unwrap_or_default());
        Ok(node)
    }

    async fn reconcile_existing(&self, existing: &Node) {
        let name = &self.cfg.name;
        let have = existing.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        let want_has = |t: &k8s_openapi::api::core::v1::Taint| {
            have.iter().any(|h| h.key == t.key && h.value == t.value && h.effect == t.effect)
        };
        if !self.cfg.taints.iter().all(want_has) {
            warn!(
                node = %name,
                want = ?self.cfg.taints,
                have = ?have,
                "the existing Node lacks configured taints; NodeRestriction forbids a node from changing its \
                 taints, so delete the Node (as an admin) to register it afresh, or taint it as an admin"
            );
        }
        if let Some(patch) = node::labels_patch(existing, &self.cfg) {
            if let Err(e) = self.api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                warn!(node = %name, error = %e, "could not update the Node's labels");
            }
        }
    }

    /// Patches `nodes/status` with the current status (nulling the resources it no longer has).
    pub(crate) async fn patch_status(&self) -> Result<(), kube::Error> {
        let status = self.current_status();
        let removed = node::removed_resources(&self.listed.lock().unwrap_or_else(|p| p.into_inner()), &status);
        let patch = node::status_patch(&status, &removed);
        let result = self.api.patch_status(&self.cfg.name, &PatchParams::default(), &Patch::Merge(&patch)).await;
        let written = node::listed_resources(&Node { status: Some(status), ..Node::default() });
        let mut listed = self.listed.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(_) => *listed = written,
            // It may have been applied all the same: what it would have written may be listed.
            Err(_) => listed.extend(written),
        }
        drop(listed);
        result?;
        debug!(node = %self.cfg.name, "patched the Node status");
        Ok(())
    }

    /// Registers, retrying transient failures (1 s doubling to 30 s) until `cancel`.
    /// `Ok(None)` = cancelled first.
    pub(crate) async fn register_until_done(&self, cancel: &CancellationToken) -> Result<Option<Node>, VnodeError> {
        let mut delay = Duration::from_secs(1);
        loop {
            match self.register().await {
                Ok(node) => return Ok(Some(node)),
                Err(RegisterError::Fatal(e)) => return Err(e),
                Err(RegisterError::Transient(e)) => {
                    warn!(node = %self.cfg.name, error = %e, retry_in = ?delay, "registering the Node failed; retrying");
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(30));
        }
    }

    /// Patches the status periodically and on demand until `cancel`.
    pub(crate) async fn status_loop(
        self: Arc<Self>,
        interval: Duration,
        mut health: watch::Receiver<bool>,
        cancel: CancellationToken,
    ) {
        let mut failing = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
                _ = self.cfg.handle.notified() => {}
                changed = health.changed() => if changed.is_err() { return },
            }
            if !*health.borrow_and_update() {
                continue;
            }
            let result = match self.patch_status().await {
                Err(e) if is_not_found(&e) => {
                    warn!(node = %self.cfg.name, "the Node is gone; registering it again");
                    self.register().await.map(drop).map_err(|e| e.to_string())
                }
                other => other.map_err(|e| e.to_string()),
            };
            match result {
                Ok(()) if failing => {
                    info!(node = %self.cfg.name, "Node status updates work again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    warn!(node = %self.cfg.name, error = %e, "Node status update failed (retrying every interval)");
                    failing = true;
                }
                Err(e) => debug!(node = %self.cfg.name, error = %e, "Node status update still failing"),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::{json, Value};
    use std::collections::BTreeMap;

    use crate::testing::{path_of, Calls};

    /// An API server holding one Node that already lists `warm-old` (left by a previous run).
    fn fake_api(calls: Calls) -> kube::Client {
        crate::testing::fake_api(calls, |_, _, _| {
            let node = json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "vk-test", "uid": "n1", "labels": {"type": "virtual-kubelet",
                    "kubernetes.io/hostname": "vk-test"}},
                "status": {"capacity": {"pods": "10", "example.com/warm-old": "1"},
                    "allocatable": {"pods": "10", "example.com/warm-old": "1"}}});
            (200, node)
        })
    }

    fn status_patches(calls: &Calls) -> Vec<Value> {
        let c = calls.lock().unwrap();
        c.iter()
            .filter(|(m, p, _)| m == "PATCH" && path_of(p).ends_with("/status"))
            .map(|(_, _, b)| b["status"].clone())
            .collect()
    }

    #[tokio::test]
    async fn extra_resources_are_written_and_a_withdrawn_one_is_nulled() {
        let calls = Calls::default();
        let cfg = NodeConfig {
            name: "vk-test".into(),
            capacity: BTreeMap::from([("pods".into(), Quantity("10".into()))]),
            ..Default::default()
        };
        let handle = cfg.handle.clone();
        let q = |n: &str| Quantity(n.into());
        handle.set_extra_resources(BTreeMap::from([
            ("example.com/warm-a".into(), q("2")),
            ("example.com/warm-b".into(), q("1")),
        ]));
        let r = Registrar::new(fake_api(calls.clone()), cfg);
        r.register().await.unwrap();
        let first = status_patches(&calls).pop().unwrap();
        assert_eq!(first["capacity"]["example.com/warm-a"], "2");
        assert_eq!(first["allocatable"]["example.com/warm-b"], "1");
        assert!(first["capacity"]["example.com/warm-old"].is_null(), "a previous run's resource goes: {first}");
        assert!(first["capacity"].as_object().unwrap().contains_key("example.com/warm-old"));

        // Pool b is gone: the next patch nulls it and keeps a.
        handle.set_extra_resources(BTreeMap::from([("example.com/warm-a".into(), q("3"))]));
        r.patch_status().await.unwrap();
        let second = status_patches(&calls).pop().unwrap();
        assert_eq!(second["capacity"]["example.com/warm-a"], "3");
        assert!(
            second["capacity"]["example.com/warm-b"].is_null() && second["allocatable"]["example.com/warm-b"].is_null()
        );
        assert_eq!(second["capacity"]["pods"], "10");
        // Written once as removed: not nulled again.
        r.patch_status().await.unwrap();
        let third = status_patches(&calls).pop().unwrap();
        assert!(!third["capacity"].as_object().unwrap().contains_key("example.com/warm-b"), "{third}");
        assert!(!third["capacity"].as_object().unwrap().contains_key("example.com/warm-old"), "{third}");
    }
}

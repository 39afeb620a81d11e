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
    /// Resources to remove from capacity/allocatable (found on the existing Node).
    removed: Mutex<Vec<String>>,
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
            removed: Mutex::new(Vec::new()),
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
        node::status(&self.cfg, stamped)
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
        *self.removed.lock().unwrap_or_else(|p| p.into_inner()) = node::removed_resources(&node, &self.cfg);
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

    /// Patches `nodes/status` with the current status.
    pub(crate) async fn patch_status(&self) -> Result<(), kube::Error> {
        let removed = self.removed.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let patch = node::status_patch(&self.current_status(), &removed);
        self.api.patch_status(&self.cfg.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
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

//! The fleet side of a box (issue #19): what this node tells the cluster, and what it tells its
//! sandboxd about the other boxes. One loop ([`Publisher::run`]) does three things per pass:
//!
//! 1. **Warm capacity** (`--advertise-warm-capacity`, default on): per pool, the extended
//!    resource `sandbox.cocoonstack.io/warm-<template>-<net>-<size>` on the Node's capacity and
//!    allocatable ([`warm`]), through [`vnode::NodeHandle::set_extra_resources`] (the Node's
//!    status is patched only when a count changed).
//! 2. **NodeInventory** (`--publish-inventory`, default off): the cluster-scoped object named
//!    after the node ([`object`]), applied server-side as field manager `vk-sandbox` (forced),
//!    owned by the Node so that deleting the Node deletes it.
//! 3. **Peers** (with 2): every `NodeInventory` is listed; the fresh ones of other boxes become
//!    the [`sandboxd_api::PeerReport`] `PUT` to sandboxd ([`peers`]), which redirects a warm
//!    miss of an SDK claim to them.
//!
//! # Expected flow
//! A pass reads sandboxd's `GET /v1/info` and `GET /v1/sandboxes` (root token), sets the warm
//! capacity, then (publishing) reads the Node's UID, applies the object, lists the objects and
//! sends the report. Passes run every `--publish-interval` (30 s) and, coalesced, a second
//! after the provider's claims change ([`crate::SandboxProvider::changes`]: a claim, an
//! adoption, a release).
//!
//! # Guarantees
//! * A failed sandboxd read changes nothing (the previous capacities stay; nothing is applied),
//!   until sandboxd has not answered for a stale-after window: then every warm capacity is set
//!   to 0, so that nothing is placed here on old news.
//! * A peer is believed only where its Node vouches for it ([`peers`]: the Node of the object's
//!   name exists, owns it, and lists the host of its address); a Node that cannot be read
//!   vouches for nothing.
//! * A failed apply of this node's object still lists the others and sends the report (the
//!   error is returned after); a failed listing sends no report: the previous one runs out by
//!   itself after `--inventory-stale-after`; an empty fleet sends an empty report.
//! * The node keeps serving Pods whatever happens here.
//!
//! # Caveats
//! * A cluster without the CRD (404), or a node not granted the objects (403), is logged once
//!   at info and tried again every minute; warm capacity is still advertised meanwhile.
//! * Before the Node is registered the object goes out without an owner (the next pass adds
//!   it); a Node seen before and missing now skips the apply until vnode registers it again.
//! * A refill is seen at the next interval (sandboxd does not tell the provider).

pub mod object;
pub mod peers;
pub mod warm;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use kube::Api;
use vnode::error_chain;
use vnode::kit::Locked;

use crate::provider::SandboxProvider;
use crate::sandboxd::{SandboxdClient, SandboxdError};

/// What the loop does and how often.
#[derive(Debug, Clone)]
pub struct InventoryConfig {
    /// The node's name (the object's name and `node`).
    pub node_name: String,
    /// sandboxd's advertise address (`address`, and every entry's `addr`).
    pub address: String,
    /// Publish the `NodeInventory` and send the peer report.
    pub publish: bool,
    /// Advertise warm capacity as extended resources on the Node.
    pub advertise_warm: bool,
    /// The pass period.
    pub interval: Duration,
    /// A peer published longer ago is left out; also the report's `ttl_seconds`.
    pub stale_after: Duration,
    /// How long after a change the pass runs (changes meanwhile join it).
    pub settle: Duration,
    /// How long to wait before trying again a missing CRD or a refused object.
    pub absent_retry: Duration,
}

impl InventoryConfig {
    /// Upstream's defaults: no publishing, warm capacity on, 30 s passes, 90 s staleness.
    pub fn new(node_name: String, address: String) -> InventoryConfig {
        InventoryConfig {
            node_name,
            address,
            publish: false,
            advertise_warm: true,
            interval: Duration::from_secs(30),
            stale_after: Duration::from_secs(90),
            settle: Duration::from_secs(1),
            absent_retry: Duration::from_secs(60),
        }
    }

    /// Whether the loop has anything to do.
    pub fn enabled(&self) -> bool {
        self.publish || self.advertise_warm
    }
}

/// Why a pass stopped short.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// `GET /v1/info` or `GET /v1/sandboxes` failed.
    #[error("reading sandboxd's pools and sandboxes")]
    Sandboxd(#[source] SandboxdError),
    /// The Node could not be read (for its UID).
    #[error("reading Node {node}")]
    Node {
        node: String,
        #[source]
        source: kube::Error,
    },
    /// The object could not be applied.
    #[error("applying NodeInventory {node}")]
    Apply {
        node: String,
        #[source]
        source: kube::Error,
    },
    /// The objects could not be listed (no report is sent).
    #[error("listing NodeInventory objects")]
    List(#[source] kube::Error),
    /// sandboxd refused the report.
    #[error("sending the peer report to sandboxd")]
    Peers(#[source] SandboxdError),
}

impl InventoryError {
    /// A missing CRD (404) or a node not granted the objects (403).
    fn absent(&self) -> bool {
        let e = match self {
            InventoryError::Apply { source, .. } | InventoryError::List(source) => source,
            _ => return false,
        };
        matches!(e, kube::Error::Api(s) if s.code == 403 || s.code == 404)
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Warm-capacity resources set (advertising).
    pub resources: Option<usize>,
    /// The object was applied.
    pub published: bool,
    /// Peers in the report sent.
    pub peers: Option<usize>,
    /// Publishing is waiting out a missing CRD or a refusal.
    pub absent: bool,
}

/// When publishing is tried again after a 403/404, and whether that was logged.
#[derive(Debug, Default)]
struct Absent {
    until: Option<tokio::time::Instant>,
    logged: bool,
}

/// The loop's state (see the module docs).
pub struct Publisher {
    cfg: InventoryConfig,
    sandboxd: SandboxdClient,
    provider: Arc<SandboxProvider>,
    node: vnode::NodeHandle,
    client: RwLock<Option<kube::Client>>,
    absent: Locked<Absent>,
    /// The Node was read once: its absence later means it is being registered again.
    node_seen: AtomicBool,
    /// When sandboxd last answered (or the loop began).
    last_read: Locked<tokio::time::Instant>,
}

impl Publisher {
    /// A publisher for `provider`'s node, reading `sandboxd`, writing the Node through `node`.
    pub fn new(
        cfg: InventoryConfig,
        sandboxd: SandboxdClient,
        provider: Arc<SandboxProvider>,
        node: vnode::NodeHandle,
    ) -> Publisher {
        Publisher {
            cfg,
            sandboxd,
            provider,
            node,
            client: RwLock::new(None),
            absent: Locked::default(),
            node_seen: AtomicBool::new(false),
            last_read: Locked::new(tokio::time::Instant::now()),
        }
    }

    /// The API client to publish with (replaced after each certificate renewal).
    pub fn set_client(&self, client: kube::Client) {
        *self.client.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(client);
    }

    fn client(&self) -> Option<kube::Client> {
        self.client.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// After a stale-after window without an answer from sandboxd, every warm capacity goes to 0.
    fn zero_when_silent(&self) {
        let silent = self.last_read.lock().elapsed();
        if self.cfg.advertise_warm && silent >= self.cfg.stale_after {
            let zero = warm::zeroed(&self.node.extra_resources());
            if self.node.set_extra_resources(zero) {
                tracing::warn!(silent = ?silent, "sandboxd has not answered for the stale-after window; warm capacity set to 0");
            }
        }
    }

    /// One pass (see the module docs).
    #[tracing::instrument(name = "inventory_pass", skip_all, fields(node = %self.cfg.node_name))]
    pub async fn pass(&self) -> Result<Pass, InventoryError> {
        let (info, rows) = tokio::join!(self.sandboxd.info(), self.sandboxd.list(None));
        let (info, rows) = match (info, rows) {
            (Ok(info), Ok(rows)) => (info, rows),
            (Err(e), _) | (_, Err(e)) => {
                self.zero_when_silent();
                return Err(InventoryError::Sandboxd(e));
            }
        };
        *self.last_read.lock() = tokio::time::Instant::now();
        let mut pass = Pass::default();
        if self.cfg.advertise_warm {
            let resources = warm::warm_resources(&info, &rows, &self.provider.held_claims());
            pass.resources = Some(resources.len());
            if self.node.set_extra_resources(resources.clone()) {
                tracing::debug!(?resources, "warm capacity changed");
            }
        }
        if !self.cfg.publish {
            return Ok(pass);
        }
        let Some(client) = self.client() else {
            tracing::debug!("no API client yet; publishing waits");
            return Ok(pass);
        };
        if self.absent.lock().until.is_some_and(|t| tokio::time::Instant::now() < t) {
            pass.absent = true;
            return Ok(pass);
        }
        match self.publish(&client, &info, &rows, &mut pass).await {
            Err(e) if e.absent() => {
                let mut a = self.absent.lock();
                if !a.logged {
                    tracing::info!(
                        error = %error_chain(&e),
                        "NodeInventory objects are not served here (CRD not installed, or this node not granted them: \
                         apply manifests/nodeinventory-crd.yaml and rbac.yaml); trying again every minute, the node \
                         keeps serving"
                    );
                    a.logged = true;
                }
                a.until = Some(tokio::time::Instant::now() + self.cfg.absent_retry);
                pass.absent = true;
                Ok(pass)
            }
            Err(e) => Err(e),
            Ok(()) => {
                let mut a = self.absent.lock();
                if a.logged {
                    tracing::info!("NodeInventory objects are served now; publishing");
                }
                *a = Absent::default();
                Ok(pass)
            }
        }
    }

    /// Steps 2 and 3: apply the object, list the fleet, send the report.
    async fn publish(
        &self,
        client: &kube::Client,
        info: &crate::sandboxd::Info,
        rows: &[crate::sandboxd::SandboxRow],
        pass: &mut Pass,
    ) -> Result<(), InventoryError> {
        let name = &self.cfg.node_name;
        let found = Api::<Node>::all(client.clone())
            .get_opt(name)
            .await
            .map_err(|source| InventoryError::Node { node: name.clone(), source })?;
        let owner = found.map(|n| object::NodeOwner { name: name.clone(), uid: n.metadata.uid.unwrap_or_default() });
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &object::resource());
        let mut applied = Ok(());
        match &owner {
            None if self.node_seen.load(Ordering::SeqCst) => {
                tracing::debug!("the Node is gone; the apply waits until it is registered again");
            }
            _ => {
                if owner.is_some() {
                    self.node_seen.store(true, Ordering::SeqCst);
                }
                let obj = object::inventory(name, &self.cfg.address, info, rows, owner.as_ref(), Timestamp::now());
                let params = PatchParams::apply(object::FIELD_MANAGER).force();
                match api.patch(name, &params, &Patch::Apply(&obj)).await {
                    Ok(_) => pass.published = true,
                    Err(source) => applied = Err(InventoryError::Apply { node: name.clone(), source }),
                }
            }
        }
        if applied.as_ref().is_err_and(InventoryError::absent) {
            return applied;
        }
        let list = api.list(&ListParams::default()).await.map_err(InventoryError::List)?;
        let now = Timestamp::now();
        let names = peers::candidates(&list.items, name, now, self.cfg.stale_after);
        let nodes = node_facts(client, names).await;
        let report = peers::peer_report(&list.items, &nodes, name, &self.cfg.address, now, self.cfg.stale_after);
        let n = report.peers.len();
        self.sandboxd.put_peers(&report).await.map_err(InventoryError::Peers)?;
        pass.peers = Some(n);
        applied
    }

    /// Runs passes until the task is dropped: one now, then every interval and a `settle`
    /// after each change of the provider's claims (changes meanwhile join that pass).
    pub async fn run(self: Arc<Self>) {
        let changes = self.provider.changes();
        let mut failing = false;
        loop {
            match self.pass().await {
                Ok(p) => {
                    if failing {
                        tracing::info!("inventory passes work again");
                    }
                    failing = false;
                    tracing::debug!(?p, "inventory pass");
                }
                Err(e) if !failing => {
                    tracing::warn!(error = %error_chain(&e), "inventory pass failed; retrying every interval");
                    failing = true;
                }
                Err(e) => tracing::debug!(error = %error_chain(&e), "inventory pass still failing"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.interval) => {}
                _ = changes.notified() => {
                    tokio::time::sleep(self.cfg.settle).await;
                    // A change during the settle is in this pass: drop its stored permit.
                    let _ = changes.notified().now_or_never();
                }
            }
        }
    }
}

/// The facts of the Nodes named (a Node that cannot be read is left out: it vouches for
/// nothing). One GET each, a few at a time: a fleet is tens of boxes.
async fn node_facts(client: &kube::Client, names: Vec<String>) -> BTreeMap<String, peers::NodeFacts> {
    use futures::StreamExt as _;
    let api = Api::<Node>::all(client.clone());
    futures::stream::iter(names)
        .map(|n| {
            let api = api.clone();
            async move {
                match api.get_opt(&n).await {
                    Ok(found) => found.map(|node| (n, peers::NodeFacts::of(&node))),
                    Err(e) => {
                        tracing::debug!(node = %n, error = %error_chain(&e), "a peer's Node could not be read; left out");
                        None
                    }
                }
            }
        })
        .buffer_unordered(8)
        .filter_map(std::future::ready)
        .collect()
        .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

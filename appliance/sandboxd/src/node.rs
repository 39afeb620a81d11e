//! The node: the controller every HTTP handler calls, a thin facade over the jobs it starts
//! and the state they share.
//!
//! | job | module | works on |
//! |---|---|---|
//! | claim, release, renew, lookups | `node/claim.rs` | the [`ClaimStore`], the pools |
//! | refill (golden → clones, cold boots) | [`crate::refill`] | [`Refill`] |
//! | lease reaper, journal compaction | [`crate::reaper`] | the [`ClaimStore`], [`Vms`] |
//! | restart reconcile | [`crate::reconcile`] | the [`ClaimStore`], [`Refill`] |
//! | drain, uncordon, `PUT /v1/pools`, info, metrics | here | all of it |
//!
//! Expected flow: [`Node::start`] loads the journal, builds the pools, reconciles with the
//! driver (re-adopting journaled VMs, destroying `sbx-` VMs nobody owns), then refill tasks
//! fill the pools and the reaper ends expired leases.
//!
//! Guarantees:
//! - the claim path does no VM work: pop a warm VM, mint, journal, reply;
//! - warm + refilling + claimed VMs never exceed the node budget ([`crate::limits::Ledger`]):
//!   refill reserves before any VM work and stops at the budget (the pool reports
//!   `at_capacity`); `PUT /v1/pools` refuses targets that cannot fit, before persisting;
//! - no lease runs past `claimed_at` + `max_lifetime_secs`;
//! - a claim is granted only after a journal write that includes it;
//! - nothing is destroyed on ambiguity: a failed `list` is retried, never read as empty, and
//!   refill (whose new VMs the reconcile could mistake for unowned ones) starts only after a
//!   clean reconcile.

mod branch;
mod claim;
mod hibernate;
pub mod peers;
mod promote;
mod volumes;

pub use branch::BranchError;
pub use hibernate::HibernateError;
pub use promote::PromoteError;
pub use volumes::{default_mount, VolumeError};

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use vmm::{Driver, DriverError, Vm};

use crate::config::{self, ConfigError, PoolConfig};
use crate::golden::Goldens;
use crate::journal::JournalError;
use crate::limits::{BudgetError, Ledger, Limits, Usage};
use crate::metrics::{Gauges, Metrics};
use crate::pool::{Pool, PoolInfo, PoolKey, Pools};
use crate::refill::{self, Refill};
use crate::slots::{CapError, ClaimSlots, SlotGuard, Use};
use crate::snapshots::SnapshotStore;
use crate::store::ClaimStore;
use crate::vms::{disk_mib, Vms};
use crate::{reaper, reconcile};

pub use crate::options::{NodeOptions, Timing};
pub use crate::reconcile::ReconcileReport;

/// Errors starting a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The journal could not be read (a corrupt journal stops the start: nothing is guessed).
    #[error("loading the journal")]
    Journal(#[from] JournalError),
    /// The pool list (config or `pools.json`) is invalid.
    #[error("pool list")]
    Pools(#[from] ConfigError),
    /// The snapshot or template directory could not be created.
    #[error("creating the snapshot and template directories under the data dir")]
    Snapshots(#[source] std::io::Error),
    /// The volume catalog could not be opened, or a declared volume made.
    #[error("volume catalog (config key volumes)")]
    Volumes(#[source] crate::volumes::CatalogError),
    /// The VM network (bridge, packet filter) could not be set up.
    #[error("setting up the VM network (config key network)")]
    Network(#[source] vmnet::VmnetError),
}

/// Errors of `PUT /v1/pools`.
#[derive(Debug, thiserror::Error)]
pub enum PoolsError {
    /// The list is invalid.
    #[error("invalid pool list")]
    Invalid(#[source] ConfigError),
    /// The targets cannot fit the node budget (nothing was changed or persisted).
    #[error("{0}")]
    OverBudget(#[source] BudgetError),
    /// Persisting `pools.json` failed.
    #[error("persisting pools")]
    Journal(#[source] JournalError),
}

/// A validated claim request.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Pool key.
    pub key: PoolKey,
    /// Lease.
    pub ttl: Duration,
    /// Caller reference.
    pub claim_ref: Option<String>,
}

/// The wire bodies the node answers with: a grant, `GET /v1/info` and its budget.
pub use sandboxd_api::{BudgetInfo, Grant, Info};

/// One sandboxd node.
pub struct Node {
    store: Arc<ClaimStore>,
    refill: Arc<Refill>,
    vms: Arc<Vms>,
    pub(crate) timing: Timing,
    limits: Limits,
    slots: Arc<ClaimSlots>,
    /// Connection counts of the HTTP listeners, for `/metrics`.
    pub conn_stats: Arc<httpd::ConnStats>,
    api_token: Option<String>,
    advertise_addr: String,
    pool_configs: Mutex<Vec<PoolConfig>>,
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Fork snapshots, checkpoints and hibernated sandboxes.
    snapshots: SnapshotStore,
    /// Preview URLs, when `preview_listen` is configured.
    previews: Option<crate::preview::Previews>,
    /// Promoted templates.
    promoted: crate::promoted::PromotedStore,
    /// The volume catalog.
    volume_catalog: crate::volumes::Catalog,
    /// The other boxes of the cluster, as the provider last reported them.
    peers: Mutex<peers::PeerTable>,
    /// One hibernate or wake at a time per sandbox.
    transitions: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("data_dir", &self.store.dir()).finish_non_exhaustive()
    }
}

impl Node {
    /// Loads the journal, builds pools, reconciles with the driver (retrying in the background
    /// if `list` fails) and starts the refill and reaper tasks.
    pub async fn start(driver: Arc<dyn Driver>, opts: NodeOptions) -> Result<Arc<Node>, NodeError> {
        let store = Arc::new(ClaimStore::open(&opts.data_dir, opts.sync_claims)?);
        let pool_list = match store.load_pools()? {
            Some(p) => p,
            None => opts.pools.clone(),
        };
        let egress = opts.network.as_ref().is_some_and(|n| n.filter.uplink.is_some());
        let pools = config::validate_pools(&pool_list, egress)?;
        let net = match &opts.network {
            Some(cfg) => {
                // The lease file is born 0600 (vmnet); its directory is ours alone too.
                if let Some(dir) = cfg.leases_path.parent() {
                    foundation::private_dir(dir).map_err(|source| {
                        NodeError::Network(vmnet::VmnetError::Io { what: "creating", path: dir.to_path_buf(), source })
                    })?;
                }
                Some(vmnet::Network::ensure(cfg).await.map_err(NodeError::Network)?)
            }
            None => None,
        };
        if let Err(e) = opts.limits.budget.check(&pools) {
            // The config's own pools were checked at load; pools.json (an earlier PUT) may
            // predate a smaller budget. Refill stops at the budget either way.
            tracing::warn!(error = %e, "the persisted pools.json targets do not fit the node budget; refill stops at the budget");
        }
        let snapshots = SnapshotStore::open(&opts.data_dir).map_err(NodeError::Snapshots)?;
        let promoted = crate::promoted::PromotedStore::open(&opts.data_dir).map_err(NodeError::Snapshots)?;
        let volume_catalog = crate::volumes::Catalog::open(&opts.data_dir).map_err(NodeError::Volumes)?;
        volume_catalog.ensure(&opts.volumes).map_err(NodeError::Volumes)?;
        let goldens = Goldens::new(&opts.data_dir);
        goldens.clean_staging();
        let ledger = Ledger::new(opts.limits.budget);
        // A hibernated sandbox holds no VM.
        let held: Vec<_> = store
            .lock()
            .iter()
            .filter(|c| c.rec.hibernate_snap.is_none())
            .map(|c| (c.rec.vm.clone(), c.rec.key.clone()))
            .collect();
        for (vm, key) in held {
            ledger.hold(&vm, key.size(), disk_mib(&opts.catalog, key.template()));
        }
        let metrics = Arc::new(Metrics::default());
        let vms =
            Arc::new(Vms { driver, net, ledger, metrics: Arc::clone(&metrics), pools: Arc::new(Pools::default()) });
        let refill = Refill::new(
            Arc::clone(&vms),
            opts.catalog,
            opts.timing.clone(),
            opts.refill_concurrency,
            goldens,
            opts.clone,
        );
        let node = Arc::new(Node {
            store,
            refill: Arc::new(refill),
            vms,
            timing: opts.timing,
            limits: opts.limits,
            slots: ClaimSlots::new(opts.limits.caps),
            conn_stats: Arc::new(httpd::ConnStats::default()),
            api_token: opts.api_token,
            advertise_addr: opts.advertise_addr,
            pool_configs: Mutex::new(pool_list),
            metrics,
            snapshots,
            previews: opts.previews,
            promoted,
            volume_catalog,
            peers: Mutex::default(),
            transitions: Mutex::default(),
            cancel: CancellationToken::new(),
        });
        for (key, target) in pools {
            node.add_pool(key, target);
        }
        let (store, vms) = (Arc::clone(&node.store), Arc::clone(&node.vms));
        tokio::spawn(reaper::run(store, vms, node.timing.reap, node.cancel.clone()));
        if let Err(e) = node.reconcile().await {
            tracing::warn!(error = %vmm::error_chain(&e), "reconcile: listing VMs failed; nothing destroyed, retrying");
            let (store, refill) = (Arc::clone(&node.store), Arc::clone(&node.refill));
            tokio::spawn(reconcile::retry(store, refill, node.cancel.clone()));
        }
        // Snapshots a crash left half-made, or that nothing needs since: now, then periodically.
        node.gc_snapshots().await;
        let (idle, gc) = (node.timing.idle_check, node.timing.snapshot_gc);
        tokio::spawn(snapshot_gc(Arc::downgrade(&node), idle, gc, node.cancel.clone()));
        Ok(node)
    }

    /// Stops background tasks (refill, reaper, reconcile retries). VMs keep running.
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// The root API token, if configured.
    pub fn api_token(&self) -> Option<&str> {
        self.api_token.as_deref()
    }

    /// Preview URLs, when configured.
    pub fn previews(&self) -> Option<&crate::preview::Previews> {
        self.previews.as_ref()
    }

    /// The advertised owner address (may be empty).
    pub fn advertise_addr(&self) -> &str {
        &self.advertise_addr
    }

    /// The node's limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// What warm + refilling + claimed VMs hold of the budget.
    pub fn usage(&self) -> Usage {
        self.vms.ledger.usage()
    }

    /// Takes one concurrent-use slot of claim `id` (`/agent`, `/ports`, `/exec`); freed when
    /// the guard drops.
    pub fn acquire_slot(&self, id: &str, use_: Use) -> Result<SlotGuard, CapError> {
        self.slots.acquire(id, use_)
    }

    /// Open `/agent` relays, `/ports` relays and `/exec` calls of claim `id`.
    pub fn open_uses(&self, id: &str) -> [usize; 3] {
        self.slots.open(id)
    }

    /// Whether `net: egress` is available (a network with an uplink).
    pub fn egress(&self) -> bool {
        self.vms.egress()
    }

    /// The VM network, if configured.
    pub fn network(&self) -> Option<&vmnet::Network> {
        self.vms.net.as_ref()
    }

    /// Whether the node is draining.
    pub fn draining(&self) -> bool {
        self.refill.draining()
    }

    /// Whether the restart reconcile has completed.
    pub fn reconciled(&self) -> bool {
        self.refill.reconciled()
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.vms.driver
    }

    /// A pool by key.
    pub fn pool(&self, key: &PoolKey) -> Option<Arc<Pool>> {
        self.vms.pools.get(key)
    }

    /// All pools.
    pub fn pools(&self) -> Vec<Arc<Pool>> {
        self.vms.pools.all()
    }

    /// Adds a pool (with its golden, when one is on disk) and starts its refill task.
    fn add_pool(&self, key: PoolKey, target: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool::new(key, target, &self.cancel));
        // A promoted template's snapshot is its pool's golden; others have a built one.
        let golden = match self.promoted.get(pool.key.template()) {
            Some((_, snap)) => Some(snap),
            None => self.refill.load_golden(&pool.hash),
        };
        if let Some(g) = golden {
            pool.lock().golden = Some(g);
        }
        self.vms.pools.insert(Arc::clone(&pool));
        let span = tracing::info_span!("refill", template = %pool.key.template(), pool = %pool.key);
        tokio::spawn(refill::run(Arc::clone(&self.refill), Arc::clone(&pool)).instrument(span));
        pool
    }

    /// Destroys a VM (kill), counting the outcome; see [`Vms::destroy`].
    pub async fn destroy(&self, vm: &Vm) {
        self.vms.destroy(vm).await;
    }

    /// Node and pool counters.
    pub fn info(&self) -> Info {
        let pools: Vec<PoolInfo> = self.vms.pools.infos();
        let reason = pools.iter().find_map(|p| p.at_capacity_reason.clone());
        let used = self.vms.ledger.usage();
        let budget = self.vms.ledger.budget();
        let (checkpoints, checkpoint_disk_bytes) = self.snapshot_summary();
        Info {
            claimed: self.claimed(),
            hibernated: self.hibernated(),
            archived: 0,
            draining: self.draining(),
            at_capacity: reason.is_some(),
            at_capacity_reason: reason,
            peers: self.peer_addrs(),
            advertise_addr: self.advertise_addr.clone(),
            pools,
            budget: BudgetInfo {
                max_vms: budget.max_vms,
                max_memory_mib: budget.max_memory_mib,
                max_disk_mib: budget.max_disk_mib,
                vms: used.vms,
                memory_mib: used.memory_mib,
                disk_mib: used.disk_mib,
            },
            checkpoints,
            checkpoint_disk_bytes,
            hypervisor: self.vms.driver.backend().to_string(),
            accel: self.vms.driver.accel().to_string(),
        }
    }

    /// Prometheus text (the counters, the claim latency and the live gauges).
    pub fn render_metrics(&self) -> String {
        let gauges = Gauges {
            pools: self.vms.pools.infos(),
            claimed: self.claimed(),
            draining: self.draining(),
            budget: self.vms.ledger.budget(),
            used: self.vms.ledger.usage(),
            http: self.conn_stats.as_ref().into(),
        };
        self.metrics.render(gauges).unwrap_or_else(|e| {
            tracing::error!(error = %vmm::error_chain(&e), "rendering /metrics failed");
            String::new()
        })
    }

    /// Starts draining: claims are refused, warm VMs destroyed, live claims run on.
    pub async fn drain(&self) -> Info {
        self.refill.set_draining(true);
        let warm: Vec<Vm> = self.vms.pools.all().iter().flat_map(|p| p.take_all()).collect();
        tracing::info!(destroying = warm.len(), "draining");
        self.vms.destroy_all(warm).await;
        self.info()
    }

    /// Lifts a drain and kicks refill.
    pub fn uncordon(&self) -> Info {
        self.refill.set_draining(false);
        self.vms.pools.kick_all();
        tracing::info!("uncordoned");
        self.info()
    }

    /// Replaces the pool list (`PUT /v1/pools`): omitted pools are drained and removed, targets
    /// updated, new pools started; the list is persisted in `pools.json`.
    pub async fn put_pools(self: &Arc<Self>, list: Vec<PoolConfig>) -> Result<Info, PoolsError> {
        let wanted = config::validate_pools(&list, self.egress()).map_err(PoolsError::Invalid)?;
        self.limits.budget.check(&wanted).map_err(PoolsError::OverBudget)?;
        for p in &list {
            if p.archive_after_seconds.is_some() || p.archive_delete_after_seconds.is_some() {
                tracing::warn!(template = %p.template, "archive settings are accepted but not implemented on this node");
            }
        }
        self.store.write_pools(&list).map_err(PoolsError::Journal)?;
        *self.pool_configs.lock().unwrap_or_else(|p| p.into_inner()) = list;
        let mut doomed: Vec<Vm> = Vec::new();
        let keep: HashSet<&PoolKey> = wanted.iter().map(|(k, _)| k).collect();
        for p in self.vms.pools.remove_others(&keep) {
            tracing::info!(pool = %p.key, "pool removed");
            doomed.extend(p.retire());
        }
        for (key, target) in wanted {
            match self.pool(&key) {
                Some(p) => {
                    doomed.extend(p.set_target(target));
                    p.kick();
                }
                None => {
                    tracing::info!(pool = %key, target, "pool added");
                    self.add_pool(key, target).kick();
                }
            }
        }
        self.vms.destroy_all(doomed).await;
        Ok(self.info())
    }

    /// The current pool list (as configured or last `PUT`).
    pub fn pool_configs(&self) -> Vec<PoolConfig> {
        self.pool_configs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Destroys every claim past its deadline; returns how many (the reaper's tick).
    pub async fn reap_once(&self) -> usize {
        reaper::reap_once(&self.store, &self.vms).await
    }

    /// Restart reconcile ([`crate::reconcile`]): re-adopt journaled claims whose VM lives, drop
    /// rows whose VM is gone, destroy every `sbx-` VM no claim or pool names, then let refill
    /// start. A failed `list` returns the error and changes nothing.
    pub async fn reconcile(&self) -> Result<ReconcileReport, DriverError> {
        reconcile::reconcile(&self.store, &self.refill).await
    }
}

/// Until `cancel` or the node is gone: every `idle_period` hibernates idle sandboxes
/// ([`Node::hibernate_idle`]), every `gc_period` runs [`Node::gc_snapshots`].
async fn snapshot_gc(
    node: std::sync::Weak<Node>,
    idle_period: Duration,
    gc_period: Duration,
    cancel: CancellationToken,
) {
    let mut idle = tokio::time::interval(idle_period);
    let mut gc = tokio::time::interval(gc_period);
    idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    gc.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first ticks are immediate; the start already ran a gc.
    idle.tick().await;
    gc.tick().await;
    loop {
        let hibernate = tokio::select! {
            () = cancel.cancelled() => return,
            _ = idle.tick() => true,
            _ = gc.tick() => false,
        };
        let Some(node) = node.upgrade() else { return };
        if !hibernate {
            node.gc_snapshots().await;
        } else if node.reconciled() {
            node.hibernate_idle().await;
        }
    }
}

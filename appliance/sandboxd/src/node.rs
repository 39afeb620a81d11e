//! The node controller: pools, claims, journal, drain, reaper and restart reconcile, over any
//! [`vmm::Driver`]. HTTP handlers ([`crate::http`]) are thin calls into this.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use vmm::{Catalog, Driver, DriverError, Snapshot, Vm, VmId};

use crate::claims::{self, Claim, ClaimError, ClaimTable, SandboxRow};
use crate::config::{self, Config, ConfigError, PoolConfig};
use crate::journal::{ClaimRecord, Journal, JournalError};
use crate::limits::{Budget, BudgetError, CapError, ClaimSlots, Ledger, Limits, SlotGuard, Usage, Use};
use crate::metrics::{inc, Metrics};
use crate::pool::{refill, Net, Pool, PoolInfo, PoolKey};

/// Timings (production defaults; tests shorten them).
#[derive(Debug, Clone)]
pub struct Timing {
    /// Refill ticker.
    pub tick: Duration,
    /// Reaper period (≤ 5 s).
    pub reap: Duration,
    /// Probe budget of a clone.
    pub clone_probe: Duration,
    /// Probe budget of a cold boot (also the golden builder).
    pub cold_probe: Duration,
    /// Wait before retrying a failed golden build.
    pub golden_retry: Duration,
    /// Wait before retrying a failed reconcile (`list` error).
    pub reconcile_retry: Duration,
    /// How long a pool parks on a condition retrying cannot fix (template missing).
    pub park: Duration,
    /// After the guest closes a relay, how long the client may still send.
    pub relay_drain: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            tick: Duration::from_secs(2),
            reap: Duration::from_secs(1),
            clone_probe: Duration::from_secs(5),
            cold_probe: Duration::from_secs(90),
            golden_retry: Duration::from_secs(30),
            reconcile_retry: Duration::from_secs(5),
            park: Duration::from_secs(30),
            relay_drain: Duration::from_secs(30),
        }
    }
}

/// Everything a node is built from.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Journal, pool overrides, goldens.
    pub data_dir: PathBuf,
    /// Pools from the config file (`pools.json` overrides).
    pub pools: Vec<PoolConfig>,
    /// Root API token; `None` leaves node routes open.
    pub api_token: Option<String>,
    /// `owner_addr` in replies (empty: clients use the address they dialled).
    pub advertise_addr: String,
    /// Concurrent refills.
    pub refill_concurrency: usize,
    /// `fdatasync` every claims-log append before replying.
    pub sync_claims: bool,
    /// Fill by cloning a golden snapshot.
    pub clone: bool,
    /// Templates this node can boot.
    pub catalog: Catalog,
    /// Timings.
    pub timing: Timing,
    /// Budget, lease horizon, per-claim caps, exec timeouts, HTTP limits.
    pub limits: Limits,
    /// Per-VM networking of `net: egress` pools (the config's `network` section); `None`: no
    /// VM gets a NIC and egress is refused.
    pub network: Option<vmnet::NetConfig>,
}

impl NodeOptions {
    /// Options from a loaded config (reads the token file).
    pub fn from_config(c: &Config, catalog: Catalog) -> Result<Self, ConfigError> {
        let advertise_addr = c.advertise_addr.clone().unwrap_or_else(|| {
            if c.listen.ip().is_unspecified() {
                String::new()
            } else {
                c.listen.to_string()
            }
        });
        Ok(NodeOptions {
            data_dir: c.data_dir.clone(),
            pools: c.pools.clone(),
            api_token: c.api_token()?,
            advertise_addr,
            refill_concurrency: c.refill_limit(),
            sync_claims: c.sync_claims,
            clone: c.clone,
            catalog,
            timing: Timing { cold_probe: Duration::from_secs(c.boot_timeout_secs.max(1)), ..Timing::default() },
            limits: c.limits()?,
            network: c.net_config()?,
        })
    }

    /// Minimal options for tests and tools: no token, no pools, default limits with a fixed
    /// budget of [`NodeOptions::TEST_BUDGET`] (the daemon derives its budget from the host).
    pub fn new(data_dir: impl Into<PathBuf>, catalog: Catalog) -> Self {
        NodeOptions {
            data_dir: data_dir.into(),
            pools: Vec::new(),
            api_token: None,
            advertise_addr: String::new(),
            refill_concurrency: 4,
            sync_claims: false,
            clone: true,
            catalog,
            timing: Timing::default(),
            limits: Limits::with_budget(Self::TEST_BUDGET),
            network: None,
        }
    }

    /// The budget of [`NodeOptions::new`]: 64 VMs, 32 GiB.
    pub const TEST_BUDGET: Budget = Budget { max_vms: 64, max_memory_mib: 32 * 1024, max_disk_mib: 1 << 20 };
}

/// Errors starting a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The journal could not be read (a corrupt journal stops the start: nothing is guessed).
    #[error("loading the journal")]
    Journal(#[from] JournalError),
    /// The pool list (config or `pools.json`) is invalid.
    #[error("pool list")]
    Pools(#[from] ConfigError),
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

/// The most host disk a VM of `template` can fill (its overlay's worst case), MiB, as the
/// ledger counts it. A template that is not in the catalog or whose overlay image cannot be
/// read counts 0: no VM of it can boot either.
pub(crate) fn disk_mib(catalog: &Catalog, template: &str) -> u64 {
    let Ok((_, t)) = catalog.resolve(template) else { return 0 };
    match &t.overlay_base {
        Some(base) => vmm::disk::overlay_cap(base).map(vmm::disk::mib_ceil).unwrap_or_else(|e| {
            tracing::warn!(template, overlay = %base.display(), error = %e, "cannot size the template's overlay image");
            0
        }),
        None => 0,
    }
}

/// What a reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Journaled claims re-attached.
    pub adopted: usize,
    /// Journaled claims whose VM was gone.
    pub dropped: usize,
    /// Unowned `sbx-` VMs destroyed.
    pub destroyed: usize,
    /// Network leases (and TAPs) of VMs that no longer exist, released.
    pub leases_released: usize,
}

/// One sandboxd node.
pub struct Node {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) catalog: Catalog,
    pub(crate) journal: Journal,
    pub(crate) timing: Timing,
    pub(crate) clone_enabled: bool,
    pub(crate) limits: Limits,
    pub(crate) ledger: Arc<Ledger>,
    slots: Arc<ClaimSlots>,
    /// Connection counts of the HTTP listeners, for `/metrics`.
    pub conn_stats: Arc<httpd::ConnStats>,
    api_token: Option<String>,
    advertise_addr: String,
    pools: RwLock<BTreeMap<PoolKey, Arc<Pool>>>,
    pool_configs: Mutex<Vec<PoolConfig>>,
    claims: Mutex<ClaimTable>,
    draining: AtomicBool,
    reconciled: AtomicBool,
    pub(crate) refill_sem: Arc<Semaphore>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The VM network of egress pools (bridge, leases, TAPs, packet filter).
    pub(crate) net: Option<vmnet::Network>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("data_dir", &self.journal.dir()).finish_non_exhaustive()
    }
}

/// The goldens directory under a data dir.
pub fn goldens_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("goldens")
}

impl Node {
    /// Loads the journal, builds pools, reconciles with the driver (retrying in the background
    /// if `list` fails) and starts the refill and reaper tasks.
    pub async fn start(driver: Arc<dyn Driver>, opts: NodeOptions) -> Result<Arc<Node>, NodeError> {
        let journal = Journal::open(&opts.data_dir, opts.sync_claims)?;
        let loaded = journal.recover()?;
        let pool_list = match journal.load_pools()? {
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
        clean_staging(&goldens_dir(&opts.data_dir));
        let ledger = Ledger::new(opts.limits.budget);
        for rec in &loaded.claims {
            ledger.hold(&rec.vm, rec.key.size(), disk_mib(&opts.catalog, rec.key.template()));
        }
        let node = Arc::new(Node {
            driver,
            catalog: opts.catalog,
            journal,
            timing: opts.timing,
            clone_enabled: opts.clone,
            limits: opts.limits,
            ledger,
            slots: ClaimSlots::new(opts.limits.caps),
            conn_stats: Arc::new(httpd::ConnStats::default()),
            api_token: opts.api_token,
            advertise_addr: opts.advertise_addr,
            pools: RwLock::new(BTreeMap::new()),
            pool_configs: Mutex::new(pool_list),
            claims: Mutex::new(ClaimTable::restore(loaded.seq, loaded.claims)),
            draining: AtomicBool::new(false),
            reconciled: AtomicBool::new(false),
            refill_sem: Arc::new(Semaphore::new(opts.refill_concurrency.max(1))),
            metrics: Metrics::default(),
            net,
            cancel: CancellationToken::new(),
        });
        for (key, target) in pools {
            node.add_pool(key, target);
        }
        let reaper = Arc::clone(&node);
        tokio::spawn(async move { reaper.reap_loop().await });
        if let Err(e) = node.reconcile().await {
            tracing::warn!(error = %vmm::error_chain(&e), "reconcile: listing VMs failed; nothing destroyed, retrying");
            let n = Arc::clone(&node);
            tokio::spawn(async move { n.reconcile_loop().await });
        }
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
        self.ledger.usage()
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
        self.net.as_ref().is_some_and(|n| n.config().filter.uplink.is_some())
    }

    /// The VM network, if configured.
    pub fn network(&self) -> Option<&vmnet::Network> {
        self.net.as_ref()
    }

    /// Whether the node is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Whether the restart reconcile has completed.
    pub fn reconciled(&self) -> bool {
        self.reconciled.load(Ordering::SeqCst)
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    fn claims(&self) -> MutexGuard<'_, ClaimTable> {
        // The table is plain data updated in single statements; a poisoned lock is still usable.
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pool_map(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<PoolKey, Arc<Pool>>> {
        self.pools.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A pool by key.
    pub fn pool(&self, key: &PoolKey) -> Option<Arc<Pool>> {
        self.pool_map().get(key).cloned()
    }

    /// All pools.
    pub fn pools(&self) -> Vec<Arc<Pool>> {
        self.pool_map().values().cloned().collect()
    }

    fn add_pool(self: &Arc<Self>, key: PoolKey, target: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool::new(key, target, &self.cancel));
        if let Some(g) = self.load_golden(&pool.hash) {
            pool.lock().golden = Some(g);
        }
        self.pools.write().unwrap_or_else(|p| p.into_inner()).insert(pool.key.clone(), Arc::clone(&pool));
        let (n, p) = (Arc::clone(self), Arc::clone(&pool));
        let span = tracing::info_span!("refill", template = %pool.key.template(), pool = %pool.key);
        tokio::spawn(refill::run(n, p).instrument(span));
        pool
    }

    fn load_golden(&self, hash: &str) -> Option<Snapshot> {
        let dir = goldens_dir(self.journal.dir()).join(hash);
        if !dir.join(Snapshot::FILE).exists() {
            return None;
        }
        match Snapshot::load(&dir) {
            Ok(s) if s.backend == self.driver.backend() => Some(refill::rebase(s, &dir)),
            Ok(s) => {
                tracing::warn!(golden = %dir.display(), backend = %s.backend, "ignoring a golden of another backend");
                None
            }
            Err(e) => {
                tracing::warn!(golden = %dir.display(), error = %vmm::error_chain(&e), "ignoring an unreadable golden");
                None
            }
        }
    }

    /// Journals the claim table up to generation `gen`. Without `sync_claims` this is one
    /// buffered `write` of a few hundred bytes, done inline; with it the `fdatasync` runs in
    /// `block_in_place` on a multi-threaded runtime so the worker's other tasks move on.
    fn commit(&self, gen: u64) -> Result<(), JournalError> {
        let run = || self.journal.commit_claims(gen, &self.claims);
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if self.journal.sync() && multi_thread {
            tokio::task::block_in_place(run)
        } else {
            run()
        }
    }

    /// Compacts the claims log into `claims.json` when it has grown (off the claim path).
    async fn compact_journal(self: &Arc<Self>) {
        let node = Arc::clone(self);
        match tokio::task::spawn_blocking(move || node.journal.compact_if_large(&node.claims)).await {
            Ok(Ok(true)) => tracing::debug!("claims log compacted"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %vmm::error_chain(&e), "compacting the claims log failed; retrying"),
            Err(e) => tracing::warn!(error = %e, "the compaction task failed"),
        }
    }

    /// Grants a claim: ownership transfer of the newest warm VM, no VM work.
    pub fn claim(&self, req: ClaimRequest) -> Result<Grant, ClaimError> {
        let r = self.claim_inner(req);
        match &r {
            Ok(_) => inc(&self.metrics.claims_warm),
            Err(ClaimError::NoCapacity(_)) => inc(&self.metrics.claims_no_capacity),
            Err(ClaimError::Draining) => inc(&self.metrics.claims_draining),
            Err(_) => inc(&self.metrics.claims_failed),
        }
        r
    }

    fn claim_inner(&self, req: ClaimRequest) -> Result<Grant, ClaimError> {
        if req.key.net() == Net::Egress && !self.egress() {
            return Err(ClaimError::Egress);
        }
        if self.draining() {
            return Err(ClaimError::Draining);
        }
        let Some(pool) = self.pool(&req.key) else {
            return Err(match self.catalog.resolve(req.key.template()) {
                Ok(_) => ClaimError::NoCapacity(req.key),
                Err(_) => ClaimError::UnknownTemplate(req.key.template().to_string()),
            });
        };
        let Some(vm) = pool.take() else {
            pool.kick();
            return Err(ClaimError::NoCapacity(req.key));
        };
        pool.kick();
        let now = claims::unix_ms(SystemTime::now());
        // The lease horizon caps the first lease too.
        let ttl_ms = u64::try_from(req.ttl.min(self.limits.max_lifetime).as_millis()).unwrap_or(u64::MAX);
        let rec = ClaimRecord {
            id: claims::mint_id(),
            token: claims::mint_token(),
            vm: vm.id.clone(),
            key: req.key.clone(),
            deadline_unix_ms: now.saturating_add(ttl_ms),
            claimed_at_unix_ms: now,
            claim_ref: req.claim_ref.filter(|r| !r.is_empty()),
        };
        let span = tracing::info_span!("claim", claim = %rec.id, vm = %rec.vm, template = %req.key.template());
        let _enter = span.enter();
        let grant = Grant {
            id: rec.id.clone(),
            token: rec.token.clone(),
            deadline: claims::rfc3339(rec.deadline_unix_ms),
            owner_addr: self.advertise_addr.clone(),
            template_digest: self
                .catalog
                .resolve(req.key.template())
                .ok()
                .map(|(_, t)| t.digest.clone())
                .filter(|d| !d.is_empty()),
        };
        let id = rec.id.clone();
        let gen = self.claims().insert(Claim { rec, vm: Some(vm) });
        if let Err(e) = self.commit(gen) {
            tracing::error!(error = %vmm::error_chain(&e), "claim not granted: journal write failed");
            let back = self.claims().remove(&id);
            if let Some((Claim { vm: Some(vm), .. }, _)) = back {
                pool.put_back(vm);
            }
            return Err(ClaimError::Journal(e));
        }
        tracing::info!("claimed");
        Ok(grant)
    }

    /// One claim by id.
    pub fn sandbox(&self, id: &str) -> Option<Claim> {
        self.claims().get(id).cloned()
    }

    /// Listing rows, optionally filtered by exact `claim_ref` (empty = all), sorted by id.
    pub fn list(&self, claim_ref: Option<&str>) -> Vec<SandboxRow> {
        let want = claim_ref.filter(|r| !r.is_empty());
        let mut rows: Vec<SandboxRow> = self
            .claims()
            .iter()
            .filter(|c| want.is_none() || c.rec.claim_ref.as_deref() == want)
            .map(Claim::row)
            .collect();
        rows.sort_by(|a, b| a.id.cmp(&b.id));
        rows
    }

    /// Number of live claims.
    pub fn claimed(&self) -> usize {
        self.claims().len()
    }

    /// Ends a claim and destroys its VM.
    pub async fn release(&self, id: &str) -> Result<(), ClaimError> {
        let removed = self.claims().remove(id);
        let Some((claim, gen)) = removed else {
            return Err(ClaimError::NotFound);
        };
        let span =
            tracing::info_span!("release", claim = %id, vm = %claim.rec.vm, template = %claim.rec.key.template());
        async {
            if let Err(e) = self.commit(gen) {
                // The VM goes anyway; a restart finds it gone and drops the stale row.
                tracing::warn!(error = %vmm::error_chain(&e), "journaling the release failed");
            }
            inc(&self.metrics.releases);
            self.destroy_claim_vm(&claim).await;
            tracing::info!("released");
        }
        .instrument(span)
        .await;
        Ok(())
    }

    async fn destroy_claim_vm(&self, claim: &Claim) {
        match &claim.vm {
            Some(vm) => self.destroy(vm).await,
            // Not attached yet (list failed at start): the next successful reconcile sweeps it.
            None => tracing::warn!(vm = %claim.rec.vm, "VM not attached; left to the reconcile sweep"),
        }
    }

    /// Resets a lease to now + `ttl` (may shorten it); returns the new deadline. A deadline past
    /// the lease horizon (`claimed_at` + `max_lifetime_secs`) is refused, not clamped.
    pub fn renew(&self, id: &str, ttl: Duration) -> Result<String, ClaimError> {
        let now = claims::unix_ms(SystemTime::now());
        let deadline = now.saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let max_ms = u64::try_from(self.limits.max_lifetime.as_millis()).unwrap_or(u64::MAX);
        let gen = {
            let mut table = self.claims();
            let claimed_at = table.get(id).ok_or(ClaimError::NotFound)?.rec.claimed_at_unix_ms;
            let horizon = claimed_at.saturating_add(max_ms);
            if deadline > horizon {
                return Err(ClaimError::LeaseHorizon {
                    horizon: claims::rfc3339(horizon),
                    max_lifetime_secs: self.limits.max_lifetime.as_secs(),
                    remaining_secs: horizon.saturating_sub(now) / 1000,
                });
            }
            table.set_deadline(id, deadline).ok_or(ClaimError::NotFound)?
        };
        self.commit(gen).map_err(ClaimError::Journal)?;
        inc(&self.metrics.renews);
        tracing::info!(claim = %id, "renewed");
        Ok(claims::rfc3339(deadline))
    }

    /// The VM of a claim, attaching it first if a restart left it unattached.
    pub async fn vm_for(&self, claim: &Claim) -> Result<Vm, DriverError> {
        if let Some(vm) = &claim.vm {
            return Ok(vm.clone());
        }
        let vm = self.driver.attach(&claim.rec.vm).await?;
        self.claims().set_vm(&claim.rec.id, vm.clone());
        Ok(vm)
    }

    /// Destroys a VM (kill), counting the outcome. Once it is gone it leaves the budget (a
    /// failed kill keeps it counted: it may still run) and pools waiting on the budget are woken.
    /// A VM with a NIC gives its TAP and lease back once it is gone.
    pub async fn destroy(&self, vm: &Vm) {
        match self.driver.kill(vm).await {
            Ok(()) => {
                inc(&self.metrics.vms_destroyed);
                if let Some(nic) = &vm.spec.nic {
                    self.release_nic(&vm.id, &nic.tap).await;
                }
                self.ledger.forget(&vm.id);
                for p in self.pools() {
                    if p.lock().budget_blocked.is_some() {
                        p.kick();
                    }
                }
            }
            Err(e) => {
                inc(&self.metrics.destroy_failures);
                tracing::warn!(vm = %vm.id, error = %vmm::error_chain(&e), "destroying VM failed; it stays counted against the budget");
            }
        }
    }

    /// Deletes TAP `tap` and releases the lease holding it (best effort: logged and counted).
    /// Only for a VM whose hypervisor is gone, or that never started.
    pub(crate) async fn release_nic(&self, vm: &VmId, tap: &str) {
        let Some(net) = &self.net else { return };
        let span = tracing::info_span!("release_nic", vm = %vm, tap);
        async {
            if let Err(e) = net.delete_tap(tap).await {
                inc(&self.metrics.network_failures);
                tracing::warn!(error = %vmm::error_chain(&e), "deleting the TAP failed");
            }
            let key = match net.leases() {
                Ok(all) => all.into_iter().find(|(_, l)| l.tap == tap).map(|(k, _)| k),
                Err(e) => {
                    inc(&self.metrics.network_failures);
                    tracing::warn!(error = %vmm::error_chain(&e), "reading the leases failed; the lease stays until the next start");
                    return;
                }
            };
            if let Some(key) = key {
                match net.release(&key) {
                    Ok(_) => tracing::debug!(lease = %key, "lease released"),
                    Err(e) => {
                        inc(&self.metrics.network_failures);
                        tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "releasing the lease failed");
                    }
                }
            }
        }
        .instrument(span)
        .await;
    }

    /// Releases every lease (and deletes its TAP) that no listed VM holds: leftovers of VMs
    /// destroyed or half-made while sandboxd was down. A lease whose TAP a listed VM names
    /// (alive, creating, or one whose kill failed) is kept.
    async fn sweep_leases(&self, live: &HashMap<VmId, Vm>) -> usize {
        let Some(net) = &self.net else { return 0 };
        let held: HashSet<&str> = live.values().filter_map(|v| v.spec.nic.as_ref()).map(|n| n.tap.as_str()).collect();
        let leases = match net.leases() {
            Ok(l) => l,
            Err(e) => {
                inc(&self.metrics.network_failures);
                tracing::warn!(error = %vmm::error_chain(&e), "reading the leases failed; none released");
                return 0;
            }
        };
        let mut released = 0;
        for (key, lease) in leases {
            if held.contains(lease.tap.as_str()) {
                continue;
            }
            tracing::info!(lease = %key, tap = %lease.tap, ip = %lease.ip, "releasing the lease of a VM that is gone");
            if let Err(e) = net.delete_tap(&lease.tap).await {
                inc(&self.metrics.network_failures);
                tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "deleting a stale TAP failed");
            }
            match net.release(&key) {
                Ok(_) => released += 1,
                Err(e) => {
                    inc(&self.metrics.network_failures);
                    tracing::warn!(lease = %key, error = %vmm::error_chain(&e), "releasing a stale lease failed");
                }
            }
        }
        released
    }

    async fn destroy_all(&self, vms: Vec<Vm>) {
        for vm in vms {
            self.destroy(&vm).await;
        }
    }

    /// Node and pool counters.
    pub fn info(&self) -> Info {
        let pools: Vec<PoolInfo> = self.pools().iter().map(|p| p.info()).collect();
        let reason = pools.iter().find_map(|p| p.at_capacity_reason.clone());
        let used = self.ledger.usage();
        let budget = self.ledger.budget();
        Info {
            claimed: self.claimed(),
            hibernated: 0,
            archived: 0,
            draining: self.draining(),
            at_capacity: reason.is_some(),
            at_capacity_reason: reason,
            peers: Vec::new(),
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
        }
    }

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        let pools: Vec<PoolInfo> = self.pools().iter().map(|p| p.info()).collect();
        self.metrics.render(
            &pools,
            self.claimed(),
            self.draining(),
            self.ledger.budget(),
            self.ledger.usage(),
            &self.conn_stats,
        )
    }

    /// Starts draining: claims are refused, warm VMs destroyed, live claims run on.
    pub async fn drain(&self) -> Info {
        self.draining.store(true, Ordering::SeqCst);
        let warm: Vec<Vm> = self.pools().iter().flat_map(|p| p.take_all()).collect();
        tracing::info!(destroying = warm.len(), "draining");
        self.destroy_all(warm).await;
        self.info()
    }

    /// Lifts a drain and kicks refill.
    pub fn uncordon(&self) -> Info {
        self.draining.store(false, Ordering::SeqCst);
        for p in self.pools() {
            p.kick();
        }
        tracing::info!("uncordoned");
        self.info()
    }

    /// Replaces the pool list (`PUT /v1/pools`): omitted pools are drained and removed, targets
    /// updated, new pools started; the list is persisted in `pools.json`.
    pub async fn put_pools(self: &Arc<Self>, list: Vec<PoolConfig>) -> Result<Info, PoolsError> {
        let wanted = config::validate_pools(&list, self.egress()).map_err(PoolsError::Invalid)?;
        self.limits.budget.check(&wanted).map_err(PoolsError::OverBudget)?;
        for p in &list {
            if p.idle_hibernate_seconds.is_some()
                || p.archive_after_seconds.is_some()
                || p.archive_delete_after_seconds.is_some()
            {
                tracing::warn!(template = %p.template, "hibernate/archive settings are accepted but not implemented on this node");
            }
        }
        self.journal.write_pools(&list).map_err(PoolsError::Journal)?;
        *self.pool_configs.lock().unwrap_or_else(|p| p.into_inner()) = list;
        let mut doomed: Vec<Vm> = Vec::new();
        let keep: HashSet<&PoolKey> = wanted.iter().map(|(k, _)| k).collect();
        let removed: Vec<Arc<Pool>> = {
            let mut map = self.pools.write().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<PoolKey> = map.keys().filter(|k| !keep.contains(k)).cloned().collect();
            gone.iter().filter_map(|k| map.remove(k)).collect()
        };
        for p in removed {
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
        self.destroy_all(doomed).await;
        Ok(self.info())
    }

    /// The current pool list (as configured or last `PUT`).
    pub fn pool_configs(&self) -> Vec<PoolConfig> {
        self.pool_configs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn reap_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.timing.reap);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.reap_once().await;
            self.compact_journal().await;
        }
    }

    /// Destroys every claim past its deadline; returns how many.
    pub async fn reap_once(&self) -> usize {
        let now = claims::unix_ms(SystemTime::now());
        let expired = self.claims().expired(now);
        let mut n = 0;
        for id in expired {
            let removed = self.claims().remove(&id);
            let Some((claim, gen)) = removed else { continue };
            let span =
                tracing::info_span!("reap", claim = %id, vm = %claim.rec.vm, template = %claim.rec.key.template());
            async {
                if let Err(e) = self.commit(gen) {
                    tracing::warn!(error = %vmm::error_chain(&e), "journaling the reap failed");
                }
                self.destroy_claim_vm(&claim).await;
                inc(&self.metrics.reaped);
                tracing::info!("lease expired; sandbox destroyed");
            }
            .instrument(span)
            .await;
            n += 1;
        }
        n
    }

    async fn reconcile_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.cancel.cancelled() => return,
                () = tokio::time::sleep(self.timing.reconcile_retry) => {}
            }
            match self.reconcile().await {
                Ok(_) => return,
                Err(e) => tracing::warn!(error = %vmm::error_chain(&e), "reconcile: listing VMs failed again"),
            }
        }
    }

    /// Restart reconcile: re-adopt journaled claims whose VM lives, drop rows whose VM is gone,
    /// destroy every `sbx-` VM no claim or pool names, then let refill start.
    /// A failed `list` returns the error and changes nothing.
    pub async fn reconcile(&self) -> Result<ReconcileReport, DriverError> {
        let span = tracing::info_span!("reconcile");
        async {
            let live: HashMap<VmId, Vm> = self.driver.list().await?.into_iter().map(|v| (v.id.clone(), v)).collect();
            let mut report = ReconcileReport::default();
            let pending: Vec<(String, VmId)> = self
                .claims()
                .iter()
                .filter(|c| c.vm.is_none())
                .map(|c| (c.rec.id.clone(), c.rec.vm.clone()))
                .collect();
            let mut last_gen = None;
            for (id, vm_id) in pending {
                match live.get(&vm_id) {
                    // A claim only ever takes a VM that finished booting; a half-created one under
                    // a claimed id is not that VM, so the claim cannot be honoured.
                    Some(listed) if listed.state == vmm::VmState::Creating => {
                        tracing::warn!(claim = %id, vm = %vm_id, "claimed VM is half-created; dropping the claim");
                        if let Some((_, gen)) = self.claims().remove(&id) {
                            last_gen = Some(gen);
                        }
                        self.destroy(listed).await;
                        report.dropped += 1;
                    }
                    Some(listed) => {
                        let vm = match self.driver.attach(&vm_id).await {
                            Ok(vm) => vm,
                            Err(e) => {
                                tracing::warn!(claim = %id, vm = %vm_id, error = %vmm::error_chain(&e), "attach failed; keeping the listed record");
                                listed.clone()
                            }
                        };
                        tracing::info!(claim = %id, vm = %vm_id, "re-adopted");
                        self.claims().set_vm(&id, vm);
                        report.adopted += 1;
                    }
                    None => {
                        tracing::info!(claim = %id, vm = %vm_id, "VM gone; dropping the claim");
                        if let Some((_, gen)) = self.claims().remove(&id) {
                            last_gen = Some(gen);
                        }
                        self.ledger.forget(&vm_id);
                        report.dropped += 1;
                    }
                }
            }
            if let Some(gen) = last_gen {
                if let Err(e) = self.commit(gen) {
                    tracing::warn!(error = %vmm::error_chain(&e), "journaling dropped claims failed");
                }
            }
            let mut named: HashSet<VmId> = self.claims().iter().map(|c| c.rec.vm.clone()).collect();
            for p in self.pools() {
                named.extend(p.warm_ids());
            }
            for vm in live.values() {
                if vm.id.as_str().starts_with("sbx-") && !named.contains(&vm.id) {
                    tracing::info!(vm = %vm.id, "destroying an unowned sandbox VM");
                    self.destroy(vm).await;
                    report.destroyed += 1;
                }
            }
            // Destroyed VMs gave their leases back; leases of VMs gone while we were down go now.
            report.leases_released = self.sweep_leases(&live).await;
            // Half-created VMs are listed (state `creating`) and were destroyed above when
            // unowned; records of VMs that died on their own are removed here.
            if let Err(e) = self.driver.prune().await {
                tracing::warn!(error = %vmm::error_chain(&e), "pruning dead VM records failed");
            }
            self.reconciled.store(true, Ordering::SeqCst);
            for p in self.pools() {
                p.kick();
            }
            tracing::info!(
                adopted = report.adopted,
                dropped = report.dropped,
                destroyed = report.destroyed,
                leases_released = report.leases_released,
                "reconciled"
            );
            Ok(report)
        }
        .instrument(span)
        .await
    }
}

fn clean_staging(goldens: &std::path::Path) {
    let Ok(rd) = std::fs::read_dir(goldens) else { return };
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().contains(".staging-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

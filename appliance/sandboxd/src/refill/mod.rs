//! The refill task of each pool, over its own context ([`Refill`]: the driver and the VM
//! network through [`Vms`], the catalog, timings, the refill semaphore, the counters, the
//! goldens, and the two switches refill obeys: draining and the end of the restart reconcile).
//! It never calls back into the node: nothing here knows about claims.
//!
//! Every tick (2 s) and on every kick (after each claim), [`step`] reserves slots for the
//! deficit `target − warm − refilling` and spawns one job per slot, each bounded by the node's
//! refill semaphore:
//! - golden: the first time (clone enabled, no golden yet) a single job cold-boots
//!   `sbx-gb-<hash>` with its RAM in a file (`Ram::SharedFile`), waits for silkd, snapshots it
//!   into `goldens/<hash>.staging-*` (the stream without the RAM, the file beside it), destroys
//!   it and renames the staging dir to `goldens/<hash>`. A failure retries after 30 s; meanwhile
//!   slots cold-boot;
//! - clone: `restore` from the golden (the clone maps the golden's RAM copy-on-write: it holds
//!   only the pages it writes), probe silkd (5 s), then reseed the guest kernel RNG with
//!   fresh host randomness (silkd `reseed`), since every clone resumes with the golden's RNG
//!   state; a clone that cannot be reseeded is destroyed, never pooled. Three clone failures in
//!   a row drop the golden (it is rebuilt); a failed clone falls back to a cold boot in the same
//!   slot;
//! - cold: boot from the catalog template, probe silkd (`boot_timeout_secs`).
//!
//! Network (`net: egress` pools only; `none` pools get no NIC): every VM of the pool (the golden
//! builder, each clone, each cold boot) first gets its own lease (egress on, no shared group:
//! isolated) and TAP on the node's [`vmnet::Network`], booted with that NIC (the kernel command
//! line addresses it); a clone is restored with its own NIC (`restore_with`) and re-addressed
//! through silkd (`guest-init net-config`, before the reseed: the golden's MAC and address are
//! dropped by the port filter until then). [`Vms::destroy`] deletes the TAP and releases the
//! lease; a VM that never started gives them back at once.
//!
//! A VM enters the pool only after silkd answers `info`. Failures back off (see
//! [`PoolState::failed`](crate::pool::PoolState::failed)); a template missing from the catalog
//! parks the pool and reports it.
//!
//! Budget: each slot (and the golden build) holds a [`Reservation`] of the node budget from
//! before its first VM operation to its end; a VM admitted to the pool keeps its share. When
//! the budget has no room for the whole deficit, the pool gets what fits and reports
//! `at_capacity` with the reason until a later step is granted in full.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tracing::Instrument as _;
use vmm::jail::CpuWeight;
use vmm::{AfterSnapshot, BootSpec, Catalog, Driver, NicSpec, Snapshot, Vm, VmId};

use crate::golden::{GoldenError, Goldens};
use crate::limits::Reservation;
use crate::metrics::{inc, Metrics};
use crate::options::Timing;
use crate::pool::{Net, Pool};
use crate::vms::{disk_mib, Vms, OWNERSHIP};

mod ready;
use ready::weigh;
pub use ready::{handed_out, restore_ready};

/// Clone failures in a row after which the golden is dropped and rebuilt.
const CLONE_FAILURES_TO_REBUILD: u32 = 3;

/// The most output of `guest-init net-config` kept (it prints a line or two).
const NET_CONFIG_OUTPUT_CAP: usize = 64 * 1024;

/// Why a slot failed.
#[derive(Debug, thiserror::Error)]
pub enum RefillError {
    /// The template is not in the catalog (parks the pool).
    #[error("template {template:?} is not in the image catalog")]
    Catalog {
        /// The template.
        template: String,
        /// The cause.
        #[source]
        source: vmm::CatalogError,
    },
    /// A driver operation failed.
    #[error("{what}")]
    Driver {
        /// What we were doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: vmm::DriverError,
    },
    /// The clone's guest RNG could not be reseeded (the clone is destroyed, never pooled).
    #[error("reseeding the clone's guest RNG")]
    Reseed {
        /// The cause.
        #[source]
        source: silkd_client::ClientError,
    },
    /// An egress pool on a node without a network (cannot happen after config validation).
    #[error("the pool asks for net egress, but this node has no network section")]
    NoNetwork,
    /// Leasing an address, making the TAP, or reading the lease failed.
    #[error("{what}")]
    Network {
        /// What we were doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: vmnet::VmnetError,
    },
    /// The clone could not be re-addressed through silkd.
    #[error("re-addressing the clone's network ({argv})")]
    NetConfig {
        /// The command run in the guest.
        argv: String,
        /// The cause.
        #[source]
        source: silkd_client::ClientError,
    },
    /// `guest-init net-config` failed in the guest.
    #[error("re-addressing the clone's network: {argv} exited {code}: {stderr}")]
    NetConfigExit {
        /// The command run in the guest.
        argv: String,
        /// Its exit code.
        code: i32,
        /// What it said (trimmed).
        stderr: String,
    },
    /// The task making an on-demand VM ended without an answer (it panicked).
    #[error("the task making the VM ended without an answer")]
    Abandoned,
    /// Making the goldens dir or moving the golden into place failed.
    #[error(transparent)]
    Golden(#[from] GoldenError),
}

/// What refill works with: everything a slot or a golden build touches, and nothing of the
/// node's claims.
#[derive(Debug)]
pub struct Refill {
    /// The driver, the VM network, the budget ledger, the counters; destroys VMs.
    pub vms: Arc<Vms>,
    /// Templates this node can boot.
    pub catalog: Catalog,
    /// Tick, probe budgets, retry and park waits.
    pub timing: Timing,
    /// Bounds concurrent refills (`refill_concurrency`).
    pub sem: Arc<Semaphore>,
    /// Where golden snapshots live.
    pub goldens: Goldens,
    /// Fill by cloning a golden snapshot.
    pub clone_enabled: bool,
    draining: AtomicBool,
    reconciled: AtomicBool,
}

impl Refill {
    /// A refill context; refill waits until [`Refill::mark_reconciled`].
    pub fn new(
        vms: Arc<Vms>,
        catalog: Catalog,
        timing: Timing,
        concurrency: usize,
        goldens: Goldens,
        clone: bool,
    ) -> Self {
        Refill {
            vms,
            catalog,
            timing,
            sem: Arc::new(Semaphore::new(concurrency.max(1))),
            goldens,
            clone_enabled: clone,
            draining: AtomicBool::new(false),
            reconciled: AtomicBool::new(false),
        }
    }

    fn driver(&self) -> &dyn Driver {
        self.vms.driver.as_ref()
    }

    fn metrics(&self) -> &Metrics {
        &self.vms.metrics
    }

    /// Whether the node is draining (no refill; VMs that finish booting are destroyed).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts or lifts a drain.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }

    /// Whether the restart reconcile has completed (refill starts only after it: its new VMs
    /// could be mistaken for unowned ones).
    pub fn reconciled(&self) -> bool {
        self.reconciled.load(Ordering::SeqCst)
    }

    /// Marks the restart reconcile done and wakes every pool.
    pub fn mark_reconciled(&self) {
        self.reconciled.store(true, Ordering::SeqCst);
        self.vms.pools.kick_all();
    }

    /// The golden of a new pool, when one of the running backend is on disk.
    pub fn load_golden(&self, hash: &str) -> Option<Snapshot> {
        self.goldens.load(hash, self.driver().backend())
    }
}

enum Tier {
    Clone,
    Cold,
}

/// The refill loop: runs until the pool is retired or the node stops.
pub async fn run(cx: Arc<Refill>, pool: Arc<Pool>) {
    let mut tick = tokio::time::interval(cx.timing.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = pool.cancel.cancelled() => return,
            _ = tick.tick() => {}
            () = pool.kick.notified() => {}
        }
        step(&cx, &pool);
    }
}

enum Plan {
    Golden(Reservation),
    Slots(Vec<Reservation>, Option<Box<Snapshot>>),
}

/// Reserves and spawns the work the pool needs now.
pub fn step(cx: &Arc<Refill>, pool: &Arc<Pool>) {
    if !cx.reconciled() || cx.draining() {
        return;
    }
    let now = Instant::now();
    let disk = disk_mib(&cx.catalog, pool.key.template());
    let plan = {
        let mut s = pool.lock();
        if s.retired || s.backoff_until.is_some_and(|t| now < t) {
            return;
        }
        let deficit = s.target.saturating_sub(s.warm.len() + s.refilling);
        if deficit == 0 {
            s.budget_blocked = None;
            return;
        }
        let golden_first =
            cx.clone_enabled && s.golden.is_none() && !s.golden_building && s.golden_retry_at.is_none_or(|t| now >= t);
        if cx.clone_enabled && s.golden.is_none() && s.golden_building {
            return;
        }
        let (granted, short) = cx.vms.ledger.reserve(if golden_first { 1 } else { deficit }, pool.key.size(), disk);
        if let Some(why) = &short {
            inc(&cx.metrics().refill_budget_blocked);
            if s.budget_blocked.as_deref() != Some(why.as_str()) {
                tracing::warn!(reason = %why, granted = granted.len(), deficit, "refill stopped at the node budget");
            }
        }
        s.budget_blocked = short;
        if golden_first {
            let Some(reservation) = granted.into_iter().next() else { return };
            s.golden_building = true;
            Plan::Golden(reservation)
        } else if granted.is_empty() {
            return;
        } else {
            s.refilling += granted.len();
            Plan::Slots(granted, s.golden.clone().filter(|_| cx.clone_enabled).map(Box::new))
        }
    };
    match plan {
        Plan::Golden(reservation) => {
            let (n, p) = (Arc::clone(cx), Arc::clone(pool));
            let span = tracing::info_span!("golden", template = %pool.key.template(), hash = %pool.hash);
            tokio::spawn(async move { build_golden(n, p, reservation).await }.instrument(span));
        }
        Plan::Slots(granted, golden) => {
            for reservation in granted {
                let (n, p, g) = (Arc::clone(cx), Arc::clone(pool), golden.clone());
                let span = tracing::info_span!("fill", template = %pool.key.template(), vm = tracing::field::Empty);
                tokio::spawn(async move { slot(n, p, g, reservation).await }.instrument(span));
            }
        }
    }
}

async fn slot(cx: Arc<Refill>, pool: Arc<Pool>, golden: Option<Box<Snapshot>>, reservation: Reservation) {
    let work = async {
        let Ok(_permit) = Arc::clone(&cx.sem).acquire_owned().await else {
            return None;
        };
        let made = match make_one(&cx, &pool, golden.as_deref(), CpuWeight::Background).await {
            Ok(made) => made,
            Err(e) => return Some(Err(e)),
        };
        Some(park(&cx, made.0).await.map(|vm| (vm, made.1)))
    };
    let outcome = tokio::select! {
        () = pool.cancel.cancelled() => None,
        r = work => r,
    };
    let mut doomed = None;
    let mut reservation = Some(reservation);
    {
        let mut s = pool.lock();
        s.refilling = s.refilling.saturating_sub(1);
        match outcome {
            None => {}
            Some(Ok((vm, tier))) => {
                tracing::Span::current().record("vm", vm.id.as_str());
                if s.retired || cx.draining() || s.warm.len() >= s.target {
                    doomed = Some(vm);
                } else {
                    tracing::info!(vm = %vm.id, "warm VM ready");
                    if let Some(r) = reservation.take() {
                        r.admit(&vm.id);
                    }
                    s.warm.push(vm);
                    s.succeeded();
                    inc(match tier {
                        Tier::Clone => &cx.metrics().refill_clone,
                        Tier::Cold => &cx.metrics().refill_cold,
                    });
                }
            }
            Some(Err(e)) => {
                inc(&cx.metrics().refill_failures);
                let reason = vmm::error_chain(&e);
                tracing::warn!(error = %reason, "refill failed");
                match e {
                    RefillError::Catalog { .. } => s.park(reason, Instant::now(), cx.timing.park),
                    _ => s.failed(reason, Instant::now()),
                }
            }
        }
    }
    if let Some(vm) = doomed {
        cx.vms.destroy(&vm).await;
    }
    // A slot that admitted nothing frees its share of the budget only now, after its VM (if
    // any) is destroyed.
    drop(reservation);
}

/// One VM of the pool: a clone of `golden` if there is one (a failed clone counts towards
/// dropping the golden, and falls back), else a cold boot.
async fn make_one(
    cx: &Refill,
    pool: &Pool,
    golden: Option<&Snapshot>,
    weight: CpuWeight,
) -> Result<(Vm, Tier), RefillError> {
    if let Some(g) = golden {
        match clone_one(cx, pool, g, weight).await {
            Ok(vm) => return Ok((vm, Tier::Clone)),
            Err(e) => tracing::warn!(error = %vmm::error_chain(&e), "clone failed; cold-booting instead"),
        }
    }
    cold_one(cx, pool, weight).await.map(|vm| (vm, Tier::Cold))
}

/// Stops a ready VM's vCPUs before it waits in the pool: a warm VM costs no CPU, and touches
/// no more memory, until a claim resumes it. One that cannot be paused is destroyed.
async fn park(cx: &Refill, vm: Vm) -> Result<Vm, RefillError> {
    match cx.driver().pause(&vm).await {
        Ok(()) => Ok(vm),
        Err(source) => {
            cx.vms.destroy(&vm).await;
            Err(RefillError::Driver { what: "pausing the warm VM", source })
        }
    }
}

/// A VM for a claim that found its pool empty, made now, as upstream does: a clone of the
/// golden (a cold boot when the pool has none), ready (silkd answers) and running. `Refused`,
/// with why, when the node budget has no room for it (or the node is draining or not
/// reconciled yet): the claim answers 429.
/// The VM is made on its own task: a claim that goes away meanwhile (its client hung up) leaves
/// the VM to the pool, paused, instead of killing it half-made.
pub async fn on_demand(cx: &Arc<Refill>, pool: &Arc<Pool>) -> Result<Vm, Miss> {
    if cx.draining() {
        return Err(Miss::Refused("the node is draining".into()));
    }
    if !cx.reconciled() {
        return Err(Miss::Refused("the node is still reconciling its VMs after a restart".into()));
    }
    // A clone is cheap; a cold boot is not: while the golden is being built, or while another
    // boot for this pool is in flight, the claim is refused rather than adding a boot that
    // competes with those for the CPU (each retry of an impatient client would add one).
    let golden = {
        let s = pool.lock();
        let golden = s.golden.clone().filter(|_| cx.clone_enabled);
        if golden.is_none() && cx.clone_enabled && s.golden_building {
            return Err(Miss::Refused("the pool's golden snapshot is still being built".into()));
        }
        if golden.is_none() && (s.on_demand_booting > 0 || s.refilling > 0) {
            return Err(Miss::Refused("a VM for this pool is already booting".into()));
        }
        golden
    };
    let disk = disk_mib(&cx.catalog, pool.key.template());
    let (granted, short) = cx.vms.ledger.reserve(1, pool.key.size(), disk);
    let Some(reservation) = granted.into_iter().next() else {
        return Err(Miss::Refused(short.unwrap_or_else(|| "the node budget is full".into())));
    };
    let cold = golden.is_none();
    if cold {
        pool.lock().on_demand_booting += 1;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (cx, pool) = (Arc::clone(cx), Arc::clone(pool));
    let span = tracing::info_span!("on_demand", template = %pool.key.template());
    tokio::spawn(
        async move {
            // One attempt: a failed clone fails the claim rather than adding a cold boot (the
            // pool's own refill falls back to those, one slot at a time).
            let made = match golden.as_ref() {
                Some(g) => clone_one(&cx, &pool, g, CpuWeight::Normal).await,
                None => cold_one(&cx, &pool, CpuWeight::Normal).await,
            };
            if cold {
                pool.lock().on_demand_booting -= 1;
            }
            if let Ok(vm) = &made {
                reservation.admit(&vm.id);
            }
            let Err(Ok(vm)) = tx.send(made) else { return };
            // The claim is gone: the VM waits in the pool like any warm one.
            let full = {
                let s = pool.lock();
                s.retired || s.warm.len() >= s.target
            };
            if full || cx.draining() {
                cx.vms.destroy(&vm).await;
            } else if let Ok(vm) = park(&cx, vm).await {
                pool.lock().warm.push(vm);
            }
        }
        .instrument(span),
    );
    rx.await.unwrap_or(Err(RefillError::Abandoned)).map_err(Miss::Failed)
}

/// Why a claim on an empty pool got no VM made for it.
#[derive(Debug, thiserror::Error)]
pub enum Miss {
    /// No VM was started: the node budget has no room, or the node drains.
    #[error("{0}")]
    Refused(String),
    /// The VM made for the claim failed.
    #[error(transparent)]
    Failed(RefillError),
}

fn clone_failed(cx: &Refill, pool: &Pool) {
    let drop_golden = {
        let mut s = pool.lock();
        s.clone_failures += 1;
        if s.clone_failures >= CLONE_FAILURES_TO_REBUILD && s.golden.is_some() {
            s.golden = None;
            s.clone_failures = 0;
            s.golden_retry_at = Some(Instant::now() + cx.timing.golden_retry);
            true
        } else {
            false
        }
    };
    if drop_golden {
        tracing::warn!(golden = %cx.goldens.path(&pool.hash).display(), "clones keep failing; dropping the golden");
        cx.goldens.remove(&pool.hash);
    }
}

fn spec_for(cx: &Refill, pool: &Pool, id_prefix: String) -> Result<BootSpec, RefillError> {
    let mut spec = BootSpec::from_template(&cx.catalog, pool.key.template(), pool.key.size())
        .map_err(|source| RefillError::Catalog { template: pool.key.template().to_string(), source })?;
    // The driver names a booted VM `<spec.name>-<8 hex>`: this gives our VMs the `sbx-` prefix
    // the restart sweep relies on.
    spec.name = id_prefix;
    Ok(spec)
}

fn vm_prefix(pool: &Pool) -> String {
    prefix_for(&pool.hash)
}

/// `sbx-<12 hex of the pool key's hash>`: the names of a pool's VMs (and its forks' children).
pub(crate) fn prefix_for(key_hash: &str) -> String {
    format!("{}{}", OWNERSHIP.prefix(), &key_hash[..12])
}

async fn probe(cx: &Refill, vm: Vm, budget: std::time::Duration) -> Result<Vm, RefillError> {
    match cx.driver().wait_agent(&vm, budget).await {
        Ok(_) => Ok(vm),
        Err(source) => {
            cx.vms.destroy(&vm).await;
            Err(RefillError::Driver { what: "waiting for silkd", source })
        }
    }
}

/// The lease (egress, isolated) and TAP of a new VM of an egress pool, keyed `key`, and its
/// NIC; `None` for a `none` pool.
async fn nic_for(cx: &Refill, lane: Net, key: &VmId) -> Result<Option<(vmnet::Lease, NicSpec)>, RefillError> {
    if lane != Net::Egress {
        return Ok(None);
    }
    let net = cx.vms.net.as_ref().ok_or(RefillError::NoNetwork)?;
    let policy = vmnet::VmPolicy { group: None, egress: true };
    let lease = net.allocate_with(key.as_str(), &policy).map_err(|source| {
        inc(&cx.metrics().network_failures);
        RefillError::Network { what: "leasing an address", source }
    })?;
    if let Err(source) = net.create_tap(&lease).await {
        inc(&cx.metrics().network_failures);
        cx.vms.release_nic(key, &lease.tap).await;
        return Err(RefillError::Network { what: "creating the TAP", source });
    }
    tracing::debug!(vm = %key, ip = %lease.ip, tap = %lease.tap, "NIC ready");
    let nic = net.nic_spec(&lease);
    Ok(Some((lease, nic)))
}

/// Gives back the NIC of a VM that never started.
async fn unstarted(cx: &Refill, key: &VmId, nic: Option<&(vmnet::Lease, NicSpec)>) {
    if let Some((lease, _)) = nic {
        cx.vms.release_nic(key, &lease.tap).await;
    }
}

/// A clone of the pool's golden; the outcome counts towards dropping the golden (a success
/// resets the count of failures in a row).
async fn clone_one(cx: &Refill, pool: &Pool, golden: &Snapshot, weight: CpuWeight) -> Result<Vm, RefillError> {
    let made = restore_ready(cx, &pool.key, golden, weight).await;
    match &made {
        Ok(_) => pool.lock().clone_failures = 0,
        Err(_) => clone_failed(cx, pool),
    }
    made
}

/// Boots `spec` at `weight`, with a NIC of its own for an egress pool (given back if the boot
/// fails).
async fn boot_with_nic(
    cx: &Refill,
    pool: &Pool,
    mut spec: BootSpec,
    what: &'static str,
    weight: CpuWeight,
) -> Result<Vm, RefillError> {
    let key = VmId::generate(&spec.name);
    let nic = nic_for(cx, pool.key.net(), &key).await?;
    spec.nic = nic.as_ref().map(|(_, n)| n.clone());
    match cx.driver().boot(&spec).await {
        Ok(vm) => {
            weigh(cx, &vm, weight).await;
            Ok(vm)
        }
        Err(source) => {
            unstarted(cx, &key, nic.as_ref()).await;
            Err(RefillError::Driver { what, source })
        }
    }
}

async fn cold_one(cx: &Refill, pool: &Pool, weight: CpuWeight) -> Result<Vm, RefillError> {
    let spec = spec_for(cx, pool, vm_prefix(pool))?;
    let vm = boot_with_nic(cx, pool, spec, "cold boot", weight).await?;
    probe(cx, vm, cx.timing.cold_probe).await
}

async fn build_golden(cx: Arc<Refill>, pool: Arc<Pool>, reservation: Reservation) {
    let permit = Arc::clone(&cx.sem).acquire_owned().await;
    let result = tokio::select! {
        () = pool.cancel.cancelled() => None,
        r = golden_inner(&cx, &pool) => Some(r),
    };
    drop(permit);
    // The golden builder VM is destroyed by now.
    drop(reservation);
    {
        let mut s = pool.lock();
        s.golden_building = false;
        match result {
            None => {}
            Some(Ok(snap)) => {
                inc(&cx.metrics().goldens_built);
                tracing::info!(golden = %snap.dir.display(), "golden snapshot ready");
                s.golden = Some(snap);
                s.golden_retry_at = None;
                s.clone_failures = 0;
            }
            Some(Err(e)) => {
                inc(&cx.metrics().golden_failures);
                let reason = vmm::error_chain(&e);
                tracing::warn!(error = %reason, "golden build failed; cold boots until the retry");
                s.golden_retry_at = Some(Instant::now() + cx.timing.golden_retry);
                match e {
                    RefillError::Catalog { .. } => s.park(reason, Instant::now(), cx.timing.park),
                    _ => s.failed(reason, Instant::now()),
                }
            }
        }
    }
    pool.kick();
}

async fn golden_inner(cx: &Refill, pool: &Pool) -> Result<Snapshot, RefillError> {
    let mut spec = spec_for(cx, pool, format!("{}gb-{}", OWNERSHIP.prefix(), pool.hash))?;
    // Its RAM stays in a file its clones map copy-on-write: a warm clone holds only the pages
    // it has written since.
    spec.ram = vmm::Ram::SharedFile;
    let vm = boot_with_nic(cx, pool, spec, "booting the golden", CpuWeight::Background).await?;
    let vm = probe(cx, vm, cx.timing.cold_probe).await?;
    let made = async {
        let staging = cx.goldens.staging(&pool.hash)?;
        Ok::<_, RefillError>((cx.driver().snapshot(&vm, &staging, AfterSnapshot::Paused).await, staging))
    }
    .await;
    cx.vms.destroy(&vm).await;
    let (snap, staging) = made?;
    let snap = match snap {
        Ok(s) => s,
        Err(source) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(RefillError::Driver { what: "snapshotting the golden", source });
        }
    };
    Ok(cx.goldens.install(snap, &staging, &pool.hash)?)
}

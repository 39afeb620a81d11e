//! The bounds nobody can talk the node out of.
//!
//! - [`Budget`]: how many VMs, how much memory (each VM counted with its size class's memory)
//!   and how much disk (each VM counted with the most its writable overlay can grow to,
//!   [`vmm::disk::writable_disk_cap`]) warm, refilling and claimed VMs may take together.
//!   Defaults come from the host ([`Budget::from_mem_total`]: `MemTotal` minus a reserve;
//!   [`default_max_disk_mib`]: three quarters of the filesystem holding the VMs). The [`Ledger`]
//!   counts what the node holds; refill reserves from it and stops at the budget.
//! - the lease horizon (`max_lifetime_secs`): a lease never runs past `claimed_at` + horizon;
//! - [`ClaimCaps`](crate::slots::ClaimCaps): the per-claim caps on concurrent uses
//!   (`crate::slots`);
//! - [`ExecTimeouts`]: the default and the maximum `/exec` timeout;
//! - [`HttpLimits`]: the HTTP server's connection cap, request-head and body deadlines, and the
//!   relay idle timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vmm::{SizeClass, VmId};

use crate::pool::PoolKey;
use crate::slots::ClaimCaps;

/// The smallest size class's memory: the default `max_vms` is the memory budget over it.
pub const SMALLEST_VM_MIB: u64 = 512;
/// The default `max_vms` never exceeds this (each VM also costs processes, sockets and
/// descriptors, whatever its size).
pub const MAX_VMS_CEILING: usize = 1024;
/// The least memory kept back for the host (kernel, sandboxd, the other services).
pub const RESERVE_MIN_MIB: u64 = 1024;
/// `max_disk_mib` when no disk budget applies (tests, benches).
pub const UNLIMITED_DISK_MIB: u64 = u64::MAX;
/// The share of the VM filesystem the default disk budget takes, in quarters: the rest is
/// for images, golden snapshots, journals and logs on the same partition.
const DISK_QUARTERS: u64 = 3;

/// What warm + refilling + claimed VMs may take together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// VMs at most.
    pub max_vms: usize,
    /// Memory at most, in MiB (the sum of the VMs' size-class memory).
    pub max_memory_mib: u64,
    /// Disk at most, in MiB (the sum of the VMs' worst-case overlay sizes).
    pub max_disk_mib: u64,
}

/// Why a set of pool targets cannot fit the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// More warm VMs than `max_vms`.
    #[error(
        "the warm targets add up to {vms} VMs, over the node budget max_vms = {max_vms}; lower the warm \
         targets or raise max_vms in sandboxd's config"
    )]
    Vms {
        /// Σ warm.
        vms: usize,
        /// The limit.
        max_vms: usize,
    },
    /// More memory than `max_memory_mib`.
    #[error(
        "the warm targets need {memory_mib} MiB ({detail}), over the node budget max_memory_mib = {max_memory_mib}; \
         lower the warm targets or raise max_memory_mib in sandboxd's config"
    )]
    Memory {
        /// Σ warm × size memory.
        memory_mib: u64,
        /// The limit.
        max_memory_mib: u64,
        /// Per pool: `<warm> × <size> (<mib> MiB)`.
        detail: String,
    },
}

impl Budget {
    /// The budget derived from the host's memory: `max_memory_mib` = `MemTotal` − reserve, the
    /// reserve being an eighth of `MemTotal` but at least [`RESERVE_MIN_MIB`]; `max_vms` =
    /// `max_memory_mib` / [`SMALLEST_VM_MIB`], at most [`MAX_VMS_CEILING`] (and at least 1).
    pub fn from_mem_total(mem_total_mib: u64) -> Budget {
        let reserve = (mem_total_mib / 8).max(RESERVE_MIN_MIB);
        let max_memory_mib = mem_total_mib.saturating_sub(reserve);
        Budget { max_vms: default_max_vms(max_memory_mib), max_memory_mib, max_disk_mib: UNLIMITED_DISK_MIB }
    }

    /// Checks warm targets against the budget (both limits; the VM count first).
    pub fn check(&self, targets: &[(PoolKey, usize)]) -> Result<(), BudgetError> {
        let vms: usize = targets.iter().map(|(_, w)| *w).fold(0, usize::saturating_add);
        if vms > self.max_vms {
            return Err(BudgetError::Vms { vms, max_vms: self.max_vms });
        }
        let memory_mib: u64 =
            targets.iter().map(|(k, w)| mib(k.size()).saturating_mul(*w as u64)).fold(0, u64::saturating_add);
        if memory_mib > self.max_memory_mib {
            let detail = targets
                .iter()
                .filter(|(_, w)| *w > 0)
                .map(|(k, w)| format!("{w} × {} {} MiB", k.size(), mib(k.size())))
                .collect::<Vec<_>>()
                .join(" + ");
            return Err(BudgetError::Memory { memory_mib, max_memory_mib: self.max_memory_mib, detail });
        }
        Ok(())
    }
}

/// `max_vms` when only the memory is known.
pub fn default_max_vms(max_memory_mib: u64) -> usize {
    usize::try_from(max_memory_mib / SMALLEST_VM_MIB).unwrap_or(usize::MAX).clamp(1, MAX_VMS_CEILING)
}

/// The memory a VM of `size` is counted with.
pub fn mib(size: SizeClass) -> u64 {
    size.memory_mib()
}

/// The default `max_disk_mib`: three quarters of the size of the filesystem holding `dir`
/// (the VM state directory, or the nearest ancestor that exists yet).
pub fn default_max_disk_mib(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut at = dir;
    while !at.exists() {
        at = at.parent().unwrap_or(std::path::Path::new("/"));
    }
    let st = rustix::fs::statvfs(at).map_err(std::io::Error::from)?;
    let total = st.f_blocks.saturating_mul(st.f_frsize);
    Ok(vmm::disk::mib_ceil(total) / 4 * DISK_QUARTERS)
}

/// `MemTotal` of `/proc/meminfo`, in MiB.
pub fn host_mem_total_mib() -> std::io::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_total(&text).ok_or_else(|| std::io::Error::other("/proc/meminfo has no MemTotal line"))
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// What the node holds against its budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// VMs held or being made.
    pub vms: usize,
    /// Their memory, MiB.
    pub memory_mib: u64,
    /// Their worst-case disk, MiB.
    pub disk_mib: u64,
}

/// What one VM is counted with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Cost {
    /// Its size class's memory, MiB.
    memory_mib: u64,
    /// The most its writable overlay can take, MiB.
    disk_mib: u64,
}

impl Cost {
    /// A VM of `size` whose overlay can take at most `disk_mib`.
    fn new(size: SizeClass, disk_mib: u64) -> Cost {
        Cost { memory_mib: mib(size), disk_mib }
    }
}

impl Usage {
    fn add(&mut self, c: Cost, n: usize) {
        self.vms = self.vms.saturating_add(n);
        self.memory_mib = self.memory_mib.saturating_add(c.memory_mib.saturating_mul(n as u64));
        self.disk_mib = self.disk_mib.saturating_add(c.disk_mib.saturating_mul(n as u64));
    }

    fn sub(&mut self, c: Cost) {
        self.vms = self.vms.saturating_sub(1);
        self.memory_mib = self.memory_mib.saturating_sub(c.memory_mib);
        self.disk_mib = self.disk_mib.saturating_sub(c.disk_mib);
    }
}

#[derive(Debug, Default)]
struct LedgerState {
    /// VMs the node holds (warm or claimed), with what they are counted with.
    held: HashMap<VmId, Cost>,
    /// Refill and golden slots in flight.
    pending: usize,
    used: Usage,
}

/// The count of everything the node holds or is making, against the [`Budget`].
///
/// A refill slot (or a golden build) [`Ledger::reserve`]s before any VM work and holds a
/// [`Reservation`] until it ends; a VM admitted to a pool turns its reservation into a held
/// VM ([`Reservation::admit`]); claims keep their VM held (a claim moves a VM, it does not add
/// one); [`Ledger::forget`] drops a VM once its destroy succeeded. So a dying VM counts until
/// its process is gone, and two pools racing for the last slot cannot both get it.
#[derive(Debug)]
pub struct Ledger {
    budget: Budget,
    state: Mutex<LedgerState>,
}

impl Ledger {
    /// An empty ledger under `budget`.
    pub fn new(budget: Budget) -> Arc<Ledger> {
        Arc::new(Ledger { budget, state: Mutex::new(LedgerState::default()) })
    }

    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        // Plain counters updated in single statements: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The budget.
    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// What is held now.
    pub fn usage(&self) -> Usage {
        self.lock().used
    }

    /// Counts a VM the node holds (a claim re-adopted after a restart). Idempotent per id.
    pub fn hold(&self, vm: &VmId, size: SizeClass, disk_mib: u64) {
        let cost = Cost::new(size, disk_mib);
        let mut s = self.lock();
        if s.held.insert(vm.clone(), cost).is_none() {
            s.used.add(cost, 1);
        }
    }

    /// Stops counting a VM (destroyed, or found gone). Unknown ids are ignored.
    pub fn forget(&self, vm: &VmId) {
        let mut s = self.lock();
        if let Some(c) = s.held.remove(vm) {
            s.used.sub(c);
        }
    }

    /// Reserves up to `want` VMs of `size` whose overlays can take `disk_mib` each; returns the
    /// reservations granted (fewer when the budget is reached) and, when short, why.
    pub fn reserve(
        self: &Arc<Self>,
        want: usize,
        size: SizeClass,
        disk_mib: u64,
    ) -> (Vec<Reservation>, Option<String>) {
        let cost = Cost::new(size, disk_mib);
        let b = self.budget;
        let mut s = self.lock();
        let fit = |max: u64, used: u64, each: u64| match each {
            0 => usize::MAX,
            each => usize::try_from(max.saturating_sub(used) / each).unwrap_or(usize::MAX),
        };
        let by_vms = b.max_vms.saturating_sub(s.used.vms);
        let by_mem = fit(b.max_memory_mib, s.used.memory_mib, cost.memory_mib.max(1));
        let by_disk = fit(b.max_disk_mib, s.used.disk_mib, cost.disk_mib);
        let n = want.min(by_vms).min(by_mem).min(by_disk);
        s.used.add(cost, n);
        s.pending += n;
        let short = (n < want).then(|| {
            let mut limits = Vec::new();
            if by_vms == n {
                limits.push(format!("max_vms = {}", b.max_vms));
            }
            if by_mem == n {
                limits.push(format!("max_memory_mib = {}", b.max_memory_mib));
            }
            if by_disk == n {
                limits.push(format!("max_disk_mib = {}", b.max_disk_mib));
            }
            let limit = limits.join(", ");
            format!(
                "node budget reached ({limit}): {} VMs / {} MiB memory / {} MiB disk held or booting, a {size} VM \
                 needs {} MiB memory and {} MiB disk",
                s.used.vms, s.used.memory_mib, s.used.disk_mib, cost.memory_mib, cost.disk_mib
            )
        });
        drop(s);
        let r = (0..n).map(|_| Reservation { ledger: Arc::clone(self), cost, open: true }).collect();
        (r, short)
    }

    fn end_pending(&self, cost: Cost, admit: Option<&VmId>) {
        let mut s = self.lock();
        s.pending = s.pending.saturating_sub(1);
        match admit {
            Some(vm) if !s.held.contains_key(vm) => {
                s.held.insert(vm.clone(), cost);
            }
            _ => s.used.sub(cost),
        }
    }
}

/// One reserved VM slot (a refill in flight or a golden build). Dropped: the slot is free.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    cost: Cost,
    open: bool,
}

impl Reservation {
    /// The slot made `vm` and it joined a pool: the ledger now holds that VM instead.
    pub fn admit(mut self, vm: &VmId) {
        self.open = false;
        self.ledger.end_pending(self.cost, Some(vm));
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.open {
            self.ledger.end_pending(self.cost, None);
        }
    }
}

/// `/exec` timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecTimeouts {
    /// `timeout_seconds` absent or 0 (`exec_default_timeout_secs`).
    pub default: Duration,
    /// Larger `timeout_seconds` are refused (`exec_max_timeout_secs`).
    pub max: Duration,
}

impl Default for ExecTimeouts {
    fn default() -> Self {
        use sandboxd_api::config::{DEFAULT_EXEC_MAX_TIMEOUT_SECS, DEFAULT_EXEC_TIMEOUT_SECS};
        ExecTimeouts {
            default: Duration::from_secs(DEFAULT_EXEC_TIMEOUT_SECS),
            max: Duration::from_secs(DEFAULT_EXEC_MAX_TIMEOUT_SECS),
        }
    }
}

/// The HTTP server's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Open connections per listener (`max_connections`).
    pub max_connections: usize,
    /// Request head, and idle keep-alive (`header_timeout_secs`).
    pub header_timeout: Duration,
    /// A whole request body (`body_timeout_secs`).
    pub body_timeout: Duration,
    /// A relay with no byte either way for this long is closed (`relay_idle_timeout_secs`).
    pub relay_idle: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        use sandboxd_api::config as d;
        HttpLimits {
            max_connections: d::DEFAULT_MAX_CONNECTIONS,
            // Longer than the SDK's keep_alive (30 s): the SDK drops a parked keep-alive
            // connection before the server would, so a reused one is never closed under it.
            header_timeout: Duration::from_secs(d::DEFAULT_HEADER_TIMEOUT_SECS),
            body_timeout: Duration::from_secs(d::DEFAULT_BODY_TIMEOUT_SECS),
            relay_idle: Duration::from_secs(d::DEFAULT_RELAY_IDLE_TIMEOUT_SECS),
        }
    }
}

/// Every limit of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The node budget.
    pub budget: Budget,
    /// The lease horizon, from the first grant (`max_lifetime_secs`).
    pub max_lifetime: Duration,
    /// Per-claim caps.
    pub caps: ClaimCaps,
    /// `/exec` timeouts.
    pub exec: ExecTimeouts,
    /// HTTP.
    pub http: HttpLimits,
    /// Fork and checkpoints.
    pub branching: Branching,
}

/// The limits of fork and checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Branching {
    /// Most children of one fork (`max_fork_count`).
    pub max_fork_count: usize,
    /// Age at which a checkpoint is deleted (`checkpoint_ttl_hours`); `None` keeps it.
    pub checkpoint_ttl: Option<Duration>,
}

impl Default for Branching {
    fn default() -> Self {
        Branching {
            max_fork_count: sandboxd_api::config::DEFAULT_MAX_FORK_COUNT,
            checkpoint_ttl: Some(Duration::from_secs(sandboxd_api::config::DEFAULT_CHECKPOINT_TTL_HOURS * 3600)),
        }
    }
}

/// The default lease horizon: 7 days.
pub const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(sandboxd_api::config::DEFAULT_MAX_LIFETIME_SECS);

impl Limits {
    /// Defaults with `budget` (tests and tools; the daemon derives its budget from the host).
    pub fn with_budget(budget: Budget) -> Limits {
        Limits {
            budget,
            max_lifetime: DEFAULT_MAX_LIFETIME,
            caps: ClaimCaps::default(),
            exec: ExecTimeouts::default(),
            http: HttpLimits::default(),
            branching: Branching::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(size: &str) -> PoolKey {
        PoolKey::parse("base", None, Some(size)).expect("key")
    }

    #[test]
    fn derived_budget() {
        assert_eq!(parse_mem_total("MemTotal:       24683568 kB\nMemFree: 1 kB\n"), Some(24105));
        assert_eq!(parse_mem_total("nothing"), None);
        // 24 GiB: an eighth is kept back.
        assert_eq!(
            Budget::from_mem_total(24576),
            Budget { max_vms: 42, max_memory_mib: 21504, max_disk_mib: UNLIMITED_DISK_MIB }
        );
        // 4 GiB: the 1 GiB floor.
        assert_eq!(
            Budget::from_mem_total(4096),
            Budget { max_vms: 6, max_memory_mib: 3072, max_disk_mib: UNLIMITED_DISK_MIB }
        );
        // Tiny hosts still allow one VM in the count (the memory limit decides).
        assert_eq!(
            Budget::from_mem_total(512),
            Budget { max_vms: 1, max_memory_mib: 0, max_disk_mib: UNLIMITED_DISK_MIB }
        );
        // Huge hosts: the VM ceiling.
        assert_eq!(Budget::from_mem_total(4 << 20).max_vms, MAX_VMS_CEILING);
    }

    #[test]
    fn check_names_the_limit_and_the_numbers() {
        let b = Budget { max_vms: 10, max_memory_mib: 4096, max_disk_mib: UNLIMITED_DISK_MIB };
        assert_eq!(b.check(&[(key("small"), 4), (key("medium"), 2)]), Ok(()));
        let e = b.check(&[(key("small"), 100_000)]).expect_err("vms");
        assert_eq!(e, BudgetError::Vms { vms: 100_000, max_vms: 10 });
        assert!(e.to_string().contains("max_vms = 10") && e.to_string().contains("100000 VMs"), "{e}");
        let e = b.check(&[(key("small"), 2), (key("large"), 1)]).expect_err("memory");
        let msg = e.to_string();
        assert!(msg.contains("5120 MiB") && msg.contains("max_memory_mib = 4096"), "{msg}");
        assert!(msg.contains("2 × small 512 MiB + 1 × large 4096 MiB"), "{msg}");
    }

    #[test]
    fn ledger_reserves_up_to_the_budget_and_frees() {
        let l = Ledger::new(Budget { max_vms: 3, max_memory_mib: 2048, max_disk_mib: UNLIMITED_DISK_MIB });
        let (a, short) = l.reserve(2, SizeClass::Small, 0);
        assert_eq!((a.len(), short), (2, None));
        // 1 GiB left: one medium, no more.
        let (b, short) = l.reserve(2, SizeClass::Medium, 0);
        assert_eq!(b.len(), 1);
        assert!(short.as_deref().is_some_and(|s| s.contains("max_memory_mib = 2048")), "{short:?}");
        assert_eq!(l.usage(), Usage { vms: 3, memory_mib: 2048, disk_mib: 0 });
        let (c, short) = l.reserve(1, SizeClass::Small, 0);
        assert!(c.is_empty() && short.as_deref().is_some_and(|s| s.contains("max_vms = 3")), "{short:?}");
        // A reservation admitted holds its VM until it is forgotten; a dropped one frees at once.
        let vm = VmId::new("sbx-1").expect("id");
        let mut a = a.into_iter();
        a.next().expect("r").admit(&vm);
        drop(a);
        assert_eq!(l.usage(), Usage { vms: 2, memory_mib: 1536, disk_mib: 0 });
        drop(b);
        l.forget(&vm);
        l.forget(&vm);
        assert_eq!(l.usage(), Usage::default());
        l.hold(&vm, SizeClass::Large, 10);
        l.hold(&vm, SizeClass::Large, 10);
        assert_eq!(l.usage(), Usage { vms: 1, memory_mib: 4096, disk_mib: 10 });
    }

    #[test]
    fn ledger_stops_at_the_disk_budget_and_names_it() {
        let l = Ledger::new(Budget { max_vms: 100, max_memory_mib: 1 << 20, max_disk_mib: 1000 });
        // 300 MiB overlays: three fit in 1000 MiB, the fourth does not.
        let (a, short) = l.reserve(5, SizeClass::Small, 300);
        assert_eq!(a.len(), 3);
        let short = short.expect("short");
        assert!(short.contains("max_disk_mib = 1000") && !short.contains("max_vms"), "{short}");
        assert!(short.contains("900 MiB disk held") && short.contains("300 MiB disk"), "{short}");
        assert_eq!(l.usage().disk_mib, 900);
        // A template without an overlay costs no disk: only the other limits apply.
        let (b, short) = l.reserve(2, SizeClass::Small, 0);
        assert_eq!((b.len(), short), (2, None));
        // A VM re-held after a restart counts its disk; forgetting it gives the disk back.
        let vm = VmId::new("sbx-9").expect("id");
        drop(a);
        l.hold(&vm, SizeClass::Small, 600);
        assert_eq!(l.usage().disk_mib, 600);
        let (c, _) = l.reserve(2, SizeClass::Small, 300);
        assert_eq!(c.len(), 1);
        drop(c);
        l.forget(&vm);
        assert_eq!(l.usage().disk_mib, 0);
    }

    #[test]
    fn the_default_disk_budget_is_three_quarters_of_the_filesystem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = rustix::fs::statvfs(dir.path()).expect("statvfs");
        let total_mib = (st.f_blocks * st.f_frsize) >> 20;
        // A directory that does not exist yet is measured at its nearest existing ancestor.
        let got = default_max_disk_mib(&dir.path().join("vms/not/yet")).expect("budget");
        assert!(got <= total_mib * 3 / 4 + 1 && got + 2 >= total_mib * 3 / 4, "{got} of {total_mib}");
    }
}

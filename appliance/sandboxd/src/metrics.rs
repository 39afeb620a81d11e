//! Counters beside the logs, rendered as Prometheus text (`GET /metrics`, names `sandboxd_*`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::limits::{Budget, Usage};
use crate::pool::PoolInfo;

/// Process-wide counters. Gauges (warm, target, claimed) are read from live state at render time.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Claims granted from a warm VM.
    pub claims_warm: AtomicU64,
    /// Claims refused: pool empty.
    pub claims_no_capacity: AtomicU64,
    /// Claims refused: draining.
    pub claims_draining: AtomicU64,
    /// Claims refused for another reason (bad request, journal failure, unknown template).
    pub claims_failed: AtomicU64,
    /// Releases.
    pub releases: AtomicU64,
    /// Renewals.
    pub renews: AtomicU64,
    /// Leases reaped.
    pub reaped: AtomicU64,
    /// VMs admitted to a pool from a clone.
    pub refill_clone: AtomicU64,
    /// VMs admitted to a pool from a cold boot.
    pub refill_cold: AtomicU64,
    /// Refill attempts that failed.
    pub refill_failures: AtomicU64,
    /// Golden snapshots built.
    pub goldens_built: AtomicU64,
    /// Golden builds that failed.
    pub golden_failures: AtomicU64,
    /// Clones destroyed because their guest RNG could not be reseeded.
    pub clone_reseed_failures: AtomicU64,
    /// VMs destroyed.
    pub vms_destroyed: AtomicU64,
    /// VM destroys that failed.
    pub destroy_failures: AtomicU64,
    /// `/agent` relays opened.
    pub agent_relays: AtomicU64,
    /// `/ports` relays opened.
    pub port_relays: AtomicU64,
    /// `/exec` calls.
    pub execs: AtomicU64,
    /// Refill steps the node budget stopped short.
    pub refill_budget_blocked: AtomicU64,
    /// `/agent` relays refused at the per-claim cap.
    pub agent_relays_refused: AtomicU64,
    /// `/ports` relays refused at the per-claim cap.
    pub port_relays_refused: AtomicU64,
    /// `/exec` calls refused at the per-claim cap.
    pub execs_refused: AtomicU64,
    /// Relays closed after `relay_idle_timeout_secs` without a byte.
    pub relays_idle_closed: AtomicU64,
    /// Request bodies not received within `body_timeout_secs`.
    pub body_timeouts: AtomicU64,
    /// Requests refused for a missing or wrong token (401).
    pub auth_failures: AtomicU64,
    /// Network operations of egress VMs (lease, TAP, guest re-addressing, release) that failed.
    pub network_failures: AtomicU64,
}

/// Bumps a counter.
pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Metrics {
    /// Renders everything as Prometheus text exposition.
    pub fn render(
        &self,
        pools: &[PoolInfo],
        claimed: usize,
        draining: bool,
        budget: Budget,
        used: Usage,
        conns: &httpd::ConnStats,
    ) -> String {
        let mut o = String::new();
        let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
            let _ = writeln!(o, "# HELP sandboxd_{name} {help}\n# TYPE sandboxd_{name} counter");
            for (labels, v) in rows {
                let _ = writeln!(o, "sandboxd_{name}{labels} {v}");
            }
        };
        counter(
            "claims_total",
            "Claims by result and tier.",
            &[
                ("{result=\"granted\",tier=\"warm\"}", get(&self.claims_warm)),
                ("{result=\"no_capacity\",tier=\"\"}", get(&self.claims_no_capacity)),
                ("{result=\"draining\",tier=\"\"}", get(&self.claims_draining)),
                ("{result=\"error\",tier=\"\"}", get(&self.claims_failed)),
            ],
        );
        counter("releases_total", "Sandboxes released.", &[("", get(&self.releases))]);
        counter("renews_total", "Leases renewed.", &[("", get(&self.renews))]);
        counter("reaped_total", "Expired leases reaped.", &[("", get(&self.reaped))]);
        counter(
            "refills_total",
            "VMs admitted to a pool, by how they were made.",
            &[("{tier=\"clone\"}", get(&self.refill_clone)), ("{tier=\"cold\"}", get(&self.refill_cold))],
        );
        counter("refill_failures_total", "Refill attempts that failed.", &[("", get(&self.refill_failures))]);
        counter(
            "golden_builds_total",
            "Golden snapshot builds by result.",
            &[("{result=\"ok\"}", get(&self.goldens_built)), ("{result=\"failed\"}", get(&self.golden_failures))],
        );
        counter(
            "clone_reseed_failures_total",
            "Clones destroyed because their guest RNG could not be reseeded (the slot cold-boots instead).",
            &[("", get(&self.clone_reseed_failures))],
        );
        counter(
            "network_failures_total",
            "Network operations of egress VMs (lease, TAP, guest re-addressing, release) that failed.",
            &[("", get(&self.network_failures))],
        );
        counter(
            "vm_destroys_total",
            "VM destroys by result.",
            &[("{result=\"ok\"}", get(&self.vms_destroyed)), ("{result=\"failed\"}", get(&self.destroy_failures))],
        );
        counter(
            "relays_total",
            "Relays opened by kind.",
            &[
                ("{kind=\"agent\"}", get(&self.agent_relays)),
                ("{kind=\"port\"}", get(&self.port_relays)),
                ("{kind=\"exec\"}", get(&self.execs)),
            ],
        );
        counter(
            "relays_refused_total",
            "Relays and execs refused at their per-claim cap, by kind.",
            &[
                ("{kind=\"agent\"}", get(&self.agent_relays_refused)),
                ("{kind=\"port\"}", get(&self.port_relays_refused)),
                ("{kind=\"exec\"}", get(&self.execs_refused)),
            ],
        );
        counter(
            "relays_idle_closed_total",
            "Relays closed after relay_idle_timeout_secs without a byte either way.",
            &[("", get(&self.relays_idle_closed))],
        );
        counter(
            "refill_budget_blocked_total",
            "Refill steps stopped short by the node budget.",
            &[("", get(&self.refill_budget_blocked))],
        );
        counter("body_timeouts_total", "Request bodies not received in time.", &[("", get(&self.body_timeouts))]);
        counter("auth_failures_total", "Requests refused with 401.", &[("", get(&self.auth_failures))]);
        counter(
            "http_connections_refused_total",
            "Connections closed at once because max_connections were open.",
            &[("", conns.refused.load(Ordering::Relaxed))],
        );
        counter(
            "http_connections_timed_out_total",
            "Connections closed for a slow request head, idle keep-alive or a slow TLS handshake.",
            &[("", conns.timed_out.load(Ordering::Relaxed))],
        );
        for (name, help, pick) in [
            ("pool_warm", "Warm VMs per pool.", 0),
            ("pool_target", "Warm target per pool.", 1),
            ("pool_refilling", "Refills in flight per pool.", 2),
            ("pool_at_capacity", "1 when the pool cannot fill.", 3),
        ] {
            let _ = writeln!(o, "# HELP sandboxd_{name} {help}\n# TYPE sandboxd_{name} gauge");
            for p in pools {
                let v = match pick {
                    0 => p.warm,
                    1 => p.target,
                    2 => p.refilling,
                    _ => usize::from(p.at_capacity),
                };
                let _ = writeln!(
                    o,
                    "sandboxd_{name}{{template=\"{}\",net=\"{}\",size=\"{}\"}} {v}",
                    escape(&p.key.template),
                    p.key.net,
                    p.key.size
                );
            }
        }
        let _ = writeln!(
            o,
            "# HELP sandboxd_claimed Live claims.\n# TYPE sandboxd_claimed gauge\nsandboxd_claimed {claimed}"
        );
        let _ = writeln!(
            o,
            "# HELP sandboxd_draining 1 while the node drains.\n# TYPE sandboxd_draining gauge\nsandboxd_draining {}",
            u8::from(draining)
        );
        for (name, help, v) in [
            ("budget_max_vms", "The node budget: max_vms.", budget.max_vms as u64),
            ("budget_max_memory_mib", "The node budget: max_memory_mib.", budget.max_memory_mib),
            ("budget_vms", "VMs held or booting (warm + refilling + claimed).", used.vms as u64),
            ("budget_memory_mib", "Their memory, MiB.", used.memory_mib),
            ("budget_max_disk_mib", "The node budget: max_disk_mib.", budget.max_disk_mib),
            ("budget_disk_mib", "Their writable disks at most (worst case), MiB.", used.disk_mib),
            ("http_connections_open", "Open HTTP connections.", conns.open.load(Ordering::Relaxed) as u64),
        ] {
            let _ = writeln!(o, "# HELP sandboxd_{name} {help}\n# TYPE sandboxd_{name} gauge\nsandboxd_{name} {v}");
        }
        o
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

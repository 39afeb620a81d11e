//! Counters beside the logs and the claim latency, rendered as Prometheus text with
//! `prometheus-client` (`GET /metrics`), as the supervisor's `metrics.rs` does: each scrape
//! registers a collector over the counters and a snapshot of the live state ([`Gauges`]), so
//! no gauge drifts from what `GET /v1/info` shows.
//!
//! | sample | labels | type |
//! |---|---|---|
//! | `sandboxd_claims_total` | `result` (`granted`, `no_capacity`, `draining`, `error`), `tier` (`warm`, `on_demand`, or empty) | counter |
//! | `sandboxd_claim_duration_seconds` (every `Node::claim`, granted or refused, an on-demand VM's wait included; 50 µs … 1 s) | | histogram |
//! | `sandboxd_claim_resume_seconds` (waking the paused warm VM inside a claim: its CPU weight back to normal, then the resume) | | histogram |
//! | `sandboxd_releases_total`, `sandboxd_renews_total`, `sandboxd_reaped_total` | | counter |
//! | `sandboxd_hibernations_total`, `sandboxd_wakes_total`, `sandboxd_fork_children_total`, `sandboxd_checkpoints_total`, `sandboxd_promotions_total`, `sandboxd_volume_attaches_total`, `sandboxd_volume_detaches_total`, `sandboxd_volume_failures_total` | | counter |
//! | `sandboxd_refills_total` | `tier` (`clone`, `cold`) | counter |
//! | `sandboxd_refill_failures_total`, `sandboxd_refill_budget_blocked_total` | | counter |
//! | `sandboxd_golden_builds_total`, `sandboxd_vm_destroys_total` | `result` (`ok`, `failed`) | counter |
//! | `sandboxd_clone_reseed_failures_total`, `sandboxd_network_failures_total` | | counter |
//! | `sandboxd_relays_total`, `sandboxd_relays_refused_total` | `kind` (`agent`, `port`, `exec`) | counter |
//! | `sandboxd_relays_idle_closed_total`, `sandboxd_body_timeouts_total`, `sandboxd_auth_failures_total` | | counter |
//! | `sandboxd_http_connections_refused_total`, `sandboxd_http_connections_timed_out_total` | | counter |
//! | `sandboxd_pool_warm`, `sandboxd_pool_target`, `sandboxd_pool_refilling`, `sandboxd_pool_at_capacity` | `template`, `net`, `size` | gauge |
//! | `sandboxd_claimed`, `sandboxd_draining` | | gauge |
//! | `sandboxd_budget_{max_vms,max_memory_mib,max_disk_mib,vms,memory_mib,disk_mib}`, `sandboxd_http_connections_open` | | gauge |
//!
//! The text is OpenMetrics, which Prometheus's text parser reads too: a counter family is
//! typed under its name without `_total` and its samples carry the suffix; the text ends with
//! `# EOF`. Gauges are integers; one past `i64::MAX` (an unlimited disk budget) shows as
//! `i64::MAX`.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::limits::{Budget, Usage};
use crate::pool::PoolInfo;

/// Upper bounds of the claim-latency buckets, seconds: a claim does no VM work (a pop, two
/// mints, a journal append), so it takes microseconds; the top buckets catch a slow disk under
/// `sync_claims`.
pub const CLAIM_BUCKETS: [f64; 14] =
    [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Why the text could not be produced (a formatting error; not expected).
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The encoder failed.
    #[error("encoding metrics")]
    Encode(#[source] std::fmt::Error),
}

/// The claim-latency histogram ([`CLAIM_BUCKETS`]).
#[derive(Debug)]
pub struct Latency(Histogram);

impl Default for Latency {
    fn default() -> Self {
        Latency(Histogram::new(CLAIM_BUCKETS))
    }
}

impl Latency {
    /// Records one claim's duration.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Process-wide counters and the claim latency. Gauges (warm, target, claimed, budget) are read
/// from live state at render time ([`Gauges`]).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Claims granted from a warm VM.
    pub claims_warm: Counter,
    /// Claims granted from a VM made for them (the pool was empty).
    pub claims_on_demand: Counter,
    /// Claims refused: pool empty and no room in the node budget.
    pub claims_no_capacity: Counter,
    /// Claims refused: draining.
    pub claims_draining: Counter,
    /// Claims answered with a redirect to peers with warm VMs (this pool had none).
    pub claims_redirected: Counter,
    /// Claims refused for another reason (bad request, journal failure, unknown template).
    pub claims_failed: Counter,
    /// How long `Node::claim` took, granted or refused.
    pub claim_duration: Latency,
    /// How long resuming a paused warm VM took inside a claim.
    pub claim_resume: Latency,
    /// Releases.
    pub releases: Counter,
    /// Renewals.
    pub renews: Counter,
    /// Leases reaped.
    pub reaped: Counter,
    /// VMs admitted to a pool from a clone.
    pub refill_clone: Counter,
    /// VMs admitted to a pool from a cold boot.
    pub refill_cold: Counter,
    /// Refill attempts that failed.
    pub refill_failures: Counter,
    /// Golden snapshots built.
    pub goldens_built: Counter,
    /// Golden builds that failed.
    pub golden_failures: Counter,
    /// Clones destroyed because their guest RNG could not be reseeded.
    pub clone_reseed_failures: Counter,
    /// VMs destroyed.
    pub vms_destroyed: Counter,
    /// VM destroys that failed.
    pub destroy_failures: Counter,
    /// `/agent` relays opened.
    pub agent_relays: Counter,
    /// `/ports` relays opened.
    pub port_relays: Counter,
    /// `/exec` calls.
    pub execs: Counter,
    /// Refill steps the node budget stopped short.
    pub refill_budget_blocked: Counter,
    /// `/agent` relays refused at the per-claim cap.
    pub agent_relays_refused: Counter,
    /// `/ports` relays refused at the per-claim cap.
    pub port_relays_refused: Counter,
    /// `/exec` calls refused at the per-claim cap.
    pub execs_refused: Counter,
    /// Relays closed after `relay_idle_timeout_secs` without a byte.
    pub relays_idle_closed: Counter,
    /// Request bodies not received within `body_timeout_secs`.
    pub body_timeouts: Counter,
    /// Requests refused for a missing or wrong token (401).
    pub auth_failures: Counter,
    /// Network operations of egress VMs (lease, TAP, guest re-addressing, release) that failed.
    pub network_failures: Counter,
    /// Sandboxes hibernated (explicitly or when idle).
    pub hibernations: Counter,
    /// Sandboxes woken.
    pub wakes: Counter,
    /// Fork children granted.
    pub fork_children: Counter,
    /// Checkpoints made.
    pub checkpoints: Counter,
    /// Sandboxes promoted to templates.
    pub promotions: Counter,
    /// Volumes attached to sandboxes.
    pub volume_attaches: Counter,
    /// Volumes detached from sandboxes.
    pub volume_detaches: Counter,
    /// Volume attaches or detaches that failed.
    pub volume_failures: Counter,
}

/// Bumps a counter.
pub fn inc(c: &Counter) {
    c.inc();
}

/// Adds `n` to a counter.
pub fn inc_by(c: &Counter, n: usize) {
    c.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
}

/// The live state shown beside the counters, read once per scrape.
#[derive(Debug, Clone)]
pub struct Gauges {
    /// Every pool's row.
    pub pools: Vec<PoolInfo>,
    /// Live claims.
    pub claimed: usize,
    /// The node drains.
    pub draining: bool,
    /// The node budget.
    pub budget: Budget,
    /// What warm + refilling + claimed VMs hold of it.
    pub used: Usage,
    /// The HTTP listeners' connection counts.
    pub http: HttpConns,
}

/// The HTTP listeners' connection counts (kept by `httpd`), read at a scrape.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpConns {
    /// Open now.
    pub open: u64,
    /// Closed at once because `max_connections` were open (a counter).
    pub refused: u64,
    /// Closed for a slow request head, idle keep-alive or a slow TLS handshake (a counter).
    pub timed_out: u64,
}

impl From<&httpd::ConnStats> for HttpConns {
    fn from(c: &httpd::ConnStats) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        HttpConns {
            open: c.open.load(Relaxed) as u64,
            refused: c.refused.load(Relaxed),
            timed_out: c.timed_out.load(Relaxed),
        }
    }
}

impl Metrics {
    /// Renders the counters and `gauges` as Prometheus (OpenMetrics) text.
    pub fn render(self: &Arc<Self>, gauges: Gauges) -> Result<String, MetricsError> {
        let mut reg = Registry::default();
        reg.register_collector(Box::new(Scrape { metrics: Arc::clone(self), gauges }));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).map_err(MetricsError::Encode)?;
        Ok(out)
    }
}

/// One scrape: the counters (shared, read while encoding) and the gauges (a snapshot).
#[derive(Debug)]
struct Scrape {
    metrics: Arc<Metrics>,
    gauges: Gauges,
}

type Row<'a> = (&'a [(&'a str, &'a str)], u64);

/// A per-pool gauge: name, help, and what it reads of a pool's row.
type PoolGauge = (&'static str, &'static str, fn(&PoolInfo) -> usize);

/// A counter family: one unlabelled sample, or one sample per label set.
fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, rows: &[Row<'_>]) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    if let [([], v)] = rows {
        return ConstCounter::new(*v).encode(m);
    }
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// An unlabelled integer gauge.
fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    ConstGauge::new(int(v)).encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (m, g) = (&self.metrics, &self.gauges);
        let e = &mut enc;
        let none: &[(&str, &str)] = &[];
        counter(
            e,
            "sandboxd_claims",
            "Claims by result and tier.",
            &[
                (&[("result", "granted"), ("tier", "warm")], m.claims_warm.get()),
                (&[("result", "granted"), ("tier", "on_demand")], m.claims_on_demand.get()),
                (&[("result", "no_capacity"), ("tier", "")], m.claims_no_capacity.get()),
                (&[("result", "draining"), ("tier", "")], m.claims_draining.get()),
                (&[("result", "redirected"), ("tier", "")], m.claims_redirected.get()),
                (&[("result", "error"), ("tier", "")], m.claims_failed.get()),
            ],
        )?;
        m.claim_duration.0.encode(e.encode_descriptor(
            "sandboxd_claim_duration_seconds",
            "How long a claim took in sandboxd, granted or refused.",
            None,
            MetricType::Histogram,
        )?)?;
        m.claim_resume.0.encode(e.encode_descriptor(
            "sandboxd_claim_resume_seconds",
            "How long resuming the paused warm VM took inside a claim.",
            None,
            MetricType::Histogram,
        )?)?;
        counter(e, "sandboxd_releases", "Sandboxes released.", &[(none, m.releases.get())])?;
        counter(e, "sandboxd_renews", "Leases renewed.", &[(none, m.renews.get())])?;
        counter(e, "sandboxd_reaped", "Expired leases reaped.", &[(none, m.reaped.get())])?;
        counter(e, "sandboxd_hibernations", "Sandboxes hibernated.", &[(none, m.hibernations.get())])?;
        counter(e, "sandboxd_wakes", "Hibernated sandboxes woken.", &[(none, m.wakes.get())])?;
        counter(e, "sandboxd_fork_children", "Sandboxes made by fork.", &[(none, m.fork_children.get())])?;
        counter(e, "sandboxd_checkpoints", "Checkpoints made.", &[(none, m.checkpoints.get())])?;
        counter(e, "sandboxd_promotions", "Sandboxes promoted to templates.", &[(none, m.promotions.get())])?;
        counter(e, "sandboxd_volume_attaches", "Volumes attached to sandboxes.", &[(none, m.volume_attaches.get())])?;
        counter(e, "sandboxd_volume_detaches", "Volumes detached from sandboxes.", &[(none, m.volume_detaches.get())])?;
        counter(
            e,
            "sandboxd_volume_failures",
            "Volume attaches and detaches that failed.",
            &[(none, m.volume_failures.get())],
        )?;
        counter(
            e,
            "sandboxd_refills",
            "VMs admitted to a pool, by how they were made.",
            &[(&[("tier", "clone")], m.refill_clone.get()), (&[("tier", "cold")], m.refill_cold.get())],
        )?;
        counter(e, "sandboxd_refill_failures", "Refill attempts that failed.", &[(none, m.refill_failures.get())])?;
        counter(
            e,
            "sandboxd_golden_builds",
            "Golden snapshot builds by result.",
            &[(&[("result", "ok")], m.goldens_built.get()), (&[("result", "failed")], m.golden_failures.get())],
        )?;
        counter(
            e,
            "sandboxd_clone_reseed_failures",
            "Clones destroyed because their guest RNG could not be reseeded (the slot cold-boots instead).",
            &[(none, m.clone_reseed_failures.get())],
        )?;
        counter(
            e,
            "sandboxd_network_failures",
            "Network operations of egress VMs (lease, TAP, guest re-addressing, release) that failed.",
            &[(none, m.network_failures.get())],
        )?;
        counter(
            e,
            "sandboxd_vm_destroys",
            "VM destroys by result.",
            &[(&[("result", "ok")], m.vms_destroyed.get()), (&[("result", "failed")], m.destroy_failures.get())],
        )?;
        counter(
            e,
            "sandboxd_relays",
            "Relays opened by kind.",
            &[
                (&[("kind", "agent")], m.agent_relays.get()),
                (&[("kind", "port")], m.port_relays.get()),
                (&[("kind", "exec")], m.execs.get()),
            ],
        )?;
        counter(
            e,
            "sandboxd_relays_refused",
            "Relays and execs refused at their per-claim cap, by kind.",
            &[
                (&[("kind", "agent")], m.agent_relays_refused.get()),
                (&[("kind", "port")], m.port_relays_refused.get()),
                (&[("kind", "exec")], m.execs_refused.get()),
            ],
        )?;
        counter(
            e,
            "sandboxd_relays_idle_closed",
            "Relays closed after relay_idle_timeout_secs without a byte either way.",
            &[(none, m.relays_idle_closed.get())],
        )?;
        counter(
            e,
            "sandboxd_refill_budget_blocked",
            "Refill steps stopped short by the node budget.",
            &[(none, m.refill_budget_blocked.get())],
        )?;
        counter(e, "sandboxd_body_timeouts", "Request bodies not received in time.", &[(none, m.body_timeouts.get())])?;
        counter(e, "sandboxd_auth_failures", "Requests refused with 401.", &[(none, m.auth_failures.get())])?;
        counter(
            e,
            "sandboxd_http_connections_refused",
            "Connections closed at once because max_connections were open.",
            &[(none, g.http.refused)],
        )?;
        counter(
            e,
            "sandboxd_http_connections_timed_out",
            "Connections closed for a slow request head, idle keep-alive or a slow TLS handshake.",
            &[(none, g.http.timed_out)],
        )?;
        let per_pool: [PoolGauge; 4] = [
            ("sandboxd_pool_warm", "Warm VMs per pool.", |p| p.warm),
            ("sandboxd_pool_target", "Warm target per pool.", |p| p.target),
            ("sandboxd_pool_refilling", "Refills in flight per pool.", |p| p.refilling),
            ("sandboxd_pool_at_capacity", "1 when the pool cannot fill.", |p| usize::from(p.at_capacity)),
        ];
        for (name, help, pick) in per_pool {
            let mut f = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for p in &g.pools {
                let labels = [
                    ("template", escape(&p.key.template)),
                    ("net", p.key.net.to_string()),
                    ("size", p.key.size.to_string()),
                ];
                ConstGauge::new(int(pick(p) as u64)).encode(f.encode_family(&labels)?)?;
            }
        }
        gauge(e, "sandboxd_claimed", "Live claims.", g.claimed as u64)?;
        gauge(e, "sandboxd_draining", "1 while the node drains.", u64::from(g.draining))?;
        for (name, help, v) in [
            ("sandboxd_budget_max_vms", "The node budget: max_vms.", g.budget.max_vms as u64),
            ("sandboxd_budget_max_memory_mib", "The node budget: max_memory_mib.", g.budget.max_memory_mib),
            ("sandboxd_budget_vms", "VMs held or booting (warm + refilling + claimed).", g.used.vms as u64),
            ("sandboxd_budget_memory_mib", "Their memory, MiB.", g.used.memory_mib),
            ("sandboxd_budget_max_disk_mib", "The node budget: max_disk_mib.", g.budget.max_disk_mib),
            ("sandboxd_budget_disk_mib", "Their writable disks at most (worst case), MiB.", g.used.disk_mib),
            ("sandboxd_http_connections_open", "Open HTTP connections.", g.http.open),
        ] {
            gauge(e, name, help, v)?;
        }
        Ok(())
    }
}

/// A label value as the text format wants it (`prometheus-client` writes values as given;
/// template names are validated, so this never fires today).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests;

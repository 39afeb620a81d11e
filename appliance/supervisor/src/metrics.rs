//! Prometheus text for the whole appliance, built from the current [`Health`] at each scrape
//! (a `prometheus-client` collector over a snapshot, so nothing drifts):
//!
//! | metric | labels |
//! |---|---|
//! | `chrysalis_supervisor_uptime_seconds`, `chrysalis_supervisor_ready` | |
//! | `chrysalis_service_up`, `chrysalis_service_restarts_total`, `chrysalis_service_last_exit_code` | `service` |
//! | `chrysalis_process_resident_bytes` (the supervisor and each running service) | `process` |
//! | `chrysalis_pool_warm`, `chrysalis_pool_target` | `template`, `size`, `net` |
//! | `chrysalis_node_ready`, `chrysalis_node_lease_fresh` | `node`, `service` |
//! | `chrysalis_cluster_api_reachable` (with a cluster) | |
//! | `chrysalis_update_state` (1 for the current state) | `state` |
//!
//! `last_exit_code` is the exit status, 128 + signal when killed, -1 when it could not start.

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::health::Health;
use crate::supervise::RunState;
use crate::update::UpdateState;

/// Why the text could not be produced (a formatting error; not expected).
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The encoder failed.
    #[error("encoding metrics")]
    Encode(#[source] std::fmt::Error),
}

#[derive(Debug)]
struct Snapshot {
    health: Health,
    uptime: Duration,
    update: UpdateState,
    supervisor_rss_kib: Option<u64>,
}

type Labels = Vec<(&'static str, String)>;

fn gauges(enc: &mut DescriptorEncoder, name: &str, help: &str, rows: &[(Labels, f64)]) -> Result<(), std::fmt::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    if let [(labels, v)] = rows {
        if labels.is_empty() {
            return ConstGauge::new(*v).encode(m);
        }
    }
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn b(v: bool) -> f64 {
    if v {
        1.0
    } else {
        0.0
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let h = &self.health;
        let none: Labels = Vec::new();
        gauges(
            &mut enc,
            "chrysalis_supervisor_uptime_seconds",
            "Seconds since the supervisor started.",
            &[(none.clone(), self.uptime.as_secs_f64())],
        )?;
        gauges(
            &mut enc,
            "chrysalis_supervisor_ready",
            "1 when every enabled service runs and sandboxd answers.",
            &[(none.clone(), b(h.ready))],
        )?;
        let svc = |name: &str| vec![("service", name.to_string())];
        let up: Vec<(Labels, f64)> =
            h.services.iter().map(|s| (svc(&s.name), b(s.state == RunState::Running))).collect();
        gauges(&mut enc, "chrysalis_service_up", "1 while the service's process runs.", &up)?;
        if !h.services.is_empty() {
            let mut m = enc.encode_descriptor(
                "chrysalis_service_restarts",
                "Restarts of the service since the supervisor started.",
                None,
                MetricType::Counter,
            )?;
            for s in &h.services {
                ConstCounter::new(s.restarts).encode(m.encode_family(&svc(&s.name))?)?;
            }
        }
        let exits: Vec<(Labels, f64)> = h
            .services
            .iter()
            .filter_map(|s| s.last_exit.as_ref().map(|e| (svc(&s.name), e.metric_code() as f64)))
            .collect();
        gauges(
            &mut enc,
            "chrysalis_service_last_exit_code",
            "Last exit: status, 128+signal, or -1 when it could not start.",
            &exits,
        )?;
        let process = |name: &str| vec![("process", name.to_string())];
        let rss: Vec<(Labels, f64)> = std::iter::once(("supervisor", self.supervisor_rss_kib))
            .chain(h.services.iter().map(|s| (s.name.as_str(), s.rss_kib)))
            .filter_map(|(name, kib)| kib.map(|k| (process(name), (k * 1024) as f64)))
            .collect();
        gauges(
            &mut enc,
            "chrysalis_process_resident_bytes",
            "Resident memory of the supervisor and of each service's main process (VMs not included).",
            &rss,
        )?;
        let pool = |p: &crate::health::PoolHealth| {
            vec![("template", p.template.clone()), ("size", p.size.clone()), ("net", p.net.clone())]
        };
        let warm: Vec<(Labels, f64)> = h.pools.iter().map(|p| (pool(p), p.warm as f64)).collect();
        let target: Vec<(Labels, f64)> = h.pools.iter().map(|p| (pool(p), p.target as f64)).collect();
        gauges(&mut enc, "chrysalis_pool_warm", "Warm VMs in the sandboxd pool.", &warm)?;
        gauges(&mut enc, "chrysalis_pool_target", "Warm target of the sandboxd pool.", &target)?;
        let node = |n: &crate::health::NodeHealth| vec![("node", n.name.clone()), ("service", n.service.clone())];
        let ready: Vec<(Labels, f64)> = h.nodes.iter().map(|n| (node(n), b(n.ready))).collect();
        let fresh: Vec<(Labels, f64)> = h.nodes.iter().map(|n| (node(n), b(n.lease_fresh))).collect();
        gauges(&mut enc, "chrysalis_node_ready", "1 when the virtual node's Ready condition is True.", &ready)?;
        gauges(
            &mut enc,
            "chrysalis_node_lease_fresh",
            "1 when the virtual node's Lease was renewed within 40 s.",
            &fresh,
        )?;
        if let Some(r) = h.api_reachable {
            gauges(
                &mut enc,
                "chrysalis_cluster_api_reachable",
                "1 when the cluster's API server answers.",
                &[(none, b(r))],
            )?;
        }
        let states: Vec<(Labels, f64)> =
            UpdateState::ALL.iter().map(|s| (vec![("state", s.as_str().to_string())], b(*s == self.update))).collect();
        gauges(&mut enc, "chrysalis_update_state", "1 for the current A/B update state.", &states)
    }
}

/// The exposition text.
pub fn render(health: &Health, uptime: Duration, update: UpdateState) -> Result<String, MetricsError> {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Snapshot {
        health: health.clone(),
        uptime,
        update,
        supervisor_rss_kib: crate::supervise::rss_kib(std::process::id()),
    }));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg).map_err(MetricsError::Encode)?;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use crate::health::{NodeHealth, PoolHealth};
    use crate::supervise::{ExitInfo, ServiceStatus};

    #[test]
    fn every_family_is_present_with_values() {
        let h = Health {
            ready: true,
            services: vec![ServiceStatus {
                name: "sandboxd".into(),
                state: RunState::Running,
                pid: Some(10),
                since_unix: Some(1),
                restarts: 3,
                last_exit: Some(ExitInfo {
                    code: None,
                    signal: Some(9),
                    at_unix: 1,
                    ran_for_secs: 1.0,
                    text: "x".into(),
                }),
                restart_in_secs: None,
                rss_kib: Some(2048),
            }],
            pools: vec![PoolHealth {
                template: "base".into(),
                size: "small".into(),
                net: "none".into(),
                warm: 1,
                target: 2,
            }],
            nodes: vec![NodeHealth {
                name: "box-sandbox".into(),
                service: "vk-sandbox".into(),
                ready: true,
                lease_fresh: false,
                api_reachable: true,
                error: None,
            }],
            api_reachable: Some(true),
            ..Health::default()
        };
        let text = render(&h, Duration::from_secs(5), UpdateState::Trial).unwrap();
        for line in [
            "chrysalis_supervisor_uptime_seconds 5.0",
            "chrysalis_supervisor_ready 1.0",
            "chrysalis_service_up{service=\"sandboxd\"} 1.0",
            "chrysalis_process_resident_bytes{process=\"sandboxd\"} 2097152.0",
            "chrysalis_service_restarts_total{service=\"sandboxd\"} 3",
            "chrysalis_service_last_exit_code{service=\"sandboxd\"} 137.0",
            "chrysalis_pool_warm{template=\"base\",size=\"small\",net=\"none\"} 1.0",
            "chrysalis_pool_target{template=\"base\",size=\"small\",net=\"none\"} 2.0",
            "chrysalis_node_ready{node=\"box-sandbox\",service=\"vk-sandbox\"} 1.0",
            "chrysalis_node_lease_fresh{node=\"box-sandbox\",service=\"vk-sandbox\"} 0.0",
            "chrysalis_cluster_api_reachable 1.0",
            "chrysalis_update_state{state=\"trial\"} 1.0",
            "chrysalis_update_state{state=\"confirmed\"} 0.0",
            "# TYPE chrysalis_service_restarts counter",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // The supervisor's own RSS is whatever this test process has.
        assert!(
            text.lines().any(|l| l.starts_with("chrysalis_process_resident_bytes{process=\"supervisor\"} ")),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn empty_health_still_renders() {
        let text = render(&Health::default(), Duration::ZERO, UpdateState::Unavailable).unwrap();
        assert!(text.contains("chrysalis_supervisor_ready 0.0"), "{text}");
        assert!(!text.contains("chrysalis_cluster_api_reachable"), "{text}");
        assert!(!text.contains("chrysalis_service_up"), "{text}");
    }
}

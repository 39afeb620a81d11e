//! Readiness probes (`virtual-node.md` §3.5): TCP to `vm.cocoonstack.io/probe-port` when set,
//! else one guest-agent round trip (`info`); an unmanaged Pod without a port is ready when it
//! has an IP (no backend call for a VM that is not ours).
//!
//! Schedule per tracked Pod: before Ready, 100 ms growing ×1.5 up to 1 s; once Ready, every
//! 5 s; 3 consecutive failures flip Ready off (and the schedule back to the fast one). A
//! change of the Pod's Ready condition is pushed; nothing else is.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::provider::Shared;

/// What one probe needs.
#[derive(Debug, Clone)]
pub(crate) struct ProbeTarget {
    pub vm_id: String,
    pub ip: Option<String>,
    pub port: Option<u16>,
    pub managed: bool,
}

/// The next pre-Ready delay.
pub(crate) fn grow(d: Duration, factor: f64, max: Duration) -> Duration {
    d.mul_f64(factor).min(max)
}

/// One TCP connect within `timeout`.
pub(crate) async fn tcp_probe(ip: &str, port: u16, timeout: Duration) -> bool {
    let Ok(ip) = ip.parse::<IpAddr>() else { return false };
    matches!(tokio::time::timeout(timeout, tokio::net::TcpStream::connect(SocketAddr::new(ip, port))).await, Ok(Ok(_)))
}

impl Shared {
    pub(crate) fn probe_target(&self, key: &str, gen: u64) -> Option<ProbeTarget> {
        let g = self.lock();
        let e = g.entries.get(key).filter(|e| e.gen == gen)?;
        Some(ProbeTarget {
            vm_id: e.vm.id.clone(),
            ip: e.vm.ip.clone(),
            port: e.spec.probe_port,
            managed: e.spec.managed,
        })
    }

    /// One probe.
    pub(crate) async fn probe_once(&self, t: &ProbeTarget) -> bool {
        match (t.port, &t.ip) {
            (Some(port), Some(ip)) => self.backend.probe_tcp(ip, port, self.cfg.probe_timeout).await,
            (Some(_), None) => false,
            (None, _) if t.managed => {
                matches!(
                    tokio::time::timeout(self.cfg.probe_timeout, self.backend.probe_agent(&t.vm_id)).await,
                    Ok(Ok(()))
                )
            }
            (None, ip) => ip.is_some(),
        }
    }

    /// The probe loop of the entry `key`/`gen`; ends when the entry is gone or replaced.
    pub(crate) async fn probe_loop(self: Arc<Self>, key: String, gen: u64) {
        let span = tracing::debug_span!("probe", pod = %key);
        async move {
            let mut backoff = self.cfg.probe_initial;
            loop {
                let ready_now = {
                    let g = self.lock();
                    let Some(e) = g.entries.get(&key).filter(|e| e.gen == gen) else { return };
                    e.probe_ok
                };
                let wait = if ready_now {
                    self.cfg.probe_ready_interval
                } else {
                    let w = backoff;
                    backoff = grow(backoff, self.cfg.probe_factor, self.cfg.probe_max);
                    w
                };
                tokio::time::sleep(wait).await;
                let Some(target) = self.probe_target(&key, gen) else { return };
                let ok = self.probe_once(&target).await;
                let push = {
                    let mut g = self.lock();
                    let Some(e) = g.entries.get_mut(&key).filter(|e| e.gen == gen) else { return };
                    if e.busy || e.terminal.is_some() {
                        false
                    } else {
                        let before = e.ready();
                        if ok {
                            e.failures = 0;
                            e.probe_ok = true;
                        } else if e.probe_ok {
                            e.failures += 1;
                            if e.failures >= self.cfg.probe_failures {
                                tracing::info!(vm = %e.vm.id, failures = e.failures, "probe failing; Ready off");
                                e.probe_ok = false;
                                e.failures = 0;
                                backoff = self.cfg.probe_initial;
                            }
                        }
                        before != e.ready()
                    }
                };
                if push {
                    tracing::debug!(ok, "readiness changed");
                    self.push_entry(&key, gen);
                }
            }
        }
        .instrument(span)
        .await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_the_cap() {
        let mut d = Duration::from_millis(100);
        let mut seen = vec![d];
        for _ in 0..8 {
            d = grow(d, 1.5, Duration::from_secs(1));
            seen.push(d);
        }
        assert_eq!(seen[1], Duration::from_millis(150));
        assert_eq!(seen[2], Duration::from_millis(225));
        assert_eq!(*seen.last().unwrap(), Duration::from_secs(1));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
    }

    #[tokio::test]
    async fn tcp_probe_connects_or_not() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(tcp_probe("127.0.0.1", port, Duration::from_secs(1)).await);
        drop(l);
        assert!(!tcp_probe("127.0.0.1", port, Duration::from_secs(1)).await);
        assert!(!tcp_probe("not-an-ip", port, Duration::from_secs(1)).await);
    }
}

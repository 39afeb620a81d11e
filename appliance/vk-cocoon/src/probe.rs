//! Readiness probes (`docs/virtual-node.md` §3.5): TCP to `vm.cocoonstack.io/probe-port` when set,
//! else one guest-agent round trip (`info`); an unmanaged Pod without a port is ready when it
//! has an IP (no backend call for a VM that is not ours).
//!
//! Schedule per tracked Pod: before Ready, 100 ms growing ×1.5 up to 1 s; once Ready, every
//! 5 s; 3 consecutive failures flip Ready off (and the schedule back to the fast one). A
//! change of the Pod's Ready condition is pushed; nothing else is.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::shared::Shared;

/// What one probe needs.
#[derive(Debug, Clone)]
struct ProbeTarget {
    pub vm_id: String,
    pub ip: Option<String>,
    pub port: Option<u16>,
    pub managed: bool,
}

/// The next pre-Ready delay.
pub(crate) fn grow(d: Duration, factor: f64, max: Duration) -> Duration {
    d.mul_f64(factor).min(max)
}

/// What the next probe of the entry `key`/`gen` needs; `None` once it is gone or replaced.
fn target(s: &Shared, key: &str, gen: u64) -> Option<ProbeTarget> {
    let g = s.lock();
    let e = g.entries.get(key).filter(|e| e.gen == gen)?;
    Some(ProbeTarget { vm_id: e.vm.id.clone(), ip: e.vm.ip.clone(), port: e.spec.probe_port, managed: e.spec.managed })
}

/// One probe of the entry `key`/`gen` (`None`: the entry is gone or replaced).
pub(crate) async fn probe_entry(s: &Shared, key: &str, gen: u64) -> Option<bool> {
    let t = target(s, key, gen)?;
    Some(once(s, &t).await)
}

/// One probe.
async fn once(s: &Shared, t: &ProbeTarget) -> bool {
    match (t.port, &t.ip) {
        (Some(port), Some(ip)) => s.backend.probe_tcp(ip, port, s.cfg.probe_timeout).await,
        (Some(_), None) => false,
        (None, _) if t.managed => {
            matches!(tokio::time::timeout(s.cfg.probe_timeout, s.backend.probe_agent(&t.vm_id)).await, Ok(Ok(())))
        }
        (None, ip) => ip.is_some(),
    }
}

/// Starts a fresh probe loop (fast schedule) for the entry `key`/`gen`, replacing (aborting)
/// the one it had; nothing when the entry is gone or replaced.
pub(crate) fn start(s: &Arc<Shared>, key: &str, gen: u64) {
    let task = tokio::spawn(run(s.clone(), key.to_owned(), gen));
    let mut g = s.lock();
    match g.entries.get_mut(key).filter(|e| e.gen == gen) {
        Some(e) => {
            if let Some(old) = e.probe.replace(task.abort_handle()) {
                old.abort();
            }
        }
        None => task.abort(),
    }
}

/// The probe loop of the entry `key`/`gen`; ends when the entry is gone or replaced.
async fn run(s: Arc<Shared>, key: String, gen: u64) {
    let span = tracing::debug_span!("probe", pod = %key);
    async move {
        let mut backoff = s.cfg.probe_initial;
        loop {
            let ready_now = {
                let g = s.lock();
                let Some(e) = g.entries.get(&key).filter(|e| e.gen == gen) else { return };
                e.probe_ok
            };
            let wait = if ready_now {
                s.cfg.probe_ready_interval
            } else {
                let w = backoff;
                backoff = grow(backoff, s.cfg.probe_factor, s.cfg.probe_max);
                w
            };
            tokio::time::sleep(wait).await;
            let Some(ok) = probe_entry(&s, &key, gen).await else { return };
            let push = {
                let mut g = s.lock();
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
                        if e.failures >= s.cfg.probe_failures {
                            tracing::info!(vm = %e.vm.id, failures = e.failures, "probe failing; Ready off");
                            e.probe_ok = false;
                            e.failures = 0;
                            backoff = s.cfg.probe_initial;
                        }
                    }
                    before != e.ready()
                }
            };
            if push {
                tracing::debug!(ok, "readiness changed");
                s.push_entry(&key, gen);
            }
        }
    }
    .instrument(span)
    .await
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
}

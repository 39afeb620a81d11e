//! The caps on open streaming sessions (logs, exec, attach, port-forward): so many per Pod and
//! so many on the node. A session holds a [`SessionGuard`] for as long as it streams; the
//! open sessions are the `/metrics` gauge `vnode_stream_sessions_open`.

use crate::provider::PodKey;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The kubelet port's streaming caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Open sessions one Pod may have; the next is answered 429.
    pub per_pod: usize,
    /// Open sessions on the node; the next is answered 429.
    pub total: usize,
    /// The largest WebSocket message (and frame) a client may send; a larger one ends the
    /// session.
    pub max_message: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits { per_pod: 16, total: 256, max_message: 1 << 20 }
    }
}

/// A cap that was reached.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Busy {
    #[error("pod {pod} already has {cap} open streaming sessions (logs -f, exec, attach, port-forward); close one and retry")]
    Pod { pod: PodKey, cap: usize },
    #[error("this node already serves {cap} streaming sessions; retry later")]
    Node { cap: usize },
}

/// The open sessions, per Pod.
#[derive(Debug)]
pub(super) struct Sessions {
    limits: StreamLimits,
    open: Mutex<HashMap<PodKey, usize>>,
    gauge: Gauge,
}

impl Sessions {
    pub(super) fn new(limits: StreamLimits, gauge: Gauge) -> Sessions {
        Sessions { limits, open: Mutex::new(HashMap::new()), gauge }
    }

    pub(super) fn limits(&self) -> StreamLimits {
        self.limits
    }

    /// Opens a session for `pod`, or says which cap is reached.
    pub(super) fn open(self: &Arc<Self>, pod: &PodKey) -> Result<SessionGuard, Busy> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.values().sum::<usize>() >= self.limits.total {
            return Err(Busy::Node { cap: self.limits.total });
        }
        let n = open.entry(pod.clone()).or_default();
        if *n >= self.limits.per_pod {
            return Err(Busy::Pod { pod: pod.clone(), cap: self.limits.per_pod });
        }
        *n += 1;
        self.sessions_changed(&open);
        Ok(SessionGuard { sessions: self.clone(), pod: pod.clone() })
    }

    /// Sets the gauge to the open sessions (under the lock, so it never lags behind).
    fn sessions_changed(&self, open: &HashMap<PodKey, usize>) {
        self.gauge.set(i64::try_from(open.values().sum::<usize>()).unwrap_or(i64::MAX));
    }
}

/// One open session; dropping it frees its slot.
#[derive(Debug)]
pub(super) struct SessionGuard {
    sessions: Arc<Sessions>,
    pod: PodKey,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut open = self.sessions.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.pod) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.pod);
            }
        }
        self.sessions.sessions_changed(&open);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_pod_and_node_caps_are_hit_and_freed() {
        let gauge = Gauge::default();
        let s = Arc::new(Sessions::new(StreamLimits { per_pod: 2, total: 3, ..Default::default() }, gauge.clone()));
        let (a, b) = (PodKey::new("ns", "a"), PodKey::new("ns", "b"));
        let a1 = s.open(&a).expect("1st");
        let _a2 = s.open(&a).expect("2nd");
        assert_eq!(s.open(&a).expect_err("3rd on a"), Busy::Pod { pod: a.clone(), cap: 2 });
        let _b1 = s.open(&b).expect("b");
        assert_eq!(s.open(&b).expect_err("node full"), Busy::Node { cap: 3 });
        assert_eq!(gauge.get(), 3);
        drop(a1);
        assert_eq!(gauge.get(), 2);
        let _a3 = s.open(&a).expect("a slot came back");
        assert!(Busy::Pod { pod: a, cap: 2 }.to_string().contains("ns/a already has 2"));
    }
}

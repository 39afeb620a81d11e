//! The loops a provider keeps running beside its calls: the post-clone network configuration
//! a create waits on (every `net_retry_interval` until `net_deadline`), the probe loop every
//! tracked Pod gets when its create finishes ([`crate::probe`]), and the VM watcher
//! ([`crate::watcher`]) on its period.

use std::sync::Arc;

use base64::Engine;
use vnode::error_chain;
use vnode::kit::BackgroundLoops;

use crate::events;
use crate::probe;
use crate::shared::{Lifecycle, Shared};
use crate::watcher;

/// Step 7: configure the clone's network, every `net_retry_interval` until `net_deadline`.
pub(super) async fn post_clone(s: &Shared, key: &str, gen: u64) {
    let Some(id) = s.lock().entries.get(key).filter(|e| e.gen == gen).map(|e| e.vm.id.clone()) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + s.cfg.net_deadline;
    let mut attempts = 0u32;
    let last_error = loop {
        attempts += 1;
        match s.backend.configure_network(&id).await {
            Ok(()) => {
                let pod = {
                    let mut g = s.lock();
                    let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
                    e.lifecycle = Lifecycle::Ready;
                    e.message = None;
                    e.pod.clone()
                };
                s.event(&pod, false, events::POST_CLONE_SUCCEEDED, &format!("network of VM {id} configured"));
                return;
            }
            Err(e) => {
                tracing::debug!(vm = %id, attempts, error = %error_chain(&e), "post-clone network configuration failed");
                if tokio::time::Instant::now() + s.cfg.net_retry_interval > deadline {
                    break e;
                }
                tokio::time::sleep(s.cfg.net_retry_interval).await;
            }
        }
    };
    let msg = format!(
        "the network of VM {id} could not be configured after {attempts} attempts in {:?}: {}",
        s.cfg.net_deadline,
        error_chain(&last_error)
    );
    let pod = {
        let mut g = s.lock();
        let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
        e.lifecycle = Lifecycle::Failed;
        e.message = Some(msg.clone());
        e.hint = s.backend.network_hint(&e.vm).map(|h| base64::engine::general_purpose::STANDARD.encode(h));
        e.pod.clone()
    };
    s.event(&pod, true, events::POST_CLONE_EXEC_EXHAUSTED, &msg);
}

/// Step 8: one synchronous probe, Running pushed, the probe loop started.
pub(super) async fn finish(s: &Arc<Shared>, key: &str, gen: u64) {
    if let Some(ok) = probe::probe_entry(s, key, gen).await {
        let mut g = s.lock();
        let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) else { return };
        e.probe_ok = ok;
        e.busy = false;
    }
    probe::start(s, key, gen);
    s.push_entry(key, gen);
}

/// The VM watcher: one [`watcher::watch_once`] pass every `watch_interval`.
pub(super) fn spawn_watcher(s: &Arc<Shared>) -> BackgroundLoops {
    let mut loops = BackgroundLoops::default();
    let shared = s.clone();
    loops.every(s.cfg.watch_interval, tracing::info_span!("vm_watcher"), move || {
        let shared = shared.clone();
        async move { watcher::watch_once(&shared).await }
    });
    loops
}

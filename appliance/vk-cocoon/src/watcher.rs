//! The VM watcher (`docs/virtual-node.md` §3.5): every `watch_interval`, one listing of the backend
//! compared with the tracked managed Pods. A failed listing skips the pass (never read as
//! "every VM is gone").
//!
//! | Seen | Action |
//! |---|---|
//! | running, IP changed | the new IP is pushed |
//! | stopped, no restart within the cooldown | `start`; Ready off until the probe sees it (Normal `VMRestarted`) |
//! | stopped again within 30 s of a restart | `remove` + release, Warning `RestartCooldown`, Pod deleted |
//! | stopped, `start` fails | `remove` + release (best effort), Warning `RestartFailed`, Pod deleted |
//! | not listed, and `inspect` confirms absence | release, Warning `VMGone`, Pod deleted |
//! | not listed, `inspect` fails | nothing this pass (logged as `VMInspectTimeout`) |
//!
//! A hibernated Pod has no VM by design and is not watched, except that a hibernate whose
//! remove failed after the VM stopped (`remove_pending`) has the remove retried on every pass.
//!
//! Eviction is upstream's (vk-cocoon deletes the Pod, so that its Sandbox or CocoonSet
//! controller makes a new one, which gets a fresh VM): the Warning event first, then a push
//! that carries the deletion (`crate::shared::Terminal`). Until the API Pod is gone the
//! evicted Pod stays tracked as `Failed` (terminal), so that a resync cannot boot it a new VM;
//! a new Pod under the key replaces it.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use tracing::Instrument;
use vnode::error_chain;

use crate::backend::{VmInfo, VmState};
use crate::events;
use crate::probe;
use crate::shared::{Shared, Terminal};

/// One tracked VM the watcher looks at.
struct Watched {
    key: String,
    gen: u64,
    id: String,
    ip: Option<String>,
    last_restart: Option<tokio::time::Instant>,
}

/// One watcher pass.
pub(crate) async fn watch_once(s: &Arc<Shared>) {
    retry_removals(s).await;
    let vms = match s.backend.list().await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "VM watcher: the VMs cannot be listed; skipping this pass");
            return;
        }
    };
    let by_id: BTreeMap<&str, &VmInfo> = vms.iter().map(|v| (v.id.as_str(), v)).collect();
    let watched: Vec<Watched> = {
        let g = s.lock();
        g.entries
            .iter()
            .filter(|(_, e)| e.spec.managed && !e.busy && e.terminal.is_none() && !e.hibernated)
            .map(|(k, e)| Watched {
                key: k.clone(),
                gen: e.gen,
                id: e.vm.id.clone(),
                ip: e.vm.ip.clone(),
                last_restart: e.last_restart,
            })
            .collect()
    };
    for w in watched {
        let span = tracing::info_span!("vm_watch", pod = %w.key, vm = %w.id);
        match by_id.get(w.id.as_str()) {
            Some(v) => match v.state {
                VmState::Running if v.ip.is_some() && v.ip != w.ip => {
                    let changed = {
                        let mut g = s.lock();
                        match g.entries.get_mut(&w.key).filter(|e| e.gen == w.gen && !e.busy) {
                            Some(e) => {
                                e.vm.ip = v.ip.clone();
                                true
                            }
                            None => false,
                        }
                    };
                    if changed {
                        span.in_scope(|| tracing::info!(ip = ?v.ip, "the VM's IP changed"));
                        s.push_entry(&w.key, w.gen);
                    }
                }
                VmState::Running | VmState::Creating => {}
                VmState::Stopped => restart_or_evict(s, &w).instrument(span).await,
            },
            None => match s.backend.inspect(&w.id).await {
                Ok(None) => {
                    let evicted = span.in_scope(|| evict(s, &w, events::VM_GONE, format!("VM {} is gone", w.id)));
                    if evicted {
                        release_quietly(s, &w.id).instrument(span).await;
                    }
                }
                Ok(Some(_)) => {}
                Err(e) => span.in_scope(|| {
                    tracing::warn!(reason = "VMInspectTimeout", error = %error_chain(&e), "the VM is not listed and cannot be inspected; checking again next pass")
                }),
            },
        }
    }
}

/// Retries the removal of every VM a hibernate left behind (`remove_pending`).
async fn retry_removals(s: &Shared) {
    let pending: Vec<(String, u64, String)> = {
        let g = s.lock();
        g.entries
            .iter()
            .filter(|(_, e)| e.hibernated && e.remove_pending && !e.busy && e.terminal.is_none())
            .map(|(k, e)| (k.clone(), e.gen, e.vm.id.clone()))
            .collect()
    };
    for (key, gen, id) in pending {
        match finish_removal(s, &key, gen, &id).await {
            Ok(()) => s.push_entry(&key, gen),
            Err(e) => {
                tracing::warn!(pod = %key, vm = %id, error = %error_chain(&e), "removing the VM a hibernate left behind failed; retrying next pass")
            }
        }
    }
}

/// Removes the VM a hibernate left behind (the entry's `remove_pending`): `Ok` once it is
/// gone, the flag cleared.
pub(crate) async fn finish_removal(s: &Shared, key: &str, gen: u64, id: &str) -> Result<(), crate::BackendError> {
    s.backend.remove(id).await?;
    let mut g = s.lock();
    if let Some(e) = g.entries.get_mut(key).filter(|e| e.gen == gen) {
        e.remove_pending = false;
        if e.hibernated {
            e.message = None;
        }
    }
    tracing::info!(vm = %id, "the VM a hibernate left behind is removed");
    Ok(())
}

async fn restart_or_evict(s: &Arc<Shared>, w: &Watched) {
    let cooling = w.last_restart.is_some_and(|t| t.elapsed() < s.cfg.restart_cooldown);
    if cooling {
        if let Err(e) = s.backend.remove(&w.id).await {
            tracing::warn!(error = %error_chain(&e), "removing a VM that keeps stopping failed; retrying next pass");
            return;
        }
        release_quietly(s, &w.id).await;
        evict(
            s,
            w,
            events::RESTART_COOLDOWN,
            format!("VM {} stopped again within {:?} of a restart; removed", w.id, s.cfg.restart_cooldown),
        );
        return;
    }
    match s.backend.start(&w.id).await {
        Ok(v) => {
            let pod = {
                let mut g = s.lock();
                let Some(e) = g.entries.get_mut(&w.key).filter(|e| e.gen == w.gen) else { return };
                e.last_restart = Some(tokio::time::Instant::now());
                e.vm.state = v.state;
                if v.ip.is_some() {
                    e.vm.ip = v.ip;
                }
                e.probe_ok = false;
                e.failures = 0;
                e.pod.clone()
            };
            tracing::info!("the VM had stopped; started it again");
            s.event(&pod, false, events::VM_RESTARTED, &format!("VM {} had stopped and was started again", w.id));
            probe::start(s, &w.key, w.gen);
            s.push_entry(&w.key, w.gen);
        }
        Err(e) => {
            let msg = format!("VM {} had stopped and could not be started: {}", w.id, error_chain(&e));
            if let Err(e) = s.backend.remove(&w.id).await {
                tracing::warn!(error = %error_chain(&e), "removing the VM that failed to start failed");
            }
            release_quietly(s, &w.id).await;
            evict(s, w, events::RESTART_FAILED, msg);
        }
    }
}

async fn release_quietly(s: &Shared, id: &str) {
    if let Err(e) = s.backend.release_ip(id).await {
        tracing::warn!(vm = %id, error = %error_chain(&e), "releasing the lease failed (best effort)");
    }
}

/// Marks the Pod `Failed` with `reason` and pushes it (Warning event too). `false`: the
/// entry changed meanwhile (replaced, or a provider call is working on it) and was left.
fn evict(s: &Shared, w: &Watched, reason: &str, message: String) -> bool {
    let (view, pod) = {
        let mut g = s.lock();
        let Some(e) = g.entries.get_mut(&w.key).filter(|e| e.gen == w.gen && !e.busy) else { return false };
        e.terminal = Some(Terminal { reason: reason.to_owned(), message: message.clone(), at: Time(Timestamp::now()) });
        if let Some(h) = e.probe.take() {
            h.abort();
        }
        (e.view(&s.cfg.node_ip), e.pod.clone())
    };
    tracing::warn!(reason, %message, "evicting the pod");
    s.event(&pod, true, reason, &message);
    s.notify(view);
    true
}

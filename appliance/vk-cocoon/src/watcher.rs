//! The VM watcher (`virtual-node.md` §3.5): every `watch_interval`, one listing of the backend
//! compared with the tracked managed Pods. A failed listing skips the pass (never read as
//! "every VM is gone").
//!
//! | Seen | Action |
//! |---|---|
//! | running, IP changed | the new IP is pushed |
//! | stopped, no restart within the cooldown | `start`; Ready off until the probe sees it (Normal `VMRestarted`) |
//! | stopped again within 30 s of a restart | `remove` + release, Pod `Failed` `RestartCooldown` |
//! | stopped, `start` fails | `remove` + release (best effort), Pod `Failed` `RestartFailed` |
//! | not listed, and `inspect` confirms absence | release, Pod `Failed` `VMGone` |
//! | not listed, `inspect` fails | nothing this pass (logged as `VMInspectTimeout`) |
//!
//! An evicted Pod stays tracked with its `Failed` status (terminal) so that a resync cannot
//! boot it a new VM; a new Pod under the key replaces it.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use tracing::Instrument;

use crate::backend::{VmInfo, VmState};
use crate::events;
use crate::provider::{error_chain, BackgroundLoops, CocoonProvider, Shared, Terminal};

/// One tracked VM the watcher looks at.
struct Watched {
    key: String,
    gen: u64,
    id: String,
    ip: Option<String>,
    last_restart: Option<tokio::time::Instant>,
}

impl Shared {
    /// One watcher pass.
    pub(crate) async fn watch_once(self: &Arc<Self>) {
        let vms = match self.backend.list().await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "VM watcher: the VMs cannot be listed; skipping this pass");
                return;
            }
        };
        let by_id: BTreeMap<&str, &VmInfo> = vms.iter().map(|v| (v.id.as_str(), v)).collect();
        let watched: Vec<Watched> = {
            let g = self.lock();
            g.entries
                .iter()
                .filter(|(_, e)| e.spec.managed && !e.busy && e.terminal.is_none())
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
                            let mut g = self.lock();
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
                            self.push_entry(&w.key, w.gen);
                        }
                    }
                    VmState::Running | VmState::Creating => {}
                    VmState::Stopped => self.restart_or_evict(&w).instrument(span).await,
                },
                None => match self.backend.inspect(&w.id).await {
                    Ok(None) => {
                        let evicted = span.in_scope(|| self.evict(&w, events::VM_GONE, format!("VM {} is gone", w.id)));
                        if evicted {
                            self.release_quietly(&w.id).instrument(span).await;
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

    async fn restart_or_evict(self: &Arc<Self>, w: &Watched) {
        let cooling = w.last_restart.is_some_and(|t| t.elapsed() < self.cfg.restart_cooldown);
        if cooling {
            if let Err(e) = self.backend.remove(&w.id).await {
                tracing::warn!(error = %error_chain(&e), "removing a VM that keeps stopping failed; retrying next pass");
                return;
            }
            self.release_quietly(&w.id).await;
            self.evict(
                w,
                events::RESTART_COOLDOWN,
                format!("VM {} stopped again within {:?} of a restart; removed", w.id, self.cfg.restart_cooldown),
            );
            return;
        }
        match self.backend.start(&w.id).await {
            Ok(v) => {
                let pod = {
                    let mut g = self.lock();
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
                self.event(
                    &pod,
                    false,
                    events::VM_RESTARTED,
                    &format!("VM {} had stopped and was started again", w.id),
                );
                self.restart_probe(&w.key, w.gen);
                self.push_entry(&w.key, w.gen);
            }
            Err(e) => {
                let msg = format!("VM {} had stopped and could not be started: {}", w.id, error_chain(&e));
                if let Err(e) = self.backend.remove(&w.id).await {
                    tracing::warn!(error = %error_chain(&e), "removing the VM that failed to start failed");
                }
                self.release_quietly(&w.id).await;
                self.evict(w, events::RESTART_FAILED, msg);
            }
        }
    }

    async fn release_quietly(&self, id: &str) {
        if let Err(e) = self.backend.release_ip(id).await {
            tracing::warn!(vm = %id, error = %error_chain(&e), "releasing the lease failed (best effort)");
        }
    }

    /// A fresh probe loop (fast schedule) for the entry.
    fn restart_probe(self: &Arc<Self>, key: &str, gen: u64) {
        let task = tokio::spawn(self.clone().probe_loop(key.to_owned(), gen));
        let mut g = self.lock();
        match g.entries.get_mut(key).filter(|e| e.gen == gen) {
            Some(e) => {
                if let Some(old) = e.probe.replace(task.abort_handle()) {
                    old.abort();
                }
            }
            None => task.abort(),
        }
    }

    /// Marks the Pod `Failed` with `reason` and pushes it (Warning event too). `false`: the
    /// entry changed meanwhile (replaced, or a provider call is working on it) and was left.
    fn evict(&self, w: &Watched, reason: &str, message: String) -> bool {
        let (view, pod) = {
            let mut g = self.lock();
            let Some(e) = g.entries.get_mut(&w.key).filter(|e| e.gen == w.gen && !e.busy) else { return false };
            e.terminal =
                Some(Terminal { reason: reason.to_owned(), message: message.clone(), at: Time(Timestamp::now()) });
            if let Some(h) = e.probe.take() {
                h.abort();
            }
            (e.view(&self.cfg.node_ip), e.pod.clone())
        };
        tracing::warn!(reason, %message, "evicting the pod");
        self.event(&pod, true, reason, &message);
        self.notify(view);
        true
    }
}

impl CocoonProvider {
    /// One VM-watcher pass (the loop of [`CocoonProvider::spawn_watcher`] runs these).
    pub async fn watch_once(&self) {
        self.0.watch_once().await;
    }

    /// Starts the VM watcher on the current tokio runtime.
    pub fn spawn_watcher(&self) -> BackgroundLoops {
        let shared = self.0.clone();
        let period = shared.cfg.watch_interval;
        let task = tokio::spawn(
            async move {
                let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    shared.watch_once().await;
                }
            }
            .instrument(tracing::info_span!("vm_watcher")),
        );
        BackgroundLoops(vec![task])
    }
}

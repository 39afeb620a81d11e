//! Start-up reconcile (`docs/virtual-node.md` §3.8): before the node registers, the backend's VMs
//! are matched with the node's Pods, so that a provider restarted after a crash (even
//! `kill -9`: the hypervisors are daemonized and keep running) takes its VMs back instead of
//! booting new ones.
//!
//! * A failed VM listing fails the reconcile (the node must not register on a guess).
//! * A VM still `Creating` was left by a crashed create: removed, its lease released — unless
//!   it was a wake: while `<vm-name>:hibernate` of its name (or of a live Pod's name that
//!   references its id) exists, or cannot be looked up, the lease stays, since the guest the
//!   retried wake restores carries that address.
//! * A VM referenced by a live (not `Failed`/`Succeeded`) Pod on this node — its
//!   `vm.cocoonstack.io/id`, else its `vm.cocoonstack.io/name` — becomes *adoptable*: the Pod's
//!   CreatePod adopts it (by id, then name), its DeletePod removes it — when the Pod's
//!   namespace may use the VM ([`crate::namespaces`]). A VM referenced only by Pods of other
//!   namespaces is kept all the same (logged): those Pods are refused, and the VM waits for a
//!   Pod of its own namespace; a namespace mismatch is no proof that nobody wants it.
//! * Every other VM is an orphan, handled per `VK_ORPHAN_POLICY`: `destroy` removes it and
//!   releases its lease (no snapshot: no Pod says which policy applies), `alert` logs a
//!   warning, `keep` logs at info. The Pod list must be complete (the caller lists every Pod
//!   bound to the node; a failed Pod list must not reach here).
//!
//! Nothing else is persisted: the backend's list (durable names) plus the Pods' annotations
//! are the whole state.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;

use crate::annotations;
use crate::backend::VmState;
use crate::config::OrphanPolicy;
use crate::metrics::metrics;
use crate::provider::{hibernation_held, CocoonProvider, CocoonProviderError};

/// What a reconcile found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// VM ids kept for their Pods.
    pub adoptable: Vec<String>,
    /// Half-created VMs removed.
    pub stale_removed: Vec<String>,
    /// Those of them whose lease was kept for a wake (a `<vm-name>:hibernate` holds it).
    pub leases_kept: Vec<String>,
    /// Orphans removed (`destroy`).
    pub orphans_destroyed: Vec<String>,
    /// Orphans left in place (`alert`, `keep`, or a failed removal).
    pub orphans_left: Vec<String>,
}

impl CocoonProvider {
    /// Matches the backend's VMs with `pods` (every Pod bound to this node). Run once, before
    /// the node runtime starts.
    pub async fn reconcile_startup(&self, pods: &[Pod]) -> Result<ReconcileReport, CocoonProviderError> {
        let shared = &self.0;
        let vms = shared.backend.list().await.map_err(CocoonProviderError::Reconcile)?;
        let live = pods.iter().filter(|p| !vnode::sync::is_finished(p));
        // id / name → the namespaces of the Pods that reference it.
        let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        // id → the VM names of the Pods that reference it.
        let mut named_by_id: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for p in live {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            if let Some(id) = annotations::value(p, annotations::VM_ID) {
                ids.entry(id.to_owned()).or_default().insert(ns.clone());
                if let Some(n) = annotations::value(p, annotations::VM_NAME) {
                    named_by_id.entry(id.to_owned()).or_default().insert(n.to_owned());
                }
            }
            if let Some(n) = annotations::value(p, annotations::VM_NAME) {
                names.entry(n.to_owned()).or_default().insert(ns);
            }
        }
        let mut report = ReconcileReport::default();
        for vm in vms {
            let tracked = shared.lock().entries.values().any(|e| e.vm.id == vm.id);
            if tracked {
                continue;
            }
            if vm.state == VmState::Creating {
                tracing::info!(vm = %vm.id, name = %vm.name, "removing a VM a crashed create left half-made");
                match shared.backend.remove(&vm.id).await {
                    Ok(()) => {
                        let candidates = std::iter::once(vm.name.as_str())
                            .chain(named_by_id.get(&vm.id).into_iter().flatten().map(String::as_str));
                        if hibernation_held(shared, candidates).await {
                            tracing::info!(vm = %vm.id, name = %vm.name, "it was a wake: its lease is kept (the hibernated guest carries its address)");
                            report.leases_kept.push(vm.id.clone());
                        } else if let Err(e) = shared.backend.release_ip(&vm.id).await {
                            tracing::warn!(vm = %vm.id, error = %error_chain(&e), "releasing its lease failed");
                        }
                        report.stale_removed.push(vm.id);
                    }
                    Err(e) => {
                        tracing::warn!(vm = %vm.id, error = %error_chain(&e), "removing a half-made VM failed; leaving it");
                        report.orphans_left.push(vm.id);
                    }
                }
                continue;
            }
            let referrers: BTreeSet<&String> =
                ids.get(&vm.id).into_iter().chain(names.get(&vm.name)).flatten().collect();
            if !referrers.is_empty() {
                let policy = &shared.cfg.namespaces;
                if referrers.iter().any(|ns| policy.permits(ns, vm.namespace.as_deref())) {
                    tracing::info!(vm = %vm.id, name = %vm.name, state = ?vm.state, "a pod references this VM; it will be adopted");
                } else {
                    // Kept all the same: a namespace mismatch is no proof the VM is unwanted.
                    tracing::warn!(vm = %vm.id, name = %vm.name, owner = policy.owner(vm.namespace.as_deref()), referrers = ?referrers, "only pods of other namespaces reference this VM; it is kept, and they will be refused (VK_SHARED_NAMESPACES, VK_LEGACY_NAMESPACE)");
                }
                report.adoptable.push(vm.id.clone());
                let mut g = shared.lock();
                g.restarted.insert(vm.id.clone());
                g.adoptable.insert(vm.id.clone(), vm);
                continue;
            }
            metrics().orphan_found();
            match shared.cfg.orphan_policy {
                OrphanPolicy::Destroy => {
                    tracing::warn!(vm = %vm.id, name = %vm.name, "orphan VM (no pod on this node references it); destroying it");
                    match shared.backend.remove(&vm.id).await {
                        Ok(()) => {
                            if let Err(e) = shared.backend.release_ip(&vm.id).await {
                                tracing::warn!(vm = %vm.id, error = %error_chain(&e), "releasing the orphan's lease failed");
                            }
                            report.orphans_destroyed.push(vm.id);
                        }
                        Err(e) => {
                            tracing::warn!(vm = %vm.id, error = %error_chain(&e), "destroying the orphan failed; leaving it");
                            report.orphans_left.push(vm.id);
                        }
                    }
                }
                OrphanPolicy::Alert => {
                    tracing::warn!(vm = %vm.id, name = %vm.name, "orphan VM (no pod on this node references it); left running (VK_ORPHAN_POLICY=alert)");
                    report.orphans_left.push(vm.id);
                }
                OrphanPolicy::Keep => {
                    tracing::info!(vm = %vm.id, name = %vm.name, "orphan VM kept (VK_ORPHAN_POLICY=keep)");
                    report.orphans_left.push(vm.id);
                }
            }
        }
        tracing::info!(?report, "start-up reconcile done");
        Ok(report)
    }
}

//! [`SandboxProvider`]: the [`vnode::Provider`] that turns each Pod bound to this node into one
//! sandboxd claim (`docs/virtual-node.md` §2.5–§2.8).
//!
//! # Expected flow
//! * **CreatePod** (key `ns/name`): runtime check → settle a quarantined row (list; a failed
//!   list fails) → settle a past cached deadline (list; listed → refresh, gone → drop, error →
//!   fail) → adopt a settled claim in place (or, when this Pod may not adopt it and the recorded
//!   owner's verdict is Release, queue it for release) → release a stranded tentative claim →
//!   take back a claim sandboxd granted for this key whose answer was lost (`lost.rs`: listing
//!   by `claim_ref` only while one can exist; beyond §2.5, so a crash mid-claim leaves no
//!   duplicate) or claim with `claim_ref` = key → record it tentative, persist (an atomic
//!   write flushed to disk off the path, [`crate::state`]; failure → release, detached, 10 s)
//!   → push Running. A clean create is one sandboxd call and one file write.
//! * **UpdatePod**: a stale UID is ignored; a tentative claim re-runs CreatePod; else the Pod
//!   is stored.
//! * **DeletePod**: a stale UID is ignored; no claim → forget; otherwise the
//!   [`crate::authority`] verdict: Release → sandboxd release (404 = converged; any other
//!   error keeps everything and fails the call); Preserve → drop the Pod entry only.
//! * **Loops** ([`SandboxProvider::spawn_loops`]): quarantine verification (15 s, until
//!   clean), lease watch (30 s), owner recheck of pod-less preserved claims (10 s backoff →
//!   10 min) plus the release queue, and the audit-only orphan scan.
//!
//! # Guarantees
//! * A VM is released only on a positive verdict or a confirmed absence; every error preserves
//!   (§5 pitfall 1). A failed listing is never read as empty (pitfall 2).
//! * The token lives only in memory and in the 0600 state file: never on a Pod, never in logs.
//! * Every status change is pushed through the notifier (async provider: nothing polls).
//!
//! # Caveats
//! A claim whose HTTP response was lost is taken back only when the node token is sandboxd's
//! root token (only then does sandboxd reveal its token); otherwise the orphan scan logs it
//! (`external`) and its lease bounds it.
//!
//! # Code map
//! `config.rs` ([`ProviderConfig`]), `error.rs` ([`SandboxProviderError`]), `table.rs` (the
//! [`SandboxProvider`] and its table, persisted through [`crate::state`]), `create.rs`
//! (CreatePod, UpdatePod), `lost.rs` (claims whose answer was lost), `delete.rs` (DeletePod),
//! `loops.rs` (the background loops), `phases.rs` (the create's phase timings), `metrics.rs`
//! (`kubectl top`),
//! `streams.rs` (the kubelet port's streams, not wired to the VMs yet); the
//! table's lock, the notifier and the loops' handles come from [`vnode::kit`].

mod config;
mod create;
mod delete;
mod error;
mod loops;
mod lost;
mod metrics;
mod phases;
mod streams;
mod table;

pub use config::ProviderConfig;
pub use error::SandboxProviderError;
pub use table::{HeldClaim, SandboxProvider};
pub use vnode::kit::BackgroundLoops;

use k8s_openapi::api::core::v1::Pod;
use vnode::kit::reported;
use vnode::{PodKey, PodNotifier, Provider, ProviderError};

#[async_trait::async_trait]
impl Provider for SandboxProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(self.create(pod).await)
    }

    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(self.update(pod).await)
    }

    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        reported(self.delete(pod).await)
    }

    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.lock().pods.get(&key.to_string()).cloned()
    }

    fn get_pods(&self) -> Vec<Pod> {
        self.lock().pods.values().cloned().collect()
    }

    fn notify_pods(&self, notifier: PodNotifier) {
        self.notifier.set(notifier);
    }
}

#[cfg(test)]
mod tests;

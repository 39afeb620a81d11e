//! The provider's table: [`SandboxProvider`] with its claims, the Pods it reports and their
//! bookkeeping behind one [`Locked`], and the persistence of that table (the claims state file).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use k8s_openapi::api::core::v1::Pod;
use vnode::error_chain;
use vnode::kit::{Locked, Notifier};

use super::config::ProviderConfig;
use super::error::SandboxProviderError;
use super::lost::LostClaims;
use super::phases::CreatePhases;
use crate::authority::OwnerLookup;
use crate::sandboxd::{SandboxRow, SandboxdClient, SandboxdError};
use crate::state::{ClaimRecord, StateError, StateFile, StateStore};

/// When a pod-less preserved claim's owner is read again, and the delay that led there.
#[derive(Debug, Clone, Copy)]
pub(super) struct Recheck {
    pub at: tokio::time::Instant,
    pub delay: Duration,
}

/// The orphan scan's class of a listed sandbox (audit only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OrphanClass {
    Orphan,
    External,
    Stale,
}

/// The table: what the provider knows per Pod key, and the claims in flight.
#[derive(Default)]
pub(super) struct Inner {
    /// Key → the provider's copy of the Pod.
    pub pods: BTreeMap<String, Pod>,
    /// Key → claim.
    pub claims: BTreeMap<String, ClaimRecord>,
    /// Keys whose claim is not yet durable (made in this process, persist pending or failed).
    pub tentative: BTreeSet<String>,
    /// Tentative keys whose persist is under way: every snapshot includes them (one write can
    /// commit many).
    pub committing: BTreeSet<String>,
    /// Keys loaded from the state file and not yet vouched for by a listing.
    pub quarantined: BTreeSet<String>,
    /// Claims withdrawn from their key, awaiting a successful release.
    pub releasing: Vec<ClaimRecord>,
    /// Owner recheck schedule of pod-less preserved claims.
    pub rechecks: BTreeMap<String, Recheck>,
    /// Orphan-scan classification of sandbox ids (audit only).
    pub orphans: BTreeMap<String, OrphanClass>,
    /// Keys that must list for a lost claim before they claim.
    pub lost: LostClaims,
}

impl Inner {
    pub fn settled(&self, key: &str) -> bool {
        self.claims.contains_key(key) && !self.tentative.contains(key) && !self.quarantined.contains(key)
    }

    /// The durable view: settled and quarantined rows, the tentative ones being committed, and
    /// the release queue.
    pub fn snapshot(&self) -> StateFile {
        StateFile {
            claims: self
                .claims
                .iter()
                .filter(|(k, _)| !self.tentative.contains(*k) || self.committing.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            releasing: self.releasing.clone(),
        }
    }

    /// Removes the claim at `key` if it is still `id`, with its pod entry and bookkeeping.
    pub fn withdraw(&mut self, key: &str, id: &str) {
        if self.claims.get(key).is_some_and(|c| c.id == id) {
            self.claims.remove(key);
            self.pods.remove(key);
            self.tentative.remove(key);
            self.committing.remove(key);
            self.quarantined.remove(key);
            self.rechecks.remove(key);
        }
    }
}

/// A listing by sandbox id.
pub(super) fn listed_ids(rows: &[SandboxRow]) -> BTreeMap<&str, &SandboxRow> {
    rows.iter().map(|r| (r.id.as_str(), r)).collect()
}

/// A claim of the table and the Pod it serves (none while it is preserved for a replacement, or
/// not yet recorded as the Pod's).
#[derive(Debug, Clone)]
pub struct HeldClaim {
    /// The Pod key (`namespace/name`), the claim's `claim_ref`.
    pub key: String,
    /// The sandbox id.
    pub id: String,
    /// The provider's copy of the Pod.
    pub pod: Option<Pod>,
}

/// The vk-sandbox provider.
pub struct SandboxProvider {
    pub(super) sandboxd: SandboxdClient,
    pub(super) owners: Arc<dyn OwnerLookup>,
    store: StateStore,
    pub(super) cfg: ProviderConfig,
    inner: Locked<Inner>,
    pub(super) notifier: Notifier,
    pub(super) phases: CreatePhases,
    /// Poked on every claim, adoption, release or drop (one permit: pokes coalesce).
    changes: Arc<Notify>,
}

impl SandboxProvider {
    /// Opens the state file (missing = empty, malformed = error, must be writable); every loaded
    /// row starts quarantined.
    pub fn new(
        sandboxd: SandboxdClient,
        owners: Arc<dyn OwnerLookup>,
        cfg: ProviderConfig,
    ) -> Result<SandboxProvider, SandboxProviderError> {
        let (store, loaded) = StateStore::open(&cfg.state_path).map_err(SandboxProviderError::State)?;
        let inner = Inner {
            quarantined: loaded.claims.keys().cloned().collect(),
            claims: loaded.claims,
            releasing: loaded.releasing,
            ..Inner::default()
        };
        tracing::info!(
            path = %cfg.state_path.display(),
            claims = inner.claims.len(),
            releasing = inner.releasing.len(),
            "loaded the claims state; loaded claims stay quarantined until sandboxd lists them"
        );
        let phases = CreatePhases::new(store.flush_failures());
        Ok(SandboxProvider {
            sandboxd,
            owners,
            store,
            cfg,
            inner: Locked::new(inner),
            notifier: Notifier::default(),
            phases,
            changes: Arc::new(Notify::new()),
        })
    }

    /// Registers the provider's own samples ([`super::phases`]) beside the runtime's.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.phases.register(registry);
    }

    /// The table (consistent at every unlock: no await under the lock).
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Pushes a Pod's new status.
    pub(super) fn notify(&self, pod: Pod) {
        self.notifier.notify(pod);
    }

    /// Persists the current table; a failure is logged (the caller's change is already durable
    /// elsewhere or harmless to lose).
    pub(super) async fn persist_logged(&self, why: &'static str) {
        if let Err(e) = self.store.save(|| self.lock().snapshot()).await {
            tracing::warn!(error = %error_chain(&e), why, "could not persist the claims state");
        }
    }

    /// Makes the tentative claim at `key` durable (possibly in a write another commit made).
    pub(super) async fn commit(&self, key: &str) -> Result<(), StateError> {
        self.lock().committing.insert(key.to_owned());
        let r = self
            .store
            .save_with(
                || self.lock().snapshot(),
                || {
                    let mut g = self.lock();
                    g.tentative.remove(key);
                    g.committing.remove(key);
                },
            )
            .await;
        if r.is_err() {
            self.lock().committing.remove(key);
        }
        r
    }

    /// Releases on a task of its own (a dropped caller does not cancel it), bounded by the
    /// client's 10 s timeout.
    pub(super) async fn release_detached(&self, id: &str, token: &str) -> Result<(), SandboxdError> {
        let (c, id, token) = (self.sandboxd.clone(), id.to_owned(), token.to_owned());
        tokio::spawn(async move { c.release(&id, &token).await })
            .await
            .unwrap_or(Err(SandboxdError::Aborted { what: "release" }))
    }

    /// Poked whenever the claims or the Pods holding them change (a claim, an adoption, a
    /// release, a claim gone with its lease): [`crate::inventory`] publishes soon after. Pokes
    /// while nobody waits coalesce into one.
    pub fn changes(&self) -> Arc<Notify> {
        self.changes.clone()
    }

    /// Tells [`SandboxProvider::changes`]' waiter.
    pub(super) fn changed(&self) {
        self.changes.notify_one();
    }

    /// Every claim of the table with its Pod (no token).
    pub fn held_claims(&self) -> Vec<HeldClaim> {
        let g = self.lock();
        g.claims
            .iter()
            .map(|(k, c)| HeldClaim {
                key: k.clone(),
                id: c.id.clone(),
                pod: g.pods.get(k).filter(|p| c.pod_uid.is_empty() || vnode::kit::uid_of(p) == c.pod_uid).cloned(),
            })
            .collect()
    }

    /// The claim id at `key`, if any (no token).
    pub fn claim_id(&self, key: &str) -> Option<String> {
        self.lock().claims.get(key).map(|c| c.id.clone())
    }

    /// Whether the row at `key` still awaits verification.
    pub fn is_quarantined(&self, key: &str) -> bool {
        self.lock().quarantined.contains(key)
    }
}

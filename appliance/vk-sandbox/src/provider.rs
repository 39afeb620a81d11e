//! [`SandboxProvider`]: the [`vnode::Provider`] that turns each Pod bound to this node into one
//! sandboxd claim (`shared/spec/virtual-node.md` §2.5–§2.8).
//!
//! # Expected flow
//! * **CreatePod** (key `ns/name`): runtime check → settle a quarantined row (list; a failed
//!   list fails) → settle a past cached deadline (list; listed → refresh, gone → drop, error →
//!   fail) → adopt a settled claim in place (or, when this Pod may not adopt it and the recorded
//!   owner's verdict is Release, queue it for release) → release a stranded tentative claim →
//!   take back a claim sandboxd granted for this key whose answer was lost (listing by
//!   `claim_ref`; beyond §2.5, so a crash mid-claim leaves no duplicate) or claim with
//!   `claim_ref` = key → record it tentative, persist (failure → release, detached, 10 s) →
//!   push Running.
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

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use tracing::Instrument;
use vnode::{PodKey, PodNotifier, Provider, ProviderError};

use crate::annotations::{self, AnnotationError};
use crate::authority::{self, Lookup, OwnerLookup, Verdict};
use crate::sandboxd::{claimed_at, Deadline as _, SandboxRow, SandboxdClient, SandboxdError};
use crate::state::{ClaimRecord, StateError, StateFile, StateStore};
use crate::status;

/// Why a provider call failed. The chain becomes the Pod's `ProviderFailed` message.
#[derive(Debug, thiserror::Error)]
pub enum SandboxProviderError {
    /// The Pod's annotations cannot be served.
    #[error("pod {key}")]
    Annotation {
        key: String,
        #[source]
        source: AnnotationError,
    },
    /// A row from a previous run could not be verified.
    #[error(
        "pod {key}: a claim from a previous run is not yet verified and sandboxd cannot be listed; \
         refusing to claim over a possibly live sandbox"
    )]
    Unverified {
        key: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// A past-deadline row could not be checked.
    #[error("pod {key}: claim {id} is past its cached deadline and sandboxd cannot be listed; refusing to replace it")]
    ExpiredUnlisted {
        key: String,
        id: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// A preserved claim belongs to another, still-live owner.
    #[error(
        "pod {key}: the preserved claim {id} for this name belongs to another owner and may not be adopted ({reason})"
    )]
    NotAdoptable { key: String, id: String, reason: String },
    /// A stranded tentative claim could not be returned.
    #[error(
        "pod {key}: an earlier claim {id} that never reached the state file could not be released \
         (its credential is only in memory)"
    )]
    Stranded {
        key: String,
        id: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// The check for a lost claim could not list sandboxd.
    #[error(
        "pod {key}: sandboxd cannot be listed to check for a claim whose answer was lost; \
         not claiming (a duplicate VM could leak)"
    )]
    LostUnlisted {
        key: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// sandboxd refused or failed the claim (no capacity included).
    #[error("pod {key}: claiming a sandbox")]
    Claim {
        key: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// The claim could not be persisted; it was released.
    #[error("pod {key}: claim {id} could not be recorded, so it was released")]
    Persist {
        key: String,
        id: String,
        #[source]
        source: StateError,
    },
    /// The claim could not be persisted and releasing it failed too.
    #[error(
        "pod {key}: claim {id} could not be recorded ({persist}) and releasing it failed; the credential is kept \
         in memory and the release is retried on the next update or delete"
    )]
    PersistAndRelease {
        key: String,
        id: String,
        persist: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// Releasing on delete failed; everything is kept and the delete is retried.
    #[error("pod {key}: releasing claim {id}")]
    Release {
        key: String,
        id: String,
        #[source]
        source: Box<SandboxdError>,
    },
    /// The state file could not be opened.
    #[error("opening the claims state")]
    State(#[source] StateError),
}

/// The provider error the runtime shows: the whole chain as one message.
fn report(e: &dyn std::error::Error) -> ProviderError {
    ProviderError::reported(e)
}

pub use vnode::provider::error_chain;

/// Intervals and inputs of a [`SandboxProvider`].
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    /// The claims state file.
    pub state_path: PathBuf,
    /// The pod IP when a claim's `owner_addr` is empty (host of the sandboxd advertise address).
    pub fallback_host: String,
    /// Quarantine verification period.
    pub verify_interval: Duration,
    /// Lease watch period.
    pub lease_interval: Duration,
    /// First owner recheck delay (doubles per preserve verdict).
    pub recheck_base: Duration,
    /// Owner recheck backoff cap.
    pub recheck_max: Duration,
    /// Orphan scan period (zero = off).
    pub orphan_scan_interval: Duration,
}

impl ProviderConfig {
    /// The spec's intervals: verify 15 s, lease 30 s, recheck 10 s → 10 min, orphan scan 60 s.
    pub fn new(state_path: PathBuf, fallback_host: String) -> ProviderConfig {
        ProviderConfig {
            state_path,
            fallback_host,
            verify_interval: Duration::from_secs(15),
            lease_interval: Duration::from_secs(30),
            recheck_base: Duration::from_secs(10),
            recheck_max: Duration::from_secs(600),
            orphan_scan_interval: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Recheck {
    at: tokio::time::Instant,
    delay: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OrphanClass {
    Orphan,
    External,
    Stale,
}

#[derive(Default)]
struct Inner {
    /// Key → the provider's copy of the Pod.
    pods: BTreeMap<String, Pod>,
    /// Key → claim.
    claims: BTreeMap<String, ClaimRecord>,
    /// Keys whose claim is not yet durable (made in this process, persist pending or failed).
    tentative: BTreeSet<String>,
    /// Keys loaded from the state file and not yet vouched for by a listing.
    quarantined: BTreeSet<String>,
    /// Claims withdrawn from their key, awaiting a successful release.
    releasing: Vec<ClaimRecord>,
    /// Owner recheck schedule of pod-less preserved claims.
    rechecks: BTreeMap<String, Recheck>,
    /// Orphan-scan classification of sandbox ids (audit only).
    orphans: BTreeMap<String, OrphanClass>,
}

impl Inner {
    fn settled(&self, key: &str) -> bool {
        self.claims.contains_key(key) && !self.tentative.contains(key) && !self.quarantined.contains(key)
    }

    /// The durable view: settled and quarantined rows, plus `commit` (a tentative key being
    /// committed), plus the release queue.
    fn snapshot(&self, commit: Option<&str>) -> StateFile {
        StateFile {
            claims: self
                .claims
                .iter()
                .filter(|(k, _)| !self.tentative.contains(*k) || Some(k.as_str()) == commit)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            releasing: self.releasing.clone(),
        }
    }

    /// Removes the claim at `key` if it is still `id`, with its pod entry and bookkeeping.
    fn withdraw(&mut self, key: &str, id: &str) {
        if self.claims.get(key).is_some_and(|c| c.id == id) {
            self.claims.remove(key);
            self.pods.remove(key);
            self.tentative.remove(key);
            self.quarantined.remove(key);
            self.rechecks.remove(key);
        }
    }
}

fn uid_of(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

fn listed_ids(rows: &[SandboxRow]) -> BTreeMap<&str, &SandboxRow> {
    rows.iter().map(|r| (r.id.as_str(), r)).collect()
}

/// The vk-sandbox provider.
pub struct SandboxProvider {
    sandboxd: SandboxdClient,
    owners: Arc<dyn OwnerLookup>,
    store: StateStore,
    cfg: ProviderConfig,
    inner: Mutex<Inner>,
    notifier: Mutex<Option<PodNotifier>>,
}

/// The provider's background loops; dropping this stops them (claims and VMs are untouched).
pub struct BackgroundLoops(Vec<tokio::task::JoinHandle<()>>);

impl Drop for BackgroundLoops {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
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
        Ok(SandboxProvider { sandboxd, owners, store, cfg, inner: Mutex::new(inner), notifier: Mutex::new(None) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The table is consistent at every unlock (no await under the lock), so a poisoned lock
        // (a panic elsewhere) still guards valid data.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn notify(&self, pod: Pod) {
        let n = self.notifier.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        match n {
            Some(n) => n.notify(pod),
            None => tracing::debug!("no notifier yet; status push dropped"),
        }
    }

    /// Persists the current table; a failure is logged (the caller's change is already durable
    /// elsewhere or harmless to lose).
    async fn persist_logged(&self, why: &'static str) {
        if let Err(e) = self.store.save(|| self.lock().snapshot(None)).await {
            tracing::warn!(error = %error_chain(&e), why, "could not persist the claims state");
        }
    }

    /// Makes the tentative claim at `key` durable.
    async fn commit(&self, key: &str) -> Result<(), StateError> {
        self.store
            .save_with(
                || self.lock().snapshot(Some(key)),
                || {
                    self.lock().tentative.remove(key);
                },
            )
            .await
    }

    /// Releases on a task of its own (a dropped caller does not cancel it), bounded by the
    /// client's 10 s timeout.
    async fn release_detached(&self, id: &str, token: &str) -> Result<(), SandboxdError> {
        let (c, id, token) = (self.sandboxd.clone(), id.to_owned(), token.to_owned());
        tokio::spawn(async move { c.release(&id, &token).await })
            .await
            .unwrap_or(Err(SandboxdError::Aborted { what: "release" }))
    }

    /// The claim id at `key`, if any (no token).
    pub fn claim_id(&self, key: &str) -> Option<String> {
        self.lock().claims.get(key).map(|c| c.id.clone())
    }

    /// Whether the row at `key` still awaits verification.
    pub fn is_quarantined(&self, key: &str) -> bool {
        self.lock().quarantined.contains(key)
    }

    // ---------------------------------------------------------------- CreatePod

    #[tracing::instrument(name = "create_pod", skip_all, fields(pod = %PodKey::of(pod), claim = tracing::field::Empty))]
    async fn create(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
        let key = PodKey::of(pod).to_string();
        // 1. Runtime.
        annotations::check_runtime(pod)
            .map_err(|source| SandboxProviderError::Annotation { key: key.clone(), source })?;
        // 2. A quarantined row: settle it first.
        if self.is_quarantined(&key) {
            self.verify_quarantine()
                .await
                .map_err(|source| SandboxProviderError::Unverified { key: key.clone(), source: Box::new(source) })?;
        }
        // 3. A past cached deadline.
        self.settle_expired(&key).await?;
        // 4. Adopt in place.
        if self.adopt_or_withdraw(&key, pod).await? {
            return Ok(());
        }
        // 5. A stranded tentative claim.
        self.clear_stranded(&key).await?;
        // 6. Claim — or take back a claim sandboxd granted for this key whose answer was lost.
        let spec = annotations::claim_spec(pod)
            .map_err(|source| SandboxProviderError::Annotation { key: key.clone(), source })?;
        let rec = match self.recover_lost(&key, pod).await? {
            Some(rec) => rec,
            None => {
                let grant = self
                    .sandboxd
                    .claim(&spec, &key)
                    .await
                    .map_err(|source| SandboxProviderError::Claim { key: key.clone(), source: Box::new(source) })?;
                let deadline = grant.deadline_time();
                ClaimRecord {
                    id: grant.id,
                    token: grant.token,
                    address: grant.owner_addr,
                    pod_uid: uid_of(pod),
                    claimed_at: Some(Timestamp::now()),
                    deadline,
                    owner: authority::controller_owner(pod),
                }
            }
        };
        tracing::Span::current().record("claim", rec.id.as_str());
        // 7. Record tentative; persisting commits it.
        {
            let mut g = self.lock();
            g.claims.insert(key.clone(), rec.clone());
            g.tentative.insert(key.clone());
            g.pods.insert(key.clone(), status::pushed(pod, status::pending(pod), None));
            g.rechecks.remove(&key);
        }
        if let Err(persist) = self.commit(&key).await {
            tracing::error!(error = %error_chain(&persist), "could not record the claim; releasing it");
            return match self.release_detached(&rec.id, &rec.token).await {
                Ok(()) => {
                    self.lock().withdraw(&key, &rec.id);
                    Err(SandboxProviderError::Persist { key, id: rec.id, source: persist })
                }
                Err(source) => {
                    tracing::error!(error = %error_chain(&source), "releasing the unrecorded claim failed; keeping it in memory");
                    Err(SandboxProviderError::PersistAndRelease {
                        key,
                        id: rec.id,
                        persist: error_chain(&persist),
                        source: Box::new(source),
                    })
                }
            };
        }
        // 8. Running.
        let running = status::pushed(pod, status::running(pod, &rec, &self.cfg.fallback_host), Some(&rec.id));
        self.lock().pods.insert(key, running.clone());
        tracing::info!(addr = %rec.address, "claimed a sandbox");
        self.notify(running);
        Ok(())
    }

    /// Step 3: a settled row past its cached deadline is re-checked against a listing.
    async fn settle_expired(&self, key: &str) -> Result<(), SandboxProviderError> {
        let (id, deadline) = {
            let g = self.lock();
            match g.claims.get(key) {
                Some(c) if g.settled(key) => (c.id.clone(), c.deadline),
                _ => return Ok(()),
            }
        };
        if deadline.is_none_or(|d| d > Timestamp::now()) {
            return Ok(());
        }
        let rows = self.sandboxd.list(None).await.map_err(|source| SandboxProviderError::ExpiredUnlisted {
            key: key.to_owned(),
            id: id.clone(),
            source: Box::new(source),
        })?;
        let listed = listed_ids(&rows);
        {
            let mut g = self.lock();
            if g.claims.get(key).is_none_or(|c| c.id != id) {
                return Ok(());
            }
            match listed.get(id.as_str()) {
                Some(row) => {
                    if let (Some(c), Some(d)) = (g.claims.get_mut(key), row.deadline_time()) {
                        c.deadline = Some(d);
                    }
                    tracing::info!(claim = %id, "claim past its cached deadline is still listed; deadline refreshed");
                }
                None => {
                    g.claims.remove(key);
                    g.rechecks.remove(key);
                    tracing::info!(claim = %id, "claim past its cached deadline is gone from sandboxd; dropped");
                }
            }
        }
        self.persist_logged("settling an expired claim").await;
        Ok(())
    }

    /// Step 4. `Ok(true)`: adopted and Running pushed. A claim this Pod may not adopt is
    /// queued for release when its recorded owner's verdict is Release, else the create fails.
    async fn adopt_or_withdraw(&self, key: &str, pod: &Pod) -> Result<bool, SandboxProviderError> {
        let pod_owner = authority::controller_owner(pod);
        let rec = {
            let g = self.lock();
            match g.claims.get(key) {
                Some(c) if g.settled(key) => c.clone(),
                _ => return Ok(false),
            }
        };
        let may_adopt = match (&rec.owner, &pod_owner) {
            (None, _) => true,
            (Some(o), Some(p)) => o.uid.is_empty() || p.uid.is_empty() || o.uid == p.uid,
            (Some(_), None) => false,
        };
        if may_adopt {
            let adopted = {
                let mut g = self.lock();
                // Re-read under the lock: a loop may have dropped or withdrawn the row meanwhile.
                match g.claims.get_mut(key) {
                    Some(c) if c.id == rec.id => {
                        c.pod_uid = uid_of(pod);
                        if c.claimed_at.is_none() {
                            c.claimed_at = Some(Timestamp::now());
                        }
                        if pod_owner.is_some() {
                            c.owner = pod_owner.clone();
                        }
                        let c = c.clone();
                        let running =
                            status::pushed(pod, status::running(pod, &c, &self.cfg.fallback_host), Some(&c.id));
                        g.pods.insert(key.to_owned(), running.clone());
                        g.rechecks.remove(key);
                        Some(running)
                    }
                    _ => None,
                }
            };
            let Some(running) = adopted else {
                return Ok(false);
            };
            tracing::Span::current().record("claim", rec.id.as_str());
            // The credential is already durable; this save only records the new holder.
            self.persist_logged("adopting a claim").await;
            tracing::info!(claim = %rec.id, "adopted the preserved sandbox in place");
            self.notify(running);
            return Ok(true);
        }
        // Not adoptable by this Pod: its recorded owner decides.
        let namespace = key.split_once('/').map(|(ns, _)| ns).unwrap_or("");
        let lookup = match &rec.owner {
            Some(o) => self.owners.lookup(namespace, o).await,
            None => Lookup::NoClient,
        };
        let decision = authority::verdict(rec.owner.as_ref(), &lookup);
        if decision.verdict == Verdict::Preserve {
            return Err(SandboxProviderError::NotAdoptable {
                key: key.to_owned(),
                id: rec.id,
                reason: decision.reason,
            });
        }
        tracing::info!(claim = %rec.id, reason = %decision.reason, "the preserved claim may not be adopted by this pod; releasing it");
        {
            let mut g = self.lock();
            if g.claims.get(key).is_some_and(|c| c.id == rec.id) {
                g.claims.remove(key);
                g.rechecks.remove(key);
                g.releasing.push(rec);
            }
        }
        self.persist_logged("queueing a release").await;
        if self.drain_releases().await {
            self.persist_logged("release queue drained").await;
        }
        Ok(false)
    }

    /// Before a fresh claim: sandboxd journals a claim before it answers, so a crash (or a lost
    /// response) between its grant and our persist leaves a live claim with `claim_ref` = this
    /// key that no row knows. Such a claim was never handed to any Pod: the newest is taken
    /// back (its token read with the node token, which sandboxd honours as root) and any others
    /// are released. A failed listing fails the create rather than risk a duplicate VM.
    async fn recover_lost(&self, key: &str, pod: &Pod) -> Result<Option<ClaimRecord>, SandboxProviderError> {
        let rows = self
            .sandboxd
            .list(Some(key))
            .await
            .map_err(|source| SandboxProviderError::LostUnlisted { key: key.to_owned(), source: Box::new(source) })?;
        let known: BTreeSet<String> = {
            let g = self.lock();
            g.claims.values().chain(g.releasing.iter()).map(|c| c.id.clone()).collect()
        };
        let mut strays: Vec<SandboxRow> =
            rows.into_iter().filter(|r| r.claim_ref.as_deref() == Some(key) && !known.contains(&r.id)).collect();
        if strays.is_empty() {
            return Ok(None);
        }
        // Newest first (RFC 3339 UTC strings of one format sort by time).
        strays.sort_by(|a, b| b.claimed_at.cmp(&a.claimed_at));
        let mut taken: Option<ClaimRecord> = None;
        for row in strays {
            let token = match self.sandboxd.get(&row.id).await {
                Ok(Some((_, Some(token)))) => token,
                Ok(Some((_, None))) => {
                    tracing::warn!(claim = %row.id, "a claim made for this pod was never recorded and its token cannot be read (no root token); leaving it to its lease");
                    continue;
                }
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(claim = %row.id, error = %error_chain(&e), "reading a lost claim failed; leaving it to its lease");
                    continue;
                }
            };
            if taken.is_none() {
                tracing::info!(claim = %row.id, "taking back a claim made for this pod whose answer was lost");
                taken = Some(ClaimRecord {
                    id: row.id.clone(),
                    token,
                    address: String::new(),
                    pod_uid: uid_of(pod),
                    claimed_at: claimed_at(&row).or_else(|| Some(Timestamp::now())),
                    deadline: row.deadline_time(),
                    owner: authority::controller_owner(pod),
                });
            } else if let Err(e) = self.release_detached(&row.id, &token).await {
                tracing::warn!(claim = %row.id, error = %error_chain(&e), "releasing a duplicate lost claim failed; leaving it to its lease");
            } else {
                tracing::info!(claim = %row.id, "released a duplicate lost claim");
            }
        }
        Ok(taken)
    }

    /// Step 5: a tentative claim left by an earlier failed persist is returned first.
    async fn clear_stranded(&self, key: &str) -> Result<(), SandboxProviderError> {
        let rec = {
            let g = self.lock();
            match g.claims.get(key) {
                Some(c) if g.tentative.contains(key) => c.clone(),
                _ => return Ok(()),
            }
        };
        self.release_detached(&rec.id, &rec.token).await.map_err(|source| SandboxProviderError::Stranded {
            key: key.to_owned(),
            id: rec.id.clone(),
            source: Box::new(source),
        })?;
        self.lock().withdraw(key, &rec.id);
        tracing::info!(claim = %rec.id, "released a stranded claim before reusing its pod key");
        Ok(())
    }

    // ---------------------------------------------------------------- UpdatePod

    #[tracing::instrument(name = "update_pod", skip_all, fields(pod = %PodKey::of(pod)))]
    async fn update(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        let rerun = {
            let mut g = self.lock();
            match g.pods.get(&key) {
                Some(cur) if uid_of(cur) != uid => {
                    tracing::debug!(%uid, "ignoring an update for a previous pod generation");
                    return Ok(());
                }
                None => true,
                Some(_) if g.tentative.contains(&key) => true,
                Some(cur) => {
                    // Store the Pod, keeping the status and claim-id this provider reports.
                    let st = cur.status.clone();
                    let claim_id = g.claims.get(&key).map(|c| c.id.clone());
                    let mut stored = pod.clone();
                    if let Some(st) = st {
                        stored = status::pushed(&stored, st, claim_id.as_deref());
                    }
                    g.pods.insert(key.clone(), stored);
                    false
                }
            }
        };
        if rerun {
            return self.create(pod).await;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- DeletePod

    #[tracing::instrument(name = "delete_pod", skip_all, fields(pod = %PodKey::of(pod), claim = tracing::field::Empty))]
    async fn delete(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
        let key = PodKey::of(pod).to_string();
        let uid = uid_of(pod);
        let (rec, tentative) = {
            let mut g = self.lock();
            if let Some(cur) = g.pods.get(&key) {
                if uid_of(cur) != uid {
                    tracing::debug!(%uid, "ignoring a delete for a previous pod generation");
                    return Ok(());
                }
            }
            let Some(rec) = g.claims.get(&key).cloned() else {
                g.pods.remove(&key);
                return Ok(());
            };
            if !g.pods.contains_key(&key) && !rec.pod_uid.is_empty() && rec.pod_uid != uid {
                tracing::debug!(%uid, "ignoring a delete: the claim belongs to another pod generation");
                return Ok(());
            }
            (rec, g.tentative.contains(&key))
        };
        tracing::Span::current().record("claim", rec.id.as_str());
        let owner = authority::controller_owner(pod).or_else(|| rec.owner.clone());
        let decision = if tentative {
            authority::Decision {
                verdict: Verdict::Release,
                reason: "the claim was never recorded: the pod never ran on it".into(),
            }
        } else {
            let lookup = match &owner {
                Some(o) => self.owners.lookup(&PodKey::of(pod).namespace, o).await,
                None => Lookup::NoClient, // not consulted for a bare pod
            };
            authority::verdict(owner.as_ref(), &lookup)
        };
        match decision.verdict {
            Verdict::Release => {
                self.sandboxd.release(&rec.id, &rec.token).await.map_err(|source| SandboxProviderError::Release {
                    key: key.clone(),
                    id: rec.id.clone(),
                    source: Box::new(source),
                })?;
                self.lock().withdraw(&key, &rec.id);
                tracing::info!(reason = %decision.reason, "released the sandbox");
                self.persist_logged("releasing a claim").await;
            }
            Verdict::Preserve => {
                {
                    let mut g = self.lock();
                    g.pods.remove(&key);
                    g.rechecks.remove(&key);
                    if let (Some(c), Some(o)) = (g.claims.get_mut(&key), owner) {
                        if c.id == rec.id {
                            c.owner = Some(o);
                        }
                    }
                }
                tracing::info!(reason = %decision.reason, "preserved the sandbox for a replacement pod");
                self.persist_logged("preserving a claim").await;
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- loops

    /// One quarantine pass: list sandboxd; listed rows become settled (deadline refreshed),
    /// unlisted rows are dropped. A failed list changes nothing and is returned.
    pub async fn verify_quarantine(&self) -> Result<(), SandboxdError> {
        let pending: Vec<(String, String)> = {
            let g = self.lock();
            g.quarantined.iter().filter_map(|k| g.claims.get(k).map(|c| (k.clone(), c.id.clone()))).collect()
        };
        if pending.is_empty() {
            return Ok(());
        }
        let rows = self.sandboxd.list(None).await?;
        let listed = listed_ids(&rows);
        let mut vouched = Vec::new();
        {
            let mut g = self.lock();
            for (key, id) in pending {
                if !g.quarantined.contains(&key) || g.claims.get(&key).is_none_or(|c| c.id != id) {
                    continue;
                }
                g.quarantined.remove(&key);
                match listed.get(id.as_str()) {
                    Some(row) => {
                        if let (Some(c), Some(d)) = (g.claims.get_mut(&key), row.deadline_time()) {
                            c.deadline = Some(d);
                        }
                        tracing::info!(pod = %key, claim = %id, "sandboxd vouches for a claim from a previous run");
                        vouched.push(key);
                    }
                    None => {
                        g.claims.remove(&key);
                        tracing::info!(pod = %key, claim = %id, "a claim from a previous run is gone from sandboxd; dropped");
                    }
                }
            }
            // A Pod already tracked for a vouched row (not expected: CreatePod verifies first).
            let pushes: Vec<Pod> = vouched
                .iter()
                .filter_map(|k| {
                    let (p, c) = (g.pods.get(k)?, g.claims.get(k)?);
                    (uid_of(p) == c.pod_uid)
                        .then(|| status::pushed(p, status::running(p, c, &self.cfg.fallback_host), Some(&c.id)))
                })
                .collect();
            for p in &pushes {
                g.pods.insert(PodKey::of(p).to_string(), p.clone());
            }
            drop(g);
            for p in pushes {
                self.notify(p);
            }
        }
        self.persist_logged("verifying loaded claims").await;
        Ok(())
    }

    /// One lease-watch pass: settled claims past their deadline are re-checked against a
    /// listing; confirmed gone → the Pod is pushed `Failed` (`SandboxLeaseExpired`) and the row
    /// dropped; listed → deadline refreshed; a failed list defers everything.
    pub async fn lease_check(&self) {
        let now = Timestamp::now();
        let due: Vec<(String, String)> = {
            let g = self.lock();
            g.claims
                .iter()
                .filter(|(k, c)| g.settled(k) && c.deadline.is_some_and(|d| d <= now))
                .map(|(k, c)| (k.clone(), c.id.clone()))
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let rows = match self.sandboxd.list(None).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), due = due.len(), "lease watch: sandboxd cannot be listed; deferring");
                return;
            }
        };
        let listed = listed_ids(&rows);
        let mut pushes = Vec::new();
        let mut changed = false;
        {
            let mut g = self.lock();
            for (key, id) in due {
                // Re-check: the key may hold another claim by now.
                if !g.settled(&key) || g.claims.get(&key).is_none_or(|c| c.id != id) {
                    continue;
                }
                if let Some(row) = listed.get(id.as_str()) {
                    if let (Some(c), Some(d)) = (g.claims.get_mut(&key), row.deadline_time()) {
                        changed |= c.deadline != Some(d);
                        c.deadline = Some(d);
                    }
                    tracing::debug!(pod = %key, claim = %id, "lease past its cached deadline is still listed; refreshed");
                    continue;
                }
                let Some(rec) = g.claims.remove(&key) else { continue };
                g.rechecks.remove(&key);
                changed = true;
                tracing::warn!(pod = %key, claim = %id, "the sandbox lease expired and sandboxd no longer holds it");
                if let Some(p) = g.pods.get(&key).filter(|p| uid_of(p) == rec.pod_uid).cloned() {
                    let failed =
                        status::pushed(&p, status::lease_expired(&p, &rec, &self.cfg.fallback_host), Some(&rec.id));
                    g.pods.insert(key.clone(), failed.clone());
                    pushes.push(failed);
                }
            }
        }
        for p in pushes {
            self.notify(p);
        }
        if changed {
            self.persist_logged("lease watch").await;
        }
    }

    /// One owner-recheck pass: each due pod-less preserved claim's owner is read again;
    /// Release → the claim moves to the release queue; Preserve → backoff doubles (≤ max).
    /// Then the release queue is drained.
    pub async fn recheck_owners(&self) {
        let now = tokio::time::Instant::now();
        let candidates: Vec<(String, ClaimRecord, Option<Recheck>)> = {
            let mut g = self.lock();
            let preserved: BTreeMap<String, ClaimRecord> = g
                .claims
                .iter()
                .filter(|(k, c)| g.settled(k) && !g.pods.contains_key(*k) && c.owner.is_some())
                .map(|(k, c)| (k.clone(), c.clone()))
                .collect();
            g.rechecks.retain(|k, _| preserved.contains_key(k));
            preserved
                .into_iter()
                .filter_map(|(k, c)| {
                    let r = g.rechecks.get(&k).copied();
                    r.is_none_or(|r| r.at <= now).then_some((k, c, r))
                })
                .collect()
        };
        let mut changed = false;
        for (key, rec, prev) in candidates {
            let Some(owner) = rec.owner.clone() else { continue };
            let namespace = key.split_once('/').map(|(ns, _)| ns.to_owned()).unwrap_or_default();
            let lookup = self.owners.lookup(&namespace, &owner).await;
            let decision = authority::verdict(Some(&owner), &lookup);
            let mut g = self.lock();
            let still =
                g.settled(&key) && !g.pods.contains_key(&key) && g.claims.get(&key).is_some_and(|c| c.id == rec.id);
            if !still {
                continue;
            }
            match decision.verdict {
                Verdict::Release => {
                    tracing::info!(pod = %key, claim = %rec.id, reason = %decision.reason, "owner recheck: releasing a preserved sandbox");
                    g.claims.remove(&key);
                    g.rechecks.remove(&key);
                    g.releasing.push(rec);
                    changed = true;
                }
                Verdict::Preserve => {
                    let delay = prev.map(|r| (r.delay * 2).min(self.cfg.recheck_max)).unwrap_or(self.cfg.recheck_base);
                    tracing::debug!(pod = %key, claim = %rec.id, reason = %decision.reason, ?delay, "owner recheck: preserved");
                    g.rechecks.insert(key, Recheck { at: now + delay, delay });
                }
            }
        }
        if changed {
            self.persist_logged("owner recheck").await;
        }
        if self.drain_releases().await {
            self.persist_logged("release queue drained").await;
        }
    }

    /// Releases every queued claim it can; a failure stays queued. `true` if any left the queue.
    async fn drain_releases(&self) -> bool {
        let queued = self.lock().releasing.clone();
        let mut any = false;
        for rec in queued {
            match self.sandboxd.release(&rec.id, &rec.token).await {
                Ok(()) => {
                    self.lock().releasing.retain(|q| q.id != rec.id);
                    tracing::info!(claim = %rec.id, "released a queued sandbox");
                    any = true;
                }
                Err(e) => {
                    tracing::warn!(claim = %rec.id, error = %error_chain(&e), "queued release failed; retrying later")
                }
            }
        }
        any
    }

    /// One orphan-scan pass (audit only, never releases): `orphan` (no local claim, no
    /// `claim_ref`), `external` (has a `claim_ref`), `stale` (local settled claim not listed).
    /// Logs transitions; a failed list skips the pass.
    pub async fn orphan_scan(&self) {
        let rows = match self.sandboxd.list(None).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %error_chain(&e), "orphan scan: sandboxd cannot be listed; skipping");
                return;
            }
        };
        let mut g = self.lock();
        let local: BTreeSet<&str> =
            g.claims.values().map(|c| c.id.as_str()).chain(g.releasing.iter().map(|c| c.id.as_str())).collect();
        let listed: BTreeSet<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let mut now: BTreeMap<String, OrphanClass> = BTreeMap::new();
        for r in &rows {
            if local.contains(r.id.as_str()) {
                continue;
            }
            let class = if r.claim_ref.as_deref().is_some_and(|c| !c.is_empty()) {
                OrphanClass::External
            } else {
                OrphanClass::Orphan
            };
            now.insert(r.id.clone(), class);
        }
        for (k, c) in &g.claims {
            if g.settled(k) && !listed.contains(c.id.as_str()) {
                now.insert(c.id.clone(), OrphanClass::Stale);
            }
        }
        for (id, class) in &now {
            if g.orphans.get(id) != Some(class) {
                tracing::info!(sandbox = %id, class = ?class, "orphan scan");
            }
        }
        for id in g.orphans.keys() {
            if !now.contains_key(id) {
                tracing::info!(sandbox = %id, "orphan scan: resolved");
            }
        }
        g.orphans = now;
    }

    /// Starts the background loops on the current tokio runtime.
    pub fn spawn_loops(self: &Arc<Self>) -> BackgroundLoops {
        let mut tasks = Vec::new();
        let every = |d: Duration| {
            let mut i = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        };
        let p = self.clone();
        let mut tick = every(self.cfg.verify_interval);
        tasks.push(tokio::spawn(
            async move {
                loop {
                    if p.lock().quarantined.is_empty() {
                        tracing::info!("every loaded claim is verified");
                        return;
                    }
                    tick.tick().await;
                    if let Err(e) = p.verify_quarantine().await {
                        tracing::warn!(error = %error_chain(&e), "claim verification: sandboxd cannot be listed; rows stay quarantined");
                    }
                }
            }
            .instrument(tracing::info_span!("claim_verify")),
        ));
        let p = self.clone();
        let mut tick = every(self.cfg.lease_interval);
        tasks.push(tokio::spawn(
            async move {
                loop {
                    tick.tick().await;
                    p.lease_check().await;
                }
            }
            .instrument(tracing::info_span!("lease_watch")),
        ));
        let p = self.clone();
        let mut tick = every(self.cfg.recheck_base);
        tasks.push(tokio::spawn(
            async move {
                loop {
                    tick.tick().await;
                    p.recheck_owners().await;
                }
            }
            .instrument(tracing::info_span!("owner_recheck")),
        ));
        if !self.cfg.orphan_scan_interval.is_zero() {
            let p = self.clone();
            let mut tick = every(self.cfg.orphan_scan_interval);
            tasks.push(tokio::spawn(
                async move {
                    loop {
                        tick.tick().await;
                        p.orphan_scan().await;
                    }
                }
                .instrument(tracing::info_span!("orphan_scan")),
            ));
        }
        BackgroundLoops(tasks)
    }
}

#[async_trait::async_trait]
impl Provider for SandboxProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.create(pod).await.map_err(|e| report(&e))
    }

    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.update(pod).await.map_err(|e| report(&e))
    }

    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.delete(pod).await.map_err(|e| report(&e))
    }

    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.lock().pods.get(&key.to_string()).cloned()
    }

    fn get_pods(&self) -> Vec<Pod> {
        self.lock().pods.values().cloned().collect()
    }

    fn notify_pods(&self, notifier: PodNotifier) {
        *self.notifier.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(notifier);
    }
}

#[cfg(test)]
#[path = "provider_tests.rs"]
mod tests;

/// Test access to the owner recorded for a key.
#[cfg(test)]
impl SandboxProvider {
    fn owner_of(&self, key: &str) -> Option<crate::state::OwnerRef> {
        self.lock().claims.get(key).and_then(|c| c.owner.clone())
    }
    fn set_deadline(&self, key: &str, d: Timestamp) {
        if let Some(c) = self.lock().claims.get_mut(key) {
            c.deadline = Some(d);
        }
    }
    fn releasing_len(&self) -> usize {
        self.lock().releasing.len()
    }
}

//! CreatePod and UpdatePod: settle what a previous run or an earlier attempt left under the
//! key, adopt a preserved claim in place, take back a claim whose answer was lost, or claim
//! afresh; record it, then push Running (the steps are in the module docs of [`super`]).

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use vnode::error_chain;
use vnode::kit::uid_of;
use vnode::PodKey;

use super::error::SandboxProviderError;
use super::lost::may_have_been_granted;
use super::phases::Phase;
use super::table::{listed_ids, SandboxProvider};
use crate::annotations;
use crate::authority::{self, Lookup, Verdict};
use crate::sandboxd::Deadline as _;
use crate::state::ClaimRecord;
use crate::status;

impl SandboxProvider {
    #[tracing::instrument(name = "create_pod", skip_all, fields(pod = %PodKey::of(pod), claim = tracing::field::Empty))]
    pub(super) async fn create(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
        let key = PodKey::of(pod).to_string();
        let started = Instant::now();
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
        let (rec, fresh) = match self.recover_lost(&key, pod).await? {
            Some(rec) => (rec, false),
            None => {
                // Marked until the answer is definite: a create dropped mid-claim, or an answer
                // lost on the way, makes the next create of this key list first.
                self.lock().lost.keys.insert(key.clone());
                self.phases.observe(Phase::Settle, started.elapsed());
                let claiming = Instant::now();
                let claimed = self.sandboxd.claim(&spec, &key).await;
                self.phases.observe(Phase::Claim, claiming.elapsed());
                let grant = claimed.map_err(|source| {
                    if may_have_been_granted(&source) {
                        tracing::warn!(error = %error_chain(&source), "the claim may have been granted without its answer; the next create of this pod lists first");
                    } else {
                        self.lock().lost.keys.remove(&key);
                    }
                    SandboxProviderError::Claim { key: key.clone(), source: Box::new(source) }
                })?;
                let deadline = grant.deadline_time();
                let rec = ClaimRecord {
                    id: grant.id,
                    token: grant.token,
                    address: grant.owner_addr,
                    pod_uid: uid_of(pod),
                    claimed_at: Some(Timestamp::now()),
                    deadline,
                    owner: authority::controller_owner(pod),
                };
                (rec, true)
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
            if fresh {
                // The grant is in the table now: nothing of this key is lost.
                g.lost.keys.remove(&key);
            }
        }
        let recording = Instant::now();
        let committed = self.commit(&key).await;
        self.phases.observe(Phase::Record, recording.elapsed());
        if let Err(persist) = committed {
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
        self.changed();
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
            self.changed();
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

    #[tracing::instrument(name = "update_pod", skip_all, fields(pod = %PodKey::of(pod)))]
    pub(super) async fn update(&self, pod: &Pod) -> Result<(), SandboxProviderError> {
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
}

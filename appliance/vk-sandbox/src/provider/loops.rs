//! The background loops ([`SandboxProvider::spawn_loops`]): the start-up lost-claim scan
//! ([`SandboxProvider::scan_lost`], once), quarantine verification (until
//! every loaded row is vouched for or dropped), the lease watch, the owner recheck of pod-less
//! preserved claims with the release queue, and the audit-only orphan scan. Each pass is public
//! so tests (and a caller without the loops) can run one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use vnode::error_chain;
use vnode::kit::{self, uid_of, BackgroundLoops};
use vnode::PodKey;

use super::table::{listed_ids, OrphanClass, Recheck, SandboxProvider};
use crate::authority::{self, Verdict};
use crate::sandboxd::Deadline as _;
use crate::sandboxd::SandboxdError;
use crate::state::ClaimRecord;
use crate::status;

impl SandboxProvider {
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
            self.changed();
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
    pub(super) async fn drain_releases(&self) -> bool {
        let queued = self.lock().releasing.clone();
        let mut any = false;
        for rec in queued {
            match self.sandboxd.release(&rec.id, &rec.token).await {
                Ok(()) => {
                    self.lock().releasing.retain(|q| q.id != rec.id);
                    tracing::info!(claim = %rec.id, "released a queued sandbox");
                    self.changed();
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
        let mut loops = BackgroundLoops::default();
        let p = self.clone();
        loops.spawn(tracing::info_span!("lost_claim_scan"), async move {
            match p.scan_lost().await {
                Ok(rows) => tracing::info!(listed = rows.len(), "lost-claim scan done; clean creates list nothing from now on"),
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "lost-claim scan: sandboxd cannot be listed; the next create scans")
                }
            }
        });
        let p = self.clone();
        let mut tick = kit::interval(self.cfg.verify_interval);
        loops.spawn(tracing::info_span!("claim_verify"), async move {
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
        });
        let p = self.clone();
        loops.every(self.cfg.lease_interval, tracing::info_span!("lease_watch"), move || {
            let p = p.clone();
            async move { p.lease_check().await }
        });
        let p = self.clone();
        loops.every(self.cfg.recheck_base, tracing::info_span!("owner_recheck"), move || {
            let p = p.clone();
            async move { p.recheck_owners().await }
        });
        if !self.cfg.orphan_scan_interval.is_zero() {
            let p = self.clone();
            loops.every(self.cfg.orphan_scan_interval, tracing::info_span!("orphan_scan"), move || {
                let p = p.clone();
                async move { p.orphan_scan().await }
            });
        }
        loops
    }
}

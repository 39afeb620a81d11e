//! The per-claim calls of [`Node`]: claim, release, renew and the lookups.
//!
//! Guarantees: the claim path does one VM operation on a hit (pop the newest warm VM, resume its
//! vCPUs: warm VMs wait paused, mint an id and a token, journal, reply; the VM's normal CPU
//! weight and its guest clock, which stood still while it waited, are set on a task of its
//! own); a miss makes a VM now, as upstream does (a clone of the golden, a cold boot when there
//! is none; [`refill::on_demand`]), bounded by the node budget (429 when it has no room), the
//! wait counted in the claim latency; a claim is granted only after a journal write that
//! includes it (a failed write puts the VM back, paused); no lease runs past `claimed_at` +
//! `max_lifetime_secs`.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tracing::Instrument as _;
use vmm::jail::CpuWeight;
use vmm::{DriverError, Vm};

use super::{ClaimRequest, Grant, Node};
use crate::claims::{self, Claim, ClaimError, SandboxRow};
use crate::journal::ClaimRecord;
use crate::metrics::inc;
use crate::pool::{Net, Pool, PoolKey};
use crate::refill;

/// Where a claim's VM came from.
#[derive(Debug, Clone, Copy)]
enum Tier {
    /// The pool's newest warm VM.
    Warm,
    /// Made for the claim (the pool was empty).
    OnDemand,
}

impl Node {
    /// Grants a claim: ownership transfer of the newest warm VM (resumed), or of one made now
    /// on a miss. Its duration is observed in `sandboxd_claim_duration_seconds`, granted or
    /// refused.
    pub async fn claim(&self, req: ClaimRequest) -> Result<Grant, ClaimError> {
        let started = Instant::now();
        let r = self.claim_inner(req).await;
        self.metrics.claim_duration.observe(started.elapsed());
        match &r {
            Ok((_, Tier::Warm)) => inc(&self.metrics.claims_warm),
            Ok((_, Tier::OnDemand)) => inc(&self.metrics.claims_on_demand),
            Err(ClaimError::NoCapacity(_) | ClaimError::Full { .. }) => inc(&self.metrics.claims_no_capacity),
            Err(ClaimError::Draining) => inc(&self.metrics.claims_draining),
            Err(_) => inc(&self.metrics.claims_failed),
        }
        r.map(|(grant, _)| grant)
    }

    /// A VM for a claim on `pool`: the newest warm one, resumed; else one made now.
    async fn vm_for_claim(&self, pool: &Arc<Pool>) -> Result<(Vm, Tier), ClaimError> {
        while let Some(vm) = pool.take() {
            pool.kick();
            let t0 = Instant::now();
            // Made in the background: the normal CPU weight first, so that waking it is not
            // queued behind refill's work at the same low weight (measured under TCG with
            // refills running: a 26 ms resume otherwise).
            if let Err(e) = self.vms.driver.set_cpu_weight(&vm, CpuWeight::Normal).await {
                tracing::warn!(vm = %vm.id, error = %vmm::error_chain(&e), "the claimed VM's CPU weight was not raised");
            }
            match self.vms.driver.resume(&vm).await {
                Ok(()) => {
                    self.metrics.claim_resume.observe(t0.elapsed());
                    // Paused since it was made: the host's time.
                    refill::handed_out(Arc::clone(&self.vms.driver), vm.clone());
                    return Ok((vm, Tier::Warm));
                }
                Err(e) => {
                    // A warm VM that cannot run again is gone; the next one is tried.
                    tracing::warn!(vm = %vm.id, error = %vmm::error_chain(&e), "a warm VM did not resume; destroying it");
                    self.vms.destroy(&vm).await;
                }
            }
        }
        pool.kick();
        match refill::on_demand(&self.refill, pool).await {
            Ok(vm) => Ok((vm, Tier::OnDemand)),
            Err(refill::Miss::Refused(reason)) => Err(ClaimError::Full { key: pool.key.clone(), reason }),
            Err(refill::Miss::Failed(e)) => Err(ClaimError::Start(vmm::error_chain(&e))),
        }
    }

    /// The pool a claim for `key` is served from. A pool under the exact name wins; otherwise
    /// the name is resolved through the catalog (alias or short name) and a pool of the same
    /// lane and size whose template resolves to the same target serves it. An unknown name
    /// is returned as it came (the caller answers 404).
    pub(super) fn pool_key_for(&self, key: &PoolKey) -> Result<PoolKey, ClaimError> {
        if self.pool(key).is_some() {
            return Ok(key.clone());
        }
        let catalog = &self.refill.catalog;
        let target = match catalog.resolve(key.template()) {
            Ok((target, _)) => target,
            Err(e @ vmm::CatalogError::Ambiguous { .. }) => return Err(ClaimError::AmbiguousTemplate(e.to_string())),
            Err(_) => return Ok(key.clone()),
        };
        let same_target = |p: &PoolKey| {
            p.net() == key.net()
                && p.size() == key.size()
                && catalog.resolve(p.template()).is_ok_and(|(t, _)| t == target)
        };
        match self.pools().into_iter().find(|p| same_target(&p.key)) {
            Some(pool) => Ok(pool.key.clone()),
            None => Ok(PoolKey::new(target, key.net(), key.size())?),
        }
    }

    async fn claim_inner(&self, mut req: ClaimRequest) -> Result<(Grant, Tier), ClaimError> {
        req.key = self.pool_key_for(&req.key)?;
        if req.key.net() == Net::Egress && !self.egress() {
            return Err(ClaimError::Egress);
        }
        if self.draining() {
            return Err(ClaimError::Draining);
        }
        let catalog = &self.refill.catalog;
        let Some(pool) = self.pool(&req.key) else {
            return Err(match catalog.resolve(req.key.template()) {
                Ok(_) => ClaimError::NoCapacity(req.key),
                Err(_) => ClaimError::UnknownTemplate(req.key.template().to_string()),
            });
        };
        let (vm, tier) = self.vm_for_claim(&pool).await?;
        let now = claims::unix_ms(SystemTime::now());
        // The lease horizon caps the first lease too.
        let ttl_ms = u64::try_from(req.ttl.min(self.limits.max_lifetime).as_millis()).unwrap_or(u64::MAX);
        let rec = ClaimRecord {
            id: claims::mint_id(),
            token: claims::mint_token(),
            vm: vm.id.clone(),
            key: req.key.clone(),
            deadline_unix_ms: now.saturating_add(ttl_ms),
            claimed_at_unix_ms: now,
            claim_ref: req.claim_ref.filter(|r| !r.is_empty()),
            from_checkpoint: None,
            hibernate_snap: None,
            pending_snap: None,
            volumes: Vec::new(),
        };
        let span = tracing::info_span!("claim", claim = %rec.id, vm = %rec.vm, template = %req.key.template());
        let _enter = span.enter();
        let grant = self.grant_for(&rec);
        let id = rec.id.clone();
        let gen = self.store.lock().insert(Claim { rec, vm: Some(vm) });
        if let Err(e) = self.store.commit(gen) {
            tracing::error!(error = %vmm::error_chain(&e), "claim not granted: journal write failed");
            let back = self.store.lock().remove(&id);
            if let Some((Claim { vm: Some(vm), .. }, _)) = back {
                match self.vms.driver.pause(&vm).await {
                    Ok(()) => {
                        if let Err(e) = self.vms.driver.set_cpu_weight(&vm, CpuWeight::Background).await {
                            tracing::debug!(vm = %vm.id, error = %vmm::error_chain(&e), "a warm VM put back keeps the normal CPU weight");
                        }
                        pool.put_back(vm)
                    }
                    Err(_) => self.vms.destroy(&vm).await,
                }
            }
            return Err(ClaimError::Journal(e));
        }
        tracing::info!(?tier, "claimed");
        Ok((grant, tier))
    }

    /// The `200` body of a claim granted as `rec`.
    pub(crate) fn grant_for(&self, rec: &ClaimRecord) -> Grant {
        Grant {
            id: rec.id.clone(),
            token: rec.token.clone(),
            deadline: claims::rfc3339(rec.deadline_unix_ms),
            owner_addr: self.advertise_addr.clone(),
            template_digest: match self.refill.catalog.resolve(rec.key.template()) {
                Ok((_, t)) => Some(t.digest.clone()),
                Err(_) => self.promoted.record(rec.key.template()).map(|p| p.content_digest),
            }
            .filter(|d| !d.is_empty()),
            from_checkpoint: rec.from_checkpoint.clone(),
            volumes: rec.volumes.iter().map(|v| v.spec()).collect(),
        }
    }

    /// One claim by id.
    pub fn sandbox(&self, id: &str) -> Option<Claim> {
        self.store.lock().get(id).cloned()
    }

    /// Listing rows, optionally filtered by exact `claim_ref` (empty = all), sorted by id.
    pub fn list(&self, claim_ref: Option<&str>) -> Vec<SandboxRow> {
        let want = claim_ref.filter(|r| !r.is_empty());
        let mut rows: Vec<SandboxRow> = self
            .store
            .lock()
            .iter()
            .filter(|c| want.is_none() || c.rec.claim_ref.as_deref() == want)
            .map(Claim::row)
            .collect();
        rows.sort_by(|a, b| a.id.cmp(&b.id));
        rows
    }

    /// Number of live claims.
    pub fn claimed(&self) -> usize {
        self.store.lock().len()
    }

    /// Ends a claim and destroys its VM.
    pub async fn release(&self, id: &str) -> Result<(), ClaimError> {
        let removed = self.store.lock().remove(id);
        let Some((claim, gen)) = removed else {
            return Err(ClaimError::NotFound);
        };
        let span =
            tracing::info_span!("release", claim = %id, vm = %claim.rec.vm, template = %claim.rec.key.template());
        async {
            if let Err(e) = self.store.commit(gen) {
                // The VM goes anyway; a restart finds it gone and drops the stale row.
                tracing::warn!(error = %vmm::error_chain(&e), "journaling the release failed");
            }
            inc(&self.metrics.releases);
            self.unmount_all(&claim).await;
            self.vms.destroy_claim_vm(&claim).await;
            self.forget_transitions(id);
            tracing::info!("released");
        }
        .instrument(span)
        .await;
        Ok(())
    }

    /// Resets a lease to now + `ttl` (may shorten it); returns the new deadline. A deadline past
    /// the lease horizon (`claimed_at` + `max_lifetime_secs`) is refused, not clamped.
    pub fn renew(&self, id: &str, ttl: Duration) -> Result<String, ClaimError> {
        let now = claims::unix_ms(SystemTime::now());
        let deadline = now.saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let max_ms = u64::try_from(self.limits.max_lifetime.as_millis()).unwrap_or(u64::MAX);
        let gen = {
            let mut table = self.store.lock();
            let claimed_at = table.get(id).ok_or(ClaimError::NotFound)?.rec.claimed_at_unix_ms;
            let horizon = claimed_at.saturating_add(max_ms);
            if deadline > horizon {
                return Err(ClaimError::LeaseHorizon {
                    horizon: claims::rfc3339(horizon),
                    max_lifetime_secs: self.limits.max_lifetime.as_secs(),
                    remaining_secs: horizon.saturating_sub(now) / 1000,
                });
            }
            table.set_deadline(id, deadline).ok_or(ClaimError::NotFound)?
        };
        self.store.commit(gen).map_err(ClaimError::Journal)?;
        inc(&self.metrics.renews);
        tracing::info!(claim = %id, "renewed");
        Ok(claims::rfc3339(deadline))
    }

    /// The VM of a claim, attaching it first if a restart left it unattached; a hibernated
    /// sandbox has none (and is not woken: see [`Node::vm_waking`]).
    pub async fn vm_for(&self, claim: &Claim) -> Result<Vm, DriverError> {
        if let Some(vm) = &claim.vm {
            return Ok(vm.clone());
        }
        if claim.rec.hibernate_snap.is_some() {
            return Err(DriverError::Invalid(format!(
                "sandbox {} is hibernated: it has no VM until it wakes (POST …/wake, or a call into it)",
                claim.rec.id
            )));
        }
        let vm = self.vms.driver.attach(&claim.rec.vm).await?;
        self.store.lock().set_vm(&claim.rec.id, vm.clone());
        Ok(vm)
    }
}

//! The reaper: every `reap` period (≤ 5 s) it ends the claims whose lease ran out, then
//! compacts the claims journal when its log has grown (off the claim path).
//!
//! Guarantee: no lease outlives its deadline by more than one period (plus the destroy). An
//! expired claim leaves the table and is journaled before its VM is destroyed; a failed
//! journal write is logged and the VM goes anyway (a restart finds it gone and drops the row).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::claims;
use crate::metrics::inc;
use crate::store::ClaimStore;
use crate::vms::Vms;

/// Reaps and compacts every `period` until `cancel`.
pub async fn run(store: Arc<ClaimStore>, vms: Arc<Vms>, period: Duration, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        reap_once(&store, &vms).await;
        store.compact().await;
    }
}

/// Destroys every claim past its deadline; returns how many.
pub async fn reap_once(store: &ClaimStore, vms: &Vms) -> usize {
    let now = claims::unix_ms(SystemTime::now());
    let expired = store.lock().expired(now);
    let mut n = 0;
    for id in expired {
        let removed = store.lock().remove(&id);
        let Some((claim, gen)) = removed else { continue };
        let span = tracing::info_span!("reap", claim = %id, vm = %claim.rec.vm, template = %claim.rec.key.template());
        async {
            if let Err(e) = store.commit(gen) {
                tracing::warn!(error = %vmm::error_chain(&e), "journaling the reap failed");
            }
            vms.destroy_claim_vm(&claim).await;
            inc(&vms.metrics.reaped);
            tracing::info!("lease expired; sandbox destroyed");
        }
        .instrument(span)
        .await;
        n += 1;
    }
    n
}

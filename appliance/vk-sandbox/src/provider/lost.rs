//! Claims whose answer was lost: sandboxd journals a claim before it answers, so a crash (of
//! this process, or of the connection) between its grant and our record leaves a live claim
//! with `claim_ref` = the Pod key that no row knows. Such a claim was never handed to any Pod:
//! the next CreatePod of the key takes the newest back (its token read with the node token,
//! which sandboxd honours as root) and releases any others.
//!
//! Finding them costs a listing, which the claim path does only when a lost claim can exist
//! ([`LostClaims`]): until one full listing after start-up has been read (a previous process
//! may have died mid-claim), and for keys whose claim may have been granted without the grant
//! reaching the table (marked before the claim is sent, cleared by a definite answer). A clean
//! create lists nothing.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use vnode::error_chain;
use vnode::kit::uid_of;

use super::error::SandboxProviderError;
use super::table::SandboxProvider;
use crate::authority;
use crate::sandboxd::{claimed_at, Deadline as _, SandboxRow, SandboxdError};
use crate::state::ClaimRecord;

/// Where sandboxd may hold a claim for one of our keys that the table does not know.
#[derive(Debug, Default)]
pub(super) struct LostClaims {
    /// A full listing since start-up has been read into `keys`.
    pub scanned: bool,
    /// Keys that may have such a claim: found by the scan, or whose claim had no definite answer
    /// (including one still in flight).
    pub keys: BTreeSet<String>,
}

impl LostClaims {
    /// Whether a create of `key` must list before it claims.
    pub fn must_list(&self, key: &str) -> bool {
        !self.scanned || self.keys.contains(key)
    }
}

/// Whether a failed claim may nonetheless have been granted (the answer, not the request, was
/// lost): anything but a definite refusal.
pub(super) fn may_have_been_granted(e: &SandboxdError) -> bool {
    match e {
        SandboxdError::Url { .. }
        | SandboxdError::Trust(_)
        | SandboxdError::Query { .. }
        | SandboxdError::NoCapacity { .. } => false,
        SandboxdError::Status { status, .. } => *status >= 500,
        _ => true,
    }
}

impl SandboxProvider {
    /// Ids of every claim the table knows (rows and the release queue).
    fn known_ids(&self) -> BTreeSet<String> {
        let g = self.lock();
        g.claims.values().chain(g.releasing.iter()).map(|c| c.id.clone()).collect()
    }

    /// One full listing read into [`LostClaims`]: every key with a claim the table does not know
    /// is marked. Returns the listing. Start-up runs it once; a create runs it if that failed.
    pub async fn scan_lost(&self) -> Result<Vec<SandboxRow>, SandboxdError> {
        let rows = self.sandboxd.list(None).await?;
        let known = self.known_ids();
        let mut g = self.lock();
        for r in &rows {
            if let Some(key) = r.claim_ref.as_deref().filter(|k| !k.is_empty() && !known.contains(&r.id)) {
                if g.lost.keys.insert(key.to_owned()) {
                    tracing::info!(pod = %key, claim = %r.id, "sandboxd holds a claim for this pod that no row knows; its next create takes it back");
                }
            }
        }
        g.lost.scanned = true;
        Ok(rows)
    }

    /// Step 6a of CreatePod: the newest lost claim of `key`, taken back, with any others
    /// released. A failed listing fails the create rather than risk a duplicate VM.
    pub(super) async fn recover_lost(&self, key: &str, pod: &Pod) -> Result<Option<ClaimRecord>, SandboxProviderError> {
        let (must, scanned) = {
            let g = self.lock();
            (g.lost.must_list(key), g.lost.scanned)
        };
        if !must {
            return Ok(None);
        }
        let listed = if scanned { self.sandboxd.list(Some(key)).await } else { self.scan_lost().await };
        let rows = listed
            .map_err(|source| SandboxProviderError::LostUnlisted { key: key.to_owned(), source: Box::new(source) })?;
        let known = self.known_ids();
        let mut strays: Vec<SandboxRow> =
            rows.into_iter().filter(|r| r.claim_ref.as_deref() == Some(key) && !known.contains(&r.id)).collect();
        // Newest first (RFC 3339 UTC strings of one format sort by time).
        strays.sort_by(|a, b| b.claimed_at.cmp(&a.claimed_at));
        let mut taken: Option<ClaimRecord> = None;
        let mut left = false;
        for row in strays {
            let token = match self.sandboxd.get(&row.id).await {
                Ok(Some((_, Some(token)))) => token,
                Ok(Some((_, None))) => {
                    tracing::warn!(claim = %row.id, "a claim made for this pod was never recorded and its token cannot be read (no root token); leaving it to its lease");
                    left = true;
                    continue;
                }
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(claim = %row.id, error = %error_chain(&e), "reading a lost claim failed; leaving it to its lease");
                    left = true;
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
                left = true;
            } else {
                tracing::info!(claim = %row.id, "released a duplicate lost claim");
            }
        }
        if !left {
            // Clean (a taken-back claim is recorded by the caller before anything can list).
            self.lock().lost.keys.remove(key);
        }
        Ok(taken)
    }
}

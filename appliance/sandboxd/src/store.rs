//! The claim table and its journal, kept together: [`ClaimStore`].
//!
//! Every job that changes a claim (the claim path, release, renew, the reaper, the restart
//! reconcile) mutates the table under its lock, which returns a generation, then calls
//! [`ClaimStore::commit`] with it before answering or acting. The lock is never held across an
//! `.await` or a commit.
//!
//! Invariant: a claim is granted only after a commit that includes it returned `Ok`
//! (`crate::journal`).

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::claims::ClaimTable;
use crate::config::PoolConfig;
use crate::journal::{Journal, JournalError};

/// The claim table and the journal that makes it durable.
#[derive(Debug)]
pub struct ClaimStore {
    journal: Journal,
    table: Mutex<ClaimTable>,
}

impl ClaimStore {
    /// Opens the journal in `data_dir` (0700; its files 0600) and loads the claims into the
    /// table (a start-up compaction: see [`Journal::recover`]). A corrupt journal is an error:
    /// nothing is guessed.
    pub fn open(data_dir: &Path, sync_claims: bool) -> Result<ClaimStore, JournalError> {
        let journal = Journal::open(data_dir, sync_claims)?;
        let loaded = journal.recover()?;
        Ok(ClaimStore { journal, table: Mutex::new(ClaimTable::restore(loaded.seq, loaded.claims)) })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        self.journal.dir()
    }

    /// Locks the claim table. It is plain data updated in single statements; a poisoned lock is
    /// still usable.
    pub fn lock(&self) -> MutexGuard<'_, ClaimTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Journals the claim table up to generation `gen`. Without `sync_claims` this is one
    /// buffered `write` of a few hundred bytes, done inline; with it the `fdatasync` runs in
    /// `block_in_place` on a multi-threaded runtime so the worker's other tasks move on.
    pub fn commit(&self, gen: u64) -> Result<(), JournalError> {
        let run = || self.journal.commit_claims(gen, &self.table);
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if self.journal.sync() && multi_thread {
            tokio::task::block_in_place(run)
        } else {
            run()
        }
    }

    /// Compacts the claims log into `claims.json` when it has grown (off the claim path: a
    /// blocking task).
    pub async fn compact(self: &Arc<Self>) {
        let store = Arc::clone(self);
        match tokio::task::spawn_blocking(move || store.journal.compact_if_large(&store.table)).await {
            Ok(Ok(true)) => tracing::debug!("claims log compacted"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %vmm::error_chain(&e), "compacting the claims log failed; retrying"),
            Err(e) => tracing::warn!(error = %e, "the compaction task failed"),
        }
    }

    /// Loads `pools.json` (the persisted `PUT /v1/pools`), if present.
    pub fn load_pools(&self) -> Result<Option<Vec<PoolConfig>>, JournalError> {
        self.journal.load_pools()
    }

    /// Persists the pool list (atomically, fsynced).
    pub fn write_pools(&self, pools: &[PoolConfig]) -> Result<(), JournalError> {
        self.journal.write_pools(pools)
    }
}

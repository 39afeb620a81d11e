//! [`RecordStore`]: one durable record per owned VM, `<dir>/<id>.json`, generic over the
//! service's own metadata `M` (flattened into the same JSON object).
//!
//! Expected flow: [`RecordStore::claim`] (exclusive create, state `creating`: a second claim of
//! the id is [`RecordStoreError::InUse`]) → boot → [`RecordStore::complete`] (state `created`,
//! the current instance and the spec a later cold boot uses) → … → [`RecordStore::delete`].
//!
//! Guarantees: every write is atomic (`foundation::write_new` for a claim,
//! [`write_json_atomic`] after, as for `vm.json`), so a reader sees the old record or the new one; a
//! missing record reads as `None`, a corrupt one is an error (never skipped).

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::driver::{BootSpec, VmId};
use crate::record::{read_json, write_json_atomic, RecordError};

/// Whether a record's VM was ever completely created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// Claimed; its VM is being booted (or a crash came first).
    Creating,
    /// Its VM booted at least once.
    Created,
}

/// `<dir>/<id>.json`: the VM's id, the service's metadata `M` (its fields sit beside these in
/// the JSON), the state, the current hypervisor instance and what a cold boot boots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OwnedRecord<M> {
    /// The owner id (the prefix of its instances' ids).
    pub id: VmId,
    /// The service's own fields.
    #[serde(flatten)]
    pub meta: M,
    /// Whether its VM was ever completely created.
    pub state: RecordState,
    /// The current hypervisor instance.
    #[serde(default)]
    pub vmm_id: Option<VmId>,
    /// What a cold boot boots (the NIC included).
    #[serde(default)]
    pub spec: Option<BootSpec>,
    /// When it was claimed, seconds since the Unix epoch.
    pub created_at_epoch_secs: u64,
}

/// Failures of a [`RecordStore`].
#[derive(Debug, thiserror::Error)]
pub enum RecordStoreError {
    /// A record of the id exists already (a claim is exclusive).
    #[error("VM {id} has a record already")]
    InUse {
        /// The id.
        id: VmId,
    },
    /// No record of the id (to complete).
    #[error("VM {id} has no record")]
    Missing {
        /// The id.
        id: VmId,
    },
    /// Reading or writing a record (or its directory) failed, or a record is not valid JSON
    /// for its type.
    #[error(transparent)]
    Record(#[from] RecordError),
}

/// The records of one service's VMs in one directory.
#[derive(Debug)]
pub struct RecordStore<M> {
    dir: PathBuf,
    meta: PhantomData<fn() -> M>,
}

impl<M> Clone for RecordStore<M> {
    fn clone(&self) -> Self {
        RecordStore { dir: self.dir.clone(), meta: PhantomData }
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> RecordStoreError {
    let path = path.to_path_buf();
    move |source| RecordError::Io { what, path, source }.into()
}

impl<M: Serialize + DeserializeOwned> RecordStore<M> {
    /// The store in `dir`, created if missing.
    pub fn open(dir: PathBuf) -> Result<RecordStore<M>, RecordStoreError> {
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        Ok(RecordStore { dir, meta: PhantomData })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Creates the record of `id` (state `creating`), exclusively: if one exists, whoever made
    /// it, the error is [`RecordStoreError::InUse`] and it is left as it is.
    pub fn claim(&self, id: &VmId, meta: M) -> Result<OwnedRecord<M>, RecordStoreError> {
        let rec = OwnedRecord {
            id: id.clone(),
            meta,
            state: RecordState::Creating,
            vmm_id: None,
            spec: None,
            created_at_epoch_secs: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        };
        let path = self.path(id.as_str());
        let bytes =
            serde_json::to_vec_pretty(&rec).map_err(|source| RecordError::Parse { path: path.clone(), source })?;
        match foundation::write_new(&path, &bytes, foundation::PUBLIC_FILE) {
            Ok(()) => Ok(rec),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(RecordStoreError::InUse { id: id.clone() }),
            Err(e) => Err(io("placing", &path)(e)),
        }
    }

    /// Marks the record of `id` created, with its current instance `vmm_id` booted from `spec`.
    pub fn complete(&self, id: &VmId, vmm_id: &VmId, spec: BootSpec) -> Result<OwnedRecord<M>, RecordStoreError> {
        let mut rec = self.load(id.as_str())?.ok_or_else(|| RecordStoreError::Missing { id: id.clone() })?;
        rec.state = RecordState::Created;
        rec.vmm_id = Some(vmm_id.clone());
        rec.spec = Some(spec);
        write_json_atomic(&self.path(id.as_str()), &rec)?;
        Ok(rec)
    }

    /// The record of `id`, if there is one.
    pub fn load(&self, id: &str) -> Result<Option<OwnedRecord<M>>, RecordStoreError> {
        match read_json(&self.path(id)) {
            Ok(rec) => Ok(Some(rec)),
            Err(RecordError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Every record (`<dir>/*.json`; a temporary file of an interrupted write is no record).
    pub fn list(&self) -> Result<Vec<OwnedRecord<M>>, RecordStoreError> {
        let rd = std::fs::read_dir(&self.dir).map_err(io("listing", &self.dir))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(io("listing", &self.dir))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else { continue };
            if let Some(r) = self.load(id)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Deletes the record of `id` (none is fine).
    pub fn delete(&self, id: &str) -> Result<(), RecordStoreError> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("deleting", &path)(e)),
        }
    }
}

//! `<root>/refs.json`: `{"refs": {"repo:tag": "sha256:…"}}`, replaced atomically (temp file,
//! fsync, rename, fsync of the directory). Readers need no lock; writers hold `.lock`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ImageError;
use crate::reference::{Digest, Reference};

/// The reference table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Refs {
    /// Name → manifest digest.
    #[serde(default)]
    pub refs: BTreeMap<Reference, Digest>,
}

impl Refs {
    /// Loads the table; a missing file is an empty table.
    pub(crate) fn load(path: &Path) -> Result<Refs, ImageError> {
        match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|source| ImageError::Refs { path: path.to_path_buf(), source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Refs::default()),
            Err(e) => Err(ImageError::io("reading", path)(e)),
        }
    }

    /// Replaces the file atomically.
    pub(crate) fn store(&self, path: &Path) -> Result<(), ImageError> {
        // A map of validated strings always serialises.
        let bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        // tempfile's files were born 0600: keep that.
        foundation::write_atomic(path, &bytes, foundation::SECRET_FILE).map_err(ImageError::io("replacing", path))
    }
}

//! [`ImageError`]: every way a store operation fails, with the path, reference or digest it
//! concerns.

use std::path::PathBuf;

use crate::reference::{BadRef, Digest};

/// Errors of the image library.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No image or snapshot by that reference or digest.
    #[error("{reference}: not found in the image store")]
    NotFound {
        /// The reference (or digest) asked for.
        reference: String,
    },
    /// A string is not a valid `repo[:tag]` reference or `sha256:<hex>` digest.
    #[error("invalid reference {reference:?}: {reason}")]
    BadRef {
        /// The string.
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A blob's content does not hash to its name.
    #[error("blob {digest} is corrupt: its content hashes to {actual}")]
    Corrupt {
        /// The blob's name.
        digest: Digest,
        /// What its content hashes to (or what was wrong when it could not be read as expected).
        actual: String,
    },
    /// A manifest names a blob the store does not hold.
    #[error("blob {digest} is missing (referenced by {by})")]
    MissingBlob {
        /// The missing blob.
        digest: Digest,
        /// The manifest (or reference) that needs it.
        by: String,
    },
    /// A blob is not a valid manifest.
    #[error("blob {digest} is not a valid manifest")]
    Manifest {
        /// The blob.
        digest: Digest,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The reference names the other kind of entry (an image where a snapshot was expected, …).
    #[error("{reference} is {}, not {}", found.with_article(), expected.with_article())]
    WrongKind {
        /// The reference.
        reference: String,
        /// What the caller wanted.
        expected: crate::Kind,
        /// What it is.
        found: crate::Kind,
    },
    /// The input cannot be stored (a snapshot without a directory, an overlay without a base, …).
    #[error("invalid input: {0}")]
    Invalid(String),
    /// A helper program (`qemu-img`) failed.
    #[error("running {program} failed: {detail}")]
    Tool {
        /// The program.
        program: String,
        /// Exit status and stderr excerpt, or the spawn error.
        detail: String,
    },
    /// A filesystem operation failed.
    #[error("{what} {}", path.display())]
    Io {
        /// The operation.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The live VMs under a `vmm` state directory could not be listed (their use of the
    /// store is unknown, so nothing may be collected).
    #[error("listing the VMs under {}", dir.display())]
    VmListing {
        /// The directory (`<state>/vms`).
        dir: PathBuf,
        /// The cause.
        #[source]
        source: vmm::DriverError,
    },
    /// `refs.json` is not valid JSON.
    #[error("parsing {}", path.display())]
    Refs {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

impl ImageError {
    /// Shorthand for [`ImageError::Io`].
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ImageError {
        let path = path.into();
        move |source| ImageError::Io { what, path, source }
    }

    /// Shorthand for [`ImageError::NotFound`].
    pub(crate) fn not_found(reference: impl ToString) -> ImageError {
        ImageError::NotFound { reference: reference.to_string() }
    }
}

impl From<BadRef> for ImageError {
    fn from(e: BadRef) -> Self {
        ImageError::BadRef { reference: e.reference, reason: e.reason }
    }
}

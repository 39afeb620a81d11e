//! [`SandboxProviderError`]: why a provider call failed; each variant names the Pod and the claim.

use crate::annotations::AnnotationError;
use crate::sandboxd::SandboxdError;
use crate::state::StateError;

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

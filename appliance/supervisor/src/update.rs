//! The seam between the supervisor and A/B updates: the API's update routes and the health
//! gate call an [`UpdateControl`]. The real implementation lives in `appliance/update`;
//! [`NoUpdates`] answers when the box does not run from an A/B image (a dev run on a plain
//! host), with a typed `503`.
//!
//! # Contract
//! * [`UpdateControl::status`] is cheap and never fails: it describes the slot and any apply in
//!   progress (`GET /v1/update` is polled while an apply runs).
//! * [`UpdateControl::apply`] consumes the whole bundle stream and returns when the other slot
//!   is written, verified and armed (or refused). When [`UpdateOutcome::reboot`] is true the
//!   supervisor answers the client, stops the services and reboots.
//! * [`UpdateControl::rollback`] arms the other slot; the supervisor reboots when asked to.
//! * [`UpdateControl::on_health`] is called every few seconds with the latest [`Health`]; it
//!   commits a trial boot when healthy, and returns [`GateVerdict::Reboot`] when the trial
//!   failed (deadline passed): the supervisor then stops the services and reboots, and the
//!   boot loader falls back to the old slot.

use std::pin::Pin;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncRead;

use crate::health::Health;

/// The bundle as it streams in from `POST /v1/update/apply`.
pub type BundleStream = Pin<Box<dyn AsyncRead + Send>>;

/// The message of [`NoUpdates`].
pub const UNAVAILABLE: &str = "updates unavailable: not running from an A/B image";

/// What the update side is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpdateState {
    /// Not an A/B image: no updates.
    Unavailable,
    /// The running slot is committed; nothing pending.
    Confirmed,
    /// A trial boot: the health gate decides (commit or revert).
    Trial,
    /// A bundle is being written.
    Applying,
    /// The other slot is written and armed; it boots next.
    Armed,
    /// The last apply or trial failed (see `message`).
    Failed,
}

impl UpdateState {
    /// Every state (metrics export one gauge per state).
    pub const ALL: [UpdateState; 6] = [
        UpdateState::Unavailable,
        UpdateState::Confirmed,
        UpdateState::Trial,
        UpdateState::Applying,
        UpdateState::Armed,
        UpdateState::Failed,
    ];

    /// The serialized name.
    pub fn as_str(self) -> &'static str {
        match self {
            UpdateState::Unavailable => "unavailable",
            UpdateState::Confirmed => "confirmed",
            UpdateState::Trial => "trial",
            UpdateState::Applying => "applying",
            UpdateState::Armed => "armed",
            UpdateState::Failed => "failed",
        }
    }
}

/// Progress of an apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// `verifying`, `writing root`, `writing kernel`, …
    pub phase: String,
    /// Bytes done.
    pub done: u64,
    /// Bytes in all, when known.
    pub total: Option<u64>,
}

/// `GET /v1/update`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateStatus {
    /// The state.
    pub state: UpdateState,
    /// The running slot (`a` / `b`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// The running version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The running generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// The running image's `security_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_version: Option<u64>,
    /// The security floor: the highest `security_version` this box committed; bundles below it
    /// are refused (no downgrades).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_floor: Option<u64>,
    /// Apply progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// A human sentence (why unavailable, why failed, trial deadline, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Implementation details (other slot, last attempt, gate state); free-form JSON.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub detail: serde_json::Value,
}

impl UpdateStatus {
    /// The status of a box without updates.
    pub fn unavailable(message: &str) -> Self {
        UpdateStatus {
            state: UpdateState::Unavailable,
            slot: None,
            version: None,
            generation: None,
            security_version: None,
            security_floor: None,
            progress: None,
            message: Some(message.to_string()),
            detail: serde_json::Value::Null,
        }
    }
}

/// The answer to apply and rollback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateOutcome {
    /// What happened, for people.
    pub message: String,
    /// The supervisor reboots after answering.
    pub reboot: bool,
    /// The status afterwards.
    pub status: UpdateStatus,
}

/// What the health gate wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateVerdict {
    /// Nothing to do (not in a trial, committed, or still waiting).
    Continue,
    /// The trial failed: stop the services and reboot (the old slot boots).
    Reboot {
        /// Why (logged and shown).
        reason: String,
    },
}

/// Why an update operation failed. Each variant maps to one HTTP status in the API.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// Updates are not possible on this box (`503`).
    #[error("{0}")]
    Unavailable(String),
    /// The bundle is unsigned, tampered, for another board, or malformed (`422`).
    #[error("bundle refused: {0}")]
    BadBundle(String),
    /// The bundle's signed `security_version` is below the box's security floor (`422`).
    #[error(
        "bundle refused: its security_version {bundle} is lower than this box's security floor {floor} \
         (no downgrades); install a bundle with security_version {floor} or higher"
    )]
    Downgrade {
        /// The bundle's `security_version`.
        bundle: u64,
        /// The box's floor.
        floor: u64,
    },
    /// The operation is not allowed now: running slot unconfirmed, nothing to roll back to
    /// (`409`).
    #[error("{0}")]
    Conflict(String),
    /// Another apply is running (`409`).
    #[error("an update is already being applied")]
    Busy,
    /// Anything else (`500`).
    #[error("{message}")]
    Internal {
        /// What failed.
        message: String,
        /// The cause.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

/// What the supervisor needs from the update side.
#[async_trait::async_trait]
pub trait UpdateControl: Send + Sync + 'static {
    /// The current state (cheap; polled).
    async fn status(&self) -> UpdateStatus;
    /// Writes, verifies and arms a streamed bundle.
    async fn apply(&self, bundle: BundleStream) -> Result<UpdateOutcome, UpdateError>;
    /// Arms the other slot.
    async fn rollback(&self) -> Result<UpdateOutcome, UpdateError>;
    /// The health gate: called with each new health snapshot.
    async fn on_health(&self, health: &Health) -> GateVerdict;
    /// The `[update]` settings (deadline, offline rule), given once the configuration is loaded.
    fn configure(&self, _settings: &crate::config::UpdateConfig) {}
}

/// No A/B image: every operation answers [`UNAVAILABLE`].
#[derive(Debug, Clone, Default)]
pub struct NoUpdates;

#[async_trait::async_trait]
impl UpdateControl for NoUpdates {
    async fn status(&self) -> UpdateStatus {
        UpdateStatus::unavailable(UNAVAILABLE)
    }

    async fn apply(&self, _bundle: BundleStream) -> Result<UpdateOutcome, UpdateError> {
        Err(UpdateError::Unavailable(UNAVAILABLE.into()))
    }

    async fn rollback(&self) -> Result<UpdateOutcome, UpdateError> {
        Err(UpdateError::Unavailable(UNAVAILABLE.into()))
    }

    async fn on_health(&self, _health: &Health) -> GateVerdict {
        GateVerdict::Continue
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_updates_answers_unavailable() {
        let u = NoUpdates;
        let s = u.status().await;
        assert_eq!(s.state, UpdateState::Unavailable);
        assert_eq!(s.message.as_deref(), Some(UNAVAILABLE));
        let e = u.apply(Box::pin(tokio::io::empty())).await.unwrap_err();
        assert!(matches!(e, UpdateError::Unavailable(ref m) if m == UNAVAILABLE), "{e:?}");
        assert!(matches!(u.rollback().await, Err(UpdateError::Unavailable(_))));
        assert_eq!(u.on_health(&Health::default()).await, GateVerdict::Continue);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json, serde_json::json!({"state": "unavailable", "message": UNAVAILABLE}));
        let back: UpdateStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, s);
    }
}

//! The A/B update side of a box booted from a slot: [`UpdateControl`] over the one updater
//! (`appliance/update`). It maps the updater's status and errors onto the API's, and turns each
//! health snapshot into a gate decision (commit, wait, or mark bad and reboot) during a trial.
//!
//! Test hook: `chrysalis.fault=never-healthy` on the kernel command line makes the gate see an
//! unready supervisor forever — how the end-to-end suite builds "a bundle whose supervisor never
//! becomes healthy" (the bundle's boot entry carries it). It changes nothing else.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use update::{Decision, GateInput, GateOutcome, HealthSnapshot, OfflinePolicy, Updater, UpdaterError};

use crate::config::{OfflinePolicy as ConfiguredOffline, UpdateConfig};
use crate::health::Health;
use crate::update::{
    BundleStream, GateVerdict, Progress, UpdateControl, UpdateError, UpdateOutcome, UpdateState, UpdateStatus,
};

/// The kernel argument of the test hook.
pub const FAULT_NEVER_HEALTHY: &str = "chrysalis.fault=never-healthy";

/// [`UpdateControl`] for a box booted from an A/B slot.
pub struct AbUpdates {
    updater: Updater,
    gate: Mutex<(Duration, OfflinePolicy)>,
    never_healthy: bool,
}

impl AbUpdates {
    /// Over `updater`; `cmdline` is the running kernel's command line (for the test hook).
    pub fn new(updater: Updater, cmdline: &str) -> AbUpdates {
        let never_healthy = cmdline.split_whitespace().any(|a| a == FAULT_NEVER_HEALTHY);
        if never_healthy {
            tracing::warn!("{FAULT_NEVER_HEALTHY}: the health gate will never see this boot healthy (test hook)");
        }
        let defaults = UpdateConfig::default();
        AbUpdates {
            updater,
            gate: Mutex::new((Duration::from_secs(defaults.health_deadline_secs), OfflinePolicy::CommitLocal)),
            never_healthy,
        }
    }

    /// The appliance's update side when this kernel booted from a slot (`chrysalis.slot=` on
    /// `/proc/cmdline`), with the board from `image.json`; `None` on any other host.
    pub fn for_appliance(image_json: &Path) -> Option<AbUpdates> {
        let cmdline = std::fs::read_to_string("/proc/cmdline").ok()?;
        if !cmdline.split_whitespace().any(|a| a.starts_with("chrysalis.slot=")) {
            return None;
        }
        match update::UpdaterConfig::compatible_from_image_json(image_json) {
            Ok(compatible) => {
                Some(AbUpdates::new(Updater::open(update::UpdaterConfig::appliance(compatible)), &cmdline))
            }
            Err(e) => {
                tracing::error!(error = %update::chain(&e), "booted from a slot but the image description is unreadable: updates disabled");
                None
            }
        }
    }

    fn settings(&self) -> (Duration, OfflinePolicy) {
        // A poisoned lock still holds a valid pair.
        *self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gate's view of a supervisor health snapshot.
    fn snapshot(&self, h: &Health) -> HealthSnapshot {
        HealthSnapshot {
            supervisor_ready: h.ready && !self.never_healthy,
            nodes: h
                .nodes
                .iter()
                .map(|n| update::NodeHealth { name: n.name.clone(), ready: n.ready, lease_fresh: n.lease_fresh })
                .collect(),
            pools: if h.pools_error.is_some() {
                // Unreadable pools are not at target.
                vec![update::PoolHealth { name: "sandboxd".into(), warm: 0, target: 1 }]
            } else {
                h.pools
                    .iter()
                    .map(|p| update::PoolHealth {
                        name: format!("{}/{}/{}", p.template, p.size, p.net),
                        warm: u32::try_from(p.warm).unwrap_or(u32::MAX),
                        target: u32::try_from(p.target).unwrap_or(u32::MAX),
                    })
                    .collect()
            },
            api_reachable: h.api_reachable.unwrap_or(true),
        }
    }
}

fn internal(e: UpdaterError) -> UpdateError {
    UpdateError::Internal { message: update::chain(&e), source: Some(Box::new(e)) }
}

/// The API's error for an updater error: refusals are the caller's (409 / 422), the rest 500.
fn api_error(e: UpdaterError) -> UpdateError {
    match e.kind() {
        "busy" => UpdateError::Busy,
        "unconfirmed"
        | "no-own-entry"
        | "already-committed"
        | "nothing-to-roll-back-to"
        | "other-not-good"
        | "other-kernel-missing" => UpdateError::Conflict(update::chain(&e)),
        _ if e.is_refusal() => UpdateError::BadBundle(update::chain(&e)),
        _ => internal(e),
    }
}

/// The API's status for the updater's.
fn api_status(s: &update::Status) -> UpdateStatus {
    use update::Phase;
    let p = &s.progress;
    let applying = matches!(p.phase, Phase::Verifying | Phase::Kernel | Phase::Root | Phase::ReadBack | Phase::Arming);
    let other_armed = s.other.as_ref().is_some_and(|o| o.state == update::state::SlotState::Armed);
    let state = if applying {
        UpdateState::Applying
    } else if s.trial_in_progress {
        UpdateState::Trial
    } else if other_armed {
        UpdateState::Armed
    } else if p.error.is_some() {
        UpdateState::Failed
    } else {
        UpdateState::Confirmed
    };
    let phase = serde_json::to_value(p.phase).ok().and_then(|v| v.as_str().map(str::to_string));
    let message = match state {
        UpdateState::Trial => Some("trial boot: committed once healthy, reverted at the health deadline".to_string()),
        UpdateState::Armed => Some("the other slot is armed: it is tried at the next boot".to_string()),
        UpdateState::Failed => p.error.clone(),
        _ => s.last_attempt.as_ref().and_then(|a| serde_json::to_value(a).ok()).map(|a| format!("last attempt: {a}")),
    };
    UpdateStatus {
        state,
        slot: Some(s.slot.to_string()),
        version: s.version.clone(),
        generation: s.generation,
        progress: (p.phase != Phase::Idle).then(|| Progress {
            phase: phase.unwrap_or_else(|| format!("{:?}", p.phase)),
            done: p.bytes_done,
            total: (p.bytes_total > 0).then_some(p.bytes_total),
        }),
        message,
        detail: serde_json::to_value(s).unwrap_or(serde_json::Value::Null),
    }
}

#[async_trait::async_trait]
impl UpdateControl for AbUpdates {
    async fn status(&self) -> UpdateStatus {
        match self.updater.status().await {
            Ok(s) => api_status(&s),
            Err(e) => UpdateStatus {
                state: UpdateState::Failed,
                slot: None,
                version: None,
                generation: None,
                progress: None,
                message: Some(format!("reading the update state: {}", update::chain(&e))),
                detail: serde_json::Value::Null,
            },
        }
    }

    async fn apply(&self, bundle: BundleStream) -> Result<UpdateOutcome, UpdateError> {
        let report = self.updater.apply(bundle).await.map_err(api_error)?;
        let status = self.status().await;
        Ok(UpdateOutcome {
            message: format!(
                "slot {} written, verified and armed (version {}, generation {}): the next boot tries it",
                report.slot, report.version, report.generation
            ),
            reboot: false,
            status,
        })
    }

    async fn rollback(&self) -> Result<UpdateOutcome, UpdateError> {
        let r = self.updater.rollback().await.map_err(api_error)?;
        let status = self.status().await;
        Ok(UpdateOutcome {
            message: format!("slot {} (generation {}) boots next: reboot to roll back", r.slot, r.generation),
            reboot: false,
            status,
        })
    }

    async fn on_health(&self, health: &Health) -> GateVerdict {
        // Only a trial boot has a gate.
        match self.updater.status().await {
            Ok(s) if s.trial_in_progress => {}
            Ok(_) => return GateVerdict::Continue,
            Err(e) => {
                tracing::warn!(error = %update::chain(&e), "update gate: cannot read the slot state");
                return GateVerdict::Continue;
            }
        }
        let (deadline, offline) = self.settings();
        let elapsed = match update::since_boot() {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "update gate: no boot time; waiting");
                return GateVerdict::Continue;
            }
        };
        let decision = update::decide(&GateInput { elapsed, deadline, health: self.snapshot(health), offline });
        if decision == Decision::Wait {
            return GateVerdict::Continue;
        }
        match self.updater.act(&decision).await {
            Ok(GateOutcome::RebootNeeded { reason, .. }) => {
                tracing::error!(reason, "update gate: the trial failed; rebooting into the previous slot");
                GateVerdict::Reboot { reason }
            }
            Ok(GateOutcome::Committed { entry }) => {
                tracing::info!(entry, ?decision, "update gate: the trial is committed");
                GateVerdict::Continue
            }
            Ok(_) => GateVerdict::Continue,
            Err(e) => {
                tracing::error!(error = %update::chain(&e), "update gate: acting on {decision:?} failed; retrying");
                GateVerdict::Continue
            }
        }
    }

    fn configure(&self, settings: &UpdateConfig) {
        let offline = match settings.offline {
            ConfiguredOffline::CommitLocal => OfflinePolicy::CommitLocal,
            ConfiguredOffline::Wait => OfflinePolicy::Wait,
        };
        *self.gate.lock().unwrap_or_else(|p| p.into_inner()) =
            (Duration::from_secs(settings.health_deadline_secs), offline);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn the_fault_hook_only_hides_readiness() {
        let u = AbUpdates::new(
            Updater::open(update::UpdaterConfig::appliance("chrysalis-qemu-x86_64")),
            "root=/dev/dm-0 chrysalis.slot=b chrysalis.fault=never-healthy",
        );
        let h = Health { ready: true, api_reachable: Some(true), ..Health::default() };
        let s = u.snapshot(&h);
        assert!(!s.supervisor_ready && s.api_reachable);
        let plain = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance("x")), "chrysalis.slot=b");
        assert!(plain.snapshot(&h).supervisor_ready);
    }

    #[test]
    fn unreadable_pools_are_not_at_target() {
        let u = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance("x")), "");
        let h = Health { ready: true, pools_error: Some("connection refused".into()), ..Health::default() };
        let s = u.snapshot(&h);
        assert!(s.pools.iter().any(|p| p.warm < p.target));
    }

    #[test]
    fn a_refused_bundle_reads_failed_on_the_same_committed_slot() {
        let mut s = update::Status {
            slot: update::Slot::A,
            version: Some("1".into()),
            generation: Some(1),
            confirmed: true,
            trial_in_progress: false,
            entry: Some("chrysalis-a.conf".into()),
            other: None,
            boot_order: vec!["chrysalis-a.conf".into()],
            progress: update::Progress::default(),
            last_attempt: None,
        };
        assert_eq!(api_status(&s).state, UpdateState::Confirmed);
        s.progress.phase = update::Phase::Failed;
        s.progress.error = Some("root.img does not match the signed manifest".into());
        let failed = api_status(&s);
        assert_eq!(failed.state, UpdateState::Failed);
        assert_eq!(failed.slot.as_deref(), Some("a"));
        assert!(failed.message.is_some_and(|m| m.contains("signed manifest")));
        s.progress.phase = update::Phase::Root;
        assert_eq!(api_status(&s).state, UpdateState::Applying, "a new apply is allowed after a refusal");
    }

    #[test]
    fn configure_sets_the_deadline_and_offline_rule() {
        let u = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance("x")), "");
        u.configure(&UpdateConfig { health_deadline_secs: 42, offline: ConfiguredOffline::Wait });
        assert_eq!(u.settings(), (Duration::from_secs(42), OfflinePolicy::Wait));
    }
}

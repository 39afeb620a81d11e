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
    /// `/proc/cmdline`), with the board and `security_version` from `image.json`; `None` on any
    /// other host. Reconciles the security floor first (a first boot of a committed slot
    /// records its level).
    pub fn for_appliance(image_json: &Path) -> Option<AbUpdates> {
        let cmdline = std::fs::read_to_string("/proc/cmdline").ok()?;
        if !cmdline.split_whitespace().any(|a| a.starts_with("chrysalis.slot=")) {
            return None;
        }
        match update::ImageInfo::load(image_json) {
            Ok(image) => {
                let ab = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance(image)), &cmdline);
                ab.reconcile_floor();
                Some(ab)
            }
            Err(e) => {
                tracing::error!(error = %foundation::error_chain(&e), "booted from a slot but the image description is unreadable: updates disabled");
                None
            }
        }
    }

    /// Reconciles the security floor with the running slot (logged; an unknown floor only
    /// means every apply is refused until it is known).
    pub fn reconcile_floor(&self) {
        match self.updater.reconcile_floor_blocking() {
            Ok(floor) => tracing::info!(
                floor,
                security_version = self.updater.config().security_version,
                "security floor: bundles below it are refused"
            ),
            Err(e) => tracing::error!(error = %foundation::error_chain(&e), "security floor: reconciling failed"),
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
    UpdateError::Internal { message: foundation::error_chain(&e), source: Some(Box::new(e)) }
}

/// The API's error for an updater error: refusals are the caller's (409 / 422), the rest 500.
fn api_error(e: UpdaterError) -> UpdateError {
    use update::apply::ApplyError;
    use update::bundle::BundleError;
    if let UpdaterError::Apply(ApplyError::Bundle(BundleError::Downgrade { bundle, floor })) = e {
        return UpdateError::Downgrade { bundle, floor };
    }
    match e.kind() {
        "busy" => UpdateError::Busy,
        "unconfirmed"
        | "no-own-entry"
        | "already-committed"
        | "nothing-to-roll-back-to"
        | "other-not-good"
        | "other-kernel-missing"
        | "below-security-floor" => UpdateError::Conflict(foundation::error_chain(&e)),
        _ if e.is_refusal() => UpdateError::BadBundle(foundation::error_chain(&e)),
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
        security_version: Some(s.security_version),
        security_floor: s.security_floor,
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
                security_version: None,
                security_floor: None,
                progress: None,
                message: Some(format!("reading the update state: {}", foundation::error_chain(&e))),
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
                tracing::warn!(error = %foundation::error_chain(&e), "update gate: cannot read the slot state");
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
                tracing::error!(error = %foundation::error_chain(&e), "update gate: acting on {decision:?} failed; retrying");
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

    fn image(compatible: &str) -> update::ImageInfo {
        update::ImageInfo { compatible: compatible.into(), security_version: 1 }
    }

    #[test]
    fn the_fault_hook_only_hides_readiness() {
        let u = AbUpdates::new(
            Updater::open(update::UpdaterConfig::appliance(image("chrysalis-qemu-x86_64"))),
            "root=/dev/dm-0 chrysalis.slot=b chrysalis.fault=never-healthy",
        );
        let h = Health { ready: true, api_reachable: Some(true), ..Health::default() };
        let s = u.snapshot(&h);
        assert!(!s.supervisor_ready && s.api_reachable);
        let plain = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance(image("x"))), "chrysalis.slot=b");
        assert!(plain.snapshot(&h).supervisor_ready);
    }

    #[test]
    fn unreadable_pools_are_not_at_target() {
        let u = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance(image("x"))), "");
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
            security_version: 2,
            security_floor: Some(2),
            progress: update::Progress::default(),
            last_attempt: None,
        };
        assert_eq!(api_status(&s).state, UpdateState::Confirmed);
        assert_eq!((api_status(&s).security_version, api_status(&s).security_floor), (Some(2), Some(2)));
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
        let u = AbUpdates::new(Updater::open(update::UpdaterConfig::appliance(image("x"))), "");
        u.configure(&UpdateConfig { health_deadline_secs: 42, offline: ConfiguredOffline::Wait });
        assert_eq!(u.settings(), (Duration::from_secs(42), OfflinePolicy::Wait));
    }

    #[test]
    fn a_downgrade_is_its_own_api_error_naming_both_numbers() {
        use update::apply::ApplyError;
        use update::bundle::BundleError;
        let e = api_error(UpdaterError::Apply(ApplyError::Bundle(BundleError::Downgrade { bundle: 1, floor: 2 })));
        assert!(matches!(e, UpdateError::Downgrade { bundle: 1, floor: 2 }), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("security_version 1") && text.contains("floor 2"), "{text}");
        let below =
            update::state::StateError::BelowFloor { slot: update::Slot::A, security_version: Some(1), floor: 2 };
        assert!(matches!(api_error(UpdaterError::State(below)), UpdateError::Conflict(_)));
    }

    /// A box on files (ESP directory, slot files, by-partuuid links) running committed slot A
    /// at security_version 2, and a signed bundle at `security_version`.
    struct FakeBox {
        dir: tempfile::TempDir,
        ab: AbUpdates,
        key: update::keys::SigningKey,
    }

    impl FakeBox {
        const UUID_A: &'static str = "aaaaaaaa-1111-4111-8111-000000000001";
        const UUID_B: &'static str = "bbbbbbbb-2222-4222-8222-000000000002";

        fn new() -> FakeBox {
            use update::entries::{BootEntry, EntryName, Esp};
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path();
            for sub in ["esp/chrysalis/a", "state", "keys", "by-partuuid"] {
                std::fs::create_dir_all(root.join(sub)).unwrap();
            }
            let key = update::keys::SigningKey::from_bytes(&[5u8; 32]);
            update::keys::write_public_key(&root.join("keys/dev.pub"), &key.verifying_key()).unwrap();
            for (slot, uuid) in [("a", Self::UUID_A), ("b", Self::UUID_B)] {
                std::fs::write(root.join(format!("root-{slot}")), vec![0xEEu8; 64 * 1024]).unwrap();
                std::os::unix::fs::symlink(root.join(format!("root-{slot}")), root.join("by-partuuid").join(uuid))
                    .unwrap();
            }
            let options =
                "chrysalis.slot=a chrysalis.version=0.1.0 chrysalis.generation=1 chrysalis.security_version=2";
            let esp = Esp::new(root.join("esp"));
            esp.write(&EntryName::plain(update::Slot::A), &BootEntry::for_slot(update::Slot::A, "0.1.0", 1, options))
                .unwrap();
            std::fs::write(esp.kernel_path(update::Slot::A), b"kernel").unwrap();
            let config = update::UpdaterConfig {
                esp: root.join("esp"),
                state_dir: root.join("state"),
                trusted_keys: root.join("keys"),
                slots: update::slots::SlotsConfig {
                    a: root.join("root-a"),
                    b: root.join("root-b"),
                    partuuids: update::slots::PartUuidSource::ByPartUuidDir(root.join("by-partuuid")),
                },
                cmdline: update::cmdline::CmdlineSource::Literal(options.into()),
                compatible: "chrysalis-qemu-x86_64".into(),
                security_version: 2,
            };
            let ab = AbUpdates::new(Updater::open(config), options);
            ab.reconcile_floor();
            FakeBox { dir, ab, key }
        }

        fn bundle(&self, security_version: u64) -> BundleStream {
            let work = self.dir.path().join(format!("bundle-{security_version}"));
            std::fs::create_dir_all(&work).unwrap();
            std::fs::write(work.join("root.img"), vec![security_version as u8; 3 * 4096]).unwrap();
            std::fs::write(work.join("vmlinuz"), b"kernel").unwrap();
            let fields = update::bundle::ManifestFields {
                compatible: "chrysalis-qemu-x86_64".into(),
                version: format!("0.{security_version}.0"),
                build_id: "b".into(),
                security_version,
                verity: update::manifest::Verity {
                    root_hash: "ab".repeat(32),
                    salt: String::new(),
                    data_blocks: 2,
                    hash_offset: 2 * 4096,
                },
                cmdline: String::new(),
            };
            let out = work.join("x.chrysalis-bundle");
            update::bundle::create(&work.join("root.img"), &work.join("vmlinuz"), &fields, &self.key, &out).unwrap();
            Box::pin(std::io::Cursor::new(std::fs::read(out).unwrap()))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lower_security_version_is_refused_and_status_says_why() {
        let fake = FakeBox::new();
        let before = fake.ab.status().await;
        assert_eq!(
            (before.state, before.security_version, before.security_floor),
            (UpdateState::Confirmed, Some(2), Some(2))
        );
        let slot_b = std::fs::read(fake.dir.path().join("root-b")).unwrap();

        let err = fake.ab.apply(fake.bundle(1)).await.expect_err("a downgrade was applied");
        assert!(matches!(err, UpdateError::Downgrade { bundle: 1, floor: 2 }), "{err:?}");
        assert_eq!(std::fs::read(fake.dir.path().join("root-b")).unwrap(), slot_b, "slot B was written");
        let after = fake.ab.status().await;
        assert_eq!((after.state, after.slot.as_deref(), after.generation), (UpdateState::Failed, Some("a"), Some(1)));
        let why = after.message.unwrap_or_default();
        assert!(why.contains("security_version 1") && why.contains("floor 2"), "{why}");
        assert_eq!(after.detail["confirmed"], serde_json::Value::Bool(true));
        assert_eq!(after.detail["other"]["state"], "empty");

        // The same level is allowed.
        let ok = fake.ab.apply(fake.bundle(2)).await.expect("an equal security_version");
        assert_eq!(ok.status.state, UpdateState::Armed);
        assert_eq!(ok.status.security_floor, Some(2), "applying raised the floor");
    }
}

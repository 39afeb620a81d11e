//! The security floor: no downgrades.
//!
//! Every bundle manifest carries a signed `security_version`, and every image knows its own
//! (`image.json` in its verified root). The box records the highest `security_version` it has
//! **committed** in `<state>/update/security-floor.json` and refuses any bundle below it,
//! before writing anything ([`crate::bundle::BundleError::Downgrade`]). An equal
//! `security_version` is allowed (same-level updates, re-installs).
//!
//! The record only ever rises, and only through [`Records::raise_floor`], which the updater
//! calls when
//! - the health gate commits a slot (the floor becomes that slot's `security_version`), and
//! - at start and before each apply, when the running slot is committed ([`reconcile`]): a
//!   first boot records the running slot's level, and a commit whose record write failed is
//!   caught up.
//!
//! Applying a bundle, a trial boot, a failed trial and a rollback never raise it. A record that
//! is missing or not valid JSON is rebuilt from the highest level committed on the box: the
//! running committed slot's and every committed boot entry's `chrysalis.security_version=` (an
//! older committed slot picked in the boot menu does not lower it), and the rebuild is logged;
//! a record that cannot be read at all fails the apply.
//!
//! The record (not a secret, mode 0644, written with [`foundation::write_atomic`]):
//! ```json
//! {"security_version": 2, "slot": "b", "version": "0.1.0-next", "generation": 2,
//!  "at": 1764770000, "reason": "commit"}
//! ```

use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::slots::Slot;
use crate::state::Records;

/// The record's file name in `<state>/update/`.
pub const FLOOR_FILE: &str = "security-floor.json";

/// Errors reading or writing the floor record.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    /// The record exists but could not be read (not "missing", not "damaged": unknown).
    #[error("reading the security floor record {}", path.display())]
    Read {
        /// The record.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The record could not be written.
    #[error("writing the security floor record {}", path.display())]
    Write {
        /// The record.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What set the floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FloorReason {
    /// No record yet: the running committed slot's level (first boot).
    FirstBoot,
    /// The health gate committed the running slot.
    Commit,
    /// The record was damaged and rebuilt from the running committed slot.
    Rebuilt,
    /// The running committed slot is above the record (a commit whose record write failed).
    CaughtUp,
}

/// `<state>/update/security-floor.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FloorRecord {
    /// The floor: the highest `security_version` this box has committed.
    pub security_version: u64,
    /// The slot whose level set it.
    pub slot: Slot,
    /// That slot's version.
    pub version: Option<String>,
    /// That slot's generation.
    pub generation: Option<u64>,
    /// When (seconds since the Unix epoch).
    pub at: u64,
    /// What set it.
    pub reason: FloorReason,
}

/// The running slot, as the floor rules see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningSlot {
    /// Which slot.
    pub slot: Slot,
    /// Its version.
    pub version: Option<String>,
    /// Its generation.
    pub generation: Option<u64>,
    /// Its image's `security_version` (from its verified root).
    pub security_version: u64,
    /// Its boot entry is committed.
    pub committed: bool,
    /// The highest `chrysalis.security_version=` of any committed boot entry on the ESP (0 when
    /// none names one): a floor rebuilt while an older committed slot runs (picked in the boot
    /// menu) still counts the newer one.
    pub committed_max: u64,
}

/// The floor as read from the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// No record.
    Missing,
    /// The record exists but is not a valid record (`reason` says why).
    Damaged(String),
    /// The record.
    Present(FloorRecord),
}

impl Recorded {
    /// The recorded floor, if any.
    pub fn floor(&self) -> Option<u64> {
        match self {
            Recorded::Present(r) => Some(r.security_version),
            _ => None,
        }
    }
}

impl Records {
    /// `<state>/update/security-floor.json`.
    pub fn floor_path(&self) -> PathBuf {
        self.dir().join(FLOOR_FILE)
    }

    /// Reads the floor record.
    pub fn floor(&self) -> Result<Recorded, FloorError> {
        let path = self.floor_path();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Recorded::Missing),
            Err(source) => return Err(FloorError::Read { path, source }),
        };
        Ok(match serde_json::from_slice::<FloorRecord>(&bytes) {
            Ok(r) => Recorded::Present(r),
            Err(e) => Recorded::Damaged(e.to_string()),
        })
    }

    /// Raises the floor to the highest level committed on this box, `running`'s or any committed
    /// boot entry's (never lowers it); writes only when the record is missing, damaged or lower.
    /// Returns the floor afterwards.
    pub fn raise_floor(&self, running: &RunningSlot, reason: FloorReason) -> Result<u64, FloorError> {
        let recorded = self.floor()?;
        let target = running.security_version.max(running.committed_max);
        let (floor, reason) = match &recorded {
            Recorded::Present(r) if r.security_version >= target => return Ok(r.security_version),
            Recorded::Present(_) => (target, reason),
            Recorded::Missing => (target, reason),
            Recorded::Damaged(why) => {
                tracing::warn!(
                    path = %self.floor_path().display(),
                    error = %why,
                    floor = target,
                    "the security floor record is damaged: rebuilt from the committed slots"
                );
                (target, FloorReason::Rebuilt)
            }
        };
        let record = FloorRecord {
            security_version: floor,
            slot: running.slot,
            version: running.version.clone(),
            generation: running.generation,
            at: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            reason,
        };
        let path = self.floor_path();
        std::fs::create_dir_all(self.dir()).map_err(|source| FloorError::Write { path: path.clone(), source })?;
        let mut bytes = serde_json::to_vec_pretty(&record).unwrap_or_default();
        bytes.push(b'\n');
        foundation::write_atomic(&path, &bytes, foundation::PUBLIC_FILE)
            .map_err(|source| FloorError::Write { path: path.clone(), source })?;
        tracing::info!(floor, slot = %running.slot, ?reason, "security floor recorded");
        Ok(floor)
    }
}

/// The floor a bundle must meet now, reconciling the record with the running slot first: when
/// the running slot is committed, the floor is raised to its level (first boot, a missed
/// commit, a damaged record); on a trial boot the record is only read (a trial never raises
/// it), and the floor is at least the highest committed boot entry's level (a missing or
/// damaged record counts as that).
pub fn reconcile(records: &Records, running: &RunningSlot) -> Result<u64, FloorError> {
    if running.committed {
        let reason = match records.floor()? {
            Recorded::Missing => FloorReason::FirstBoot,
            _ => FloorReason::CaughtUp,
        };
        records.raise_floor(running, reason)
    } else {
        Ok(records.floor()?.floor().unwrap_or(0).max(running.committed_max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn running(slot: Slot, sv: u64, committed: bool) -> RunningSlot {
        RunningSlot {
            slot,
            version: Some(format!("v{sv}")),
            generation: Some(1),
            security_version: sv,
            committed,
            committed_max: 0,
        }
    }

    fn record(records: &Records) -> FloorRecord {
        match records.floor().expect("floor") {
            Recorded::Present(r) => r,
            other => panic!("no record: {other:?}"),
        }
    }

    #[test]
    fn first_boot_records_the_running_slot_and_the_record_only_rises() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        assert_eq!(records.floor().expect("floor"), Recorded::Missing);
        assert_eq!(reconcile(&records, &running(Slot::A, 2, true)).expect("reconcile"), 2);
        let r = record(&records);
        assert_eq!((r.security_version, r.slot, r.reason), (2, Slot::A, FloorReason::FirstBoot));
        let mode = std::fs::metadata(records.floor_path()).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "the floor is not a secret, and born with its mode");

        // A lower running slot (never reachable: rollback below the floor is refused) does not
        // lower it, and an equal one does not rewrite it.
        let before = std::fs::read(records.floor_path()).expect("read");
        assert_eq!(reconcile(&records, &running(Slot::B, 1, true)).expect("reconcile"), 2);
        assert_eq!(reconcile(&records, &running(Slot::A, 2, true)).expect("reconcile"), 2);
        assert_eq!(std::fs::read(records.floor_path()).expect("read"), before);

        // A commit raises it.
        assert_eq!(records.raise_floor(&running(Slot::B, 5, true), FloorReason::Commit).expect("raise"), 5);
        let r = record(&records);
        assert_eq!((r.security_version, r.slot, r.reason), (5, Slot::B, FloorReason::Commit));
        // A committed slot above the record (a commit whose write failed) is caught up.
        assert_eq!(reconcile(&records, &running(Slot::A, 7, true)).expect("reconcile"), 7);
        assert_eq!(record(&records).reason, FloorReason::CaughtUp);
    }

    #[test]
    fn a_trial_boot_reads_but_never_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        assert_eq!(reconcile(&records, &running(Slot::B, 9, false)).expect("reconcile"), 0);
        assert_eq!(records.floor().expect("floor"), Recorded::Missing, "a trial wrote the floor");
        records.raise_floor(&running(Slot::A, 3, true), FloorReason::FirstBoot).expect("raise");
        assert_eq!(reconcile(&records, &running(Slot::B, 9, false)).expect("reconcile"), 3);
        assert_eq!(record(&records).security_version, 3);
    }

    #[test]
    fn a_damaged_record_is_rebuilt_from_the_running_committed_slot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        std::fs::create_dir_all(records.dir()).expect("mkdir");
        std::fs::write(records.floor_path(), "{\"security_version\": ").expect("damage");
        assert!(matches!(records.floor().expect("floor"), Recorded::Damaged(_)));
        // On a trial it is left alone (and counts as no floor: applies are refused anyway).
        assert_eq!(reconcile(&records, &running(Slot::B, 4, false)).expect("reconcile"), 0);
        assert!(matches!(records.floor().expect("floor"), Recorded::Damaged(_)));
        assert_eq!(reconcile(&records, &running(Slot::A, 4, true)).expect("reconcile"), 4);
        assert_eq!(record(&records).reason, FloorReason::Rebuilt);
    }

    #[test]
    fn an_unreadable_record_is_an_error_not_a_zero_floor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        // A directory where the record should be: reading it fails with something other than
        // "not found", so the floor is unknown and nothing may be applied.
        std::fs::create_dir_all(records.floor_path()).expect("mkdir");
        let err = reconcile(&records, &running(Slot::A, 1, true)).expect_err("unknown floor");
        assert!(matches!(err, FloorError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains(FLOOR_FILE), "{err}");
    }

    #[test]
    fn a_rebuilt_floor_counts_every_committed_entry_not_only_the_running_slot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        std::fs::create_dir_all(records.dir()).expect("mkdir");
        std::fs::write(records.floor_path(), "not json").expect("damage");
        // Old A (level 1) picked in the boot menu while B (level 3) is committed too.
        let old_a = RunningSlot { committed_max: 3, ..running(Slot::A, 1, true) };
        assert_eq!(reconcile(&records, &old_a).expect("reconcile"), 3);
        assert_eq!((record(&records).security_version, record(&records).reason), (3, FloorReason::Rebuilt));
        // A trial with no record: the committed entries still set the floor.
        std::fs::remove_file(records.floor_path()).expect("rm");
        let trial = RunningSlot { committed_max: 3, ..running(Slot::B, 4, false) };
        assert_eq!(reconcile(&records, &trial).expect("reconcile"), 3);
    }
}

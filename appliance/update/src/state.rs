//! The A/B state: what runs, what the other slot holds, and the named transitions on it
//! (commit, mark bad, rollback), plus the update records on the state partition.
//!
//! Like Bottlerocket's signpost, each transition loads the state (the ESP's entries and the
//! kernel command line), applies one named change and writes once, atomically:
//! - **commit**: rename the running slot's `+0-1` (or `+N-M`) entry to `chrysalis-<slot>.conf`;
//! - **mark bad**: make sure the running slot's counted entry has 0 tries left, so the next
//!   boot picks the other slot (the trial entry already is `+0-1` once systemd-boot booted it);
//! - **rollback**: the other slot must hold a committed entry at or above the security floor
//!   (its entry's `chrysalis.security_version=`); rewrite it (still committed) with generation
//!   max + 1 so it boots next. An empty, armed, failed or below-the-floor other slot is refused.
//!
//! Records (`<state>/update/last-attempt.json`) say what the last apply, commit, revert or
//! rollback did and why; they survive reboots and upgrades.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cmdline::{set_param, BootInfo};
use crate::entries::{self, EntriesError, EntryName, Esp, SlotEntry};
use crate::slots::Slot;

/// Errors of state transitions and records.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A boot entry operation failed.
    #[error(transparent)]
    Entries(#[from] EntriesError),
    /// The running slot has no boot entry.
    #[error("the running slot {slot} has no boot entry")]
    NoOwnEntry {
        /// The running slot.
        slot: Slot,
    },
    /// Marking bad a slot that is already committed.
    #[error("slot {slot} is already committed ({entry}); use rollback to leave it")]
    AlreadyCommitted {
        /// The running slot.
        slot: Slot,
        /// Its entry.
        entry: String,
    },
    /// Rollback with nothing in the other slot.
    #[error("slot {slot} holds no boot entry: nothing to roll back to")]
    NothingToRollBackTo {
        /// The other slot.
        slot: Slot,
    },
    /// Rollback to a slot that is not known good.
    #[error("slot {slot} is {state:?} ({entry}), not a committed slot: refusing to roll back to it")]
    OtherNotGood {
        /// The other slot.
        slot: Slot,
        /// Its state.
        state: SlotState,
        /// Its entry.
        entry: String,
    },
    /// Rollback to a slot below the security floor: it would run an image whose known
    /// vulnerabilities a committed update fixed.
    #[error(
        "slot {slot} holds security_version {}, below this box's security floor {floor}: \
         refusing to roll back to it (install a bundle with security_version {floor} or higher instead)",
        security_version.map_or_else(|| "unknown (its entry has no chrysalis.security_version=)".to_string(), |v| v.to_string())
    )]
    BelowFloor {
        /// The other slot.
        slot: Slot,
        /// Its entry's `security_version`, when it has one.
        security_version: Option<u64>,
        /// The floor.
        floor: u64,
    },
    /// Rollback to a slot whose kernel is gone.
    #[error("slot {slot}'s kernel {} is missing: refusing to roll back to it", path.display())]
    OtherKernelMissing {
        /// The other slot.
        slot: Slot,
        /// The kernel path.
        path: PathBuf,
    },
    /// Reading or writing an update record failed.
    #[error("{what} {}", path.display())]
    Record {
        /// The record file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What a slot's entry says about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SlotState {
    /// A trial is armed (`+1`): the next boot tries it.
    Armed,
    /// Its trial ran and was not committed (0 tries left): it boots only if nothing else does.
    Bad,
    /// Committed: a fallback (or the running slot).
    Good,
    /// No entry.
    Empty,
}

impl SlotState {
    fn of(entry: Option<&SlotEntry>) -> SlotState {
        match entry {
            None => SlotState::Empty,
            Some(e) if e.name.is_committed() => SlotState::Good,
            Some(e) if e.name.is_armed() => SlotState::Armed,
            Some(_) => SlotState::Bad,
        }
    }
}

/// The other slot, as its entry describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtherSlot {
    /// Which slot.
    pub slot: Slot,
    /// `chrysalis.version=` of its entry.
    pub version: Option<String>,
    /// Its entry's generation.
    pub generation: Option<u64>,
    /// `chrysalis.security_version=` of its entry.
    #[serde(default)]
    pub security_version: Option<u64>,
    /// Its state.
    pub state: SlotState,
    /// Its entry file.
    pub entry: Option<String>,
}

/// The update status of the box (`GET /v1/update`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The running slot.
    pub slot: Slot,
    /// The running version.
    pub version: Option<String>,
    /// The running generation.
    pub generation: Option<u64>,
    /// The running image's `security_version` (from its verified root).
    #[serde(default)]
    pub security_version: u64,
    /// The security floor: the highest `security_version` this box committed (no bundle below
    /// it is accepted). `None` until recorded (the first start of a committed slot).
    #[serde(default)]
    pub security_floor: Option<u64>,
    /// The running slot's entry is committed.
    pub confirmed: bool,
    /// The running slot is on trial (its entry has a counter): the health gate decides.
    pub trial_in_progress: bool,
    /// The running slot's entry file.
    pub entry: Option<String>,
    /// The other slot (always present; `state` is `empty` when it holds nothing).
    pub other: Option<OtherSlot>,
    /// What systemd-boot would boot next, in order.
    pub boot_order: Vec<String>,
    /// The current or last apply.
    pub progress: Progress,
    /// The last recorded attempt.
    pub last_attempt: Option<LastAttempt>,
}

/// The kind of a recorded attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// A bundle was applied (or refused).
    Apply,
    /// The running trial was committed by the health gate.
    Commit,
    /// The running trial was committed by the offline rule (API server unreachable).
    CommitOffline,
    /// The running trial failed the health gate: marked bad, reboot.
    Revert,
    /// A manual rollback to the other slot.
    Rollback,
}

/// One recorded attempt (`<state>/update/last-attempt.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastAttempt {
    /// Seconds since the Unix epoch.
    pub at: u64,
    /// What was attempted.
    pub action: Action,
    /// The slot running at the time.
    pub from_slot: Slot,
    /// The slot acted on.
    pub to_slot: Option<Slot>,
    /// The version involved.
    pub version: Option<String>,
    /// The generation involved.
    pub generation: Option<u64>,
    /// Whether it succeeded.
    pub ok: bool,
    /// What happened, or why not.
    pub message: String,
}

impl LastAttempt {
    /// A record stamped now.
    pub fn now(action: Action, from_slot: Slot, ok: bool, message: impl Into<String>) -> LastAttempt {
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        LastAttempt {
            at,
            action,
            from_slot,
            to_slot: None,
            version: None,
            generation: None,
            ok,
            message: message.into(),
        }
    }
}

/// The update records directory (`<state>/update`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Records {
    dir: PathBuf,
}

impl Records {
    /// Records under `<state_dir>/update`.
    pub fn new(state_dir: &Path) -> Records {
        Records { dir: state_dir.join("update") }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn last_attempt_path(&self) -> PathBuf {
        self.dir.join("last-attempt.json")
    }

    /// The last attempt; `None` when none was recorded (or the record is unreadable, which is
    /// logged: a damaged record must not hide the status).
    pub fn last_attempt(&self) -> Option<LastAttempt> {
        let path = self.last_attempt_path();
        let bytes = std::fs::read(&path).ok()?;
        match serde_json::from_slice(&bytes) {
            Ok(record) => Some(record),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable update record");
                None
            }
        }
    }

    /// Replaces the last-attempt record atomically.
    pub fn record(&self, attempt: &LastAttempt) -> Result<(), StateError> {
        let path = self.last_attempt_path();
        std::fs::create_dir_all(&self.dir).map_err(|source| StateError::Record {
            path: self.dir.clone(),
            what: "creating",
            source,
        })?;
        let mut bytes = serde_json::to_vec_pretty(attempt).unwrap_or_default();
        bytes.push(b'\n');
        crate::atomic::write_file(&path, &bytes).map_err(|source| StateError::Record { path, what: "writing", source })
    }
}

/// The status of the box; `security_version` is the running image's.
pub fn status(
    esp: &Esp,
    boot: &BootInfo,
    security_version: u64,
    progress: Progress,
    records: &Records,
) -> Result<Status, StateError> {
    let all = esp.slot_entries()?;
    let own = entries::mine(&all, boot.slot, boot.generation);
    let other_slot = boot.slot.other();
    let other = entries::newest(&all, other_slot);
    Ok(Status {
        slot: boot.slot,
        version: boot.version.clone().or_else(|| own.and_then(|e| e.entry.chrysalis_version())),
        generation: boot.generation.or_else(|| own.and_then(|e| e.entry.generation())),
        security_version,
        security_floor: match records.floor() {
            Ok(recorded) => recorded.floor(),
            Err(e) => {
                tracing::warn!(error = %foundation::error_chain(&e), "status: the security floor is unreadable");
                None
            }
        },
        confirmed: own.is_some_and(|e| e.name.is_committed()),
        trial_in_progress: own.is_some_and(|e| !e.name.is_committed()),
        entry: own.map(|e| e.file_name.clone()),
        other: Some(OtherSlot {
            slot: other_slot,
            version: other.and_then(|e| e.entry.chrysalis_version()),
            generation: other.and_then(|e| e.entry.generation()),
            security_version: other.and_then(|e| e.entry.security_version()),
            state: SlotState::of(other),
            entry: other.map(|e| e.file_name.clone()),
        }),
        boot_order: esp.boot_order()?,
        progress,
        last_attempt: records.last_attempt(),
    })
}

/// The result of a commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    /// The committed entry file (`chrysalis-b.conf`).
    pub entry: String,
    /// It already was committed: nothing changed.
    pub already: bool,
}

/// Commits the running slot: its counted entry becomes `chrysalis-<slot>.conf`. Idempotent.
pub fn commit(esp: &Esp, boot: &BootInfo) -> Result<Committed, StateError> {
    let all = esp.slot_entries()?;
    let own = entries::mine(&all, boot.slot, boot.generation).ok_or(StateError::NoOwnEntry { slot: boot.slot })?;
    let plain = EntryName::plain(boot.slot);
    if own.name.is_committed() {
        return Ok(Committed { entry: own.file_name.clone(), already: true });
    }
    esp.rename(&own.file_name, &plain)?;
    tracing::info!(from = %own.file_name, to = %plain.file_name(), "committed the running slot");
    Ok(Committed { entry: plain.file_name(), already: false })
}

/// Makes sure the running slot's (counted) entry has no tries left, so the next boot picks
/// the other slot. Returns the entry's file name. Refuses on a committed slot.
pub fn mark_bad(esp: &Esp, boot: &BootInfo) -> Result<String, StateError> {
    let all = esp.slot_entries()?;
    let own = entries::mine(&all, boot.slot, boot.generation).ok_or(StateError::NoOwnEntry { slot: boot.slot })?;
    match own.name.counter {
        None => Err(StateError::AlreadyCommitted { slot: boot.slot, entry: own.file_name.clone() }),
        Some(c) if c.left == 0 => Ok(own.file_name.clone()),
        Some(c) => {
            let bad = EntryName {
                slot: boot.slot,
                counter: Some(entries::Counter { left: 0, done: c.done.saturating_add(c.left) }),
            };
            esp.rename(&own.file_name, &bad)?;
            tracing::warn!(from = %own.file_name, to = %bad.file_name(), "marked the running slot bad");
            Ok(bad.file_name())
        }
    }
}

/// The result of a rollback.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolledBack {
    /// The slot that boots next.
    pub slot: Slot,
    /// Its new generation.
    pub generation: u64,
    /// Its entry file.
    pub entry: String,
    /// Its version.
    pub version: Option<String>,
}

/// Makes the other slot boot next: its committed entry is rewritten with generation max + 1
/// (the running slot's entry stays, as the fallback). Reboot to take effect. A slot below
/// `floor` (the security floor) is refused.
pub fn rollback(esp: &Esp, boot: &BootInfo, floor: u64) -> Result<RolledBack, StateError> {
    let all = esp.slot_entries()?;
    let other = boot.slot.other();
    let target = entries::newest(&all, other).ok_or(StateError::NothingToRollBackTo { slot: other })?;
    if !target.name.is_committed() {
        return Err(StateError::OtherNotGood {
            slot: other,
            state: SlotState::of(Some(target)),
            entry: target.file_name.clone(),
        });
    }
    let security_version = target.entry.security_version();
    if security_version.is_none_or(|v| v < floor) {
        return Err(StateError::BelowFloor { slot: other, security_version, floor });
    }
    let kernel = esp.kernel_path(other);
    if !kernel.is_file() {
        return Err(StateError::OtherKernelMissing { slot: other, path: kernel });
    }
    let generation = entries::next_generation(&all, boot.generation);
    let mut body = target.entry.clone();
    body.version = Some(generation.to_string());
    body.options = set_param(&body.options, "chrysalis.generation", &generation.to_string());
    let name = EntryName::plain(other);
    esp.write(&name, &body)?;
    // Drop any other file of that slot (there should be none), so no twin remains.
    for stale in all.iter().filter(|e| e.name.slot == other && e.file_name != name.file_name()) {
        esp.remove(&stale.file_name)?;
    }
    esp.sync()?;
    tracing::info!(slot = %other, generation, "rolled back: the other slot boots next");
    Ok(RolledBack { slot: other, generation, entry: name.file_name(), version: body.chrysalis_version() })
}

/// The step an apply is at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// No apply has run since the updater started.
    #[default]
    Idle,
    /// Reading and verifying the manifest.
    Verifying,
    /// Receiving the kernel.
    Kernel,
    /// Writing the root image to the slot.
    Root,
    /// Reading the slot back.
    ReadBack,
    /// Installing the kernel and writing the entry.
    Arming,
    /// Armed: reboot to try the new slot.
    Done,
    /// Failed (see `error`); no entry points at the other slot.
    Failed,
}

/// The progress of the current (or last) apply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The step.
    pub phase: Phase,
    /// The slot being written.
    pub slot: Option<Slot>,
    /// The bundle's version, once verified.
    pub version: Option<String>,
    /// Bytes done in this step (root write or read-back).
    pub bytes_done: u64,
    /// Bytes of this step.
    pub bytes_total: u64,
    /// Why it failed.
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entries::BootEntry;
    use std::fs;

    fn esp_with(dir: &Path, files: &[(&str, u64)]) -> Esp {
        let esp = Esp::new(dir);
        for (name, generation) in files {
            let n = EntryName::parse(name).expect("name");
            let options = format!(
                "chrysalis.slot={} chrysalis.version=v{generation} chrysalis.generation={generation} \
                 chrysalis.security_version={generation}",
                n.slot
            );
            esp.write(&n, &BootEntry::for_slot(n.slot, &format!("v{generation}"), *generation, &options))
                .expect("write");
            fs::create_dir_all(esp.kernel_path(n.slot).parent().expect("dir")).expect("mkdir");
            fs::write(esp.kernel_path(n.slot), "k").expect("kernel");
        }
        esp
    }

    fn boot(slot: Slot, generation: u64) -> BootInfo {
        BootInfo { slot, version: Some(format!("v{generation}")), generation: Some(generation) }
    }

    fn names(esp: &Esp) -> Vec<String> {
        esp.list().expect("list").into_iter().map(|f| f.file_name).collect()
    }

    #[test]
    fn commit_renames_the_trial_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b+0-1.conf", 2)]);
        let b = boot(Slot::B, 2);
        let records = Records::new(dir.path());
        let before = status(&esp, &b, 2, Progress::default(), &records).expect("status");
        assert!(before.trial_in_progress && !before.confirmed);
        assert_eq!(before.boot_order, ["chrysalis-a.conf", "chrysalis-b+0-1.conf"]);
        let done = commit(&esp, &b).expect("commit");
        assert_eq!(done, Committed { entry: "chrysalis-b.conf".into(), already: false });
        assert_eq!(names(&esp), ["chrysalis-a.conf", "chrysalis-b.conf"]);
        assert!(commit(&esp, &b).expect("again").already);
        let after = status(&esp, &b, 2, Progress::default(), &records).expect("status");
        assert!(after.confirmed && !after.trial_in_progress);
        assert_eq!(after.boot_order[0], "chrysalis-b.conf");
        let other = after.other.expect("other");
        assert_eq!((other.slot, other.state, other.generation), (Slot::A, SlotState::Good, Some(1)));
        assert_eq!(other.version.as_deref(), Some("v1"));
    }

    #[test]
    fn mark_bad_rules() {
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b+0-1.conf", 2)]);
        assert_eq!(mark_bad(&esp, &boot(Slot::B, 2)).expect("bad"), "chrysalis-b+0-1.conf");
        assert!(matches!(mark_bad(&esp, &boot(Slot::A, 1)), Err(StateError::AlreadyCommitted { .. })));
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b+2-1.conf", 2)]);
        assert_eq!(mark_bad(&esp, &boot(Slot::B, 2)).expect("bad"), "chrysalis-b+0-3.conf");
        assert_eq!(esp.boot_order().expect("order")[0], "chrysalis-a.conf");
    }

    #[test]
    fn rollback_rules() {
        // Nothing to roll back to on a fresh image.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1)]);
        assert!(matches!(rollback(&esp, &boot(Slot::A, 1), 0), Err(StateError::NothingToRollBackTo { slot: Slot::B })));

        // An armed or failed other slot is not a rollback target.
        for other in ["chrysalis-b+1.conf", "chrysalis-b+0-1.conf"] {
            let dir = tempfile::tempdir().expect("tempdir");
            let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), (other, 2)]);
            assert!(matches!(
                rollback(&esp, &boot(Slot::A, 1), 0),
                Err(StateError::OtherNotGood { slot: Slot::B, .. })
            ));
        }

        // After A→B committed: rolling back rewrites A with generation 3, which then boots.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b.conf", 2)]);
        let done = rollback(&esp, &boot(Slot::B, 2), 1).expect("rollback");
        assert_eq!(done.slot, Slot::A);
        assert_eq!(done.generation, 3);
        assert_eq!(done.entry, "chrysalis-a.conf");
        assert_eq!(esp.boot_order().expect("order")[0], "chrysalis-a.conf");
        let a = esp.slot_entries().expect("entries").into_iter().find(|e| e.name.slot == Slot::A).expect("a");
        assert_eq!(a.entry.generation(), Some(3));
        assert_eq!(crate::cmdline::param(&a.entry.options, "chrysalis.generation").as_deref(), Some("3"));
        assert_eq!(crate::cmdline::param(&a.entry.options, "chrysalis.slot").as_deref(), Some("a"));

        // During a trial of B, rolling back to the committed A is allowed.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b+0-1.conf", 2)]);
        assert_eq!(rollback(&esp, &boot(Slot::B, 2), 1).expect("rollback").generation, 3);

        // A missing kernel makes the target unbootable.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b.conf", 2)]);
        fs::remove_file(esp.kernel_path(Slot::A)).expect("rm");
        assert!(matches!(rollback(&esp, &boot(Slot::B, 2), 1), Err(StateError::OtherKernelMissing { .. })));
    }

    #[test]
    fn rollback_below_the_security_floor_is_refused() {
        // A (security_version 1, from esp_with) and B (2) committed; B runs.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 1), ("chrysalis-b.conf", 2)]);
        let before = names(&esp);
        let a_entry = fs::read(esp.entries_dir().join("chrysalis-a.conf")).expect("a");
        match rollback(&esp, &boot(Slot::B, 2), 2) {
            Err(e @ StateError::BelowFloor { slot: Slot::A, security_version: Some(1), floor: 2 }) => {
                let text = e.to_string();
                assert!(text.contains("security_version 1") && text.contains("floor 2"), "{text}");
            }
            other => panic!("expected BelowFloor, got {other:?}"),
        }
        assert_eq!(names(&esp), before);
        assert_eq!(fs::read(esp.entries_dir().join("chrysalis-a.conf")).expect("a"), a_entry, "A was rewritten");
        // An entry that does not say its level is below any floor but 0.
        let bare = BootEntry::for_slot(Slot::A, "v1", 1, "chrysalis.slot=a chrysalis.generation=1");
        esp.write(&EntryName::plain(Slot::A), &bare).expect("bare");
        assert!(matches!(
            rollback(&esp, &boot(Slot::B, 2), 1),
            Err(StateError::BelowFloor { security_version: None, floor: 1, .. })
        ));
        // At the floor: allowed.
        let dir = tempfile::tempdir().expect("tempdir");
        let esp = esp_with(dir.path(), &[("chrysalis-a.conf", 2), ("chrysalis-b.conf", 3)]);
        assert_eq!(rollback(&esp, &boot(Slot::B, 3), 2).expect("at the floor").slot, Slot::A);
        let status = status(&esp, &boot(Slot::B, 3), 3, Progress::default(), &Records::new(dir.path())).expect("st");
        assert_eq!(status.other.and_then(|o| o.security_version), Some(2));
        assert_eq!((status.security_version, status.security_floor), (3, None));
    }

    #[test]
    fn records_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path());
        assert_eq!(records.last_attempt(), None);
        let mut a = LastAttempt::now(Action::Revert, Slot::B, false, "pool base/small warm 0/1");
        a.to_slot = Some(Slot::A);
        records.record(&a).expect("record");
        assert_eq!(records.last_attempt(), Some(a));
        assert!(dir.path().join("update/last-attempt.json").is_file());
        fs::write(dir.path().join("update/last-attempt.json"), "{").expect("corrupt");
        assert_eq!(records.last_attempt(), None);
    }
}

//! [`Updater`]: the one object the supervisor holds. It ties the configuration (ESP, state
//! directory, trusted keys, slot devices, command-line source, `compatible`) to the modules,
//! runs the blocking work on tokio's blocking pool, allows one mutating operation at a time,
//! publishes apply progress on a watch channel, records every attempt, and keeps the security
//! floor ([`crate::floor`]): reconciled at start and before each apply, raised by commits.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncRead;
use tokio::sync::{watch, Mutex, OwnedMutexGuard};

use crate::apply::{self, ApplyContext, ApplyError, ApplyReport, Phase, Progress};
use crate::bundle::BundleError;
use crate::cmdline::{BootInfo, CmdlineError, CmdlineSource};
use crate::entries::{self, EntriesError, Esp};
use crate::floor::{FloorError, FloorReason, RunningSlot};
use crate::gate::Decision;
use crate::keys::TrustedKeys;
use crate::slots::SlotsConfig;
use crate::state::{self, Action, Committed, LastAttempt, Records, RolledBack, StateError, Status};

/// Errors of the facade.
#[derive(Debug, thiserror::Error)]
pub enum UpdaterError {
    /// Another apply, commit, revert or rollback is running.
    #[error("another update operation is running")]
    Busy,
    /// Which slot booted is unknown.
    #[error(transparent)]
    Cmdline(#[from] CmdlineError),
    /// The apply failed or was refused.
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// A state transition failed or was refused.
    #[error(transparent)]
    State(#[from] StateError),
    /// The security floor could not be read or written.
    #[error(transparent)]
    Floor(#[from] FloorError),
    /// `image.json` could not be read.
    #[error("reading the image description {} (board, security_version): {reason}", path.display())]
    ImageJson {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The blocking worker died.
    #[error("the update worker failed: {0}")]
    Worker(String),
}

impl UpdaterError {
    /// A stable machine-readable kind for API errors (`{"error": …, "kind": …}`).
    pub fn kind(&self) -> &'static str {
        match self {
            UpdaterError::Busy => "busy",
            UpdaterError::Cmdline(_) => "not-booted-from-slot",
            UpdaterError::ImageJson { .. } => "image-json",
            UpdaterError::Worker(_) => "internal",
            UpdaterError::Apply(e) => match e {
                ApplyError::Unconfirmed { .. } => "unconfirmed",
                ApplyError::NoOwnEntry { .. } => "no-own-entry",
                ApplyError::Keys(_) => "trusted-keys",
                ApplyError::Floor(_) => "security-floor",
                ApplyError::ReadBack { .. } => "read-back-mismatch",
                ApplyError::Slots(_) | ApplyError::Entries(_) | ApplyError::Kernel { .. } => "io",
                ApplyError::Bundle(b) => match b {
                    BundleError::Unsigned => "unsigned",
                    BundleError::BadSignature { .. } => "bad-signature",
                    BundleError::UnknownKey { .. } => "unknown-key",
                    BundleError::Incompatible { .. } => "incompatible",
                    BundleError::Downgrade { .. } => "downgrade",
                    BundleError::Tampered { .. } | BundleError::SizeMismatch { .. } => "tampered",
                    BundleError::OutOfOrder { .. } => "out-of-order",
                    BundleError::UnexpectedMember { .. } => "unexpected-member",
                    BundleError::TooLarge { .. } => "too-large",
                    BundleError::Manifest(_) => "bad-manifest",
                    BundleError::MissingMember { .. }
                    | BundleError::Truncated { .. }
                    | BundleError::MemberTooLarge { .. }
                    | BundleError::BadHeader { .. } => "malformed-bundle",
                    BundleError::Read { .. } => "bundle-read",
                    BundleError::Write { .. } | BundleError::File { .. } => "io",
                },
            },
            UpdaterError::State(e) => match e {
                StateError::NoOwnEntry { .. } => "no-own-entry",
                StateError::AlreadyCommitted { .. } => "already-committed",
                StateError::NothingToRollBackTo { .. } => "nothing-to-roll-back-to",
                StateError::OtherNotGood { .. } => "other-not-good",
                StateError::OtherKernelMissing { .. } => "other-kernel-missing",
                StateError::BelowFloor { .. } => "below-security-floor",
                StateError::Entries(_) | StateError::Record { .. } => "io",
            },
            UpdaterError::Floor(_) => "security-floor",
        }
    }

    /// Whether the request was refused (the caller's or the bundle's fault, or a state that
    /// forbids it: a 4xx) rather than the box failing (a 5xx).
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self.kind(),
            "io" | "internal"
                | "read-back-mismatch"
                | "trusted-keys"
                | "not-booted-from-slot"
                | "image-json"
                | "security-floor"
        )
    }
}

/// Where everything is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdaterConfig {
    /// The ESP mount point (`/efi`).
    pub esp: PathBuf,
    /// The state directory (`/var/lib/chrysalis`); records go to `<state>/update/`.
    pub state_dir: PathBuf,
    /// The trusted keys directory (`/usr/share/chrysalis/update-keys`), re-read at every apply.
    pub trusted_keys: PathBuf,
    /// The slot devices.
    pub slots: SlotsConfig,
    /// Where the running kernel's command line comes from (`/proc/cmdline`).
    pub cmdline: CmdlineSource,
    /// This box's `compatible` (`chrysalis-<board>`).
    pub compatible: String,
    /// The running image's `security_version` (from `image.json` in its verified root).
    pub security_version: u64,
}

impl UpdaterConfig {
    /// The fixed appliance paths, for the running image.
    pub fn appliance(image: ImageInfo) -> UpdaterConfig {
        UpdaterConfig {
            esp: PathBuf::from("/efi"),
            state_dir: PathBuf::from("/var/lib/chrysalis"),
            trusted_keys: PathBuf::from("/usr/share/chrysalis/update-keys"),
            slots: SlotsConfig::appliance(),
            cmdline: CmdlineSource::default(),
            compatible: image.compatible,
            security_version: image.security_version,
        }
    }
}

/// What the running image says about itself in `/usr/share/chrysalis/image.json` (written by
/// `cargo xtask image`, inside the dm-verity root).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// `chrysalis-<board>`.
    pub compatible: String,
    /// The image's `security_version`.
    pub security_version: u64,
}

impl ImageInfo {
    /// Reads `board` and `security_version` from `image.json`. Both are required: the updater
    /// and `image.json` ship in the same root, so a missing field is a broken build.
    pub fn load(path: &Path) -> Result<ImageInfo, UpdaterError> {
        let err = |reason: String| UpdaterError::ImageJson { path: path.to_path_buf(), reason };
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| err(e.to_string()))?;
        let board = value.get("board").and_then(|b| b.as_str()).ok_or_else(|| err("no \"board\" string".into()))?;
        let security_version = value
            .get("security_version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| err("no \"security_version\" number (rebuild the image with `cargo xtask image`)".into()))?;
        Ok(ImageInfo { compatible: crate::manifest::Manifest::compatible_for_board(board), security_version })
    }
}

/// The result of acting on a gate [`Decision`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum GateOutcome {
    /// Nothing to do yet.
    Waiting,
    /// The running slot is committed.
    Committed {
        /// The entry.
        entry: String,
    },
    /// The trial is marked bad: the caller reboots now.
    RebootNeeded {
        /// The (bad) entry.
        entry: String,
        /// Why.
        reason: String,
    },
}

struct Inner {
    config: UpdaterConfig,
    progress: watch::Sender<Progress>,
    lock: Arc<Mutex<()>>,
}

/// The updater; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct Updater {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Updater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Updater").field("config", &self.inner.config).finish()
    }
}

impl Updater {
    /// An updater over `config`. Does no IO: a box without slots still starts, and its
    /// update calls fail with typed errors.
    pub fn open(config: UpdaterConfig) -> Updater {
        let (progress, _) = watch::channel(Progress::default());
        Updater { inner: Arc::new(Inner { config, progress, lock: Arc::new(Mutex::new(())) }) }
    }

    /// The configuration.
    pub fn config(&self) -> &UpdaterConfig {
        &self.inner.config
    }

    /// Which slot booted, from the command line.
    pub fn boot_info(&self) -> Result<BootInfo, UpdaterError> {
        Ok(BootInfo::parse(&self.inner.config.cmdline.read()?)?)
    }

    /// Apply progress (the current value and every change).
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.inner.progress.subscribe()
    }

    fn esp(&self) -> Esp {
        Esp::new(&self.inner.config.esp)
    }

    fn records(&self) -> Records {
        Records::new(&self.inner.config.state_dir)
    }

    fn lock(&self) -> Result<OwnedMutexGuard<()>, UpdaterError> {
        self.inner.lock.clone().try_lock_owned().map_err(|_| UpdaterError::Busy)
    }

    fn record(&self, attempt: LastAttempt) {
        if let Err(e) = self.records().record(&attempt) {
            tracing::warn!(error = %foundation::error_chain(&e), "could not write the update record");
        }
    }

    /// The status (`GET /v1/update`).
    pub async fn status(&self) -> Result<Status, UpdaterError> {
        let this = self.clone();
        run_blocking(move || this.status_blocking()).await
    }

    /// [`Updater::status`] on the calling thread.
    pub fn status_blocking(&self) -> Result<Status, UpdaterError> {
        let boot = self.boot_info()?;
        let progress = self.inner.progress.borrow().clone();
        Ok(state::status(&self.esp(), &boot, self.inner.config.security_version, progress, &self.records())?)
    }

    /// The running slot as the floor rules see it.
    fn running(&self, boot: &BootInfo) -> Result<RunningSlot, EntriesError> {
        let all = self.esp().slot_entries()?;
        let committed = entries::mine(&all, boot.slot, boot.generation).is_some_and(|e| e.name.is_committed());
        let committed_max =
            all.iter().filter(|e| e.name.is_committed()).filter_map(|e| e.entry.security_version()).max().unwrap_or(0);
        Ok(RunningSlot {
            slot: boot.slot,
            version: boot.version.clone(),
            generation: boot.generation,
            security_version: self.inner.config.security_version,
            committed,
            committed_max,
        })
    }

    /// Reconciles the security floor with the running slot (at start: a first boot of a
    /// committed slot records its level) and returns the floor. See [`crate::floor::reconcile`].
    pub fn reconcile_floor_blocking(&self) -> Result<u64, UpdaterError> {
        let _guard = self.lock()?;
        let boot = self.boot_info()?;
        let running = self.running(&boot).map_err(StateError::from)?;
        Ok(crate::floor::reconcile(&self.records(), &running)?)
    }

    /// Applies the bundle streamed from `body` (the HTTP request body) to the other slot and
    /// arms a one-shot trial; see [`crate::apply`]. The stream is read on a blocking thread.
    pub async fn apply<R>(&self, body: R) -> Result<ApplyReport, UpdaterError>
    where
        R: AsyncRead + Send + Unpin + 'static,
    {
        let guard = self.lock()?;
        let reader = tokio_util::io::SyncIoBridge::new(body);
        let this = self.clone();
        // The guard moves into the worker: a dropped request future does not release the
        // lock while the worker still writes the slot.
        run_blocking(move || {
            let _guard = guard;
            this.apply_locked(reader)
        })
        .await
    }

    /// [`Updater::apply`] from a blocking context (CLI tools, tests). Never call it on an
    /// async worker thread.
    pub fn apply_blocking<R: Read>(&self, body: R) -> Result<ApplyReport, UpdaterError> {
        let _guard = self.lock()?;
        self.apply_locked(body)
    }

    fn apply_locked<R: Read>(&self, body: R) -> Result<ApplyReport, UpdaterError> {
        let boot = self.boot_info()?;
        let config = &self.inner.config;
        let esp = self.esp();
        let progress = &self.inner.progress;
        // The floor first: an unknown floor accepts nothing.
        let floor = self
            .running(&boot)
            .map_err(ApplyError::from)
            .and_then(|running| Ok(crate::floor::reconcile(&self.records(), &running)?));
        let result = floor.and_then(|floor| {
            let keys = TrustedKeys::load(&config.trusted_keys)?;
            let ctx = ApplyContext {
                esp: &esp,
                slots: &config.slots,
                keys: &keys,
                compatible: &config.compatible,
                min_security_version: floor,
                boot: &boot,
            };
            apply::apply(&ctx, body, &mut |p| {
                progress.send_replace(p.clone());
            })
        });
        let mut attempt = LastAttempt::now(Action::Apply, boot.slot, result.is_ok(), "");
        attempt.to_slot = Some(boot.slot.other());
        match &result {
            Ok(report) => {
                attempt.version = Some(report.version.clone());
                attempt.generation = Some(report.generation);
                attempt.message = format!("armed {} (reboot to try it)", report.entry);
            }
            Err(e) => {
                let message = foundation::error_chain(e);
                tracing::warn!(error = %message, "update refused or failed");
                progress.send_modify(|p| {
                    p.phase = Phase::Failed;
                    p.error = Some(message.clone());
                });
                attempt.version = progress.borrow().version.clone();
                attempt.message = message;
            }
        }
        self.record(attempt);
        Ok(result?)
    }

    /// Commits the running slot (the gate said healthy). Idempotent.
    pub async fn commit(&self) -> Result<Committed, UpdaterError> {
        self.commit_as(Action::Commit, "healthy".to_string()).await
    }

    async fn commit_as(&self, action: Action, note: String) -> Result<Committed, UpdaterError> {
        let guard = self.lock()?;
        let this = self.clone();
        run_blocking(move || {
            let _guard = guard;
            let boot = this.boot_info()?;
            let done = state::commit(&this.esp(), &boot)?;
            // Committed: the floor rises to this slot's level. A failed write is logged and
            // caught up at the next start or apply (the slot is committed either way).
            let running = RunningSlot { committed: true, ..this.running(&boot).map_err(StateError::from)? };
            if let Err(e) = this.records().raise_floor(&running, FloorReason::Commit) {
                tracing::error!(error = %foundation::error_chain(&e), "could not raise the security floor after the commit");
            }
            if !done.already {
                let mut attempt =
                    LastAttempt::now(action, boot.slot, true, format!("committed {}: {note}", done.entry));
                attempt.to_slot = Some(boot.slot);
                attempt.version = boot.version.clone();
                attempt.generation = boot.generation;
                this.record(attempt);
            }
            Ok(done)
        })
        .await
    }

    /// The trial failed the gate: records `reason`, makes sure the running entry has no tries
    /// left, and returns the entry. The caller must reboot; the other slot boots.
    pub async fn mark_bad_and_reboot_needed(&self, reason: &str) -> Result<String, UpdaterError> {
        let guard = self.lock()?;
        let this = self.clone();
        let reason = reason.to_string();
        run_blocking(move || {
            let _guard = guard;
            let boot = this.boot_info()?;
            let result = state::mark_bad(&this.esp(), &boot);
            let mut attempt = LastAttempt::now(Action::Revert, boot.slot, result.is_ok(), reason.clone());
            attempt.to_slot = Some(boot.slot.other());
            attempt.version = boot.version.clone();
            attempt.generation = boot.generation;
            if let Err(e) = &result {
                attempt.message = format!("{reason}; marking bad failed: {}", foundation::error_chain(e));
            }
            this.record(attempt);
            Ok(result?)
        })
        .await
    }

    /// Makes the other (committed) slot boot next; the caller reboots. See [`state::rollback`].
    pub async fn rollback(&self) -> Result<RolledBack, UpdaterError> {
        let guard = self.lock()?;
        let this = self.clone();
        run_blocking(move || {
            let _guard = guard;
            let boot = this.boot_info()?;
            let running = this.running(&boot).map_err(StateError::from)?;
            let floor = crate::floor::reconcile(&this.records(), &running)?;
            let result = state::rollback(&this.esp(), &boot, floor);
            let mut attempt = LastAttempt::now(Action::Rollback, boot.slot, result.is_ok(), "");
            attempt.to_slot = Some(boot.slot.other());
            match &result {
                Ok(done) => {
                    attempt.version = done.version.clone();
                    attempt.generation = Some(done.generation);
                    attempt.message = format!("{} boots next (generation {})", done.entry, done.generation);
                }
                Err(e) => attempt.message = foundation::error_chain(e),
            }
            this.record(attempt);
            Ok(result?)
        })
        .await
    }

    /// Acts on a gate decision: commit, commit offline, or mark bad (the caller then
    /// reboots on [`GateOutcome::RebootNeeded`]).
    pub async fn act(&self, decision: &Decision) -> Result<GateOutcome, UpdaterError> {
        match decision {
            Decision::Wait => Ok(GateOutcome::Waiting),
            Decision::Commit => Ok(GateOutcome::Committed { entry: self.commit().await?.entry }),
            Decision::CommitOffline { reason } => {
                Ok(GateOutcome::Committed { entry: self.commit_as(Action::CommitOffline, reason.clone()).await?.entry })
            }
            Decision::Revert { reason } => {
                let entry = self.mark_bad_and_reboot_needed(reason).await?;
                Ok(GateOutcome::RebootNeeded { entry, reason: reason.clone() })
            }
        }
    }
}

/// Time since the kernel booted (the first field of `/proc/uptime`, which includes suspend):
/// the gate's `elapsed`, unaffected by supervisor restarts.
pub fn since_boot() -> std::io::Result<Duration> {
    let text = std::fs::read_to_string("/proc/uptime")?;
    let secs = text
        .split_whitespace()
        .next()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "unreadable /proc/uptime"))?;
    Ok(Duration::from_secs_f64(secs.max(0.0)))
}

async fn run_blocking<T, F>(f: F) -> Result<T, UpdaterError>
where
    F: FnOnce() -> Result<T, UpdaterError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f).await.map_err(|e| UpdaterError::Worker(e.to_string()))?
}

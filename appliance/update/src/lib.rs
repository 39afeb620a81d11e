//! A/B updates of the Chrysalis appliance.
//!
//! The box has two root slots (`chrysalis-root-a`, `chrysalis-root-b`: erofs + dm-verity) and
//! boots through systemd-boot, whose boot counting lives in entry file names on the ESP. This
//! crate is the only code that changes which slot boots:
//!
//! - [`bundle`] + [`manifest`] + [`keys`]: the signed bundle format (`cargo xtask bundle`
//!   makes one; the box streams one in and verifies the ed25519 signature before writing);
//! - [`slots`]: the slot devices, their sizes and PARTUUIDs;
//! - [`cmdline`]: the slot's kernel command line (verity root hash bound to the entry) and
//!   which slot booted;
//! - [`entries`]: systemd-boot entries (`chrysalis-a.conf`, `chrysalis-b+1.conf`,
//!   `chrysalis-b+0-1.conf`) and systemd-boot's boot order;
//! - [`apply`]: writing the inactive slot and arming a one-shot trial, entry last;
//! - [`state`]: status, commit, mark-bad, rollback, and the update records;
//! - [`floor`]: the security floor (no downgrades): the highest committed `security_version`;
//! - [`gate`]: the pure health-gate decision (commit / wait / revert / offline rule);
//! - [`Updater`]: the async facade the supervisor holds.
//!
//! Invariants: nothing is written before the bundle's signature verifies; no bundle below the
//! security floor is written, and only a commit (or the running committed slot) raises the
//! floor; the fallback slot is never written while the running slot is unconfirmed; the boot
//! entry is always the last write, so a power cut at any point leaves the running slot booting.

#![forbid(unsafe_code)]

pub mod apply;
pub mod bundle;
pub mod cmdline;
pub mod entries;
pub mod floor;
pub mod gate;
pub mod keys;
pub mod manifest;
pub mod slots;
pub mod state;

mod atomic;
mod updater;

pub use apply::{ApplyError, ApplyReport, Phase, Progress};
pub use cmdline::slot_cmdline;
pub use gate::{decide, Decision, GateInput, HealthSnapshot, NodeHealth, OfflinePolicy, PoolHealth};
pub use slots::Slot;
pub use state::Status;
pub use updater::{since_boot, GateOutcome, ImageInfo, Updater, UpdaterConfig, UpdaterError};

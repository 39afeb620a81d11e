//! Applying a bundle to the inactive slot: the one write path of the updater.
//!
//! The sequence (each step only after the previous one succeeded):
//! 1. refuse unless the running slot's entry is committed (no counter): the fallback is never
//!    overwritten while the running slot is unconfirmed (systemd #34827, checklist #6);
//! 2. read `manifest.json` + `manifest.sig` from the stream and verify the signature, the
//!    board, the `security_version` against the box's floor (no downgrades) and the slot size
//!    — nothing has been written yet;
//! 3. delete the other slot's entries and kernel (fsync the directory): from here on nothing
//!    boots the other slot;
//! 4. stream `vmlinuz` to `<esp>/chrysalis/<slot>/vmlinuz.tmp` and `root.img` onto the other
//!    partition, hashing both; fsync;
//! 5. read the partition back from the medium and compare its sha256;
//! 6. rename the kernel into place (fsync the directory);
//! 7. write the entry **last**: `chrysalis-<slot>+1.conf`, generation = max + 1 over the
//!    entries found at step 3 and the booted generation (tmp, fsync, rename, fsync the directory).
//!
//! A power cut or an error anywhere before the last rename leaves no entry for the other slot,
//! so the running slot keeps booting. Progress goes to a callback so another task can show it.

use std::fs::{self, File};
use std::io::Read;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::bundle::{BundleError, BundleReader, Expect};
use crate::cmdline::{slot_cmdline, BootInfo};
use crate::entries::{self, BootEntry, EntriesError, EntryName, Esp};
use crate::floor::FloorError;
use crate::keys::{KeysError, TrustedKeys};
use crate::slots::{Slot, SlotsConfig, SlotsError};
pub use crate::state::{Phase, Progress};

/// Errors of an apply.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The running slot is on trial: writing the other slot would destroy the fallback.
    #[error(
        "slot {slot} is running unconfirmed ({entry}): the fallback slot is not overwritten \
         until this boot is committed (wait for the health gate, or roll back)"
    )]
    Unconfirmed {
        /// The running slot.
        slot: Slot,
        /// Its entry file.
        entry: String,
    },
    /// The running slot has no boot entry: after a failed trial nothing would boot it.
    #[error("the running slot {slot} has no boot entry in {}; refusing to write the other slot", esp.display())]
    NoOwnEntry {
        /// The running slot.
        slot: Slot,
        /// The ESP.
        esp: PathBuf,
    },
    /// The trusted keys could not be loaded.
    #[error(transparent)]
    Keys(#[from] KeysError),
    /// The security floor is unknown (its record cannot be read or written): nothing is
    /// applied until it is known.
    #[error(transparent)]
    Floor(#[from] FloorError),
    /// The bundle was refused or could not be read.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// A slot device failed.
    #[error(transparent)]
    Slots(#[from] SlotsError),
    /// A boot entry operation failed.
    #[error(transparent)]
    Entries(#[from] EntriesError),
    /// The slot read back differs from what was written.
    #[error("slot {slot} reads back as sha256 {got}, the manifest says {want}")]
    ReadBack {
        /// The slot written.
        slot: Slot,
        /// The manifest's sha256.
        want: String,
        /// What the medium returned.
        got: String,
    },
    /// The kernel could not be written to the ESP.
    #[error("{what} {}", path.display())]
    Kernel {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What an apply did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyReport {
    /// The slot written and armed.
    pub slot: Slot,
    /// The bundle's version.
    pub version: String,
    /// The new entry's generation.
    pub generation: u64,
    /// The entry file (`chrysalis-b+1.conf`).
    pub entry: String,
    /// The trusted key that verified the bundle.
    pub signer: String,
    /// Bytes written to the slot.
    pub root_bytes: u64,
}

/// Everything an apply works on.
#[derive(Clone, Copy, Debug)]
pub struct ApplyContext<'a> {
    /// The ESP.
    pub esp: &'a Esp,
    /// The slot devices.
    pub slots: &'a SlotsConfig,
    /// The trusted keys.
    pub keys: &'a TrustedKeys,
    /// This box's `compatible`.
    pub compatible: &'a str,
    /// The security floor: bundles below it are refused.
    pub min_security_version: u64,
    /// What booted.
    pub boot: &'a BootInfo,
}

/// Step 1: refuses unless the running slot's entry is committed.
pub fn check_confirmed(esp: &Esp, boot: &BootInfo) -> Result<(), ApplyError> {
    let all = esp.slot_entries()?;
    match entries::mine(&all, boot.slot, boot.generation) {
        None => Err(ApplyError::NoOwnEntry { slot: boot.slot, esp: esp.root().to_path_buf() }),
        Some(own) if !own.name.is_committed() => {
            Err(ApplyError::Unconfirmed { slot: boot.slot, entry: own.file_name.clone() })
        }
        Some(_) => Ok(()),
    }
}

/// Applies the bundle read from `reader` to the other slot; see the module docs.
/// `progress` is called at every step and every written megabyte.
pub fn apply<R: Read>(
    ctx: &ApplyContext<'_>,
    reader: R,
    progress: &mut dyn FnMut(&Progress),
) -> Result<ApplyReport, ApplyError> {
    let target = ctx.boot.slot.other();
    let _span = tracing::info_span!("apply", from = %ctx.boot.slot, to = %target).entered();
    let mut state = Progress { phase: Phase::Verifying, slot: Some(target), ..Progress::default() };
    progress(&state);

    check_confirmed(ctx.esp, ctx.boot)?;
    let slot_bytes = ctx.slots.size_bytes(target)?;
    let partuuid = ctx.slots.partuuid(target)?;
    let expect = Expect {
        keys: ctx.keys,
        compatible: ctx.compatible,
        min_security_version: ctx.min_security_version,
        slot_bytes,
    };
    let mut bundle = BundleReader::open(reader, &expect)?;
    let manifest = bundle.manifest().clone();
    let signer = bundle.signer().to_string();
    tracing::info!(
        version = %manifest.version,
        build_id = %manifest.build_id,
        security_version = manifest.security_version,
        floor = ctx.min_security_version,
        %signer,
        "bundle verified"
    );
    state.version = Some(manifest.version.clone());

    // Counted before the other slot's entries go, so generations never repeat.
    let generation = entries::next_generation(&ctx.esp.slot_entries()?, ctx.boot.generation);
    // From here on the other slot is being replaced: first make sure nothing boots it.
    let removed = ctx.esp.remove_slot(target)?;
    if !removed.is_empty() {
        tracing::info!(?removed, "removed the other slot's entries");
    }
    let kernel_path = ctx.esp.kernel_path(target);
    let kernel_tmp = crate::atomic::tmp_path(&kernel_path);
    let kernel_err = |what, source| ApplyError::Kernel { path: kernel_path.clone(), what, source };
    if let Some(dir) = kernel_path.parent() {
        fs::create_dir_all(dir).map_err(|e| kernel_err("creating the directory of", e))?;
    }
    // The old kernel is unreferenced now; dropping it first keeps a small ESP from filling up.
    crate::atomic::remove(&kernel_path).map_err(|e| kernel_err("removing the old", e))?;

    let result = (|| -> Result<(), ApplyError> {
        state.phase = Phase::Kernel;
        progress(&state);
        let mut kernel = File::create(&kernel_tmp).map_err(|e| kernel_err("creating", e))?;
        bundle.copy_kernel(&mut kernel, &kernel_tmp)?;
        kernel.sync_all().map_err(|e| kernel_err("syncing", e))?;
        drop(kernel);

        state.phase = Phase::Root;
        state.bytes_total = manifest.root.size;
        progress(&state);
        let device = ctx.slots.device(target).to_path_buf();
        let mut slot = crate::slots::open_for_write(ctx.slots, target)?;
        bundle.copy_root(&mut slot, &device, &mut |done| {
            state.bytes_done = done;
            progress(&state);
        })?;
        bundle.finish()?;
        slot.sync_all().map_err(|source| SlotsError::Device {
            slot: target,
            path: device.clone(),
            what: "syncing",
            source,
        })?;
        drop(slot);

        state.phase = Phase::ReadBack;
        state.bytes_done = 0;
        progress(&state);
        let got = crate::slots::read_back_sha256(ctx.slots, target, manifest.root.size, &mut |done| {
            state.bytes_done = done;
            progress(&state);
        })?;
        let got = hex::encode(got);
        if got != manifest.root.sha256 {
            return Err(ApplyError::ReadBack { slot: target, want: manifest.root.sha256.clone(), got });
        }

        state.phase = Phase::Arming;
        progress(&state);
        crate::atomic::rename(&kernel_tmp, &kernel_path).map_err(|e| kernel_err("installing", e))?;
        let options = slot_cmdline(target, &partuuid, generation, &manifest);
        ctx.esp
            .write(&EntryName::armed(target), &BootEntry::for_slot(target, &manifest.version, generation, &options))?;
        Ok(())
    })();

    match result {
        Ok(()) => {
            state.phase = Phase::Done;
            progress(&state);
            let entry = EntryName::armed(target).file_name();
            tracing::info!(%entry, generation, version = %manifest.version, "armed a one-shot trial of the new slot");
            Ok(ApplyReport {
                slot: target,
                version: manifest.version.clone(),
                generation,
                entry,
                signer,
                root_bytes: manifest.root.size,
            })
        }
        Err(e) => {
            let _ = crate::atomic::remove(&kernel_tmp);
            Err(e)
        }
    }
}

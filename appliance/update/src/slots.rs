//! The two root slots: which device each is, its size, its PARTUUID, and reading a written
//! image back.
//!
//! On the appliance the slots are the GPT partitions labelled `chrysalis-root-a` and
//! `chrysalis-root-b` (`/dev/disk/by-partlabel/…`), and their PARTUUIDs come from the
//! `/dev/disk/by-partuuid` symlinks udev makes. Both are configurable so tests use regular
//! files as "partitions", a directory of symlinks as `by-partuuid`, or a GPT disk image read
//! with the `gpt` crate ([`PartUuidSource::Gpt`]).
//!
//! The running slot comes from the kernel command line (`chrysalis.slot=`), see
//! [`crate::cmdline`].

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One of the two root slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Slot {
    /// `chrysalis-root-a`, the slot a fresh image boots.
    A,
    /// `chrysalis-root-b`, empty in a fresh image.
    B,
}

impl Slot {
    /// Both slots, A first.
    pub const ALL: [Slot; 2] = [Slot::A, Slot::B];

    /// The other slot.
    pub fn other(self) -> Slot {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }

    /// `"a"` or `"b"`, as in file names and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Slot::A => "a",
            Slot::B => "b",
        }
    }

    /// The GPT partition label of this slot (`chrysalis-root-a`).
    pub fn partlabel(self) -> String {
        format!("chrysalis-root-{}", self.as_str())
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Slot {
    type Err = SlotsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "a" | "A" => Ok(Slot::A),
            "b" | "B" => Ok(Slot::B),
            other => Err(SlotsError::BadSlot(other.to_string())),
        }
    }
}

/// Errors of the slot layout.
#[derive(Debug, thiserror::Error)]
pub enum SlotsError {
    /// A slot name other than `a` or `b`.
    #[error("`{0}` is not a slot (expected `a` or `b`)")]
    BadSlot(String),
    /// The slot device could not be opened or measured.
    #[error("slot {slot} device {}: {what}", path.display())]
    Device {
        /// Which slot.
        slot: Slot,
        /// The device (or file) path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The `by-partuuid` directory could not be read.
    #[error("reading {}", dir.display())]
    PartUuidDir {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No PARTUUID names the slot's device.
    #[error("no PARTUUID found for slot {slot} ({}) in {}", device.display(), searched.display())]
    PartUuidNotFound {
        /// Which slot.
        slot: Slot,
        /// The slot device.
        device: PathBuf,
        /// Where we looked.
        searched: PathBuf,
    },
    /// The GPT of the disk could not be read.
    #[error("reading the GPT of {}", disk.display())]
    Gpt {
        /// The disk image or device.
        disk: PathBuf,
        /// The cause.
        #[source]
        source: gpt::GptError,
    },
    /// The GPT has no partition with the slot's label.
    #[error("the GPT of {} has no partition labelled `{label}`", disk.display())]
    GptLabelNotFound {
        /// The disk image or device.
        disk: PathBuf,
        /// The label looked for.
        label: String,
    },
    /// Reading the slot back ended before the image did.
    #[error("slot {slot} device {}: read back {got} of {want} bytes", path.display())]
    ShortReadBack {
        /// Which slot.
        slot: Slot,
        /// The device path.
        path: PathBuf,
        /// Bytes expected.
        want: u64,
        /// Bytes read.
        got: u64,
    },
}

/// Where the PARTUUID of a slot comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartUuidSource {
    /// A directory of symlinks named by PARTUUID (udev's `/dev/disk/by-partuuid`): the one
    /// resolving to the same file as the slot device wins.
    ByPartUuidDir(PathBuf),
    /// The GPT of this disk (device or image file): the partition labelled
    /// `chrysalis-root-<slot>`.
    Gpt(PathBuf),
}

/// The slot devices of this box.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotsConfig {
    /// The device (or file) of slot A.
    pub a: PathBuf,
    /// The device (or file) of slot B.
    pub b: PathBuf,
    /// Where PARTUUIDs come from.
    pub partuuids: PartUuidSource,
}

impl SlotsConfig {
    /// The fixed appliance layout: `/dev/disk/by-partlabel/chrysalis-root-{a,b}` and
    /// `/dev/disk/by-partuuid`.
    pub fn appliance() -> Self {
        SlotsConfig {
            a: PathBuf::from("/dev/disk/by-partlabel/chrysalis-root-a"),
            b: PathBuf::from("/dev/disk/by-partlabel/chrysalis-root-b"),
            partuuids: PartUuidSource::ByPartUuidDir(PathBuf::from("/dev/disk/by-partuuid")),
        }
    }

    /// The device of `slot`.
    pub fn device(&self, slot: Slot) -> &Path {
        match slot {
            Slot::A => &self.a,
            Slot::B => &self.b,
        }
    }

    /// The size of `slot` in bytes (a block device's size, or a regular file's length).
    pub fn size_bytes(&self, slot: Slot) -> Result<u64, SlotsError> {
        let path = self.device(slot);
        let device_err = |what, source| SlotsError::Device { slot, path: path.to_path_buf(), what, source };
        let mut file = File::open(path).map_err(|e| device_err("opening", e))?;
        // Seeking to the end works for block devices, where metadata().len() is 0.
        file.seek(SeekFrom::End(0)).map_err(|e| device_err("measuring", e))
    }

    /// The PARTUUID of `slot`, lower case (as `PARTUUID=` on the kernel command line).
    pub fn partuuid(&self, slot: Slot) -> Result<String, SlotsError> {
        match &self.partuuids {
            PartUuidSource::ByPartUuidDir(dir) => self.partuuid_from_dir(slot, dir),
            PartUuidSource::Gpt(disk) => partuuid_from_gpt(disk, &slot.partlabel()),
        }
    }

    fn partuuid_from_dir(&self, slot: Slot, dir: &Path) -> Result<String, SlotsError> {
        let device = self.device(slot);
        let target = fs::canonicalize(device).map_err(|source| SlotsError::Device {
            slot,
            path: device.to_path_buf(),
            what: "resolving",
            source,
        })?;
        let listing = fs::read_dir(dir).map_err(|source| SlotsError::PartUuidDir { dir: dir.to_path_buf(), source })?;
        for entry in listing {
            let entry = entry.map_err(|source| SlotsError::PartUuidDir { dir: dir.to_path_buf(), source })?;
            // A dangling link (a partition that went away) is skipped, not fatal.
            let Ok(resolved) = fs::canonicalize(entry.path()) else { continue };
            if resolved == target {
                if let Some(name) = entry.file_name().to_str() {
                    return Ok(name.to_ascii_lowercase());
                }
            }
        }
        Err(SlotsError::PartUuidNotFound { slot, device: device.to_path_buf(), searched: dir.to_path_buf() })
    }
}

/// The PARTUUID of the partition labelled `label` in the GPT of `disk`, lower case.
pub fn partuuid_from_gpt(disk: &Path, label: &str) -> Result<String, SlotsError> {
    let gpt = gpt::GptConfig::new()
        .writable(false)
        .open(disk)
        .map_err(|source| SlotsError::Gpt { disk: disk.to_path_buf(), source })?;
    gpt.partitions()
        .values()
        .find(|p| p.is_used() && p.name == label)
        .map(|p| p.part_guid.hyphenated().to_string().to_ascii_lowercase())
        .ok_or_else(|| SlotsError::GptLabelNotFound { disk: disk.to_path_buf(), label: label.to_string() })
}

/// Opens `slot`'s device for writing an image (no truncation: it is a partition). A block
/// device is opened `O_EXCL`, which the kernel refuses (`EBUSY`) while the device is mounted
/// or held by device-mapper: the running root can never be the target.
pub fn open_for_write(config: &SlotsConfig, slot: Slot) -> Result<File, SlotsError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let path = config.device(slot);
    let device_err = |what, source| SlotsError::Device { slot, path: path.to_path_buf(), what, source };
    let block = fs::metadata(path).map_err(|e| device_err("inspecting", e))?.file_type().is_block_device();
    let mut options = OpenOptions::new();
    options.write(true);
    if block {
        options.custom_flags(rustix::fs::OFlags::EXCL.bits() as i32);
    }
    let what = if block { "opening exclusively for writing" } else { "opening for writing" };
    options.open(path).map_err(|e| device_err(what, e))
}

/// Reads the first `len` bytes of `slot`'s device back from the disk (the page cache is
/// dropped first) and returns their sha256. `on_progress` gets the bytes read so far.
pub fn read_back_sha256(
    config: &SlotsConfig,
    slot: Slot,
    len: u64,
    on_progress: &mut dyn FnMut(u64),
) -> Result<[u8; 32], SlotsError> {
    let path = config.device(slot);
    let device_err = |what, source| SlotsError::Device { slot, path: path.to_path_buf(), what, source };
    let mut file = File::open(path).map_err(|e| device_err("opening to read back", e))?;
    // Best effort: ask the kernel to drop cached pages so the read hits the medium. Pages
    // already flushed by the writer's fsync are clean, so DONTNEED evicts them.
    let _ = rustix::fs::fadvise(&file, 0, NonZeroU64::new(len), rustix::fs::Advice::DontNeed);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < len {
        let want = usize::try_from((len - done).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = match file.read(&mut buf[..want]) {
            Ok(0) => return Err(SlotsError::ShortReadBack { slot, path: path.to_path_buf(), want: len, got: done }),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(device_err("reading back", e)),
        };
        hasher.update(&buf[..n]);
        done += n as u64;
        on_progress(done);
    }
    Ok(hasher.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn slot_names() {
        assert_eq!(Slot::A.other(), Slot::B);
        assert_eq!(Slot::B.other(), Slot::A);
        assert_eq!("b".parse::<Slot>().expect("b"), Slot::B);
        assert!("c".parse::<Slot>().is_err());
        assert_eq!(Slot::B.partlabel(), "chrysalis-root-b");
        assert_eq!(serde_json::to_string(&Slot::A).expect("json"), "\"a\"");
    }

    #[test]
    fn size_and_partuuid_from_symlinks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("root-a");
        let b = dir.path().join("root-b");
        fs::write(&a, vec![0u8; 8192]).expect("a");
        fs::write(&b, vec![0u8; 4096]).expect("b");
        let by = dir.path().join("by-partuuid");
        fs::create_dir(&by).expect("dir");
        std::os::unix::fs::symlink(&a, by.join("AAAAAAAA-0000-4000-8000-000000000001")).expect("link a");
        std::os::unix::fs::symlink(&b, by.join("bbbbbbbb-0000-4000-8000-000000000002")).expect("link b");
        std::os::unix::fs::symlink(dir.path().join("gone"), by.join("dangling")).expect("link");
        let config = SlotsConfig { a, b, partuuids: PartUuidSource::ByPartUuidDir(by) };
        assert_eq!(config.size_bytes(Slot::A).expect("size"), 8192);
        assert_eq!(config.size_bytes(Slot::B).expect("size"), 4096);
        assert_eq!(config.partuuid(Slot::A).expect("a"), "aaaaaaaa-0000-4000-8000-000000000001");
        assert_eq!(config.partuuid(Slot::B).expect("b"), "bbbbbbbb-0000-4000-8000-000000000002");
    }

    #[test]
    fn partuuid_missing_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("root-a");
        fs::write(&a, b"x").expect("a");
        let by = dir.path().join("by-partuuid");
        fs::create_dir(&by).expect("dir");
        let config = SlotsConfig { a: a.clone(), b: a, partuuids: PartUuidSource::ByPartUuidDir(by) };
        assert!(matches!(config.partuuid(Slot::A), Err(SlotsError::PartUuidNotFound { slot: Slot::A, .. })));
    }

    #[test]
    fn partuuid_from_a_gpt_disk_image() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = dir.path().join("disk.img");
        let file = File::create(&disk).expect("create");
        file.set_len(8 << 20).expect("len");
        drop(file);
        let mut gpt = gpt::GptConfig::new().writable(true).create(&disk).expect("gpt");
        gpt.update_partitions(BTreeMap::new()).expect("empty table");
        gpt.add_partition("esp", 1 << 20, gpt::partition_types::EFI, 0, None).expect("esp");
        gpt.add_partition("chrysalis-root-a", 2 << 20, gpt::partition_types::LINUX_FS, 0, None).expect("a");
        gpt.add_partition("chrysalis-root-b", 2 << 20, gpt::partition_types::LINUX_FS, 0, None).expect("b");
        let want_b = gpt
            .partitions()
            .values()
            .find(|p| p.name == "chrysalis-root-b")
            .map(|p| p.part_guid.hyphenated().to_string())
            .expect("b present");
        gpt.write().expect("write gpt");
        let config = SlotsConfig {
            a: dir.path().join("a"),
            b: dir.path().join("b"),
            partuuids: PartUuidSource::Gpt(disk.clone()),
        };
        assert_eq!(config.partuuid(Slot::B).expect("b"), want_b.to_ascii_lowercase());
        assert_ne!(config.partuuid(Slot::A).expect("a"), want_b.to_ascii_lowercase());
        assert!(matches!(partuuid_from_gpt(&disk, "chrysalis-state"), Err(SlotsError::GptLabelNotFound { .. })));
    }

    #[test]
    fn read_back_hashes_the_prefix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a");
        fs::write(&a, b"hello world").expect("a");
        let config = SlotsConfig { a: a.clone(), b: a, partuuids: PartUuidSource::Gpt(PathBuf::new()) };
        let mut seen = 0;
        let sum = read_back_sha256(&config, Slot::A, 5, &mut |n| seen = n).expect("read back");
        assert_eq!(hex::encode(sum), hex::encode(Sha256::digest(b"hello")));
        assert_eq!(seen, 5);
        assert!(matches!(
            read_back_sha256(&config, Slot::A, 100, &mut |_| {}),
            Err(SlotsError::ShortReadBack { got: 11, .. })
        ));
    }
}

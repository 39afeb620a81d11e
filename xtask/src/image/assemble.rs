//! Rootless, deterministic assembly of the disk from a finished root tree: `mkfs.erofs` → the
//! dm-verity hash tree appended (`veritysetup format --no-superblock`) → a FAT32 ESP built in a
//! file (`mkfs.vfat -C` + mtools) → a GPT written by `sfdisk` into a regular file, partitions
//! copied in at their offsets. No loop devices, no mounts, no root needed.
//!
//! Every identifier derives from a seed (`chrysalis/<board>/<label>`) and every timestamp from
//! `SOURCE_DATE_EPOCH`, so the same inputs give the same bytes (see the tests).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// dm-verity data and hash block size (and the erofs block size).
pub const BLOCK: u64 = 4096;
/// GPT partition type of the ESP.
pub const TYPE_ESP: &str = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B";
/// GPT partition type of the root slots (Discoverable Partitions: root, x86-64).
pub const TYPE_ROOT_X86_64: &str = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709";
/// GPT partition type of the state partition (Linux filesystem data).
pub const TYPE_LINUX_DATA: &str = "0FC63DAF-8483-4772-8E79-3D69D8477DE4";
/// Partition labels (fixed by the design; the fstab and the update crate use them).
pub const LABEL_ESP: &str = "esp";
pub const LABEL_ROOT_A: &str = "chrysalis-root-a";
pub const LABEL_ROOT_B: &str = "chrysalis-root-b";
pub const LABEL_STATE: &str = "chrysalis-state";
/// Bytes per MiB.
const MIB: u64 = 1024 * 1024;
/// Sectors are 512 bytes in the image (what QEMU and nearly every disk present).
const SECTOR: u64 = 512;

/// A deterministic id (UUID v4 layout, salt, volume id) from `chrysalis/<board>/<label>`.
#[derive(Debug, Clone)]
pub struct Seed {
    board: String,
}

impl Seed {
    pub fn new(board: &str) -> Seed {
        Seed { board: board.to_string() }
    }

    fn digest(&self, label: &str) -> [u8; 32] {
        Sha256::digest(format!("chrysalis/{}/{label}", self.board).as_bytes()).into()
    }

    /// A UUID with the RFC 4122 version-4 and variant bits set, lower case.
    pub fn uuid(&self, label: &str) -> String {
        let mut b = self.digest(label);
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        let h = hex::encode(&b[..16]);
        format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
    }

    /// 32 bytes of hex (a dm-verity salt).
    pub fn hex32(&self, label: &str) -> String {
        hex::encode(self.digest(label))
    }

    /// 8 hex digits (a FAT volume id).
    pub fn volume_id(&self, label: &str) -> String {
        hex::encode(&self.digest(label)[..4])
    }
}

/// The dm-verity parameters of a root image (what the boot entry and bundles carry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verity {
    pub root_hash: String,
    pub salt: String,
    /// 4096-byte data blocks (= the hash tree's start block).
    pub data_blocks: u64,
    /// Byte offset of the hash tree in the image (= the padded erofs size).
    pub hash_offset: u64,
}

/// `root.img`: erofs padded to 4096 + the hash tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RootImage {
    pub size: u64,
    pub sha256: String,
    pub verity: Verity,
}

/// Packs `tree` into an erofs image at `out` (lz4hc, every file owned by root, every timestamp
/// `epoch`, fixed UUID), pads it to 4096 and appends the dm-verity hash tree.
pub fn make_root(tree: &Path, out: &Path, epoch: u64, seed: &Seed) -> Result<RootImage> {
    let _ = fs::remove_file(out);
    run(
        Command::new("mkfs.erofs")
            .arg("--quiet")
            .arg("-zlz4hc,12")
            .arg(format!("-T{epoch}"))
            .arg(format!("-U{}", seed.uuid("root-fs")))
            .arg("--all-root")
            .arg(out)
            .arg(tree)
            .env("SOURCE_DATE_EPOCH", epoch.to_string()),
        "mkfs.erofs",
    )?;
    let len = fs::metadata(out)?.len();
    let padded = len.div_ceil(BLOCK) * BLOCK;
    fs::OpenOptions::new().write(true).open(out)?.set_len(padded)?;
    let salt = seed.hex32("verity-salt");
    let output = Command::new("veritysetup")
        .args(["format", "--no-superblock", "--data-block-size=4096", "--hash-block-size=4096", "--hash=sha256"])
        .arg(format!("--salt={salt}"))
        .arg(format!("--hash-offset={padded}"))
        .arg(format!("--data-blocks={}", padded / BLOCK))
        .arg(out)
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .context("running veritysetup")?;
    if !output.status.success() {
        bail!("veritysetup format failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let root_hash = text
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|h| h.trim().to_string())
        .with_context(|| format!("no `Root hash:` in veritysetup's output:\n{text}"))?;
    Ok(RootImage {
        size: fs::metadata(out)?.len(),
        sha256: file_sha256(out)?,
        verity: Verity { root_hash, salt, data_blocks: padded / BLOCK, hash_offset: padded },
    })
}

/// One file of the ESP: its path inside the FAT (`EFI/BOOT/BOOTX64.EFI`) and its content.
#[derive(Debug, Clone)]
pub struct EspFile {
    pub path: String,
    pub source: PathBuf,
}

/// Builds a FAT32 image of `size_mib` at `out` holding `files` (directories created as needed),
/// with a seeded volume id and every timestamp `epoch`.
pub fn make_esp(out: &Path, size_mib: u64, files: &[EspFile], epoch: u64, seed: &Seed, work: &Path) -> Result<()> {
    let _ = fs::remove_file(out);
    let epoch_s = epoch.to_string();
    run(
        Command::new("mkfs.vfat")
            .args(["--invariant", "-F", "32", "-S", "512", "-n", "ESP"])
            .arg("-i")
            .arg(seed.volume_id("esp"))
            .arg("-C")
            .arg(out)
            .arg((size_mib * 1024).to_string())
            .env("SOURCE_DATE_EPOCH", &epoch_s)
            .stdout(Stdio::null()),
        "mkfs.vfat",
    )?;
    // mtools stamps new entries with SOURCE_DATE_EPOCH; copied files keep their mtime (-m),
    // which is set to the epoch on a private copy first.
    let staging = work.join("esp-staging");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging)?;
    let mut copies = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let copy = staging.join(format!("{i}"));
        fs::copy(&f.source, &copy).with_context(|| format!("reading {}", f.source.display()))?;
        set_mtime(&copy, epoch)?;
        copies.push((f.path.clone(), copy));
    }
    test_infra::vfat::fill(out, &copies, Some(epoch))?;
    let _ = fs::remove_dir_all(&staging);
    Ok(())
}

/// Sets a file's atime and mtime to `epoch` (via `touch`, which every system has).
fn set_mtime(path: &Path, epoch: u64) -> Result<()> {
    run(Command::new("touch").arg("-d").arg(format!("@{epoch}")).arg(path), "touch")
}

/// One GPT partition.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Partition {
    pub number: u32,
    pub label: String,
    pub type_guid: String,
    pub uuid: String,
    /// Byte offset on the disk.
    pub offset: u64,
    pub size: u64,
}

/// The disk: GPT id, partitions, total size.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Layout {
    pub disk_uuid: String,
    pub size: u64,
    pub partitions: Vec<Partition>,
}

impl Layout {
    /// The fixed layout: 1 MiB for the primary GPT, ESP, root A, root B, state, 1 MiB tail
    /// (backup GPT), every partition 1 MiB aligned.
    pub fn new(seed: &Seed, esp_mib: u64, root_mib: u64, state_mib: u64) -> Layout {
        let mut offset = MIB;
        let mut partitions = Vec::new();
        for (number, (label, type_guid, mib)) in [
            (LABEL_ESP, TYPE_ESP, esp_mib),
            (LABEL_ROOT_A, TYPE_ROOT_X86_64, root_mib),
            (LABEL_ROOT_B, TYPE_ROOT_X86_64, root_mib),
            (LABEL_STATE, TYPE_LINUX_DATA, state_mib),
        ]
        .into_iter()
        .enumerate()
        {
            partitions.push(Partition {
                number: number as u32 + 1,
                label: label.to_string(),
                type_guid: type_guid.to_string(),
                uuid: seed.uuid(&format!("partition/{label}")),
                offset,
                size: mib * MIB,
            });
            offset += mib * MIB;
        }
        Layout { disk_uuid: seed.uuid("disk"), size: offset + MIB, partitions }
    }

    pub fn partition(&self, label: &str) -> Option<&Partition> {
        self.partitions.iter().find(|p| p.label == label)
    }

    /// The `sfdisk` script creating this GPT.
    pub fn sfdisk_script(&self) -> String {
        let mut s = format!(
            "label: gpt\nlabel-id: {}\nunit: sectors\nfirst-lba: 2048\nsector-size: {SECTOR}\n",
            self.disk_uuid.to_uppercase()
        );
        for p in &self.partitions {
            s.push_str(&format!(
                "start={}, size={}, type={}, uuid={}, name=\"{}\"\n",
                p.offset / SECTOR,
                p.size / SECTOR,
                p.type_guid,
                p.uuid.to_uppercase(),
                p.label
            ));
        }
        s
    }
}

/// Writes the GPT of `layout` into a new sparse file `out` and copies `contents`
/// (partition label → image file) to their partitions' offsets; other partitions stay zero.
pub fn make_disk(out: &Path, layout: &Layout, contents: &[(&str, &Path)]) -> Result<()> {
    let _ = fs::remove_file(out);
    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    file.set_len(layout.size)?;
    drop(file);
    let mut child = Command::new("sfdisk")
        .args(["--quiet", "--no-reread", "--no-tell-kernel", "--wipe=never"])
        .arg(out)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("running sfdisk")?;
    child
        .stdin
        .take()
        .context("sfdisk stdin")?
        .write_all(layout.sfdisk_script().as_bytes())
        .context("writing the sfdisk script")?;
    let status = child.wait()?;
    if !status.success() {
        bail!("sfdisk failed ({status}) for:\n{}", layout.sfdisk_script());
    }
    let mut disk = fs::OpenOptions::new().write(true).open(out)?;
    for (label, image) in contents {
        let p = layout.partition(label).with_context(|| format!("no partition {label}"))?;
        let len = fs::metadata(image)?.len();
        if len > p.size {
            bail!("{} ({len} bytes) does not fit partition {label} ({} bytes)", image.display(), p.size);
        }
        copy_sparse(image, &mut disk, p.offset)?;
    }
    disk.sync_all()?;
    Ok(())
}

/// Copies `src` into `dst` at `offset`, seeking over all-zero MiB chunks (the output stays sparse).
fn copy_sparse(src: &Path, dst: &mut fs::File, offset: u64) -> Result<()> {
    let mut input = fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let mut buf = vec![0u8; MIB as usize];
    let mut pos = offset;
    loop {
        let mut n = 0;
        while n < buf.len() {
            let r = input.read(&mut buf[n..])?;
            if r == 0 {
                break;
            }
            n += r;
        }
        if n == 0 {
            return Ok(());
        }
        if buf[..n].iter().any(|&b| b != 0) {
            dst.seek(SeekFrom::Start(pos))?;
            dst.write_all(&buf[..n])?;
        }
        pos += n as u64;
    }
}

/// The slot command line written straight from the README (the appliance section): a test oracle for
/// `update::slot_cmdline`, which the image build uses (one format for images and updates).
#[cfg(test)]
pub fn slot_cmdline(
    partuuid: &str,
    verity: &Verity,
    slot: char,
    version: &str,
    generation: u64,
    security_version: u64,
    board_args: &str,
) -> String {
    let data_sectors = verity.data_blocks * (BLOCK / SECTOR);
    let mut s = format!(
        "dm-mod.create=\"chrysalis-root,,,ro,0 {data_sectors} verity 1 PARTUUID={partuuid} PARTUUID={partuuid} \
         4096 4096 {blocks} {blocks} sha256 {hash} {salt}\" dm-mod.waitfor=PARTUUID={partuuid} root=/dev/dm-0 \
         rootfstype=erofs ro chrysalis.slot={slot} chrysalis.version={version} chrysalis.generation={generation} \
         chrysalis.security_version={security_version} panic=10",
        blocks = verity.data_blocks,
        hash = verity.root_hash,
        salt = verity.salt,
    );
    if !board_args.trim().is_empty() {
        s.push(' ');
        s.push_str(board_args.trim());
    }
    s
}

/// `loader/loader.conf`.
pub const LOADER_CONF: &str = "timeout 0\neditor no\nauto-entries no\nauto-firmware no\n";

/// sha256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("{what}: running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {cmd:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The tools assembly needs, with the Debian package providing each.
#[cfg(test)]
pub const TOOLS: &[(&str, &str)] = &[
    ("mkfs.erofs", "erofs-utils"),
    ("veritysetup", "cryptsetup-bin"),
    ("mkfs.vfat", "dosfstools"),
    ("mcopy", "mtools"),
    ("sfdisk", "fdisk"),
];

/// The first missing tool, if any (tests skip, saying which).
#[cfg(test)]
pub fn missing_tool() -> Option<&'static str> {
    TOOLS.iter().find(|(tool, _)| !which(tool)).map(|(tool, _)| *tool)
}

#[cfg(test)]
fn which(tool: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false)
        || Path::new("/usr/sbin").join(tool).is_file()
        || Path::new("/sbin").join(tool).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_ids_are_stable_v4_uuids() {
        let s = Seed::new("qemu-x86_64");
        let u = s.uuid("disk");
        assert_eq!(u, Seed::new("qemu-x86_64").uuid("disk"));
        assert_ne!(u, Seed::new("x86_64-efi").uuid("disk"));
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"), "{u}");
        assert_eq!(s.volume_id("esp").len(), 8);
        assert_eq!(s.hex32("x").len(), 64);
    }

    #[test]
    fn layout_is_aligned_and_ordered() {
        let l = Layout::new(&Seed::new("b"), 128, 512, 1024);
        let labels: Vec<&str> = l.partitions.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, [LABEL_ESP, LABEL_ROOT_A, LABEL_ROOT_B, LABEL_STATE]);
        assert_eq!(l.partitions[0].offset, MIB);
        for w in l.partitions.windows(2) {
            assert_eq!(w[0].offset + w[0].size, w[1].offset);
        }
        assert!(l.partitions.iter().all(|p| p.offset % MIB == 0));
        assert_eq!(l.size, (1 + 128 + 512 * 2 + 1024 + 1) * MIB);
        assert!(l.sfdisk_script().contains("name=\"chrysalis-root-b\""));
    }

    /// Assembles a small synthetic image twice, a second apart, and compares the bytes: the
    /// same tools and code paths as a real image, in seconds.
    #[test]
    #[cfg_attr(
        not(feature = "image-tests"),
        ignore = "needs the image tools (erofs-utils, cryptsetup-bin, dosfstools, mtools, fdisk): feature xtask/image-tests, which cargo xtask test installs and enables"
    )]
    fn assembly_is_reproducible() {
        if let Some(tool) = missing_tool() {
            panic!("{tool} is not installed (cargo xtask test installs the image tools)");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = dir.path().join("tree");
        fs::create_dir_all(tree.join("usr/bin")).expect("tree");
        fs::write(tree.join("usr/bin/hello"), b"#!/bin/sh\necho hi\n").expect("file");
        fs::write(tree.join("etc-hostname"), b"chrysalis\n").expect("file");
        let kernel = dir.path().join("vmlinuz");
        fs::write(&kernel, vec![7u8; 300_000]).expect("kernel");
        let build = |n: u32| -> (String, String) {
            let out = dir.path().join(format!("out{n}"));
            fs::create_dir_all(&out).expect("out");
            let seed = Seed::new("test");
            let root = make_root(&tree, &out.join("root.img"), 1_700_000_000, &seed).expect("root");
            let layout = Layout::new(&seed, 64, 4, 4);
            let entry = out.join("entry.conf");
            fs::write(&entry, format!("options {} {}\n", layout.partitions[1].uuid, root.verity.root_hash))
                .expect("entry");
            let files = [
                EspFile { path: "EFI/BOOT/BOOTX64.EFI".into(), source: kernel.clone() },
                EspFile { path: "loader/entries/chrysalis-a.conf".into(), source: entry.clone() },
                EspFile { path: "chrysalis/a/vmlinuz".into(), source: kernel.clone() },
            ];
            make_esp(&out.join("esp.img"), 64, &files, 1_700_000_000, &seed, &out).expect("esp");
            let root_img = out.join("root.img");
            let esp_img = out.join("esp.img");
            make_disk(&out.join("disk.raw"), &layout, &[(LABEL_ESP, &esp_img), (LABEL_ROOT_A, &root_img)])
                .expect("disk");
            (file_sha256(&out.join("disk.raw")).expect("hash"), root.verity.root_hash)
        };
        let first = build(1);
        std::thread::sleep(std::time::Duration::from_millis(1100));
        // Touch the tree: mtimes must not leak into the image.
        fs::write(tree.join("etc-hostname"), b"chrysalis\n").expect("rewrite");
        let second = build(2);
        assert_eq!(first, second, "two assemblies of the same inputs differ");
        assert_eq!(first.1.len(), 64);
    }
}

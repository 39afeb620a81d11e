//! End-to-end update flows without root or a real disk: a temp directory is the ESP,
//! regular files are the slot partitions, a directory of symlinks is `/dev/disk/by-partuuid`
//! (or a GPT disk image), and "rebooting" runs a small model of systemd-boot over the ESP
//! (boot order from `update::entries::boot_order`, then the counter rename it does before
//! booting an entry). The boot order itself is checked against the real systemd-boot by the
//! QEMU e2e tests.

use std::fs;
use std::io::{self, Read};
use std::path::PathBuf;
use std::time::Duration;

use update::bundle::{self, ManifestFields};
use update::cmdline::{slot_cmdline, CmdlineSource};
use update::entries::{BootEntry, Counter, EntryName, Esp};
use update::floor::{FloorReason, Recorded};
use update::gate::{self, GateInput, HealthSnapshot, OfflinePolicy, PoolHealth};
use update::keys::SigningKey;
use update::manifest::{Blob, Manifest, RootImage, Verity, FORMAT};
use update::slots::{PartUuidSource, SlotsConfig};
use update::state::Records;
use update::state::{Action, SlotState};
use update::{GateOutcome, ImageInfo, Phase, Slot, Updater, UpdaterConfig, UpdaterError};

const COMPATIBLE: &str = "chrysalis-qemu-x86_64";
const SLOT_BYTES: u64 = 64 * 1024;
const UUID_A: &str = "aaaaaaaa-1111-4111-8111-000000000001";
const UUID_B: &str = "bbbbbbbb-2222-4222-8222-000000000002";
/// The fresh image's security_version (slot A).
const IMAGE_SECURITY_VERSION: u64 = 1;

/// A fake box: ESP, state dir, trusted keys, slot files, by-partuuid links.
struct Rig {
    dir: tempfile::TempDir,
    key: SigningKey,
    config: UpdaterConfig,
}

fn pattern(seed: &str, len: usize) -> Vec<u8> {
    let mut x: u32 = seed.bytes().fold(2166136261, |h, b| (h ^ u32::from(b)).wrapping_mul(16777619));
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

impl Rig {
    /// A freshly flashed box running slot A, generation 1; slot B holds `0xEE` garbage.
    fn new() -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for sub in ["esp", "state", "keys", "by-partuuid"] {
            fs::create_dir_all(root.join(sub)).expect("mkdir");
        }
        let key = SigningKey::from_bytes(&[42u8; 32]);
        fs::write(root.join("keys/dev.pub"), update::keys::public_key_text(&key.verifying_key())).expect("pub");
        let (a, b) = (root.join("root-a"), root.join("root-b"));
        fs::write(&a, vec![0xAAu8; SLOT_BYTES as usize]).expect("slot a");
        fs::write(&b, vec![0xEEu8; SLOT_BYTES as usize]).expect("slot b");
        std::os::unix::fs::symlink(&a, root.join("by-partuuid").join(UUID_A)).expect("link");
        std::os::unix::fs::symlink(&b, root.join("by-partuuid").join(UUID_B)).expect("link");

        // What the image build writes for slot A.
        let image = manifest_for("0.1.0", IMAGE_SECURITY_VERSION, &pattern("0.1.0", 12 * 4096), b"kernel 0.1.0");
        let options = slot_cmdline(Slot::A, UUID_A, 1, &image);
        let esp = Esp::new(root.join("esp"));
        esp.write(&EntryName::plain(Slot::A), &BootEntry::for_slot(Slot::A, "0.1.0", 1, &options)).expect("entry");
        fs::create_dir_all(root.join("esp/chrysalis/a")).expect("mkdir");
        fs::write(esp.kernel_path(Slot::A), b"kernel 0.1.0").expect("kernel");

        let config = UpdaterConfig {
            esp: root.join("esp"),
            state_dir: root.join("state"),
            trusted_keys: root.join("keys"),
            slots: SlotsConfig { a, b, partuuids: PartUuidSource::ByPartUuidDir(root.join("by-partuuid")) },
            cmdline: CmdlineSource::Literal(options),
            compatible: COMPATIBLE.to_string(),
            security_version: IMAGE_SECURITY_VERSION,
        };
        Rig { dir, key, config }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn esp(&self) -> Esp {
        Esp::new(&self.config.esp)
    }

    fn updater(&self) -> Updater {
        Updater::open(self.config.clone())
    }

    /// Builds a signed bundle of `version` (root image of `blocks` 4 KiB blocks) at the
    /// image's security_version.
    fn bundle(&self, version: &str, blocks: u64) -> (PathBuf, Manifest) {
        self.bundle_with(version, blocks, &self.key, COMPATIBLE)
    }

    fn bundle_with(&self, version: &str, blocks: u64, key: &SigningKey, compatible: &str) -> (PathBuf, Manifest) {
        self.bundle_full(version, IMAGE_SECURITY_VERSION, blocks, key, compatible)
    }

    /// A bundle of `version` at `security_version`.
    fn bundle_sv(&self, version: &str, security_version: u64) -> (PathBuf, Manifest) {
        self.bundle_full(version, security_version, 12, &self.key, COMPATIBLE)
    }

    fn bundle_full(
        &self,
        version: &str,
        security_version: u64,
        blocks: u64,
        key: &SigningKey,
        compatible: &str,
    ) -> (PathBuf, Manifest) {
        let work = self.path(&format!("build-{version}-{compatible}-{security_version}"));
        fs::create_dir_all(&work).expect("mkdir");
        let (root, kernel) = (work.join("root.img"), work.join("vmlinuz"));
        fs::write(&root, pattern(version, (blocks * 4096) as usize)).expect("root");
        fs::write(&kernel, format!("kernel {version}")).expect("kernel");
        let fields = ManifestFields {
            compatible: compatible.to_string(),
            version: version.to_string(),
            build_id: format!("build-{version}"),
            security_version,
            verity: verity(blocks),
            cmdline: "console=ttyS0,115200".to_string(),
        };
        let out = work.join(format!("{version}.chrysalis-bundle"));
        let manifest = bundle::create(&root, &kernel, &fields, key, &out).expect("create bundle");
        (out, manifest)
    }

    /// Reboots: systemd-boot picks the first entry of its order, bumps a counter if the entry
    /// has one, and boots its options. The updater then sees that command line.
    fn reboot(&mut self) -> String {
        let esp = self.esp();
        let order = esp.boot_order().expect("boot order");
        let first = order.first().expect("something boots").clone();
        let entry = esp.list().expect("list").into_iter().find(|f| f.file_name == first).expect("entry");
        if let Some(Counter { left, done }) = entry.counter {
            let name = EntryName::parse(&first).expect("chrysalis entry");
            let next = EntryName { counter: Some(Counter { left: left.saturating_sub(1), done: done + 1 }), ..name };
            esp.rename(&first, &next).expect("systemd-boot's rename");
        }
        self.config.cmdline = CmdlineSource::Literal(entry.entry.options.clone());
        // The booted root's image.json says what the bundle's manifest (and so the entry) said.
        self.config.security_version = entry.entry.security_version().expect("the entry names its security_version");
        first
    }

    fn entry_names(&self) -> Vec<String> {
        self.esp().list().expect("list").into_iter().map(|f| f.file_name).collect()
    }
}

fn verity(blocks: u64) -> Verity {
    let data_blocks = blocks - 1;
    Verity { root_hash: "5a".repeat(32), salt: "c3".repeat(32), data_blocks, hash_offset: data_blocks * 4096 }
}

fn manifest_for(version: &str, security_version: u64, root: &[u8], kernel: &[u8]) -> Manifest {
    use sha2::Digest;
    Manifest {
        format: FORMAT,
        compatible: COMPATIBLE.to_string(),
        version: version.to_string(),
        build_id: format!("build-{version}"),
        security_version,
        kernel: Blob { sha256: hex::encode(sha2::Sha256::digest(kernel)), size: kernel.len() as u64 },
        root: RootImage {
            sha256: hex::encode(sha2::Sha256::digest(root)),
            size: root.len() as u64,
            verity: verity(root.len() as u64 / 4096),
        },
        cmdline: "console=ttyS0,115200".to_string(),
    }
}

fn unhealthy() -> HealthSnapshot {
    HealthSnapshot {
        supervisor_ready: false,
        nodes: vec![],
        pools: vec![PoolHealth { name: "base/small".into(), warm: 0, target: 1 }],
        api_reachable: true,
    }
}

fn kind(result: Result<impl std::fmt::Debug, UpdaterError>) -> &'static str {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.kind(),
    }
}

/// A reader that fails after `limit` bytes, like a connection dropped mid-upload.
struct FailAfter<R> {
    inner: R,
    left: usize,
}

impl<R: Read> Read for FailAfter<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "client went away"));
        }
        let n = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..n])?;
        self.left -= n;
        Ok(n)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_arms_b_then_commit_after_trial_boot() {
    let mut rig = Rig::new();
    let a_entry_before = fs::read(rig.path("esp/loader/entries/chrysalis-a.conf")).expect("a entry");
    let (bundle, manifest) = rig.bundle("0.2.0", 12);
    let updater = rig.updater();
    let before = updater.status().await.expect("status");
    assert!(before.confirmed && !before.trial_in_progress);
    assert_eq!(before.other.as_ref().map(|o| o.state), Some(SlotState::Empty));

    let body = tokio::fs::File::open(&bundle).await.expect("open bundle");
    let report = updater.apply(body).await.expect("apply");
    assert_eq!((report.slot, report.generation, report.entry.as_str()), (Slot::B, 2, "chrysalis-b+1.conf"));
    assert_eq!(report.signer, "dev.pub");

    // The entry: last write, counted, generation 2, the designed command line.
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b+1.conf"]);
    let text = fs::read_to_string(rig.path("esp/loader/entries/chrysalis-b+1.conf")).expect("b entry");
    let want = BootEntry::for_slot(Slot::B, "0.2.0", 2, &slot_cmdline(Slot::B, UUID_B, 2, &manifest)).render();
    assert_eq!(text, want);
    assert!(text.contains(&format!("PARTUUID={UUID_B}")) && text.contains("chrysalis.slot=b"), "{text}");
    // The slot holds the image, the kernel is in place, A is untouched.
    let slot = fs::read(&rig.config.slots.b).expect("slot b");
    assert_eq!(&slot[..12 * 4096], &pattern("0.2.0", 12 * 4096)[..]);
    assert!(slot[12 * 4096..].iter().all(|&b| b == 0xEE), "nothing written past the image");
    assert_eq!(fs::read(rig.esp().kernel_path(Slot::B)).expect("kernel"), b"kernel 0.2.0");
    assert!(!rig.path("esp/chrysalis/b/vmlinuz.tmp").exists());
    assert_eq!(fs::read(rig.path("esp/loader/entries/chrysalis-a.conf")).expect("a"), a_entry_before);
    assert!(fs::read(&rig.config.slots.a).expect("slot a").iter().all(|&b| b == 0xAA));

    let status = updater.status().await.expect("status");
    assert_eq!(status.progress.phase, Phase::Done);
    assert_eq!(status.progress.bytes_done, status.progress.bytes_total);
    assert_eq!(status.progress.bytes_total, 12 * 4096);
    let other = status.other.expect("other");
    assert_eq!((other.state, other.generation, other.version.as_deref()), (SlotState::Armed, Some(2), Some("0.2.0")));
    let last = status.last_attempt.expect("recorded");
    assert!(last.ok && last.action == Action::Apply && last.generation == Some(2));

    // Reboot: systemd-boot tries B once (renaming it +0-1).
    assert_eq!(rig.reboot(), "chrysalis-b+1.conf");
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b+0-1.conf"]);
    let updater = rig.updater();
    let trial = updater.status().await.expect("status");
    assert_eq!((trial.slot, trial.generation, trial.version.as_deref()), (Slot::B, Some(2), Some("0.2.0")));
    assert!(trial.trial_in_progress && !trial.confirmed);

    // Checklist #6: no update while unconfirmed; the fallback A is not touched.
    let (next, _) = rig.bundle("0.3.0", 12);
    let body = tokio::fs::File::open(&next).await.expect("open");
    assert_eq!(kind(updater.apply(body).await), "unconfirmed");
    assert!(fs::read(&rig.config.slots.a).expect("slot a").iter().all(|&b| b == 0xAA));
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b+0-1.conf"]);

    // Healthy: the gate commits.
    let healthy = HealthSnapshot { supervisor_ready: true, ..unhealthy() };
    let healthy = HealthSnapshot { pools: vec![PoolHealth { name: "p".into(), warm: 1, target: 1 }], ..healthy };
    let decision = gate::decide(&GateInput {
        elapsed: Duration::from_secs(30),
        deadline: Duration::from_secs(600),
        health: healthy,
        offline: OfflinePolicy::CommitLocal,
    });
    assert_eq!(updater.act(&decision).await.expect("act"), GateOutcome::Committed { entry: "chrysalis-b.conf".into() });
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b.conf"]);
    assert_eq!(updater.status().await.expect("status").last_attempt.map(|a| a.action), Some(Action::Commit));
    // B keeps booting.
    assert_eq!(rig.reboot(), "chrysalis-b.conf");
    let status = rig.updater().status().await.expect("status");
    assert!(status.confirmed);
    assert_eq!(status.other.map(|o| (o.slot, o.state)), Some((Slot::A, SlotState::Good)));

    // And the next update goes to A with generation 3.
    let body = tokio::fs::File::open(&next).await.expect("open");
    let report = rig.updater().apply(body).await.expect("apply to A");
    assert_eq!((report.slot, report.generation), (Slot::A, 3));
    assert_eq!(rig.entry_names(), ["chrysalis-a+1.conf", "chrysalis-b.conf"]);
}

#[test]
fn tampered_root_or_kernel_is_refused_and_no_entry_is_written() {
    for member in [bundle::ROOT_MEMBER, bundle::KERNEL_MEMBER] {
        let rig = Rig::new();
        let (path, _) = rig.bundle("0.2.0", 12);
        let info = bundle::inspect(&path).expect("inspect");
        let m = info.iter().find(|m| m.name == member).expect("member");
        let mut bytes = fs::read(&path).expect("read");
        bytes[(m.data_offset + m.size / 2) as usize] ^= 0x01;
        let err = rig.updater().apply_blocking(&bytes[..]).expect_err("tampered bundle applied");
        assert_eq!(err.kind(), "tampered", "{member}: {err}");
        assert!(err.to_string().contains(member), "{err}");
        assert_eq!(rig.entry_names(), ["chrysalis-a.conf"], "{member}");
        assert!(!rig.esp().kernel_path(Slot::B).exists() && !rig.path("esp/chrysalis/b/vmlinuz.tmp").exists());
        let status = rig.updater().status_blocking().expect("status");
        let last = status.last_attempt.expect("recorded");
        assert!(!last.ok && last.message.contains("does not match the signed manifest"), "{}", last.message);
        assert_eq!(status.other.map(|o| o.state), Some(SlotState::Empty));
    }
}

#[test]
fn bad_bundles_are_refused_before_any_byte_is_written() {
    let rig = Rig::new();
    // B holds an older committed entry: a refusal must not even remove it.
    let esp = rig.esp();
    let old = BootEntry::for_slot(Slot::B, "0.0.9", 0, "chrysalis.slot=b chrysalis.generation=0");
    esp.write(&EntryName::plain(Slot::B), &old).expect("old b");
    fs::create_dir_all(rig.path("esp/chrysalis/b")).expect("mkdir");
    fs::write(esp.kernel_path(Slot::B), b"old kernel").expect("old kernel");
    let untouched = || {
        assert!(fs::read(&rig.config.slots.b).expect("slot b").iter().all(|&b| b == 0xEE), "slot B was written");
        assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b.conf"]);
        assert_eq!(fs::read(esp.kernel_path(Slot::B)).expect("kernel"), b"old kernel");
    };

    let (good, _) = rig.bundle("0.2.0", 12);
    let bytes = fs::read(&good).expect("read");
    let info = bundle::inspect(&good).expect("inspect");

    // Unsigned: manifest.json directly followed by vmlinuz and root.img.
    let mut builder = tar::Builder::new(Vec::new());
    for m in info.iter().filter(|m| m.name != bundle::SIGNATURE_MEMBER) {
        let mut header = tar::Header::new_ustar();
        header.set_path(&m.name).expect("path");
        header.set_size(m.size);
        header.set_cksum();
        builder.append(&header, &bytes[m.data_offset as usize..(m.data_offset + m.size) as usize]).expect("append");
    }
    let unsigned = builder.into_inner().expect("tar");
    assert_eq!(kind(rig.updater().apply_blocking(&unsigned[..])), "unsigned");
    untouched();

    // Signed by a key the box does not trust.
    let (foreign, _) = rig.bundle_with("0.2.1", 12, &SigningKey::from_bytes(&[9u8; 32]), COMPATIBLE);
    assert_eq!(kind(rig.updater().apply_blocking(fs::File::open(&foreign).expect("open"))), "unknown-key");
    untouched();

    // The manifest edited after signing (one flipped byte).
    let mut edited = bytes.clone();
    edited[info[0].data_offset as usize + 5] ^= 0x01;
    assert_eq!(kind(rig.updater().apply_blocking(&edited[..])), "unknown-key");
    untouched();

    // A bundle for another board.
    let (other_board, _) = rig.bundle_with("0.2.2", 12, &rig.key, "chrysalis-x86_64-efi");
    let err = rig.updater().apply_blocking(fs::File::open(&other_board).expect("open")).expect_err("incompatible");
    assert_eq!(err.kind(), "incompatible");
    assert!(err.to_string().contains("chrysalis-x86_64-efi"), "{err}");
    untouched();

    // A root image larger than the slot.
    let (huge, _) = rig.bundle("0.2.3", SLOT_BYTES / 4096 + 1);
    let err = rig.updater().apply_blocking(fs::File::open(&huge).expect("open")).expect_err("too large");
    assert_eq!(err.kind(), "too-large");
    untouched();

    // No trusted keys at all.
    let mut config = rig.config.clone();
    config.trusted_keys = rig.path("no-keys");
    fs::create_dir_all(&config.trusted_keys).expect("mkdir");
    assert_eq!(kind(Updater::open(config).apply_blocking(&bytes[..])), "unknown-key");
    untouched();

    // And the good bundle still applies afterwards (replacing the old B entry).
    rig.updater().apply_blocking(&bytes[..]).expect("good bundle");
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b+1.conf"]);
}

#[test]
fn an_interrupted_upload_leaves_a_booting() {
    let mut rig = Rig::new();
    let a_entry = fs::read(rig.path("esp/loader/entries/chrysalis-a.conf")).expect("a");
    let (path, _) = rig.bundle("0.2.0", 12);
    let bytes = fs::read(&path).expect("read");
    let half = bytes.len() / 2;
    // The connection drops at 50%: root.img is half written.
    let updater = rig.updater();
    let err = updater.apply_blocking(FailAfter { inner: &bytes[..], left: half }).expect_err("interrupted");
    assert_eq!(err.kind(), "bundle-read", "{err}");
    assert_ne!(fs::read(&rig.config.slots.b).expect("slot b")[..4096], [0xEEu8; 4096][..], "the write had begun");
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf"]);
    assert_eq!(fs::read(rig.path("esp/loader/entries/chrysalis-a.conf")).expect("a"), a_entry);
    let status = updater.status_blocking().expect("status");
    assert_eq!(status.progress.phase, Phase::Failed);
    assert!(status.progress.error.as_deref().is_some_and(|e| e.contains("client went away")), "{:?}", status.progress);
    assert_eq!(status.other.map(|o| o.state), Some(SlotState::Empty));
    // The stream simply ends at 50% (a power cut on the sender's side looks like this).
    let err = rig.updater().apply_blocking(&bytes[..half]).expect_err("truncated");
    assert_eq!(err.kind(), "malformed-bundle", "{err}");
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf"]);
    // What boots: A.
    assert_eq!(rig.reboot(), "chrysalis-a.conf");
    assert!(rig.updater().status_blocking().expect("status").confirmed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_trial_reverts_to_a() {
    let mut rig = Rig::new();
    let (path, _) = rig.bundle("0.2.0+fault", 12);
    rig.updater().apply(tokio::fs::File::open(&path).await.expect("open")).await.expect("apply");
    assert_eq!(rig.reboot(), "chrysalis-b+1.conf");
    let updater = rig.updater();
    let input = |secs| GateInput {
        elapsed: Duration::from_secs(secs),
        deadline: Duration::from_secs(600),
        health: unhealthy(),
        offline: OfflinePolicy::CommitLocal,
    };
    assert_eq!(updater.act(&gate::decide(&input(300))).await.expect("act"), GateOutcome::Waiting);
    let outcome = updater.act(&gate::decide(&input(601))).await.expect("act");
    match &outcome {
        GateOutcome::RebootNeeded { entry, reason } => {
            assert_eq!(entry, "chrysalis-b+0-1.conf");
            assert!(reason.contains("supervisor not ready"), "{reason}");
        }
        other => panic!("expected RebootNeeded, got {other:?}"),
    }
    let last = updater.status().await.expect("status").last_attempt.expect("record");
    assert_eq!((last.action, last.ok), (Action::Revert, true));
    assert!(last.message.contains("pool base/small warm 0/1"), "{}", last.message);
    // Reboot: the bad entry sorts last, A boots, and A is still committed.
    assert_eq!(rig.reboot(), "chrysalis-a.conf");
    let status = rig.updater().status().await.expect("status");
    assert_eq!(status.slot, Slot::A);
    assert!(status.confirmed);
    assert_eq!(status.other.as_ref().map(|o| o.state), Some(SlotState::Bad));
    // Rollback to a failed slot is refused; a new apply is allowed and gets generation 3.
    assert_eq!(kind(rig.updater().rollback().await), "other-not-good");
    let (path, _) = rig.bundle("0.2.1", 12);
    let report = rig.updater().apply(tokio::fs::File::open(&path).await.expect("open")).await.expect("apply");
    assert_eq!((report.slot, report.generation), (Slot::B, 3));
    assert_eq!(rig.entry_names(), ["chrysalis-a.conf", "chrysalis-b+1.conf"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_after_a_committed_update() {
    let mut rig = Rig::new();
    assert_eq!(kind(rig.updater().rollback().await), "nothing-to-roll-back-to");
    let (path, _) = rig.bundle("0.2.0", 12);
    rig.updater().apply(tokio::fs::File::open(&path).await.expect("open")).await.expect("apply");
    // Armed but not yet tried: not a rollback target.
    assert_eq!(kind(rig.updater().rollback().await), "other-not-good");
    rig.reboot();
    rig.updater().commit().await.expect("commit");
    assert_eq!(rig.reboot(), "chrysalis-b.conf");
    let done = rig.updater().rollback().await.expect("rollback");
    assert_eq!((done.slot, done.generation, done.version.as_deref()), (Slot::A, 3, Some("0.1.0")));
    assert_eq!(rig.reboot(), "chrysalis-a.conf");
    let status = rig.updater().status().await.expect("status");
    assert_eq!((status.slot, status.generation, status.confirmed), (Slot::A, Some(3), true));
    assert_eq!(status.other.map(|o| (o.state, o.generation)), Some((SlotState::Good, Some(2))));
    assert_eq!(status.last_attempt.map(|a| a.action), Some(Action::Rollback));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_operation_at_a_time() {
    let rig = Rig::new();
    let (path, _) = rig.bundle("0.2.0", 12);
    let bytes = fs::read(&path).expect("read");
    let updater = rig.updater();
    let (mut tx, rx) = tokio::io::duplex(4096);
    let first = tokio::spawn({
        let updater = updater.clone();
        async move { updater.apply(rx).await }
    });
    // Feed the first third, then check a concurrent operation is refused.
    use tokio::io::AsyncWriteExt;
    tx.write_all(&bytes[..bytes.len() / 3]).await.expect("feed");
    let mut progress = updater.progress();
    tokio::time::timeout(Duration::from_secs(10), progress.wait_for(|p| p.phase == Phase::Root && p.bytes_done > 0))
        .await
        .expect("progress within 10s")
        .expect("progress channel");
    assert_eq!(kind(updater.apply(&b""[..]).await), "busy");
    assert_eq!(kind(updater.rollback().await), "busy");
    tx.write_all(&bytes[bytes.len() / 3..]).await.expect("feed rest");
    drop(tx);
    let report = first.await.expect("join").expect("first apply");
    assert_eq!(report.entry, "chrysalis-b+1.conf");
}

#[test]
fn partuuids_from_a_gpt_disk_image() {
    let mut rig = Rig::new();
    let disk = rig.path("disk.img");
    let file = fs::File::create(&disk).expect("disk");
    file.set_len(8 << 20).expect("len");
    drop(file);
    let mut gpt = gpt::GptConfig::new().writable(true).create(&disk).expect("gpt");
    gpt.update_partitions(std::collections::BTreeMap::new()).expect("table");
    gpt.add_partition("esp", 1 << 20, gpt::partition_types::EFI, 0, None).expect("esp");
    gpt.add_partition("chrysalis-root-a", 2 << 20, gpt::partition_types::LINUX_FS, 0, None).expect("a");
    gpt.add_partition("chrysalis-root-b", 2 << 20, gpt::partition_types::LINUX_FS, 0, None).expect("b");
    let b_uuid = gpt
        .partitions()
        .values()
        .find(|p| p.name == "chrysalis-root-b")
        .map(|p| p.part_guid.hyphenated().to_string())
        .expect("b");
    gpt.write().expect("write");
    rig.config.slots.partuuids = PartUuidSource::Gpt(disk);
    let (path, _) = rig.bundle("0.2.0", 12);
    rig.updater().apply_blocking(fs::File::open(&path).expect("open")).expect("apply");
    let text = fs::read_to_string(rig.path("esp/loader/entries/chrysalis-b+1.conf")).expect("entry");
    assert!(text.contains(&format!("dm-mod.waitfor=PARTUUID={b_uuid} ")), "{text}");
}

#[test]
fn status_needs_a_slot_on_the_command_line() {
    let mut rig = Rig::new();
    rig.config.cmdline = CmdlineSource::Literal("root=/dev/sda1 quiet".into());
    assert_eq!(kind(rig.updater().status_blocking()), "not-booted-from-slot");
    let image_json = rig.path("image.json");
    fs::write(&image_json, r#"{"board":"qemu-x86_64","version":"0.1.0","security_version":4}"#).expect("write");
    let image = ImageInfo::load(&image_json).expect("image.json");
    assert_eq!((image.compatible.as_str(), image.security_version), (COMPATIBLE, 4));
    // An image.json without its security_version is a broken build: updates stay off.
    fs::write(&image_json, r#"{"board":"qemu-x86_64","version":"0.1.0"}"#).expect("write");
    let err = ImageInfo::load(&image_json).expect_err("no security_version");
    assert_eq!(err.kind(), "image-json");
    assert!(err.to_string().contains("security_version"), "{err}");
}

/// The security floor on the rig's state directory.
fn floor(rig: &Rig) -> Option<u64> {
    Records::new(&rig.config.state_dir).floor().expect("floor record").floor()
}

#[test]
fn a_lower_security_version_is_refused_before_anything_is_written() {
    let mut rig = Rig::new();
    rig.config.security_version = 2;
    // B holds an older committed entry: a refusal must not even remove it.
    let esp = rig.esp();
    let old = BootEntry::for_slot(Slot::B, "0.0.9", 0, "chrysalis.slot=b chrysalis.generation=0");
    esp.write(&EntryName::plain(Slot::B), &old).expect("old b");
    fs::create_dir_all(rig.path("esp/chrysalis/b")).expect("mkdir");
    fs::write(esp.kernel_path(Slot::B), b"old kernel").expect("old kernel");
    let slot_b = fs::read(&rig.config.slots.b).expect("slot b");
    let entries_before: Vec<(String, Vec<u8>)> = rig
        .entry_names()
        .into_iter()
        .map(|n| (n.clone(), fs::read(rig.path(&format!("esp/loader/entries/{n}"))).expect("entry")))
        .collect();

    let (lower, _) = rig.bundle_sv("0.0.8", 1);
    let updater = rig.updater();
    let err = updater.apply_blocking(fs::File::open(&lower).expect("open")).expect_err("downgrade applied");
    assert_eq!(err.kind(), "downgrade", "{err}");
    assert!(err.is_refusal());
    let text = err.to_string();
    assert!(text.contains("security_version 1") && text.contains("floor 2"), "{text}");
    // Nothing written: slot bytes, entries, kernel.
    assert_eq!(fs::read(&rig.config.slots.b).expect("slot b"), slot_b, "slot B changed");
    let entries_after: Vec<(String, Vec<u8>)> = rig
        .entry_names()
        .into_iter()
        .map(|n| (n.clone(), fs::read(rig.path(&format!("esp/loader/entries/{n}"))).expect("entry")))
        .collect();
    assert_eq!(entries_after, entries_before);
    assert_eq!(fs::read(esp.kernel_path(Slot::B)).expect("kernel"), b"old kernel");
    // The first start of a committed slot recorded its level; the refusal is on record.
    assert_eq!(floor(&rig), Some(2));
    let status = updater.status_blocking().expect("status");
    assert_eq!((status.security_version, status.security_floor), (2, Some(2)));
    assert_eq!(status.progress.phase, Phase::Failed);
    assert!(status.progress.error.as_deref().is_some_and(|e| e.contains("floor 2")), "{:?}", status.progress);
    let last = status.last_attempt.expect("recorded");
    assert!(!last.ok && last.message.contains("security_version 1") && last.message.contains("floor 2"), "{last:?}");

    // Equal is allowed (a same-level update or a re-install), and higher too.
    rig.updater().apply_blocking(fs::File::open(&rig.bundle_sv("0.2.0", 2).0).expect("open")).expect("equal");
    rig.updater().apply_blocking(fs::File::open(&rig.bundle_sv("0.3.0", 3).0).expect("open")).expect("higher");
    assert_eq!(floor(&rig), Some(2), "applying does not raise the floor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_rises_on_commit_only() {
    let mut rig = Rig::new();
    assert_eq!(rig.updater().reconcile_floor_blocking().expect("first start"), 1);
    match Records::new(&rig.config.state_dir).floor().expect("floor") {
        Recorded::Present(r) => {
            assert_eq!((r.security_version, r.slot, r.reason), (1, Slot::A, FloorReason::FirstBoot))
        }
        other => panic!("first boot recorded nothing: {other:?}"),
    }

    // A failed trial of a level-3 bundle: applied, tried, reverted: the floor stays 1.
    let (three, _) = rig.bundle_sv("0.3.0+fault", 3);
    rig.updater().apply(tokio::fs::File::open(&three).await.expect("open")).await.expect("apply");
    assert_eq!(floor(&rig), Some(1), "apply raised the floor");
    assert_eq!(rig.reboot(), "chrysalis-b+1.conf");
    let trial = rig.updater();
    assert_eq!(trial.reconcile_floor_blocking().expect("trial start"), 1);
    let st = trial.status().await.expect("status");
    assert_eq!((st.security_version, st.security_floor, st.trial_in_progress), (3, Some(1), true));
    let revert = gate::decide(&GateInput {
        elapsed: Duration::from_secs(601),
        deadline: Duration::from_secs(600),
        health: unhealthy(),
        offline: OfflinePolicy::CommitLocal,
    });
    assert!(matches!(trial.act(&revert).await.expect("act"), GateOutcome::RebootNeeded { .. }));
    assert_eq!(floor(&rig), Some(1), "a failed trial raised the floor");
    assert_eq!(rig.reboot(), "chrysalis-a.conf");
    assert_eq!(rig.updater().reconcile_floor_blocking().expect("back on A"), 1);

    // The same level again, committed this time: the floor becomes 3.
    let (good, _) = rig.bundle_sv("0.3.0", 3);
    rig.updater().apply(tokio::fs::File::open(&good).await.expect("open")).await.expect("apply");
    rig.reboot();
    assert_eq!(floor(&rig), Some(1));
    let committed = rig.updater().commit().await.expect("commit");
    assert_eq!(committed.entry, "chrysalis-b.conf");
    assert_eq!(floor(&rig), Some(3), "the commit did not raise the floor");
    match Records::new(&rig.config.state_dir).floor().expect("floor") {
        Recorded::Present(r) => {
            assert_eq!((r.slot, r.reason, r.version.as_deref()), (Slot::B, FloorReason::Commit, Some("0.3.0")))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.reboot(), "chrysalis-b.conf");

    // Now level 2 is a downgrade: refused with A byte-identical; rollback to A (level 1) too.
    let slot_a = fs::read(&rig.config.slots.a).expect("slot a");
    let entries = rig.entry_names();
    let (two, _) = rig.bundle_sv("0.2.9", 2);
    let err = rig.updater().apply(tokio::fs::File::open(&two).await.expect("open")).await.expect_err("downgrade");
    assert_eq!(err.kind(), "downgrade", "{err}");
    assert_eq!(fs::read(&rig.config.slots.a).expect("slot a"), slot_a, "slot A was written");
    assert_eq!(rig.entry_names(), entries);
    let err = rig.updater().rollback().await.expect_err("rollback below the floor");
    assert_eq!(err.kind(), "below-security-floor", "{err}");
    assert!(err.is_refusal());
    assert!(err.to_string().contains("security_version 1") && err.to_string().contains("floor 3"), "{err}");
    assert_eq!(rig.entry_names(), entries);
    let st = rig.updater().status().await.expect("status");
    assert_eq!((st.security_version, st.security_floor), (3, Some(3)));
    assert_eq!(st.other.and_then(|o| o.security_version), Some(1));
    // A re-install at the floor is allowed.
    rig.updater().apply(tokio::fs::File::open(&good).await.expect("open")).await.expect("equal level");
}

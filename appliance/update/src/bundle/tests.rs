use super::*;
use crate::keys::{TrustedKey, VerifyingKey};

pub(crate) fn keys_for(key: &SigningKey) -> TrustedKeys {
    TrustedKeys::from_keys(
        PathBuf::from("/trusted"),
        vec![TrustedKey { name: "test.pub".into(), key: VerifyingKey::from(key) }],
    )
}

fn fixture(dir: &Path) -> (PathBuf, PathBuf, ManifestFields) {
    let root = dir.join("root.img");
    let kernel = dir.join("vmlinuz");
    let mut data = vec![0u8; 3 * 4096 + 100];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    std::fs::write(&root, &data).expect("root");
    std::fs::write(&kernel, b"MZ kernel bytes").expect("kernel");
    let fields = ManifestFields {
        compatible: "chrysalis-qemu-x86_64".into(),
        version: "0.2.0".into(),
        build_id: "b1".into(),
        security_version: 5,
        verity: Verity { root_hash: "ab".repeat(32), salt: "cd".repeat(32), data_blocks: 2, hash_offset: 2 * 4096 },
        cmdline: "console=ttyS0".into(),
    };
    (root, kernel, fields)
}

fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, data) in members {
        let mut header = tar::Header::new_ustar();
        header.set_path(name).expect("path");
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append(&header, *data).expect("append");
    }
    builder.into_inner().expect("finish")
}

/// A bundle made by [`create`] from [`fixture`] and signed with the `[1; 32]` key, at
/// `x.chrysalis-bundle` in its own temporary directory, with what went in and what came out.
struct Built {
    dir: tempfile::TempDir,
    root: PathBuf,
    kernel: PathBuf,
    fields: ManifestFields,
    key: SigningKey,
    out: PathBuf,
    /// What [`create`] returned.
    manifest: Manifest,
    /// The bundle file.
    bytes: Vec<u8>,
    /// Its members, as [`inspect`] reads them.
    members: Vec<MemberInfo>,
    /// Trusts `key` alone.
    keys: TrustedKeys,
}

impl Built {
    fn new() -> Built {
        let dir = tempfile::tempdir().expect("tempdir");
        let (root, kernel, fields) = fixture(dir.path());
        let key = SigningKey::from_bytes(&[1u8; 32]);
        let out = dir.path().join("x.chrysalis-bundle");
        let manifest = create(&root, &kernel, &fields, &key, &out).expect("create");
        let bytes = std::fs::read(&out).expect("read");
        let members = inspect(&out).expect("inspect");
        let keys = keys_for(&key);
        Built { dir, root, kernel, fields, key, out, manifest, bytes, members, keys }
    }

    /// What a box that should accept this bundle expects: its key, its `compatible`, a
    /// 1 MiB slot.
    fn expect(&self) -> Expect<'_> {
        Expect { keys: &self.keys, compatible: "chrysalis-qemu-x86_64", min_security_version: 5, slot_bytes: 1 << 20 }
    }

    /// The data of member `index` (in [`MEMBERS`] order).
    fn member_data(&self, index: usize) -> &[u8] {
        let m = &self.members[index];
        &self.bytes[m.data_offset as usize..(m.data_offset + m.size) as usize]
    }
}

#[test]
fn create_then_stream() {
    let built = Built::new();
    let names: Vec<&str> = built.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, MEMBERS);
    let again = built.dir.path().join("y.chrysalis-bundle");
    create(&built.root, &built.kernel, &built.fields, &built.key, &again).expect("create again");
    assert_eq!(built.bytes, std::fs::read(&again).expect("b"), "bundles are reproducible");

    let mut reader = BundleReader::open(File::open(&built.out).expect("open"), &built.expect()).expect("verify");
    assert_eq!(reader.manifest(), &built.manifest);
    assert_eq!(reader.signer(), "test.pub");
    let mut k = Vec::new();
    reader.copy_kernel(&mut k, Path::new("k")).expect("kernel");
    let mut r = Vec::new();
    let mut last = 0;
    reader.copy_root(&mut r, Path::new("r"), &mut |n| last = n).expect("root");
    reader.finish().expect("finish");
    assert_eq!(k, std::fs::read(&built.kernel).expect("kernel"));
    assert_eq!(r, std::fs::read(&built.root).expect("root"));
    assert_eq!(last, r.len() as u64);
}

#[test]
fn refusals_before_any_payload() {
    let built = Built::new();
    let bytes = &built.bytes;
    let ok = built.expect();
    let open = |b: &[u8], e: &Expect<'_>| BundleReader::open(b, e).map(|_| ());

    let other = keys_for(&SigningKey::from_bytes(&[2u8; 32]));
    let wrong_key = Expect { keys: &other, ..ok };
    assert!(matches!(open(bytes, &wrong_key), Err(BundleError::UnknownKey { keys: 1, .. })));
    let none = TrustedKeys::default();
    assert!(matches!(open(bytes, &Expect { keys: &none, ..ok }), Err(BundleError::UnknownKey { keys: 0, .. })));
    assert!(matches!(
        open(bytes, &Expect { compatible: "chrysalis-x86_64-efi", ..ok }),
        Err(BundleError::Incompatible { ref want, ref got }) if want == "chrysalis-x86_64-efi" && got == "chrysalis-qemu-x86_64"
    ));
    // The floor: equal passes (above), one more is a downgrade; checked after the
    // signature, so an unsigned claim of a high security_version gets nowhere.
    let err = open(bytes, &Expect { min_security_version: 6, ..ok }).expect_err("downgrade");
    assert!(matches!(err, BundleError::Downgrade { bundle: 5, floor: 6 }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("security_version 5") && text.contains("floor 6"), "{text}");
    open(bytes, &Expect { min_security_version: 0, ..ok }).expect("no floor");
    assert!(matches!(
        open(bytes, &Expect { keys: &other, min_security_version: 6, ..ok }),
        Err(BundleError::UnknownKey { .. })
    ));
    assert!(matches!(
        open(bytes, &Expect { slot_bytes: 4096, ..ok }),
        Err(BundleError::TooLarge { slot_bytes: 4096, image_bytes }) if image_bytes == 3 * 4096 + 100
    ));

    // A flipped byte in the manifest: the signature no longer verifies.
    let mut edited = bytes.clone();
    let pos = built.members[0].data_offset as usize + 20;
    edited[pos] ^= 0x01;
    // Keep the header checksum valid: only data changed.
    assert!(matches!(open(&edited, &ok), Err(BundleError::UnknownKey { .. })));

    let manifest_bytes = built.member_data(0);
    let sig = built.member_data(1);
    let kernel_bytes = std::fs::read(&built.kernel).expect("k");
    // Unsigned: the kernel follows the manifest directly, or the stream ends.
    assert!(matches!(
        open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes), (KERNEL_MEMBER, &kernel_bytes)]), &ok),
        Err(BundleError::Unsigned)
    ));
    assert!(matches!(open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes)]), &ok), Err(BundleError::Unsigned)));
    assert!(matches!(
        open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes), (SIGNATURE_MEMBER, b"\n")]), &ok),
        Err(BundleError::Unsigned)
    ));
    assert!(matches!(
        open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes), (SIGNATURE_MEMBER, b"not base64!")]), &ok),
        Err(BundleError::BadSignature { .. })
    ));
    assert!(matches!(
        open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes), (SIGNATURE_MEMBER, b"AAAA")]), &ok),
        Err(BundleError::BadSignature { .. })
    ));
    // Out of order / unexpected.
    assert!(matches!(
        open(&tar_of(&[(SIGNATURE_MEMBER, sig), (MANIFEST_MEMBER, manifest_bytes)]), &ok),
        Err(BundleError::OutOfOrder { expected: MANIFEST_MEMBER, .. })
    ));
    assert!(matches!(
        open(&tar_of(&[("README", b"hi"), (MANIFEST_MEMBER, manifest_bytes)]), &ok),
        Err(BundleError::UnexpectedMember { ref name }) if name == "README"
    ));
    assert!(matches!(
        open(&tar_of(&[(MANIFEST_MEMBER, manifest_bytes), ("extra", b"x"), (SIGNATURE_MEMBER, sig)]), &ok),
        Err(BundleError::UnexpectedMember { .. })
    ));
    assert!(matches!(open(&[], &ok), Err(BundleError::MissingMember { member: MANIFEST_MEMBER })));
    // A corrupted header checksum.
    let mut broken = bytes.clone();
    broken[10] ^= 0x20;
    assert!(matches!(open(&broken, &ok), Err(BundleError::BadHeader { offset: 0, .. })));
}

#[test]
fn payload_errors() {
    let built = Built::new();
    let (bytes, members) = (&built.bytes, &built.members);
    let ok = built.expect();
    let run = |b: &[u8]| -> Result<(), BundleError> {
        let mut r = BundleReader::open(b, &ok)?;
        r.copy_kernel(&mut io::sink(), Path::new("k"))?;
        r.copy_root(&mut io::sink(), Path::new("r"), &mut |_| {})?;
        r.finish().map(|_| ())
    };
    run(bytes).expect("intact bundle");
    for (index, member) in [(2usize, KERNEL_MEMBER), (3, ROOT_MEMBER)] {
        let mut edited = bytes.clone();
        edited[members[index].data_offset as usize + 3] ^= 0x80;
        match run(&edited) {
            Err(BundleError::Tampered { member: m, want, got }) => {
                assert_eq!(m, member);
                assert_ne!(want, got);
            }
            other => panic!("{member}: expected Tampered, got {other:?}"),
        }
    }
    // Cut inside root.img.
    let cut = &bytes[..members[3].data_offset as usize + 1000];
    assert!(matches!(run(cut), Err(BundleError::Truncated { member: ROOT_MEMBER, .. })));
    // Cut before root.img.
    let cut = &bytes[..members[3].data_offset as usize - BLOCK];
    assert!(matches!(run(cut), Err(BundleError::MissingMember { member: ROOT_MEMBER })));
    // An extra member after root.img.
    let mut extra = bytes[..bytes.len() - 2 * BLOCK].to_vec();
    extra.extend(tar_of(&[("extra.txt", b"x")]));
    assert!(matches!(run(&extra), Err(BundleError::UnexpectedMember { ref name }) if name == "extra.txt"));
    // Root before kernel.
    let manifest = built.member_data(0);
    let sig = built.member_data(1);
    let rootb = std::fs::read(&built.root).expect("root");
    let kern = std::fs::read(&built.kernel).expect("kernel");
    let swapped =
        tar_of(&[(MANIFEST_MEMBER, manifest), (SIGNATURE_MEMBER, sig), (ROOT_MEMBER, &rootb), (KERNEL_MEMBER, &kern)]);
    assert!(matches!(run(&swapped), Err(BundleError::OutOfOrder { expected: KERNEL_MEMBER, .. })));
    // A symlink member is never a regular file.
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Symlink);
    header.set_path(MANIFEST_MEMBER).expect("path");
    header.set_link_name("/etc/passwd").expect("link");
    header.set_size(0);
    header.set_cksum();
    builder.append(&header, &[][..]).expect("append");
    let link = builder.into_inner().expect("tar");
    assert!(matches!(BundleReader::open(&link[..], &ok), Err(BundleError::UnexpectedMember { .. })));
}

#[test]
fn octal_and_base256_sizes() {
    assert_eq!(parse_octal(b"00000001750\0"), Some(1000));
    assert_eq!(parse_octal(b"           \0"), Some(0));
    assert_eq!(parse_octal(b"12x"), None);
    let mut header = tar::Header::new_ustar();
    header.set_path("root.img").expect("path");
    header.set_size(9 << 30);
    header.set_cksum();
    let block: [u8; BLOCK] = header.as_bytes()[..].try_into().expect("block");
    assert_eq!(parse_header(&block, 0).expect("parse"), Some(("root.img".to_string(), 9 << 30)));
}

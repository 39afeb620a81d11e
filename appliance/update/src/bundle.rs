//! The update bundle (`*.chrysalis-bundle`): making one, and reading one as a stream.
//!
//! A bundle is an uncompressed ustar archive with exactly these members, in this order:
//! `manifest.json`, `manifest.sig` (base64 of the 64-byte ed25519 signature over the exact
//! manifest bytes), `vmlinuz`, `root.img`. The order lets a box verify the signature before it
//! writes a single byte, then stream the kernel and the root image straight from the HTTP body
//! to their destinations while hashing them: nothing is buffered and nothing is trusted before
//! it is checked.
//!
//! [`BundleReader::open`] reads the manifest and the signature, verifies the signature against
//! the trusted keys, then checks `compatible`, the `security_version` against the box's floor
//! (no downgrades) and the slot size. Only then does the caller
//! prepare the destinations and call [`BundleReader::copy_kernel`],
//! [`BundleReader::copy_root`] and [`BundleReader::finish`]. Each copy compares size and sha256
//! with the manifest; a mismatch is [`BundleError::Tampered`] and the caller discards what
//! was written (no boot entry ever points at it).
//!
//! The reader parses ustar headers itself (it is a fixed, tiny subset: regular files, no
//! extensions), so a member of any other type, a missing or extra member, or a bad header
//! checksum is a typed error, never a surprise.

use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use ed25519_dalek::Signer as _;
use sha2::{Digest, Sha256};

use crate::keys::{Signature, SigningKey, TrustedKeys};
use crate::manifest::{Blob, Manifest, ManifestError, RootImage, Verity, FORMAT};

/// First member: the manifest.
pub const MANIFEST_MEMBER: &str = "manifest.json";
/// Second member: the signature over the manifest.
pub const SIGNATURE_MEMBER: &str = "manifest.sig";
/// Third member: the kernel.
pub const KERNEL_MEMBER: &str = "vmlinuz";
/// Fourth member: the root image.
pub const ROOT_MEMBER: &str = "root.img";
/// The member order.
pub const MEMBERS: [&str; 4] = [MANIFEST_MEMBER, SIGNATURE_MEMBER, KERNEL_MEMBER, ROOT_MEMBER];
/// The file extension of bundles.
pub const EXTENSION: &str = "chrysalis-bundle";

const BLOCK: usize = 512;
const MAX_MANIFEST: u64 = 1 << 20;
const MAX_SIGNATURE: u64 = 4096;
const CHUNK: usize = 1 << 20;

/// Errors of making or reading a bundle.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// No `manifest.sig` follows the manifest (or it is empty).
    #[error("the bundle is not signed (no manifest.sig after manifest.json)")]
    Unsigned,
    /// `manifest.sig` is not a well-formed ed25519 signature.
    #[error("manifest.sig is not a valid ed25519 signature: {reason}")]
    BadSignature {
        /// What is wrong with it.
        reason: String,
    },
    /// No trusted key verifies the signature: the bundle was signed by a key this box does
    /// not trust, or `manifest.json` was changed after signing.
    #[error(
        "manifest.sig does not verify under any of the {keys} trusted keys in {} \
         (signed by an unknown key, or manifest.json was altered)",
        dir.display()
    )]
    UnknownKey {
        /// The trusted-keys directory.
        dir: PathBuf,
        /// How many keys it holds.
        keys: usize,
    },
    /// The bundle's signed `security_version` is below the box's floor: installing it would
    /// bring back vulnerabilities a committed update fixed.
    #[error(
        "the bundle's security_version {bundle} is lower than this box's security floor {floor} \
         (the highest security_version it has committed): a downgrade is refused; install a \
         bundle with security_version {floor} or higher"
    )]
    Downgrade {
        /// The bundle's `security_version`.
        bundle: u64,
        /// The box's floor.
        floor: u64,
    },
    /// The bundle is for another board.
    #[error("the bundle is for `{got}`, this box is `{want}`")]
    Incompatible {
        /// This box's `compatible`.
        want: String,
        /// The bundle's.
        got: String,
    },
    /// A member's content does not match the signed manifest.
    #[error("{member} does not match the signed manifest: sha256 {got}, manifest says {want}")]
    Tampered {
        /// The member.
        member: &'static str,
        /// The manifest's sha256.
        want: String,
        /// The sha256 of what was received.
        got: String,
    },
    /// A member's size does not match the signed manifest.
    #[error("{member} is {got} bytes, the signed manifest says {want}")]
    SizeMismatch {
        /// The member.
        member: &'static str,
        /// The manifest's size.
        want: u64,
        /// The archive header's size.
        got: u64,
    },
    /// A known member in the wrong place.
    #[error("bundle members out of order: expected {expected}, found {got}")]
    OutOfOrder {
        /// The member expected here.
        expected: &'static str,
        /// The member found.
        got: String,
    },
    /// A member that is not part of the format (or not a regular file).
    #[error("unexpected bundle member `{name}`")]
    UnexpectedMember {
        /// Its name (and tar type when not a regular file).
        name: String,
    },
    /// The archive ended before a member.
    #[error("the bundle ends before {member}")]
    MissingMember {
        /// The missing member.
        member: &'static str,
    },
    /// The archive ended inside a member.
    #[error("the bundle ends inside {member}: {got} of {want} bytes")]
    Truncated {
        /// The member.
        member: &'static str,
        /// Its size.
        want: u64,
        /// Bytes received.
        got: u64,
    },
    /// The root image does not fit the slot.
    #[error("root.img is {image_bytes} bytes, the slot holds {slot_bytes}")]
    TooLarge {
        /// The slot's size.
        slot_bytes: u64,
        /// The image's size.
        image_bytes: u64,
    },
    /// `manifest.json` or `manifest.sig` is implausibly large.
    #[error("{member} is {size} bytes (limit {limit})")]
    MemberTooLarge {
        /// The member.
        member: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A broken archive header.
    #[error("bad tar header at byte {offset}: {reason}")]
    BadHeader {
        /// Offset of the header in the bundle.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The signed manifest is invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Reading the bundle stream failed.
    #[error("reading the bundle ({what})")]
    Read {
        /// What was being read.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Writing a member to its destination failed.
    #[error("writing {member} to {}", dest.display())]
    Write {
        /// The member.
        member: &'static str,
        /// The destination.
        dest: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// An input or output file of [`create`] failed.
    #[error("{what} {}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The manifest fields [`create`] does not compute itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestFields {
    /// `chrysalis-<board>`.
    pub compatible: String,
    /// The version.
    pub version: String,
    /// The build id.
    pub build_id: String,
    /// The anti-rollback level (see [`Manifest::security_version`]).
    pub security_version: u64,
    /// The verity parameters of `root.img`.
    pub verity: Verity,
    /// The board's kernel arguments.
    pub cmdline: String,
}

/// Makes a signed bundle at `out` (written to a temporary sibling, then renamed) from a root
/// image and a kernel. Hashes and sizes are computed here; member timestamps come from
/// `SOURCE_DATE_EPOCH` (0 when unset), so the same inputs give the same bundle.
pub fn create(
    root_img: &Path,
    kernel: &Path,
    fields: &ManifestFields,
    key: &SigningKey,
    out: &Path,
) -> Result<Manifest, BundleError> {
    let kernel_blob = hash_file(kernel)?;
    let root_blob = hash_file(root_img)?;
    let manifest = Manifest {
        format: FORMAT,
        compatible: fields.compatible.clone(),
        version: fields.version.clone(),
        build_id: fields.build_id.clone(),
        security_version: fields.security_version,
        kernel: kernel_blob,
        root: RootImage { sha256: root_blob.sha256, size: root_blob.size, verity: fields.verity.clone() },
        cmdline: fields.cmdline.clone(),
    };
    manifest.validate()?;
    let manifest_bytes = manifest.to_bytes();
    let signature = base64::engine::general_purpose::STANDARD.encode(key.sign(&manifest_bytes).to_bytes());
    let mtime = std::env::var("SOURCE_DATE_EPOCH").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);

    let tmp = crate::atomic::tmp_path(out);
    let file_err = |path: &Path, what, source| BundleError::File { path: path.to_path_buf(), what, source };
    let file = File::create(&tmp).map_err(|e| file_err(&tmp, "creating", e))?;
    let mut builder = tar::Builder::new(io::BufWriter::with_capacity(CHUNK, file));
    let mut append = |name: &str, size: u64, data: &mut dyn Read| -> io::Result<()> {
        let mut header = tar::Header::new_ustar();
        header.set_path(name)?;
        header.set_size(size);
        header.set_mode(0o644);
        header.set_mtime(mtime);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_cksum();
        builder.append(&header, data)
    };
    append(MANIFEST_MEMBER, manifest_bytes.len() as u64, &mut &manifest_bytes[..])
        .map_err(|e| file_err(&tmp, "writing", e))?;
    append(SIGNATURE_MEMBER, signature.len() as u64, &mut signature.as_bytes())
        .map_err(|e| file_err(&tmp, "writing", e))?;
    for (name, path, size) in
        [(KERNEL_MEMBER, kernel, manifest.kernel.size), (ROOT_MEMBER, root_img, manifest.root.size)]
    {
        let input = File::open(path).map_err(|e| file_err(path, "opening", e))?;
        // `take` pins the size the header announced even if the file grows meanwhile.
        let mut reader = BufReader::with_capacity(CHUNK, input).take(size);
        append(name, size, &mut reader).map_err(|e| file_err(path, "archiving", e))?;
    }
    let writer = builder.into_inner().map_err(|e| file_err(&tmp, "finishing", e))?;
    let file = writer.into_inner().map_err(|e| file_err(&tmp, "flushing", e.into_error()))?;
    file.sync_all().map_err(|e| file_err(&tmp, "syncing", e))?;
    drop(file);
    crate::atomic::rename(&tmp, out).map_err(|e| file_err(out, "installing", e))?;
    // A file that changed between hashing and archiving makes a bundle every box refuses;
    // catch it here instead.
    let again = hash_file(root_img)?;
    if again.sha256 != manifest.root.sha256 {
        return Err(BundleError::Tampered { member: ROOT_MEMBER, want: manifest.root.sha256, got: again.sha256 });
    }
    Ok(manifest)
}

fn hash_file(path: &Path) -> Result<Blob, BundleError> {
    let err = |what, source| BundleError::File { path: path.to_path_buf(), what, source };
    let mut file = File::open(path).map_err(|e| err("opening", e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(err("hashing", e)),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(Blob { sha256: hex::encode(hasher.finalize()), size })
}

/// What a box requires of a bundle before anything is written.
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    /// The keys signatures must verify under.
    pub keys: &'a TrustedKeys,
    /// This box's `compatible` (`chrysalis-<board>`).
    pub compatible: &'a str,
    /// The lowest `security_version` this box accepts (its floor; 0 accepts every bundle).
    pub min_security_version: u64,
    /// The size of the slot `root.img` goes to.
    pub slot_bytes: u64,
}

/// One member header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    /// The member name.
    pub name: String,
    /// Offset of its data in the bundle.
    pub data_offset: u64,
    /// Its size.
    pub size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Kernel,
    Root,
    End,
    Done,
}

/// A bundle being read from a stream; see the module docs for the call order.
pub struct BundleReader<R> {
    inner: R,
    offset: u64,
    manifest: Manifest,
    signer: String,
    stage: Stage,
}

impl<R: Read> BundleReader<R> {
    /// Reads `manifest.json` and `manifest.sig`, verifies the signature, then checks
    /// `compatible`, the `security_version` floor and that the root image fits the slot.
    /// Nothing past the signature is read.
    pub fn open(inner: R, expect: &Expect<'_>) -> Result<BundleReader<R>, BundleError> {
        let mut reader =
            BundleReader { inner, offset: 0, manifest: placeholder(), signer: String::new(), stage: Stage::Kernel };
        let first = reader.next_member()?.ok_or(BundleError::MissingMember { member: MANIFEST_MEMBER })?;
        if first.name != MANIFEST_MEMBER {
            return Err(misplaced(MANIFEST_MEMBER, first.name));
        }
        let manifest_bytes = reader.read_small(MANIFEST_MEMBER, first.size, MAX_MANIFEST)?;
        let signature_text = match reader.next_member()? {
            None => return Err(BundleError::Unsigned),
            Some(m) if m.name == SIGNATURE_MEMBER => reader.read_small(SIGNATURE_MEMBER, m.size, MAX_SIGNATURE)?,
            Some(m) if m.name == KERNEL_MEMBER || m.name == ROOT_MEMBER => return Err(BundleError::Unsigned),
            Some(m) => return Err(misplaced(SIGNATURE_MEMBER, m.name)),
        };
        let signature = decode_signature(&signature_text)?;
        let signer = expect
            .keys
            .verify(&manifest_bytes, &signature)
            .ok_or_else(|| BundleError::UnknownKey { dir: expect.keys.dir().to_path_buf(), keys: expect.keys.len() })?;
        reader.signer = signer.to_string();
        // Only signed bytes are parsed.
        let manifest = Manifest::parse(&manifest_bytes)?;
        if manifest.compatible != expect.compatible {
            return Err(BundleError::Incompatible { want: expect.compatible.to_string(), got: manifest.compatible });
        }
        if manifest.security_version < expect.min_security_version {
            return Err(BundleError::Downgrade {
                bundle: manifest.security_version,
                floor: expect.min_security_version,
            });
        }
        if manifest.root.size > expect.slot_bytes {
            return Err(BundleError::TooLarge { slot_bytes: expect.slot_bytes, image_bytes: manifest.root.size });
        }
        reader.manifest = manifest;
        Ok(reader)
    }

    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The trusted key file that verified the signature (`dev.pub`).
    pub fn signer(&self) -> &str {
        &self.signer
    }

    /// Streams `vmlinuz` into `out` (`dest` names it in errors) and checks size and sha256.
    pub fn copy_kernel(&mut self, out: &mut dyn Write, dest: &Path) -> Result<(), BundleError> {
        if self.stage != Stage::Kernel {
            return Err(BundleError::OutOfOrder { expected: ROOT_MEMBER, got: KERNEL_MEMBER.to_string() });
        }
        let want = self.manifest.kernel.clone();
        self.copy_member(KERNEL_MEMBER, &want, out, dest, &mut |_| {})?;
        self.stage = Stage::Root;
        Ok(())
    }

    /// Streams `root.img` into `out`, calling `progress` with the bytes written so far, and
    /// checks size and sha256.
    pub fn copy_root(
        &mut self,
        out: &mut dyn Write,
        dest: &Path,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), BundleError> {
        if self.stage != Stage::Root {
            return Err(BundleError::OutOfOrder { expected: KERNEL_MEMBER, got: ROOT_MEMBER.to_string() });
        }
        let want = Blob { sha256: self.manifest.root.sha256.clone(), size: self.manifest.root.size };
        self.copy_member(ROOT_MEMBER, &want, out, dest, progress)?;
        self.stage = Stage::End;
        Ok(())
    }

    /// Checks that nothing but the end-of-archive marker follows `root.img`.
    pub fn finish(mut self) -> Result<Manifest, BundleError> {
        if self.stage != Stage::End {
            return Err(BundleError::MissingMember { member: ROOT_MEMBER });
        }
        if let Some(extra) = self.next_member()? {
            return Err(BundleError::UnexpectedMember { name: extra.name });
        }
        self.stage = Stage::Done;
        Ok(self.manifest)
    }

    fn copy_member(
        &mut self,
        member: &'static str,
        want: &Blob,
        out: &mut dyn Write,
        dest: &Path,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), BundleError> {
        let header = self.next_member()?.ok_or(BundleError::MissingMember { member })?;
        if header.name != member {
            return Err(misplaced(member, header.name));
        }
        if header.size != want.size {
            return Err(BundleError::SizeMismatch { member, want: want.size, got: header.size });
        }
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut done = 0u64;
        while done < want.size {
            let chunk = usize::try_from((want.size - done).min(CHUNK as u64)).unwrap_or(CHUNK);
            let n = match self.inner.read(&mut buf[..chunk]) {
                Ok(0) => return Err(BundleError::Truncated { member, want: want.size, got: done }),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(BundleError::Read { what: member.to_string(), source }),
            };
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|source| BundleError::Write {
                member,
                dest: dest.to_path_buf(),
                source,
            })?;
            done += n as u64;
            self.offset += n as u64;
            progress(done);
        }
        self.skip_padding(member, want.size)?;
        let got = hex::encode(hasher.finalize());
        if got != want.sha256 {
            return Err(BundleError::Tampered { member, want: want.sha256.clone(), got });
        }
        Ok(())
    }

    fn read_small(&mut self, member: &'static str, size: u64, limit: u64) -> Result<Vec<u8>, BundleError> {
        if size > limit {
            return Err(BundleError::MemberTooLarge { member, size, limit });
        }
        let mut bytes = vec![0u8; usize::try_from(size).unwrap_or(0)];
        self.read_exact(&mut bytes, member, size)?;
        self.skip_padding(member, size)?;
        Ok(bytes)
    }

    fn skip_padding(&mut self, member: &'static str, size: u64) -> Result<(), BundleError> {
        let pad = (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64;
        let mut buf = [0u8; BLOCK];
        self.read_exact(&mut buf[..pad as usize], member, size)
    }

    fn read_exact(&mut self, buf: &mut [u8], member: &'static str, size: u64) -> Result<(), BundleError> {
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.offset += buf.len() as u64;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                Err(BundleError::Truncated { member, want: size, got: 0 })
            }
            Err(source) => Err(BundleError::Read { what: member.to_string(), source }),
        }
    }

    /// The next member header; `None` at the end-of-archive marker or a clean end of stream.
    fn next_member(&mut self) -> Result<Option<MemberInfo>, BundleError> {
        let mut block = [0u8; BLOCK];
        let mut got = 0;
        while got < BLOCK {
            match self.inner.read(&mut block[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => {
                    return Err(BundleError::BadHeader { offset: self.offset, reason: "truncated header".to_string() })
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(BundleError::Read { what: "a member header".to_string(), source }),
            }
        }
        let offset = self.offset;
        self.offset += BLOCK as u64;
        let Some((name, size)) = parse_header(&block, offset)? else { return Ok(None) };
        Ok(Some(MemberInfo { name, data_offset: self.offset, size }))
    }
}

/// Lists the members of a bundle file without verifying anything (tools and tests: e.g. to
/// find where `root.img`'s data starts).
pub fn inspect(path: &Path) -> Result<Vec<MemberInfo>, BundleError> {
    use std::io::{Seek, SeekFrom};
    let mut file =
        File::open(path).map_err(|source| BundleError::File { path: path.into(), what: "opening", source })?;
    let mut out = Vec::new();
    let mut offset = 0u64;
    loop {
        let mut block = [0u8; BLOCK];
        match file.read_exact(&mut block) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(source) => return Err(BundleError::Read { what: "a member header".to_string(), source }),
        }
        let Some((name, size)) = parse_header(&block, offset)? else { break };
        let data_offset = offset + BLOCK as u64;
        out.push(MemberInfo { name, data_offset, size });
        offset = data_offset + size.div_ceil(BLOCK as u64) * BLOCK as u64;
        file.seek(SeekFrom::Start(offset))
            .map_err(|source| BundleError::Read { what: "seeking".to_string(), source })?;
    }
    Ok(out)
}

fn placeholder() -> Manifest {
    Manifest {
        format: FORMAT,
        compatible: String::new(),
        version: String::new(),
        build_id: String::new(),
        security_version: 0,
        kernel: Blob { sha256: String::new(), size: 0 },
        root: RootImage {
            sha256: String::new(),
            size: 0,
            verity: Verity { root_hash: String::new(), salt: String::new(), data_blocks: 0, hash_offset: 0 },
        },
        cmdline: String::new(),
    }
}

fn misplaced(expected: &'static str, got: String) -> BundleError {
    if MEMBERS.contains(&got.as_str()) {
        BundleError::OutOfOrder { expected, got }
    } else {
        BundleError::UnexpectedMember { name: got }
    }
}

fn decode_signature(text: &[u8]) -> Result<Signature, BundleError> {
    let trimmed: Vec<u8> = text.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
    if trimmed.is_empty() {
        return Err(BundleError::Unsigned);
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&trimmed)
        .map_err(|e| BundleError::BadSignature { reason: format!("not base64: {e}") })?;
    let bytes: [u8; 64] = bytes
        .try_into()
        .map_err(|b: Vec<u8>| BundleError::BadSignature { reason: format!("{} bytes, expected 64", b.len()) })?;
    Ok(Signature::from_bytes(&bytes))
}

/// Parses one ustar header block: `None` for an all-zero block (end of archive).
fn parse_header(block: &[u8; BLOCK], offset: u64) -> Result<Option<(String, u64)>, BundleError> {
    if block.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let bad = |reason: String| BundleError::BadHeader { offset, reason };
    let stored = parse_octal(&block[148..156]).ok_or_else(|| bad("unreadable checksum".to_string()))?;
    let sum: u64 = block
        .iter()
        .enumerate()
        .map(|(i, &b)| if (148..156).contains(&i) { u64::from(b' ') } else { u64::from(b) })
        .sum();
    if stored != sum {
        return Err(bad(format!("checksum {stored} != computed {sum}")));
    }
    let name = field_str(&block[0..100]);
    let posix = &block[257..263] == b"ustar\0";
    let prefix = if posix { field_str(&block[345..500]) } else { String::new() };
    let name = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
    let size = if block[124] & 0x80 != 0 {
        // GNU base-256: big-endian in the remaining bytes.
        block[125..136].iter().try_fold(0u64, |acc, &b| acc.checked_mul(256).map(|v| v | u64::from(b)))
    } else {
        parse_octal(&block[124..136])
    }
    .ok_or_else(|| bad(format!("unreadable size of `{name}`")))?;
    let kind = block[156];
    if kind != b'0' && kind != 0 {
        return Err(BundleError::UnexpectedMember { name: format!("{name} (tar type `{}`)", kind as char) });
    }
    Ok(Some((name, size)))
}

fn field_str(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn parse_octal(field: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(field).ok()?;
    let text = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

#[cfg(test)]
mod tests;

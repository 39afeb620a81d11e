//! The bundle manifest (`manifest.json`): what a bundle claims to contain, signed as bytes.
//!
//! ```json
//! {"format":1,"compatible":"chrysalis-qemu-x86_64","version":"0.1.0","build_id":"…",
//!  "security_version":1,
//!  "kernel":{"sha256":"…","size":123},
//!  "root":{"sha256":"…","size":456,"verity":{"root_hash":"…","salt":"…","data_blocks":9,"hash_offset":36864}},
//!  "cmdline":"console=ttyS0"}
//! ```
//! `root.img` is the erofs image padded to 4096 bytes followed by its dm-verity hash tree
//! (`hash_offset` = `data_blocks` × 4096). `cmdline` holds the board's kernel arguments; the
//! slot's full command line is rendered by [`crate::cmdline::slot_cmdline`].
//!
//! The signature (`manifest.sig`) covers the exact bytes of `manifest.json`, so this type is
//! only ever parsed from bytes whose signature was already verified (see [`crate::bundle`]).
//! The image build (`cargo xtask image`) writes the same type, unsigned, next to the image.
//!
//! `security_version` is the anti-rollback level: signed like every other field, raised (by
//! the release process, `rootfs/security-version`) when a security fix lands, never lowered.
//! A box refuses a bundle whose `security_version` is below the highest one it has committed
//! (see [`crate::floor`]). The format stays 1: the field is required by this updater, and an
//! older updater, which ignores unknown fields, still accepts bundles that carry it (so boxes
//! can be upgraded into anti-rollback).

use serde::{Deserialize, Serialize};

/// The only manifest format this updater understands.
pub const FORMAT: u32 = 1;

/// dm-verity data and hash block size, fixed by the image layout.
pub const VERITY_BLOCK: u64 = 4096;

/// Errors of a manifest's content.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not the JSON shape of a manifest.
    #[error("manifest.json is not a valid manifest")]
    Json(#[source] serde_json::Error),
    /// A format this updater does not know.
    #[error("manifest format {got} is not supported (this updater reads format {FORMAT})")]
    Format {
        /// The format found.
        got: u32,
    },
    /// A field with an impossible value.
    #[error("manifest field `{field}`: {reason}")]
    Invalid {
        /// The dotted field name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// A bundle manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: u32,
    /// `chrysalis-<board>`: a box only accepts bundles for its own board.
    pub compatible: String,
    /// The human version (`0.1.0`, `0.1.0+fault`), shown in status and the boot menu.
    pub version: String,
    /// The build's identifier (content hash or CI build number).
    pub build_id: String,
    /// The anti-rollback level: a box refuses bundles below the highest level it committed.
    pub security_version: u64,
    /// The host kernel (`vmlinuz`, an EFI-stub bzImage).
    pub kernel: Blob,
    /// The root image (`root.img`: erofs + dm-verity hash tree).
    pub root: RootImage,
    /// The board's kernel arguments (console, watchdog, …).
    pub cmdline: String,
}

/// A member's digest and size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blob {
    /// Lower-case hex sha256 of the member.
    pub sha256: String,
    /// Its size in bytes.
    pub size: u64,
}

/// The root image and its verity parameters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootImage {
    /// Lower-case hex sha256 of the whole `root.img` (data + hash tree).
    pub sha256: String,
    /// Its size in bytes.
    pub size: u64,
    /// What dm-verity needs.
    pub verity: Verity,
}

/// dm-verity parameters (`veritysetup format --no-superblock`, sha256, 4096-byte blocks).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verity {
    /// Lower-case hex root hash.
    pub root_hash: String,
    /// Lower-case hex salt (empty for none).
    pub salt: String,
    /// Number of 4096-byte data blocks.
    pub data_blocks: u64,
    /// Byte offset of the hash tree in `root.img` (= `data_blocks` × 4096).
    pub hash_offset: u64,
}

impl Manifest {
    /// The `compatible` string of a board (`chrysalis-qemu-x86_64`).
    pub fn compatible_for_board(board: &str) -> String {
        format!("chrysalis-{board}")
    }

    /// Parses and validates manifest bytes.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(ManifestError::Json)?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// The canonical bytes of this manifest (pretty JSON + newline): what gets signed.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serialising plain strings and integers cannot fail.
        let mut bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    /// Checks every field for values that would make an unbootable entry or an ambiguous
    /// command line.
    pub fn validate(&self) -> Result<(), ManifestError> {
        let invalid = |field, reason: &str| Err(ManifestError::Invalid { field, reason: reason.to_string() });
        if self.format != FORMAT {
            return Err(ManifestError::Format { got: self.format });
        }
        if self.compatible.is_empty() || !self.compatible.chars().all(is_word_char) {
            return invalid("compatible", "must be non-empty letters, digits and `._+~-`");
        }
        if self.version.is_empty() || self.version.len() > 64 || !self.version.chars().all(is_word_char) {
            return invalid("version", "must be 1-64 letters, digits and `._+~-` (it goes on the kernel command line)");
        }
        if self.build_id.len() > 128 || self.build_id.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return invalid("build_id", "must be at most 128 characters without spaces");
        }
        check_sha256("kernel.sha256", &self.kernel.sha256)?;
        if self.kernel.size == 0 {
            return invalid("kernel.size", "the kernel is empty");
        }
        check_sha256("root.sha256", &self.root.sha256)?;
        check_sha256("root.verity.root_hash", &self.root.verity.root_hash)?;
        let salt = &self.root.verity.salt;
        if salt.len() & 1 == 1 || salt.len() > 512 || !salt.chars().all(is_lower_hex) {
            return invalid("root.verity.salt", "must be lower-case hex of whole bytes (at most 256)");
        }
        let verity = &self.root.verity;
        if verity.data_blocks == 0 {
            return invalid("root.verity.data_blocks", "must be positive");
        }
        if verity.data_blocks.checked_mul(VERITY_BLOCK) != Some(verity.hash_offset) {
            return invalid(
                "root.verity.hash_offset",
                "must equal data_blocks × 4096 (the hash tree follows the data)",
            );
        }
        if self.root.size < verity.hash_offset.saturating_add(VERITY_BLOCK) {
            return invalid("root.size", "must hold the data blocks and at least one hash block");
        }
        if self.cmdline.chars().any(char::is_control) {
            return invalid("cmdline", "must be one line without control characters");
        }
        Ok(())
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._+~-".contains(c)
}

fn is_lower_hex(c: char) -> bool {
    c.is_ascii_digit() || ('a'..='f').contains(&c)
}

fn check_sha256(field: &'static str, value: &str) -> Result<(), ManifestError> {
    if value.len() == 64 && value.chars().all(is_lower_hex) {
        Ok(())
    } else {
        Err(ManifestError::Invalid { field, reason: "must be 64 lower-case hex characters".to_string() })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            format: FORMAT,
            compatible: "chrysalis-qemu-x86_64".to_string(),
            version: "0.2.0".to_string(),
            build_id: "test-build".to_string(),
            security_version: 3,
            kernel: Blob { sha256: "11".repeat(32), size: 10 },
            root: RootImage {
                sha256: "22".repeat(32),
                size: 3 * VERITY_BLOCK,
                verity: Verity {
                    root_hash: "33".repeat(32),
                    salt: "44".repeat(32),
                    data_blocks: 2,
                    hash_offset: 2 * VERITY_BLOCK,
                },
            },
            cmdline: "console=ttyS0,115200".to_string(),
        }
    }

    #[test]
    fn round_trips_and_validates() {
        let m = sample();
        let bytes = m.to_bytes();
        assert_eq!(Manifest::parse(&bytes).expect("parse"), m);
        let text = String::from_utf8(bytes).expect("utf8");
        for key in [
            "\"format\"",
            "\"compatible\"",
            "\"build_id\"",
            "\"security_version\"",
            "\"root_hash\"",
            "\"hash_offset\"",
            "\"cmdline\"",
        ] {
            assert!(text.contains(key), "{key} missing in {text}");
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let mut m = sample();
        m.format = 2;
        assert!(matches!(m.validate(), Err(ManifestError::Format { got: 2 })));
        type Mutate = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(&str, Mutate)> = vec![
            ("version", Box::new(|m| m.version = "1.0 evil=1".into())),
            ("version", Box::new(|m| m.version = String::new())),
            ("kernel.sha256", Box::new(|m| m.kernel.sha256 = "AB".repeat(32))),
            ("root.verity.salt", Box::new(|m| m.root.verity.salt = "abc".into())),
            ("root.verity.hash_offset", Box::new(|m| m.root.verity.hash_offset = 4096 * 3)),
            ("root.size", Box::new(|m| m.root.size = 2 * VERITY_BLOCK)),
            ("cmdline", Box::new(|m| m.cmdline = "a\nb".into())),
            ("kernel.size", Box::new(|m| m.kernel.size = 0)),
        ];
        for (field, mutate) in cases {
            let mut m = sample();
            mutate(&mut m);
            match m.validate() {
                Err(ManifestError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
        let mut m = sample();
        m.root.verity.salt = String::new();
        m.validate().expect("an empty salt is allowed");
        assert!(matches!(Manifest::parse(b"{\"format\":1}"), Err(ManifestError::Json(_))));
    }

    #[test]
    fn security_version_is_required() {
        let mut value = serde_json::to_value(sample()).expect("json");
        value.as_object_mut().expect("object").remove("security_version");
        let bytes = serde_json::to_vec(&value).expect("bytes");
        match Manifest::parse(&bytes) {
            Err(ManifestError::Json(e)) => assert!(e.to_string().contains("security_version"), "{e}"),
            other => panic!("a manifest without security_version parsed: {other:?}"),
        }
    }
}

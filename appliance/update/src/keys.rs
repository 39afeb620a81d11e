//! ed25519 update keys: the box's trusted public keys and the build machine's signing key.
//!
//! Trusted keys live in a directory (`/usr/share/chrysalis/update-keys/`), one key per
//! `*.pub` file: 64 hex characters (32 bytes) and a newline. They are part of the verified
//! root, so a new image can rotate them.
//!
//! The signing key is a file holding the 32-byte seed as 64 hex characters (mode 0600, refused
//! when group or others can read it); its public half sits beside it with `.pub` appended
//! (`update-signing.key.pub`). [`generate_signing_key`] makes a pair (`cargo xtask keygen`, and
//! the dev pair of `cargo xtask image|bundle --dev-keys`); it never replaces an existing key.

use std::fs;
use std::path::{Path, PathBuf};

pub use ed25519_dalek::{Signature, SigningKey, VerifyingKey};

/// Errors loading or making keys.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The trusted-keys directory could not be read.
    #[error("reading trusted update keys in {}", dir.display())]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A key file could not be read or written.
    #[error("{what} {}", path.display())]
    File {
        /// The key file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A signing key file readable by group or others.
    #[error(
        "{} is readable by others (mode {mode:o}): a signing key must be private; chmod 600 it \
         (and, if others could read it, make a new key pair and rebuild the image with the new public key)",
        path.display()
    )]
    Exposed {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Generating a key where one exists.
    #[error("{} exists: refusing to replace a signing key (remove it first if you really mean to)", path.display())]
    Exists {
        /// The key file.
        path: PathBuf,
    },
    /// A key file does not hold 64 hex characters, or not a valid ed25519 point.
    #[error("{}: {reason} (expected 64 hex characters and a newline)", path.display())]
    Malformed {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// One trusted public key and the file it came from.
#[derive(Clone, Debug)]
pub struct TrustedKey {
    /// The file name (`dev.pub`), reported as the signer.
    pub name: String,
    /// The key.
    pub key: VerifyingKey,
}

/// The set of public keys this box accepts bundles from.
#[derive(Clone, Debug, Default)]
pub struct TrustedKeys {
    dir: PathBuf,
    keys: Vec<TrustedKey>,
}

impl TrustedKeys {
    /// Loads every `*.pub` file of `dir` (sorted by name).
    pub fn load(dir: &Path) -> Result<TrustedKeys, KeysError> {
        let listing = fs::read_dir(dir).map_err(|source| KeysError::Dir { dir: dir.to_path_buf(), source })?;
        let mut paths = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|source| KeysError::Dir { dir: dir.to_path_buf(), source })?;
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "pub") {
                paths.push(path);
            }
        }
        paths.sort();
        let mut keys = Vec::with_capacity(paths.len());
        for path in paths {
            let text = fs::read_to_string(&path).map_err(|source| KeysError::File {
                path: path.clone(),
                what: "reading",
                source,
            })?;
            let key = parse_public_key(&text).map_err(|reason| KeysError::Malformed { path: path.clone(), reason })?;
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            keys.push(TrustedKey { name, key });
        }
        Ok(TrustedKeys { dir: dir.to_path_buf(), keys })
    }

    /// A key set from keys in memory (tests, tools); `dir` is only reported in errors.
    pub fn from_keys(dir: PathBuf, keys: Vec<TrustedKey>) -> TrustedKeys {
        TrustedKeys { dir, keys }
    }

    /// The directory the keys came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many keys are trusted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is trusted (every bundle is refused).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The name of the first trusted key under which `signature` verifies `message` (strict
    /// ed25519 verification), or `None`.
    pub fn verify(&self, message: &[u8], signature: &Signature) -> Option<&str> {
        self.keys.iter().find(|k| k.key.verify_strict(message, signature).is_ok()).map(|k| k.name.as_str())
    }
}

/// Parses the text of a `.pub` file.
pub fn parse_public_key(text: &str) -> Result<VerifyingKey, String> {
    let text = text.trim();
    if text.len() != 64 {
        return Err(format!("{} characters", text.len()));
    }
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(text, &mut bytes).map_err(|e| format!("not hex: {e}"))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| format!("not an ed25519 public key: {e}"))
}

/// The text of a `.pub` file for `key` (hex + newline).
pub fn public_key_text(key: &VerifyingKey) -> String {
    format!("{}\n", hex::encode(key.as_bytes()))
}

/// The public-key file beside a signing-key file (`update-signing.key` →
/// `update-signing.key.pub`, as `cargo xtask image` expects).
pub fn public_key_path(signing_key: &Path) -> PathBuf {
    let mut name = signing_key.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".pub");
    signing_key.with_file_name(name)
}

/// Loads a signing key file (64 hex characters of seed). The file must not be readable by
/// group or others (mode 0600 or stricter): a signing key anyone on the machine could copy is
/// refused, with the fix.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeysError> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta =
        fs::metadata(path).map_err(|source| KeysError::File { path: path.to_path_buf(), what: "reading", source })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeysError::Exposed { path: path.to_path_buf(), mode });
    }
    let text = fs::read_to_string(path).map_err(|source| KeysError::File {
        path: path.to_path_buf(),
        what: "reading",
        source,
    })?;
    let text = text.trim();
    let mut seed = [0u8; 32];
    if text.len() != 64 || hex::decode_to_slice(text, &mut seed).is_err() {
        return Err(KeysError::Malformed { path: path.to_path_buf(), reason: "not a 32-byte hex seed".to_string() });
    }
    Ok(SigningKey::from_bytes(&seed))
}

/// Makes a new signing key at `path` (hex seed, born 0600 with [`foundation::write_atomic`]; a
/// missing directory is created 0700, an existing one is left as it is: `--out ~/k.key` must
/// not change `$HOME`) and its public half at `<path>.pub` (0644). Refuses to
/// replace an existing key: a lost signing key cannot be recovered, and a box trusts only the
/// public keys its image was built with.
pub fn generate_signing_key(path: &Path) -> Result<SigningKey, KeysError> {
    if fs::symlink_metadata(path).is_ok() {
        return Err(KeysError::Exists { path: path.to_path_buf() });
    }
    let key = SigningKey::from_bytes(&rand::random::<[u8; 32]>());
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists());
    dir.map_or(Ok(()), foundation::private_dir)
        .and_then(|()| {
            let seed = format!("{}\n", hex::encode(key.to_bytes()));
            foundation::write_atomic(path, seed.as_bytes(), foundation::SECRET_FILE)
        })
        .map_err(|source| KeysError::File { path: path.to_path_buf(), what: "writing", source })?;
    write_public_key(&public_key_path(path), &key.verifying_key())?;
    Ok(key)
}

/// Writes a `.pub` file (0644, atomically).
pub fn write_public_key(path: &Path, key: &VerifyingKey) -> Result<(), KeysError> {
    foundation::write_atomic(path, public_key_text(key).as_bytes(), foundation::PUBLIC_FILE)
        .map_err(|source| KeysError::File { path: path.to_path_buf(), what: "writing", source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::Signer;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("meta").permissions().mode() & 0o777
    }

    #[test]
    fn generate_load_and_trust() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_path = dir.path().join("keys/update-signing.key");
        let key = generate_signing_key(&key_path).expect("generate");
        assert_eq!(mode(&key_path), 0o600);
        assert_eq!(mode(key_path.parent().expect("dir")), 0o700);
        let pub_path = public_key_path(&key_path);
        assert!(pub_path.ends_with("keys/update-signing.key.pub"));
        assert_eq!(mode(&pub_path), 0o644);
        assert_eq!(load_signing_key(&key_path).expect("load").to_bytes(), key.to_bytes());
        assert!(matches!(generate_signing_key(&key_path), Err(KeysError::Exists { .. })), "a key was replaced");
        let pub_text = fs::read_to_string(&pub_path).expect("pub");
        assert_eq!(pub_text.len(), 65);
        assert!(pub_text.ends_with('\n'));

        let trust = dir.path().join("trust");
        fs::create_dir(&trust).expect("mkdir");
        fs::copy(&pub_path, trust.join("dev.pub")).expect("copy");
        fs::write(trust.join("README"), "not a key").expect("other file");
        let keys = TrustedKeys::load(&trust).expect("load trust");
        assert_eq!(keys.len(), 1);
        let sig = key.sign(b"hello");
        assert_eq!(keys.verify(b"hello", &sig), Some("dev.pub"));
        assert_eq!(keys.verify(b"hellO", &sig), None);
        let other = SigningKey::from_bytes(&[7u8; 32]);
        assert_eq!(keys.verify(b"hello", &other.sign(b"hello")), None);
    }

    #[test]
    fn an_exposed_signing_key_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_path = dir.path().join("k");
        generate_signing_key(&key_path).expect("generate");
        fs::set_permissions(&key_path, fs::Permissions::from_mode(0o640)).expect("chmod");
        match load_signing_key(&key_path) {
            Err(e @ KeysError::Exposed { mode: 0o640, .. }) => assert!(e.to_string().contains("chmod 600"), "{e}"),
            other => panic!("expected Exposed, got {other:?}"),
        }
        fs::set_permissions(&key_path, fs::Permissions::from_mode(0o400)).expect("chmod");
        load_signing_key(&key_path).expect("0400 is private");
    }

    #[test]
    fn malformed_keys_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("bad.pub"), "abcd\n").expect("write");
        match TrustedKeys::load(dir.path()) {
            Err(KeysError::Malformed { path, .. }) => assert!(path.ends_with("bad.pub")),
            other => panic!("expected Malformed, got {other:?}"),
        }
        assert!(matches!(TrustedKeys::load(&dir.path().join("missing")), Err(KeysError::Dir { .. })));
        let seed = dir.path().join("seed");
        foundation::write_secret(&seed, b"not hex\n").expect("write");
        assert!(matches!(load_signing_key(&seed), Err(KeysError::Malformed { .. })));
    }
}

//! ed25519 update keys: the box's trusted public keys and the build machine's signing key.
//!
//! Trusted keys live in a directory (`/usr/share/chrysalis/update-keys/`), one key per
//! `*.pub` file: 64 hex characters (32 bytes) and a newline. They are part of the verified
//! root, so a new image can rotate them.
//!
//! The signing key is a file holding the 32-byte seed as 64 hex characters (mode 0600); its
//! public half sits beside it with `.pub` appended (`update-signing.key.pub`). The dev key of
//! `cargo xtask bundle` is `$CHRYSALIS_CACHE/keys/update-signing.key`, generated on first use
//! ([`ensure_dev_key`]; `cargo xtask image` embeds its `.pub`).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
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

/// Loads a signing key file (64 hex characters of seed).
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeysError> {
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

/// The signing key at `path`, generated (seed 0600 + `<path>.pub`) when the file does not exist.
/// Returns the key and whether it was just made. The `.pub` file is rewritten when missing.
pub fn load_or_generate_signing_key(path: &Path) -> Result<(SigningKey, bool), KeysError> {
    let (key, created) = if path.exists() {
        (load_signing_key(path)?, false)
    } else {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|source| KeysError::File {
                path: dir.to_path_buf(),
                what: "creating",
                source,
            })?;
        }
        let key = SigningKey::from_bytes(&rand::random::<[u8; 32]>());
        write_private(path, format!("{}\n", hex::encode(key.to_bytes())).as_bytes())?;
        (key, true)
    };
    let pub_path = public_key_path(path);
    let want = public_key_text(&key.verifying_key());
    if fs::read_to_string(&pub_path).ok().as_deref() != Some(want.as_str()) {
        crate::atomic::write_file(&pub_path, want.as_bytes()).map_err(|source| KeysError::File {
            path: pub_path.clone(),
            what: "writing",
            source,
        })?;
    }
    Ok((key, created))
}

/// The development signing key of this machine: `<cache>/keys/update-signing.key` (+ `.pub`),
/// generated on first use. The image build embeds its `.pub`; `cargo xtask bundle` signs with it.
pub fn ensure_dev_key(cache_dir: &Path) -> Result<DevKey, KeysError> {
    let key_path = cache_dir.join("keys").join("update-signing.key");
    let (key, created) = load_or_generate_signing_key(&key_path)?;
    Ok(DevKey { pub_path: public_key_path(&key_path), key_path, key, created })
}

/// The dev signing key and where it lives.
#[derive(Debug)]
pub struct DevKey {
    /// `<cache>/keys/update-signing.key` (hex seed, 0600).
    pub key_path: PathBuf,
    /// `<cache>/keys/update-signing.key.pub` (hex public key + newline).
    pub pub_path: PathBuf,
    /// The key.
    pub key: SigningKey,
    /// Whether this call generated it.
    pub created: bool,
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), KeysError> {
    let tmp = crate::atomic::tmp_path(path);
    let err = |what, source| KeysError::File { path: path.to_path_buf(), what, source };
    let _ = fs::remove_file(&tmp);
    let mut file =
        fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(|e| err("creating", e))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| err("writing", e))?;
    crate::atomic::rename(&tmp, path).map_err(|e| err("installing", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::Signer;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn generate_load_and_trust() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = ensure_dev_key(dir.path()).expect("generate");
        assert!(dev.created);
        let mode = fs::metadata(&dev.key_path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = ensure_dev_key(dir.path()).expect("load");
        assert!(!again.created);
        assert_eq!(again.key.to_bytes(), dev.key.to_bytes());
        let pub_text = fs::read_to_string(&dev.pub_path).expect("pub");
        assert_eq!(pub_text.len(), 65);
        assert!(dev.pub_path.ends_with("keys/update-signing.key.pub"));
        assert!(pub_text.ends_with('\n'));

        let trust = dir.path().join("trust");
        fs::create_dir(&trust).expect("mkdir");
        fs::copy(&dev.pub_path, trust.join("dev.pub")).expect("copy");
        fs::write(trust.join("README"), "not a key").expect("other file");
        let keys = TrustedKeys::load(&trust).expect("load trust");
        assert_eq!(keys.len(), 1);
        let sig = dev.key.sign(b"hello");
        assert_eq!(keys.verify(b"hello", &sig), Some("dev.pub"));
        assert_eq!(keys.verify(b"hellO", &sig), None);
        let other = SigningKey::from_bytes(&[7u8; 32]);
        assert_eq!(keys.verify(b"hello", &other.sign(b"hello")), None);
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
    }
}

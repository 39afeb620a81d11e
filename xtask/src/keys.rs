//! The dev update-signing key pair shared by `cargo xtask image` (embeds the public key in
//! `/usr/share/chrysalis/update-keys/`) and `cargo xtask bundle` (signs bundle manifests).
//!
//! `$CHRYSALIS_CACHE/keys/update-signing.key`: the 32-byte ed25519 seed as 64 hex characters and
//! a newline, mode 0600; `update-signing.key.pub`: the 32-byte public key, same encoding. The
//! pair is generated on first use; an existing pair is checked (the public key must match).

use anyhow::{bail, Context, Result};
use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The key pair's files.
#[derive(Debug, Clone)]
// `cargo xtask bundle` signs with `seed`; the image build only embeds the public key.
#[allow(dead_code)]
pub struct DevKey {
    /// Hex seed, 0600.
    pub secret: PathBuf,
    /// Hex public key.
    pub public: PathBuf,
    /// The 32-byte seed.
    pub seed: [u8; 32],
    /// The 32-byte public key.
    pub public_key: [u8; 32],
}

impl DevKey {
    /// The public key as written in `update-keys/*.pub`: 64 hex characters and a newline.
    pub fn public_hex_line(&self) -> String {
        format!("{}\n", hex::encode(self.public_key))
    }
}

/// `$CHRYSALIS_CACHE/keys`.
pub fn keys_dir() -> PathBuf {
    crate::paths::cache_dir().join("keys")
}

/// Loads the dev update-signing key pair, generating it when missing.
pub fn dev_update_key() -> Result<DevKey> {
    load_or_generate(&keys_dir())
}

/// Loads `<dir>/update-signing.key{,.pub}`, generating both when the secret is missing.
pub fn load_or_generate(dir: &Path) -> Result<DevKey> {
    let secret = dir.join("update-signing.key");
    let public = dir.join("update-signing.key.pub");
    let _lock = crate::paths::lock_file(&dir.join(".lock"))?;
    if !secret.exists() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        let seed: [u8; 32] = rand::random();
        let tmp = dir.join(".update-signing.key.tmp");
        let _ = fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(format!("{}\n", hex::encode(seed)).as_bytes())?;
        f.sync_all()?;
        let public_key = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key().to_bytes();
        fs::write(&public, format!("{}\n", hex::encode(public_key)))
            .with_context(|| format!("writing {}", public.display()))?;
        fs::rename(&tmp, &secret).with_context(|| format!("installing {}", secret.display()))?;
        eprintln!("keys: generated the dev update-signing key {} (+ .pub)", secret.display());
    }
    let seed = read_hex32(&secret)?;
    let mode = fs::metadata(&secret)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!("{} is readable by others (mode {mode:o}): chmod 600 it", secret.display());
    }
    let public_key = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key().to_bytes();
    match read_hex32(&public) {
        Ok(have) if have == public_key => {}
        Ok(_) => bail!("{} does not match {}: delete both to regenerate", public.display(), secret.display()),
        Err(_) => fs::write(&public, format!("{}\n", hex::encode(public_key)))
            .with_context(|| format!("writing {}", public.display()))?,
    }
    Ok(DevKey { secret, public, seed, public_key })
}

/// Reads a file holding 64 hex characters (32 bytes), surrounding whitespace allowed.
fn read_hex32(path: &Path) -> Result<[u8; 32]> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let bytes = hex::decode(text.trim()).with_context(|| format!("{}: not hex", path.display()))?;
    bytes.try_into().map_err(|b: Vec<u8>| anyhow::anyhow!("{}: {} bytes, want 32", path.display(), b.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_once_then_loads_the_same_pair() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = load_or_generate(dir.path()).expect("generate");
        let b = load_or_generate(dir.path()).expect("load");
        assert_eq!(a.seed, b.seed);
        assert_eq!(a.public_key, b.public_key);
        let mode = fs::metadata(&a.secret).expect("secret").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let public = fs::read_to_string(&a.public).expect("public");
        assert_eq!(public, a.public_hex_line());
        assert_eq!(public.len(), 65);
    }

    #[test]
    fn a_mismatched_public_key_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = load_or_generate(dir.path()).expect("generate");
        fs::write(&a.public, format!("{}\n", "00".repeat(32))).expect("overwrite");
        assert!(load_or_generate(dir.path()).is_err());
    }
}

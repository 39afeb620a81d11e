//! Update keys for `cargo xtask image` (the public keys the image trusts) and `cargo xtask
//! bundle` (the key that signs), always named explicitly:
//!
//! - production: `image --update-keys DIR` (every `DIR/*.pub`, public keys only) and
//!   `bundle --key FILE` (a signing key made by `cargo xtask keygen`, mode 0600);
//! - development: `--dev-keys` on either, the machine's dev pair
//!   `$CHRYSALIS_CACHE/keys/update-signing.key` (+ `.pub`), generated on first use.
//!
//! Nothing falls back to the dev pair: a build without a key flag fails with the flags to pass.
//! The key file formats are the `update` crate's (`update::keys`): 64 hex characters and a
//! newline; the seed file must not be readable by group or others.

use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use update::keys::SigningKey;

/// The file name of the dev pair's public key inside an image.
pub const DEV_PUB: &str = "dev.pub";

/// Which public keys an image trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateKeys {
    /// Every `*.pub` of a directory (`--update-keys DIR`).
    Dir(PathBuf),
    /// This machine's dev pair (`--dev-keys`).
    Dev,
}

/// Which key signs a bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SigningKeySource {
    /// A signing key file (`--key FILE`).
    File(PathBuf),
    /// This machine's dev pair (`--dev-keys`).
    Dev,
}

/// One public key as the image carries it: `usr/share/chrysalis/update-keys/<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKeyFile {
    /// The file name (`dev.pub`, `release-2026.pub`).
    pub name: String,
    /// Its text: 64 hex characters and a newline.
    pub text: String,
}

/// The flags of a command that needs the image's trusted keys, resolved; `command` names it in
/// the error.
pub fn update_keys(dir: Option<&Path>, dev: bool, command: &str) -> Result<UpdateKeys> {
    match (dir, dev) {
        (Some(dir), false) => Ok(UpdateKeys::Dir(dir.to_path_buf())),
        (None, true) => Ok(UpdateKeys::Dev),
        (Some(_), true) => bail!("{command}: --update-keys and --dev-keys exclude each other"),
        (None, false) => bail!(
            "{command}: say which update keys the image trusts: --update-keys DIR (the public keys of your \
             release signing keys: every DIR/*.pub, 64 hex characters each; `cargo xtask keygen --out FILE` \
             makes a pair) or --dev-keys (this machine's development pair in {}, generated on first use: for \
             development and tests only, never for boxes you ship)",
            keys_dir().display()
        ),
    }
}

/// The flags of a command that signs, resolved.
pub fn signing_key_source(key: Option<&Path>, dev: bool, command: &str) -> Result<SigningKeySource> {
    match (key, dev) {
        (Some(key), false) => Ok(SigningKeySource::File(key.to_path_buf())),
        (None, true) => Ok(SigningKeySource::Dev),
        (Some(_), true) => bail!("{command}: --key and --dev-keys exclude each other"),
        (None, false) => bail!(
            "{command}: say which key signs the bundle: --key FILE (a signing key made by `cargo xtask keygen \
             --out FILE`, mode 0600; keep it off build machines) or --dev-keys (this machine's development \
             pair {}, generated on first use: only boxes built with --dev-keys accept it)",
            dev_key_path().display()
        ),
    }
}

/// `$CHRYSALIS_CACHE/keys`.
pub fn keys_dir() -> PathBuf {
    crate::paths::cache_dir().join("keys")
}

/// `$CHRYSALIS_CACHE/keys/update-signing.key`.
pub fn dev_key_path() -> PathBuf {
    keys_dir().join("update-signing.key")
}

/// The public key files an image built with `keys` carries.
pub fn public_keys(keys: &UpdateKeys) -> Result<Vec<PublicKeyFile>> {
    match keys {
        UpdateKeys::Dev => {
            let key = dev_signing_key_in(&keys_dir())?;
            Ok(vec![PublicKeyFile { name: DEV_PUB.into(), text: update::keys::public_key_text(&key.verifying_key()) }])
        }
        UpdateKeys::Dir(dir) => public_keys_in(dir),
    }
}

/// Every `*.pub` of `dir`, validated. Refuses an empty directory (a box trusting no key refuses
/// every bundle) and a directory holding anything that looks like a signing key (`*.key`): an
/// image build needs public keys only, and signing keys belong off build machines.
pub fn public_keys_in(dir: &Path) -> Result<Vec<PublicKeyFile>> {
    let trusted = update::keys::TrustedKeys::load(dir)
        .map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))
        .with_context(|| format!("--update-keys {}", dir.display()))?;
    let mut secrets = Vec::new();
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("key") => secrets.push(path.display().to_string()),
            Some("pub") => names.push(path),
            _ => {}
        }
    }
    if !secrets.is_empty() {
        bail!(
            "--update-keys {}: {} looks like a signing key; the image needs only the public keys (*.pub): \
             keep signing keys off build machines and pass a directory of public keys",
            dir.display(),
            secrets.join(", ")
        );
    }
    if trusted.is_empty() {
        bail!(
            "--update-keys {}: no *.pub file: a box that trusts no key refuses every bundle \
             (`cargo xtask keygen --out FILE` makes a pair; copy FILE.pub here)",
            dir.display()
        );
    }
    names.sort();
    names
        .into_iter()
        .map(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let key = update::keys::parse_public_key(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            Ok(PublicKeyFile { name, text: update::keys::public_key_text(&key) })
        })
        .collect()
}

/// The signing key of `source`.
pub fn signing_key(source: &SigningKeySource) -> Result<SigningKey> {
    match source {
        SigningKeySource::Dev => dev_signing_key_in(&keys_dir()),
        SigningKeySource::File(path) => {
            update::keys::load_signing_key(path).map_err(|e| anyhow::anyhow!(foundation::error_chain(&e))).with_context(
                || format!("--key {} (make one with `cargo xtask keygen --out {}`)", path.display(), path.display()),
            )
        }
    }
}

/// The dev pair in `dir` (`update-signing.key` + `.pub`), generated on first use; the `.pub`
/// is rewritten when missing and must match when present.
pub fn dev_signing_key_in(dir: &Path) -> Result<SigningKey> {
    let secret = dir.join("update-signing.key");
    let public = update::keys::public_key_path(&secret);
    foundation::private_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
    let _lock = crate::paths::lock_file(&dir.join(".lock"))?;
    let key = if secret.exists() {
        update::keys::load_signing_key(&secret).map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))?
    } else {
        let key =
            update::keys::generate_signing_key(&secret).map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))?;
        eprintln!("keys: generated the dev update-signing key {} (+ .pub)", secret.display());
        key
    };
    let want = update::keys::public_key_text(&key.verifying_key());
    match fs::read_to_string(&public) {
        Ok(have) if have.trim() == want.trim() => {}
        Ok(_) => bail!("{} does not match {}: delete both to regenerate", public.display(), secret.display()),
        Err(_) => update::keys::write_public_key(&public, &key.verifying_key())
            .map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))?,
    }
    Ok(key)
}

/// `cargo xtask keygen --out FILE`: a new signing key pair (FILE 0600 in a 0700 directory,
/// FILE.pub 0644). Never replaces an existing file.
pub fn keygen(out: &Path) -> Result<()> {
    let key = update::keys::generate_signing_key(out).map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))?;
    let public = update::keys::public_key_path(out);
    eprintln!(
        "keygen: signing key {} (0600: keep it on the signing host, or in an HSM, never on build machines)\n\
         keygen: public key  {} (put it in the directory you pass to `cargo xtask image --update-keys`)",
        out.display(),
        public.display()
    );
    println!("{}", update::keys::public_key_text(&key.verifying_key()).trim());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_dev_pair_is_generated_once_then_loaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys = dir.path().join("keys");
        let a = dev_signing_key_in(&keys).expect("generate");
        let b = dev_signing_key_in(&keys).expect("load");
        assert_eq!(a.to_bytes(), b.to_bytes());
        let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&keys.join("update-signing.key")), 0o600);
        assert_eq!(mode(&keys), 0o700);
        let public = fs::read_to_string(keys.join("update-signing.key.pub")).expect("public");
        assert_eq!(public, update::keys::public_key_text(&a.verifying_key()));
        fs::write(keys.join("update-signing.key.pub"), format!("{}\n", "00".repeat(32))).expect("overwrite");
        assert!(dev_signing_key_in(&keys).is_err(), "a mismatched .pub was accepted");
    }

    #[test]
    fn no_key_flag_is_an_error_naming_the_flags() {
        let err = update_keys(None, false, "cargo xtask image").expect_err("no flag").to_string();
        assert!(err.contains("--update-keys DIR") && err.contains("--dev-keys"), "{err}");
        assert!(update_keys(Some(Path::new("k")), true, "x").is_err());
        assert_eq!(update_keys(None, true, "x").expect("dev"), UpdateKeys::Dev);
        let err = signing_key_source(None, false, "cargo xtask bundle").expect_err("no flag").to_string();
        assert!(err.contains("--key FILE") && err.contains("--dev-keys"), "{err}");
        assert_eq!(
            signing_key_source(Some(Path::new("k")), false, "x").expect("file"),
            SigningKeySource::File("k".into())
        );
    }

    #[test]
    fn update_keys_dirs_hold_public_keys_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys = dir.path().join("trusted");
        fs::create_dir(&keys).expect("mkdir");
        assert!(public_keys_in(&keys).expect_err("empty").to_string().contains("no *.pub"));
        let signing = dir.path().join("release.key");
        keygen(&signing).expect("keygen");
        fs::copy(update::keys::public_key_path(&signing), keys.join("release.pub")).expect("copy");
        let found = public_keys_in(&keys).expect("keys");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].name, "release.pub");
        // A signing key beside the public ones is refused.
        fs::copy(&signing, keys.join("release.key")).expect("copy secret");
        let err = public_keys_in(&keys).expect_err("secret in the dir").to_string();
        assert!(err.contains("release.key") && err.contains("public keys"), "{err}");
        // keygen never replaces a key.
        assert!(keygen(&signing).is_err());
        // A missing --key file is an error naming keygen, not a fresh key.
        let missing = dir.path().join("missing.key");
        let err = format!("{:#}", signing_key(&SigningKeySource::File(missing.clone())).expect_err("missing"));
        assert!(err.contains("cargo xtask keygen"), "{err}");
        assert!(!missing.exists());
    }
}

//! `cargo xtask bundle`: a signed update bundle (`*.chrysalis-bundle`) from a built image.
//!
//! Inputs: the image build's output directory (`--image-dir`, default
//! `$CHRYSALIS_CACHE/appliance/<board>/current`): `root.img`, `vmlinuz`, `manifest.json`
//! (compatible, version, build id, security_version, verity parameters, board kernel
//! arguments) and `update-keys/` (the public keys the image trusts). Without a built image,
//! `--root`, `--kernel`, `--verity-json` and `--version` name the pieces explicitly.
//! `--cmdline-extra` appends kernel arguments to the signed manifest (tests: a fault-injection
//! bundle with `chrysalis.fault=never-healthy`).
//!
//! The signing key is named explicitly: `--key FILE` (a release key, on the signing host) or
//! `--dev-keys` (this machine's development pair; see [`crate::keys`]). The new bundle is read
//! back through the same streaming verifier a box uses, under the signing key and, from an
//! image directory, under the keys that image trusts (a bundle its own image would refuse is an
//! error). The security_version of a bundle made from an image is the image's own (baked into
//! its root); a different `--security-version` is refused. The format and the signing live in
//! the `update` crate (`update::bundle::create`); this file only gathers inputs.

use crate::{flags::BundleArgs, image, keys, paths};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use sha2::Digest;
use std::fs;
use std::io::{self, BufReader};
use std::path::{Path, PathBuf};
use std::time::Instant;
use update::bundle::{self, BundleReader, Expect, ManifestFields};
use update::keys::{SigningKey, TrustedKey, TrustedKeys};
use update::manifest::{Manifest, Verity};

/// The fields of the image build's `manifest.json` a bundle needs (the rest is ignored).
#[derive(Debug, Deserialize)]
struct ImageManifest {
    compatible: String,
    version: String,
    build_id: String,
    security_version: u64,
    root: ImageRoot,
    cmdline: String,
}

#[derive(Debug, Deserialize)]
struct ImageRoot {
    verity: Verity,
}

/// Everything a bundle is made of.
#[derive(Debug)]
struct Inputs {
    root: PathBuf,
    kernel: PathBuf,
    fields: ManifestFields,
    /// The public keys the image trusts (`<image-dir>/update-keys`), when bundling an image.
    image_keys: Option<PathBuf>,
}

pub fn run(args: &BundleArgs) -> Result<()> {
    let started = Instant::now();
    // The key first: a missing --key/--dev-keys is the first thing to fix.
    let source = keys::signing_key_source(args.key.as_deref(), args.dev_keys, "cargo xtask bundle")?;
    let mut inputs = inputs(args)?;
    let want = Manifest::compatible_for_board(&args.board);
    if inputs.fields.compatible != want {
        bail!("the image is for `{}`, not `{want}` (--board {})", inputs.fields.compatible, args.board);
    }
    if let Some(extra) = args.cmdline_extra.as_deref().map(str::trim).filter(|e| !e.is_empty()) {
        inputs.fields.cmdline = format!("{} {extra}", inputs.fields.cmdline.trim()).trim().to_string();
    }
    let key = keys::signing_key(&source)?;
    let out = match &args.out {
        Some(out) => out.clone(),
        None => default_out(&inputs.fields, args.cmdline_extra.as_deref()),
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    eprintln!(
        "bundle: {} {} (security_version {}) from {} + {} ...",
        inputs.fields.compatible,
        inputs.fields.version,
        inputs.fields.security_version,
        inputs.root.display(),
        inputs.kernel.display()
    );
    let manifest = make(&inputs, &key, &out)?;
    eprintln!(
        "bundle: {} ({:.1} MiB: root.img {:.1} MiB, vmlinuz {:.1} MiB), security_version {}, signed by {}{}, verified in {}s",
        out.display(),
        fs::metadata(&out)?.len() as f64 / 1048576.0,
        manifest.root.size as f64 / 1048576.0,
        manifest.kernel.size as f64 / 1048576.0,
        manifest.security_version,
        hex::encode(key.verifying_key().as_bytes()),
        if source == keys::SigningKeySource::Dev { " (the DEV key)" } else { "" },
        started.elapsed().as_secs()
    );
    println!("{}", out.display());
    Ok(())
}

/// Creates the bundle at `out`, then reads it back through the box's verifier: under the
/// signing key, and under the keys the image trusts when they are known. A bundle that fails
/// either check is removed.
fn make(inputs: &Inputs, key: &SigningKey, out: &Path) -> Result<Manifest> {
    let manifest = bundle::create(&inputs.root, &inputs.kernel, &inputs.fields, key, out)
        .map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))
        .with_context(|| format!("making {}", out.display()))?;
    let checked = (|| -> Result<()> {
        let signer = TrustedKeys::from_keys(
            PathBuf::from("(the signing key)"),
            vec![TrustedKey { name: "signing key".into(), key: key.verifying_key() }],
        );
        verify(out, &signer, &manifest.compatible)
            .map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))
            .with_context(|| format!("verifying the new bundle {}", out.display()))?;
        if let Some(dir) = &inputs.image_keys {
            let trusted = TrustedKeys::load(dir).map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))?;
            verify(out, &trusted, &manifest.compatible)
                .map_err(|e| anyhow::anyhow!(foundation::error_chain(&e)))
                .with_context(|| {
                    format!(
                        "the image this bundle carries does not trust its signing key (its keys: {}): boxes built \
                         from the same keys would refuse it; sign with a key whose .pub was passed to \
                         `cargo xtask image --update-keys` (or --dev-keys on both)",
                        dir.display()
                    )
                })?;
        }
        Ok(())
    })();
    if let Err(e) = checked {
        let _ = fs::remove_file(out);
        return Err(e);
    }
    Ok(manifest)
}

fn verify(path: &Path, keys: &TrustedKeys, compatible: &str) -> Result<(), bundle::BundleError> {
    let expect = Expect { keys, compatible, min_security_version: 0, slot_bytes: u64::MAX };
    let file = fs::File::open(path).map_err(|source| bundle::BundleError::File {
        path: path.to_path_buf(),
        what: "opening",
        source,
    })?;
    let mut reader = BundleReader::open(BufReader::with_capacity(1 << 20, file), &expect)?;
    reader.copy_kernel(&mut io::sink(), Path::new("/dev/null"))?;
    reader.copy_root(&mut io::sink(), Path::new("/dev/null"), &mut |_| {})?;
    reader.finish().map(|_| ())
}

fn inputs(args: &BundleArgs) -> Result<Inputs> {
    if args.root.is_some() || args.kernel.is_some() || args.verity_json.is_some() {
        return explicit_inputs(args);
    }
    let dir = match &args.image_dir {
        Some(dir) => dir.clone(),
        None => paths::cache_dir().join("appliance").join(&args.board).join("current"),
    };
    let manifest_path = dir.join("manifest.json");
    let bytes = fs::read(&manifest_path).with_context(|| {
        format!(
            "reading {} (build the image first: `cargo xtask image --board {} --update-keys DIR` (or --dev-keys), \
             or pass --root/--kernel/--verity-json)",
            manifest_path.display(),
            args.board
        )
    })?;
    let image: ImageManifest = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "parsing {} (an image built before security_version existed? rebuild it with `cargo xtask image`)",
            manifest_path.display()
        )
    })?;
    if let Some(v) = args.security_version.filter(|v| *v != image.security_version) {
        bail!(
            "--security-version {v}: the image in {} was built with security_version {} (baked into its root); \
             a bundle must carry its image's level: rebuild the image with `cargo xtask image --security-version {v}`",
            dir.display(),
            image.security_version
        );
    }
    let keys_dir = dir.join(image::UPDATE_KEYS_DIR);
    Ok(Inputs {
        root: dir.join("root.img"),
        kernel: dir.join("vmlinuz"),
        fields: ManifestFields {
            compatible: image.compatible,
            version: args.version.clone().unwrap_or(image.version),
            build_id: image.build_id,
            security_version: image.security_version,
            verity: image.root.verity,
            cmdline: image.cmdline,
        },
        image_keys: keys_dir.is_dir().then_some(keys_dir),
    })
}

fn explicit_inputs(args: &BundleArgs) -> Result<Inputs> {
    let (Some(root), Some(kernel), Some(verity_json), Some(version)) =
        (&args.root, &args.kernel, &args.verity_json, &args.version)
    else {
        bail!("--root, --kernel, --verity-json and --version go together (or use --image-dir)");
    };
    let text = fs::read(verity_json).with_context(|| format!("reading {}", verity_json.display()))?;
    let verity: Verity = serde_json::from_slice(&text).with_context(|| {
        format!("{}: expected {{\"root_hash\",\"salt\",\"data_blocks\",\"hash_offset\"}}", verity_json.display())
    })?;
    let board = crate::image::board::Board::load(&paths::project_root(), &args.board)?;
    Ok(Inputs {
        root: root.clone(),
        kernel: kernel.clone(),
        fields: ManifestFields {
            compatible: Manifest::compatible_for_board(&args.board),
            version: version.clone(),
            build_id: args.build_id.clone().unwrap_or_else(|| version.clone()),
            security_version: match args.security_version {
                Some(v) => v,
                None => image::repository_security_version()?,
            },
            verity,
            cmdline: board.kernel.cmdline.clone(),
        },
        image_keys: None,
    })
}

/// `$CHRYSALIS_CACHE/bundles/<compatible>-<version>[-x<hash of the extra args>].chrysalis-bundle`.
fn default_out(fields: &ManifestFields, extra: Option<&str>) -> PathBuf {
    let mut name = format!("{}-{}", fields.compatible, fields.version);
    if let Some(extra) = extra.map(str::trim).filter(|e| !e.is_empty()) {
        name.push_str(&format!("-x{}", &hex::encode(sha2::Sha256::digest(extra.as_bytes()))[..8]));
    }
    paths::cache_dir().join("bundles").join(format!("{name}.{}", bundle::EXTENSION))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> ManifestFields {
        ManifestFields {
            compatible: "chrysalis-qemu-x86_64".into(),
            version: "0.2.0".into(),
            build_id: "b".into(),
            security_version: 2,
            verity: Verity { root_hash: "ab".repeat(32), salt: "cd".repeat(32), data_blocks: 3, hash_offset: 3 * 4096 },
            cmdline: "console=ttyS0".into(),
        }
    }

    #[test]
    fn makes_a_bundle_a_box_accepts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (root, kernel) = (dir.path().join("root.img"), dir.path().join("vmlinuz"));
        fs::write(&root, vec![7u8; 4 * 4096]).expect("root");
        fs::write(&kernel, b"kernel").expect("kernel");
        let key = SigningKey::from_bytes(&[3u8; 32]);
        let out = dir.path().join("x.chrysalis-bundle");
        let mut inputs = Inputs { root, kernel, fields: fields(), image_keys: None };
        let manifest = make(&inputs, &key, &out).expect("bundle");
        assert_eq!(manifest.root.size, 4 * 4096);
        assert_eq!(manifest.security_version, 2);
        let names: Vec<String> = bundle::inspect(&out).expect("inspect").into_iter().map(|m| m.name).collect();
        assert_eq!(names, bundle::MEMBERS);
        // Another key does not verify it.
        let other = TrustedKeys::from_keys(
            PathBuf::from("other"),
            vec![TrustedKey { name: "other".into(), key: SigningKey::from_bytes(&[4u8; 32]).verifying_key() }],
        );
        let err = verify(&out, &other, "chrysalis-qemu-x86_64").expect_err("foreign key");
        assert!(matches!(err, bundle::BundleError::UnknownKey { .. }), "{err}");

        // Made from an image whose root trusts another key: refused, and no bundle is left.
        let image_keys = dir.path().join("update-keys");
        fs::create_dir(&image_keys).expect("mkdir");
        update::keys::write_public_key(
            &image_keys.join("release.pub"),
            &SigningKey::from_bytes(&[4u8; 32]).verifying_key(),
        )
        .expect("pub");
        inputs.image_keys = Some(image_keys.clone());
        let err = format!("{:#}", make(&inputs, &key, &out).expect_err("untrusted signer"));
        assert!(err.contains("does not trust its signing key"), "{err}");
        assert!(!out.exists(), "a bundle its own image refuses was left behind");
        // Trusted: fine.
        update::keys::write_public_key(&image_keys.join("dev.pub"), &key.verifying_key()).expect("pub");
        make(&inputs, &key, &out).expect("trusted signer");
    }

    /// A bundle of a built image carries the image's security_version; another one is refused.
    #[test]
    fn a_bundle_carries_its_images_security_version() {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("image");
        fs::create_dir(&image).expect("mkdir");
        let f = fields();
        let manifest = serde_json::json!({
            "compatible": f.compatible, "version": f.version, "build_id": f.build_id,
            "security_version": 7, "root": {"verity": f.verity}, "cmdline": f.cmdline,
        });
        fs::write(image.join("manifest.json"), manifest.to_string()).expect("manifest");
        let args = |sv: Option<u64>| BundleArgs {
            board: "qemu-x86_64".into(),
            image_dir: Some(image.clone()),
            key: None,
            dev_keys: true,
            security_version: sv,
            out: None,
            cmdline_extra: None,
            version: None,
            root: None,
            kernel: None,
            verity_json: None,
            build_id: None,
        };
        assert_eq!(inputs(&args(None)).expect("inputs").fields.security_version, 7);
        assert_eq!(inputs(&args(Some(7))).expect("same").fields.security_version, 7);
        let err = format!("{:#}", inputs(&args(Some(8))).expect_err("a different level"));
        assert!(err.contains("security_version 7") && err.contains("--security-version 8"), "{err}");
        // An image manifest without a security_version (built before it existed): rebuild.
        fs::write(
            image.join("manifest.json"),
            r#"{"compatible":"x","version":"1","build_id":"b","root":{"verity":{}},"cmdline":""}"#,
        )
        .expect("old manifest");
        let err = format!("{:#}", inputs(&args(None)).expect_err("old image"));
        assert!(err.contains("rebuild"), "{err}");
    }

    #[test]
    fn default_names_separate_custom_bundles() {
        let plain = default_out(&fields(), None);
        let fault = default_out(&fields(), Some("chrysalis.fault=never-healthy"));
        assert!(plain.ends_with("bundles/chrysalis-qemu-x86_64-0.2.0.chrysalis-bundle"), "{}", plain.display());
        assert_ne!(plain, fault);
        assert_eq!(default_out(&fields(), Some("  ")), plain);
    }

    /// The image build renders slot A's command line itself; it must be the line the updater
    /// renders for an updated slot (`update::slot_cmdline`), or a fresh image and an updated
    /// one would boot differently.
    #[test]
    fn image_and_updater_render_the_same_slot_cmdline() {
        let f = fields();
        let image_verity = crate::image::assemble::Verity {
            root_hash: f.verity.root_hash.clone(),
            salt: f.verity.salt.clone(),
            data_blocks: f.verity.data_blocks,
            hash_offset: f.verity.hash_offset,
        };
        let manifest = Manifest {
            format: update::manifest::FORMAT,
            compatible: f.compatible.clone(),
            version: f.version.clone(),
            build_id: f.build_id.clone(),
            security_version: f.security_version,
            kernel: update::manifest::Blob { sha256: "00".repeat(32), size: 1 },
            root: update::manifest::RootImage { sha256: "00".repeat(32), size: 4 * 4096, verity: f.verity.clone() },
            cmdline: f.cmdline.clone(),
        };
        let uuid = "0b4ac8a5-7d5a-4b8c-9c1e-3f2a1b0c9d8e";
        assert_eq!(
            crate::image::assemble::slot_cmdline(
                uuid,
                &image_verity,
                'a',
                &f.version,
                1,
                f.security_version,
                &f.cmdline
            ),
            update::slot_cmdline(update::Slot::A, uuid, 1, &manifest)
        );
    }
}

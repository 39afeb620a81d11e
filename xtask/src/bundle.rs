//! `cargo xtask bundle`: a signed update bundle (`*.chrysalis-bundle`) from a built image.
//!
//! Inputs: the image build's output directory (`--image-dir`, default
//! `$CHRYSALIS_CACHE/appliance/<board>/current`): `root.img`, `vmlinuz` and `manifest.json`
//! (compatible, version, build id, verity parameters, board kernel arguments). Without a built
//! image, `--root`, `--kernel`, `--verity-json` and `--version` name the pieces explicitly.
//! `--cmdline-extra` appends kernel arguments to the signed manifest (tests: a fault-injection
//! bundle with `chrysalis.fault=never-healthy`).
//!
//! The bundle is signed with the dev update key (`$CHRYSALIS_CACHE/keys/update-signing.key`,
//! generated on first use; the image embeds its `.pub`) or `--key FILE`, then read back through
//! the same streaming verifier a box uses. The format and the signing live in the `update`
//! crate (`update::bundle::create`); this file only gathers inputs.

use crate::{flags::BundleArgs, keys, paths};
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
}

pub fn run(args: &BundleArgs) -> Result<()> {
    let started = Instant::now();
    let mut inputs = inputs(args)?;
    let want = Manifest::compatible_for_board(&args.board);
    if inputs.fields.compatible != want {
        bail!("the image is for `{}`, not `{want}` (--board {})", inputs.fields.compatible, args.board);
    }
    if let Some(extra) = args.cmdline_extra.as_deref().map(str::trim).filter(|e| !e.is_empty()) {
        inputs.fields.cmdline = format!("{} {extra}", inputs.fields.cmdline.trim()).trim().to_string();
    }
    let key = signing_key(args.key.as_deref())?;
    let out = match &args.out {
        Some(out) => out.clone(),
        None => default_out(&inputs.fields, args.cmdline_extra.as_deref()),
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    eprintln!(
        "bundle: {} {} from {} + {} ...",
        inputs.fields.compatible,
        inputs.fields.version,
        inputs.root.display(),
        inputs.kernel.display()
    );
    let manifest = make(&inputs, &key, &out)?;
    eprintln!(
        "bundle: {} ({:.1} MiB: root.img {:.1} MiB, vmlinuz {:.1} MiB), signed by {}, verified in {}s",
        out.display(),
        fs::metadata(&out)?.len() as f64 / 1048576.0,
        manifest.root.size as f64 / 1048576.0,
        manifest.kernel.size as f64 / 1048576.0,
        hex::encode(key.verifying_key().as_bytes()),
        started.elapsed().as_secs()
    );
    println!("{}", out.display());
    Ok(())
}

/// Creates the bundle at `out`, then reads it back through the box's verifier.
fn make(inputs: &Inputs, key: &SigningKey, out: &Path) -> Result<Manifest> {
    let manifest = bundle::create(&inputs.root, &inputs.kernel, &inputs.fields, key, out)
        .map_err(|e| anyhow::anyhow!(update::chain(&e)))
        .with_context(|| format!("making {}", out.display()))?;
    verify(out, key, &manifest.compatible)
        .map_err(|e| anyhow::anyhow!(update::chain(&e)))
        .with_context(|| format!("verifying the new bundle {}", out.display()))?;
    Ok(manifest)
}

fn verify(path: &Path, key: &SigningKey, compatible: &str) -> Result<(), bundle::BundleError> {
    let keys = TrustedKeys::from_keys(
        PathBuf::from("(the signing key)"),
        vec![TrustedKey { name: "signing key".into(), key: key.verifying_key() }],
    );
    let expect = Expect { keys: &keys, compatible, slot_bytes: u64::MAX };
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
            "reading {} (build the image first: `cargo xtask image --board {}`, or pass --root/--kernel/--verity-json)",
            manifest_path.display(),
            args.board
        )
    })?;
    let image: ImageManifest =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", manifest_path.display()))?;
    Ok(Inputs {
        root: dir.join("root.img"),
        kernel: dir.join("vmlinuz"),
        fields: ManifestFields {
            compatible: image.compatible,
            version: args.version.clone().unwrap_or(image.version),
            build_id: image.build_id,
            verity: image.root.verity,
            cmdline: image.cmdline,
        },
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
            verity,
            cmdline: board.kernel.cmdline.clone(),
        },
    })
}

fn signing_key(path: Option<&Path>) -> Result<SigningKey> {
    match path {
        // The dev key is shared with `cargo xtask image`, which embeds its public half.
        None => Ok(SigningKey::from_bytes(&keys::dev_update_key()?.seed)),
        Some(path) => {
            let (key, created) =
                update::keys::load_or_generate_signing_key(path).map_err(|e| anyhow::anyhow!(update::chain(&e)))?;
            if created {
                eprintln!("bundle: generated the signing key {} (+ .pub)", path.display());
            }
            Ok(key)
        }
    }
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
        let inputs = Inputs { root, kernel, fields: fields() };
        let manifest = make(&inputs, &key, &out).expect("bundle");
        assert_eq!(manifest.root.size, 4 * 4096);
        let names: Vec<String> = bundle::inspect(&out).expect("inspect").into_iter().map(|m| m.name).collect();
        assert_eq!(names, bundle::MEMBERS);
        // Another key does not verify it.
        let err = verify(&out, &SigningKey::from_bytes(&[4u8; 32]), "chrysalis-qemu-x86_64").expect_err("foreign key");
        assert!(matches!(err, bundle::BundleError::UnknownKey { .. }), "{err}");
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
            kernel: update::manifest::Blob { sha256: "00".repeat(32), size: 1 },
            root: update::manifest::RootImage { sha256: "00".repeat(32), size: 4 * 4096, verity: f.verity.clone() },
            cmdline: f.cmdline.clone(),
        };
        let uuid = "0b4ac8a5-7d5a-4b8c-9c1e-3f2a1b0c9d8e";
        assert_eq!(
            crate::image::assemble::slot_cmdline(uuid, &image_verity, 'a', &f.version, 1, &f.cmdline),
            update::slot_cmdline(update::Slot::A, uuid, 1, &manifest)
        );
    }
}

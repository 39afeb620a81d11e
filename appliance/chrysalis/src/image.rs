//! `chrysalis image …`: import, list, rm, tag, inspect, verify, gc.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use images::{Digest, ImageSource, Kind, Manifest, Reference, Store};

use crate::flags::{GcArgs, ImageCmd, ImportArgs, VmStateDir};
use crate::output;

/// Runs an image verb.
pub fn run(store: &Store, cmd: ImageCmd) -> Result<()> {
    match cmd {
        ImageCmd::Import(a) => import(store, &a),
        ImageCmd::List(a) => output::entries(store.list()?, Kind::Image, a.json),
        ImageCmd::Rm { refs } => remove(store, &refs, Kind::Image),
        ImageCmd::Tag { source, target } => {
            let d = store.tag(&source, &target)?;
            println!("{} {d}", Reference::parse(&target)?);
            Ok(())
        }
        ImageCmd::Inspect { reference } => inspect(store, &reference),
        ImageCmd::Verify { reference } => verify(store, reference.as_deref()),
        ImageCmd::Gc(a) => gc(store, &a),
    }
}

fn import(store: &Store, a: &ImportArgs) -> Result<()> {
    let (name, src) = match (&a.dir, &a.template) {
        (Some(dir), _) => {
            // clap requires --name with --dir.
            let name = a.name.clone().context("--dir needs --name")?;
            (name, source_from_dir(dir, a.kernel.as_deref(), a.cmdline.as_deref())?)
        }
        (None, Some(t)) => {
            let catalog = match &a.catalog {
                Some(p) => vmm::Catalog::load(p),
                None => vmm::Catalog::load_default(),
            }
            .context("loading the image catalog (`cargo xtask vm-image <template>` builds it)")?;
            let (tname, template) = catalog.resolve(t)?;
            tracing::info!(template = tname, "importing from the catalog");
            (a.name.clone().unwrap_or_else(|| t.clone()), ImageSource::from(template))
        }
        (None, None) => bail!("give a catalog template or --dir"),
    };
    let reference = Reference::parse(&name)?;
    let d = store.import_image(&name, &src).with_context(|| format!("importing {reference}"))?;
    println!("{reference} {d}");
    Ok(())
}

fn first_existing(dir: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

/// The files of an image directory (see `chrysalis image import --help`).
pub fn source_from_dir(dir: &Path, kernel: Option<&Path>, cmdline: Option<&str>) -> Result<ImageSource> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    // `cargo xtask vm-image` writes {"template": …, "built": {"kernel": …, "cmdline": …}}.
    let built: Option<serde_json::Value> = match std::fs::read(dir.join("manifest.json")) {
        Ok(b) => Some(
            serde_json::from_slice::<serde_json::Value>(&b)
                .with_context(|| format!("parsing {}", dir.join("manifest.json").display()))?
                .get("built")
                .cloned()
                .unwrap_or_default(),
        ),
        Err(_) => None,
    };
    let built_str = |k: &str| built.as_ref().and_then(|b| b.get(k)).and_then(|v| v.as_str()).map(str::to_string);
    let kernel = match kernel {
        Some(k) => k.to_path_buf(),
        None => first_existing(dir, &["vmlinux", "kernel"])
            .or_else(|| built_str("kernel").map(PathBuf::from))
            .with_context(|| format!("no kernel in {}: add vmlinux or pass --kernel", dir.display()))?,
    };
    let initrd = first_existing(dir, &["initrd.cpio.gz", "initrd.cpio", "initrd"])
        .with_context(|| format!("no initrd.cpio.gz (or initrd) in {}", dir.display()))?;
    let cmdline = match cmdline {
        Some(c) => c.to_string(),
        None => match std::fs::read_to_string(dir.join("cmdline")) {
            Ok(s) => s.trim().to_string(),
            Err(_) => built_str("cmdline").unwrap_or_default(),
        },
    };
    Ok(ImageSource {
        kernel,
        initrd,
        rootfs: first_existing(dir, &["rootfs.erofs", "rootfs"]),
        overlay_base: first_existing(dir, &["overlay-empty.ext4", "overlay_base"]),
        cmdline,
    })
}

/// Untags `refs` after checking each names an entry of `kind`.
pub fn remove(store: &Store, refs: &[String], kind: Kind) -> Result<()> {
    for r in refs {
        let d = store.lookup(r)?;
        let found = store.manifest(&d)?.kind();
        if found != kind {
            let verb = if found == Kind::Image { "image" } else { "snapshot" };
            bail!("{r} is {}, not {}: use `chrysalis {verb} rm`", found.with_article(), kind.with_article());
        }
        store.remove(r)?;
        println!("untagged {} ({d})", Reference::parse(r)?);
    }
    Ok(())
}

fn inspect(store: &Store, reference: &str) -> Result<()> {
    let d = store.lookup(reference)?;
    let manifest: Manifest = store.manifest(&d)?;
    let resolved = store.resolve(reference)?;
    let out = serde_json::json!({"digest": d, "manifest": manifest, "resolved": resolved});
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn verify(store: &Store, reference: Option<&str>) -> Result<()> {
    match reference {
        Some(r) => {
            store.verify(r)?;
            println!("{r}: ok");
        }
        None => {
            let bad = store.verify_all()?;
            if !bad.is_empty() {
                for d in &bad {
                    eprintln!("corrupt: {d}");
                }
                bail!("{} corrupt blob(s)", bad.len());
            }
            println!("all blobs ok");
        }
    }
    Ok(())
}

/// Digests the live VMs under `vms` use from `store` ([`Store::live_vm_digests`]).
pub fn live_vm_digests(store: &Store, vms: &VmStateDir) -> Result<Vec<Digest>> {
    Ok(store.live_vm_digests(&vmm::record::vms_dir(&vms.vm_state_dir))?)
}

fn gc(store: &Store, a: &GcArgs) -> Result<()> {
    let mut in_use = live_vm_digests(store, &a.vms)?;
    for k in &a.keep {
        in_use.push(Digest::parse(k)?);
    }
    let r = store.gc(&in_use)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "removed {} manifest(s), {} blob(s), {} materialised snapshot(s), {} temp file(s); freed {}; kept {} blob(s)",
            r.removed_manifests.len(),
            r.removed_blobs.len(),
            r.removed_materialised,
            r.removed_temp,
            output::human_size(r.freed_bytes),
            r.kept_blobs
        );
    }
    Ok(())
}

//! Garbage collection: mark from the roots (every named manifest, plus the digests live VMs
//! use), sweep the rest.
//!
//! Marking follows an image manifest to its four blobs, a snapshot manifest to its files and
//! its base image manifest (and on). An `in_use` digest may be a manifest (followed the same
//! way) or a plain blob (kept as is). A named manifest that exists but cannot be read is an
//! error that stops the collection — guessing would delete what it protects. Sweeping removes
//! unmarked blobs, the materialised directories of unmarked snapshots, and everything under
//! `tmp/` (no writer runs: gc holds `.gc.lock` exclusively).

use std::collections::HashSet;
use std::path::Path;

use serde::Serialize;

use crate::error::ImageError;
use crate::manifest::{Manifest, MAX_MANIFEST_BYTES};
use crate::reference::Digest;
use crate::store::Store;

/// What a collection removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GcReport {
    /// Manifests removed (image and snapshot).
    pub removed_manifests: Vec<Digest>,
    /// Other blobs removed.
    pub removed_blobs: Vec<Digest>,
    /// Disk bytes the removed blobs occupied.
    pub freed_bytes: u64,
    /// Materialised snapshot directories removed.
    pub removed_materialised: usize,
    /// Leftover temp files and directories removed.
    pub removed_temp: usize,
    /// Blobs kept.
    pub kept_blobs: usize,
}

/// What a digest on the mark stack must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A manifest (named, or a snapshot's base image): unreadable is an error.
    Manifest,
    /// A manifest or a plain blob (an `in_use` digest).
    Either,
    /// A plain blob named by a manifest.
    Blob,
}

impl Store {
    /// Reads `d` as a manifest if it looks like one (small, JSON object that parses).
    fn maybe_manifest(&self, d: &Digest) -> Option<Manifest> {
        let size = self.blobs.size(d).ok()?;
        if size.len > MAX_MANIFEST_BYTES {
            return None;
        }
        self.manifest(d).ok()
    }

    fn mark(&self, roots: Vec<(Digest, Expect)>) -> Result<HashSet<Digest>, ImageError> {
        let mut marked = HashSet::new();
        let mut stack = roots;
        while let Some((d, expect)) = stack.pop() {
            if !marked.insert(d.clone()) {
                continue;
            }
            if !self.blobs.has(&d) {
                tracing::warn!(digest = %d, "gc: a referenced blob is missing");
                continue;
            }
            let m = match expect {
                Expect::Blob => None,
                Expect::Either => self.maybe_manifest(&d),
                Expect::Manifest => Some(self.manifest(&d)?),
            };
            match m {
                Some(Manifest::Image(im)) => stack.extend(im.blobs().map(|b| (b.clone(), Expect::Blob))),
                Some(Manifest::Snapshot(sm)) => {
                    stack.extend(sm.files.values().map(|b| (b.clone(), Expect::Blob)));
                    stack.push((sm.base_image.clone(), Expect::Manifest));
                }
                None => {}
            }
        }
        Ok(marked)
    }

    /// The digests the live VMs under `vms_dir` (a `vmm` state directory's `vms/`, QEMU and
    /// cloud-hypervisor alike) use from this store ([`Store::in_use_by`] of each): what
    /// [`Store::gc`] must keep for them. A directory that does not exist holds no VM; one that
    /// cannot be listed is an error, never an empty answer.
    pub fn live_vm_digests(&self, vms_dir: &Path) -> Result<Vec<Digest>, ImageError> {
        let jail = vmm::jail::JailSettings::from_env();
        let find = |pidfile| vmm::lifecycle::Finder { pidfile, cgroups: jail.cgroups() };
        let listing = |backend, pidfile| {
            vmm::lifecycle::list(vms_dir, backend, &find(pidfile))
                .map_err(|source| ImageError::VmListing { dir: vms_dir.to_path_buf(), source })
        };
        let mut live = listing(vmm::Backend::Qemu, Some(vmm::qemu::cmdline::files::PID))?;
        live.extend(listing(vmm::Backend::CloudHypervisor, None)?);
        let mut out = Vec::new();
        for vm in &live {
            let used = self.in_use_by(vm);
            tracing::debug!(vm = %vm.id, used = used.len(), "live VM");
            out.extend(used);
        }
        Ok(out)
    }

    /// Removes every blob and manifest reachable from no name, no named snapshot's base image
    /// and no `in_use` digest (what live VMs use: [`Store::in_use_by`]).
    pub fn gc(&self, in_use: &[Digest]) -> Result<GcReport, ImageError> {
        let span = tracing::info_span!("image_gc", in_use = in_use.len());
        let _e = span.enter();
        let _gc = self.gc_exclusive()?;
        let _l = self.refs_lock()?;
        let refs = self.load_refs()?;
        let roots = refs
            .refs
            .values()
            .map(|d| (d.clone(), Expect::Manifest))
            .chain(in_use.iter().map(|d| (d.clone(), Expect::Either)))
            .collect();
        let marked = self.mark(roots)?;
        let mut report = GcReport::default();
        for d in self.blobs.all()? {
            if marked.contains(&d) {
                report.kept_blobs += 1;
                continue;
            }
            let is_manifest = self.maybe_manifest(&d).is_some();
            report.freed_bytes += self.blobs.remove(&d)?;
            tracing::debug!(digest = %d, is_manifest, "gc: removed");
            if is_manifest {
                report.removed_manifests.push(d);
            } else {
                report.removed_blobs.push(d);
            }
        }
        let mroot = self.materialised_root();
        for e in std::fs::read_dir(&mroot).map_err(ImageError::io("listing", &mroot))?.flatten() {
            let name = e.file_name();
            let keep = name.to_str().and_then(Digest::from_hex).is_some_and(|d| marked.contains(&d));
            if !keep {
                remove_any(&e.path())?;
                report.removed_materialised += 1;
            }
        }
        let tmp = self.blobs.tmp();
        for e in std::fs::read_dir(tmp).map_err(ImageError::io("listing", tmp))?.flatten() {
            remove_any(&e.path())?;
            report.removed_temp += 1;
        }
        tracing::info!(
            manifests = report.removed_manifests.len(),
            blobs = report.removed_blobs.len(),
            freed_bytes = report.freed_bytes,
            kept = report.kept_blobs,
            "gc done"
        );
        Ok(report)
    }
}

fn remove_any(p: &std::path::Path) -> Result<(), ImageError> {
    let r = match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) => Err(e),
    };
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ImageError::io("removing", p)(e)),
    }
}

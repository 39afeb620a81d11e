//! How much host disk one VM's writable disk can take, at most.
//!
//! A VM writes to one disk only: its copy-on-write overlay (`overlay.qcow2`) on the template's
//! empty ext4 image (`BootSpec::overlay_base`). The guest sees a block device exactly as large
//! as that image, so however much it writes, the overlay's data clusters never pass the image's
//! size; qcow2 adds its tables on top (an L2 entry per 64 KiB cluster and a refcount per
//! cluster: about 0.02 %). [`writable_disk_cap`] is that worst case, with room to spare, and
//! is what sandboxd's disk budget counts per VM. A template without an overlay image writes to
//! a tmpfs inside the guest, which its memory (and its cgroup) already bounds: it costs no disk.

use std::path::Path;

use crate::driver::BootSpec;

/// Allowance for qcow2 metadata on top of the data: one part in 1024 of the virtual size…
const METADATA_SHARE: u64 = 1024;
/// …plus this many bytes (header, L1 table, the first refcount block).
const METADATA_FIXED: u64 = 4 << 20;

/// The most host disk a VM booted from `spec` can fill with its overlay, in bytes (0 when it
/// has no overlay disk).
pub fn writable_disk_cap(spec: &BootSpec) -> std::io::Result<u64> {
    match &spec.overlay_base {
        Some(base) => Ok(cap_for_virtual_size(std::fs::metadata(base)?.len().max(spec.overlay_bytes.unwrap_or(0)))),
        None => Ok(0),
    }
}

/// The guest-visible size of the writable overlay `spec` asks for on `base`:
/// `spec.overlay_bytes` (refused below the base's length: the guest's filesystem fills the
/// base), else `None` (the base's size).
pub fn overlay_size(spec: &BootSpec, base: &Path) -> Result<Option<u64>, crate::DriverError> {
    let Some(want) = spec.overlay_bytes else { return Ok(None) };
    let have = std::fs::metadata(base)
        .map_err(|e| crate::DriverError::io(format!("reading the size of {}", base.display()), e))?
        .len();
    if want < have {
        return Err(crate::DriverError::Invalid(format!(
            "a writable disk of {want} bytes is smaller than its image's {have} bytes ({}); ask for at least {}",
            base.display(),
            have
        )));
    }
    Ok(Some(want))
}

/// Grows the raw overlay `file` (a copy of its base) to `bytes` of guest-visible size (sparse).
pub fn grow_raw(file: &Path, bytes: u64) -> Result<(), crate::DriverError> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .map_err(|e| crate::DriverError::io(format!("opening {}", file.display()), e))?;
    f.set_len(bytes).map_err(|e| crate::DriverError::io(format!("growing {} to {bytes} bytes", file.display()), e))
}

/// The worst-case size of a qcow2 overlay whose guest-visible size is the length of `base`.
pub fn overlay_cap(base: &Path) -> std::io::Result<u64> {
    Ok(cap_for_virtual_size(std::fs::metadata(base)?.len()))
}

/// The worst-case size of a qcow2 file of `virtual_size` bytes.
pub fn cap_for_virtual_size(virtual_size: u64) -> u64 {
    virtual_size.saturating_add(virtual_size / METADATA_SHARE).saturating_add(METADATA_FIXED)
}

/// `bytes` in MiB, rounded up.
pub fn mib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_the_virtual_size_plus_metadata() {
        assert_eq!(cap_for_virtual_size(0), 4 << 20);
        let gib = 1u64 << 30;
        assert_eq!(cap_for_virtual_size(gib), gib + (1 << 20) + (4 << 20));
        assert_eq!(cap_for_virtual_size(u64::MAX), u64::MAX);
        assert_eq!(mib_ceil(1), 1);
        assert_eq!(mib_ceil(1 << 20), 1);
        assert_eq!(mib_ceil((1 << 20) + 1), 2);
    }

    #[test]
    fn a_spec_without_an_overlay_costs_no_disk_and_one_with_it_costs_its_image() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("overlay.ext4");
        let f = std::fs::File::create(&base).expect("create");
        f.set_len(64 << 20).expect("set_len");
        let mut spec = BootSpec {
            overlay_bytes: None,
            name: "base".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            rootfs: None,
            overlay_base: None,
            cmdline: String::new(),
            size: crate::SizeClass::Small,
            accel: Default::default(),
            nic: None,
            rng: true,
            volumes: true,
            ram: crate::driver::Ram::Anonymous,
        };
        assert_eq!(writable_disk_cap(&spec).expect("cap"), 0);
        spec.overlay_base = Some(base);
        assert_eq!(writable_disk_cap(&spec).expect("cap"), cap_for_virtual_size(64 << 20));
        spec.overlay_base = Some(dir.path().join("missing"));
        assert!(writable_disk_cap(&spec).is_err());
    }
}

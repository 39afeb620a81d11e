//! A VM's identity and shape: its id from its name ([`vm_id_for`], the `vc-` [`OWNERSHIP`] and
//! the instance rule [`owner_of`], both `vmm::owned`'s), its network policy ([`vm_policy`]) and
//! its size class ([`size_for`]).

use sha2::{Digest as _, Sha256};
use vmm::owned::Ownership;
use vmm::{SizeClass, VmId};
use vmnet::VmPolicy;

use crate::backend::BackendError;

/// The prefix of every VM id this backend makes.
pub const ID_PREFIX: &str = "vc-";
/// The driver VMs this backend owns: `vc-` ids, instances `<id>-<8 hex>`.
pub const OWNERSHIP: Ownership = Ownership::new(ID_PREFIX);
/// Longest id [`vm_id_for`] makes (so that the driver's `<id>-<8 hex>` keeps the whole id).
pub(super) const MAX_ID: usize = 40;

/// The VM id of the VM named `name` (see the module doc): deterministic, `vc-` prefixed,
/// `[a-z0-9-]`, at most 40 characters, never ending in `-`.
pub fn vm_id_for(name: &str) -> String {
    let direct = format!("{ID_PREFIX}{name}");
    if direct.len() <= MAX_ID && VmId::new(direct.as_str()).is_ok() && !direct.ends_with('-') {
        return direct;
    }
    let hash = hex::encode(Sha256::digest(name.as_bytes()));
    let slug: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
        .collect();
    let slug: String = slug.trim_matches('-').chars().take(MAX_ID - ID_PREFIX.len() - 11).collect();
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        format!("{ID_PREFIX}{}", &hash[..10])
    } else {
        format!("{ID_PREFIX}{slug}-{}", &hash[..10])
    }
}

/// The backend id owning the driver VM `vmm_id` (`<id>-<8 hex>` → `<id>`), if it is one of ours
/// ([`OWNERSHIP`]).
pub fn owner_of(vmm_id: &str) -> Option<&str> {
    OWNERSHIP.owner_of(vmm_id)
}

/// A VM's network policy (see the module doc): egress for `network: egress` (refused without an
/// uplink), the shared group `<namespace>/<shared>`.
pub fn vm_policy(
    network: Option<&str>,
    namespace: &str,
    shared: Option<&str>,
    has_uplink: bool,
) -> Result<VmPolicy, BackendError> {
    let egress = match network {
        None | Some("default") => false,
        Some("egress") if has_uplink => true,
        Some("egress") => {
            return Err(BackendError::Unsupported {
                what: "network \"egress\": this node has no uplink for VMs (set [vk_cocoon] vm_uplink, VK_NET_UPLINK)"
                    .to_owned(),
            })
        }
        Some(n) => {
            return Err(BackendError::Unsupported {
                what: format!("network {n:?}: this node has the networks default (no route out) and egress"),
            })
        }
    };
    Ok(VmPolicy { group: shared.map(|g| format!("{namespace}/{g}")), egress })
}

/// The smallest size class holding `vcpus` and `memory_mib`.
pub fn size_for(vcpus: u32, memory_mib: u64) -> Option<SizeClass> {
    SizeClass::ALL.into_iter().find(|c| c.vcpus() >= vcpus && c.memory_mib() >= memory_mib)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn ids_are_derived_from_names() {
        assert_eq!(vm_id_for("sandbox-default-cocoon-example"), "vc-sandbox-default-cocoon-example");
        for name in [
            "Upper_Case",
            "a-",
            "x".repeat(63).as_str(),
            "vk-default-very-long-pod-name-that-goes-on-and-on",
            "----",
            "ünïcode",
        ] {
            let id = vm_id_for(name);
            assert!(id.starts_with(ID_PREFIX) && id.len() <= MAX_ID, "{name} → {id}");
            assert!(VmId::new(id.as_str()).is_ok() && !id.ends_with('-'), "{name} → {id}");
            assert_eq!(vm_id_for(name), id, "deterministic");
            // The driver's generated instance ids map back to the owner.
            let inst = VmId::generate(&id);
            assert_eq!(owner_of(inst.as_str()), Some(id.as_str()), "{inst}");
        }
        assert_ne!(vm_id_for("Upper_Case"), vm_id_for("upper-case"));
        assert_eq!(owner_of("base-0a1b2c3d"), None, "not ours");
        assert_eq!(owner_of("vc-x-0a1b2c3"), None);
        assert_eq!(owner_of("vc-x-0A1B2C3D"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(size_for(1, 512), Some(SizeClass::Small));
        assert_eq!(size_for(1, 513), Some(SizeClass::Medium));
        assert_eq!(size_for(3, 512), Some(SizeClass::Large));
        assert_eq!(size_for(4, 8192), Some(SizeClass::XLarge));
        assert_eq!(size_for(9, 1), None);
    }

    #[test]
    fn network_policy() {
        assert_eq!(vm_policy(None, "ns", None, false).unwrap(), VmPolicy::default(), "no group, no egress");
        assert_eq!(vm_policy(Some("default"), "ns", None, true).unwrap(), VmPolicy::default());
        let p = vm_policy(Some("egress"), "team-a", Some("g1"), true).unwrap();
        assert_eq!(p, VmPolicy { group: Some("team-a/g1".into()), egress: true }, "the group is scoped by namespace");
        let e = vm_policy(Some("egress"), "ns", None, false).unwrap_err();
        assert!(matches!(&e, BackendError::Unsupported { what } if what.contains("VK_NET_UPLINK")), "{e}");
        assert!(matches!(vm_policy(Some("lan"), "ns", None, true), Err(BackendError::Unsupported { .. })));
    }
}

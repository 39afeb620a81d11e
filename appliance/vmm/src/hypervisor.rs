//! Which hypervisor a service drives: `qemu`, `cloud-hypervisor`, or `auto` (cloud-hypervisor
//! when its binary is present and KVM works, else QEMU, which also runs under TCG). The choice
//! and why are returned so the caller logs them and shows them (`/v1/info`, `chrysalis status`).

use std::ffi::OsStr;
use std::fmt;
use std::sync::Arc;

use crate::accel::KvmFacts;
use crate::cloud_hypervisor::{CloudHypervisor, CloudHypervisorConfig};
use crate::driver::{Backend, Driver};
use crate::qemu::{QemuConfig, QemuDriver};

/// The configured preference.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HypervisorPreference {
    /// cloud-hypervisor when its binary is present and KVM works; else QEMU.
    #[default]
    Auto,
    /// QEMU `-M microvm` (KVM, else TCG).
    Qemu,
    /// cloud-hypervisor (needs KVM).
    CloudHypervisor,
}

impl fmt::Display for HypervisorPreference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HypervisorPreference::Auto => "auto",
            HypervisorPreference::Qemu => "qemu",
            HypervisorPreference::CloudHypervisor => "cloud-hypervisor",
        })
    }
}

impl std::str::FromStr for HypervisorPreference {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(HypervisorPreference::Auto),
            "qemu" => Ok(HypervisorPreference::Qemu),
            "cloud-hypervisor" => Ok(HypervisorPreference::CloudHypervisor),
            other => Err(format!("unknown hypervisor {other:?}: expected auto, qemu or cloud-hypervisor")),
        }
    }
}

/// What was chosen, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The backend.
    pub backend: Backend,
    /// Why, in a sentence (logged and shown).
    pub why: String,
}

/// Chooses a backend for `pref`, given whether the cloud-hypervisor binary resolves (`ch`: its
/// path, or why not) and why KVM is unusable (`None`: usable). Pure, for tests.
pub fn choose(pref: HypervisorPreference, ch: Result<&OsStr, String>, kvm_unusable: Option<&str>) -> Choice {
    let qemu = |why: String| Choice { backend: Backend::Qemu, why };
    match pref {
        HypervisorPreference::Qemu => qemu("hypervisor = qemu in the config".into()),
        HypervisorPreference::CloudHypervisor => {
            Choice { backend: Backend::CloudHypervisor, why: "hypervisor = cloud-hypervisor in the config".into() }
        }
        HypervisorPreference::Auto => match (ch, kvm_unusable) {
            (Ok(bin), None) => Choice {
                backend: Backend::CloudHypervisor,
                why: format!("auto: {} is present and KVM works", bin.to_string_lossy()),
            },
            (Err(why), _) => qemu(format!("auto: no cloud-hypervisor ({why})")),
            (Ok(_), Some(kvm)) => qemu(format!("auto: cloud-hypervisor needs KVM, which is unusable here ({kvm})")),
        },
    }
}

/// Builds the driver `pref` resolves to on this host, with VMs under `qemu.state_dir` (the
/// cloud-hypervisor driver shares the state dir and the console cap).
pub fn driver(pref: HypervisorPreference, qemu: QemuConfig) -> Result<(Arc<dyn Driver>, Choice), crate::DriverError> {
    let ch_cfg = CloudHypervisorConfig {
        console_cap: qemu.console_cap,
        ..CloudHypervisorConfig::from_env(qemu.state_dir.clone())
    };
    let binary = crate::cloud_hypervisor::process::resolve_binary(ch_cfg.binary.as_deref(), ch_cfg.path_var.as_deref());
    let kvm = KvmFacts::gather().unusable_reason();
    let choice = choose(pref, binary.as_ref().map(|p| p.as_os_str()).map_err(|e| e.to_string()), kvm.as_deref());
    tracing::info!(preference = %pref, backend = %choice.backend, why = %choice.why, "hypervisor chosen");
    let driver: Arc<dyn Driver> = match choice.backend {
        Backend::Qemu => Arc::new(QemuDriver::new(qemu)),
        Backend::CloudHypervisor => {
            Arc::new(CloudHypervisor::new(ch_cfg).map_err(|e| crate::DriverError::Invalid(crate::error_chain(&e)))?)
        }
    };
    Ok((driver, choice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_cloud_hypervisor_only_with_its_binary_and_kvm() {
        let bin = OsStr::new("/usr/bin/cloud-hypervisor");
        let c = choose(HypervisorPreference::Auto, Ok(bin), None);
        assert_eq!(c.backend, Backend::CloudHypervisor);
        let c = choose(HypervisorPreference::Auto, Ok(bin), Some("host KVM is PVM-only"));
        assert_eq!(c.backend, Backend::Qemu);
        assert!(c.why.contains("PVM-only"), "{}", c.why);
        let c = choose(HypervisorPreference::Auto, Err("not on PATH".into()), None);
        assert_eq!(c.backend, Backend::Qemu);
        assert!(c.why.contains("not on PATH"), "{}", c.why);
        // An explicit choice is taken as asked (a cloud-hypervisor without KVM fails on boot,
        // with the driver's own warning).
        assert_eq!(choose(HypervisorPreference::Qemu, Ok(bin), None).backend, Backend::Qemu);
        let c = choose(HypervisorPreference::CloudHypervisor, Err("x".into()), Some("y"));
        assert_eq!(c.backend, Backend::CloudHypervisor);
        for p in [HypervisorPreference::Auto, HypervisorPreference::Qemu, HypervisorPreference::CloudHypervisor] {
            assert_eq!(p.to_string().parse::<HypervisorPreference>(), Ok(p));
        }
        assert!("kvm".parse::<HypervisorPreference>().unwrap_err().contains("expected auto, qemu or cloud-hypervisor"));
    }
}

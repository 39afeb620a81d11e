//! Accelerator choice: KVM when it works, else TCG; overridable by `CHRYSALIS_ACCEL=kvm|tcg|auto`.
//!
//! KVM "works" iff `/dev/kvm` opens read-write, `KVM_GET_API_VERSION` returns 12, and the host
//! KVM is not PVM-only (`/sys/module/kvm_pvm` absent: a PVM host only runs PVM-enabled guest
//! kernels, and ours hangs under it). The decision is logged and reported on every [`crate::Vm`].

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Environment variable overriding the probe.
pub const ENV: &str = "CHRYSALIS_ACCEL";

/// The accelerator a VM runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
    /// QEMU's software emulator (no cloud-hypervisor support).
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// What the caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccelPreference {
    /// Probe: KVM if it works, else TCG.
    #[default]
    Auto,
    /// KVM, whatever the probe says.
    Kvm,
    /// TCG.
    Tcg,
}

/// `CHRYSALIS_ACCEL` held something other than `kvm`, `tcg` or `auto`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown accelerator {0:?} (expected kvm, tcg or auto)")]
pub struct AccelError(pub String);

impl FromStr for AccelPreference {
    type Err = AccelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(AccelPreference::Auto),
            "kvm" => Ok(AccelPreference::Kvm),
            "tcg" => Ok(AccelPreference::Tcg),
            _ => Err(AccelError(s.to_string())),
        }
    }
}

impl AccelPreference {
    /// Reads `CHRYSALIS_ACCEL`; unset → `Auto`; an invalid value is logged and treated as `Auto`.
    pub fn from_env() -> Self {
        match std::env::var(ENV) {
            Ok(v) => v.parse().unwrap_or_else(|e: AccelError| {
                tracing::warn!(error = %e, "ignoring {ENV}");
                AccelPreference::Auto
            }),
            Err(_) => AccelPreference::Auto,
        }
    }
}

/// The host facts the probe decides on (injectable for tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvmFacts {
    /// `/dev/kvm` opened read-write (else the error text).
    pub open: Result<(), String>,
    /// `KVM_GET_API_VERSION`, if the ioctl succeeded.
    pub api_version: Option<i32>,
    /// `/sys/module/kvm_pvm` exists.
    pub pvm_only: bool,
}

impl KvmFacts {
    /// Gathers the facts from this host.
    pub fn gather() -> Self {
        use std::os::fd::AsRawFd;
        let pvm_only = Path::new("/sys/module/kvm_pvm").exists();
        match std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
            Ok(f) => {
                const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
                // SAFETY: KVM_GET_API_VERSION takes no argument and only returns an int; the fd is open.
                let v = unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION as _, 0) };
                KvmFacts { open: Ok(()), api_version: (v >= 0).then_some(v), pvm_only }
            }
            Err(e) => KvmFacts { open: Err(e.to_string()), api_version: None, pvm_only },
        }
    }

    /// Why KVM does not work, or `None` if it does.
    pub fn unusable_reason(&self) -> Option<String> {
        if let Err(e) = &self.open {
            return Some(format!("/dev/kvm does not open read-write: {e}"));
        }
        if self.api_version != Some(12) {
            return Some(format!("KVM_GET_API_VERSION is {:?}, expected 12", self.api_version));
        }
        if self.pvm_only {
            return Some("host KVM is PVM-only (/sys/module/kvm_pvm exists)".into());
        }
        None
    }
}

/// Decides the accelerator from a preference and host facts.
pub fn decide(pref: AccelPreference, facts: &KvmFacts) -> Accel {
    match pref {
        AccelPreference::Kvm => Accel::Kvm,
        AccelPreference::Tcg => Accel::Tcg,
        AccelPreference::Auto => match facts.unusable_reason() {
            None => Accel::Kvm,
            Some(_) => Accel::Tcg,
        },
    }
}

/// Resolves `pref` on this host and logs the decision.
pub fn resolve(pref: AccelPreference) -> Accel {
    let facts = KvmFacts::gather();
    let accel = decide(pref, &facts);
    match (pref, facts.unusable_reason()) {
        (AccelPreference::Auto, Some(why)) => {
            tracing::info!(%accel, reason = %why, "accelerator: KVM unusable, using TCG")
        }
        (AccelPreference::Auto, None) => tracing::info!(%accel, "accelerator: KVM works"),
        (_, why) => tracing::info!(%accel, kvm_unusable = ?why, "accelerator forced by {ENV}"),
    }
    accel
}

/// Probes with the preference from `CHRYSALIS_ACCEL`.
pub fn probe() -> Accel {
    resolve(AccelPreference::from_env())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(open: bool, v: Option<i32>, pvm: bool) -> KvmFacts {
        KvmFacts { open: if open { Ok(()) } else { Err("EACCES".into()) }, api_version: v, pvm_only: pvm }
    }

    #[test]
    fn auto_uses_kvm_only_when_everything_holds() {
        let a = AccelPreference::Auto;
        assert_eq!(decide(a, &facts(true, Some(12), false)), Accel::Kvm);
        assert_eq!(decide(a, &facts(false, None, false)), Accel::Tcg);
        assert_eq!(decide(a, &facts(true, Some(11), false)), Accel::Tcg);
        assert_eq!(decide(a, &facts(true, None, false)), Accel::Tcg);
        assert_eq!(decide(a, &facts(true, Some(12), true)), Accel::Tcg);
    }

    #[test]
    fn forced_preferences_win() {
        assert_eq!(decide(AccelPreference::Kvm, &facts(false, None, true)), Accel::Kvm);
        assert_eq!(decide(AccelPreference::Tcg, &facts(true, Some(12), false)), Accel::Tcg);
    }

    #[test]
    fn preference_parses() {
        assert_eq!("KVM".parse(), Ok(AccelPreference::Kvm));
        assert_eq!(" tcg\n".parse(), Ok(AccelPreference::Tcg));
        assert_eq!("auto".parse(), Ok(AccelPreference::Auto));
        assert_eq!("hvf".parse::<AccelPreference>(), Err(AccelError("hvf".into())));
    }

    #[test]
    fn pvm_reason_is_reported() {
        let why = facts(true, Some(12), true).unusable_reason().expect("unusable");
        assert!(why.contains("PVM"), "{why}");
    }
}

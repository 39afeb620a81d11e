//! [`BackendConfig`]: where and how the backend keeps its VMs, from the environment (the
//! variables are described in the [module doc](super)).

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmnet::{FilterPolicy, Ipv4Net};

use crate::config::ConfigError;

/// Where and how the backend keeps its VMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendConfig {
    /// `COCOON_ROOT_DIR`.
    pub root_dir: PathBuf,
    /// `CHRYSALIS_IMAGES`, else `<root>/images`.
    pub images_dir: PathBuf,
    /// `VK_BRIDGE`.
    pub bridge: String,
    /// `VK_VM_CIDR`.
    pub cidr: Ipv4Net,
    /// `VK_NETNS`.
    pub netns: Option<String>,
    /// `VK_BOOT_TIMEOUT` (seconds, default 300): how long `run`/`start` wait for the agent.
    pub boot_timeout: Duration,
    /// `VK_NET_HOST_ALLOW`, `VK_NET_UPLINK`, `VK_NET_REFUSE`: what VMs may reach.
    pub filter: FilterPolicy,
    /// `VK_CONSOLE_LOG_KIB` (1024, at least 16): serial console each VM keeps on disk, in
    /// bytes here; `kubectl logs` reads it.
    pub console_cap: u64,
    /// `VK_HYPERVISOR` (`auto`, `qemu` or `cloud-hypervisor`; default `auto`: cloud-hypervisor
    /// when its binary is present and KVM works, else QEMU).
    pub hypervisor: vmm::hypervisor::HypervisorPreference,
}

impl BackendConfig {
    /// From `get` (one variable's value; empty = unset) for the root `root_dir`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>, root_dir: &Path) -> Result<BackendConfig, ConfigError> {
        let val = |k: &str| get(k).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let bad = |var: &'static str, value: &str, why: &'static str| ConfigError::Invalid {
            var,
            value: value.to_owned(),
            why,
        };
        let cidr = match val("VK_VM_CIDR") {
            None => vmnet::config::DEFAULT_CIDR.parse().map_err(|_| bad("VK_VM_CIDR", "", "internal"))?,
            Some(v) => {
                let c: Ipv4Net = v.parse().map_err(|_| bad("VK_VM_CIDR", &v, "is not an IPv4 range a.b.c.d/len"))?;
                if c != c.trunc() {
                    return Err(bad("VK_VM_CIDR", &v, "has host bits set"));
                }
                if c.prefix_len() > 30 {
                    return Err(bad("VK_VM_CIDR", &v, "is smaller than a /30"));
                }
                c
            }
        };
        let bridge = val("VK_BRIDGE").unwrap_or_else(|| vmnet::config::DEFAULT_BRIDGE.to_owned());
        if !vmnet::config::valid_ifname(&bridge) {
            return Err(bad("VK_BRIDGE", &bridge, "is not an interface name (1-15 characters)"));
        }
        let netns = val("VK_NETNS");
        if let Some(ns) = &netns {
            if !vmnet::config::valid_netns_name(ns) {
                return Err(bad("VK_NETNS", ns, "is not a name under /run/netns"));
            }
        }
        let boot_timeout = match val("VK_BOOT_TIMEOUT") {
            None => Duration::from_secs(300),
            Some(v) => match v.parse::<u64>() {
                Ok(s) if s > 0 => Duration::from_secs(s),
                _ => return Err(bad("VK_BOOT_TIMEOUT", &v, "expected a positive number of seconds")),
            },
        };
        let console_cap = match val("VK_CONSOLE_LOG_KIB") {
            None => vmm::console::DEFAULT_CONSOLE_CAP,
            Some(v) => match v.parse::<u64>() {
                Ok(kib) if kib.saturating_mul(1024) >= vmm::console::MIN_CONSOLE_SETTING => kib.saturating_mul(1024),
                _ => return Err(bad("VK_CONSOLE_LOG_KIB", &v, "expected a whole number of KiB, at least 16")),
            },
        };
        let hypervisor = match val("VK_HYPERVISOR") {
            None => vmm::hypervisor::HypervisorPreference::Auto,
            Some(v) => v.parse().map_err(|_| bad("VK_HYPERVISOR", &v, "expected auto, qemu or cloud-hypervisor"))?,
        };
        let net = |var: &'static str, value: &str, e: vmnet::FilterError| ConfigError::Net {
            var,
            value: value.to_owned(),
            why: e.to_string(),
        };
        let mut filter = FilterPolicy::default();
        if let Some(v) = val("VK_NET_HOST_ALLOW") {
            filter.host_allow = vmnet::filter::parse_host_allow(&v).map_err(|e| net("VK_NET_HOST_ALLOW", &v, e))?;
        }
        if let Some(v) = val("VK_NET_UPLINK") {
            filter.uplink = Some(v.clone());
            filter.validate().map_err(|e| net("VK_NET_UPLINK", &v, e))?;
        }
        if let Some(v) = val("VK_NET_REFUSE") {
            filter.refuse = vmnet::filter::parse_refuse(&v).map_err(|e| net("VK_NET_REFUSE", &v, e))?;
        }
        Ok(BackendConfig {
            filter,
            root_dir: root_dir.to_path_buf(),
            images_dir: val("CHRYSALIS_IMAGES").map(PathBuf::from).unwrap_or_else(|| root_dir.join("images")),
            bridge,
            cidr,
            netns,
            boot_timeout,
            console_cap,
            hypervisor,
        })
    }

    /// From the process environment.
    pub fn from_env(root_dir: &Path) -> Result<BackendConfig, ConfigError> {
        BackendConfig::from_lookup(&|k| std::env::var(k).ok(), root_dir)
    }

    /// The lease file.
    pub fn leases_path(&self) -> PathBuf {
        self.root_dir.join("net").join("leases.json")
    }

    /// The backend's records.
    pub fn records_dir(&self) -> PathBuf {
        self.root_dir.join("cocoon")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn config_from_env() {
        let none = |_: &str| None;
        let c = BackendConfig::from_lookup(&none, Path::new("/r")).unwrap();
        assert_eq!(c.images_dir, PathBuf::from("/r/images"));
        assert_eq!(c.bridge, "chrysalis0");
        assert_eq!(c.cidr.to_string(), "10.88.0.0/24");
        assert_eq!(c.netns, None);
        assert_eq!(c.leases_path(), PathBuf::from("/r/net/leases.json"));
        assert_eq!(c.boot_timeout, Duration::from_secs(300));
        assert_eq!(c.console_cap, vmm::console::DEFAULT_CONSOLE_CAP);
        assert_eq!(c.hypervisor, vmm::hypervisor::HypervisorPreference::Auto);
        let qemu = |k: &str| (k == "VK_HYPERVISOR").then(|| "qemu".to_string());
        let c = BackendConfig::from_lookup(&qemu, Path::new("/r")).unwrap();
        assert_eq!(c.hypervisor, vmm::hypervisor::HypervisorPreference::Qemu);
        let kvm = |k: &str| (k == "VK_HYPERVISOR").then(|| "kvm".to_string());
        let e = BackendConfig::from_lookup(&kvm, Path::new("/r")).unwrap_err().to_string();
        assert!(e.contains("VK_HYPERVISOR") && e.contains("cloud-hypervisor"), "{e}");
        assert_eq!(c.filter, FilterPolicy::default(), "VMs reach nothing by default");
        let env = |k: &str| {
            match k {
                "VK_BRIDGE" => Some("br-t"),
                "VK_VM_CIDR" => Some("10.9.0.0/16"),
                "VK_NETNS" => Some("vkc-e2e-1"),
                "CHRYSALIS_IMAGES" => Some("/lib/img"),
                "VK_BOOT_TIMEOUT" => Some("60"),
                "VK_CONSOLE_LOG_KIB" => Some("64"),
                "VK_NET_HOST_ALLOW" => Some("udp/53,tcp/8053"),
                "VK_NET_UPLINK" => Some("eno1"),
                "VK_NET_REFUSE" => Some("203.0.113.0/24"),
                _ => None,
            }
            .map(String::from)
        };
        let c = BackendConfig::from_lookup(&env, Path::new("/r")).unwrap();
        assert_eq!(
            (c.bridge.as_str(), c.cidr.to_string(), c.netns.as_deref()),
            ("br-t", "10.9.0.0/16".into(), Some("vkc-e2e-1"))
        );
        assert_eq!(c.images_dir, PathBuf::from("/lib/img"));
        assert_eq!(c.boot_timeout, Duration::from_secs(60));
        assert_eq!(c.console_cap, 64 * 1024);
        assert_eq!(
            c.filter,
            FilterPolicy::parse(Some("tcp/8053,udp/53"), Some("eno1"), Some("203.0.113.0/24")).unwrap()
        );
        for (var, value) in [
            ("VK_NET_HOST_ALLOW", "53"),
            ("VK_NET_UPLINK", "a/b"),
            ("VK_NET_REFUSE", "example.com"),
            ("VK_VM_CIDR", "10.88.0.1/24"),
            ("VK_VM_CIDR", "10.88.0.0/31"),
            ("VK_VM_CIDR", "nope"),
            ("VK_BRIDGE", "a-bridge-name-too-long"),
            ("VK_NETNS", "../x"),
            ("VK_BOOT_TIMEOUT", "0"),
            ("VK_CONSOLE_LOG_KIB", "15"),
            ("VK_CONSOLE_LOG_KIB", "1M"),
        ] {
            let get = move |k: &str| (k == var).then(|| value.to_owned());
            let e = BackendConfig::from_lookup(&get, Path::new("/r")).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{var}=")), "{e}");
        }
    }
}

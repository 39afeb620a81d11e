//! The Node vk-cocoon registers (`docs/virtual-node.md` §3.2): labels, taint, capacity measured
//! from the host, conditions and addresses, as a [`vnode::NodeConfig`] + [`vnode::RuntimeConfig`].
//!
//! * Labels: `cocoonstack.io/pool=<pool>` and, when set, `cocoonstack.io/snapshot-cpu-class`
//!   (the runtime adds `type=virtual-kubelet` and `kubernetes.io/hostname`). **Not**
//!   `node-role.kubernetes.io/cocoon-vm`: NodeRestriction refuses `node-role.kubernetes.io/*`
//!   when a node registers itself (§5 #10), so the registration would fail; an admin may apply
//!   it afterwards (`kubectl label node <n> node-role.kubernetes.io/cocoon-vm=`).
//! * Taint `virtual-kubelet.io/provider=cocoon:NoSchedule`, set at registration (a node may not
//!   change its taints later).
//! * Capacity = allocatable: host CPUs, `MemTotal`, `statvfs(COCOON_ROOT_DIR)` available
//!   blocks, each × (100 − reserve)/100; `VK_NODE_*` overrides replace a measured value exactly.
//! * Conditions besides Ready: `MemoryPressure`, `DiskPressure`, `PIDPressure` False and
//!   `NetworkUnavailable` False (`RouteCreated`). Addresses: InternalIP, then Hostname.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use foundation::quantity::cpu_string;
use k8s_openapi::api::core::v1::{NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::annotations::{CPU_CLASS_LABEL, POOL_LABEL};
use crate::config::CocoonConfig;

/// The taint every vk-cocoon node registers with.
pub const TAINT_KEY: &str = "virtual-kubelet.io/provider";
pub const TAINT_VALUE: &str = "cocoon";

/// What the host offers, before the reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostResources {
    pub cpus: u64,
    pub memory_bytes: u64,
    /// Available to an unprivileged user on the file system of `COCOON_ROOT_DIR`.
    pub storage_bytes: u64,
}

/// Why the host could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("reading /proc/meminfo")]
    Meminfo(#[source] std::io::Error),
    #[error("/proc/meminfo has no MemTotal line")]
    NoMemTotal,
    #[error("statvfs {} (COCOON_ROOT_DIR)", .path.display())]
    Statvfs {
        path: std::path::PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error(
        "the allocatable {what} is zero (measured {measured}, reserve {reserve}%): zero allocatable rejects every pod"
    )]
    ZeroAllocatable { what: &'static str, measured: u64, reserve: u8 },
}

/// `MemTotal` in bytes from `/proc/meminfo` text.
pub fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl HostResources {
    /// Measures this host: CPUs this process may use, `MemTotal`, and `statvfs(root)`
    /// `f_bavail × f_frsize`.
    pub fn measure(root: &Path) -> Result<HostResources, NodeError> {
        let cpus = std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1);
        let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(NodeError::Meminfo)?;
        let memory_bytes = mem_total(&meminfo).ok_or(NodeError::NoMemTotal)?;
        let st =
            nix::sys::statvfs::statvfs(root).map_err(|source| NodeError::Statvfs { path: root.to_owned(), source })?;
        #[allow(clippy::useless_conversion)] // the field widths differ between targets
        let storage_bytes = u64::from(st.blocks_available()).saturating_mul(u64::from(st.fragment_size()));
        Ok(HostResources { cpus, memory_bytes, storage_bytes })
    }
}

fn reserved(v: u64, reserve: u8) -> u64 {
    // u128: no overflow for any u64 × 100.
    u64::try_from(u128::from(v) * u128::from(100 - reserve.min(99)) / 100).unwrap_or(u64::MAX)
}

/// capacity = allocatable: `cpu`, `memory`, `ephemeral-storage`, `pods`.
pub fn capacity(cfg: &CocoonConfig, host: &HostResources) -> Result<BTreeMap<String, Quantity>, NodeError> {
    let r = cfg.reserve_percent;
    let o = &cfg.overrides;
    let cpu = o.cpu_millis.unwrap_or_else(|| reserved(host.cpus.saturating_mul(1000), r));
    let mem = o.memory_bytes.unwrap_or_else(|| reserved(host.memory_bytes, r));
    let disk = o.storage_bytes.unwrap_or_else(|| reserved(host.storage_bytes, r));
    for (what, v, measured) in
        [("cpu", cpu, host.cpus), ("memory", mem, host.memory_bytes), ("ephemeral-storage", disk, host.storage_bytes)]
    {
        if v == 0 {
            return Err(NodeError::ZeroAllocatable { what, measured, reserve: r });
        }
    }
    Ok(BTreeMap::from([
        ("cpu".to_owned(), Quantity(cpu_string(cpu))),
        ("memory".to_owned(), Quantity(mem.to_string())),
        ("ephemeral-storage".to_owned(), Quantity(disk.to_string())),
        ("pods".to_owned(), Quantity(o.pods.to_string())),
    ]))
}

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> NodeCondition {
    NodeCondition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        ..NodeCondition::default()
    }
}

/// The conditions besides `Ready`.
pub fn conditions() -> Vec<NodeCondition> {
    vec![
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        condition("NetworkUnavailable", "False", "RouteCreated", "VM networking is configured by vk-cocoon"),
    ]
}

/// The Node and runtime configuration.
pub fn setup(cfg: &CocoonConfig, host: &HostResources) -> Result<(vnode::NodeConfig, vnode::RuntimeConfig), NodeError> {
    let mut labels = BTreeMap::from([(POOL_LABEL.to_owned(), cfg.pool.clone())]);
    if let Some(class) = &cfg.snapshot_cpu_class {
        labels.insert(CPU_CLASS_LABEL.to_owned(), class.clone());
    }
    let node = vnode::NodeConfig {
        name: cfg.node_name.clone(),
        labels,
        taints: vec![Taint {
            key: TAINT_KEY.into(),
            value: Some(TAINT_VALUE.into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }],
        capacity: capacity(cfg, host)?,
        internal_ip: Some(cfg.node_ip),
        kubelet_port: cfg.kubelet_port,
        kubelet_version: concat!("v", env!("CARGO_PKG_VERSION"), "-vk-cocoon").to_owned(),
        provider_id: cfg.provider_id.clone(),
        extra_conditions: conditions(),
        ..Default::default()
    };
    let runtime = vnode::RuntimeConfig {
        listen_addr: SocketAddr::from(([0, 0, 0, 0], cfg.kubelet_port)),
        tls_cert: Some(cfg.tls_cert.clone()),
        tls_key: Some(cfg.tls_key.clone()),
        stream_limits: vnode::streams::StreamLimits {
            per_pod: cfg.max_streams_per_pod,
            ..vnode::streams::StreamLimits::default()
        },
        ..Default::default()
    };
    Ok((node, runtime))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn cfg(pairs: &[(&str, &str)]) -> CocoonConfig {
        let env: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        CocoonConfig::from_lookup(&move |k| env.get(k).cloned(), || Some(Ipv4Addr::new(192, 0, 2, 7))).unwrap()
    }

    const HOST: HostResources = HostResources { cpus: 2, memory_bytes: 24 << 30, storage_bytes: 100 << 30 };

    #[test]
    fn node_shape() {
        let (n, rt) = setup(&cfg(&[("VK_SNAPSHOT_CPU_CLASS", "skylake"), ("VK_PROVIDER_ID", "p://x")]), &HOST).unwrap();
        assert_eq!(n.name, "cocoon-pool");
        assert_eq!(n.labels.get(POOL_LABEL).map(String::as_str), Some("default"));
        assert_eq!(n.labels.get(CPU_CLASS_LABEL).map(String::as_str), Some("skylake"));
        assert!(!n.labels.keys().any(|k| k.contains("node-role.kubernetes.io")), "NodeRestriction refuses it");
        let t = &n.taints[0];
        assert_eq!((t.key.as_str(), t.value.as_deref(), t.effect.as_str()), (TAINT_KEY, Some("cocoon"), "NoSchedule"));
        assert_eq!(n.internal_ip, Some("192.0.2.7".parse().expect("ip")));
        assert_eq!(n.kubelet_port, 10250);
        assert_eq!(n.provider_id.as_deref(), Some("p://x"));
        assert!(n.kubelet_version.ends_with("-vk-cocoon"));
        let types: Vec<(&str, &str)> =
            n.extra_conditions.iter().map(|c| (c.type_.as_str(), c.status.as_str())).collect();
        assert_eq!(
            types,
            [
                ("MemoryPressure", "False"),
                ("DiskPressure", "False"),
                ("PIDPressure", "False"),
                ("NetworkUnavailable", "False")
            ]
        );
        assert_eq!(n.extra_conditions[3].reason.as_deref(), Some("RouteCreated"));
        assert_eq!(rt.listen_addr.port(), 10250);
        assert_eq!(rt.tls_cert.as_deref(), Some(Path::new("/etc/cocoon/vk/tls/vk-kubelet.crt")));
        let (n, _) = setup(&cfg(&[]), &HOST).unwrap();
        assert!(!n.labels.contains_key(CPU_CLASS_LABEL));
    }

    #[test]
    fn capacity_applies_the_reserve_to_measured_values_only() {
        let c = capacity(&cfg(&[]), &HOST).unwrap();
        assert_eq!(c["cpu"].0, "1600m", "2 CPUs × 80%");
        assert_eq!(c["memory"].0, ((24u64 << 30) * 8 / 10).to_string());
        assert_eq!(c["ephemeral-storage"].0, ((100u64 << 30) * 8 / 10).to_string());
        assert_eq!(c["pods"].0, "256");
        let c = capacity(&cfg(&[("VK_NODE_CPU", "8"), ("VK_NODE_MEM", "1Gi"), ("VK_NODE_PODS", "7")]), &HOST).unwrap();
        assert_eq!((c["cpu"].0.as_str(), c["memory"].0.as_str(), c["pods"].0.as_str()), ("8", "1073741824", "7"));
        let c = capacity(&cfg(&[("VK_RESERVE_PERCENT", "0")]), &HOST).unwrap();
        assert_eq!(c["cpu"].0, "2");
        let full = HostResources { storage_bytes: 0, ..HOST };
        let e = capacity(&cfg(&[]), &full).unwrap_err();
        assert!(e.to_string().contains("ephemeral-storage"), "{e}");
    }

    #[test]
    fn meminfo_and_measuring_this_host() {
        assert_eq!(mem_total("MemFree: 5 kB\nMemTotal:   24576000 kB\n"), Some(24_576_000 * 1024));
        assert_eq!(mem_total("MemFree: 5 kB\n"), None);
        let dir = tempfile::tempdir().unwrap();
        let h = HostResources::measure(dir.path()).unwrap();
        assert!(h.cpus >= 1 && h.memory_bytes > 0);
        assert!(HostResources::measure(&dir.path().join("missing")).is_err());
    }
}

//! vk-cocoon's configuration: the environment of `docs/virtual-node.md` §3.1 (no flags besides the
//! shared join flags), parsed into a typed [`CocoonConfig`]. Every error names its variable.
//!
//! Variables of upstream vk-cocoon that have no meaning here (a registry, the `cocoon` CLI,
//! cocoon-net, peer snapshot transfer, …) are accepted and reported as ignored
//! ([`CocoonConfig::ignored`], [`IGNORED`]) so an existing deployment's environment does not
//! break the start.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use foundation::quantity::{self, QuantityError};

use crate::namespaces::{NamespaceConfigError, NamespacePolicy, VK_LEGACY_NAMESPACE, VK_SHARED_NAMESPACES};

/// What to do with a VM no Pod on this node references, found at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrphanPolicy {
    /// Remove it and release its lease (the default).
    Destroy,
    /// Leave it and log a warning.
    Alert,
    /// Leave it quietly (logged at info).
    Keep,
}

/// Exact capacity values that replace the measured ones (no reserve applied to them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapacityOverrides {
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub storage_bytes: Option<u64>,
    /// `VK_NODE_PODS`, default 256.
    pub pods: u64,
}

/// The parsed environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CocoonConfig {
    /// `VK_NODE_NAME` (`cocoon-pool`).
    pub node_name: String,
    /// `VK_NODE_POOL` (`default`).
    pub pool: String,
    /// `VK_KUBELET_PORT` (`10250`): the kubelet HTTPS endpoint listens on all interfaces.
    pub kubelet_port: u16,
    /// `VK_NODE_IP`, else the first non-loopback IPv4 of an interface that is up.
    pub node_ip: IpAddr,
    /// `VK_TLS_CERT` / `VK_TLS_KEY`; unreadable → a self-signed P-256 pair.
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    /// `VK_PROVIDER_ID` → `spec.providerID`.
    pub provider_id: Option<String>,
    /// `VK_SNAPSHOT_CPU_CLASS` → label `cocoonstack.io/snapshot-cpu-class`.
    pub snapshot_cpu_class: Option<String>,
    /// `VK_ORPHAN_POLICY` (`destroy`).
    pub orphan_policy: OrphanPolicy,
    /// `VK_RESERVE_PERCENT` (`20`): allocatable = measured × (100 − reserve) / 100.
    pub reserve_percent: u8,
    /// `VK_NODE_CPU`, `VK_NODE_MEM`, `VK_NODE_STORAGE`, `VK_NODE_PODS`.
    pub overrides: CapacityOverrides,
    /// `COCOON_ROOT_DIR` (`/var/lib/cocoon`): VM state, the image library; storage capacity is
    /// measured here.
    pub root_dir: PathBuf,
    /// `VK_LOG_LEVEL` (`info`): a tracing filter (`RUST_LOG` wins when set).
    pub log_level: String,
    /// `VK_SHARED_NAMESPACES` (none) and `VK_LEGACY_NAMESPACE` (`default`): which namespaces'
    /// Pods may use which VMs and snapshots ([`crate::namespaces`]).
    pub namespaces: NamespacePolicy,
    /// `VK_RESTART_COOLDOWN` (30 s): a VM that stops again this soon after the watcher
    /// restarted it is removed and its Pod fails `RestartCooldown`.
    pub restart_cooldown: Duration,
    /// Variables that were set but do not apply on this node, with their values.
    pub ignored: Vec<(&'static str, String)>,
    /// `VK_METRICS_ADDR` (`host:port`, or upstream's `:port` for every address): where
    /// `/metrics` is also served, plain HTTP; unset: only on the kubelet port.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `VK_MAX_STREAMS_PER_POD` (16): open `kubectl logs -f`/`exec`/`attach`/`port-forward`
    /// sessions one Pod may have; the next is answered 429.
    pub max_streams_per_pod: usize,
    /// `VK_SNAPSHOT_GC_INTERVAL` (`10m`, upstream's; `0`: no GC) and `VK_SNAPSHOT_RETENTION`
    /// (`168h`; `0`: no snapshot is removed by age): the snapshot GC ([`crate::gc`]).
    pub gc: GcConfig,
}

/// The snapshot GC's default interval: upstream vk-cocoon's `snapshotReclaimInterval`.
pub const DEFAULT_GC_INTERVAL: Duration = Duration::from_secs(10 * 60);
/// A week.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(168 * 3600);

/// The snapshot GC's settings ([`crate::gc`]) (`VK_SNAPSHOT_GC_INTERVAL`, `VK_SNAPSHOT_RETENTION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcConfig {
    /// Between passes; zero: no GC at all.
    pub interval: Duration,
    /// Minimum age of a removed snapshot; `None`: none is removed by age.
    pub retention: Option<Duration>,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig { interval: DEFAULT_GC_INTERVAL, retention: Some(DEFAULT_RETENTION) }
    }
}

/// An environment variable that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{var}={value:?}: {why}")]
    Invalid { var: &'static str, value: String, why: &'static str },
    #[error("{var}={value:?}")]
    Quantity {
        var: &'static str,
        value: String,
        #[source]
        source: QuantityError,
    },
    /// A VM network filter variable (`VK_NET_*`); `why` is the filter's own message.
    #[error("{var}={value:?}: {why}")]
    Net { var: &'static str, value: String, why: String },
    #[error("VK_NODE_IP is not set and this host has no non-loopback IPv4 address: set VK_NODE_IP")]
    NoNodeIp,
}

/// Upstream variables accepted and ignored, with the reason shown in `--help` and the log.
pub const IGNORED: &[(&str, &str)] = &[
    ("OCI_REGISTRY", "no registry: images and snapshots are in COCOON_ROOT_DIR"),
    ("GOOGLE_APPLICATION_CREDENTIALS", "no registry credentials are used"),
    ("VK_COCOON_BIN", "no cocoon CLI: VMs run through the built-in VMM layer"),
    ("VK_COCOON_MACOS_BIN", "macOS guests are not supported"),
    ("VK_LEASES_PATH", "IP leases are kept by the built-in VM network"),
    ("VK_COCOON_NET_CONTROL_SOCKET", "there is no cocoon-net"),
    ("COCOON_CGROUP_PARENT", "VMs are not placed in a cgroup by vk-cocoon"),
    ("VK_RESTORE_MODE", "restores always copy the snapshot"),
    ("VK_STAGING_DIR", "no peer or registry snapshot transfer"),
    ("VK_PEER_ADDR", "no peer snapshot transfer"),
    ("VK_COCOON_SNAPSHOT_DIR", "snapshots are in the local library"),
    ("VK_NODE_HUGEPAGES", "no hugepages capacity is advertised"),
    ("SNAPSHOT_ZSTD_LEVEL", "no snapshot transfer"),
    ("SNAPSHOT_CHUNK_SIZE_MIB", "no snapshot transfer"),
    ("SNAPSHOT_TRANSFER_CONCURRENCY", "no snapshot transfer"),
    ("SNAPSHOT_MEMORY_BUDGET_MIB", "no snapshot transfer"),
    ("SNAPSHOT_PULL_BUDGET_MIB", "no snapshot transfer"),
];

/// The environment section of `--help`.
pub fn env_help() -> String {
    let mut s = String::from(
        "Environment (virtual-node.md §3.1; an empty value counts as unset):\n  \
         VK_NODE_NAME           node name (cocoon-pool); with --join-server its identity\n  \
         VK_NODE_POOL           label cocoonstack.io/pool (default)\n  \
         VK_KUBELET_PORT        kubelet HTTPS port, all interfaces (10250)\n  \
         VK_NODE_IP             InternalIP (first non-loopback IPv4; fatal if none)\n  \
         VK_TLS_CERT            serving certificate (/etc/cocoon/vk/tls/vk-kubelet.crt)\n  \
         VK_TLS_KEY             serving key (/etc/cocoon/vk/tls/vk-kubelet.key);\n                         \
         an unreadable pair → self-signed P-256\n  \
         VK_PROVIDER_ID         spec.providerID\n  \
         VK_SNAPSHOT_CPU_CLASS  label cocoonstack.io/snapshot-cpu-class;\n                         \
         pods selecting another class are refused\n  \
         VK_ORPHAN_POLICY       destroy (default) | alert | keep: unreferenced VMs at start-up\n  \
         VK_RESERVE_PERCENT     20: allocatable = measured capacity × (100 − reserve)/100\n  \
         VK_NODE_CPU            exact CPU capacity, a quantity (no reserve applied)\n  \
         VK_NODE_MEM            exact memory capacity, a quantity (no reserve applied)\n  \
         VK_NODE_STORAGE        exact ephemeral-storage capacity (no reserve applied)\n  \
         VK_NODE_PODS           pod capacity (256)\n  \
         COCOON_ROOT_DIR        VM state and image library (/var/lib/cocoon): <root>/vms\n                         \
         (hypervisors), <root>/cocoon (VM records), <root>/images,\n                         \
         <root>/net/leases.json\n  \
         CHRYSALIS_IMAGES       the image library instead of <root>/images\n  \
         VK_BRIDGE              VM bridge (chrysalis0); its address is the range's first host\n  \
         VK_VM_CIDR             VM address range (10.88.0.0/24)\n  \
         VK_NETNS               run the bridge, TAPs and VMs in this named netns (unset)\n  \
         VK_BOOT_TIMEOUT        seconds a boot may take until the guest agent answers (300)\n  \
         VK_HYPERVISOR          auto, qemu or cloud-hypervisor (auto: cloud-hypervisor when its\n                         \
         binary is present and KVM works, else QEMU; the choice is logged)\n  \
         VK_CONSOLE_LOG_KIB     serial console each VM keeps on disk, KiB, read by kubectl\n                         \
         logs (1024, at least 16)\n  \
         VK_RESTART_COOLDOWN    seconds after a restart within which a VM that stops again is\n                         \
         removed and its pod fails RestartCooldown (30)\n  \
         VK_NET_HOST_ALLOW      host services VMs may reach at their gateway, tcp/PORT,udp/PORT\n                         \
         (unset: none; VMs reach no host service)\n  \
         VK_NET_UPLINK          interface a VM with cocoonset.cocoonstack.io/network=egress\n                         \
         leaves by, masqueraded (unset: no VM has a route out)\n  \
         VK_NET_REFUSE          IPv4 networks egress may not reach, on top of the private,\n                         \
         link-local (169.254.169.254), loopback and multicast ranges\n  \
         VK_SHARED_NAMESPACES   namespaces whose pods may adopt, clone and delete each other's\n                         \
         VMs and snapshots (unset: none; each namespace sees only its own).\n                         \
         Groups split by ';', namespaces by ',': golden,team-a;ci,ci-tools\n                         \
         lets team-a clone golden's snapshots and golden team-a's, and ci and\n                         \
         ci-tools share; nothing crosses groups\n  \
         VK_LEGACY_NAMESPACE    owner of VMs and snapshots recorded without a namespace (before\n                         \
         namespaces were recorded, or chrysalis snapshot save without\n                         \
         --namespace) (default)\n  \
         VK_METRICS_ADDR        also serve the runtime's /metrics in plain HTTP here, host:port\n                         \
         or :port (unset: only on the kubelet port, authorized as nodes/metrics)\n  \
         VK_MAX_STREAMS_PER_POD open logs -f/exec/attach/port-forward sessions per pod; the\n                         \
         next is refused with 429 Too Many Requests (16)\n  \
         VK_SNAPSHOT_GC_INTERVAL how often the snapshot GC runs, a duration (10m; 0 = never);\n                         \
         the first pass runs 30 s after start (or one interval, if shorter)\n  \
         VK_SNAPSHOT_RETENTION  age after which a snapshot vk-cocoon saved is removed once no pod\n                         \
         on the node names, clones or forks it and no VM uses it (168h;\n                         \
         0 = never by age). Durations: 90s, 10m, 168h, 7days; a bare number\n                         \
         is seconds\n  \
         VK_LOG_LEVEL           log filter (info); RUST_LOG wins\n  \
         VK_JOIN_TOKEN_FILE     as --join-token-file\n  \
         KUBECONFIG             used without --join-server/--kubeconfig outside a cluster\n\n\
         Accepted and ignored on this node:\n",
    );
    for (var, why) in IGNORED {
        s.push_str(&format!("  {var:<30} {why}\n"));
    }
    s
}

fn non_empty(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    get(var).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

impl From<NamespaceConfigError> for ConfigError {
    fn from(e: NamespaceConfigError) -> ConfigError {
        ConfigError::Invalid { var: e.var, value: e.value, why: e.why }
    }
}

fn invalid(var: &'static str, value: &str, why: &'static str) -> ConfigError {
    ConfigError::Invalid { var, value: value.to_owned(), why }
}

/// A positive quantity as whole units (`millis = true`: thousandths).
fn positive_quantity(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
    millis: bool,
) -> Result<Option<u64>, ConfigError> {
    let Some(v) = non_empty(get, var) else { return Ok(None) };
    let q = if millis { quantity::milli(&v) } else { quantity::units_ceil(&v) }
        .map_err(|source| ConfigError::Quantity { var, value: v.clone(), source })?;
    let n = u64::try_from(q).map_err(|_| invalid(var, &v, "is too large"))?;
    if n == 0 {
        return Err(invalid(var, &v, "is zero: zero allocatable rejects every pod"));
    }
    Ok(Some(n))
}

impl CocoonConfig {
    /// From the process environment.
    pub fn from_env() -> Result<CocoonConfig, ConfigError> {
        CocoonConfig::from_lookup(&|k| std::env::var(k).ok(), vnode::host_ip::first_non_loopback_ipv4)
    }

    /// From `get` (one variable's value), with `detect_ip` answering when `VK_NODE_IP` is unset.
    pub fn from_lookup(
        get: &dyn Fn(&str) -> Option<String>,
        detect_ip: impl FnOnce() -> Option<Ipv4Addr>,
    ) -> Result<CocoonConfig, ConfigError> {
        let node_name = non_empty(get, "VK_NODE_NAME").unwrap_or_else(|| "cocoon-pool".into());
        let pool = non_empty(get, "VK_NODE_POOL").unwrap_or_else(|| "default".into());
        let kubelet_port = match non_empty(get, "VK_KUBELET_PORT") {
            None => 10250,
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => return Err(invalid("VK_KUBELET_PORT", &v, "is not a TCP port 1-65535")),
            },
        };
        let node_ip = match non_empty(get, "VK_NODE_IP") {
            Some(v) => v.parse::<IpAddr>().map_err(|_| invalid("VK_NODE_IP", &v, "is not an IP address"))?,
            None => IpAddr::V4(detect_ip().ok_or(ConfigError::NoNodeIp)?),
        };
        let orphan_policy = match non_empty(get, "VK_ORPHAN_POLICY").as_deref() {
            None | Some("destroy") => OrphanPolicy::Destroy,
            Some("alert") => OrphanPolicy::Alert,
            Some("keep") => OrphanPolicy::Keep,
            Some(v) => return Err(invalid("VK_ORPHAN_POLICY", v, "expected destroy, alert or keep")),
        };
        let reserve_percent = match non_empty(get, "VK_RESERVE_PERCENT") {
            None => 20,
            Some(v) => match v.parse::<u8>() {
                Ok(p) if p < 100 => p,
                _ => return Err(invalid("VK_RESERVE_PERCENT", &v, "expected a whole percentage 0-99")),
            },
        };
        let pods = match non_empty(get, "VK_NODE_PODS") {
            None => 256,
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => return Err(invalid("VK_NODE_PODS", &v, "expected a positive whole number")),
            },
        };
        let overrides = CapacityOverrides {
            cpu_millis: positive_quantity(get, "VK_NODE_CPU", true)?,
            memory_bytes: positive_quantity(get, "VK_NODE_MEM", false)?,
            storage_bytes: positive_quantity(get, "VK_NODE_STORAGE", false)?,
            pods,
        };
        let log_level = non_empty(get, "VK_LOG_LEVEL").unwrap_or_else(|| "info".into());
        let namespaces = NamespacePolicy::parse(
            non_empty(get, VK_SHARED_NAMESPACES).as_deref(),
            non_empty(get, VK_LEGACY_NAMESPACE).as_deref(),
        )?;
        let restart_cooldown = match non_empty(get, "VK_RESTART_COOLDOWN") {
            None => Duration::from_secs(30),
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => Duration::from_secs(n),
                _ => return Err(invalid("VK_RESTART_COOLDOWN", &v, "expected a positive number of seconds")),
            },
        };
        let metrics_addr = match non_empty(get, "VK_METRICS_ADDR") {
            None => None,
            Some(v) => {
                Some(parse_listen(&v).ok_or_else(|| invalid("VK_METRICS_ADDR", &v, "expected host:port or :port"))?)
            }
        };
        let max_streams_per_pod = match non_empty(get, "VK_MAX_STREAMS_PER_POD") {
            None => vnode::streams::StreamLimits::default().per_pod,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => return Err(invalid("VK_MAX_STREAMS_PER_POD", &v, "expected a positive whole number")),
            },
        };
        let gc = GcConfig {
            interval: duration(get, "VK_SNAPSHOT_GC_INTERVAL")?.unwrap_or(DEFAULT_GC_INTERVAL),
            retention: match duration(get, "VK_SNAPSHOT_RETENTION")? {
                None => Some(DEFAULT_RETENTION),
                Some(d) if d.is_zero() => None,
                Some(d) => Some(d),
            },
        };
        let ignored = IGNORED
            .iter()
            .filter_map(|(var, _)| get(var).filter(|v| !v.trim().is_empty()).map(|v| (*var, v)))
            .collect();
        Ok(CocoonConfig {
            node_name,
            pool,
            kubelet_port,
            node_ip,
            tls_cert: non_empty(get, "VK_TLS_CERT")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/etc/cocoon/vk/tls/vk-kubelet.crt".into()),
            tls_key: non_empty(get, "VK_TLS_KEY")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/etc/cocoon/vk/tls/vk-kubelet.key".into()),
            provider_id: non_empty(get, "VK_PROVIDER_ID"),
            snapshot_cpu_class: non_empty(get, "VK_SNAPSHOT_CPU_CLASS"),
            orphan_policy,
            reserve_percent,
            overrides,
            root_dir: non_empty(get, "COCOON_ROOT_DIR").map(PathBuf::from).unwrap_or_else(|| "/var/lib/cocoon".into()),
            log_level,
            namespaces,
            restart_cooldown,
            ignored,
            metrics_addr,
            max_streams_per_pod,
            gc,
        })
    }
}

/// A duration as upstream's Go variables write them (`90s`, `10m`, `168h`, also `1h30m`,
/// `7days`), or a bare number of seconds like this node's other variables; `0` is zero.
fn duration(get: &dyn Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<Duration>, ConfigError> {
    let Some(v) = non_empty(get, var) else { return Ok(None) };
    if let Ok(secs) = v.parse::<u64>() {
        return Ok(Some(Duration::from_secs(secs)));
    }
    humantime::parse_duration(&v)
        .map(Some)
        .map_err(|_| invalid(var, &v, "expected a duration such as 90s, 10m or 168h, or a number of seconds"))
}

/// A listen address as upstream's Go flags write it: `host:port`, `[v6]:port`, or `:port` for
/// every address.
fn parse_listen(v: &str) -> Option<std::net::SocketAddr> {
    match v.strip_prefix(':') {
        Some(port) => Some(std::net::SocketAddr::from(([0, 0, 0, 0], port.parse::<u16>().ok()?))),
        None => v.parse().ok(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<CocoonConfig, ConfigError> {
        let env: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        CocoonConfig::from_lookup(&move |k| env.get(k).cloned(), || Some(Ipv4Addr::new(192, 0, 2, 7)))
    }

    #[test]
    fn defaults_follow_the_spec() {
        let c = cfg(&[]).unwrap();
        assert_eq!((c.node_name.as_str(), c.pool.as_str(), c.kubelet_port), ("cocoon-pool", "default", 10250));
        assert_eq!(c.node_ip, IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)));
        assert_eq!(c.tls_cert, PathBuf::from("/etc/cocoon/vk/tls/vk-kubelet.crt"));
        assert_eq!(c.tls_key, PathBuf::from("/etc/cocoon/vk/tls/vk-kubelet.key"));
        assert_eq!((c.provider_id, c.snapshot_cpu_class), (None, None));
        assert_eq!(c.orphan_policy, OrphanPolicy::Destroy);
        assert_eq!(c.reserve_percent, 20);
        assert_eq!(c.overrides, CapacityOverrides { pods: 256, ..CapacityOverrides::default() });
        assert_eq!(c.root_dir, PathBuf::from("/var/lib/cocoon"));
        assert_eq!(c.log_level, "info");
        assert_eq!(c.namespaces, NamespacePolicy::isolated(), "no namespace shares by default");
        assert!(c.ignored.is_empty());
        assert_eq!(c.metrics_addr, None);
        assert_eq!(c.max_streams_per_pod, 16);
        assert_eq!(
            c.gc,
            GcConfig { interval: Duration::from_secs(600), retention: Some(Duration::from_secs(7 * 24 * 3600)) }
        );
    }

    #[test]
    fn the_snapshot_gc_takes_go_durations_or_seconds() {
        let gc = |pairs: &[(&str, &str)]| cfg(pairs).unwrap().gc;
        let c = gc(&[("VK_SNAPSHOT_GC_INTERVAL", "3s"), ("VK_SNAPSHOT_RETENTION", "40s")]);
        assert_eq!(c, GcConfig { interval: Duration::from_secs(3), retention: Some(Duration::from_secs(40)) });
        let c = gc(&[("VK_SNAPSHOT_GC_INTERVAL", "1h30m"), ("VK_SNAPSHOT_RETENTION", "168h")]);
        assert_eq!(c.interval, Duration::from_secs(5400));
        assert_eq!(c.retention, Some(Duration::from_secs(168 * 3600)));
        assert_eq!(gc(&[("VK_SNAPSHOT_GC_INTERVAL", "120")]).interval, Duration::from_secs(120));
        assert_eq!(gc(&[("VK_SNAPSHOT_RETENTION", "7days")]).retention, Some(Duration::from_secs(7 * 86400)));
        assert_eq!(gc(&[("VK_SNAPSHOT_RETENTION", "0")]).retention, None, "0: never by age");
        assert_eq!(gc(&[("VK_SNAPSHOT_GC_INTERVAL", "0s")]).interval, Duration::ZERO, "0: no GC");
        for (var, bad) in [
            ("VK_SNAPSHOT_GC_INTERVAL", "soon"),
            ("VK_SNAPSHOT_GC_INTERVAL", "-1"),
            ("VK_SNAPSHOT_RETENTION", "10 parsecs"),
        ] {
            let e = cfg(&[(var, bad)]).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{var}=")), "{var}={bad}: {e}");
        }
    }

    #[test]
    fn the_per_pod_stream_cap_is_a_positive_number() {
        assert_eq!(cfg(&[("VK_MAX_STREAMS_PER_POD", "2")]).unwrap().max_streams_per_pod, 2);
        for bad in ["0", "-1", "two"] {
            let e = cfg(&[("VK_MAX_STREAMS_PER_POD", bad)]).unwrap_err();
            assert!(e.to_string().contains("VK_MAX_STREAMS_PER_POD"), "{e}");
        }
    }

    #[test]
    fn the_metrics_address_takes_upstreams_forms() {
        let any = |p| Some(std::net::SocketAddr::from(([0, 0, 0, 0], p)));
        assert_eq!(cfg(&[("VK_METRICS_ADDR", ":9091")]).unwrap().metrics_addr, any(9091));
        assert_eq!(
            cfg(&[("VK_METRICS_ADDR", "127.0.0.1:9100")]).unwrap().metrics_addr,
            Some(std::net::SocketAddr::from(([127, 0, 0, 1], 9100)))
        );
        assert_eq!(cfg(&[("VK_METRICS_ADDR", "[::1]:9091")]).unwrap().metrics_addr.map(|a| a.port()), Some(9091));
        for bad in [":x", "9091", "host:9091", ":70000"] {
            let e = cfg(&[("VK_METRICS_ADDR", bad)]).unwrap_err();
            assert!(e.to_string().contains("VK_METRICS_ADDR"), "{bad}: {e}");
        }
    }

    #[test]
    fn values_are_parsed() {
        let c = cfg(&[
            ("VK_NODE_NAME", "n1"),
            ("VK_NODE_POOL", "gpu"),
            ("VK_KUBELET_PORT", "10333"),
            ("VK_NODE_IP", "10.1.2.3"),
            ("VK_TLS_CERT", "/c"),
            ("VK_TLS_KEY", "/k"),
            ("VK_PROVIDER_ID", "chrysalis://n1"),
            ("VK_SNAPSHOT_CPU_CLASS", "skylake"),
            ("VK_ORPHAN_POLICY", "alert"),
            ("VK_RESERVE_PERCENT", "0"),
            ("VK_NODE_CPU", "7500m"),
            ("VK_NODE_MEM", "16Gi"),
            ("VK_NODE_STORAGE", "100G"),
            ("VK_NODE_PODS", "10"),
            ("COCOON_ROOT_DIR", "/srv/cocoon"),
            ("VK_LOG_LEVEL", "debug"),
            ("VK_SHARED_NAMESPACES", "golden,team-a"),
            ("VK_LEGACY_NAMESPACE", "agents"),
            ("OCI_REGISTRY", "ghcr.io/x"),
            ("VK_COCOON_BIN", ""),
        ])
        .unwrap();
        assert_eq!((c.node_name.as_str(), c.pool.as_str(), c.kubelet_port), ("n1", "gpu", 10333));
        assert_eq!(c.node_ip.to_string(), "10.1.2.3");
        assert_eq!((c.tls_cert.to_str(), c.tls_key.to_str()), (Some("/c"), Some("/k")));
        assert_eq!(c.provider_id.as_deref(), Some("chrysalis://n1"));
        assert_eq!(c.snapshot_cpu_class.as_deref(), Some("skylake"));
        assert_eq!(c.orphan_policy, OrphanPolicy::Alert);
        assert_eq!(c.reserve_percent, 0);
        assert_eq!(
            c.overrides,
            CapacityOverrides {
                cpu_millis: Some(7500),
                memory_bytes: Some(16 << 30),
                storage_bytes: Some(100_000_000_000),
                pods: 10
            }
        );
        assert_eq!(c.root_dir, PathBuf::from("/srv/cocoon"));
        assert_eq!(c.log_level, "debug");
        assert!(c.namespaces.permits("team-a", Some("golden")) && c.namespaces.permits("agents", None));
        assert_eq!(c.ignored, vec![("OCI_REGISTRY", "ghcr.io/x".to_string())], "an empty value is not reported");
        assert_eq!(cfg(&[("VK_ORPHAN_POLICY", "keep")]).unwrap().orphan_policy, OrphanPolicy::Keep);
        assert_eq!(cfg(&[("VK_ORPHAN_POLICY", "destroy")]).unwrap().orphan_policy, OrphanPolicy::Destroy);
        assert_eq!(cfg(&[]).unwrap().restart_cooldown, Duration::from_secs(30));
        assert_eq!(cfg(&[("VK_RESTART_COOLDOWN", "90")]).unwrap().restart_cooldown, Duration::from_secs(90));
    }

    #[test]
    fn errors_name_the_variable() {
        for (var, value) in [
            ("VK_ORPHAN_POLICY", "nuke"),
            ("VK_KUBELET_PORT", "0"),
            ("VK_KUBELET_PORT", "70000"),
            ("VK_NODE_IP", "ten"),
            ("VK_RESERVE_PERCENT", "100"),
            ("VK_RESERVE_PERCENT", "-1"),
            ("VK_NODE_PODS", "0"),
            ("VK_NODE_CPU", "0"),
            ("VK_NODE_CPU", "lots"),
            ("VK_NODE_MEM", "8Tb"),
            ("VK_NODE_STORAGE", "0Gi"),
            ("VK_SHARED_NAMESPACES", "team-a"),
            ("VK_LEGACY_NAMESPACE", "Not_A_Namespace"),
            ("VK_RESTART_COOLDOWN", "0"),
            ("VK_RESTART_COOLDOWN", "soon"),
        ] {
            let e = cfg(&[(var, value)]).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{var}=")), "{var}={value}: {e}");
        }
        let none = CocoonConfig::from_lookup(&|_| None, || None).unwrap_err();
        assert_eq!(none, ConfigError::NoNodeIp);
        assert!(none.to_string().contains("VK_NODE_IP"));
    }

    #[test]
    fn help_lists_every_ignored_variable() {
        let h = env_help();
        for (var, _) in IGNORED {
            assert!(h.contains(var), "{var}");
        }
        assert!(h.contains("VK_ORPHAN_POLICY") && h.contains("COCOON_ROOT_DIR"));
        assert!(h.contains("VK_SHARED_NAMESPACES") && h.contains("VK_LEGACY_NAMESPACE") && h.contains("golden,team-a"));
        assert!(h.contains("VK_SNAPSHOT_GC_INTERVAL") && h.contains("VK_SNAPSHOT_RETENTION"));
    }
}

//! The typed model: one struct per TOML table, every key optional (serde defaults), unknown
//! keys refused; [`DEFAULT_TOML`] shows every default.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The guest image catalog of the appliance image.
pub const DEFAULT_CATALOG: &str = "/usr/share/chrysalis/vm-images/catalog.json";

/// The documented default configuration (what a missing baked file means), every key shown.
pub const DEFAULT_TOML: &str = r#"# Chrysalis appliance configuration (defaults; every key optional).
[supervisor]
api_socket = "/run/chrysalis/api.sock"
# api_listen = "0.0.0.0:7780"       # remote API over TCP; needs api_token_file
# api_token_file = "api-token"      # bearer token for api_listen (relative to this file)
# metrics_listen = "0.0.0.0:9100"   # /metrics is always served on the API too
# metrics_token_file = "metrics-token" # bearer token for metrics_listen (required beyond loopback)
# tls_cert_file = "box.crt"         # the box's certificate (PEM, chain); default: minted on first
# tls_key_file = "box.key"          #   boot when a TCP surface listens beyond loopback
tls_names = []                      # extra DNS names / IPs for the minted certificate
state_dir = "/var/lib/chrysalis"

[sandboxd]
enabled = true
listen = "0.0.0.0:7777"
# api_token_file = "sandboxd-token" # sandboxd's root token (default: minted on first boot)
# tls_cert_file = "sandboxd.crt"    # sandboxd's own certificate (default: the box's)
# tls_key_file = "sandboxd.key"
# advertise_addr = "10.0.0.5:7777"  # host:port clients use for sandbox calls
# max_vms = 64                      # node budget (default: sandboxd derives it from memory)
# max_memory_mib = 65536
# max_disk_mib = 200000             # VMs' writable disks, worst case (default: 3/4 of the state partition)
# max_lifetime_secs = 604800        # longest lease across renewals (default 7 days)
refill_concurrency = 0              # 0 = sandboxd picks (2/3 of the CPUs)
boot_timeout_secs = 600
# catalog = "/usr/share/chrysalis/vm-images/catalog.json"
# vm_uplink = "eno1"                # the interface net = "egress" VMs leave by, NAT (default:
#                                   #   none, and no pool or claim may ask for egress)
# vm_refuse = ["203.0.113.0/24"]    # refused to egress on top of private, link-local and
#                                   #   metadata addresses
# vm_bridge = "chrysalis1"          # sandboxd's VM bridge (default chrysalis1; not vk-cocoon's chrysalis0)
# vm_cidr = "10.89.0.0/24"          # sandboxd's VM range (default; must not overlap vk-cocoon's 10.88.0.0/24)
# [[sandboxd.pools]]
# template = "base"
# size = "small"
# net = "none"                      # or "egress" (needs vm_uplink)
# warm = 1

# [cluster]                          # absent: sandboxd alone
# endpoint = "https://10.0.2.100:16443"
# ca_cert_hashes = ["sha256:<64 hex>"]
# bootstrap_token_file = "bootstrap-token"

[vk_sandbox]                         # enabled by default when [cluster] is set
# enabled = true
# node_name = "<hostname>-sandbox"

[vk_cocoon]                          # enabled by default when [cluster] is set
# enabled = true
# node_name = "<hostname>-cocoon"
pool = "default"
# shared_namespaces = [["golden", "team-a"]]   # namespaces whose pods may use each other's
#                                                # VMs and snapshots (default: none)
# legacy_namespace = "default"                 # owner of VMs/snapshots recorded without one
# vm_host_allow = ["udp/53"]                   # host services VMs may reach at their gateway
#                                                # (default: none)
# vm_uplink = "eno1"                           # the interface egress VMs leave by, NAT
#                                                # (default: none, no VM has a route out)
# vm_refuse = ["203.0.113.0/24"]               # refused to egress on top of private,
#                                                # link-local and metadata addresses

[update]
health_deadline_secs = 600
offline = "commit-local"             # or "wait"
"#;

/// `[supervisor]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SupervisorConfig {
    /// The local API's Unix socket.
    pub api_socket: PathBuf,
    /// Optional remote API (TCP, bearer token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_listen: Option<String>,
    /// The remote API's bearer token file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_token_file: Option<PathBuf>,
    /// Optional extra `/metrics` listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// The metrics listener's bearer token file (required beyond loopback).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_token_file: Option<PathBuf>,
    /// The box's TLS certificate chain (PEM); with `tls_key_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// The box's TLS private key (PEM); with `tls_cert_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// Extra names (DNS or IP) of the certificate the box mints.
    pub tls_names: Vec<String>,
    /// The state partition.
    pub state_dir: PathBuf,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            api_socket: "/run/chrysalis/api.sock".into(),
            api_listen: None,
            api_token_file: None,
            metrics_listen: None,
            metrics_token_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_names: Vec::new(),
            state_dir: "/var/lib/chrysalis".into(),
        }
    }
}

/// One `[[sandboxd.pools]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Template name or alias of the guest catalog.
    pub template: String,
    /// Size class.
    #[serde(default = "default_size")]
    pub size: String,
    /// Network lane.
    #[serde(default = "default_net")]
    pub net: String,
    /// Warm VMs to keep.
    #[serde(default = "default_warm")]
    pub warm: usize,
}

fn default_size() -> String {
    "small".into()
}
fn default_net() -> String {
    "none".into()
}
fn default_warm() -> usize {
    1
}

/// `[sandboxd]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxdConfig {
    /// Run sandboxd.
    pub enabled: bool,
    /// Its HTTP listen address.
    pub listen: String,
    /// Its root token file (default: minted by the supervisor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_token_file: Option<PathBuf>,
    /// Its own TLS certificate (default: the box's when it serves TLS).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// Its own TLS key, with `tls_cert_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// Node budget: VMs at most (default: sandboxd's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_vms: Option<u64>,
    /// Node budget: guest memory at most (default: sandboxd's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// Node budget: the VMs' writable disks at most, worst case (default: sandboxd's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// Longest lease horizon across renewals (default: sandboxd's, 7 days).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lifetime_secs: Option<u64>,
    /// `host:port` clients use for sandbox-scoped calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_addr: Option<String>,
    /// Concurrent refills (0 = sandboxd decides).
    pub refill_concurrency: usize,
    /// How long a cold boot may take.
    pub boot_timeout_secs: u64,
    /// The guest image catalog (default: the image's, [`DEFAULT_CATALOG`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catalog: Option<PathBuf>,
    /// Warm pools.
    pub pools: Vec<PoolConfig>,
    /// The interface `net = "egress"` VMs leave by, masqueraded (sandboxd's `network.uplink`).
    /// Default: none, so no pool or claim may ask for egress.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_uplink: Option<String>,
    /// IPv4 networks egress may not reach on top of the private, link-local (metadata),
    /// loopback and multicast ranges (sandboxd's `network.refuse`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vm_refuse: Vec<String>,
    /// The bridge of sandboxd's VMs (`network.bridge`; default [`SANDBOXD_VM_BRIDGE`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_bridge: Option<String>,
    /// The range of sandboxd's VMs (`network.cidr`; default [`SANDBOXD_VM_CIDR`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_cidr: Option<String>,
}

impl SandboxdConfig {
    /// Whether any `vm_*` key is set (then sandboxd gets a `network` section).
    pub fn network_configured(&self) -> bool {
        self.vm_uplink.is_some() || !self.vm_refuse.is_empty() || self.vm_bridge.is_some() || self.vm_cidr.is_some()
    }
}

/// sandboxd's default VM bridge (the one constant sandboxd uses too).
pub const SANDBOXD_VM_BRIDGE: &str = vmnet::config::SANDBOXD_BRIDGE;
/// sandboxd's default VM range.
pub const SANDBOXD_VM_CIDR: &str = vmnet::config::SANDBOXD_CIDR;
/// The prefix of sandboxd's TAP names: no uplink may use it.
pub const SANDBOXD_TAP_PREFIX: &str = vmnet::config::SANDBOXD_TAP_PREFIX;
/// vk-cocoon's VM bridge: its `VK_BRIDGE` default, which the supervisor never overrides.
pub const VK_COCOON_VM_BRIDGE: &str = vmnet::config::DEFAULT_BRIDGE;
/// vk-cocoon's VM range: its `VK_VM_CIDR` default, which the supervisor never overrides.
pub const VK_COCOON_VM_CIDR: &str = vmnet::config::DEFAULT_CIDR;

/// sandboxd's `network` section as rendered into its JSON config (the schema of
/// `sandboxd_api::NetworkConfig`), from the validated `[sandboxd] vm_*` keys. Bridge and
/// range are always written out, so what the supervisor checked against vk-cocoon's is what
/// sandboxd uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SandboxdNetwork {
    /// `vm_bridge`.
    pub bridge: String,
    /// `vm_cidr` (no host bits, a /30 or larger).
    pub cidr: vmnet::Ipv4Net,
    /// `vm_uplink`; `None`: no egress.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uplink: Option<String>,
    /// `vm_refuse`, as written.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refuse: Vec<String>,
}

impl Default for SandboxdConfig {
    fn default() -> Self {
        SandboxdConfig {
            enabled: true,
            listen: "0.0.0.0:7777".into(),
            api_token_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            max_vms: None,
            max_memory_mib: None,
            max_disk_mib: None,
            max_lifetime_secs: None,
            advertise_addr: None,
            refill_concurrency: 0,
            boot_timeout_secs: 600,
            catalog: None,
            pools: Vec::new(),
            vm_uplink: None,
            vm_refuse: Vec::new(),
            vm_bridge: None,
            vm_cidr: None,
        }
    }
}

/// `[cluster]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// `https://host:port`: discovery and API server.
    pub endpoint: String,
    /// Pinned CA public-key hashes, `sha256:<64 hex>`.
    pub ca_cert_hashes: Vec<String>,
    /// The bootstrap token file.
    pub bootstrap_token_file: PathBuf,
}

/// `[vk_sandbox]`
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Default: enabled when `[cluster]` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Default `<hostname>-sandbox`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
}

/// `[vk_cocoon]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CocoonConfig {
    /// Default: enabled when `[cluster]` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Default `<hostname>-cocoon`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Label `cocoonstack.io/pool`.
    pub pool: String,
    /// Groups of Kubernetes namespaces whose Pods may adopt, clone and delete each other's VMs
    /// and snapshots (vk-cocoon's `VK_SHARED_NAMESPACES`). Default: none; each namespace uses
    /// only its own.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_namespaces: Vec<Vec<String>>,
    /// The owner of VMs and snapshots recorded without a namespace (`VK_LEGACY_NAMESPACE`;
    /// vk-cocoon's default is `default`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub legacy_namespace: Option<String>,
    /// Host services VMs may reach at their gateway, `tcp/PORT` / `udp/PORT`
    /// (`VK_NET_HOST_ALLOW`). Default: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vm_host_allow: Vec<String>,
    /// The interface VMs with egress leave by, masqueraded (`VK_NET_UPLINK`). Default: none, so
    /// no VM has a route out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_uplink: Option<String>,
    /// IPv4 networks egress may not reach on top of the private, link-local (metadata),
    /// loopback and multicast ranges (`VK_NET_REFUSE`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vm_refuse: Vec<String>,
}

impl Default for CocoonConfig {
    fn default() -> Self {
        CocoonConfig {
            enabled: None,
            node_name: None,
            pool: "default".into(),
            shared_namespaces: Vec::new(),
            legacy_namespace: None,
            vm_host_allow: Vec::new(),
            vm_uplink: None,
            vm_refuse: Vec::new(),
        }
    }
}

impl CocoonConfig {
    /// `shared_namespaces` as vk-cocoon's `VK_SHARED_NAMESPACES` (`a,b;c,d`); `None` when empty.
    pub fn shared_namespaces_env(&self) -> Option<String> {
        (!self.shared_namespaces.is_empty())
            .then(|| self.shared_namespaces.iter().map(|g| g.join(",")).collect::<Vec<_>>().join(";"))
    }
}

/// What the update gate does when the API server is unreachable at the deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OfflinePolicy {
    /// Commit when local health is good (an offline box is not a bad image).
    #[default]
    CommitLocal,
    /// Keep waiting for the API server (no commit, no revert).
    Wait,
}

/// `[update]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpdateConfig {
    /// How long a trial boot has to become healthy.
    pub health_deadline_secs: u64,
    /// The offline rule.
    pub offline: OfflinePolicy,
}

impl Default for UpdateConfig {
    fn default() -> Self {
        UpdateConfig { health_deadline_secs: 600, offline: OfflinePolicy::CommitLocal }
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[supervisor]`
    pub supervisor: SupervisorConfig,
    /// `[sandboxd]`
    pub sandboxd: SandboxdConfig,
    /// `[cluster]`; absent = no cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterConfig>,
    /// `[vk_sandbox]`
    pub vk_sandbox: NodeConfig,
    /// `[vk_cocoon]`
    pub vk_cocoon: CocoonConfig,
    /// `[update]`
    pub update: UpdateConfig,
}

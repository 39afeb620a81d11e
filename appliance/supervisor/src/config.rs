//! The appliance configuration: one TOML model, read in layers and validated before anything
//! starts.
//!
//! # Layers (later wins, deep-merged per key)
//! 1. baked `/usr/share/chrysalis/config.toml` (part of the read-only image),
//! 2. ESP `/efi/chrysalis/config.toml`,
//! 3. config partition `/run/chrysalis/config-disk/config.toml`,
//! 4. kernel command line: `chrysalis.set=<dotted.key>=<TOML value>`, repeatable
//!    (`chrysalis.set=sandboxd.listen="0.0.0.0:7777"`; a value that is not TOML is taken as a
//!    string, so `chrysalis.set=vk_cocoon.pool=gpu` works too).
//!
//! A missing file is skipped; an unreadable or malformed one is an error. Tables merge key by
//! key; any other value (arrays included: `sandboxd.pools` is replaced, never appended) replaces
//! what an earlier layer set. Every key remembers which layer set it ([`Provenance`]), so an
//! error names the key, the file (or kernel argument) and the fix.
//!
//! # Secrets
//! Secrets are only ever read from files (`*_file` keys). A relative path is resolved against
//! the directory of the file that set it; on the kernel command line it must be absolute.
//! [`Config::validate`] checks that each named file is readable and non-empty (and that the
//! bootstrap token has the kubeadm form) without ever printing its contents.
//!
//! # Secure defaults
//! * sandboxd always gets a root token: `sandboxd.api_token_file`, or one the supervisor mints
//!   on first boot in the state directory (`crate::secrets`).
//! * A TCP surface (the remote API, metrics, sandboxd) that listens beyond loopback serves TLS:
//!   with `supervisor.tls_cert_file`/`tls_key_file` (or sandboxd's own pair), else with a
//!   certificate the supervisor mints on first boot. Plain HTTP is for loopback only.
//! * `metrics_listen` beyond loopback needs `metrics_token_file` (a scraper's bearer token, not
//!   the admin token: the admin API can update and reboot the box and read sandboxd's token).
//!
//! # Defaults
//! No `[cluster]` table: sandboxd runs alone. With one, `vk_sandbox` and `vk_cocoon` are
//! enabled unless `enabled = false`, named `<hostname>-sandbox` / `<hostname>-cocoon` unless
//! `node_name` is set. Pools default to `size = "small"`, `net = "none"`, `warm = 1`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Layer 1: the image's baked default.
pub const BAKED_PATH: &str = "/usr/share/chrysalis/config.toml";
/// Layer 2: the box config on the ESP.
pub const ESP_PATH: &str = "/efi/chrysalis/config.toml";
/// Layer 3: the config partition (filesystem label `CHRYSALIS`).
pub const CONFIG_DISK_PATH: &str = "/run/chrysalis/config-disk/config.toml";
/// Layer 4: the kernel command line.
pub const CMDLINE_PATH: &str = "/proc/cmdline";
/// The kernel argument that sets one key.
pub const CMDLINE_PREFIX: &str = "chrysalis.set=";
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

/// Why the configuration could not be loaded or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer file exists but cannot be read.
    #[error("reading {}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A layer file is not TOML.
    #[error("{} is not valid TOML: {message}", .path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A `chrysalis.set=` kernel argument is malformed.
    #[error("kernel command line argument {arg:?}: {problem}; write it as chrysalis.set=<dotted.key>=<TOML value>, e.g. chrysalis.set=sandboxd.listen=\"0.0.0.0:7777\"")]
    Cmdline {
        /// The argument.
        arg: String,
        /// What is wrong.
        problem: String,
    },
    /// The merged configuration breaks one or more rules.
    #[error("{}", Issues(.0))]
    Invalid(Vec<Issue>),
}

impl ConfigError {
    /// The rule violations (empty for read, syntax and command-line errors).
    pub fn issues(&self) -> &[Issue] {
        match self {
            ConfigError::Invalid(v) => v,
            _ => &[],
        }
    }
}

impl ConfigError {
    /// Every problem as an [`Issue`] (read, syntax and command-line errors become one each), for
    /// `GET /v1/status` and `chrysalis config check --json`.
    pub fn to_issues(&self) -> Vec<Issue> {
        match self {
            ConfigError::Invalid(v) => v.clone(),
            ConfigError::Read { path, source } => vec![Issue {
                key: "(file)".into(),
                source: Source::File { path: path.clone() },
                problem: format!("cannot be read: {source}"),
                fix: "make the file readable by root, or remove it".into(),
            }],
            ConfigError::Syntax { path, message } => vec![Issue {
                key: "(syntax)".into(),
                source: Source::File { path: path.clone() },
                problem: message.replace('\n', " "),
                fix: "fix the TOML syntax at the line shown".into(),
            }],
            ConfigError::Cmdline { arg, problem } => vec![Issue {
                key: "(kernel argument)".into(),
                source: Source::Cmdline { path: CMDLINE_PATH.into(), arg: arg.clone() },
                problem: problem.clone(),
                fix: "write it as chrysalis.set=<dotted.key>=<TOML value>".into(),
            }],
        }
    }
}

struct Issues<'a>(&'a [Issue]);

impl fmt::Display for Issues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} configuration errors:", many.len())?;
                for i in many {
                    write!(f, "\n  {i}")?;
                }
                Ok(())
            }
        }
    }
}

/// One broken rule: the key, where it was set, what is wrong and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issue {
    /// Dotted key with indexes, e.g. `cluster.ca_cert_hashes[0]`.
    pub key: String,
    /// Where the value came from.
    pub source: Source,
    /// What is wrong.
    pub problem: String,
    /// What to do.
    pub fix: String,
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {}: {}; {}", self.key, self.source, self.problem, self.fix)
    }
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// Nobody set it: the built-in default.
    Default,
    /// A layer file.
    File {
        /// The file.
        path: PathBuf,
    },
    /// A `chrysalis.set=` kernel argument.
    Cmdline {
        /// The file the command line was read from (`/proc/cmdline`).
        path: PathBuf,
        /// The whole argument.
        arg: String,
    },
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("the built-in defaults"),
            Source::File { path } => write!(f, "{}", path.display()),
            Source::Cmdline { arg, .. } => write!(f, "the kernel command line ({arg})"),
        }
    }
}

/// Where the four layers are read from (tests and `chrysalis run` flags override them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcePaths {
    /// Layer 1.
    pub baked: PathBuf,
    /// Layer 2.
    pub esp: PathBuf,
    /// Layer 3.
    pub config_disk: PathBuf,
    /// Layer 4 (a file holding a kernel command line); `None` skips it.
    pub cmdline: Option<PathBuf>,
}

impl Default for SourcePaths {
    fn default() -> Self {
        SourcePaths {
            baked: BAKED_PATH.into(),
            esp: ESP_PATH.into(),
            config_disk: CONFIG_DISK_PATH.into(),
            cmdline: Some(CMDLINE_PATH.into()),
        }
    }
}

// ------------------------------------------------------------------------------------ model

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

// ------------------------------------------------------------------------------ provenance

/// Which layer set each key (dotted paths without array indexes; arrays are atomic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance(BTreeMap<String, Source>);

impl Provenance {
    /// The source of `key` (`a.b[0].c` style): the longest recorded prefix, else the default.
    pub fn source_of(&self, key: &str) -> Source {
        let segs: Vec<&str> = key_segments(key);
        for n in (1..=segs.len()).rev() {
            if let Some(s) = self.0.get(&segs[..n].join(".")) {
                return s.clone();
            }
        }
        Source::Default
    }

    /// The source of any key under `prefix` (the last layer that touched the table), else
    /// the default; for errors about a table as a whole ("missing field").
    pub fn source_within(&self, prefix: &str) -> Source {
        let p = key_segments(prefix).join(".");
        let direct = self.source_of(&p);
        if direct != Source::Default {
            return direct;
        }
        let under = format!("{p}.");
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(&under))
            .map(|(_, s)| s)
            .next_back()
            .cloned()
            .unwrap_or(Source::Default)
    }

    fn record(&mut self, path: &str, v: &toml::Value, source: &Source) {
        let under = format!("{path}.");
        self.0.retain(|k, _| !k.starts_with(&under));
        self.0.insert(path.to_string(), source.clone());
        if let toml::Value::Table(t) = v {
            for (k, child) in t {
                self.record(&format!("{path}.{k}"), child, source);
            }
        }
    }
}

/// `a.b[0].c` → `["a", "b", "c"]`.
fn key_segments(key: &str) -> Vec<&str> {
    key.split('.').map(|s| s.split('[').next().unwrap_or(s)).filter(|s| !s.is_empty()).collect()
}

// ---------------------------------------------------------------------------------- layers

/// One parsed layer.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Where it came from (for a command line: one entry per argument, see [`Layer::sources`]).
    pub source: Source,
    /// Its keys; `*_file` paths already resolved.
    pub table: toml::Table,
    /// Per-argument sources of a command-line layer (key path → argument).
    pub sources: Vec<(String, Source)>,
}

/// What was read from where (for `GET /v1/config` and `chrysalis config check`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceReport {
    /// The file.
    pub path: PathBuf,
    /// `loaded`, `missing` or (command line) the number of `chrysalis.set=` arguments.
    pub status: String,
}

/// Reads one layer file; `Ok(None)` when it does not exist.
pub fn read_layer(path: &Path) -> Result<Option<Layer>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ConfigError::Read { path: path.to_path_buf(), source }),
    };
    parse_layer(path, &text).map(Some)
}

/// Parses layer text read from `path` (relative `*_file` values resolve against its directory).
pub fn parse_layer(path: &Path, text: &str) -> Result<Layer, ConfigError> {
    let mut table: toml::Table = toml::from_str(text)
        .map_err(|e| ConfigError::Syntax { path: path.to_path_buf(), message: e.to_string().trim().to_string() })?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    resolve_files(&mut table, &base);
    Ok(Layer { source: Source::File { path: path.to_path_buf() }, table, sources: Vec::new() })
}

/// Makes relative `*_file` string values absolute against `base`.
fn resolve_files(table: &mut toml::Table, base: &Path) {
    for (k, v) in table.iter_mut() {
        match v {
            toml::Value::Table(t) => resolve_files(t, base),
            toml::Value::String(s) if k.ends_with("_file") && !s.is_empty() && Path::new(s.as_str()).is_relative() => {
                *s = base.join(s.as_str()).to_string_lossy().into_owned();
            }
            _ => {}
        }
    }
}

/// Splits a kernel command line into arguments (whitespace outside double quotes).
pub fn cmdline_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Parses the `chrysalis.set=` arguments of a kernel command line read from `path`.
pub fn parse_cmdline(path: &Path, line: &str) -> Result<Layer, ConfigError> {
    let mut table = toml::Table::new();
    let mut sources = Vec::new();
    for raw in cmdline_args(line) {
        let arg = match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
            Some(inner) if inner.starts_with(CMDLINE_PREFIX) => inner.to_string(),
            _ => raw,
        };
        let Some(rest) = arg.strip_prefix(CMDLINE_PREFIX) else { continue };
        let bad = |problem: &str| ConfigError::Cmdline { arg: arg.clone(), problem: problem.to_string() };
        let (key, value) = rest.split_once('=').ok_or_else(|| bad("no '=' between the key and the value"))?;
        let segs: Vec<&str> = key.split('.').collect();
        if !segs.iter().all(|s| valid_segment(s)) {
            return Err(bad(&format!("{key:?} is not a dotted key of letters, digits, '_' and '-'")));
        }
        let value = parse_value(value);
        if let toml::Value::String(s) = &value {
            if segs.last().is_some_and(|l| l.ends_with("_file")) && Path::new(s).is_relative() {
                return Err(bad("a *_file path on the kernel command line must be absolute"));
            }
        }
        let mut t = &mut table;
        for seg in &segs[..segs.len() - 1] {
            let entry = t.entry(seg.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            t = match entry {
                toml::Value::Table(inner) => inner,
                _ => return Err(bad(&format!("{seg:?} was already set to a value, not a table"))),
            };
        }
        // Split above always yields at least one segment, all validated non-empty.
        let last = segs.last().copied().unwrap_or_default();
        t.insert(last.to_string(), value);
        sources.push((key.to_string(), Source::Cmdline { path: path.to_path_buf(), arg: arg.clone() }));
    }
    Ok(Layer { source: Source::Cmdline { path: path.to_path_buf(), arg: String::new() }, table, sources })
}

/// A TOML value, or the text as a string when it is not one.
fn parse_value(text: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(text.to_string())),
        Err(_) => toml::Value::String(text.to_string()),
    }
}

/// Merges `layer` into `base` (tables per key, everything else replaced), recording sources.
pub fn merge(base: &mut toml::Table, prov: &mut Provenance, layer: &Layer) {
    merge_table(base, prov, "", &layer.table, &layer.source, &layer.sources);
}

fn merge_table(
    base: &mut toml::Table,
    prov: &mut Provenance,
    prefix: &str,
    over: &toml::Table,
    source: &Source,
    per_key: &[(String, Source)],
) {
    for (k, v) in over {
        let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => {
                merge_table(b, prov, &path, o, source, per_key);
            }
            _ => {
                prov.record(&path, v, source);
                // A command-line value is attributed to the argument that set it.
                let under = format!("{path}.");
                for (key, s) in per_key.iter().filter(|(key, _)| *key == path || key.starts_with(&under)) {
                    prov.0.insert(key.clone(), s.clone());
                }
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

// ------------------------------------------------------------------------------- loading

/// A loaded, merged configuration (not yet validated).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The typed model.
    pub config: Config,
    /// Who set what.
    pub provenance: Provenance,
    /// What was read.
    pub sources: Vec<SourceReport>,
}

/// Reads the four layers and merges them (see the module doc).
pub fn load(paths: &SourcePaths) -> Result<Loaded, ConfigError> {
    let mut layers = Vec::new();
    let mut sources = Vec::new();
    for p in [&paths.baked, &paths.esp, &paths.config_disk] {
        match read_layer(p)? {
            Some(l) => {
                layers.push(l);
                sources.push(SourceReport { path: p.clone(), status: "loaded".into() });
            }
            None => sources.push(SourceReport { path: p.clone(), status: "missing".into() }),
        }
    }
    if let Some(p) = &paths.cmdline {
        match std::fs::read_to_string(p) {
            Ok(line) => {
                let l = parse_cmdline(p, &line)?;
                sources.push(SourceReport { path: p.clone(), status: format!("{} chrysalis.set", l.sources.len()) });
                layers.push(l);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                sources.push(SourceReport { path: p.clone(), status: "missing".into() })
            }
            Err(source) => return Err(ConfigError::Read { path: p.clone(), source }),
        }
    }
    let mut loaded = from_layers(&layers)?;
    loaded.sources = sources;
    Ok(loaded)
}

/// Reads exactly these files as layers, in order (later wins); each must exist.
pub fn load_files(files: &[PathBuf]) -> Result<Loaded, ConfigError> {
    let mut layers = Vec::new();
    for p in files {
        let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        layers.push(parse_layer(p, &text)?);
    }
    let mut loaded = from_layers(&layers)?;
    loaded.sources = files.iter().map(|p| SourceReport { path: p.clone(), status: "loaded".into() }).collect();
    Ok(loaded)
}

/// Merges parsed layers and decodes the typed model; decode errors name the key and source.
pub fn from_layers(layers: &[Layer]) -> Result<Loaded, ConfigError> {
    let mut merged = toml::Table::new();
    let mut prov = Provenance::default();
    for l in layers {
        merge(&mut merged, &mut prov, l);
    }
    let config: Config = serde_path_to_error::deserialize(toml::Value::Table(merged)).map_err(|e| {
        let (key, plain) = path_key(e.path());
        let inner = e.into_inner();
        ConfigError::Invalid(vec![decode_issue(&key, &plain, &inner.to_string(), &prov)])
    })?;
    Ok(Loaded { config, provenance: prov, sources: Vec::new() })
}

/// `(display key with indexes, key without the unknown tail)` of a decode error path.
fn path_key(path: &serde_path_to_error::Path) -> (String, String) {
    let mut key = String::new();
    for seg in path.iter() {
        match seg {
            serde_path_to_error::Segment::Seq { index } => key.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key: k } => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(k);
            }
            serde_path_to_error::Segment::Enum { variant } => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(variant);
            }
            serde_path_to_error::Segment::Unknown => {}
        }
    }
    (key.clone(), key)
}

fn decode_issue(key: &str, plain: &str, msg: &str, prov: &Provenance) -> Issue {
    // serde's own words, minus TOML's span decoration.
    let msg = msg.lines().next().unwrap_or(msg).trim().to_string();
    if let Some(field) = between(&msg, "unknown field `", "`") {
        let full = if key.ends_with(field) {
            key.to_string()
        } else if key.is_empty() {
            field.to_string()
        } else {
            format!("{key}.{field}")
        };
        let expected = msg.split_once(", expected ").map(|(_, e)| format!(" (known keys: {e})")).unwrap_or_default();
        return Issue {
            key: full.clone(),
            source: prov.source_of(&full),
            problem: "unknown key".into(),
            fix: format!("remove it or correct its spelling{expected}"),
        };
    }
    if let Some(field) = between(&msg, "missing field `", "`") {
        let full = if key.is_empty() { field.to_string() } else { format!("{key}.{field}") };
        return Issue {
            key: full,
            source: prov.source_within(plain),
            problem: "is required but not set".into(),
            fix: format!("add `{field} = …` to the [{key}] table (see the configuration reference)"),
        };
    }
    Issue {
        key: if key.is_empty() { "(top level)".into() } else { key.to_string() },
        source: prov.source_of(plain),
        problem: msg,
        fix: "give a value of the documented type (see the configuration reference)".into(),
    }
}

fn between<'a>(s: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let rest = &s[s.find(start)? + start.len()..];
    Some(&rest[..rest.find(end)?])
}

// ------------------------------------------------------------------------------ validation

/// The validated, resolved settings the supervisor runs with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Settings {
    /// The merged model with defaults filled in (`enabled`, node names).
    pub config: Config,
    /// `supervisor.api_listen`, parsed.
    pub api_listen: Option<SocketAddr>,
    /// `supervisor.metrics_listen`, parsed.
    pub metrics_listen: Option<SocketAddr>,
    /// `sandboxd.listen`, parsed.
    pub sandboxd_listen: SocketAddr,
    /// Whether vk-sandbox runs.
    pub vk_sandbox: bool,
    /// Whether vk-cocoon runs.
    pub vk_cocoon: bool,
    /// sandboxd's `network` section, when any `[sandboxd] vm_*` key is set.
    pub sandboxd_network: Option<SandboxdNetwork>,
    /// What was read.
    pub sources: Vec<SourceReport>,
}

impl Settings {
    /// The vk-sandbox node name (set by validation).
    pub fn vk_sandbox_name(&self) -> &str {
        self.config.vk_sandbox.node_name.as_deref().unwrap_or_default()
    }

    /// The vk-cocoon node name (set by validation).
    pub fn vk_cocoon_name(&self) -> &str {
        self.config.vk_cocoon.node_name.as_deref().unwrap_or_default()
    }
}

/// What validation may look at besides the config.
#[derive(Debug, Clone)]
pub struct ValidateEnv {
    /// For the default node names.
    pub hostname: String,
    /// Check that `*_file` secrets are readable, non-empty and well-formed.
    pub check_files: bool,
}

impl ValidateEnv {
    /// This host's name, file checks on.
    pub fn host() -> Self {
        ValidateEnv { hostname: hostname(), check_files: true }
    }
}

/// This host's name (`uname -n`), lowercased.
pub fn hostname() -> String {
    rustix::system::uname().nodename().to_string_lossy().to_ascii_lowercase()
}

struct Check<'a> {
    prov: &'a Provenance,
    issues: Vec<Issue>,
}

impl Check<'_> {
    fn fail(&mut self, key: &str, problem: impl Into<String>, fix: impl Into<String>) {
        self.issues.push(Issue {
            key: key.to_string(),
            source: self.prov.source_of(key),
            problem: problem.into(),
            fix: fix.into(),
        });
    }

    /// Checks the `[sandboxd] vm_*` keys; the `network` section when any is set (and all are valid).
    fn sandboxd_network(&mut self, sb: &SandboxdConfig) -> Option<SandboxdNetwork> {
        let mut ok = true;
        if let Some(up) = &sb.vm_uplink {
            let policy = vmnet::FilterPolicy { uplink: Some(up.clone()), ..Default::default() };
            let problem = match policy.validate() {
                Err(e) => Some(e.to_string()),
                Ok(()) if up.starts_with(SANDBOXD_TAP_PREFIX) => {
                    Some(format!("{up:?} starts with {SANDBOXD_TAP_PREFIX:?}, the prefix of sandboxd's own VM ports"))
                }
                Ok(()) => None,
            };
            if let Some(problem) = problem {
                ok = false;
                self.fail(
                    "sandboxd.vm_uplink",
                    problem,
                    "name the network interface egress VMs leave by (e.g. \"eno1\"), or remove the key (no sandbox has a route out)",
                );
            }
        }
        if let Err(e) = vmnet::filter::parse_refuse(&sb.vm_refuse.join(",")) {
            ok = false;
            self.fail(
                "sandboxd.vm_refuse",
                e.to_string(),
                "list IPv4 networks as \"a.b.c.d/len\" (or single addresses), e.g. [\"203.0.113.0/24\"]",
            );
        }
        let bridge = sb.vm_bridge.clone().unwrap_or_else(|| SANDBOXD_VM_BRIDGE.to_string());
        if !vmnet::config::valid_ifname(&bridge) {
            ok = false;
            self.fail(
                "sandboxd.vm_bridge",
                format!("{bridge:?} is not an interface name (1-15 characters, no '/', ':', ',', quotes or spaces)"),
                format!(
                    "name the bridge of sandboxd's VMs, e.g. {SANDBOXD_VM_BRIDGE:?}, or remove the key (that default)"
                ),
            );
        }
        let cidr_text = sb.vm_cidr.as_deref().unwrap_or(SANDBOXD_VM_CIDR);
        let fix = format!(
            "give an IPv4 range a.b.c.d/len with no host bits, a /30 or larger, e.g. {SANDBOXD_VM_CIDR:?} \
             (its first host is the gateway), or remove the key (that default)"
        );
        let cidr = match cidr_text.parse::<vmnet::Ipv4Net>() {
            Err(_) => {
                self.fail("sandboxd.vm_cidr", format!("{cidr_text:?} is not an IPv4 range"), fix);
                None
            }
            Ok(n) if n != n.trunc() => {
                self.fail("sandboxd.vm_cidr", format!("{n} has host bits set (did you mean {}?)", n.trunc()), fix);
                None
            }
            Ok(n) if n.prefix_len() > 30 => {
                self.fail(
                    "sandboxd.vm_cidr",
                    format!("{n} is too small: a gateway and at least one VM need a /30 or larger"),
                    fix,
                );
                None
            }
            Ok(n) => Some(n),
        };
        let cidr = cidr?;
        (ok && sb.network_configured()).then(|| SandboxdNetwork {
            bridge,
            cidr,
            uplink: sb.vm_uplink.clone(),
            refuse: sb.vm_refuse.clone(),
        })
    }

    /// sandboxd's bridge and range must not be vk-cocoon's (both run on this box).
    fn apart_from_vk_cocoon(&mut self, net: &SandboxdNetwork) {
        if net.bridge == VK_COCOON_VM_BRIDGE {
            self.fail(
                "sandboxd.vm_bridge",
                format!(
                    "{:?} is vk-cocoon's VM bridge, and vk_cocoon.enabled is true: the two networks would share \
                     one bridge",
                    net.bridge
                ),
                format!(
                    "give sandboxd its own bridge, e.g. {SANDBOXD_VM_BRIDGE:?} (or remove sandboxd.vm_bridge), \
                     or set vk_cocoon.enabled = false"
                ),
            );
        }
        // A constant that parses.
        #[allow(clippy::unwrap_used)]
        let theirs: vmnet::Ipv4Net = VK_COCOON_VM_CIDR.parse().unwrap();
        if net.cidr.contains(&theirs.network()) || theirs.contains(&net.cidr.network()) {
            self.fail(
                "sandboxd.vm_cidr",
                format!(
                    "{} overlaps {theirs}, vk-cocoon's VM range, and vk_cocoon.enabled is true: addresses would \
                     collide",
                    net.cidr
                ),
                format!(
                    "give sandboxd a range apart from {theirs}, e.g. {SANDBOXD_VM_CIDR:?} (or remove sandboxd.vm_cidr), \
                     or set vk_cocoon.enabled = false"
                ),
            );
        }
    }

    fn addr(&mut self, key: &str, v: &str, example: &str) -> Option<SocketAddr> {
        match v.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                self.fail(key, format!("{v:?} is not an ip:port address"), format!("write it like {example:?}"));
                None
            }
        }
    }

    fn absolute(&mut self, key: &str, p: &Path) {
        if !p.is_absolute() {
            self.fail(
                key,
                format!("{:?} is not an absolute path", p.display().to_string()),
                "give a path starting with /",
            );
        }
    }

    /// `<table>.tls_cert_file` and `tls_key_file`: both or neither; each readable.
    fn tls_pair(&mut self, table: &str, cert: Option<&Path>, key: Option<&Path>, env: &ValidateEnv) {
        match (cert, key) {
            (None, None) => {}
            (Some(_), None) | (None, Some(_)) => {
                let (set, missing) =
                    if cert.is_some() { ("tls_cert_file", "tls_key_file") } else { ("tls_key_file", "tls_cert_file") };
                self.fail(
                    &format!("{table}.{set}"),
                    format!("is set without {table}.{missing}"),
                    format!("set both {table}.tls_cert_file and {table}.tls_key_file (PEM), or neither"),
                );
            }
            (Some(c), Some(k)) => {
                let cert_ok =
                    self.secret(&format!("{table}.tls_cert_file"), c, env, "the certificate chain (PEM, leaf first)");
                let key_ok =
                    self.secret(&format!("{table}.tls_key_file"), k, env, "the certificate's private key (PEM)");
                if cert_ok.is_some() && key_ok.is_some() {
                    if let Err(e) = httpd::tls::server_config_from_files(c, k, httpd::tls::ALPN_HTTP1) {
                        self.fail(
                            &format!("{table}.tls_cert_file"),
                            format!("{} and {} are not a usable certificate and key: {e}", c.display(), k.display()),
                            "give a PEM certificate chain (leaf first) and the PEM private key of its leaf",
                        );
                    }
                }
            }
        }
    }

    /// A bearer-token file under sandboxd's rule ([`foundation::read_token_file`]: owner-only,
    /// at least 32 characters), so the check refuses what sandboxd would refuse at start.
    fn token(&mut self, key: &str, p: &Path, env: &ValidateEnv) {
        if !env.check_files {
            return;
        }
        if let Err(e) = foundation::read_token_file(p) {
            self.fail(
                key,
                format!("{}: {e}", p.display()),
                "give a file readable by its owner only holding a random token of at least 32 characters \
                 (or leave the key unset: the supervisor mints one)",
            );
        }
    }

    /// A secret file: readable and non-empty; returns its trimmed contents.
    fn secret(&mut self, key: &str, p: &Path, env: &ValidateEnv, what: &str) -> Option<String> {
        if !env.check_files {
            return None;
        }
        match std::fs::read_to_string(p) {
            Ok(s) if s.trim().is_empty() => {
                self.fail(key, format!("{} is empty", p.display()), format!("write {what} into it"));
                None
            }
            Ok(s) => Some(s.trim().to_string()),
            Err(e) => {
                self.fail(
                    key,
                    format!("{} cannot be read ({e})", p.display()),
                    format!("create it with {what} (a relative path is relative to the file that sets the key)"),
                );
                None
            }
        }
    }
}

/// A name a certificate may carry: an IP address, or a DNS name (labels of letters, digits and
/// `-`, optionally a leading `*.`).
pub fn valid_tls_name(n: &str) -> bool {
    if n.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let n = n.strip_prefix("*.").unwrap_or(n);
    !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// `[a-z0-9]{6}.[a-z0-9]{16}`.
pub fn valid_bootstrap_token(t: &str) -> bool {
    let ok = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    matches!(t.split_once('.'), Some((id, secret)) if ok(id, 6) && ok(secret, 16))
}

/// `sha256:<64 lowercase or uppercase hex>`.
pub fn valid_ca_hash(h: &str) -> bool {
    h.strip_prefix("sha256:").is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A Kubernetes node name: an RFC 1123 subdomain (lowercase alphanumerics, `-`, `.`; ≤ 253;
/// labels ≤ 63, starting and ending alphanumeric).
pub fn valid_node_name(n: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && alnum(b[0])
                && alnum(b[b.len() - 1])
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// A Kubernetes label value (≤ 63; alphanumeric at both ends; `-_.` inside).
pub fn valid_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// A Kubernetes namespace name: an RFC 1123 label (1-63 of `[a-z0-9-]`, alphanumeric at both ends).
pub fn valid_namespace(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first() != Some(&b'-')
        && b.last() != Some(&b'-')
}

/// `https://host[:port]` with nothing after the authority.
fn check_endpoint(e: &str) -> Result<(), String> {
    let Some(rest) = e.strip_prefix("https://") else {
        return Err(format!("{e:?} does not start with https://"));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains('?') || authority.contains('@') {
        return Err(format!("{e:?} is not https://host:port (no path, no user)"));
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((h, "")) => (h, None),
            Some((h, p)) => (h, Some(p.strip_prefix(':').unwrap_or("x"))),
            None => ("", None),
        },
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    if host.is_empty() || port.is_some_and(|p| p.parse::<u16>().map_or(true, |n| n == 0)) {
        return Err(format!("{e:?} has no valid host[:port]"));
    }
    Ok(())
}

impl Config {
    /// Applies the defaults that depend on other keys and checks every rule; all problems are
    /// reported at once.
    pub fn validate(&self, prov: &Provenance, env: &ValidateEnv) -> Result<Settings, ConfigError> {
        let mut c = Check { prov, issues: Vec::new() };
        let mut cfg = self.clone();

        // [supervisor]
        let s = &cfg.supervisor;
        c.absolute("supervisor.api_socket", &s.api_socket);
        c.absolute("supervisor.state_dir", &s.state_dir);
        let api_listen = s.api_listen.as_deref().and_then(|v| c.addr("supervisor.api_listen", v, "0.0.0.0:7780"));
        if s.api_listen.is_some() && s.api_token_file.is_none() {
            c.fail(
                "supervisor.api_listen",
                "a remote API without a token would let anyone on the network update or reboot the box",
                "set supervisor.api_token_file to a file holding a bearer token (or remove api_listen)",
            );
        }
        if let Some(p) = &s.api_token_file {
            c.secret("supervisor.api_token_file", p, env, "a bearer token (e.g. `openssl rand -hex 32`)");
        }
        let metrics_listen =
            s.metrics_listen.as_deref().and_then(|v| c.addr("supervisor.metrics_listen", v, "0.0.0.0:9100"));
        if metrics_listen.is_some_and(|a| !a.ip().is_loopback()) && s.metrics_token_file.is_none() {
            c.fail(
                "supervisor.metrics_listen",
                "metrics beyond loopback without a token would show the box's state to anyone on the network",
                "set supervisor.metrics_token_file to a file holding a bearer token for the scraper \
                 (Prometheus: authorization.credentials_file), or listen on 127.0.0.1",
            );
        }
        if let Some(p) = &s.metrics_token_file {
            c.secret("supervisor.metrics_token_file", p, env, "a bearer token (e.g. `openssl rand -hex 32`)");
        }
        c.tls_pair("supervisor", s.tls_cert_file.as_deref(), s.tls_key_file.as_deref(), env);
        for (i, n) in s.tls_names.iter().enumerate() {
            if !valid_tls_name(n) {
                c.fail(
                    &format!("supervisor.tls_names[{i}]"),
                    format!("{n:?} is not a DNS name or an IP address"),
                    "give names like \"box1.example.com\" or addresses like \"10.0.0.5\"",
                );
            }
        }

        // [sandboxd]
        let sb = &cfg.sandboxd;
        let sandboxd_listen = c.addr("sandboxd.listen", &sb.listen, "0.0.0.0:7777");
        if let Some(p) = &sb.api_token_file {
            c.token("sandboxd.api_token_file", p, env);
        }
        c.tls_pair("sandboxd", sb.tls_cert_file.as_deref(), sb.tls_key_file.as_deref(), env);
        for (key, v) in [
            ("max_vms", sb.max_vms),
            ("max_memory_mib", sb.max_memory_mib),
            ("max_disk_mib", sb.max_disk_mib),
            ("max_lifetime_secs", sb.max_lifetime_secs),
        ] {
            if v == Some(0) {
                c.fail(
                    &format!("sandboxd.{key}"),
                    "0 would refuse every claim",
                    format!("remove sandboxd.{key} (sandboxd then picks its default) or give a positive number"),
                );
            }
        }
        if let Some(p) = &sb.catalog {
            c.absolute("sandboxd.catalog", p);
        }
        if sb.refill_concurrency > 256 {
            c.fail(
                "sandboxd.refill_concurrency",
                format!("{} is above 256", sb.refill_concurrency),
                "use 0 (automatic) to 256",
            );
        }
        if sb.boot_timeout_secs == 0 {
            c.fail(
                "sandboxd.boot_timeout_secs",
                "0 would fail every boot",
                "give the seconds a cold boot may take (600 under TCG)",
            );
        }
        let mut seen: Vec<(&str, &str, &str)> = Vec::new();
        for (i, p) in sb.pools.iter().enumerate() {
            let k = |f: &str| format!("sandboxd.pools[{i}].{f}");
            if !vmm::catalog::valid_template(&p.template) {
                c.fail(
                    &k("template"),
                    format!("{:?} is not a template name", p.template),
                    "use a catalog template or alias such as \"base\" (letters, digits, . _ : / -; at most 63)",
                );
            }
            if p.size.parse::<vmm::SizeClass>().is_err() {
                let sizes: Vec<&str> = vmm::SizeClass::ALL.iter().map(|s| s.as_str()).collect();
                c.fail(
                    &k("size"),
                    format!("{:?} is not a size class", p.size),
                    format!("use one of {}", sizes.join(", ")),
                );
            }
            match p.net.as_str() {
                "none" => {}
                "egress" if sb.vm_uplink.is_some() => {}
                "egress" => c.fail(
                    &k("net"),
                    "egress needs sandboxd.vm_uplink (the interface VM egress leaves by), which is not set",
                    "set sandboxd.vm_uplink (e.g. \"eno1\") or use net = \"none\"",
                ),
                other => {
                    c.fail(&k("net"), format!("{other:?} is not a network lane"), "use net = \"none\" or \"egress\"")
                }
            }
            let key = (p.template.as_str(), p.size.as_str(), p.net.as_str());
            if seen.contains(&key) {
                c.fail(
                    &format!("sandboxd.pools[{i}]"),
                    format!("a second pool for template {:?}, size {:?}, net {:?}", p.template, p.size, p.net),
                    "merge the two entries into one and set its warm count",
                );
            }
            seen.push(key);
        }
        let sandboxd_network = c.sandboxd_network(sb);

        // [cluster]
        if let Some(cl) = &cfg.cluster {
            if let Err(problem) = check_endpoint(&cl.endpoint) {
                c.fail(
                    "cluster.endpoint",
                    problem,
                    "give the API server as https://host:port, e.g. https://10.0.2.100:6443",
                );
            }
            if cl.ca_cert_hashes.is_empty() {
                c.fail(
                    "cluster.ca_cert_hashes",
                    "is empty: an unpinned cluster CA is never trusted",
                    "add the sha256:<hex> value printed by kubeadm token create --print-join-command",
                );
            }
            for (i, h) in cl.ca_cert_hashes.iter().enumerate() {
                if !valid_ca_hash(h) {
                    c.fail(
                        &format!("cluster.ca_cert_hashes[{i}]"),
                        format!("{h:?} is not sha256:<64 hex>"),
                        "copy the value printed by kubeadm token create --print-join-command",
                    );
                }
            }
            let key = "cluster.bootstrap_token_file";
            if let Some(t) =
                c.secret(key, &cl.bootstrap_token_file, env, "the bootstrap token (abcdef.0123456789abcdef)")
            {
                if !valid_bootstrap_token(&t) {
                    c.fail(
                        key,
                        format!(
                            "{} does not hold a token of the form abcdef.0123456789abcdef",
                            cl.bootstrap_token_file.display()
                        ),
                        "write the token printed by kubeadm token create (one line, nothing else)",
                    );
                }
            }
        }

        // [vk_sandbox] / [vk_cocoon]
        let cluster = cfg.cluster.is_some();
        let vk_sandbox = cfg.vk_sandbox.enabled.unwrap_or(cluster);
        let vk_cocoon = cfg.vk_cocoon.enabled.unwrap_or(cluster);
        for (svc, on) in [("vk_sandbox", vk_sandbox), ("vk_cocoon", vk_cocoon)] {
            if on && !cluster {
                c.fail(
                    &format!("{svc}.enabled"),
                    "a virtual node needs a cluster to join, and there is no [cluster] table",
                    format!(
                        "add [cluster] (endpoint, ca_cert_hashes, bootstrap_token_file) or set {svc}.enabled = false"
                    ),
                );
            }
        }
        if vk_sandbox && !cfg.sandboxd.enabled {
            c.fail(
                "vk_sandbox.enabled",
                "vk-sandbox serves Pods from sandboxd, which is disabled",
                "set sandboxd.enabled = true or vk_sandbox.enabled = false",
            );
        }
        let host = env.hostname.trim_end_matches('.').to_ascii_lowercase();
        let host = host.as_str();
        cfg.vk_sandbox.enabled = Some(vk_sandbox);
        cfg.vk_cocoon.enabled = Some(vk_cocoon);
        let sandbox_name = cfg.vk_sandbox.node_name.get_or_insert_with(|| format!("{host}-sandbox")).clone();
        let cocoon_name = cfg.vk_cocoon.node_name.get_or_insert_with(|| format!("{host}-cocoon")).clone();
        for (key, name, on) in
            [("vk_sandbox.node_name", &sandbox_name, vk_sandbox), ("vk_cocoon.node_name", &cocoon_name, vk_cocoon)]
        {
            if on && !valid_node_name(name) {
                let origin = if prov.source_of(key) == Source::Default {
                    format!(" (derived from the hostname {host:?})")
                } else {
                    String::new()
                };
                c.fail(
                    key,
                    format!("{name:?}{origin} is not a valid node name"),
                    format!("set {key} to lowercase letters, digits, '-' and '.' (at most 63 per label)"),
                );
            }
        }
        if vk_sandbox && vk_cocoon && sandbox_name == cocoon_name {
            c.fail(
                "vk_cocoon.node_name",
                format!("{cocoon_name:?} is also vk_sandbox's name"),
                "give each virtual node its own name",
            );
        }
        if vk_cocoon {
            let mut bad: Vec<String> = Vec::new();
            for group in &cfg.vk_cocoon.shared_namespaces {
                let distinct: std::collections::BTreeSet<&String> = group.iter().collect();
                if distinct.len() < 2 {
                    bad.push(format!("{group:?} has fewer than two different namespaces"));
                }
                bad.extend(
                    group.iter().filter(|n| !valid_namespace(n)).map(|n| format!("{n:?} is not a namespace name")),
                );
            }
            if !bad.is_empty() {
                c.fail(
                    "vk_cocoon.shared_namespaces",
                    bad.join("; "),
                    "list groups of at least two namespace names (1-63 of a-z, 0-9 and '-'), \
                     e.g. [[\"golden\", \"team-a\"]]; pods of one group may use each other's VMs and snapshots",
                );
            }
            let allow = cfg.vk_cocoon.vm_host_allow.join(",");
            if let Err(e) = vmnet::filter::parse_host_allow(&allow) {
                c.fail(
                    "vk_cocoon.vm_host_allow",
                    e.to_string(),
                    "list host services as \"tcp/PORT\" or \"udp/PORT\", e.g. [\"udp/53\"], or leave it empty (VMs reach no host service)",
                );
            }
            if let Some(up) = &cfg.vk_cocoon.vm_uplink {
                let policy = vmnet::FilterPolicy { uplink: Some(up.clone()), ..Default::default() };
                if let Err(e) = policy.validate() {
                    c.fail(
                        "vk_cocoon.vm_uplink",
                        e.to_string(),
                        "name the network interface egress VMs leave by (e.g. \"eno1\"), or remove the key (no VM has a route out)",
                    );
                }
            }
            if let Err(e) = vmnet::filter::parse_refuse(&cfg.vk_cocoon.vm_refuse.join(",")) {
                c.fail(
                    "vk_cocoon.vm_refuse",
                    e.to_string(),
                    "list IPv4 networks as \"a.b.c.d/len\" (or single addresses), e.g. [\"203.0.113.0/24\"]",
                );
            }
            if let Some(ns) = cfg.vk_cocoon.legacy_namespace.as_deref().filter(|n| !valid_namespace(n)) {
                c.fail(
                    "vk_cocoon.legacy_namespace",
                    format!("{ns:?} is not a namespace name"),
                    "name the namespace that owns VMs and snapshots recorded without one (1-63 of a-z, 0-9 and '-')",
                );
            }
        }
        if let Some(net) = sandboxd_network.as_ref().filter(|_| vk_cocoon && cfg.sandboxd.enabled) {
            c.apart_from_vk_cocoon(net);
        }
        if vk_cocoon && !valid_label_value(&cfg.vk_cocoon.pool) {
            c.fail(
                "vk_cocoon.pool",
                format!("{:?} is not a label value", cfg.vk_cocoon.pool),
                "use at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
            );
        }

        // [update]
        if cfg.update.health_deadline_secs == 0 {
            c.fail(
                "update.health_deadline_secs",
                "0 would revert every update at once",
                "give the seconds a trial boot has to become healthy (600 under TCG)",
            );
        }

        match (c.issues.is_empty(), sandboxd_listen) {
            (true, Some(sandboxd_listen)) => Ok(Settings {
                config: cfg,
                api_listen,
                metrics_listen,
                sandboxd_listen,
                vk_sandbox,
                vk_cocoon,
                sandboxd_network,
                sources: Vec::new(),
            }),
            _ => Err(ConfigError::Invalid(c.issues)),
        }
    }
}

impl Loaded {
    /// Validates (see [`Config::validate`]).
    pub fn validate(self, env: &ValidateEnv) -> Result<Settings, ConfigError> {
        let mut s = self.config.validate(&self.provenance, env)?;
        s.sources = self.sources;
        Ok(s)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

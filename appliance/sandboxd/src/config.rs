//! The daemon's JSON config (`/etc/sandboxd/config.json` by default, `--config` overrides):
//! the schema is [`sandboxd_api::config`] (keys, defaults, the example); this module parses it
//! and validates it (parse, then validate). Unknown keys are refused; every error names the
//! key, where it was set and the fix. Secure by default:
//!
//! - `listen` off loopback needs `api_token_file` ([`Config::check_exposure`]); the token file
//!   must be at least [`MIN_TOKEN_LEN`] characters and readable by its owner only;
//! - `tls_cert_file` and `tls_key_file` come together;
//! - the budget (`max_vms`, `max_memory_mib`, derived from the host when absent) must hold the
//!   configured warm targets.
//! - `net: egress` (a pool here, in `PUT /v1/pools` or in a claim) needs the `network` section
//!   with an `uplink` ([`net_config`]); sandboxes never get a host service allow-list.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::limits::{self, Branching, Budget, BudgetError, ExecTimeouts, HttpLimits, Limits};
use crate::pool::{KeyError, PoolKey};
use crate::slots::ClaimCaps;

/// The shortest root token accepted (32 characters: 128 bits as hex, 192 as base64).
pub use foundation::MIN_TOKEN_LEN;
/// The schema's pieces sandboxd's callers name through this module.
pub use sandboxd_api::config::{NetworkConfig, PoolConfig, DEFAULT_PATH, DEFAULT_WARM};

/// Where the effective `listen` address came from (named in errors).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ListenSource {
    /// Nobody set it.
    #[default]
    Default,
    /// The config file.
    File(PathBuf),
    /// The `--listen` flag.
    Flag,
}

impl fmt::Display for ListenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenSource::Default => write!(f, "the default {}", sandboxd_api::config::DEFAULT_LISTEN),
            ListenSource::File(p) => write!(f, "set in {}", p.display()),
            ListenSource::Flag => write!(f, "set by the --listen flag"),
        }
    }
}

/// Errors loading or validating the config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The preview key (`preview_listen`) could not be read or made.
    #[error("config key preview_listen: the preview key {path}")]
    Preview {
        /// The key file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file could not be read.
    #[error("reading config {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid config JSON (names the unknown or mistyped key).
    #[error("parsing config {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A pool entry has a bad key.
    #[error("config key pools[{index}]")]
    Pool {
        /// Index in `pools`.
        index: usize,
        /// The cause.
        #[source]
        source: KeyError,
    },
    /// Two pool entries share a key.
    #[error("config key pools[{index}]: duplicate pool {key}")]
    DuplicatePool {
        /// Index in `pools`.
        index: usize,
        /// The key.
        key: String,
    },
    /// A pool asks for `net: egress` on a node without `network.uplink`.
    #[error(
        "config key pools[{index}].net: egress needs network.uplink (the interface VM egress leaves by, \
         e.g. \"eth0\"); set it, or use net \"none\" for this pool"
    )]
    Egress {
        /// Index in `pools`.
        index: usize,
    },
    /// The `network` section is unusable.
    #[error("config key network: {problem}")]
    Network {
        /// What is wrong, and the fix.
        problem: String,
        /// The cause.
        #[source]
        source: vmnet::VmnetError,
    },
    /// The token file could not be read, is empty, too short or readable by others.
    #[error("config key api_token_file: {path}: {reason}")]
    Token {
        /// The file.
        path: PathBuf,
        /// What was wrong, and the fix.
        reason: String,
    },
    /// A non-loopback `listen` without a root token: anyone on the network could claim VMs.
    #[error(
        "config keys listen / api_token_file: listen {listen} ({set}) is not a loopback address and no \
         api_token_file is configured, so anyone who can reach the port could claim every VM, drain the node \
         and change its pools; set api_token_file to a file holding the root token (at least {MIN_TOKEN_LEN} \
         characters, mode 0600), or listen on 127.0.0.1:7777 for development"
    )]
    OpenListen {
        /// The address.
        listen: SocketAddr,
        /// Where it was set.
        set: ListenSource,
    },
    /// `local_listen` is not a loopback address.
    #[error(
        "config key local_listen: {0} is not a loopback address; local_listen serves plain HTTP for local \
         clients only (e.g. 127.0.0.1:7778); use listen with tls_cert_file / tls_key_file for remote clients"
    )]
    LocalListen(SocketAddr),
    /// Only one of the TLS files is set.
    #[error(
        "config keys tls_cert_file / tls_key_file: {0} is set without {1}; set both (TLS) or neither (plain HTTP)"
    )]
    TlsPair(&'static str, &'static str),
    /// The TLS certificate or key cannot be used.
    #[error("config keys tls_cert_file / tls_key_file")]
    Tls(#[source] httpd::tls::TlsError),
    /// A limit is out of range.
    #[error("config key {key}: {problem}")]
    Limit {
        /// The key.
        key: &'static str,
        /// What is wrong, and the fix.
        problem: String,
    },
    /// The configured warm targets do not fit the node budget.
    #[error("config key pools")]
    Budget(#[source] BudgetError),
    /// The host memory could not be read to derive the default budget.
    #[error("config keys max_memory_mib / max_vms: reading /proc/meminfo to derive the default budget (set both to skip it)")]
    HostMemory(#[source] std::io::Error),
    /// The filesystem holding the VMs could not be measured for the default disk budget.
    #[error("config key max_disk_mib: measuring the filesystem of {} to derive the default disk budget (set max_disk_mib to skip it)", dir.display())]
    HostDisk {
        /// The VM state directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Validates a pool list: keys parse, no duplicates, egress only when the node has an uplink
/// (`egress`). Returns `(key, target)` pairs.
pub fn validate_pools(pools: &[PoolConfig], egress: bool) -> Result<Vec<(PoolKey, usize)>, ConfigError> {
    let mut out: Vec<(PoolKey, usize)> = Vec::with_capacity(pools.len());
    for (index, p) in pools.iter().enumerate() {
        let key = pool_key(p).map_err(|source| ConfigError::Pool { index, source })?;
        if key.net() == crate::pool::Net::Egress && !egress {
            return Err(ConfigError::Egress { index });
        }
        if out.iter().any(|(k, _)| *k == key) {
            return Err(ConfigError::DuplicatePool { index, key: key.to_string() });
        }
        out.push((key, p.target()));
    }
    Ok(out)
}

/// The default bridge of sandboxd's VMs (vk-cocoon's is `chrysalis0`).
pub const DEFAULT_NET_BRIDGE: &str = vmnet::config::SANDBOXD_BRIDGE;
/// The default address range of sandboxd's VMs.
pub const DEFAULT_NET_CIDR: &str = vmnet::config::SANDBOXD_CIDR;
/// The name of sandboxd's nft tables (`bridge chrysalis_sbx`, `inet chrysalis_sbx`).
pub const NET_TABLE: &str = vmnet::config::SANDBOXD_TABLE;
/// The prefix of sandboxd's TAP names (vk-cocoon's are `ct-*`).
pub const NET_TAP_PREFIX: &str = vmnet::config::SANDBOXD_TAP_PREFIX;

fn default_net_cidr() -> vmnet::Ipv4Net {
    // A constant that parses.
    #[allow(clippy::unwrap_used)]
    DEFAULT_NET_CIDR.parse().unwrap()
}

/// The vmnet configuration of a `network` section: [`NET_TABLE`], [`NET_TAP_PREFIX`], no host
/// service allowed, leases in `<data_dir>/network/leases.json` (0600); an absent `bridge` or
/// `cidr` is [`DEFAULT_NET_BRIDGE`] / [`DEFAULT_NET_CIDR`].
pub fn net_config(section: &NetworkConfig, data_dir: &Path) -> Result<vmnet::NetConfig, ConfigError> {
    let bad = |problem: String| move |source| ConfigError::Network { problem, source };
    let cidr: vmnet::Ipv4Net = match &section.cidr {
        None => default_net_cidr(),
        Some(c) => c.parse().map_err(|e: <vmnet::Ipv4Net as std::str::FromStr>::Err| {
            bad(format!("cidr {c:?}: write an IPv4 network like \"{DEFAULT_NET_CIDR}\""))(vmnet::VmnetError::Config(
                e.to_string(),
            ))
        })?,
    };
    let refuse = vmnet::filter::parse_refuse(&section.refuse.join(",")).map_err(|e| {
        bad(format!("refuse {:?}: list IPv4 networks like \"203.0.113.0/24\"", section.refuse))(e.into())
    })?;
    let filter = vmnet::FilterPolicy { host_allow: Vec::new(), uplink: section.uplink.clone(), refuse };
    let cfg = vmnet::NetConfig {
        bridge: section.bridge.clone().unwrap_or_else(|| DEFAULT_NET_BRIDGE.to_string()),
        netns: section.netns.clone(),
        filter,
        table: NET_TABLE.to_string(),
        tap_prefix: NET_TAP_PREFIX.to_string(),
        ..vmnet::NetConfig::new(cidr, data_dir.join("network").join("leases.json"))
    };
    cfg.validate().map_err(bad(
        "fix bridge (an interface name), cidr (a /30 or larger, no host bits), uplink (an interface name) \
         or netns (a name under /run/netns)"
            .into(),
    ))?;
    if cfg.cidr != cidr {
        return Err(bad(format!("cidr {cidr} has host bits set; use {}", cfg.cidr))(vmnet::VmnetError::Config(
            "host bits set".into(),
        )));
    }
    Ok(cfg)
}

/// A config as sandboxd runs with it: the file's keys ([`sandboxd_api::Config`], read and
/// set through `Deref`) and where `listen` came from. [`Config::load`] and [`Config::parse`]
/// validate; `From` and `Default` do not (tests and tools).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    file: sandboxd_api::Config,
    /// Where `listen` came from (not a key).
    pub listen_source: ListenSource,
}

impl From<sandboxd_api::Config> for Config {
    fn from(file: sandboxd_api::Config) -> Self {
        Config { file, listen_source: ListenSource::Default }
    }
}

impl std::ops::Deref for Config {
    type Target = sandboxd_api::Config;
    fn deref(&self) -> &sandboxd_api::Config {
        &self.file
    }
}

impl std::ops::DerefMut for Config {
    fn deref_mut(&mut self) -> &mut sandboxd_api::Config {
        &mut self.file
    }
}

/// The validated key of a configured pool.
pub fn pool_key(p: &PoolConfig) -> Result<PoolKey, KeyError> {
    PoolKey::parse(&p.template, p.net.as_deref(), p.size.as_deref())
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(path, &bytes)
    }

    /// Parses and validates config bytes (`path` only names the source in errors).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, ConfigError> {
        let parse_err = |source| ConfigError::Parse { path: path.to_path_buf(), source };
        let raw: serde_json::Value = serde_json::from_slice(bytes).map_err(parse_err)?;
        let has_listen = raw.get("listen").is_some();
        let mut c = Config::from(serde_json::from_value::<sandboxd_api::Config>(raw).map_err(parse_err)?);
        if has_listen {
            c.listen_source = ListenSource::File(path.to_path_buf());
        }
        validate_pools(&c.pools, c.egress())?;
        c.check_static()?;
        c.net_config()?;
        Ok(c)
    }

    /// Whether `net: egress` is available: a `network` section with an `uplink`.
    pub fn egress(&self) -> bool {
        self.network.as_ref().is_some_and(|n| n.uplink.is_some())
    }

    /// The vmnet configuration of the `network` section, if any.
    pub fn net_config(&self) -> Result<Option<vmnet::NetConfig>, ConfigError> {
        self.network.as_ref().map(|n| net_config(n, &self.data_dir)).transpose()
    }

    /// The checks that need no file or host access: TLS pairing, `local_listen`, limit ranges.
    pub fn check_static(&self) -> Result<(), ConfigError> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => return Err(ConfigError::TlsPair("tls_cert_file", "tls_key_file")),
            (None, Some(_)) => return Err(ConfigError::TlsPair("tls_key_file", "tls_cert_file")),
            _ => {}
        }
        if let Some(l) = self.local_listen {
            if !l.ip().is_loopback() {
                return Err(ConfigError::LocalListen(l));
            }
        }
        let at_least_one = |key: &'static str, v: u64| {
            if v == 0 {
                Err(ConfigError::Limit { key, problem: "must be at least 1".into() })
            } else {
                Ok(())
            }
        };
        at_least_one("max_lifetime_secs", self.max_lifetime_secs)?;
        at_least_one("max_agent_relays_per_claim", self.max_agent_relays_per_claim as u64)?;
        at_least_one("max_port_relays_per_claim", self.max_port_relays_per_claim as u64)?;
        at_least_one("max_execs_per_claim", self.max_execs_per_claim as u64)?;
        at_least_one("exec_default_timeout_secs", self.exec_default_timeout_secs)?;
        at_least_one("exec_max_timeout_secs", self.exec_max_timeout_secs)?;
        at_least_one("max_connections", self.max_connections as u64)?;
        at_least_one("header_timeout_secs", self.header_timeout_secs)?;
        at_least_one("body_timeout_secs", self.body_timeout_secs)?;
        at_least_one("relay_idle_timeout_secs", self.relay_idle_timeout_secs)?;
        if let Some(v) = self.max_vms {
            at_least_one("max_vms", v as u64)?;
        }
        if let Some(v) = self.max_memory_mib {
            at_least_one("max_memory_mib", v)?;
        }
        if let Some(v) = self.max_disk_mib {
            at_least_one("max_disk_mib", v)?;
        }
        if !(1..=sandboxd_api::config::MAX_FORK_COUNT_LIMIT).contains(&self.max_fork_count) {
            return Err(ConfigError::Limit {
                key: "max_fork_count",
                problem: format!(
                    "{} is outside 1..={}",
                    self.max_fork_count,
                    sandboxd_api::config::MAX_FORK_COUNT_LIMIT
                ),
            });
        }
        if self.console_log_kib < sandboxd_api::config::MIN_CONSOLE_LOG_KIB {
            return Err(ConfigError::Limit {
                key: "console_log_kib",
                problem: format!(
                    "{} is under the smallest console, {} KiB",
                    self.console_log_kib,
                    sandboxd_api::config::MIN_CONSOLE_LOG_KIB
                ),
            });
        }
        if self.exec_default_timeout_secs > self.exec_max_timeout_secs {
            return Err(ConfigError::Limit {
                key: "exec_default_timeout_secs",
                problem: format!(
                    "{} is over exec_max_timeout_secs = {}; lower it or raise exec_max_timeout_secs",
                    self.exec_default_timeout_secs, self.exec_max_timeout_secs
                ),
            });
        }
        Ok(())
    }

    /// Refuses a `listen` off loopback without a root token (the fail-closed rule): names the
    /// keys, where `listen` was set, and the fix.
    pub fn check_exposure(&self) -> Result<(), ConfigError> {
        if self.listen.ip().is_loopback() || self.api_token_file.is_some() {
            return Ok(());
        }
        Err(ConfigError::OpenListen { listen: self.listen, set: self.listen_source.clone() })
    }

    /// The node budget: the configured limits, the missing ones derived from the host memory
    /// ([`Budget::from_mem_total`]); the configured warm targets must fit it.
    pub fn budget(&self) -> Result<Budget, ConfigError> {
        let max_disk_mib = match self.max_disk_mib {
            Some(v) => v,
            None => {
                let dir = self.vm_state_dir();
                limits::default_max_disk_mib(&dir).map_err(|source| ConfigError::HostDisk { dir, source })?
            }
        };
        let budget = match (self.max_vms, self.max_memory_mib) {
            (Some(max_vms), Some(max_memory_mib)) => Budget { max_vms, max_memory_mib, max_disk_mib },
            (vms, mem) => {
                let derived = Budget::from_mem_total(limits::host_mem_total_mib().map_err(ConfigError::HostMemory)?);
                let max_memory_mib = mem.unwrap_or(derived.max_memory_mib);
                let max_vms = vms.unwrap_or_else(|| limits::default_max_vms(max_memory_mib));
                Budget { max_vms, max_memory_mib, max_disk_mib }
            }
        };
        budget.check(&validate_pools(&self.pools, self.egress())?).map_err(ConfigError::Budget)?;
        Ok(budget)
    }

    /// Every limit (reads `/proc/meminfo` unless both budget keys are set).
    pub fn limits(&self) -> Result<Limits, ConfigError> {
        Ok(Limits {
            budget: self.budget()?,
            max_lifetime: Duration::from_secs(self.max_lifetime_secs),
            caps: ClaimCaps {
                agent_relays: self.max_agent_relays_per_claim,
                port_relays: self.max_port_relays_per_claim,
                execs: self.max_execs_per_claim,
            },
            exec: ExecTimeouts {
                default: Duration::from_secs(self.exec_default_timeout_secs),
                max: Duration::from_secs(self.exec_max_timeout_secs),
            },
            http: HttpLimits {
                max_connections: self.max_connections,
                header_timeout: Duration::from_secs(self.header_timeout_secs),
                body_timeout: Duration::from_secs(self.body_timeout_secs),
                relay_idle: Duration::from_secs(self.relay_idle_timeout_secs),
            },
            branching: Branching {
                max_fork_count: self.max_fork_count,
                checkpoint_ttl: (self.checkpoint_ttl_hours > 0)
                    .then(|| Duration::from_secs(self.checkpoint_ttl_hours.saturating_mul(3600))),
            },
        })
    }

    /// The TLS server configuration (ALPN `http/1.1`), when both TLS files are set.
    pub fn tls(&self) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>, ConfigError> {
        self.check_static()?;
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => httpd::tls::server_config_from_files(cert, key, httpd::tls::ALPN_HTTP1)
                .map(Some)
                .map_err(ConfigError::Tls),
            _ => Ok(None),
        }
    }

    /// The effective refill concurrency.
    pub fn refill_limit(&self) -> usize {
        if self.refill_concurrency > 0 {
            return self.refill_concurrency.min(256);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus * 2 / 3).clamp(1, 256)
    }

    /// Reads the root token, if a token file is configured. Refuses a file readable by group
    /// or others (`chmod 600` fixes it), an empty one, and a token shorter than
    /// [`MIN_TOKEN_LEN`] characters.
    pub fn api_token(&self) -> Result<Option<String>, ConfigError> {
        let Some(path) = &self.api_token_file else {
            return Ok(None);
        };
        foundation::read_token_file(path)
            .map(Some)
            .map_err(|e| ConfigError::Token { path: path.clone(), reason: e.to_string() })
    }

    /// The driver state dir.
    pub fn vm_state_dir(&self) -> PathBuf {
        self.vm_state_dir.clone().unwrap_or_else(|| self.data_dir.join("vms"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.json"), s.as_bytes())
    }

    #[test]
    fn defaults() {
        let c = parse("{}").expect("empty config");
        assert_eq!(c.listen.to_string(), "0.0.0.0:7777");
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/sandboxd"));
        assert!(c.clone);
        assert_eq!(c.boot_timeout_secs, 90);
        assert!(c.refill_limit() >= 1);
        assert_eq!(c, Config::default());
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = parse(r#"{"listen":"127.0.0.1:1","warm":3}"#).expect_err("unknown key");
        let ConfigError::Parse { source, .. } = e else { panic!("want parse error, got {e:?}") };
        assert!(source.to_string().contains("warm"), "{source}");
        let e = parse(r#"{"pools":[{"template":"base","wram":1}]}"#).expect_err("unknown pool key");
        let ConfigError::Parse { source, .. } = e else { panic!("want parse error, got {e:?}") };
        assert!(source.to_string().contains("wram"), "{source}");
    }

    #[test]
    fn pool_validation_names_the_entry() {
        let e = parse(r#"{"pools":[{"template":"base"},{"template":"base","size":"huge"}]}"#).expect_err("bad");
        assert!(matches!(e, ConfigError::Pool { index: 1, source: KeyError::Size(_) }), "{e:?}");
        let e = parse(r#"{"pools":[{"template":"base"},{"template":"base","net":"none"}]}"#).expect_err("dup");
        assert!(matches!(e, ConfigError::DuplicatePool { index: 1, .. }), "{e:?}");
        let e = parse(r#"{"pools":[{"template":"base","net":"egress"}]}"#).expect_err("egress");
        assert!(matches!(e, ConfigError::Egress { index: 0 }), "{e:?}");
        assert!(e.to_string().contains("network.uplink"), "names the key and the fix: {e}");
        let e = parse(r#"{"network":{},"pools":[{"template":"base","net":"egress"}]}"#).expect_err("no uplink");
        assert!(matches!(e, ConfigError::Egress { index: 0 }), "{e:?}");
        let c = parse(r#"{"pools":[{"template":"base"},{"template":"rt","warm":0},{"template":"x","warm_max":3}]}"#)
            .expect("ok");
        let targets: Vec<usize> = c.pools.iter().map(PoolConfig::target).collect();
        assert_eq!(targets, vec![4, 0, 0]);
    }

    #[test]
    fn network_section() {
        let c = parse(r#"{"data_dir":"/d","network":{"uplink":"eth0"},"pools":[{"template":"base","net":"egress"}]}"#)
            .expect("egress with an uplink");
        assert!(c.egress());
        let n = c.net_config().expect("valid").expect("some");
        assert_eq!(n.bridge, DEFAULT_NET_BRIDGE);
        assert_eq!(n.cidr.to_string(), DEFAULT_NET_CIDR);
        assert_eq!(n.table, NET_TABLE);
        assert_eq!(n.tap_prefix, NET_TAP_PREFIX);
        assert_eq!(n.filter.uplink.as_deref(), Some("eth0"));
        assert!(n.filter.host_allow.is_empty(), "no host service is ever allowed from a sandbox");
        assert_eq!(n.leases_path, PathBuf::from("/d/network/leases.json"));
        assert_eq!(n.netns, None);
        let c = parse(r#"{"network":{"bridge":"br9","cidr":"10.5.0.0/16","refuse":["8.8.4.0/24"],"netns":"t1"}}"#)
            .expect("full section");
        assert!(!c.egress(), "no uplink, no egress");
        let n = c.net_config().expect("valid").expect("some");
        assert_eq!(n.filter.refuse, vec!["8.8.4.0/24".parse().expect("net")]);
        assert_eq!(n.netns.as_deref(), Some("t1"));
        assert_eq!(parse("{}").expect("none").net_config().expect("ok"), None);
        for (bad, needle) in [
            (r#"{"network":{"bridge":"a bridge"}}"#, "bridge"),
            (r#"{"network":{"cidr":"10.5.0.0/31"}}"#, "cidr"),
            (r#"{"network":{"cidr":"10.5.0.9/24"}}"#, "host bits"),
            (r#"{"network":{"cidr":"nope"}}"#, "cidr \"nope\""),
            (r#"{"network":{"refuse":["nope"]}}"#, "refuse"),
            (r#"{"network":{"uplink":"sb-x"}}"#, "uplink"),
            (r#"{"network":{"netns":"../x"}}"#, "netns"),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(matches!(e, ConfigError::Network { .. }), "{bad}: {e:?}");
            let chain = vmm::error_chain(&e);
            assert!(chain.contains("config key network") && chain.contains(needle), "{bad}: {chain}");
        }
        let e = parse(r#"{"network":{"mtu":1}}"#).expect_err("unknown key");
        assert!(matches!(e, ConfigError::Parse { .. }), "{e:?}");
    }

    fn secret(dir: &Path, name: &str, contents: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, contents).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    #[test]
    fn token_file_rules() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = "0123456789abcdef0123456789abcdef";
        let p = secret(dir.path(), "token", &format!("  {good}\n"), 0o600);
        let c = Config::from(sandboxd_api::Config { api_token_file: Some(p.clone()), ..Default::default() });
        assert_eq!(c.api_token().expect("token").as_deref(), Some(good), "trimmed");
        assert_eq!(Config::default().api_token().expect("none"), None);
        // Readable by others: refused, with the fix.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = c.api_token().expect_err("world-readable").to_string();
        assert!(e.contains("api_token_file") && e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        assert!(c.api_token().is_err(), "group-readable");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).expect("chmod");
        assert!(c.api_token().is_ok(), "owner read-only is fine");
        // Empty and short tokens.
        let empty = secret(dir.path(), "empty", "\n", 0o600);
        let e = Config::from(sandboxd_api::Config { api_token_file: Some(empty), ..Default::default() })
            .api_token()
            .expect_err("empty");
        assert!(e.to_string().contains("empty"), "{e}");
        let short = secret(dir.path(), "short", "s3cret", 0o600);
        let e = Config::from(sandboxd_api::Config { api_token_file: Some(short), ..Default::default() })
            .api_token()
            .expect_err("short");
        assert!(e.to_string().contains("6 characters, fewer than 32"), "{e}");
        let missing =
            Config::from(sandboxd_api::Config { api_token_file: Some(dir.path().join("nope")), ..Default::default() });
        assert!(matches!(missing.api_token(), Err(ConfigError::Token { .. })));
    }

    #[test]
    fn open_listen_is_refused_and_names_where_it_was_set() {
        // The default (0.0.0.0:7777) without a token.
        let e = Config::default().check_exposure().expect_err("default is open").to_string();
        assert!(e.contains("listen 0.0.0.0:7777 (the default 0.0.0.0:7777)"), "{e}");
        assert!(e.contains("api_token_file") && e.contains("127.0.0.1:7777"), "{e}");
        // From the file.
        let c = Config::parse(Path::new("/etc/sandboxd/x.json"), br#"{"listen":"10.0.0.5:7777"}"#).expect("parse");
        let e = c.check_exposure().expect_err("open").to_string();
        assert!(e.contains("set in /etc/sandboxd/x.json"), "{e}");
        // From the flag.
        let c = Config { listen_source: ListenSource::Flag, ..c };
        assert!(c.check_exposure().expect_err("open").to_string().contains("--listen flag"));
        // Loopback is open for development; a token makes any address fine.
        for l in ["127.0.0.1:7777", "[::1]:7777"] {
            let c = parse(&format!(r#"{{"listen":"{l}"}}"#)).expect("parse");
            assert!(c.check_exposure().is_ok(), "{l}");
        }
        let c = Config::from(sandboxd_api::Config { api_token_file: Some("/t".into()), ..Default::default() });
        assert!(c.check_exposure().is_ok());
    }

    #[test]
    fn tls_pair_local_listen_and_limits() {
        let e = parse(r#"{"tls_cert_file":"/c.pem"}"#).expect_err("half").to_string();
        assert!(e.contains("tls_cert_file is set without tls_key_file"), "{e}");
        let e = parse(r#"{"tls_key_file":"/k.pem"}"#).expect_err("half").to_string();
        assert!(e.contains("tls_key_file is set without tls_cert_file"), "{e}");
        let e = parse(r#"{"local_listen":"0.0.0.0:7778"}"#).expect_err("not loopback").to_string();
        assert!(e.contains("local_listen") && e.contains("loopback"), "{e}");
        assert!(parse(r#"{"local_listen":"127.0.0.1:7778"}"#).is_ok());
        let e = parse(r#"{"max_execs_per_claim":0}"#).expect_err("zero").to_string();
        assert_eq!(e, "config key max_execs_per_claim: must be at least 1");
        let e = parse(r#"{"console_log_kib":4}"#).expect_err("tiny console").to_string();
        assert_eq!(e, "config key console_log_kib: 4 is under the smallest console, 16 KiB");
        assert_eq!(sandboxd_api::config::DEFAULT_CONSOLE_LOG_KIB * 1024, vmm::console::DEFAULT_CONSOLE_CAP);
        assert_eq!(sandboxd_api::config::MIN_CONSOLE_LOG_KIB * 1024, vmm::console::MIN_CONSOLE_SETTING);
        let e = parse(r#"{"exec_default_timeout_secs":10,"exec_max_timeout_secs":5}"#).expect_err("order").to_string();
        assert!(e.contains("exec_default_timeout_secs: 10 is over exec_max_timeout_secs = 5"), "{e}");
        // A cert that is not PEM: a TLS error naming the file.
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&cert, "junk").expect("w");
        std::fs::write(&key, "junk").expect("w");
        let c = Config::from(sandboxd_api::Config {
            tls_cert_file: Some(cert.clone()),
            tls_key_file: Some(key.clone()),
            ..Default::default()
        });
        let e = c.tls().expect_err("junk");
        assert!(vmm::error_chain(&e).contains("c.pem"), "{}", vmm::error_chain(&e));
        let pair = httpd::tls::self_signed(&["localhost".into()]).expect("mint");
        std::fs::write(&cert, pair.cert_pem).expect("w");
        std::fs::write(&key, pair.key_pem).expect("w");
        let tls = c.tls().expect("tls").expect("some");
        assert_eq!(tls.alpn_protocols, vec![b"http/1.1".to_vec()]);
        assert!(Config::default().tls().expect("plain").is_none());
    }

    #[test]
    fn defaults_of_the_limits() {
        let c = parse(r#"{"max_vms":10,"max_memory_mib":4096,"max_disk_mib":8192}"#).expect("parse");
        let l = c.limits().expect("limits");
        assert_eq!(l.budget, Budget { max_vms: 10, max_memory_mib: 4096, max_disk_mib: 8192 });
        assert_eq!(l.max_lifetime, Duration::from_secs(604_800));
        assert_eq!(l.caps, ClaimCaps { agent_relays: 16, port_relays: 16, execs: 8 });
        assert_eq!(l.exec, ExecTimeouts { default: Duration::from_secs(300), max: Duration::from_secs(3600) });
        assert_eq!(l.http, HttpLimits::default());
        assert_eq!(l.http.max_connections, 4096);
        // Derived from the host: whatever it is, both limits are set and consistent.
        let d = Config::default().budget().expect("derived");
        assert!(d.max_vms >= 1 && d.max_vms <= limits::MAX_VMS_CEILING, "{d:?}");
        assert!(d.max_disk_mib >= 1 && d.max_disk_mib < limits::UNLIMITED_DISK_MIB, "{d:?}");
        let e = parse(r#"{"max_disk_mib":0}"#).expect_err("zero").to_string();
        assert_eq!(e, "config key max_disk_mib: must be at least 1");
        let half =
            parse(r#"{"max_memory_mib":2048,"max_disk_mib":8192}"#).expect("parse").budget().expect("derived vms");
        assert_eq!(half, Budget { max_vms: 4, max_memory_mib: 2048, max_disk_mib: 8192 });
    }

    #[test]
    fn warm_targets_over_the_budget_are_a_config_error() {
        let c =
            parse(r#"{"max_vms":4,"max_memory_mib":8192,"pools":[{"template":"base","warm":100000}]}"#).expect("parse");
        let e = c.budget().expect_err("over");
        let msg = vmm::error_chain(&e);
        assert!(msg.contains("config key pools") && msg.contains("100000 VMs") && msg.contains("max_vms = 4"), "{msg}");
        let c = parse(r#"{"max_vms":40,"max_memory_mib":2048,"pools":[{"template":"base","size":"large","warm":1}]}"#)
            .expect("parse");
        let msg = vmm::error_chain(&c.budget().expect_err("memory"));
        assert!(msg.contains("4096 MiB") && msg.contains("max_memory_mib = 2048"), "{msg}");
    }
}

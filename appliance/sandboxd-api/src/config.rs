//! sandboxd's JSON config file (`/etc/sandboxd/config.json` by default): the schema and its
//! defaults. sandboxd parses it with these types, then validates it (its `config` module:
//! pool keys, limit ranges, the token file, the TLS pair, the exposure rule); the supervisor
//! and xtask write it with them.
//!
//! ```json
//! {"listen": "0.0.0.0:7777", "data_dir": "/var/lib/sandboxd", "api_token_file": "/etc/sandboxd/token",
//!  "tls_cert_file": "/etc/sandboxd/tls/cert.pem", "tls_key_file": "/etc/sandboxd/tls/key.pem",
//!  "advertise_addr": "10.0.0.5:7777", "pools": [{"template": "base", "net": "none", "size": "small", "warm": 4}],
//!  "refill_concurrency": 0, "sync_claims": false, "boot_timeout_secs": 90, "clone": true,
//!  "max_vms": 40, "max_memory_mib": 20480, "max_lifetime_secs": 604800,
//!  "network": {"uplink": "eno1", "bridge": "chrysalis1", "cidr": "10.89.0.0/24", "refuse": []}}
//! ```
//!
//! Unknown keys are refused. An absent key takes the default named on its field (the
//! `DEFAULT_*` constants here, which sandboxd's own limits use too); optional keys that are
//! absent are not written back.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Default config file.
pub const DEFAULT_PATH: &str = "/etc/sandboxd/config.json";
/// Default `listen`.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7777));
/// Default `data_dir`.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/sandboxd";
/// Default `boot_timeout_secs`.
pub const DEFAULT_BOOT_TIMEOUT_SECS: u64 = 90;
/// Default `max_lifetime_secs` (7 days).
pub const DEFAULT_MAX_LIFETIME_SECS: u64 = 7 * 24 * 3600;
/// Default `max_agent_relays_per_claim`.
pub const DEFAULT_AGENT_RELAYS_PER_CLAIM: usize = 16;
/// Default `max_port_relays_per_claim`.
pub const DEFAULT_PORT_RELAYS_PER_CLAIM: usize = 16;
/// Default `max_execs_per_claim`.
pub const DEFAULT_EXECS_PER_CLAIM: usize = 8;
/// Default `exec_default_timeout_secs`.
pub const DEFAULT_EXEC_TIMEOUT_SECS: u64 = 300;
/// Default `exec_max_timeout_secs`.
pub const DEFAULT_EXEC_MAX_TIMEOUT_SECS: u64 = 3600;
/// Default `max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default `header_timeout_secs`: longer than the SDK's 30 s keep-alive, so the SDK drops a
/// parked keep-alive connection before the server would.
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 60;
/// Default `body_timeout_secs`.
pub const DEFAULT_BODY_TIMEOUT_SECS: u64 = 30;
/// Default `relay_idle_timeout_secs`.
pub const DEFAULT_RELAY_IDLE_TIMEOUT_SECS: u64 = 3600;
/// Default `console_log_kib` (vmm's default console cap).
pub const DEFAULT_CONSOLE_LOG_KIB: u64 = 1024;
/// Smallest `console_log_kib` accepted.
pub const MIN_CONSOLE_LOG_KIB: u64 = 16;
/// Default `max_fork_count`.
pub const DEFAULT_MAX_FORK_COUNT: usize = 16;
/// Largest `max_fork_count` accepted.
pub const MAX_FORK_COUNT_LIMIT: usize = 256;
/// Default `checkpoint_ttl_hours`: a week.
pub const DEFAULT_CHECKPOINT_TTL_HOURS: u64 = 168;
/// Default warm target of a pool that gives neither `warm` nor `warm_max`.
pub const DEFAULT_WARM: usize = 4;

/// One pool as configured: the config file's `pools`, `PUT /v1/pools`, `pools.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Template name.
    pub template: String,
    /// `none` (default) or `egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// Size class (default `small`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// Warm target (default [`DEFAULT_WARM`] when both `warm` and `warm_max` are absent, else 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<usize>,
    /// Adaptive ceiling (accepted; this node keeps `max(warm, …)` = `warm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_max: Option<usize>,
    /// Hibernate a claimed sandbox of this pool after this many seconds with no byte through
    /// its relays and no exec running (absent or 0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_hibernate_seconds: Option<u64>,
    /// Advanced: accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_after_seconds: Option<u64>,
    /// Advanced: accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_delete_after_seconds: Option<u64>,
}

impl PoolConfig {
    /// A pool of `template` (default `net` and `size`) keeping `warm` VMs warm.
    pub fn warm(template: impl Into<String>, warm: usize) -> Self {
        PoolConfig { template: template.into(), warm: Some(warm), ..PoolConfig::default() }
    }

    /// The warm target: `warm`, else 0 with a `warm_max`, else [`DEFAULT_WARM`].
    pub fn target(&self) -> usize {
        match (self.warm, self.warm_max) {
            (Some(w), _) => w,
            (None, Some(_)) => 0,
            (None, None) => DEFAULT_WARM,
        }
    }
}

/// The `network` section: per-VM networking for `net: egress` pools.
///
/// Only VMs of `egress` pools get a NIC: each its own TAP on `bridge`, its own lease from
/// `cidr`, isolated from every other VM, no host service reachable, and a route out only
/// through `uplink`, masqueraded, with private, shared, link-local, loopback, multicast and
/// reserved destinations, the host's own addresses and `refuse` dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// The bridge of sandboxd's VMs (absent: sandboxd's `chrysalis1`; must differ from
    /// vk-cocoon's `chrysalis0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// The VM address range, `a.b.c.d/len` (absent: sandboxd's `10.89.0.0/24`); its first host
    /// is the gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    /// The interface egress leaves by (masqueraded behind its address). No default: without
    /// it, no pool or claim may ask for `net: egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uplink: Option<String>,
    /// Destinations refused on top of the built-in private and link-local set (`a.b.c.d/len`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refuse: Vec<String>,
    /// A named network namespace holding the bridge and the TAPs (tests); default: sandboxd's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
}

/// Which hypervisor sandboxd drives (`hypervisor` in the config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hypervisor {
    /// cloud-hypervisor when its binary is present and KVM works; else QEMU (default).
    #[default]
    Auto,
    /// QEMU `-M microvm` (KVM, else TCG).
    Qemu,
    /// cloud-hypervisor (needs KVM; `$CLOUD_HYPERVISOR_BIN` or `cloud-hypervisor` on `PATH`).
    CloudHypervisor,
}

/// The config file. An absent key takes its value in [`Config::default`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listen address (default [`DEFAULT_LISTEN`]). Off loopback it needs `api_token_file`.
    pub listen: SocketAddr,
    /// Journal, pool overrides and goldens (default [`DEFAULT_DATA_DIR`]).
    pub data_dir: PathBuf,
    /// File holding the root API token (trimmed; at least 32 characters; mode 0600 or
    /// tighter). Absent: node routes are open, which is allowed on a loopback `listen` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_token_file: Option<PathBuf>,
    /// PEM certificate chain: with `tls_key_file`, `listen` serves TLS (ALPN `http/1.1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// An extra plain-HTTP listener, loopback only (local clients such as vk-sandbox when
    /// `listen` serves TLS). Same routes and auth; claims made through it name it as their
    /// `owner_addr`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_listen: Option<SocketAddr>,
    /// Where preview URLs are served (plain HTTP; each URL carries its own expiring HMAC
    /// token, so any address may be used). Absent: `POST …/preview` answers `501`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preview_listen: Option<SocketAddr>,
    /// The origin preview URLs start with (default `http://<preview_listen>`), e.g. the
    /// address of a proxy in front of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preview_url: Option<String>,
    /// `host:port` clients should use for sandbox-scoped calls (`owner_addr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_addr: Option<String>,
    /// Warm pools (`pools.json` from `PUT /v1/pools` overrides these).
    pub pools: Vec<PoolConfig>,
    /// Per-VM networking for `net: egress` pools; absent: no VM has a NIC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkConfig>,
    /// Concurrent refills; 0 = NumCPU×2/3 clamped to [1, 256].
    pub refill_concurrency: usize,
    /// `fdatasync` each claims-log append before the reply (survives power loss, not only
    /// `kill -9`; the `claims.json` snapshot is always fsynced).
    pub sync_claims: bool,
    /// How long a cold boot may take to answer silkd `info` (default [`DEFAULT_BOOT_TIMEOUT_SECS`]).
    pub boot_timeout_secs: u64,
    /// Fill pools by cloning a golden snapshot (else cold boots only; default true).
    pub clone: bool,
    /// The built-image catalog (default `$CHRYSALIS_CACHE/images/catalog.json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catalog: Option<PathBuf>,
    /// The VM driver's state dir (default `<data_dir>/vms`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_state_dir: Option<PathBuf>,
    /// VMs (warm + refilling + claimed) at most (default: `max_memory_mib` / 512, at most 1024).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_vms: Option<usize>,
    /// Memory of those VMs at most, MiB, each counted with its size class (default: the host's
    /// `MemTotal` minus an eighth of it, at least 1 GiB kept back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// Disk of those VMs at most, MiB, each counted with the most its writable overlay can
    /// grow to (the template's overlay image plus qcow2 metadata; 0 for a tmpfs overlay).
    /// Default: three quarters of the filesystem holding `vm_state_dir`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// The lease horizon: no renew may move a deadline past `claimed_at` + this
    /// (default [`DEFAULT_MAX_LIFETIME_SECS`]).
    pub max_lifetime_secs: u64,
    /// Concurrent `/agent` relays per claim (default [`DEFAULT_AGENT_RELAYS_PER_CLAIM`]).
    pub max_agent_relays_per_claim: usize,
    /// Concurrent `/ports` relays per claim (default [`DEFAULT_PORT_RELAYS_PER_CLAIM`]).
    pub max_port_relays_per_claim: usize,
    /// Concurrent `/exec` calls per claim (default [`DEFAULT_EXECS_PER_CLAIM`]).
    pub max_execs_per_claim: usize,
    /// `/exec` timeout when `timeout_seconds` is absent or 0 (default [`DEFAULT_EXEC_TIMEOUT_SECS`]).
    pub exec_default_timeout_secs: u64,
    /// Largest `/exec` `timeout_seconds` accepted (default [`DEFAULT_EXEC_MAX_TIMEOUT_SECS`];
    /// larger is a `400`).
    pub exec_max_timeout_secs: u64,
    /// Open connections per listener (default [`DEFAULT_MAX_CONNECTIONS`]); one more is closed
    /// at once.
    pub max_connections: usize,
    /// Time to send a request head, and the idle time of a keep-alive connection (default
    /// [`DEFAULT_HEADER_TIMEOUT_SECS`]).
    pub header_timeout_secs: u64,
    /// Time to send a whole request body (default [`DEFAULT_BODY_TIMEOUT_SECS`]).
    pub body_timeout_secs: u64,
    /// An `/agent` or `/ports` relay that moves no byte either way this long is closed
    /// (default [`DEFAULT_RELAY_IDLE_TIMEOUT_SECS`]).
    pub relay_idle_timeout_secs: u64,
    /// Serial console each VM keeps on disk, KiB, in two halves (default
    /// [`DEFAULT_CONSOLE_LOG_KIB`], at least [`MIN_CONSOLE_LOG_KIB`]); `GET …/console` and
    /// `kubectl logs` read it. A guest that writes more only loses its oldest lines.
    pub console_log_kib: u64,
    /// The hypervisor (default `auto`: cloud-hypervisor when its binary is present and KVM
    /// works, else QEMU). The choice and why are logged and shown in `GET /v1/info`.
    pub hypervisor: Hypervisor,
    /// Most children one fork may ask for (default [`DEFAULT_MAX_FORK_COUNT`], 1 to
    /// [`MAX_FORK_COUNT_LIMIT`]); a larger `count` is a `400`.
    pub max_fork_count: usize,
    /// Checkpoints older than this are deleted, hours (default
    /// [`DEFAULT_CHECKPOINT_TTL_HOURS`]; 0 keeps them until deleted). Their files stay while a
    /// sandbox claimed from them runs.
    pub checkpoint_ttl_hours: u64,
    /// Volumes the node creates at start when missing: ext4 images under
    /// `<data_dir>/volumes/<name>.img`. Any `*.img` an operator puts there is in the catalog too.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeConfig>,
}

/// A catalog volume the node makes if it is missing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    /// Its name: 1-64 of `[A-Za-z0-9._-]`, not starting with a dot.
    pub name: String,
    /// Its size, MiB (at least 8).
    pub size_mib: u64,
}

impl Default for Config {
    /// What an empty file (`{}`) means.
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            api_token_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            local_listen: None,
            preview_listen: None,
            preview_url: None,
            advertise_addr: None,
            pools: Vec::new(),
            network: None,
            refill_concurrency: 0,
            sync_claims: false,
            boot_timeout_secs: DEFAULT_BOOT_TIMEOUT_SECS,
            clone: true,
            catalog: None,
            vm_state_dir: None,
            max_vms: None,
            max_memory_mib: None,
            max_disk_mib: None,
            max_lifetime_secs: DEFAULT_MAX_LIFETIME_SECS,
            max_agent_relays_per_claim: DEFAULT_AGENT_RELAYS_PER_CLAIM,
            max_port_relays_per_claim: DEFAULT_PORT_RELAYS_PER_CLAIM,
            max_execs_per_claim: DEFAULT_EXECS_PER_CLAIM,
            exec_default_timeout_secs: DEFAULT_EXEC_TIMEOUT_SECS,
            exec_max_timeout_secs: DEFAULT_EXEC_MAX_TIMEOUT_SECS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            relay_idle_timeout_secs: DEFAULT_RELAY_IDLE_TIMEOUT_SECS,
            console_log_kib: DEFAULT_CONSOLE_LOG_KIB,
            hypervisor: Hypervisor::Auto,
            max_fork_count: DEFAULT_MAX_FORK_COUNT,
            checkpoint_ttl_hours: DEFAULT_CHECKPOINT_TTL_HOURS,
            volumes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_empty_file_is_the_default() {
        let c: Config = serde_json::from_str("{}").expect("empty");
        assert_eq!(c, Config::default());
        assert_eq!(c.listen.to_string(), "0.0.0.0:7777");
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/sandboxd"));
        assert!(c.clone && !c.sync_claims);
        assert_eq!((c.boot_timeout_secs, c.max_lifetime_secs), (90, 604_800));
    }

    #[test]
    fn absent_optional_keys_are_not_written_and_the_rest_round_trips() {
        let v = serde_json::to_value(Config::default()).expect("ser");
        for absent in [
            "api_token_file",
            "tls_cert_file",
            "tls_key_file",
            "local_listen",
            "advertise_addr",
            "network",
            "catalog",
            "vm_state_dir",
            "max_vms",
            "max_memory_mib",
            "max_disk_mib",
        ] {
            assert!(v.get(absent).is_none(), "{absent} written: {v}");
        }
        assert_eq!(v["listen"], "0.0.0.0:7777");
        let c = Config {
            listen: "127.0.0.1:7000".parse().expect("addr"),
            api_token_file: Some("/t".into()),
            pools: vec![PoolConfig {
                net: Some("egress".into()),
                size: Some("large".into()),
                ..PoolConfig::warm("rt", 2)
            }],
            network: Some(NetworkConfig {
                uplink: Some("eno1".into()),
                cidr: Some("10.90.0.0/16".into()),
                ..NetworkConfig::default()
            }),
            max_vms: Some(8),
            ..Config::default()
        };
        let text = serde_json::to_string(&c).expect("ser");
        assert_eq!(serde_json::from_str::<Config>(&text).expect("round trip"), c);
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["pools"], json!([{"template": "rt", "net": "egress", "size": "large", "warm": 2}]));
        assert_eq!(v["network"], json!({"cidr": "10.90.0.0/16", "uplink": "eno1"}));
    }

    #[test]
    fn unknown_keys_are_refused_and_named() {
        let e = serde_json::from_str::<Config>(r#"{"warm":3}"#).expect_err("unknown key");
        assert!(e.to_string().contains("warm"), "{e}");
        let e = serde_json::from_str::<Config>(r#"{"network":{"mtu":1}}"#).expect_err("unknown network key");
        assert!(e.to_string().contains("mtu"), "{e}");
    }

    #[test]
    fn pool_targets() {
        let p = |v: serde_json::Value| serde_json::from_value::<PoolConfig>(v).expect("pool");
        assert_eq!(p(json!({"template": "base"})).target(), DEFAULT_WARM);
        assert_eq!(p(json!({"template": "base", "warm": 0})).target(), 0);
        assert_eq!(p(json!({"template": "base", "warm_max": 3})).target(), 0);
        assert_eq!(PoolConfig::warm("base", 2).target(), 2);
        assert_eq!(
            serde_json::to_string(&PoolConfig::warm("base", 2)).expect("ser"),
            r#"{"template":"base","warm":2}"#
        );
    }
}

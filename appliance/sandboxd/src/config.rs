//! The daemon's JSON config (`/etc/sandboxd/config.json` by default, `--config` overrides).
//!
//! ```json
//! {"listen": "0.0.0.0:7777", "data_dir": "/var/lib/sandboxd", "api_token_file": "/etc/sandboxd/token",
//!  "advertise_addr": "10.0.0.5:7777", "pools": [{"template": "base", "net": "none", "size": "small", "warm": 4}],
//!  "refill_concurrency": 0, "sync_claims": false, "boot_timeout_secs": 90, "clone": true}
//! ```
//!
//! Unknown keys are refused; every error names the key (parse, then validate).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::pool::{KeyError, PoolKey};

/// Default config file.
pub const DEFAULT_PATH: &str = "/etc/sandboxd/config.json";
/// Default warm target of a pool that gives none.
pub const DEFAULT_WARM: usize = 4;

/// Errors loading or validating the config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
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
    /// A pool asks for a lane this node cannot provide.
    #[error("config key pools[{index}].net: the egress lane is not available on this node")]
    Egress {
        /// Index in `pools`.
        index: usize,
    },
    /// The token file could not be read or is empty.
    #[error("config key api_token_file: {path}: {reason}")]
    Token {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

/// One pool as configured (config file, `PUT /v1/pools`, `pools.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Warm target (default 4 when both `warm` and `warm_max` are absent, else 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<usize>,
    /// Adaptive ceiling (accepted; this node keeps `max(warm, …)` = `warm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_max: Option<usize>,
    /// Advanced: accepted and ignored (hibernation is not implemented on this node).
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
    /// The validated key.
    pub fn key(&self) -> Result<PoolKey, KeyError> {
        PoolKey::parse(&self.template, self.net.as_deref(), self.size.as_deref())
    }

    /// The warm target.
    pub fn target(&self) -> usize {
        match (self.warm, self.warm_max) {
            (Some(w), _) => w,
            (None, Some(_)) => 0,
            (None, None) => DEFAULT_WARM,
        }
    }
}

/// Validates a pool list: keys parse, no duplicates, no egress. Returns `(key, target)` pairs.
pub fn validate_pools(pools: &[PoolConfig]) -> Result<Vec<(PoolKey, usize)>, ConfigError> {
    let mut out: Vec<(PoolKey, usize)> = Vec::with_capacity(pools.len());
    for (index, p) in pools.iter().enumerate() {
        let key = p.key().map_err(|source| ConfigError::Pool { index, source })?;
        if key.net() == crate::pool::Net::Egress {
            return Err(ConfigError::Egress { index });
        }
        if out.iter().any(|(k, _)| *k == key) {
            return Err(ConfigError::DuplicatePool { index, key: key.to_string() });
        }
        out.push((key, p.target()));
    }
    Ok(out)
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 7777))
}
fn default_data_dir() -> PathBuf {
    PathBuf::from("/var/lib/sandboxd")
}
fn default_boot_timeout() -> u64 {
    90
}
fn default_true() -> bool {
    true
}

/// The daemon config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listen address (default `0.0.0.0:7777`).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Journal, pool overrides and goldens (default `/var/lib/sandboxd`).
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// File holding the root API token (trimmed). Absent: node routes are open.
    #[serde(default)]
    pub api_token_file: Option<PathBuf>,
    /// `host:port` clients should use for sandbox-scoped calls (`owner_addr`).
    #[serde(default)]
    pub advertise_addr: Option<String>,
    /// Warm pools (`pools.json` from `PUT /v1/pools` overrides these).
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// Concurrent refills; 0 = NumCPU×2/3 clamped to [1, 256].
    #[serde(default)]
    pub refill_concurrency: usize,
    /// `fdatasync` each claims-log append before the reply (survives power loss, not only
    /// `kill -9`; the `claims.json` snapshot is always fsynced).
    #[serde(default)]
    pub sync_claims: bool,
    /// How long a cold boot may take to answer silkd `info`.
    #[serde(default = "default_boot_timeout")]
    pub boot_timeout_secs: u64,
    /// Fill pools by cloning a golden snapshot (else cold boots only).
    #[serde(default = "default_true")]
    pub clone: bool,
    /// The built-image catalog (default `$CHRYSALIS_CACHE/images/catalog.json`).
    #[serde(default)]
    pub catalog: Option<PathBuf>,
    /// The VM driver's state dir (default `<data_dir>/vms`).
    #[serde(default)]
    pub vm_state_dir: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        // An empty object takes every default; this cannot fail.
        #[allow(clippy::unwrap_used)]
        serde_json::from_str("{}").unwrap()
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(path, &bytes)
    }

    /// Parses and validates config bytes (`path` only names the source in errors).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, ConfigError> {
        let c: Config =
            serde_json::from_slice(bytes).map_err(|source| ConfigError::Parse { path: path.to_path_buf(), source })?;
        validate_pools(&c.pools)?;
        Ok(c)
    }

    /// The effective refill concurrency.
    pub fn refill_limit(&self) -> usize {
        if self.refill_concurrency > 0 {
            return self.refill_concurrency.min(256);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus * 2 / 3).clamp(1, 256)
    }

    /// Reads the root token, if a token file is configured.
    pub fn api_token(&self) -> Result<Option<String>, ConfigError> {
        let Some(path) = &self.api_token_file else {
            return Ok(None);
        };
        let raw = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Token { path: path.clone(), reason: e.to_string() })?;
        let t = raw.trim();
        if t.is_empty() {
            return Err(ConfigError::Token { path: path.clone(), reason: "the file is empty".into() });
        }
        Ok(Some(t.to_string()))
    }

    /// The driver state dir.
    pub fn vm_state_dir(&self) -> PathBuf {
        self.vm_state_dir.clone().unwrap_or_else(|| self.data_dir.join("vms"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let c = parse(r#"{"pools":[{"template":"base"},{"template":"rt","warm":0},{"template":"x","warm_max":3}]}"#)
            .expect("ok");
        let targets: Vec<usize> = c.pools.iter().map(PoolConfig::target).collect();
        assert_eq!(targets, vec![4, 0, 0]);
    }

    #[test]
    fn token_file_is_trimmed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("token");
        std::fs::write(&p, "  s3cret\n").expect("write");
        let c = Config { api_token_file: Some(p.clone()), ..Config::default() };
        assert_eq!(c.api_token().expect("token").as_deref(), Some("s3cret"));
        std::fs::write(&p, "\n").expect("write");
        assert!(matches!(c.api_token(), Err(ConfigError::Token { .. })));
        assert_eq!(Config::default().api_token().expect("none"), None);
    }
}

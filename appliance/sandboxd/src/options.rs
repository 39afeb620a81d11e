//! What a node is built from: [`NodeOptions`] (from the config file, or minimal ones for tests
//! and tools) and its [`Timing`]s.

use std::path::PathBuf;
use std::time::Duration;

use vmm::Catalog;

use crate::config::{Config, ConfigError, PoolConfig};
use crate::limits::{Budget, Limits};

/// Timings (production defaults; tests shorten them).
#[derive(Debug, Clone)]
pub struct Timing {
    /// Refill ticker.
    pub tick: Duration,
    /// Reaper period (≤ 5 s).
    pub reap: Duration,
    /// Probe budget of a clone.
    pub clone_probe: Duration,
    /// Probe budget of a cold boot (also the golden builder).
    pub cold_probe: Duration,
    /// Wait before retrying a failed golden build.
    pub golden_retry: Duration,
    /// Wait before retrying a failed reconcile (`list` error).
    pub reconcile_retry: Duration,
    /// How long a pool parks on a condition retrying cannot fix (template missing).
    pub park: Duration,
    /// After the guest closes a relay, how long the client may still send.
    pub relay_drain: Duration,
    /// Period of the snapshot gc (expired checkpoints, snapshots nothing uses).
    pub snapshot_gc: Duration,
    /// Period of the idle check of pools with `idle_hibernate_seconds`.
    pub idle_check: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            tick: Duration::from_secs(2),
            reap: Duration::from_secs(1),
            clone_probe: Duration::from_secs(5),
            cold_probe: Duration::from_secs(90),
            golden_retry: Duration::from_secs(30),
            reconcile_retry: Duration::from_secs(5),
            park: Duration::from_secs(30),
            relay_drain: Duration::from_secs(30),
            snapshot_gc: Duration::from_secs(60),
            idle_check: Duration::from_secs(2),
        }
    }
}

/// Everything a node is built from.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Journal, pool overrides, goldens.
    pub data_dir: PathBuf,
    /// Pools from the config file (`pools.json` overrides).
    pub pools: Vec<PoolConfig>,
    /// Root API token; `None` leaves node routes open.
    pub api_token: Option<String>,
    /// `owner_addr` in replies (empty: clients use the address they dialled).
    pub advertise_addr: String,
    /// Concurrent refills.
    pub refill_concurrency: usize,
    /// `fdatasync` every claims-log append before replying.
    pub sync_claims: bool,
    /// Fill by cloning a golden snapshot.
    pub clone: bool,
    /// Templates this node can boot.
    pub catalog: Catalog,
    /// Timings.
    pub timing: Timing,
    /// Budget, lease horizon, per-claim caps, exec timeouts, HTTP limits.
    pub limits: Limits,
    /// Per-VM networking of `net: egress` pools (the config's `network` section); `None`: no
    /// VM gets a NIC and egress is refused.
    pub network: Option<vmnet::NetConfig>,
    /// Preview URLs (`preview_listen`), if configured.
    pub previews: Option<crate::preview::Previews>,
    /// Volumes to make at start when missing (config key `volumes`).
    pub volumes: Vec<sandboxd_api::VolumeConfig>,
}

impl NodeOptions {
    /// Options from a loaded config (reads the token file).
    pub fn from_config(c: &Config, catalog: Catalog) -> Result<Self, ConfigError> {
        let advertise_addr = c.advertise_addr.clone().unwrap_or_else(|| {
            if c.listen.ip().is_unspecified() {
                String::new()
            } else {
                c.listen.to_string()
            }
        });
        Ok(NodeOptions {
            data_dir: c.data_dir.clone(),
            pools: c.pools.clone(),
            api_token: c.api_token()?,
            advertise_addr,
            refill_concurrency: c.refill_limit(),
            sync_claims: c.sync_claims,
            clone: c.clone,
            catalog,
            timing: Timing { cold_probe: Duration::from_secs(c.boot_timeout_secs.max(1)), ..Timing::default() },
            limits: c.limits()?,
            network: c.net_config()?,
            previews: match c.preview_listen {
                Some(addr) => Some(
                    crate::preview::Previews::open(
                        &c.data_dir,
                        c.preview_url.clone().unwrap_or_else(|| format!("http://{addr}")),
                    )
                    .map_err(|source| ConfigError::Preview {
                        path: c.data_dir.join(crate::preview::KEY_FILE),
                        source,
                    })?,
                ),
                None => None,
            },
            volumes: c.volumes.clone(),
        })
    }

    /// Minimal options for tests and tools: no token, no pools, default limits with a fixed
    /// budget of [`NodeOptions::TEST_BUDGET`] (the daemon derives its budget from the host).
    pub fn new(data_dir: impl Into<PathBuf>, catalog: Catalog) -> Self {
        NodeOptions {
            data_dir: data_dir.into(),
            pools: Vec::new(),
            api_token: None,
            advertise_addr: String::new(),
            refill_concurrency: 4,
            sync_claims: false,
            clone: true,
            catalog,
            timing: Timing::default(),
            limits: Limits::with_budget(Self::TEST_BUDGET),
            network: None,
            previews: None,
            volumes: Vec::new(),
        }
    }

    /// The budget of [`NodeOptions::new`]: 64 VMs, 32 GiB.
    pub const TEST_BUDGET: Budget = Budget { max_vms: 64, max_memory_mib: 32 * 1024, max_disk_mib: 1 << 20 };
}

//! [`ProviderConfig`]: the intervals and inputs of a [`super::SandboxProvider`].

use std::path::PathBuf;
use std::time::Duration;

/// Intervals and inputs of a [`crate::SandboxProvider`].
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    /// The claims state file.
    pub state_path: PathBuf,
    /// The pod IP when a claim's `owner_addr` is empty (host of the sandboxd advertise address).
    pub fallback_host: String,
    /// Quarantine verification period.
    pub verify_interval: Duration,
    /// Lease watch period.
    pub lease_interval: Duration,
    /// First owner recheck delay (doubles per preserve verdict).
    pub recheck_base: Duration,
    /// Owner recheck backoff cap.
    pub recheck_max: Duration,
    /// Orphan scan period (zero = off).
    pub orphan_scan_interval: Duration,
}

impl ProviderConfig {
    /// The spec's intervals: verify 15 s, lease 30 s, recheck 10 s → 10 min, orphan scan 60 s.
    pub fn new(state_path: PathBuf, fallback_host: String) -> ProviderConfig {
        ProviderConfig {
            state_path,
            fallback_host,
            verify_interval: Duration::from_secs(15),
            lease_interval: Duration::from_secs(30),
            recheck_base: Duration::from_secs(10),
            recheck_max: Duration::from_secs(600),
            orphan_scan_interval: Duration::from_secs(60),
        }
    }
}

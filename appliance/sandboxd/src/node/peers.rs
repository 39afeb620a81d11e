//! The other boxes of the cluster (issue #19): what the node's provider pushes with
//! `PUT /v1/peers` ([`PeerReport`], read from the boxes' `NodeInventory` objects), kept until
//! the report's `ttl_seconds` run out, so that a provider that stops pushing leaves the node
//! alone again rather than redirecting on old news.
//!
//! * `GET /v1/peers` and `/v1/info`'s `peers`: the addresses of the report (none when it ran
//!   out, or on a box that never got one: "a box that is alone answers as today").
//! * A **redirect** ([`Node::redirect_for`]): a claim (without `no_redirect`) whose pool has no
//!   warm VM here is answered `200 {"redirect": [≤ 2 addresses]}`: the peers whose same pool
//!   had warm VMs, most first, as `docs/sandboxd.md` §5.3 and SDK 0.1.19 expect (the SDK resends
//!   the claim there with `no_redirect: true`, then here once if they all fail). No such peer:
//!   the claim is served here as before (a VM made on demand).
//!
//! The node's own advertised address is never a peer. A redirected claim is authenticated by
//! the peer with the same bearer token: the boxes of one fleet share the node token.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sandboxd_api::PeerReport;

use super::Node;
use crate::pool::PoolKey;

/// Most peers one redirect names (`docs/sandboxd.md` §5.3).
pub const MAX_REDIRECT: usize = 2;

/// One peer as the node keeps it: its pools' keys parsed once when the report is taken.
#[derive(Debug)]
pub(crate) struct Peer {
    addr: String,
    /// Warm VMs per pool (a key listed twice counts once: the larger count).
    warm: HashMap<PoolKey, usize>,
    /// When this peer runs out: the report's ttl, or sooner when the provider said so
    /// ([`sandboxd_api::PeerBox::ttl_seconds`], a peer already near staleness).
    until: Instant,
}

/// The last report.
#[derive(Debug, Default)]
pub(crate) struct PeerTable {
    peers: Vec<Peer>,
}

impl PeerTable {
    fn fresh(&self, now: Instant) -> impl Iterator<Item = &Peer> {
        self.peers.iter().filter(move |p| now < p.until)
    }
}

/// A report that cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// `ttl_seconds` of 0.
    #[error("ttl_seconds must be at least 1")]
    NoTtl,
    /// A peer without an address, or with a pool key that is not one.
    #[error("peer {index}: {why}")]
    Bad {
        /// Its position in `peers`.
        index: usize,
        /// What is wrong.
        why: String,
    },
}

/// Reports longer than this are refused (a fleet is tens of boxes).
pub const MAX_PEERS: usize = 1024;
/// Pools one peer may list (a box serves a handful).
pub const MAX_PEER_POOLS: usize = 256;
/// Longest address taken.
pub const MAX_ADDR_LEN: usize = 512;
/// Longest a report holds, whatever its `ttl_seconds`.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

impl Node {
    /// Replaces the peer table with `report` (see the module docs).
    pub fn set_peers(&self, report: PeerReport) -> Result<usize, PeerError> {
        if report.ttl_seconds == 0 {
            return Err(PeerError::NoTtl);
        }
        if report.peers.len() > MAX_PEERS {
            return Err(PeerError::Bad { index: MAX_PEERS, why: format!("more than {MAX_PEERS} peers") });
        }
        let now = Instant::now();
        let ttl = Duration::from_secs(report.ttl_seconds).min(MAX_TTL);
        let own = self.advertise_addr().trim().to_owned();
        let mut peers = Vec::with_capacity(report.peers.len());
        for (index, p) in report.peers.into_iter().enumerate() {
            let addr = p.addr.trim();
            if addr.is_empty() || addr.len() > MAX_ADDR_LEN || addr.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(PeerError::Bad {
                    index,
                    why: format!("address {:?} is not host:port or an origin", p.addr),
                });
            }
            if p.pools.len() > MAX_PEER_POOLS {
                return Err(PeerError::Bad { index, why: format!("more than {MAX_PEER_POOLS} pools") });
            }
            let mut warm = HashMap::with_capacity(p.pools.len());
            for pool in &p.pools {
                let k = &pool.key;
                let key = PoolKey::parse(&k.template, Some(&k.net), Some(&k.size))
                    .map_err(|e| PeerError::Bad { index, why: format!("pool key: {e}") })?;
                let w = warm.entry(key).or_insert(0);
                *w = pool.warm.max(*w);
            }
            if !own.is_empty() && addr == own {
                continue;
            }
            let ttl = p.ttl_seconds.map_or(ttl, |s| ttl.min(Duration::from_secs(s)));
            peers.push(Peer { addr: addr.to_owned(), warm, until: now + ttl });
        }
        let n = peers.len();
        *lock(&self.peers) = PeerTable { peers };
        Ok(n)
    }

    /// The peers' addresses (none once the last report ran out).
    pub fn peer_addrs(&self) -> Vec<String> {
        lock(&self.peers).fresh(Instant::now()).map(|p| p.addr.clone()).collect()
    }

    /// Where a claim for `key` goes instead of here: empty when this node has a warm VM for
    /// it, or no peer had one.
    pub fn redirect_for(&self, key: &PoolKey) -> Vec<String> {
        let Ok(key) = self.pool_key_for(key) else { return Vec::new() };
        if self.pool(&key).is_some_and(|p| p.info().warm > 0) {
            return Vec::new();
        }
        let table = lock(&self.peers);
        let mut warm: Vec<(usize, &str)> = table
            .fresh(Instant::now())
            .filter_map(|p| p.warm.get(&key).filter(|w| **w > 0).map(|w| (*w, p.addr.as_str())))
            .collect();
        warm.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        warm.into_iter().take(MAX_REDIRECT).map(|(_, a)| a.to_owned()).collect()
    }
}

fn lock(m: &Mutex<PeerTable>) -> std::sync::MutexGuard<'_, PeerTable> {
    // Replaced whole under the lock: a poisoned one still holds a whole table.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

//! sandboxd: a warm pool of pre-booted microVMs behind the sandboxd HTTP API
//! (the sandboxd contract, `docs/sandboxd.md` §0–§8), wire-compatible with the public
//! Python SDK. The bodies of that API and the config file's schema are types of their own
//! crate, [`sandboxd_api`], shared with its clients.
//!
//! Modules, lowest first: each uses only modules listed before it (no import circles).
//! - [`pool`]: pool keys, per-pool state and the pool registry (imports nothing of sandboxd);
//! - [`limits`]: the node budget and its ledger, the lease horizon, per-claim caps, exec and
//!   HTTP limits;
//! - [`golden`]: golden snapshots on disk (staging, install, load);
//! - [`metrics`]: counters and the claim-latency histogram, rendered for `/metrics`;
//! - [`config`]: the JSON config file (and the fail-closed start-up checks);
//! - [`options`]: what a node is built from (`NodeOptions`, `Timing`);
//! - [`journal`]: the claims journal (append-only `claims.log` + atomic `claims.json` snapshot)
//!   and `pools.json`; it reads records through [`journal::ClaimLog`], not the claim table;
//! - [`claims`]: the claim table, lease rules, id/token minting;
//! - [`store`]: the claim table and its journal together (commit, compaction);
//! - [`vms`]: what VMs run on (driver, VM network, budget ledger) and how they end (destroy);
//! - [`volumes`]: the volume catalog (ext4 images under `<data_dir>/volumes`);
//! - [`refill`]: the refill task of each pool over its own context ([`refill::Refill`]);
//! - [`reaper`]: ends expired leases, compacts the journal;
//! - [`reconcile`]: the restart reconcile;
//! - [`node`]: the facade every handler calls (claim, release, renew, drain, pools, info);
//! - [`http`]: the axum router, auth, relays (`/agent`, `/ports`) and `/exec`;
//! - `test_utils` (`cfg(test)` or feature `test-utils`, never in release builds): a fake driver
//!   whose VMs run an in-process silkd stand-in.

#![forbid(unsafe_code)]

pub mod claims;
pub mod config;
pub mod golden;
pub mod guest_memory;
pub mod http;
pub mod journal;
pub mod limits;
pub mod metrics;
pub mod node;
pub mod options;
pub mod pool;
pub mod preview;
pub mod promoted;
pub mod reaper;
pub mod reconcile;
pub mod refill;
pub mod slots;
pub mod snapshots;
pub mod store;
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;
pub mod vms;
pub mod volumes;

pub use config::Config;
pub use node::{Node, NodeOptions};

//! sandboxd: a warm pool of pre-booted microVMs behind the sandboxd HTTP API
//! (the sandboxd contract, `shared/spec/sandboxd.md` §0–§8), wire-compatible with the public
//! Python SDK. The bodies of that API and the config file's schema are types of their own
//! crate, [`sandboxd_api`], shared with its clients.
//!
//! - [`config`]: the JSON config file, parsed and validated (and the fail-closed start-up
//!   checks);
//! - [`limits`]: the node budget and its ledger, the lease horizon, per-claim caps, exec and
//!   HTTP limits;
//! - [`pool`]: pool keys, pool state and the refill task;
//! - [`claims`]: the claim table, lease rules, id/token minting;
//! - [`journal`]: the claims journal (append-only `claims.log` + atomic `claims.json` snapshot)
//!   and `pools.json`;
//! - [`node`]: the controller every handler calls (claim, release, renew, drain, reconcile);
//! - [`http`]: the axum router, auth, relays (`/agent`, `/ports`) and `/exec`;
//! - [`metrics`]: counters for `/metrics`;
//! - `test_utils` (`cfg(test)` or feature `test-utils`, never in release builds): a fake driver
//!   whose VMs run an in-process silkd stand-in.

#![forbid(unsafe_code)]

pub mod claims;
pub mod config;
pub mod http;
pub mod journal;
pub mod limits;
pub mod metrics;
pub mod node;
pub mod pool;
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;

pub use config::Config;
pub use node::{Node, NodeOptions};

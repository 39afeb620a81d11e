//! sandboxd's contracts as types: the bodies of its HTTP API (`docs/sandboxd.md` §4–§7)
//! and the schema of its JSON config ([`config`]). sandboxd serves and reads them; vk-sandbox
//! (its client), the supervisor (which writes sandboxd's config and reads `GET /v1/info`),
//! xtask and the test harness build and parse them through the same types, never through
//! hand-written JSON.
//!
//! - [`claim`]: `POST /v1/claim` ([`ClaimRequest`] → [`Grant`], or [`ClaimReply`] for a client
//!   that may be redirected) and `POST …/renew` ([`RenewRequest`] → [`Renewed`]);
//! - [`sandbox`]: listings ([`SandboxList`] of [`SandboxRow`]), `…/owner` ([`Owner`]),
//!   `…/stats` ([`Stats`]);
//! - [`info`]: `GET /v1/info` and the drain routes ([`Info`], [`PoolInfo`], [`BudgetInfo`],
//!   the wire [`Key`]), `GET/PUT /v1/pools` ([`PoolList`]), `GET /v1/peers` ([`Peers`]);
//! - [`volume`]: `GET /v1/volumes` ([`VolumeCatalog`]) and `…/volumes` ([`SandboxVolumes`],
//!   [`VolumesPut`], [`VolumesPatch`]);
//! - [`exec`]: `POST …/exec` ([`ExecRequest`] → [`ExecResult`]);
//! - [`error`]: every refusal, [`ErrorBody`] (`{"error": "<message>"}`);
//! - [`config`]: the config file ([`Config`], [`PoolConfig`], [`NetworkConfig`]) and its
//!   defaults.
//!
//! Wire rules, which the public Python SDK (`cocoonstack-sandbox` 0.1.19) relies on:
//! - optional fields are omitted when absent, never written as `null`;
//! - request bodies accept unknown fields (the SDK and vk-sandbox send more than a node without
//!   the advanced features reads), except the two strict ones: [`PoolList`] (`PUT /v1/pools`)
//!   and [`ExecRequest`];
//! - response bodies decode leniently (a missing field takes its default), so a client reads
//!   an older or newer sandboxd.
//!
//! No IO and no validation beyond the shape: sandboxd validates what it reads (pool keys,
//! TTLs, limits) and names the key and the fix when it refuses.

#![forbid(unsafe_code)]

pub mod branch;
pub mod claim;
pub mod config;
pub mod error;
pub mod exec;
pub mod info;
pub mod sandbox;
pub mod volume;

pub use branch::{
    Checkpoint, CheckpointClaimRequest, CheckpointList, CheckpointReply, CheckpointRequest, ForkReply, ForkRequest,
    PromoteReply, PromoteRequest,
};
pub use claim::{ClaimReply, ClaimRequest, Grant, RenewRequest, Renewed};
pub use config::{Config, NetworkConfig, PoolConfig, VolumeConfig};
pub use error::ErrorBody;
pub use exec::{ExecRequest, ExecResult};
pub use info::{BudgetInfo, Info, Key, PeerBox, PeerPool, PeerReport, Peers, PoolInfo, PoolList};
pub use sandbox::{Owner, SandboxList, SandboxRow, Stats};
pub use volume::{CatalogVolume, SandboxVolumes, VolumeCatalog, VolumeSpec, VolumeState, VolumesPatch, VolumesPut};

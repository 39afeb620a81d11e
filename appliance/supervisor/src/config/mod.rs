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
//!
//! # Modules
//! * [`model`]: the typed tables ([`Config`] and one struct per table) and [`DEFAULT_TOML`];
//! * [`layers`]: the four sources, parsing, merging with [`Provenance`], decoding ([`load`]);
//! * [`validate`]: [`Config::validate`] → [`Settings`], over the rules of [`rules`];
//! * [`error`]: [`ConfigError`] and [`Issue`].
//!
//! The cluster keys are checked with `join`'s own types (`BootstrapToken`, `CaHash`), so the
//! configuration accepts exactly what the virtual nodes' join will; namespace names with
//! `images::valid_namespace`, the rule vk-cocoon applies to the owners of its VMs and snapshots.

pub mod error;
pub mod layers;
pub mod model;
pub mod rules;
pub mod validate;

pub use error::{ConfigError, Issue, Source};
pub use layers::{
    cmdline_args, from_layers, load, load_files, merge, parse_cmdline, parse_layer, read_layer, Layer, Loaded,
    Provenance, SourcePaths, SourceReport, BAKED_PATH, CMDLINE_PATH, CMDLINE_PREFIX, CONFIG_DISK_PATH, ESP_PATH,
};
pub use model::{
    ClusterConfig, CocoonConfig, Config, NodeConfig, OfflinePolicy, PoolConfig, SandboxdConfig, SandboxdNetwork,
    SupervisorConfig, UpdateConfig, DEFAULT_CATALOG, DEFAULT_TOML, SANDBOXD_TAP_PREFIX, SANDBOXD_VM_BRIDGE,
    SANDBOXD_VM_CIDR, VK_COCOON_VM_BRIDGE, VK_COCOON_VM_CIDR,
};
pub use rules::{valid_label_value, valid_node_name, valid_tls_name};
pub use validate::{hostname, Settings, ValidateEnv};

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests;

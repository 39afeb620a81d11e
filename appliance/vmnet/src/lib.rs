//! VM networking for vk-cocoon: one host bridge, one persistent TAP per VM, and an IP/MAC lease
//! table (IPAM) persisted as JSON.
//!
//! - [`config`]: [`NetConfig`] (bridge name, IPv4 range, optional test netns, lease file);
//! - [`ipam`]: a [`Lease`] per VM (`ip`, deterministic locally-administered [`Mac`], TAP name `ct-<hash>`)
//!   in a JSON file written atomically under an advisory lock;
//! - [`netns`]: run code inside a named network namespace (`/run/netns/<name>`) on a dedicated thread;
//! - [`link`]: the bridge and link operations over rtnetlink;
//! - [`filter`]: the nftables tables `bridge chrysalis` and `inet chrysalis` (anti-spoofing,
//!   VM↔VM, VM→host, egress with NAT), rendered from the leases;
//! - [`tap`]: persistent TAP devices (`TUNSETIFF` + `TUNSETPERSIST` on `/dev/net/tun`);
//! - [`network`]: [`Network`], the API the provider calls.
//!
//! The gateway (first host of the range) is the bridge's address; a VM's address is written to its
//! Pod as the pod IP and is reachable from the host (or from inside the netns, in tests) over the
//! bridge's connected route. QEMU opens the TAP by name (`-netdev tap,ifname=<tap>,script=no`),
//! inside the same netns.

pub mod config;
pub mod filter;
pub mod ipam;
pub mod link;
pub mod netns;
pub mod network;
pub mod tap;

use std::path::PathBuf;

pub use config::NetConfig;
pub use filter::{FilterError, FilterPolicy};
pub use ipam::{Lease, Mac, VmPolicy};
pub use ipnet::Ipv4Net;
pub use network::Network;

/// Where guest-init is inside every guest (base and rt), for the clone network fixup.
pub const GUEST_INIT: &str = "/.chrysalis/guest-init";

/// Every failure of this crate.
#[derive(Debug, thiserror::Error)]
pub enum VmnetError {
    /// The configuration or an argument is unusable.
    #[error("invalid network configuration: {0}")]
    Config(String),
    /// Every address of the range is leased.
    #[error("no free address left in {cidr} ({leased} leased)")]
    Exhausted {
        /// The range.
        cidr: Ipv4Net,
        /// How many leases it holds.
        leased: usize,
    },
    /// A file operation failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The lease file is not valid JSON of the expected shape.
    #[error("lease file {} is corrupt", path.display())]
    LeaseFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// Entering a network namespace failed.
    #[error("network namespace {name}: {what}")]
    Netns {
        /// The namespace name.
        name: String,
        /// What failed.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening a netlink socket failed.
    #[error("opening a netlink socket")]
    NetlinkSocket(#[source] std::io::Error),
    /// A netlink request failed.
    #[error("netlink: {what}")]
    Netlink {
        /// What we asked for, naming the link.
        what: String,
        /// The cause.
        #[source]
        source: rtnetlink::Error,
    },
    /// A TAP ioctl failed.
    #[error("tap {name}: {op}")]
    Tap {
        /// The TAP name.
        name: String,
        /// The operation.
        op: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The packet filter's configuration is unusable, or `nft` refused it.
    #[error("VM packet filter")]
    Filter(#[from] FilterError),
    /// The worker thread of a namespaced operation could not run it to the end.
    #[error("namespace worker: {0}")]
    Worker(String),
}

impl VmnetError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        VmnetError::Io { what, path: path.into(), source }
    }
}

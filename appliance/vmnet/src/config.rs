//! [`NetConfig`]: which bridge, which IPv4 range, which netns, which lease file.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::VmnetError;

/// The default bridge name.
pub const DEFAULT_BRIDGE: &str = "chrysalis0";
/// The default VM address range (vk-cocoon's `VK_VM_CIDR`).
pub const DEFAULT_CIDR: &str = "10.88.0.0/24";

/// sandboxd's network, the second owner beside vk-cocoon in one namespace: its bridge, range,
/// nft tables and TAP prefix, which must differ from the defaults above (the supervisor checks
/// the bridge and range against vk-cocoon's).
pub const SANDBOXD_BRIDGE: &str = "chrysalis1";
/// sandboxd's default VM address range.
pub const SANDBOXD_CIDR: &str = "10.89.0.0/24";
/// sandboxd's nft tables (`bridge chrysalis_sbx`, `inet chrysalis_sbx`).
pub const SANDBOXD_TABLE: &str = "chrysalis_sbx";
/// sandboxd's TAP names (vk-cocoon's are `ct-*`).
pub const SANDBOXD_TAP_PREFIX: &str = "sb-";

/// The default name of the two nft tables ([`NetConfig::table`]).
pub const DEFAULT_TABLE: &str = "chrysalis";

/// Network configuration of one host (or one test netns).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// Bridge every TAP is enslaved to (default [`DEFAULT_BRIDGE`]).
    #[serde(default = "default_bridge")]
    pub bridge: String,
    /// The VM address range, e.g. `10.88.0.0/24`; its first host is the gateway (the bridge's
    /// address); the network and broadcast addresses are never leased. Prefix length ≤ 30.
    pub cidr: Ipv4Net,
    /// A named network namespace (`/run/netns/<name>`) holding the bridge and TAPs; `None` = the
    /// caller's own namespace (production). Tests always set it.
    #[serde(default)]
    pub netns: Option<String>,
    /// The JSON lease file (written 0600, atomically).
    pub leases_path: PathBuf,
    /// What VMs may reach beyond their own lease (default: nothing; see [`crate::filter`]).
    #[serde(default)]
    pub filter: FilterPolicy,
    /// The name of this network's two nft tables (`bridge <table>`, `inet <table>`; default
    /// [`DEFAULT_TABLE`]): two owners in one netns (vk-cocoon, sandboxd) each own their own pair.
    /// `[a-z][a-z0-9_]{0,31}`.
    #[serde(default = "default_table")]
    pub table: String,
    /// The prefix of this network's TAP names (default [`crate::ipam::TAP_PREFIX`], `ct-`); the
    /// bridge table filters every port named `<prefix>*`, so two owners in one netns must use
    /// different prefixes. 1-3 characters `[a-z0-9-]`, starting with a letter.
    #[serde(default = "default_tap_prefix")]
    pub tap_prefix: String,
}

fn default_bridge() -> String {
    DEFAULT_BRIDGE.to_string()
}

fn default_table() -> String {
    DEFAULT_TABLE.to_string()
}

fn default_tap_prefix() -> String {
    TAP_PREFIX.to_string()
}

/// True for a usable nft table name of ours: `[a-z][a-z0-9_]{0,31}`.
pub fn valid_table(name: &str) -> bool {
    let mut b = name.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_lowercase())
        && name.len() <= 32
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
}

/// True for a usable TAP name prefix: 1-3 characters `[a-z0-9-]`, starting with a letter (the
/// prefix + 12 hex digits must fit an interface name).
pub fn valid_tap_prefix(p: &str) -> bool {
    let mut b = p.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_lowercase())
        && p.len() <= 3
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// True for a usable Linux interface name (1..=15 bytes, no `/`, whitespace, `:` or NUL), that
/// is also safe inside an nft string (no `"`, `\\` or `*`).
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() < libc::IFNAMSIZ
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_graphic() && !b"/:,\"\\*".contains(&b))
}

/// True for a usable netns name (a file name under `/run/netns`).
pub fn valid_netns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

impl NetConfig {
    /// A config for `cidr` with the default bridge, no netns.
    pub fn new(cidr: Ipv4Net, leases_path: impl Into<PathBuf>) -> Self {
        NetConfig {
            bridge: default_bridge(),
            cidr: cidr.trunc(),
            netns: None,
            leases_path: leases_path.into(),
            filter: FilterPolicy::default(),
            table: default_table(),
            tap_prefix: default_tap_prefix(),
        }
    }

    /// The gateway: the range's first host, assigned to the bridge.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.cidr.network()).wrapping_add(1))
    }

    /// The prefix length of the range.
    pub fn prefix_len(&self) -> u8 {
        self.cidr.prefix_len()
    }

    /// Checks the names and the range.
    pub fn validate(&self) -> Result<(), VmnetError> {
        if !valid_ifname(&self.bridge) {
            return Err(VmnetError::Config(format!("bridge name {:?} is not a valid interface name", self.bridge)));
        }
        if self.cidr.prefix_len() > 30 {
            return Err(VmnetError::Config(format!(
                "range {} is too small: a gateway and at least one VM need a /30 or larger",
                self.cidr
            )));
        }
        if self.cidr != self.cidr.trunc() {
            return Err(VmnetError::Config(format!(
                "range {} has host bits set (did you mean {}?)",
                self.cidr,
                self.cidr.trunc()
            )));
        }
        if let Some(ns) = &self.netns {
            if !valid_netns_name(ns) {
                return Err(VmnetError::Config(format!("netns name {ns:?} is not a plain name under /run/netns")));
            }
        }
        self.filter.validate()?;
        if !valid_table(&self.table) {
            return Err(VmnetError::Config(format!("nft table name {:?} is not [a-z][a-z0-9_]{{0,31}}", self.table)));
        }
        if !valid_tap_prefix(&self.tap_prefix) {
            return Err(VmnetError::Config(format!(
                "tap prefix {:?} is not 1-3 characters [a-z0-9-] starting with a letter",
                self.tap_prefix
            )));
        }
        if let Some(up) = self.filter.uplink.as_deref().filter(|u| u.starts_with(&self.tap_prefix)) {
            return Err(crate::FilterError::Uplink(up.to_owned()).into());
        }
        if self.leases_path.file_name().is_none() {
            return Err(VmnetError::Config(format!("lease file {} has no file name", self.leases_path.display())));
        }
        Ok(())
    }
}

/// Prefix of every TAP name this crate makes (the default [`NetConfig::tap_prefix`]).
pub const TAP_PREFIX: &str = "ct-";

/// A transport protocol of the allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// One host service VMs may reach at their gateway: `tcp/PORT` or `udp/PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HostPort {
    /// The protocol.
    pub proto: Proto,
    /// The port (1-65535).
    pub port: u16,
}

/// What the node lets its VMs reach (see the module doc). Default: nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterPolicy {
    /// Host services VMs may reach at their gateway (`VK_NET_HOST_ALLOW`).
    #[serde(default)]
    pub host_allow: Vec<HostPort>,
    /// The interface egress traffic leaves by, masqueraded (`VK_NET_UPLINK`); `None`: no VM has
    /// a route out.
    #[serde(default)]
    pub uplink: Option<String>,
    /// Destinations refused on top of [`crate::filter::ALWAYS_REFUSED`] (`VK_NET_REFUSE`).
    #[serde(default)]
    pub refuse: Vec<Ipv4Net>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(cidr: &str) -> NetConfig {
        NetConfig::new(cidr.parse().expect("cidr"), "/tmp/l.json")
    }

    #[test]
    fn gateway_is_first_host() {
        let c = cfg("10.88.0.0/24");
        assert_eq!(c.gateway(), Ipv4Addr::new(10, 88, 0, 1));
        assert_eq!(c.prefix_len(), 24);
        assert_eq!(c.bridge, "chrysalis0");
        c.validate().expect("valid");
    }

    #[test]
    fn validation() {
        assert!(cfg("10.88.0.0/31").validate().is_err());
        assert!(cfg("10.88.0.0/30").validate().is_ok());
        let mut c = cfg("10.88.0.0/24");
        c.cidr = "10.88.0.5/24".parse().expect("cidr");
        assert!(c.validate().is_err(), "host bits set");
        let mut c = cfg("10.88.0.0/24");
        c.bridge = "a-bridge-name-too-long".into();
        assert!(c.validate().is_err());
        let mut c = cfg("10.88.0.0/24");
        c.netns = Some("../etc".into());
        assert!(c.validate().is_err());
        c.netns = Some("vmnet-test-1".into());
        assert!(c.validate().is_ok());
        let mut c = cfg("10.88.0.0/24");
        for bad in ["", "Chrysalis", "1abc", "a-b", "a b", &"a".repeat(33)] {
            c.table = bad.to_string();
            assert!(c.validate().is_err(), "table {bad:?}");
        }
        c.table = "chrysalis_sbx".into();
        assert!(c.validate().is_ok());
        for bad in ["", "-a", "abcd", "A-", "a/"] {
            c.tap_prefix = bad.to_string();
            assert!(c.validate().is_err(), "prefix {bad:?}");
        }
        c.tap_prefix = "sb-".into();
        c.filter.uplink = Some("sb-0".into());
        assert!(c.validate().is_err(), "an uplink named like our TAPs");
        c.filter.uplink = Some("eth0".into());
        assert!(c.validate().is_ok());
        // `new` truncates.
        assert_eq!(NetConfig::new("10.88.0.9/24".parse().expect("cidr"), "/x").cidr.to_string(), "10.88.0.0/24");
    }

    #[test]
    fn serde_defaults() {
        let c: NetConfig =
            serde_json::from_str(r#"{"cidr":"10.9.0.0/16","leases_path":"/var/lib/x.json"}"#).expect("parse");
        assert_eq!(c.bridge, DEFAULT_BRIDGE);
        assert_eq!(c.netns, None);
        assert_eq!(c.table, DEFAULT_TABLE);
        assert_eq!(c.tap_prefix, "ct-");
        assert_eq!(c.gateway(), Ipv4Addr::new(10, 9, 0, 1));
    }
}

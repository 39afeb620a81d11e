//! The VM packet filter: two nftables tables per network, `bridge <table>` and `inet <table>`
//! ([`NetConfig::table`], default `chrysalis`), rendered from the lease table and installed with
//! `nft -f -`.
//!
//! # What a guest can reach
//! * **Layer 2** (`bridge <table>`, hook `prerouting`, every frame entering from one of this
//!   network's VM ports, i.e. a port named `<tap_prefix>*`, [`NetConfig::tap_prefix`], default
//!   `ct-`): the source MAC must be the port's leased MAC; an ARP packet must
//!   be Ethernet/IPv4 with sender MAC and IP = the lease (no gratuitous ARP for the gateway or a
//!   neighbour); an IPv4 packet must carry the leased source address; everything else (IPv6,
//!   VLAN tags, other ethertypes) is dropped. A port without a lease entry drops everything.
//! * **VM → VM** (`bridge <table>`, hook `forward`): dropped, unless the two ports are in the
//!   same shared group (the set `peers` holds every allowed pair of ports). Ports of VMs without
//!   a group are also `isolated on` in the bridge, so the bridge itself never forwards between
//!   two of them.
//! * **VM → host** (`inet <table>`, hook `input`, packets arriving on a VM bridge): replies of
//!   connections the host opened, and the allow-list ([`FilterPolicy::host_allow`],
//!   `tcp/PORT`/`udp/PORT`, addressed to the gateway) only; default: nothing.
//! * **VM → out** (`inet <table>`, hook `forward`): only from egress-enabled VMs (`egress_v4`),
//!   only out of the uplink ([`FilterPolicy::uplink`]), never to a refused destination
//!   ([`ALWAYS_REFUSED`]: private, shared, link-local (the metadata address `169.254.169.254`
//!   included), loopback, multicast and reserved ranges, the VM range, plus
//!   [`FilterPolicy::refuse`]) nor to an address of the host (`fib daddr type local`); masqueraded
//!   behind the uplink's address (hook `postrouting`). Nothing is forwarded into a VM unless it
//!   belongs to a connection the VM opened. Without an uplink, nothing leaves.
//!
//! # Ownership
//! This module touches only the two tables of its network. Two networks (vk-cocoon's and
//! sandboxd's) coexist in one netns when their tables, bridges and TAP prefixes differ: the
//! bridge tables scope by port name prefix, the `inet` tables by bridge (`@vm_bridges`).
//! (Scoping the bridge table by the bridge itself, `meta ibrname`, needs a kernel with
//! `CONFIG_NFT_BRIDGE_META`, which neither the appliance's kernel nor the test hosts' have.)
//! [`render_tables`] re-creates both in one transaction
//! (`add table; delete table; table { … }`, so a missing table is not an error), which
//! [`crate::Network::ensure`] runs at start; [`render_elements`] flushes and refills every set in
//! one transaction after each lease or port change. Both are rendered from the whole lease table,
//! so the rules never drift from it.

use std::fmt::{self, Write as _};
use std::net::Ipv4Addr;
use std::str::FromStr;

use ipnet::Ipv4Net;

use crate::config::TAP_PREFIX;
use crate::config::{valid_ifname, NetConfig};
pub use crate::config::{FilterPolicy, HostPort, Proto};
use crate::ipam::Lease;

/// The default name of both tables ([`NetConfig::table`]).
pub const TABLE: &str = crate::config::DEFAULT_TABLE;

/// Destinations no VM may reach through the uplink, whatever the configuration says.
pub const ALWAYS_REFUSED: &[&str] = &[
    "0.0.0.0/8",      // "this network"
    "10.0.0.0/8",     // RFC 1918
    "100.64.0.0/10",  // carrier-grade NAT (RFC 6598)
    "127.0.0.0/8",    // loopback
    "169.254.0.0/16", // link-local, the cloud metadata address 169.254.169.254
    "172.16.0.0/12",  // RFC 1918
    "192.0.0.0/24",   // IETF protocol assignments
    "192.168.0.0/16", // RFC 1918
    "198.18.0.0/15",  // benchmarking
    "224.0.0.0/4",    // multicast
    "240.0.0.0/4",    // reserved, broadcast
];

/// Failures of parsing the filter configuration or of running `nft`.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// An allow-list entry is not `tcp/PORT` or `udp/PORT`.
    #[error("{entry:?} is not tcp/PORT or udp/PORT (PORT 1-65535)")]
    HostAllow {
        /// The entry.
        entry: String,
    },
    /// A refused-network entry is not an IPv4 network.
    #[error("{entry:?} is not an IPv4 network a.b.c.d/len")]
    Refuse {
        /// The entry.
        entry: String,
    },
    /// The uplink is not an interface name.
    #[error("uplink {0:?} is not an interface name (1-15 characters)")]
    Uplink(String),
    /// A shared group name is unusable.
    #[error("shared group {0:?} must be 1-253 printable characters")]
    Group(String),
    /// A VM asked for egress on a network without an uplink.
    #[error(
        "VM {vm} asks for egress, but this node has no uplink for VMs (set VK_NET_UPLINK / [vk_cocoon] vm_uplink)"
    )]
    NoUplink {
        /// The VM id.
        vm: String,
    },
    /// `nft` could not be started, or refused the ruleset.
    #[error("installing the {what} with nft (is the nftables package installed?)")]
    Nft {
        /// What we were installing.
        what: &'static str,
        /// What went wrong, with nft's stderr.
        #[source]
        source: foundation::ToolError,
    },
}

impl Proto {
    fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.proto.as_str(), self.port)
    }
}

impl FromStr for HostPort {
    type Err = FilterError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || FilterError::HostAllow { entry: s.to_owned() };
        let (proto, port) = s.trim().split_once('/').ok_or_else(bad)?;
        let proto = match proto.to_ascii_lowercase().as_str() {
            "tcp" => Proto::Tcp,
            "udp" => Proto::Udp,
            _ => return Err(bad()),
        };
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            return Err(bad());
        }
        Ok(HostPort { proto, port })
    }
}

impl TryFrom<String> for HostPort {
    type Error = FilterError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<HostPort> for String {
    fn from(h: HostPort) -> String {
        h.to_string()
    }
}

/// Parses a comma-separated allow-list (`tcp/53,udp/53`); empty = nothing.
pub fn parse_host_allow(s: &str) -> Result<Vec<HostPort>, FilterError> {
    let mut out: Vec<HostPort> =
        s.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::parse).collect::<Result<_, _>>()?;
    out.sort();
    out.dedup();
    Ok(out)
}

/// Parses a comma-separated list of IPv4 networks (`203.0.113.0/24,198.51.100.7`; a bare
/// address is a /32); empty = none.
pub fn parse_refuse(s: &str) -> Result<Vec<Ipv4Net>, FilterError> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.parse::<Ipv4Net>()
                .map(|n| n.trunc())
                .or_else(|_| e.parse::<Ipv4Addr>().map(Ipv4Net::from))
                .map_err(|_| FilterError::Refuse { entry: e.to_owned() })
        })
        .collect()
}

/// True for a usable shared-group name.
pub fn valid_group(g: &str) -> bool {
    !g.is_empty() && g.len() <= 253 && g.bytes().all(|b| b.is_ascii_graphic())
}

impl FilterPolicy {
    /// From the three variables' values (`None` or empty = unset).
    pub fn parse(host_allow: Option<&str>, uplink: Option<&str>, refuse: Option<&str>) -> Result<Self, FilterError> {
        let uplink = uplink.map(str::trim).filter(|u| !u.is_empty()).map(str::to_owned);
        let p = FilterPolicy {
            host_allow: parse_host_allow(host_allow.unwrap_or(""))?,
            uplink,
            refuse: parse_refuse(refuse.unwrap_or(""))?,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the uplink's name.
    pub fn validate(&self) -> Result<(), FilterError> {
        match &self.uplink {
            Some(u) if !valid_ifname(u) || u.starts_with(TAP_PREFIX) => Err(FilterError::Uplink(u.clone())),
            _ => Ok(()),
        }
    }
}

fn quote(s: &str) -> String {
    // Interface names are validated (`valid_ifname` refuses quotes and backslashes); stripping
    // them again keeps nft's string syntax intact whatever the caller passed.
    format!("\"{}\"", s.replace(['"', '\\'], ""))
}

/// Every ordered pair of distinct ports whose leases share a group.
pub fn peer_pairs(leases: &[&Lease]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for a in leases {
        for b in leases {
            if a.tap != b.tap && a.group.is_some() && a.group == b.group {
                out.push((a.tap.clone(), b.tap.clone()));
            }
        }
    }
    out.sort();
    out
}

fn elements<T: AsRef<str>>(items: &[T]) -> String {
    let v: Vec<&str> = items.iter().map(AsRef::as_ref).collect();
    v.join(", ")
}

/// The refused destinations: [`ALWAYS_REFUSED`], the VM range `cidr`, and `policy.refuse`.
pub fn refused_nets(policy: &FilterPolicy, cidr: Ipv4Net) -> Vec<String> {
    let mut v: Vec<String> = ALWAYS_REFUSED.iter().map(|s| (*s).to_owned()).collect();
    v.push(cidr.trunc().to_string());
    v.extend(policy.refuse.iter().map(|n| n.to_string()));
    v
}

/// The script that flushes and refills every set of both tables named `table` from `leases`,
/// in one transaction.
pub fn render_elements(table: &str, leases: &[&Lease]) -> String {
    let mut s = String::new();
    let mut fill = |family: &str, set: &str, items: Vec<String>| {
        let _ = writeln!(s, "flush set {family} {table} {set}");
        if !items.is_empty() {
            let _ = writeln!(s, "add element {family} {table} {set} {{ {} }}", elements(&items));
        }
    };
    fill("bridge", "port_mac", leases.iter().map(|l| format!("{} . {}", quote(&l.tap), l.mac)).collect());
    fill("bridge", "port_ip", leases.iter().map(|l| format!("{} . {}", quote(&l.tap), l.ip)).collect());
    fill(
        "bridge",
        "peers",
        peer_pairs(leases).into_iter().map(|(a, b)| format!("{} . {}", quote(&a), quote(&b))).collect(),
    );
    fill("inet", "egress_v4", leases.iter().filter(|l| l.egress).map(|l| l.ip.to_string()).collect());
    s
}

/// The script that re-creates both tables of `cfg` (named `cfg.table`, for `cfg.bridge`, its
/// gateway, its VM range and the ports named `cfg.tap_prefix*`) under `cfg.filter`, with the
/// sets filled from `leases`, in one transaction.
pub fn render_tables(cfg: &NetConfig, leases: &[&Lease]) -> String {
    let (table, gateway, cidr, policy) = (cfg.table.as_str(), cfg.gateway(), cfg.cidr, &cfg.filter);
    let br = quote(&cfg.bridge);
    let vm_ports = quote(&format!("{}*", cfg.tap_prefix));
    let mut s = String::new();
    let _ = write!(
        s,
        "add table bridge {table}
delete table bridge {table}
table bridge {table} {{
  set port_mac {{ type ifname . ether_addr; }}
  set port_ip {{ type ifname . ipv4_addr; }}
  set peers {{ type ifname . ifname; }}
  chain prerouting {{
    type filter hook prerouting priority -200; policy accept;
    iifname {vm_ports} jump from_vm
  }}
  chain from_vm {{
    iifname . ether saddr != @port_mac drop
    ether type arp arp htype != 1 drop
    ether type arp arp ptype != ip drop
    ether type arp arp hlen != 6 drop
    ether type arp arp plen != 4 drop
    ether type arp iifname . arp saddr ether != @port_mac drop
    ether type arp iifname . arp saddr ip != @port_ip drop
    ether type arp accept
    ether type ip iifname . ip saddr @port_ip accept
    drop
  }}
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname {vm_ports} jump vm_to_vm
    oifname {vm_ports} jump vm_to_vm
  }}
  chain vm_to_vm {{
    iifname . oifname @peers accept
    drop
  }}
}}
"
    );
    let refused = elements(&refused_nets(policy, cidr));
    let mut allow = String::new();
    for proto in [Proto::Tcp, Proto::Udp] {
        let ports: Vec<String> =
            policy.host_allow.iter().filter(|h| h.proto == proto).map(|h| h.port.to_string()).collect();
        if !ports.is_empty() {
            let _ =
                writeln!(allow, "    ip daddr {gateway} {} dport {{ {} }} accept", proto.as_str(), elements(&ports));
        }
    }
    let (out, nat) = match &policy.uplink {
        Some(up) => {
            let up = quote(up);
            (
                format!(
                    "    meta nfproto != ipv4 drop
    ip saddr != @egress_v4 drop
    oifname != {up} drop
    ip daddr @refused_v4 drop
    fib daddr type {{ local, broadcast, multicast, anycast }} drop
    accept
"
                ),
                format!(
                    "  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname @vm_bridges oifname {up} ip saddr @egress_v4 masquerade
  }}
"
                ),
            )
        }
        None => ("    drop\n".to_owned(), String::new()),
    };
    let _ = write!(
        s,
        "add table inet {table}
delete table inet {table}
table inet {table} {{
  set vm_bridges {{ type ifname; elements = {{ {br} }} }}
  set egress_v4 {{ type ipv4_addr; }}
  set refused_v4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {refused} }} }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname @vm_bridges jump vm_input
  }}
  chain vm_input {{
    ct state established,related accept
{allow}    drop
  }}
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname @vm_bridges jump vm_out
    oifname @vm_bridges jump vm_in
  }}
  chain vm_out {{
{out}  }}
  chain vm_in {{
    ct state established,related accept
    drop
  }}
{nat}}}
"
    );
    s.push_str(&render_elements(table, leases));
    s
}

/// Feeds `script` to `nft -f -` (one transaction: all of it or nothing), in the calling thread's
/// network namespace.
pub fn apply(what: &'static str, script: &str) -> Result<(), FilterError> {
    foundation::tool::run("nft", &["-f", "-"], Some(script.as_bytes()))
        .map_err(|source| FilterError::Nft { what, source })?;
    tracing::debug!(what, bytes = script.len(), "nft ruleset applied");
    Ok(())
}

/// Writes `value` to `/proc/sys/<key>` (for the calling thread's namespace) if the file exists;
/// returns the previous value.
pub(crate) fn sysctl_set(key: &str, value: &str) -> Option<String> {
    let path = format!("/proc/sys/{key}");
    let old = std::fs::read_to_string(&path).ok()?.trim().to_owned();
    if old != value {
        if let Err(e) = std::fs::write(&path, value) {
            tracing::warn!(%path, error = %e, "could not set a sysctl");
        }
    }
    Some(old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Mac;

    fn lease(n: u8, group: Option<&str>, egress: bool) -> Lease {
        Lease {
            ip: Ipv4Addr::new(10, 88, 0, n),
            mac: Mac([2, 0, 0, 0, 0, n]),
            tap: format!("ct-00000000000{n}"),
            group: group.map(str::to_owned),
            egress,
        }
    }

    fn policy() -> FilterPolicy {
        FilterPolicy::parse(Some("tcp/7000, udp/53,tcp/7000"), Some("eth0"), Some("203.0.113.0/24, 198.51.100.7"))
            .expect("policy")
    }

    #[test]
    fn allow_list_parsing() {
        assert_eq!(parse_host_allow("").expect("empty"), vec![]);
        assert_eq!(parse_host_allow(" , ").expect("blank"), vec![]);
        let v = parse_host_allow("udp/53, TCP/80,tcp/80").expect("list");
        assert_eq!(v, vec![HostPort { proto: Proto::Tcp, port: 80 }, HostPort { proto: Proto::Udp, port: 53 }]);
        assert_eq!(v[0].to_string(), "tcp/80");
        for bad in ["tcp", "tcp/", "tcp/0", "tcp/65536", "icmp/1", "80", "tcp/80/1", "tcp/-1"] {
            assert!(matches!(parse_host_allow(bad), Err(FilterError::HostAllow { .. })), "{bad}");
        }
        let json = serde_json::to_string(&v).expect("ser");
        assert_eq!(json, r#"["tcp/80","udp/53"]"#);
        assert_eq!(serde_json::from_str::<Vec<HostPort>>(&json).expect("de"), v);
    }

    #[test]
    fn refuse_and_uplink_parsing() {
        let r = parse_refuse("203.0.113.9/24, 198.51.100.7").expect("refuse");
        assert_eq!(r, vec!["203.0.113.0/24".parse().expect("n"), "198.51.100.7/32".parse().expect("n")]);
        assert!(matches!(parse_refuse("10.0.0.0/33"), Err(FilterError::Refuse { .. })));
        assert!(matches!(parse_refuse("example.com"), Err(FilterError::Refuse { .. })));
        assert_eq!(FilterPolicy::parse(None, None, None).expect("default"), FilterPolicy::default());
        assert_eq!(FilterPolicy::parse(None, Some("  "), None).expect("blank").uplink, None);
        assert!(matches!(FilterPolicy::parse(None, Some("a/b"), None), Err(FilterError::Uplink(_))));
        assert!(matches!(FilterPolicy::parse(None, Some("ct-0123"), None), Err(FilterError::Uplink(_))));
        assert!(matches!(FilterPolicy::parse(None, Some("eth0\""), None), Err(FilterError::Uplink(_))));
    }

    #[test]
    fn groups_pair_only_members_of_the_same_group() {
        let (a, b, c, d, e) = (
            lease(2, Some("ns/g"), false),
            lease(3, Some("ns/g"), false),
            lease(4, None, false),
            lease(5, None, false),
            lease(6, Some("ns/h"), false),
        );
        let pairs = peer_pairs(&[&a, &b, &c, &d, &e]);
        assert_eq!(pairs, vec![(a.tap.clone(), b.tap.clone()), (b.tap.clone(), a.tap.clone())]);
        assert!(valid_group("ns/g"));
        assert!(!valid_group(""));
        assert!(!valid_group("a b"));
    }

    #[test]
    fn the_tables_hold_every_rule() {
        let (a, b, c) = (lease(2, Some("ns/g"), true), lease(3, Some("ns/g"), false), lease(4, None, false));
        let cfg = NetConfig { filter: policy(), ..NetConfig::new("10.88.0.0/24".parse().expect("cidr"), "/l.json") };
        let s = render_tables(&cfg, &[&a, &b, &c]);
        for needle in [
            // Atomic re-creation of exactly our two tables.
            "add table bridge chrysalis\ndelete table bridge chrysalis\ntable bridge chrysalis {",
            "add table inet chrysalis\ndelete table inet chrysalis\ntable inet chrysalis {",
            // Anti-spoofing.
            "iifname \"ct-*\" jump from_vm",
            "iifname . ether saddr != @port_mac drop",
            "ether type arp iifname . arp saddr ether != @port_mac drop",
            "ether type arp iifname . arp saddr ip != @port_ip drop",
            "ether type ip iifname . ip saddr @port_ip accept",
            // VM → VM.
            "iifname . oifname @peers accept",
            // VM → host: the allow-list at the gateway only.
            "iifname @vm_bridges jump vm_input",
            "ip daddr 10.88.0.1 tcp dport { 7000 } accept",
            "ip daddr 10.88.0.1 udp dport { 53 } accept",
            // Out: egress VMs only, uplink only, refused nets, the host's own addresses.
            "ip saddr != @egress_v4 drop",
            "oifname != \"eth0\" drop",
            "ip daddr @refused_v4 drop",
            "fib daddr type { local, broadcast, multicast, anycast } drop",
            "iifname @vm_bridges oifname \"eth0\" ip saddr @egress_v4 masquerade",
            "set vm_bridges { type ifname; elements = { \"chrysalis0\" } }",
            // Elements.
            "add element bridge chrysalis port_mac { \"ct-000000000002\" . 02:00:00:00:00:02, \"ct-000000000003\" . 02:00:00:00:00:03, \"ct-000000000004\" . 02:00:00:00:00:04 }",
            "add element bridge chrysalis port_ip { \"ct-000000000002\" . 10.88.0.2, \"ct-000000000003\" . 10.88.0.3, \"ct-000000000004\" . 10.88.0.4 }",
            "add element bridge chrysalis peers { \"ct-000000000002\" . \"ct-000000000003\", \"ct-000000000003\" . \"ct-000000000002\" }",
            "add element inet chrysalis egress_v4 { 10.88.0.2 }",
        ] {
            assert!(s.contains(needle), "missing {needle:?} in\n{s}");
        }
        for net in [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "169.254.0.0/16",
            "127.0.0.0/8",
            "224.0.0.0/4",
            "10.88.0.0/24",
            "203.0.113.0/24",
            "198.51.100.7/32",
        ] {
            assert!(s.contains(&format!("{net},")) || s.contains(&format!("{net} }}")), "refused {net} missing");
        }
        // Only our tables are named.
        for line in s.lines().filter(|l| l.contains("table ")) {
            assert!(line.ends_with(" chrysalis") || line.ends_with(" chrysalis {"), "{line}");
        }
    }

    #[test]
    fn without_uplink_nothing_leaves_and_without_allow_list_nothing_reaches_the_host() {
        let a = lease(2, None, false);
        let cfg =
            NetConfig { bridge: "br0".into(), ..NetConfig::new("10.88.0.0/24".parse().expect("cidr"), "/l.json") };
        let s = render_tables(&cfg, &[&a]);
        let vm_out = s.split("chain vm_out {").nth(1).and_then(|r| r.split('}').next()).expect("vm_out");
        assert_eq!(vm_out.trim(), "drop");
        let vm_input = s.split("chain vm_input {").nth(1).and_then(|r| r.split('}').next()).expect("vm_input");
        assert_eq!(vm_input.trim(), "ct state established,related accept\n    drop");
        assert!(!s.contains("masquerade") && !s.contains("dport"), "{s}");
        assert!(s.contains("flush set bridge chrysalis peers\n"), "empty sets are flushed");
        assert!(!s.contains("add element bridge chrysalis peers"), "no empty element list");
        assert!(!s.contains("add element inet chrysalis egress_v4"));
    }

    #[test]
    fn a_second_network_names_its_own_tables_bridge_and_ports() {
        let mut a = lease(2, None, true);
        a.tap = "sb-000000000002".into();
        let cfg = NetConfig {
            bridge: "chrysalis1".into(),
            table: "chrysalis_sbx".into(),
            tap_prefix: "sb-".into(),
            filter: policy(),
            ..NetConfig::new("10.89.0.0/24".parse().expect("cidr"), "/l.json")
        };
        let s = render_tables(&cfg, &[&a]);
        for needle in [
            "add table bridge chrysalis_sbx\ndelete table bridge chrysalis_sbx\ntable bridge chrysalis_sbx {",
            "add table inet chrysalis_sbx\ndelete table inet chrysalis_sbx\ntable inet chrysalis_sbx {",
            "iifname \"sb-*\" jump from_vm",
            "iifname \"sb-*\" jump vm_to_vm",
            "oifname \"sb-*\" jump vm_to_vm",
            "set vm_bridges { type ifname; elements = { \"chrysalis1\" } }",
            "ip daddr 10.89.0.1 tcp dport { 7000 } accept",
            "add element inet chrysalis_sbx egress_v4 { 10.88.0.2 }",
        ] {
            assert!(s.contains(needle), "missing {needle:?} in\n{s}");
        }
        assert!(!s.contains("ct-"), "no other network's ports: {s}");
        for line in s.lines().filter(|l| l.contains("table ") || l.contains("element ") || l.contains("flush set")) {
            assert!(line.contains(" chrysalis_sbx"), "{line}");
        }
    }
}

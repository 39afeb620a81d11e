//! The node IP a provider publishes as the Node's `InternalIP` ([`crate::NodeConfig::internal_ip`]):
//! an IP the operator gave, a name resolved once at start-up, or this host's first address.

use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};

/// A node IP setting that names no usable address.
#[derive(Debug, thiserror::Error)]
pub enum NodeIpError {
    #[error("the node IP {0:?} is neither an IP address nor a name this host resolves; set the node's IP address")]
    Unresolved(String, #[source] std::io::Error),
    #[error("the node IP {0:?} resolves to no address; set the node's IP address")]
    NoAddress(String),
}

/// The node IP from a setting: empty → this host's first non-loopback IPv4 (`None` when it has
/// none), an IP → itself, a name → its first address (the API server needs something it can
/// dial, and a name that resolves here may not resolve there).
pub fn node_ip(setting: &str) -> Result<Option<IpAddr>, NodeIpError> {
    node_ip_with(setting, first_non_loopback_ipv4)
}

/// [`node_ip`] for a kubelet port bound to `listen`: with no setting, a port bound to one
/// address publishes that address (the API server must dial where the port listens); a port
/// bound to every address falls back to detection.
pub fn node_ip_for(setting: &str, listen: std::net::SocketAddr) -> Result<Option<IpAddr>, NodeIpError> {
    if setting.trim().is_empty() && !listen.ip().is_unspecified() {
        return Ok(Some(listen.ip()));
    }
    node_ip(setting)
}

fn node_ip_with(setting: &str, detect: impl FnOnce() -> Option<Ipv4Addr>) -> Result<Option<IpAddr>, NodeIpError> {
    let setting = setting.trim();
    if setting.is_empty() {
        return Ok(detect().map(IpAddr::V4));
    }
    if let Ok(ip) = setting.parse::<IpAddr>() {
        return Ok(Some(ip));
    }
    let mut found = (setting, 0u16).to_socket_addrs().map_err(|e| NodeIpError::Unresolved(setting.into(), e))?;
    found.next().map(|a| Some(a.ip())).ok_or_else(|| NodeIpError::NoAddress(setting.into()))
}

/// The first IPv4 address of an interface that is up and not a loopback.
pub fn first_non_loopback_ipv4() -> Option<Ipv4Addr> {
    use nix::net::if_::InterfaceFlags;
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        if !a.flags.contains(InterfaceFlags::IFF_UP) || a.flags.contains(InterfaceFlags::IFF_LOOPBACK) {
            continue;
        }
        let Some(sin) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) else { continue };
        let ip = sin.ip();
        if !ip.is_loopback() && !ip.is_unspecified() {
            return Some(ip);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ips_pass_names_resolve_and_empty_detects() {
        let detected = Ipv4Addr::new(192, 0, 2, 9);
        assert_eq!(node_ip_with("", || Some(detected)).expect("ok"), Some(detected.into()));
        assert_eq!(node_ip_with("  ", || None).expect("ok"), None);
        assert_eq!(node_ip_with(" 10.0.0.5 ", || None).expect("ok"), Some("10.0.0.5".parse().expect("ip")));
        assert_eq!(node_ip_with("fd00::1", || None).expect("ok"), Some("fd00::1".parse().expect("ip")));
        let local = node_ip_with("localhost", || None).expect("localhost resolves").expect("an address");
        assert!(local.is_loopback(), "{local}");
        let e = node_ip_with("no-such-host.invalid", || None).expect_err("does not resolve");
        assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
    }

    #[test]
    fn the_detector_never_answers_a_loopback() {
        if let Some(ip) = first_non_loopback_ipv4() {
            assert!(!ip.is_loopback());
        }
    }

    #[test]
    fn a_port_bound_to_one_address_publishes_it_unless_told_otherwise() {
        let lo: std::net::SocketAddr = "127.0.0.1:10250".parse().expect("addr");
        assert_eq!(node_ip_for("", lo).expect("ip"), Some("127.0.0.1".parse().expect("ip")));
        assert_eq!(node_ip_for("10.0.0.5", lo).expect("ip"), Some("10.0.0.5".parse().expect("ip")));
    }
}

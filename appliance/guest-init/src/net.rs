//! Network interfaces, configured with plain ioctls (no netlink, no tools in the guest):
//! - `lo` up (the kernel assigns 127.0.0.1/8); silkd's `port_forward` connects to guest services
//!   on 127.0.0.1;
//! - `eth0` (virtio-net on a host TAP) from `chrysalis.ip=<ip/prefix> chrysalis.gw=<gw>
//!   chrysalis.mac=<mac>` at boot, or from `guest-init net-config <ip/prefix> <gw> <mac>` run
//!   through the agent in a clone (whose memory still holds its parent's MAC and address):
//!   MAC (`SIOCSIFHWADDR`, with the link down), address and netmask (`SIOCSIFADDR`,
//!   `SIOCSIFNETMASK`), up, default route (`SIOCADDRT`). `arp_notify` is switched on first so
//!   that bringing the link up announces the address (a reused address's stale neighbour entries
//!   on the host are refreshed at once).

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// The interface the host's TAP appears as.
pub const ETH0: &str = "eth0";

/// Failure to configure an interface.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("opening an AF_INET socket")]
    Socket(#[source] std::io::Error),
    #[error("{op} on {ifname}")]
    Ioctl {
        op: &'static str,
        ifname: String,
        #[source]
        source: std::io::Error,
    },
    #[error("interface name {0:?} is too long")]
    Name(String),
    #[error("interface {0} did not appear within {1:?}")]
    Missing(String, Duration),
}

/// A static IPv4 configuration for one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Config {
    /// The address.
    pub ip: Ipv4Addr,
    /// Prefix length (1..=32).
    pub prefix: u8,
    /// Default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// MAC to set first.
    pub mac: Option<[u8; 6]>,
}

impl Ipv4Config {
    /// The netmask of [`Ipv4Config::prefix`].
    pub fn netmask(&self) -> Ipv4Addr {
        let bits = if self.prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(self.prefix.min(32))) };
        Ipv4Addr::from(bits)
    }
}

/// Parses `10.88.0.5/24`.
pub fn parse_ip_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (ip, prefix) = s.split_once('/')?;
    let prefix: u8 = prefix.parse().ok().filter(|p| (1..=32).contains(p))?;
    Some((ip.parse().ok()?, prefix))
}

/// Parses `02:aa:bb:cc:dd:ee` (a unicast MAC).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for o in out.iter_mut() {
        let p = parts.next().filter(|p| p.len() == 2)?;
        *o = u8::from_str_radix(p, 16).ok()?;
    }
    (parts.next().is_none() && out[0] & 1 == 0).then_some(out)
}

/// Parses the `net-config` arguments `<ip/prefix> <gw> <mac>`.
pub fn parse_net_config_args(args: &[String]) -> Result<Ipv4Config, String> {
    let [ip, gw, mac] = args else {
        return Err(format!("expected <ip/prefix> <gateway> <mac>, got {} arguments", args.len()));
    };
    let (ip, prefix) = parse_ip_cidr(ip).ok_or_else(|| format!("bad address {ip:?} (want a.b.c.d/len)"))?;
    let gateway = gw.parse().map_err(|_| format!("bad gateway {gw:?}"))?;
    let mac = parse_mac(mac).ok_or_else(|| format!("bad MAC {mac:?}"))?;
    Ok(Ipv4Config { ip, prefix, gateway: Some(gateway), mac: Some(mac) })
}

/// `struct ifreq` restricted to the `ifr_flags` member (padded to the kernel's 40 bytes).
#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// `struct ifreq` with a `struct sockaddr` member (address, netmask, hardware address).
#[repr(C)]
struct IfReqAddr {
    name: [libc::c_char; libc::IFNAMSIZ],
    addr: libc::sockaddr,
    _pad: [u8; 8],
}

/// The kernel's `struct rtentry` (include/uapi/linux/route.h).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn sockaddr_in(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16-byte plain-old-data C structs.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn sockaddr_mac(mac: [u8; 6]) -> libc::sockaddr {
    let mut sa = libc::sockaddr { sa_family: libc::ARPHRD_ETHER, sa_data: [0; 14] };
    for (d, s) in sa.sa_data.iter_mut().zip(mac) {
        *d = s as libc::c_char;
    }
    sa
}

fn ifname_bytes(ifname: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], NetError> {
    if ifname.is_empty() || ifname.len() >= libc::IFNAMSIZ {
        return Err(NetError::Name(ifname.into()));
    }
    let mut name = [0 as libc::c_char; libc::IFNAMSIZ];
    for (dst, src) in name.iter_mut().zip(ifname.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(name)
}

/// An AF_INET datagram socket to issue interface ioctls on.
struct Ctl {
    sock: OwnedFd,
    ifname: String,
    name: [libc::c_char; libc::IFNAMSIZ],
}

impl Ctl {
    fn new(ifname: &str) -> Result<Self, NetError> {
        let name = ifname_bytes(ifname)?;
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(NetError::Socket(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a freshly created, valid descriptor that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Ctl { sock, ifname: ifname.into(), name })
    }

    /// ioctl(`op`) with `arg`; errors name `what`.
    fn ioctl<T>(&self, op: libc::c_ulong, what: &'static str, arg: &mut T) -> Result<(), NetError> {
        // SAFETY: every caller passes the properly sized, initialised struct `op` expects
        // (ifreq variants of 40 bytes, or rtentry), and the kernel only touches that struct.
        let rc = unsafe { libc::ioctl(self.sock.as_raw_fd(), op as _, arg as *mut T) };
        if rc < 0 {
            return Err(NetError::Ioctl {
                op: what,
                ifname: self.ifname.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    fn flags(&self) -> Result<libc::c_short, NetError> {
        let mut req = IfReqFlags { name: self.name, flags: 0, _pad: [0; 22] };
        self.ioctl(libc::SIOCGIFFLAGS, "SIOCGIFFLAGS", &mut req)?;
        Ok(req.flags)
    }

    fn set_up(&self, up: bool) -> Result<(), NetError> {
        let mut flags = self.flags()?;
        let bits = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if up {
            flags |= bits;
        } else {
            flags &= !bits;
        }
        let mut req = IfReqFlags { name: self.name, flags, _pad: [0; 22] };
        self.ioctl(libc::SIOCSIFFLAGS, "SIOCSIFFLAGS", &mut req)
    }

    fn addr_req(&self, addr: libc::sockaddr) -> IfReqAddr {
        IfReqAddr { name: self.name, addr, _pad: [0; 8] }
    }

    fn mac(&self) -> Result<[u8; 6], NetError> {
        let mut req = self.addr_req(sockaddr_mac([0; 6]));
        self.ioctl(libc::SIOCGIFHWADDR, "SIOCGIFHWADDR", &mut req)?;
        let mut mac = [0u8; 6];
        for (d, s) in mac.iter_mut().zip(req.addr.sa_data) {
            *d = s as u8;
        }
        Ok(mac)
    }

    fn set_mac(&self, mac: [u8; 6]) -> Result<(), NetError> {
        let mut req = self.addr_req(sockaddr_mac(mac));
        self.ioctl(libc::SIOCSIFHWADDR, "SIOCSIFHWADDR", &mut req)
    }

    fn set_addr(&self, ip: Ipv4Addr, mask: Ipv4Addr) -> Result<(), NetError> {
        let mut req = self.addr_req(sockaddr_in(ip));
        self.ioctl(libc::SIOCSIFADDR, "SIOCSIFADDR", &mut req)?;
        let mut req = self.addr_req(sockaddr_in(mask));
        self.ioctl(libc::SIOCSIFNETMASK, "SIOCSIFNETMASK", &mut req)
    }

    fn default_route(&self, op: libc::c_ulong, what: &'static str, gw: Option<Ipv4Addr>) -> Result<(), NetError> {
        let any = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        let mut rt = RtEntry {
            rt_pad1: 0,
            rt_dst: any,
            rt_gateway: gw.map(sockaddr_in).unwrap_or(any),
            rt_genmask: any,
            rt_flags: libc::RTF_UP | if gw.is_some() { libc::RTF_GATEWAY } else { 0 },
            rt_pad2: 0,
            rt_pad3: 0,
            rt_pad4: std::ptr::null_mut(),
            rt_metric: 0,
            rt_dev: std::ptr::null_mut(),
            rt_mtu: 0,
            rt_window: 0,
            rt_irtt: 0,
        };
        self.ioctl(op, what, &mut rt)
    }
}

/// Sets IFF_UP (and IFF_RUNNING) on `ifname`.
pub fn link_up(ifname: &str) -> Result<(), NetError> {
    Ctl::new(ifname)?.set_up(true)
}

fn wait_for(ifname: &str, timeout: Duration) -> Result<(), NetError> {
    let deadline = Instant::now() + timeout;
    let path = format!("/sys/class/net/{ifname}");
    while !std::path::Path::new(&path).exists() {
        if Instant::now() >= deadline {
            return Err(NetError::Missing(ifname.into(), timeout));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Applies `cfg` to `ifname`: arp_notify on, MAC (link taken down to change it), address and
/// netmask, up, and the default route (replacing an existing default route).
pub fn configure(ifname: &str, cfg: &Ipv4Config) -> Result<(), NetError> {
    wait_for(ifname, Duration::from_secs(5))?;
    let ctl = Ctl::new(ifname)?;
    // Best effort: only announces the address when the link comes up.
    let _ = std::fs::write(format!("/proc/sys/net/ipv4/conf/{ifname}/arp_notify"), "1");
    if let Some(mac) = cfg.mac {
        if ctl.mac()? != mac {
            ctl.set_up(false)?;
            ctl.set_mac(mac)?;
        }
    }
    ctl.set_addr(cfg.ip, cfg.netmask())?;
    ctl.set_up(true)?;
    if let Some(gw) = cfg.gateway {
        // Routes via the old address survive when the link stayed up: drop the old default.
        let _ = ctl.default_route(libc::SIOCDELRT, "SIOCDELRT", None);
        ctl.default_route(libc::SIOCADDRT, "SIOCADDRT", Some(gw))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<IfReqFlags>(), 40);
        assert_eq!(std::mem::size_of::<IfReqAddr>(), 40);
        #[cfg(target_pointer_width = "64")]
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
    }

    #[test]
    fn rejects_long_names() {
        assert!(matches!(link_up("a-very-long-interface-name"), Err(NetError::Name(_))));
    }

    #[test]
    fn parses_addresses_macs_and_arguments() {
        assert_eq!(parse_ip_cidr("10.88.0.5/24"), Some((Ipv4Addr::new(10, 88, 0, 5), 24)));
        for bad in ["10.88.0.5", "10.88.0.5/0", "10.88.0.5/33", "x/24", "10.88.0/24"] {
            assert_eq!(parse_ip_cidr(bad), None, "{bad}");
        }
        assert_eq!(parse_mac("02:aa:bb:cc:dd:0e"), Some([2, 0xaa, 0xbb, 0xcc, 0xdd, 0x0e]));
        for bad in ["02:aa:bb:cc:dd", "02:aa:bb:cc:dd:ee:ff", "01:aa:bb:cc:dd:ee", "02:aa:bb:cc:dd:e"] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
        let args: Vec<String> = ["10.88.0.7/24", "10.88.0.1", "02:00:00:00:00:07"].map(String::from).to_vec();
        let cfg = parse_net_config_args(&args).expect("args");
        assert_eq!(cfg.ip, Ipv4Addr::new(10, 88, 0, 7));
        assert_eq!(cfg.netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(cfg.gateway, Some(Ipv4Addr::new(10, 88, 0, 1)));
        assert_eq!(cfg.mac, Some([2, 0, 0, 0, 0, 7]));
        assert!(parse_net_config_args(&args[..2]).is_err());
        let mut bad = args.clone();
        bad[1] = "gw".into();
        assert!(parse_net_config_args(&bad).is_err());
    }

    #[test]
    fn netmasks() {
        let c = |prefix| Ipv4Config { ip: Ipv4Addr::UNSPECIFIED, prefix, gateway: None, mac: None }.netmask();
        assert_eq!(c(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(c(30), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(c(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(c(1), Ipv4Addr::new(128, 0, 0, 0));
    }

    #[test]
    fn sockaddrs() {
        let sa = sockaddr_in(Ipv4Addr::new(10, 88, 0, 5));
        assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
        assert_eq!(&sa.sa_data[2..6], &[10, 88, 0, 5].map(|b: u8| b as libc::c_char));
        let m = sockaddr_mac([2, 1, 2, 3, 4, 5]);
        assert_eq!(m.sa_family, libc::ARPHRD_ETHER);
        assert_eq!(&m.sa_data[..6], &[2, 1, 2, 3, 4, 5].map(|b: u8| b as libc::c_char));
    }
}

//! Brings up the loopback interface (the kernel assigns 127.0.0.1/8 when `lo` goes up);
//! silkd's `port_forward` connects to guest services on 127.0.0.1.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Failure to bring an interface up.
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
}

/// `struct ifreq` restricted to the `ifr_flags` member (padded to the kernel's 40 bytes).
#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Sets IFF_UP (and IFF_RUNNING) on `ifname`.
pub fn link_up(ifname: &str) -> Result<(), NetError> {
    if ifname.len() >= libc::IFNAMSIZ {
        return Err(NetError::Name(ifname.into()));
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(NetError::Socket(std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` is a freshly created, valid descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut req = IfReqFlags { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
    for (dst, src) in req.name.iter_mut().zip(ifname.bytes()) {
        *dst = src as libc::c_char;
    }
    let ioctl = |op: libc::c_ulong, name: &'static str, req: &mut IfReqFlags| -> Result<(), NetError> {
        // SAFETY: `req` is a properly sized, NUL-terminated ifreq for SIOC[GS]IFFLAGS.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), op as _, req as *mut IfReqFlags) };
        if rc < 0 {
            return Err(NetError::Ioctl { op: name, ifname: ifname.into(), source: std::io::Error::last_os_error() });
        }
        Ok(())
    };
    ioctl(libc::SIOCGIFFLAGS, "SIOCGIFFLAGS", &mut req)?;
    req.flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(libc::SIOCSIFFLAGS, "SIOCSIFFLAGS", &mut req)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifreq_has_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<IfReqFlags>(), 40);
    }

    #[test]
    fn rejects_long_names() {
        assert!(matches!(link_up("a-very-long-interface-name"), Err(NetError::Name(_))));
    }
}

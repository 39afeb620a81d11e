//! Persistent TAP devices: `open("/dev/net/tun")` + `TUNSETIFF(IFF_TAP | IFF_NO_PI)` +
//! `TUNSETPERSIST(1)`, then the descriptor is closed and the device stays (without carrier) until
//! QEMU opens it by name. The device is made in the namespace of the calling thread: call this
//! inside [`crate::netns::run_in`].

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use crate::config::valid_ifname;
use crate::VmnetError;

/// The clone device.
pub const TUN_DEVICE: &str = "/dev/net/tun";

/// `struct ifreq` restricted to `ifr_name` + `ifr_flags` (padded to the kernel's 40 bytes).
#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn tap_err<'a>(name: &'a str, op: &'static str) -> impl FnOnce(std::io::Error) -> VmnetError + 'a {
    move |source| VmnetError::Tap { name: name.into(), op, source }
}

/// Creates (or re-attaches to and keeps) the persistent TAP `name`. Fails with `EBUSY` while a
/// process (a running QEMU) holds it.
pub fn create_persistent(name: &str) -> Result<(), VmnetError> {
    if !valid_ifname(name) {
        return Err(VmnetError::Config(format!("tap name {name:?} is not a valid interface name")));
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(TUN_DEVICE)
        .map_err(tap_err(name, "opening /dev/net/tun"))?;
    let mut req = IfReqFlags { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
    for (dst, src) in req.name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: `req` is a properly sized, NUL-terminated ifreq that TUNSETIFF reads and writes.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETIFF as _, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        return Err(tap_err(name, "TUNSETIFF")(std::io::Error::last_os_error()));
    }
    // SAFETY: TUNSETPERSIST takes its argument by value; no memory is passed.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETPERSIST as _, 1 as libc::c_ulong) };
    if rc < 0 {
        return Err(tap_err(name, "TUNSETPERSIST")(std::io::Error::last_os_error()));
    }
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
    fn rejects_bad_names_before_touching_the_system() {
        assert!(matches!(create_persistent("a-name-that-is-far-too-long"), Err(VmnetError::Config(_))));
        assert!(matches!(create_persistent("a/b"), Err(VmnetError::Config(_))));
        assert!(matches!(create_persistent(""), Err(VmnetError::Config(_))));
    }
}

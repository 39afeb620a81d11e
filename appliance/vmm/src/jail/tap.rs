//! TAPs on the privileged side: attaching to one so the hypervisor inherits the descriptor
//! ([`open_tap`], QEMU), or handing one to the VM user so the hypervisor attaches itself
//! ([`set_owner`], cloud-hypervisor).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Errors opening a TAP.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// Opening `/dev/net/tun` or attaching to the TAP failed.
    #[error("attaching to TAP {tap} (netns {netns:?}): {what}")]
    Attach {
        /// The TAP.
        tap: String,
        /// Its network namespace file.
        netns: Option<PathBuf>,
        /// The step that failed.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens `/dev/net/tun` inside `netns` (on a thread of its own, so only that thread ever
/// switches namespaces) and attaches it to the existing TAP `tap` with `IFF_TAP | IFF_NO_PI |
/// IFF_VNET_HDR` (what QEMU asks for itself). A TAP another process holds fails with `EBUSY`.
pub fn open_tap(tap: &str, netns: Option<&Path>) -> Result<OwnedFd, TapError> {
    with_attached(tap, netns, Ok)
}

/// Hands the existing persistent TAP `tap` (in `netns`) to `uid`/`gid`: attaches to it as
/// [`open_tap`] does, sets its owner (`TUNSETOWNER`) and group (`TUNSETGROUP`), and lets go.
/// A process running as that user and group (a jailed cloud-hypervisor, which opens its TAP by
/// name) may then attach to it without `CAP_NET_ADMIN`; nobody else without it may. The
/// ownership stays with the device (it is persistent) until it is set again or the TAP is
/// deleted. A TAP that does not exist (attaching as root would create a transient one, gone
/// when we let go) fails with `NotFound` at the step `"persistent TAP"`.
pub fn set_owner(tap: &str, netns: Option<&Path>, uid: u32, gid: u32) -> Result<(), TapError> {
    with_attached(tap, netns, move |tun| {
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        // SAFETY: TUNGETIFF writes an ifreq, which `req` is.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNGETIFF as _, &mut req) } != 0 {
            return Err(("TUNGETIFF", std::io::Error::last_os_error()));
        }
        if i32::from(req.flags) & libc::IFF_PERSIST == 0 {
            return Err(("persistent TAP", std::io::ErrorKind::NotFound.into()));
        }
        // SAFETY: TUNSETOWNER and TUNSETGROUP take their argument by value (an id), not a
        // pointer; `tun` is an open, attached tun descriptor.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETOWNER as _, libc::c_ulong::from(uid)) } != 0 {
            return Err(("TUNSETOWNER", std::io::Error::last_os_error()));
        }
        // SAFETY: as above.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETGROUP as _, libc::c_ulong::from(gid)) } != 0 {
            return Err(("TUNSETGROUP", std::io::Error::last_os_error()));
        }
        Ok(())
    })
}

/// A failed step of [`with_attached`]: what failed, and why.
type Step = (&'static str, std::io::Error);

/// Runs `then` on a `/dev/net/tun` descriptor attached to `tap`, opened inside `netns` on a
/// thread of its own (so only that thread ever switches namespaces).
fn with_attached<T: Send + 'static>(
    tap: &str,
    netns: Option<&Path>,
    then: impl FnOnce(OwnedFd) -> Result<T, Step> + Send + 'static,
) -> Result<T, TapError> {
    let err = |what, source| TapError::Attach { tap: tap.into(), netns: netns.map(Path::to_path_buf), what, source };
    if tap.len() >= libc::IFNAMSIZ || tap.contains('\0') {
        return Err(err("name", std::io::ErrorKind::InvalidInput.into()));
    }
    let name = tap.to_string();
    let ns = netns.map(Path::to_path_buf);
    let joined = std::thread::spawn(move || -> Result<T, Step> {
        if let Some(ns) = ns {
            let f = std::fs::File::open(&ns).map_err(|e| ("opening the namespace", e))?;
            // SAFETY: setns(2) on a descriptor we hold; it changes only this thread's namespace.
            if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(("joining the namespace", std::io::Error::last_os_error()));
            }
        }
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| ("opening /dev/net/tun", e))?;
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        for (d, s) in req.name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        req.flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is (name, flags, padding).
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF as _, &mut req) } != 0 {
            return Err(("TUNSETIFF", std::io::Error::last_os_error()));
        }
        then(OwnedFd::from(tun))
    })
    .join();
    match joined {
        Ok(Ok(v)) => Ok(v),
        Ok(Err((what, e))) => Err(err(what, e)),
        Err(_) => Err(err("thread", std::io::Error::other("the TAP thread panicked"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A network namespace of this test, deleted when dropped.
    struct Netns(String);

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    fn ip(args: &[&str]) -> String {
        let out = std::process::Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn bad_names_are_refused_before_anything_is_opened() {
        let e = set_owner("a-name-far-too-long-for-ifnamsiz", None, 1, 1).expect_err("too long");
        assert!(matches!(e, TapError::Attach { what: "name", .. }), "{e:?}");
    }

    #[test]
    #[cfg_attr(
        not(feature = "netns-tests"),
        ignore = "root-only, creates a netns and a TAP: cargo test -p vmm --features netns-tests --lib jail::tap"
    )]
    fn set_owner_hands_a_persistent_tap_to_the_vm_user() {
        if !rustix::process::geteuid().is_root() {
            foundation::testing::skip("set_owner needs root (a netns and a TAP)");
            return;
        }
        let ns = Netns(format!("chtest-{}", std::process::id()));
        ip(&["netns", "add", &ns.0]);
        ip(&["-n", &ns.0, "tuntap", "add", "dev", "chtap0", "mode", "tap"]);
        let path = Path::new("/run/netns").join(&ns.0);
        let sys = |f: &str| ip(&["netns", "exec", &ns.0, "cat", &format!("/sys/class/net/chtap0/{f}")]);
        assert_eq!((sys("owner"), sys("group")), ("-1".to_string(), "-1".to_string()));

        set_owner("chtap0", Some(&path), 4242, 4343).expect("set owner");
        assert_eq!((sys("owner"), sys("group")), ("4242".to_string(), "4343".to_string()));
        // It is let go: root can still attach (it holds CAP_NET_ADMIN), and set it again.
        drop(open_tap("chtap0", Some(&path)).expect("attach after set_owner"));
        set_owner("chtap0", Some(&path), 4244, 4343).expect("set owner again");
        assert_eq!(sys("owner"), "4244");

        // Not in this netns, or no netns at all: a typed error naming the step.
        let e = set_owner("chtap-none", Some(&path), 1, 1).expect_err("no such tap");
        assert!(matches!(e, TapError::Attach { what: "persistent TAP", .. }), "{e:?}");
        assert!(ip(&["-n", &ns.0, "-o", "link", "show"]).lines().all(|l| !l.contains("chtap-none")), "no TAP left");
        let e = set_owner("chtap0", Some(Path::new("/run/netns/chtest-no-such-ns")), 1, 1).expect_err("no netns");
        assert!(matches!(e, TapError::Attach { what: "opening the namespace", .. }), "{e:?}");
    }
}

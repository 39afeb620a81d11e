//! Dialling a VM's socket by path and checking who answers it.
//!
//! cloud-hypervisor binds its API, console and vsock sockets itself, in `<vmdir>/jail/`, a
//! directory the VM user owns (see [`crate::cloud_hypervisor`], "Jail"). A compromised
//! cloud-hypervisor may therefore replace any of them with a link to another process's socket
//! (another service's API, another VM's console) and the driver, root, would talk to that.
//! [`connect`] with a [`PeerCheck`] closes that:
//!
//! 1. the path is opened `O_PATH | O_NOFOLLOW` and must be a socket: a symbolic link in its
//!    last component fails at once ([`PeerError::Link`]);
//! 2. the connection goes through that descriptor (`/proc/self/fd/<n>`), not the path again,
//!    so nothing swapped in after step 1 is followed;
//! 3. the peer's credentials (`SO_PEERCRED`: the pid and uid of the process that called
//!    `listen` on the socket) must be the VM's: its recorded hypervisor pid, or, where that is
//!    not known, the jail's VM uid ([`PeerError::Mismatch`]).
//!
//! A Unix socket cannot be opened `O_NOFOLLOW` — `connect(2)` follows links — and a hard link
//! or a `rename` puts a foreign socket at the path without any link, so step 3 is the
//! guarantee; steps 1–2 only fail earlier and with a clearer error.
//!
//! Not for QEMU's sockets: the driver binds those itself in root's directories and hands QEMU
//! the listening descriptors, so their `SO_PEERCRED` names the driver process that listened
//! (possibly an earlier one), not QEMU — and nobody but root can replace them.

use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use tokio::net::UnixStream;

use crate::id::VmId;

/// Who must answer a VM's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The process with this pid (the VM's hypervisor, as recorded).
    Pid(u32),
    /// Any process running as this uid (the jail's VM user), where the pid is not known.
    Uid(u32),
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Pid(p) => write!(f, "pid {p}"),
            Peer::Uid(u) => write!(f, "uid {u}"),
        }
    }
}

/// The check [`connect`] makes: the VM (for the log) and its expected peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCheck {
    /// The VM whose socket this is.
    pub vm: VmId,
    /// Who must answer it.
    pub expected: Peer,
}

/// A VM's socket is not (provably) served by the VM's hypervisor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// The socket's path is a symbolic link, which is never followed.
    #[error("{socket} is a symbolic link (not followed)")]
    Link {
        /// The socket path.
        socket: PathBuf,
    },
    /// The socket is served by another process than the VM's hypervisor.
    #[error("{socket} is served by pid {found_pid} (uid {found_uid}), not by the VM's hypervisor ({expected})")]
    Mismatch {
        /// The socket path.
        socket: PathBuf,
        /// Who should have answered.
        expected: Peer,
        /// The pid that answered (0: from another pid namespace).
        found_pid: u32,
        /// The uid that answered.
        found_uid: u32,
    },
    /// The peer's credentials could not be read.
    #[error("reading the peer credentials of {socket}")]
    Credentials {
        /// The socket path.
        socket: PathBuf,
        /// The cause.
        #[source]
        source: nix::errno::Errno,
    },
}

/// Errors of [`connect`].
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket is missing or refused (the ordinary "not up yet").
    #[error("connecting to {socket}")]
    Io {
        /// The socket path.
        socket: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The socket is not the VM's hypervisor's.
    #[error(transparent)]
    Peer(#[from] PeerError),
}

impl ConnectError {
    /// Into an `io::Error` (kind `PermissionDenied` for a peer failure, the [`PeerError`]
    /// inside, reachable with [`std::io::Error::get_ref`]).
    pub fn into_io(self) -> std::io::Error {
        match self {
            ConnectError::Io { source, .. } => source,
            ConnectError::Peer(p) => std::io::Error::new(std::io::ErrorKind::PermissionDenied, p),
        }
    }
}

/// Connects to the socket at `path`. With `check`, refuses a symbolic link there and checks
/// the peer's credentials after connecting (see the module docs), logging a refusal with the
/// VM's id; without, a plain `connect` (QEMU's sockets, tests).
pub async fn connect(path: &Path, check: Option<&PeerCheck>) -> Result<UnixStream, ConnectError> {
    let io = |source| ConnectError::Io { socket: path.to_path_buf(), source };
    let Some(check) = check else {
        return UnixStream::connect(path).await.map_err(io);
    };
    let result = async {
        let fd = open_socket_nofollow(path)?;
        let stream = UnixStream::connect(format!("/proc/self/fd/{}", fd.as_raw_fd())).await.map_err(io)?;
        drop(fd);
        verify(&stream, path, check.expected)?;
        Ok(stream)
    }
    .await;
    if let Err(ConnectError::Peer(e)) = &result {
        tracing::error!(vm = %check.vm, socket = %path.display(), error = %e, "refusing a VM socket not served by its hypervisor");
    }
    result
}

/// Opens `path` itself (`O_PATH | O_NOFOLLOW`): a symbolic link is [`PeerError::Link`], a
/// missing path the `NotFound` error `connect` would give.
fn open_socket_nofollow(path: &Path) -> Result<std::os::fd::OwnedFd, ConnectError> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(path, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| ConnectError::Io { socket: path.to_path_buf(), source: e.into() })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| ConnectError::Io { socket: path.to_path_buf(), source: e.into() })?;
    match rustix::fs::FileType::from_raw_mode(st.st_mode) {
        rustix::fs::FileType::Socket => Ok(fd),
        rustix::fs::FileType::Symlink => Err(PeerError::Link { socket: path.to_path_buf() }.into()),
        _ => Err(ConnectError::Io {
            socket: path.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
        }),
    }
}

/// Checks that the peer of the connected `stream` (to `path`) is `expected`.
pub fn verify(stream: &impl AsFd, path: &Path, expected: Peer) -> Result<(), PeerError> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials)
        .map_err(|source| PeerError::Credentials { socket: path.to_path_buf(), source })?;
    let (found_pid, found_uid) = (u32::try_from(cred.pid()).unwrap_or(0), cred.uid());
    let ok = match expected {
        Peer::Pid(p) => p != 0 && found_pid == p,
        Peer::Uid(u) => found_uid == u,
    };
    if ok {
        Ok(())
    } else {
        Err(PeerError::Mismatch { socket: path.to_path_buf(), expected, found_pid, found_uid })
    }
}

/// The [`PeerError`] somewhere in `e`'s source chain (a [`ConnectError`] or a `PeerError`,
/// directly or inside an `io::Error`), e.g. from a connector behind an HTTP client.
pub fn find_in(e: &(dyn std::error::Error + 'static)) -> Option<PeerError> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(p) = c.downcast_ref::<PeerError>() {
            return Some(p.clone());
        }
        if let Some(ConnectError::Peer(p)) = c.downcast_ref::<ConnectError>() {
            return Some(p.clone());
        }
        if let Some(p) =
            c.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).and_then(|i| i.downcast_ref::<PeerError>())
        {
            return Some(p.clone());
        }
        cur = c.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(expected: Peer) -> PeerCheck {
        PeerCheck { vm: VmId::new("peer-test").expect("id"), expected }
    }

    #[tokio::test]
    async fn checks_the_listener_and_refuses_links() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("s.sock");
        let _l = tokio::net::UnixListener::bind(&sock).expect("bind");
        let me = std::process::id();
        let uid = rustix::process::geteuid().as_raw();
        connect(&sock, Some(&check(Peer::Pid(me)))).await.expect("our own socket");
        connect(&sock, Some(&check(Peer::Uid(uid)))).await.expect("our own uid");
        connect(&sock, None).await.expect("unchecked");
        match connect(&sock, Some(&check(Peer::Pid(me + 1)))).await {
            Err(ConnectError::Peer(PeerError::Mismatch { expected, found_pid, found_uid, .. })) => {
                assert_eq!((expected, found_pid, found_uid), (Peer::Pid(me + 1), me, uid));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            connect(&sock, Some(&check(Peer::Pid(0)))).await,
            Err(ConnectError::Peer(PeerError::Mismatch { .. }))
        ));
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&sock, &link).expect("symlink");
        assert!(matches!(
            connect(&link, Some(&check(Peer::Pid(me)))).await,
            Err(ConnectError::Peer(PeerError::Link { .. }))
        ));
        // Missing or not a socket: the ordinary connect failures.
        let missing = connect(&dir.path().join("none.sock"), Some(&check(Peer::Pid(me)))).await;
        assert!(
            matches!(&missing, Err(ConnectError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound)
        );
        std::fs::write(dir.path().join("file"), b"").expect("file");
        assert!(matches!(
            connect(&dir.path().join("file"), Some(&check(Peer::Pid(me)))).await,
            Err(ConnectError::Io { .. })
        ));
        let e = ConnectError::Peer(PeerError::Link { socket: link.clone() }).into_io();
        assert_eq!(find_in(&e), Some(PeerError::Link { socket: link }));
    }
}

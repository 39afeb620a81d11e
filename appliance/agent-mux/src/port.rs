//! The guest's virtio-serial agent port: find it by name, open it non-blocking, async IO on it.
//!
//! There is no udev in the guest: `/sys/class/virtio-ports/vportXpY/name` holds the port name and
//! the device node is `/dev/vportXpY`. With the host side closed, `read()` returns 0 and
//! `poll()` reports `POLLHUP`; [`PortDevice::wait_host`] polls for that every 50 ms instead of
//! spinning.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::guest::HostPort;

/// How often [`PortDevice::wait_host`] re-checks for a host.
pub const HOST_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Errors locating or opening the port.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// No `/sys/class/virtio-ports/*/name` holds that name.
    #[error("no virtio-serial port named {name:?} under {sys}")]
    NotFound {
        /// The port name.
        name: String,
        /// The sysfs class dir searched.
        sys: PathBuf,
    },
    /// Reading sysfs failed.
    #[error("listing {0}")]
    Sysfs(PathBuf, #[source] std::io::Error),
    /// Opening the device node failed.
    #[error("opening {0}")]
    Open(PathBuf, #[source] std::io::Error),
}

/// The sysfs class directory of virtio-serial ports.
pub const SYS_VIRTIO_PORTS: &str = "/sys/class/virtio-ports";

/// Finds the device node of the port called `name` (e.g. `/dev/vport1p1`).
pub fn find(name: &str) -> Result<PathBuf, PortError> {
    find_in(Path::new(SYS_VIRTIO_PORTS), Path::new("/dev"), name)
}

/// [`find`] with injectable sysfs and /dev roots.
pub fn find_in(sys: &Path, dev: &Path, name: &str) -> Result<PathBuf, PortError> {
    let entries = std::fs::read_dir(sys).map_err(|e| PortError::Sysfs(sys.to_path_buf(), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| PortError::Sysfs(sys.to_path_buf(), e))?;
        let Ok(n) = std::fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if n.trim_end() == name {
            return Ok(dev.join(entry.file_name()));
        }
    }
    Err(PortError::NotFound { name: name.to_string(), sys: sys.to_path_buf() })
}

/// An open virtio-serial port (non-blocking, driven by tokio's reactor).
#[derive(Debug)]
pub struct PortDevice {
    fd: AsyncFd<OwnedFd>,
}

impl PortDevice {
    /// Opens `path` read-write, non-blocking, close-on-exec. Must run inside a tokio runtime.
    pub fn open(path: &Path) -> Result<Self, PortError> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
            .open(path)
            .map_err(|e| PortError::Open(path.to_path_buf(), e))?;
        let fd = register(OwnedFd::from(f)).map_err(|e| PortError::Open(path.to_path_buf(), e))?;
        Ok(PortDevice { fd })
    }

    /// Finds the port called `name` and opens it.
    pub fn open_named(name: &str) -> Result<Self, PortError> {
        Self::open(&find(name)?)
    }

    /// `poll()`s the fd once without blocking; returns its `revents`.
    fn poll_now(&self) -> std::io::Result<libc::c_short> {
        let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN | libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, count 1, timeout 0 (no blocking); the fd is open while self lives.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(p.revents)
    }
}

/// Registers an owned fd with tokio's reactor.
fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open fd and always returns the same raw fd; the AsyncFd owns
    // it, so it stays open for the AsyncFd's whole lifetime.
    unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
}

impl HostPort for PortDevice {
    async fn wait_host(&mut self) -> std::io::Result<()> {
        let mut logged = false;
        loop {
            let rev = self.poll_now()?;
            if rev & libc::POLLHUP == 0 {
                return Ok(());
            }
            if !logged {
                tracing::info!("agent port: host not connected; waiting");
                logged = true;
            }
            tokio::time::sleep(HOST_POLL_INTERVAL).await;
        }
    }
}

impl AsyncRead for PortDevice {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(g) => g?,
                Poll::Pending => return Poll::Pending,
            };
            let unfilled = buf.initialize_unfilled();
            let res = guard.try_io(|fd| {
                // SAFETY: reads into an initialised buffer of the given length from an open fd.
                let n = unsafe { libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len()) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PortDevice {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        loop {
            let mut guard = match self.fd.poll_write_ready(cx) {
                Poll::Ready(g) => g?,
                Poll::Pending => return Poll::Pending,
            };
            let res = guard.try_io(|fd| {
                // SAFETY: writes from a valid slice to an open fd.
                let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_port_by_name() {
        let sys = tempfile::tempdir().expect("tempdir");
        for (d, n) in [("vport0p0", "org.qemu.guest_agent.0\n"), ("vport1p1", "org.chrysalis.agent.0\n")] {
            std::fs::create_dir(sys.path().join(d)).expect("mkdir");
            std::fs::write(sys.path().join(d).join("name"), n).expect("write");
        }
        std::fs::create_dir(sys.path().join("vport2p0")).expect("nameless port");
        let p = find_in(sys.path(), Path::new("/dev"), crate::AGENT_PORT_NAME).expect("found");
        assert_eq!(p, Path::new("/dev/vport1p1"));
        assert!(matches!(find_in(sys.path(), Path::new("/dev"), "x"), Err(PortError::NotFound { .. })));
        assert!(matches!(find_in(Path::new("/nonexistent"), Path::new("/dev"), "x"), Err(PortError::Sysfs(..))));
    }

    #[tokio::test]
    async fn async_io_on_a_socketpair_fd() {
        // A socketpair stands in for the char device: same read/write/poll semantics for EOF and HUP.
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        a.set_nonblocking(true).expect("nonblock");
        let mut dev = PortDevice { fd: register(OwnedFd::from(a)).expect("asyncfd") };
        dev.wait_host().await.expect("peer connected: no HUP");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        dev.write_all(b"ping").await.expect("write");
        let mut b = tokio::net::UnixStream::from_std({
            b.set_nonblocking(true).expect("nonblock");
            b
        })
        .expect("tokio stream");
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
        b.write_all(b"pong").await.expect("write");
        dev.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"pong");
        drop(b);
        let mut rest = Vec::new();
        dev.read_to_end(&mut rest).await.expect("eof");
        assert!(rest.is_empty());
        // Peer gone: POLLHUP, so wait_host keeps waiting.
        let waited = tokio::time::timeout(Duration::from_millis(200), dev.wait_host()).await;
        assert!(waited.is_err(), "wait_host must wait while the host is gone");
    }
}

//! QMP client on the [`qapi`] crate (typed commands generated from QEMU's schema, tokio 1).
//!
//! One short-lived connection per operation: QEMU's QMP socket serves one client at a time,
//! and reconnecting per call makes re-attaching after our own restart trivial.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use qapi::futures::{QapiService, QmpStreamTokio};
use qapi::qmp;
use tokio::io::WriteHalf;
use tokio::net::UnixStream;

/// Errors talking QMP.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Connecting or negotiating capabilities failed.
    #[error("connecting to QMP at {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU answered a command with an error.
    #[error("QMP {command}: {message}")]
    Command {
        /// The command.
        command: &'static str,
        /// QEMU's error description.
        message: String,
    },
    /// The connection broke during a command.
    #[error("QMP {command}: connection")]
    Io {
        /// The command.
        command: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("QMP {0}: timed out")]
    Timeout(&'static str),
}

type Service = QapiService<QmpStreamTokio<WriteHalf<UnixStream>>>;

/// The longest line read from QEMU on any connection: its replies are at most a few KiB, and
/// a QEMU a guest took over must not grow the driver's memory.
pub const MAX_LINE: usize = 64 * 1024;

/// QEMU's side of a connection, failing with `InvalidData` once more than `cap` bytes arrive
/// without a newline (the JSON-lines codec above it would otherwise buffer without end).
struct LineCapped<R> {
    inner: R,
    since_newline: usize,
    cap: usize,
}

impl<R> LineCapped<R> {
    fn new(inner: R, cap: usize) -> Self {
        LineCapped { inner, since_newline: 0, cap }
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for LineCapped<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let fresh = &buf.filled()[before..];
        let since = match fresh.iter().rposition(|b| *b == b'\n') {
            Some(i) => fresh.len() - i - 1,
            None => self.since_newline.saturating_add(fresh.len()),
        };
        self.since_newline = since;
        if since > self.cap {
            let msg = format!("a QMP line longer than {} bytes", self.cap);
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg)));
        }
        Poll::Ready(Ok(()))
    }
}

/// A negotiated QMP connection.
pub struct Qmp {
    svc: Service,
    task: tokio::task::JoinHandle<()>,
}

/// Per-command timeout.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Qmp {
    /// Connects and negotiates capabilities, within `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let connect = async {
            let (r, w) = tokio::io::split(UnixStream::connect(path).await?);
            let s = QmpStreamTokio::open_split(LineCapped::new(r, MAX_LINE), w).await?;
            let s = s.negotiate().await?;
            Ok::<_, std::io::Error>(s.spawn_tokio())
        };
        let (svc, task) = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| QmpError::Connect { path: path.to_path_buf(), source: std::io::ErrorKind::TimedOut.into() })?
            .map_err(|source| QmpError::Connect { path: path.to_path_buf(), source })?;
        Ok(Qmp { svc, task })
    }

    async fn run<C>(&self, name: &'static str, c: C) -> Result<C::Ok, QmpError>
    where
        C: qapi::Command + qmp::QmpCommand,
    {
        match tokio::time::timeout(COMMAND_TIMEOUT, self.svc.execute(c)).await {
            Err(_) => Err(QmpError::Timeout(name)),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(qapi::ExecuteError::Qapi(e))) => Err(QmpError::Command { command: name, message: e.desc }),
            Ok(Err(qapi::ExecuteError::Io(source))) => Err(QmpError::Io { command: name, source }),
        }
    }

    /// `device_del` (a SCSI disk leaves at once; no guest acknowledgement).
    pub async fn device_del(&self, id: &str) -> Result<(), QmpError> {
        self.run("device_del", qmp::device_del { id: id.to_string() }).await.map(|_| ())
    }

    /// `blockdev-del`.
    pub async fn blockdev_del(&self, node: &str) -> Result<(), QmpError> {
        self.run("blockdev-del", qmp::blockdev_del { node_name: node.to_string() }).await.map(|_| ())
    }

    /// `remove-fd` of a whole fd set.
    pub async fn remove_fdset(&self, set: i64) -> Result<(), QmpError> {
        self.run("remove-fd", qmp::remove_fd { fdset_id: set, fd: None }).await.map(|_| ())
    }

    /// `query-status`.
    pub async fn status(&self) -> Result<qmp::StatusInfo, QmpError> {
        self.run("query-status", qmp::query_status {}).await
    }

    /// `stop` (pause vCPUs).
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.run("stop", qmp::stop {}).await.map(drop)
    }

    /// `cont` (resume vCPUs).
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.run("cont", qmp::cont {}).await.map(drop)
    }

    /// `system_powerdown` (ACPI power button).
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.run("system_powerdown", qmp::system_powerdown {}).await.map(drop)
    }

    /// `quit`.
    pub async fn quit(&self) -> Result<(), QmpError> {
        self.run("quit", qmp::quit {}).await.map(drop)
    }

    /// `migrate-set-capabilities` for one capability.
    pub async fn set_capability(&self, cap: qmp::MigrationCapability, on: bool) -> Result<(), QmpError> {
        let c = qmp::migrate_set_capabilities {
            capabilities: vec![qmp::MigrationCapabilityStatus { capability: cap, state: on }],
        };
        self.run("migrate-set-capabilities", c).await.map(drop)
    }

    /// `x-ignore-shared`: a migration skips (outgoing) or expects no pages of (incoming) the
    /// RAM mapped shared from a file (the golden's RAM, [`crate::driver::Ram::SharedFile`]).
    pub async fn ignore_shared(&self, on: bool) -> Result<(), QmpError> {
        self.set_capability(qmp::MigrationCapability::x_ignore_shared, on).await
    }

    /// `migrate` to `uri` (returns at once; poll [`Qmp::migration`]).
    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        let c = qmp::migrate { uri: Some(uri.to_string()), channels: None, detach: None, resume: None };
        self.run("migrate", c).await.map(drop)
    }

    /// `migrate-incoming` from `uri` (QEMU started with `-incoming defer`).
    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        let c = qmp::migrate_incoming { uri: Some(uri.to_string()), channels: None, exit_on_error: None };
        self.run("migrate-incoming", c).await.map(drop)
    }

    /// `query-migrate`: `(status, error description)`.
    pub async fn migration(&self) -> Result<(Option<qmp::MigrationStatus>, Option<String>), QmpError> {
        let i = self.run("query-migrate", qmp::query_migrate {}).await?;
        Ok((i.status, i.error_desc))
    }
}

/// Hands `fd` to QEMU (`getfd`, the descriptor in an `SCM_RIGHTS` message) and starts
/// `migrate fd:<name>` into it, on one connection of its own (QEMU looks named descriptors up
/// on the monitor that received them). Returns once the migration started; poll
/// [`Qmp::migration`]. QEMU is sandboxed (`spawn=deny`, no access to our directories), so a
/// migration stream is always a descriptor the driver opened.
pub async fn migrate_to_fd(path: &Path, fd: OwnedFd, timeout: Duration) -> Result<(), QmpError> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || raw::migrate_to_fd(&path, fd, timeout))
        .await
        .map_err(|e| QmpError::Io { command: "getfd", source: std::io::Error::other(e) })?
}

/// Sends `fd` with the command `first`, then runs `rest`, on one connection of its own (see
/// [`raw::with_fd`]); how a volume's image reaches the sandboxed QEMU (`add-fd`).
pub async fn with_fd(
    path: &Path,
    fd: OwnedFd,
    first: (&'static str, String),
    rest: Vec<(&'static str, String)>,
    timeout: Duration,
) -> Result<(), QmpError> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let rest: Vec<(&'static str, &str)> = rest.iter().map(|(n, t)| (*n, t.as_str())).collect();
        raw::with_fd(&path, fd, (first.0, &first.1), &rest, timeout)
    })
    .await
    .map_err(|e| QmpError::Io { command: first.0, source: std::io::Error::other(e) })?
}

/// A minimal blocking QMP client: the one place that sends a descriptor.
mod raw {
    use std::io::{BufRead, BufReader, IoSlice, Read, Write};
    use std::mem::MaybeUninit;
    use std::os::fd::{AsFd, OwnedFd};
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::time::Duration;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    use super::QmpError;

    /// The name the migration descriptor gets in QEMU.
    pub const FD_NAME: &str = "chrysalis-migration";

    fn io(command: &'static str) -> impl Fn(std::io::Error) -> QmpError {
        move |source| QmpError::Io { command, source }
    }

    /// The longest line read from QEMU ([`super::MAX_LINE`]).
    pub const MAX_LINE: u64 = super::MAX_LINE as u64;

    /// One line of at most [`MAX_LINE`] bytes.
    fn line(r: &mut BufReader<UnixStream>, command: &'static str) -> Result<String, QmpError> {
        let mut line = String::new();
        let n = r.by_ref().take(MAX_LINE).read_line(&mut line).map_err(io(command))?;
        if n == 0 {
            return Err(io(command)(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if !line.ends_with('\n') && n as u64 >= MAX_LINE {
            return Err(io(command)(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a QMP line longer than {MAX_LINE} bytes"),
            )));
        }
        Ok(line)
    }

    /// Reads lines until a reply (`return` or `error`), skipping events.
    fn reply(r: &mut BufReader<UnixStream>, command: &'static str) -> Result<(), QmpError> {
        loop {
            let line = line(r, command)?;
            let v: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| io(command)(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
            if v.get("return").is_some() {
                return Ok(());
            }
            if let Some(e) = v.get("error") {
                let message = e.get("desc").and_then(|d| d.as_str()).unwrap_or("unknown error").to_string();
                return Err(QmpError::Command { command, message });
            }
        }
    }

    pub fn migrate_to_fd(path: &Path, fd: OwnedFd, timeout: Duration) -> Result<(), QmpError> {
        let getfd = format!("{{\"execute\":\"getfd\",\"arguments\":{{\"fdname\":\"{FD_NAME}\"}}}}\n");
        let migrate = format!("{{\"execute\":\"migrate\",\"arguments\":{{\"uri\":\"fd:{FD_NAME}\"}}}}\n");
        with_fd(path, fd, ("getfd", &getfd), &[("migrate", &migrate)], timeout)
    }

    /// On one fresh connection: sends `first` with `fd` attached, then each of `rest`, each
    /// after the previous one's reply. Lines are `(name for errors, JSON + newline)`.
    pub fn with_fd(
        path: &Path,
        fd: OwnedFd,
        first: (&'static str, &str),
        rest: &[(&'static str, &str)],
        timeout: Duration,
    ) -> Result<(), QmpError> {
        let connect = |source| QmpError::Connect { path: path.to_path_buf(), source };
        let s = UnixStream::connect(path).map_err(connect)?;
        s.set_read_timeout(Some(timeout)).map_err(connect)?;
        s.set_write_timeout(Some(timeout)).map_err(connect)?;
        let mut w = s.try_clone().map_err(connect)?;
        let mut r = BufReader::new(s);
        line(&mut r, "greeting")?;
        w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n").map_err(io("qmp_capabilities"))?;
        reply(&mut r, "qmp_capabilities")?;
        let (name, text) = first;
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        cmsg.push(SendAncillaryMessage::ScmRights(&fds));
        let sent = rustix::net::sendmsg(&w, &[IoSlice::new(text.as_bytes())], &mut cmsg, SendFlags::empty())
            .map_err(|e| io(name)(e.into()))?;
        if sent != text.len() {
            w.write_all(&text.as_bytes()[sent..]).map_err(io(name))?;
        }
        drop(fd);
        reply(&mut r, name)?;
        for (name, text) in rest {
            w.write_all(text.as_bytes()).map_err(io(name))?;
            reply(&mut r, name)?;
        }
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn an_endless_line_from_qemu_stops_at_the_cap() {
            let (ours, mut theirs) = UnixStream::pair().expect("pair");
            let writer = std::thread::spawn(move || {
                // More than the cap, no newline; the write fails once we hang up.
                let _ = theirs.write_all(&vec![b'x'; (MAX_LINE * 2) as usize]);
            });
            let mut r = BufReader::new(ours);
            match reply(&mut r, "getfd") {
                Err(QmpError::Io { command: "getfd", source }) => {
                    assert_eq!(source.kind(), std::io::ErrorKind::InvalidData, "{source}")
                }
                other => panic!("{other:?}"),
            }
            drop(r);
            writer.join().expect("writer");
        }

        #[test]
        fn events_are_skipped_until_the_reply() {
            let (ours, mut theirs) = UnixStream::pair().expect("pair");
            theirs.write_all(b"{\"event\":\"STOP\"}\n{\"error\":{\"desc\":\"no such fd\"}}\n").expect("write");
            let mut r = BufReader::new(ours);
            match reply(&mut r, "getfd") {
                Err(QmpError::Command { command, message }) => {
                    assert_eq!((command, message.as_str()), ("getfd", "no such fd"))
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_long_lived_client_stops_an_endless_line_at_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let qemu = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            // A greeting, then a line that never ends.
            let _ = s.write_all(b"{\"QMP\":{\"version\":{\"qemu\":{\"micro\":0,\"minor\":2,\"major\":8},\"package\":\"\"},\"capabilities\":[]}}\n").await;
            let chunk = vec![b' '; 16 * 1024];
            let mut sent = 0usize;
            while sent < 4 * MAX_LINE {
                if s.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            sent
        });
        let r = Qmp::connect(&path, Duration::from_secs(10)).await;
        let e = r.err().expect("no connection past an endless line");
        let source = match &e {
            QmpError::Connect { source, .. } => source,
            other => panic!("{other:?}"),
        };
        assert_eq!(source.kind(), std::io::ErrorKind::InvalidData, "{e:?}: {source}");
        assert!(source.to_string().contains("longer than 65536 bytes"), "{source}");
        let sent = qemu.await.expect("fake qemu");
        assert!(sent < 4 * MAX_LINE, "the client kept reading ({sent} bytes)");
    }

    #[tokio::test]
    async fn lines_under_the_cap_pass_whole() {
        let (a, mut b) = tokio::io::duplex(1024);
        let line = format!("{}\n", "y".repeat(MAX_LINE - 1));
        let writer = tokio::spawn(async move {
            for _ in 0..3 {
                b.write_all(line.as_bytes()).await.expect("write");
            }
        });
        let mut r = tokio::io::BufReader::new(LineCapped::new(a, MAX_LINE));
        for _ in 0..3 {
            let mut got = String::new();
            r.read_line(&mut got).await.expect("a line at the cap");
            assert_eq!(got.len(), MAX_LINE);
        }
        writer.await.expect("writer");
    }
}

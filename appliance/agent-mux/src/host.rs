//! Host end: one mux session over QEMU's agent chardev socket; opens streams to guest ports.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::TokioAsyncReadCompatExt;

use crate::connect_line::{self, ConnectLineError};
use crate::decouple::Decoupled;
use crate::preamble::{self, PreambleError};
use crate::rewind::Rewind;
use crate::MuxStream;

/// Default time the guest has to answer the session preamble.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the first connection waits for the guest's READY before dialling again.
pub const FIRST_ATTEMPT: Duration = Duration::from_secs(4);
/// Time the guest has to answer `CONNECT` on a new stream.
pub const CONNECT_REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the host end.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Connecting to the chardev socket failed.
    #[error("connecting to {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The session preamble failed.
    #[error("session preamble")]
    Preamble(#[from] PreambleError),
    /// The mux session ended (guest gone, port closed, protocol error).
    #[error("mux session closed")]
    Closed,
    /// yamux could not open a stream.
    #[error("opening a mux stream")]
    Open(#[source] yamux::ConnectionError),
    /// Writing `CONNECT` failed.
    #[error("sending CONNECT {port}")]
    Io {
        /// The guest port.
        port: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Nothing listens on that guest port (the guest closed the stream).
    #[error("guest port {0} refused the connection")]
    Refused(u32),
    /// The guest's reply to `CONNECT` was malformed.
    #[error("bad reply to CONNECT {port}")]
    BadReply {
        /// The guest port.
        port: u32,
        /// The cause.
        #[source]
        source: ConnectLineError,
    },
    /// The guest did not answer `CONNECT` in time.
    #[error("guest port {0}: no reply to CONNECT within {CONNECT_REPLY_TIMEOUT:?}")]
    ReplyTimeout(u32),
}

type OpenReply = oneshot::Sender<Result<yamux::Stream, yamux::ConnectionError>>;

struct Inner {
    tx: mpsc::Sender<OpenReply>,
}

/// A host-side mux session. Cheap to clone; the session ends when the connection breaks or
/// when every clone and every stream opened from it is dropped.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("closed", &self.is_closed()).finish()
    }
}

impl Session {
    /// Connects to QEMU's chardev Unix socket and starts a fresh session
    /// (waiting up to [`DEFAULT_HELLO_TIMEOUT`] for the guest).
    pub async fn connect(path: &Path) -> Result<Session, SessionError> {
        Self::connect_with_timeout(path, DEFAULT_HELLO_TIMEOUT).await
    }

    /// [`Session::connect`] with an explicit preamble timeout.
    ///
    /// A connection whose preamble stalls is dropped and made again (with a fresh nonce),
    /// first after [`FIRST_ATTEMPT`], then after twice as long each time, until `hello_timeout`
    /// is spent. Hanging up and dialling again is what resets both ends: QEMU forgets the
    /// port's state for the old client and the guest sees the host leave and come back, so a
    /// marker lost while the VM was paused or the previous host died cannot wedge the session.
    pub async fn connect_with_timeout(path: &Path, hello_timeout: Duration) -> Result<Session, SessionError> {
        let deadline = tokio::time::Instant::now() + hello_timeout;
        let mut budget = FIRST_ATTEMPT;
        loop {
            let s = UnixStream::connect(path)
                .await
                .map_err(|source| SessionError::Connect { path: path.to_path_buf(), source })?;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let last = left <= budget;
            match Self::over(s, if last { left } else { budget }).await {
                Err(SessionError::Preamble(PreambleError::Timeout(_) | PreambleError::Closed)) if !last => {
                    tracing::info!(path = %path.display(), ?budget, "no session yet; dialling the guest again");
                    budget = budget.saturating_mul(2);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(SessionError::Preamble(PreambleError::Timeout(_))) => {
                    return Err(SessionError::Preamble(PreambleError::Timeout(hello_timeout)))
                }
                other => return other,
            }
        }
    }

    /// Starts a session over any byte stream (tests use a duplex pipe).
    pub async fn over<T>(mut io: T, hello_timeout: Duration) -> Result<Session, SessionError>
    where
        T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let rest = preamble::host(&mut io, hello_timeout).await?;
        let conn = yamux::Connection::new(
            Rewind::new(rest, Decoupled::new(io)).compat(),
            crate::yamux_config(),
            yamux::Mode::Client,
        );
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(drive(conn, rx));
        Ok(Session { inner: Arc::new(Inner { tx }) })
    }

    /// Whether the session has ended.
    pub fn is_closed(&self) -> bool {
        self.inner.tx.is_closed()
    }

    /// Opens a stream to guest `port`: sends `CONNECT <port>\n`, expects `OK …\n`.
    pub async fn open(&self, port: u32) -> Result<MuxStream, SessionError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        self.inner.tx.send(reply_tx).await.map_err(|_| SessionError::Closed)?;
        let raw = reply_rx.await.map_err(|_| SessionError::Closed)?.map_err(SessionError::Open)?;
        let keep: Arc<dyn Send + Sync> = self.inner.clone();
        let mut s = MuxStream::new(raw, Some(keep));
        s.write_all(connect_line::connect(port).as_bytes())
            .await
            .map_err(|source| SessionError::Io { port, source })?;
        let line = tokio::time::timeout(CONNECT_REPLY_TIMEOUT, connect_line::read_line(&mut s))
            .await
            .map_err(|_| SessionError::ReplyTimeout(port))?;
        match line {
            Ok(l) => connect_line::check_ok(&l).map_err(|source| SessionError::BadReply { port, source })?,
            Err(ConnectLineError::Closed) => return Err(SessionError::Refused(port)),
            Err(ConnectLineError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(SessionError::Refused(port))
            }
            Err(source) => return Err(SessionError::BadReply { port, source }),
        }
        Ok(s)
    }
}

/// Owns the yamux connection: serves open requests, refuses inbound streams, drives all IO.
async fn drive<T>(mut conn: yamux::Connection<T>, mut rx: mpsc::Receiver<OpenReply>)
where
    T: futures::AsyncRead + futures::AsyncWrite + Unpin,
{
    let mut pending: VecDeque<OpenReply> = VecDeque::new();
    let result = futures::future::poll_fn(|cx| {
        loop {
            match rx.poll_recv(cx) {
                Poll::Ready(Some(r)) => pending.push_back(r),
                Poll::Ready(None) => return Poll::Ready(Ok(false)),
                Poll::Pending => break,
            }
        }
        while !pending.is_empty() {
            match conn.poll_new_outbound(cx) {
                Poll::Ready(r) => {
                    let failed = r.is_err();
                    if let Some(reply) = pending.pop_front() {
                        let _ = reply.send(r);
                    }
                    if failed {
                        return Poll::Ready(Ok(true));
                    }
                }
                Poll::Pending => break,
            }
        }
        loop {
            match conn.poll_next_inbound(cx) {
                // The guest never opens streams; dropping resets it.
                Poll::Ready(Some(Ok(s))) => drop(s),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => return Poll::Ready(Ok(true)),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await;
    match result {
        Ok(false) => {
            // Every handle and stream is gone: close politely.
            let _ = futures::future::poll_fn(|cx| conn.poll_close(cx)).await;
            tracing::debug!("mux session closed by host");
        }
        Ok(true) => tracing::info!("mux session ended by the guest"),
        Err(e) => tracing::warn!(error = %e, "mux session failed"),
    }
    // Dropping `rx` makes `is_closed()` true; pending openers see `Closed`.
}

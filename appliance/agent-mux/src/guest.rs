//! Guest end: serve mux sessions on the agent port, hand each accepted stream to a [`Handler`].
//!
//! [`serve`] runs one session: the preamble, then yamux as server. Each inbound stream must
//! start with `CONNECT <port>\n`; if the handler [`accepts`](Handler::accepts) the port the guest
//! answers `OK <port>\n` and calls [`Handler::handle`], else it closes the stream. When the
//! session ends (EOF / hang-up / protocol error / a new host's HELLO) every stream task of that
//! session is aborted. [`run`] loops: wait for a host, serve, repeat.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinSet;
use tokio_util::compat::TokioAsyncReadCompatExt;

use crate::connect_line;
use crate::decouple::Decoupled;
use crate::preamble::{self, PreambleError};
use crate::rewind::Rewind;
use crate::MuxStream;

/// Time a new stream has to send its `CONNECT` line.
pub const CONNECT_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// A boxed future returned by [`Handler::handle`].
pub type HandlerFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What the guest serves on each port.
pub trait Handler: Send + Sync + 'static {
    /// Whether something listens on `port`.
    fn accepts(&self, port: u32) -> bool;
    /// Serves one accepted stream (the `OK` line is already sent). Aborted when the session ends.
    fn handle(&self, port: u32, stream: MuxStream) -> HandlerFuture;
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The preamble failed (port closed before a session started).
    #[error("session preamble")]
    Preamble(#[from] PreambleError),
    /// The yamux session failed (e.g. a new host's HELLO hit a stale session).
    #[error("mux session")]
    Mux(#[from] yamux::ConnectionError),
}

/// Serves one mux session on `io` until the host goes away. `Ok(())` = clean end of stream.
pub async fn serve<T>(mut io: T, handler: Arc<dyn Handler>) -> Result<(), ServeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let rest = preamble::guest(&mut io).await?;
    tracing::info!("mux session started");
    let mut conn = yamux::Connection::new(
        Rewind::new(rest, Decoupled::new(io)).compat(),
        crate::yamux_config(),
        yamux::Mode::Server,
    );
    let mut tasks: JoinSet<()> = JoinSet::new();
    let end = loop {
        tokio::select! {
            next = futures::future::poll_fn(|cx| conn.poll_next_inbound(cx)) => match next {
                Some(Ok(s)) => {
                    let h = handler.clone();
                    tasks.spawn(accept(MuxStream::new(s, None), h));
                }
                Some(Err(e)) => break Err(ServeError::Mux(e)),
                None => break Ok(()),
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    };
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    tracing::info!(clean = end.is_ok(), "mux session ended; its streams are dropped");
    end
}

async fn accept(mut s: MuxStream, handler: Arc<dyn Handler>) {
    let line = match tokio::time::timeout(CONNECT_LINE_TIMEOUT, connect_line::read_line(&mut s)).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            tracing::debug!(stream = s.id(), error = %e, "bad CONNECT line");
            return;
        }
        Err(_) => {
            tracing::debug!(stream = s.id(), "no CONNECT line in time");
            return;
        }
    };
    let port = match connect_line::parse_connect(&line) {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(stream = s.id(), error = %e, "bad CONNECT line");
            return;
        }
    };
    if !handler.accepts(port) {
        tracing::debug!(port, "nothing listens on port; closing stream");
        let _ = s.shutdown().await;
        return;
    }
    if s.write_all(connect_line::ok(port).as_bytes()).await.is_err() {
        return;
    }
    handler.handle(port, s).await;
}

/// A byte stream to the host that can tell whether a host is connected.
pub trait HostPort: AsyncRead + AsyncWrite + Unpin + Send {
    /// Resolves once a host is connected (virtio-serial: no POLLHUP), polling without spinning.
    fn wait_host(&mut self) -> impl Future<Output = std::io::Result<()>> + Send;
}

/// Serves sessions on `port` forever: wait for a host, [`serve`], repeat. Returns only if
/// waiting for the host fails.
pub async fn run<P: HostPort>(mut port: P, handler: Arc<dyn Handler>) -> std::io::Result<()> {
    loop {
        port.wait_host().await?;
        match serve(&mut port, handler.clone()).await {
            Ok(()) => tracing::info!("host disconnected; waiting for it to reconnect"),
            Err(e) => tracing::warn!(error = %e, "mux session failed; waiting for the host"),
        }
        // Back off a little so a fast failure loop cannot spin.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

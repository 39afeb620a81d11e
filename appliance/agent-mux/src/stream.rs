//! [`MuxStream`]: one multiplexed byte stream (tokio `AsyncRead` + `AsyncWrite`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

/// One stream of a mux session. `shutdown()` half-closes (sends FIN); reads still work.
/// On the host it keeps its session alive while it exists.
pub struct MuxStream {
    inner: Compat<yamux::Stream>,
    _keep: Option<Arc<dyn Send + Sync>>,
}

impl MuxStream {
    pub(crate) fn new(s: yamux::Stream, keep: Option<Arc<dyn Send + Sync>>) -> Self {
        MuxStream {
            inner: s.compat(),
            _keep: keep,
        }
    }

    /// The yamux stream id (odd: host-opened).
    pub fn id(&self) -> u32 {
        self.inner.get_ref().id().val()
    }
}

impl std::fmt::Debug for MuxStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MuxStream({})", self.id())
    }
}

impl AsyncRead for MuxStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for MuxStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

//! [`MuxStream`]: one multiplexed byte stream (tokio `AsyncRead` + `AsyncWrite`).
//!
//! A `yamux::Stream` sends window updates from `poll_read` through the same bounded command
//! sender that `poll_write` uses, and that sender remembers only the last task that waited on it.
//! With the stream split across a reader task and a writer task, the reader's wake-up could be
//! lost and its window update never sent: both ends then wait forever. [`MuxStream`] therefore
//! polls the inner stream with a waker that wakes both the last reader and the last writer.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

/// One stream of a mux session. `shutdown()` half-closes (sends FIN); reads still work.
/// On the host it keeps its session alive while it exists.
pub struct MuxStream {
    inner: Compat<yamux::Stream>,
    wakers: Arc<BothWakers>,
    _keep: Option<Arc<dyn Send + Sync>>,
}

/// The last waker of each direction; waking it wakes both.
#[derive(Default)]
struct BothWakers {
    read: Mutex<Option<Waker>>,
    write: Mutex<Option<Waker>>,
}

impl Wake for BothWakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        for slot in [&self.read, &self.write] {
            let w = slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(w) = w {
                w.wake();
            }
        }
    }
}

impl BothWakers {
    fn register(self: &Arc<Self>, read: bool, cx: &Context<'_>) -> Waker {
        let slot = if read { &self.read } else { &self.write };
        let mut g = slot.lock().unwrap_or_else(|p| p.into_inner());
        if !g.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *g = Some(cx.waker().clone());
        }
        Waker::from(self.clone())
    }
}

impl MuxStream {
    pub(crate) fn new(s: yamux::Stream, keep: Option<Arc<dyn Send + Sync>>) -> Self {
        MuxStream { inner: s.compat(), wakers: Arc::default(), _keep: keep }
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
        let w = self.wakers.register(true, cx);
        Pin::new(&mut self.inner).poll_read(&mut Context::from_waker(&w), buf)
    }
}

impl AsyncWrite for MuxStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let w = self.wakers.register(false, cx);
        Pin::new(&mut self.inner).poll_write(&mut Context::from_waker(&w), buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let w = self.wakers.register(false, cx);
        Pin::new(&mut self.inner).poll_flush(&mut Context::from_waker(&w))
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let w = self.wakers.register(false, cx);
        Pin::new(&mut self.inner).poll_shutdown(&mut Context::from_waker(&w))
    }
}

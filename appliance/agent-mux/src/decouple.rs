//! A write queue in front of the port so that yamux never stops reading because it cannot write.
//!
//! yamux 0.13 stops reading the socket while a Pong waits to be written; if both ends' socket
//! buffers are full of data frames at that moment (bulk transfer both ways), each waits for the
//! other to read: a deadlock. This adapter accepts writes into a queue (flushed whenever the
//! adapter is polled) up to [`QUEUE_CAP`]. The data frames yamux can have in flight are bounded by
//! the credit the peer granted (≤ the connection receive window, [`crate::CONNECTION_WINDOW`]),
//! so the queue stays bounded and never reaches its cap in a healthy session.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most bytes queued before writes push back: the connection window plus room for control frames.
pub const QUEUE_CAP: usize = crate::CONNECTION_WINDOW + 4 * 1024 * 1024;

pub(crate) struct Decoupled<T> {
    inner: T,
    queue: VecDeque<u8>,
}

impl<T: AsyncWrite + Unpin> Decoupled<T> {
    pub(crate) fn new(inner: T) -> Self {
        Decoupled { inner, queue: VecDeque::new() }
    }

    /// Writes queued bytes until the queue is empty (Ready) or the inner writer blocks (Pending).
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.queue.is_empty() {
            let (front, _) = self.queue.as_slices();
            match Pin::new(&mut self.inner).poll_write(cx, front) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    self.queue.drain(..n);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        if self.queue.capacity() > 1024 * 1024 {
            self.queue.shrink_to(64 * 1024);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Decoupled<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        // Make write progress whenever we are polled at all; errors surface on the next write.
        let _ = self.drain(cx);
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Decoupled<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        if let Poll::Ready(Err(e)) = self.drain(cx) {
            return Poll::Ready(Err(e));
        }
        if self.queue.is_empty() {
            // Fast path: straight through when the writer has room.
            if let Poll::Ready(r) = Pin::new(&mut self.inner).poll_write(cx, data) {
                return Poll::Ready(r);
            }
        }
        let room = QUEUE_CAP.saturating_sub(self.queue.len());
        if room == 0 {
            return Poll::Pending; // the inner writer's waker is registered by drain()
        }
        let n = room.min(data.len());
        self.queue.extend(&data[..n]);
        Poll::Ready(Ok(n))
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_flush(cx),
            other => other,
        }
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_shutdown(cx),
            other => other,
        }
    }
}

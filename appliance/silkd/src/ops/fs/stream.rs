//! Streaming replies produced on a blocking thread.
//!
//! [`produce`] runs a producer closure on the blocking pool; the producer pushes items into
//! a [`Sink`] (a bounded channel) and the async side turns each item into a frame and
//! sends it with [`Rpc::send`]. A slow client therefore stalls the producer after `depth`
//! items, and a vanished client makes [`Sink::send`] fail so the producer stops early.
//! [`ChunkWriter`] adapts a `Sink<Vec<u8>>` to `io::Write`, cutting the byte stream into
//! `data` payloads of exactly [`CHUNK`] bytes (the last one shorter).

use super::CHUNK;
use crate::error::OpError;
use crate::rpc::{Rpc, RpcClosed};
use std::io;
use tokio::sync::mpsc;
use wire::Response;

/// The receiving side went away (the client disconnected or the op was dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("reply stream closed")]
pub(crate) struct StreamError;

/// Where a producer puts its items.
pub(crate) struct Sink<T> {
    tx: mpsc::Sender<T>,
}

impl<T> Sink<T> {
    /// Queues one item, blocking while the queue is full.
    pub(crate) fn send(&self, item: T) -> Result<(), StreamError> {
        self.tx.blocking_send(item).map_err(|_| StreamError)
    }
}

/// Runs `producer` on the blocking pool and forwards its items as frames built by
/// `frame`. Returns the producer's result once it has finished and every item was sent.
pub(crate) async fn produce<T, P>(
    rpc: &mut Rpc,
    op: &'static str,
    depth: usize,
    producer: P,
    frame: fn(T) -> Response,
) -> Result<(), OpError>
where
    T: Send + 'static,
    P: FnOnce(Sink<T>) -> Result<(), OpError> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel(depth.max(1));
    let worker = tokio::task::spawn_blocking(move || producer(Sink { tx }));
    while let Some(item) = rx.recv().await {
        if rpc.send(frame(item)).await.is_err() {
            // Unblock the producer (its next send fails) and let it wind down.
            drop(rx);
            let _ = worker.await;
            return Err(RpcClosed.into());
        }
    }
    match worker.await {
        Ok(r) => r,
        Err(e) => Err(OpError::internal(format!("{op}: worker failed: {e}"))),
    }
}

/// The `data` frame for one chunk.
pub(crate) fn data_frame(chunk: Vec<u8>) -> Response {
    Response::Data { data: chunk.into() }
}

/// `io::Write` into a `Sink<Vec<u8>>`, in [`CHUNK`]-sized pieces.
pub(crate) struct ChunkWriter {
    sink: Sink<Vec<u8>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    pub(crate) fn new(sink: Sink<Vec<u8>>) -> Self {
        Self { sink, buf: Vec::with_capacity(CHUNK) }
    }

    fn ship(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.sink.send(chunk).map_err(|e| io::Error::new(io::ErrorKind::BrokenPipe, e))
    }

    /// Sends whatever is buffered.
    pub(crate) fn finish(mut self) -> io::Result<()> {
        self.ship()
    }
}

impl io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = CHUNK - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= CHUNK {
            self.ship()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        // Chunks are shipped when full or at `finish`; flushing early would only make
        // smaller frames.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[tokio::test]
    async fn chunk_writer_cuts_exact_chunks_and_stops_when_the_client_leaves() {
        let (mut rpc, mut peer) = Rpc::pair(2);
        let task = tokio::spawn(async move {
            produce(
                &mut rpc,
                "t",
                2,
                |sink| {
                    let mut w = ChunkWriter::new(sink);
                    w.write_all(&vec![7u8; CHUNK * 2 + 10]).map_err(|e| OpError::internal(e.to_string()))?;
                    w.finish().map_err(|e| OpError::internal(e.to_string()))
                },
                data_frame,
            )
            .await
        });
        let mut sizes = Vec::new();
        while let Some(Response::Data { data }) = peer.out.recv().await {
            sizes.push(data.0.len());
        }
        assert_eq!(sizes, vec![CHUNK, CHUNK, 10]);
        assert!(matches!(task.await, Ok(Ok(()))));

        // A client that goes away mid-stream stops an endless producer.
        let (mut rpc, mut peer) = Rpc::pair(1);
        let task = tokio::spawn(async move {
            produce(
                &mut rpc,
                "t",
                1,
                |sink| {
                    let mut w = ChunkWriter::new(sink);
                    loop {
                        w.write_all(&[1u8; 4096]).map_err(|e| OpError::internal(e.to_string()))?;
                    }
                },
                data_frame,
            )
            .await
        });
        assert!(peer.out.recv().await.is_some());
        drop(peer);
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
        assert!(matches!(r, Ok(Ok(Err(_)))), "producer did not stop: {r:?}");
    }
}

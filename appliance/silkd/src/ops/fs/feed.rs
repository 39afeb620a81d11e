//! Upload feeds: `data`…`data_end` continuation frames handed to a blocking consumer.
//!
//! [`consume`] runs the consumer on the blocking pool and pumps the RPC's input into a
//! bounded channel ([`DEPTH`] chunks), so a slow disk back-pressures the client instead of
//! buffering the upload. The consumer sees the feed as [`FeedRx`] (chunk by chunk) or as
//! an `io::Read` ([`FeedReader`]). A feed that ends without `data_end` or carries a
//! `stdin`/`stdin_close` frame is a bad feed: the consumer sees it as
//! [`FeedError::Truncated`] (so it can discard its partial work) and the op fails with
//! `bad_request`, reported only after the consumer has cleaned up.

use crate::error::OpError;
use crate::rpc::{Input, Rpc};
use std::io;
use tokio::sync::mpsc;

/// Upload chunks in flight between the connection and the disk.
const DEPTH: usize = 4;

/// One step of a feed.
enum Piece {
    Data(Vec<u8>),
    End,
}

/// Why a feed did not end cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FeedError {
    #[error("upload ended before data_end")]
    Truncated,
}

impl From<FeedError> for io::Error {
    fn from(e: FeedError) -> Self {
        io::Error::new(io::ErrorKind::UnexpectedEof, e)
    }
}

/// The consumer's view of the feed, chunk by chunk.
pub(crate) struct FeedRx {
    rx: mpsc::Receiver<Piece>,
    ended: bool,
}

impl FeedRx {
    /// The next chunk, `Ok(None)` after `data_end`, or `Truncated` on a bad feed.
    pub(crate) fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, FeedError> {
        if self.ended {
            return Ok(None);
        }
        match self.rx.blocking_recv() {
            Some(Piece::Data(d)) => Ok(Some(d)),
            Some(Piece::End) => {
                self.ended = true;
                Ok(None)
            }
            None => Err(FeedError::Truncated),
        }
    }
}

/// The feed as a byte stream: EOF at `data_end`, `UnexpectedEof` on a bad feed.
pub(crate) struct FeedReader {
    rx: FeedRx,
    cur: Vec<u8>,
    pos: usize,
}

impl FeedReader {
    pub(crate) fn new(rx: FeedRx) -> Self {
        Self { rx, cur: Vec::new(), pos: 0 }
    }
}

impl io::Read for FeedReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        while self.pos >= self.cur.len() {
            match self.rx.next_chunk()? {
                Some(chunk) => {
                    self.cur = chunk;
                    self.pos = 0;
                }
                None => return Ok(0),
            }
        }
        let avail = &self.cur[self.pos..];
        let n = avail.len().min(out.len());
        out[..n].copy_from_slice(&avail[..n]);
        self.pos += n;
        Ok(n)
    }
}

/// Runs `consumer` over this RPC's upload feed and returns its result; a bad feed wins
/// over whatever the consumer reported (it only saw the truncation).
pub(crate) async fn consume<T, C>(rpc: &mut Rpc, op: &'static str, consumer: C) -> Result<T, OpError>
where
    T: Send + 'static,
    C: FnOnce(FeedRx) -> Result<T, OpError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(DEPTH);
    let worker = tokio::task::spawn_blocking(move || consumer(FeedRx { rx, ended: false }));
    let fed = pump(rpc, op, tx).await;
    let done = match worker.await {
        Ok(r) => r,
        Err(e) => Err(OpError::internal(format!("{op}: worker failed: {e}"))),
    };
    fed?;
    done
}

/// Moves input frames into `tx` until `data_end`, a bad frame, or the consumer quits.
async fn pump(rpc: &mut Rpc, op: &str, tx: mpsc::Sender<Piece>) -> Result<(), OpError> {
    loop {
        match rpc.input().await {
            Some(Input::Data(d)) => {
                if d.is_empty() {
                    continue;
                }
                if tx.send(Piece::Data(d)).await.is_err() {
                    // The consumer stopped early; its own result says why.
                    return Ok(());
                }
            }
            Some(Input::DataEnd) => {
                let _ = tx.send(Piece::End).await;
                return Ok(());
            }
            Some(Input::Stdin(_) | Input::StdinClose) => {
                return Err(OpError::bad_request(format!("{op}: unexpected stdin frame in a data upload")));
            }
            None => return Err(OpError::bad_request(format!("{op}: upload ended before data_end"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[tokio::test]
    async fn reader_sees_eof_at_data_end_and_error_on_truncation() {
        let (mut rpc, peer) = Rpc::pair(8);
        for d in [b"ab".to_vec(), Vec::new(), b"cde".to_vec()] {
            peer.input.send(Input::Data(d)).await.ok();
        }
        peer.input.send(Input::DataEnd).await.ok();
        let got = consume(&mut rpc, "t", |rx| {
            let mut s = Vec::new();
            FeedReader::new(rx).read_to_end(&mut s).map_err(|e| OpError::internal(e.to_string()))?;
            Ok(s)
        })
        .await;
        assert_eq!(got, Ok(b"abcde".to_vec()));

        let (mut rpc, peer) = Rpc::pair(8);
        peer.input.send(Input::Data(b"ab".to_vec())).await.ok();
        drop(peer);
        let mut saw = None;
        let got = consume(&mut rpc, "t", |rx| {
            let mut s = Vec::new();
            let r = FeedReader::new(rx).read_to_end(&mut s);
            Ok(r.map_err(|e| e.kind()))
        })
        .await;
        if let Err(e) = &got {
            saw = Some(e.kind);
        }
        assert_eq!(saw, Some(wire::ErrorKind::BadRequest), "{got:?}");

        let (mut rpc, peer) = Rpc::pair(8);
        peer.input.send(Input::Stdin(b"x".to_vec())).await.ok();
        let got = consume(&mut rpc, "t", |mut rx| Ok(rx.next_chunk().is_err())).await;
        assert_eq!(got.map_err(|e| e.kind), Err(wire::ErrorKind::BadRequest));
    }
}

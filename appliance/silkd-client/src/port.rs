//! `port_forward` as a byte stream: [`port_stream`] returns a [`PortStream`] whose bytes are
//! those of a TCP connection to `127.0.0.1:port` in the guest.
//!
//! A pump task sits between the caller's end of a [`tokio::io::duplex`] pair and the agent
//! connection: the caller's writes go out as `data` frames of at most [`PUMP_CHUNK`] bytes, and
//! its write shutdown as `data_end` (silkd half-closes the guest socket); the guest's `data`
//! frames come back as bytes, and `done` (the guest closed its side) as end of file. A guest
//! `error` frame, a broken connection or a bad frame end the stream: the caller's next read
//! past what arrived, or its next write, fails with that error as an [`std::io::Error`].
//!
//! Memory is bounded: the duplex holds at most [`PUMP_BUFFER`] bytes each way and the pump
//! writes one frame into it before it reads the next, so a caller that stops reading stalls
//! the guest socket.

use crate::{read_frame, write_frame, AgentConn, ClientError};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::oneshot;
use wire::{Bytes64, Request, Response};

/// The largest payload of one outbound `data` frame.
pub const PUMP_CHUNK: usize = 64 * 1024;
/// Bytes the duplex between the caller and the pump holds, each way.
pub const PUMP_BUFFER: usize = 256 * 1024;

/// Why the stream ended abnormally, kept for the caller's next read or write.
type Failure = Arc<Mutex<Option<String>>>;

/// A forwarded guest port as a byte stream (see the module docs).
#[derive(Debug)]
pub struct PortStream {
    io: DuplexStream,
    failure: Failure,
    /// Dropped with the stream: tells the pump to hang up even if the guest never closes.
    _alive: oneshot::Sender<()>,
}

impl PortStream {
    /// The stored failure as an io error, if the pump recorded one.
    fn failure(&self) -> Option<io::Error> {
        let slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|why| io::Error::new(io::ErrorKind::ConnectionAborted, why.clone()))
    }
}

impl AsyncRead for PortStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            // End of file: clean only if the pump saw `done`.
            Poll::Ready(Ok(())) if buf.filled().len() == before => match self.failure() {
                Some(err) => Poll::Ready(Err(err)),
                None => Poll::Ready(Ok(())),
            },
            other => other,
        }
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, data) {
            Poll::Ready(Err(err)) => Poll::Ready(Err(self.failure().unwrap_or(err))),
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Opens `port_forward {port}` on `conn` and waits for `ready` (nothing listening in the guest
/// is [`ClientError::Agent`] `not_found`), then hands the connection to a pump task (see the
/// module docs). The pump ends, and drops the connection, when the guest closed its side or the
/// caller dropped the stream.
pub async fn port_stream<S>(mut conn: AgentConn<S>, port: u16) -> Result<PortStream, ClientError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    conn.send(&Request::PortForward { port }).await?;
    match conn.recv().await? {
        Response::Ready => {}
        other => return Err(crate::unexpected("ready", &other)),
    }
    let (ours, theirs) = tokio::io::duplex(PUMP_BUFFER);
    let failure = Failure::default();
    let slot = Arc::clone(&failure);
    let (alive, gone) = oneshot::channel();
    tokio::spawn(async move {
        if let Err(err) = pump(conn, theirs, gone).await {
            tracing::debug!(port, error = %err, "port stream ended abnormally");
            // Stored before the pump's end of the duplex drops, so the caller's EOF sees it.
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("port {port} in the guest: {err}"));
        }
    });
    Ok(PortStream { io: ours, failure, _alive: alive })
}

/// Moves bytes between `local` and the agent until the guest is done, the caller went away
/// (`gone` resolves), or something broke.
async fn pump<S>(conn: AgentConn<S>, local: DuplexStream, mut gone: oneshot::Receiver<()>) -> Result<(), ClientError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (stream, mut splitter, mut buf) = conn.into_parts();
    let (mut agent_rd, mut agent_wr) = tokio::io::split(stream);
    let (mut local_rd, mut local_wr) = tokio::io::split(local);
    let down = async {
        loop {
            match read_frame(&mut agent_rd, &mut splitter, &mut buf).await? {
                Response::Data { data } => {
                    if local_wr.write_all(&data.0).await.is_err() {
                        // The caller dropped the stream: nobody is left to tell.
                        return Ok(());
                    }
                }
                Response::Done => {
                    let _ = local_wr.shutdown().await;
                    return Ok(());
                }
                Response::Error { kind, message } => return Err(ClientError::Agent { kind, message }),
                other => return Err(crate::unexpected("data", &other)),
            }
        }
    };
    let up = async {
        let mut chunk = vec![0u8; PUMP_CHUNK];
        loop {
            // A read error on a duplex only means the caller's end is gone: treat it as EOF.
            let n = local_rd.read(&mut chunk).await.unwrap_or(0);
            if n == 0 {
                return write_frame(&mut agent_wr, &Request::DataEnd).await;
            }
            write_frame(&mut agent_wr, &Request::Data { data: Bytes64(chunk[..n].to_vec()) }).await?;
        }
    };
    tokio::pin!(down, up);
    let mut up_done = false;
    loop {
        tokio::select! {
            r = &mut down => return r,
            _ = &mut gone => return Ok(()),
            r = &mut up, if !up_done => {
                r?;
                up_done = true;
            }
        }
    }
}

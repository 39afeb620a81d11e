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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_utils::FakeAgent;
    use std::time::Duration;

    #[tokio::test]
    async fn a_guest_error_ends_the_stream_with_an_io_error_after_the_data_before_it() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            agent.accept(80).await;
            agent.send(&Response::Data { data: Bytes64(b"partial".to_vec()) }).await.expect("data");
            let refusal = Response::error(wire::ErrorKind::Internal, "port_forward: connection reset");
            agent.send(&refusal).await.expect("error");
            agent
        });
        let mut stream = port_stream(conn, 80).await.expect("ready");
        let mut got = [0u8; 7];
        stream.read_exact(&mut got).await.expect("the data before the error");
        assert_eq!(&got, b"partial");
        let err = stream.read(&mut [0u8; 16]).await.expect_err("the error, not a clean end of file");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(err.to_string().contains("connection reset"), "{err}");
        let _agent = fake.await.expect("fake agent");
        let err = stream.write_all(&[0u8; 512 * 1024]).await.expect_err("writes fail too");
        assert!(err.to_string().contains("connection reset"), "{err}");
    }

    #[tokio::test]
    async fn a_connection_that_breaks_mid_stream_is_an_error() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move { agent.accept(81).await });
        let mut stream = port_stream(conn, 81).await.expect("ready");
        fake.await.expect("fake agent");
        let err = stream.read(&mut [0u8; 16]).await.expect_err("a dropped connection is not a clean end");
        assert!(err.to_string().contains("closed the connection"), "{err}");
    }

    #[tokio::test]
    async fn outbound_bytes_go_in_bounded_chunks_then_data_end() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            agent.accept(82).await;
            let mut got = Vec::new();
            loop {
                match agent.recv().await {
                    Some(Request::Data { data }) => {
                        assert!(data.0.len() <= PUMP_CHUNK, "a {}-byte frame", data.0.len());
                        got.extend(data.0);
                    }
                    Some(Request::DataEnd) => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
            agent.send(&Response::Done).await.expect("done");
            got
        });
        let mut stream = port_stream(conn, 82).await.expect("ready");
        let payload = vec![9u8; 5 * PUMP_CHUNK + 17];
        stream.write_all(&payload).await.expect("write");
        stream.shutdown().await.expect("shutdown");
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.expect("`done` is a clean end of file");
        assert!(rest.is_empty());
        assert_eq!(fake.await.expect("fake agent"), payload);
    }

    #[tokio::test]
    async fn a_caller_that_stops_reading_stalls_the_guest_and_dropping_the_stream_hangs_up() {
        const FRAME: usize = 4096;
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let (sent_tx, mut sent_rx) = tokio::sync::watch::channel(0usize);
        let fake = tokio::spawn(async move {
            agent.accept(83).await;
            let frame = Response::Data { data: Bytes64(vec![b'x'; FRAME]) };
            let mut sent = 0;
            while agent.send(&frame).await.is_ok() {
                sent += 1;
                let _ = sent_tx.send(sent);
            }
            sent
        });
        let stream = port_stream(conn, 83).await.expect("ready");
        // Wait until the flood stalls: no progress for 200 ms.
        loop {
            match tokio::time::timeout(Duration::from_millis(200), sent_rx.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => panic!("the fake agent stopped on its own"),
                Err(_) => break,
            }
        }
        // The pump's buffer, its read buffer, one frame in the splitter and the transport.
        let held = *sent_rx.borrow() * FRAME;
        let bound = PUMP_BUFFER + 256 * 1024 + 2 * 8 * 1024 + 64 * 1024 + 2 * FRAME;
        assert!(held <= bound, "{held} bytes went out to a caller that reads nothing (bound {bound})");
        assert!(!fake.is_finished(), "the guest is stalled, not gone");
        drop(stream);
        let sent = tokio::time::timeout(Duration::from_secs(10), fake).await.expect("hung up").expect("fake agent");
        assert!(sent * FRAME <= bound + FRAME);
    }

    #[tokio::test]
    async fn dropping_the_stream_hangs_up_even_if_the_guest_never_closes() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            agent.accept(84).await;
            let mut seen = Vec::new();
            while let Some(req) = agent.recv().await {
                seen.push(req);
            }
            seen
        });
        let stream = port_stream(conn, 84).await.expect("ready");
        drop(stream);
        let seen = tokio::time::timeout(Duration::from_secs(10), fake).await.expect("hung up").expect("fake agent");
        assert!(seen.iter().all(|r| *r == Request::DataEnd), "{seen:?}");
    }
}

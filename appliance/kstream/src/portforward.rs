//! The port-forward protocol (`portforward.k8s.io`) on a SPDY session: for every forwarded
//! connection the client opens an `error` stream and a `data` stream carrying the same
//! `requestID` and `port` headers; we dial the port, copy bytes between the data stream and
//! the connection, and write what went wrong, if anything, on the error stream.
//!
//! The client is `k8s.io/client-go@v0.37.2/tools/portforward/portforward.go`
//! (`handleConnection`): it opens the error stream and half-closes it at once, opens the data
//! stream, copies, and when our side of the data stream ends it resets the data stream and
//! reads the error stream to its end. The server side follows the kubelet's
//! `pkg/kubelet/cri/streaming/portforward/httpstream.go` (pairing by request id, the
//! legacy id derived from stream ids, the pair timeout).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::spdy::{rst, Session, SpdyError, Stream, StreamReader, StreamWriter};

pub use crate::spdy::Limits;

/// The header naming a stream's role (`k8s.io/api/core/v1` `StreamType`).
const STREAM_TYPE: &str = "streamtype";
/// The header naming the Pod port.
const PORT: &str = "port";
/// The header pairing a request's two streams.
const REQUEST_ID: &str = "requestid";
/// Bytes read from a dialled connection at a time (what a Go peer writes per frame).
const COPY_CHUNK: usize = 32 * 1024;

/// Why port-forwarding stopped.
#[derive(Debug, thiserror::Error)]
pub enum PortForwardError {
    /// The SPDY session broke (the peer's frames, or the connection).
    #[error("port-forward session failed")]
    Session(#[from] SpdyError),
}

/// A stream's role in its request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Error,
    Data,
}

/// A request's first stream, waiting in its task for the second.
struct Waiting {
    first: Kind,
    partner: oneshot::Sender<Stream>,
}

/// Serves the port-forward protocol on `io` (the SPDY byte stream, already upgraded) until the
/// peer goes away.
///
/// For each request (a `data` and an `error` stream with the same `requestID` and `port`
/// headers), calls `dial(port)`; on `Err(message)` writes the message on the error stream and
/// closes the pair; on `Ok(conn)` copies bytes both ways (data-stream FIN from the peer →
/// shutdown of conn's write side; conn EOF → FIN on the data stream). When the peer goes, every
/// request's task ends and its connection is dropped.
pub async fn serve<S, F, Fut, D>(io: S, limits: Limits, dial: F) -> Result<(), PortForwardError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    F: Fn(u16) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<D, String>> + Send + 'static,
    D: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let dial = Arc::new(dial);
    let mut session = Session::new(io, limits.clone())?;
    let mut waiting: HashMap<String, Waiting> = HashMap::new();
    let mut requests = JoinSet::new();
    let result = loop {
        while requests.try_join_next().is_some() {}
        waiting.retain(|_, w| !w.partner.is_closed());
        let stream = match session.accept().await {
            Ok(Some(stream)) => stream,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e.into()),
        };
        let (kind, request) = match classify(&stream) {
            Ok(found) => found,
            Err(why) => {
                // The kubelet resets a stream it cannot place, without a reply.
                tracing::debug!(stream = stream.id(), why, "port-forward stream refused");
                if let Err(e) = stream.reset(rst::PROTOCOL_ERROR).await {
                    break Err(e.into());
                }
                continue;
            }
        };
        if let Err(e) = stream.reply().await {
            break Err(e.into());
        }
        match waiting.remove(&request) {
            Some(w) if w.first != kind => {
                // If the first stream's task has just timed out, the partner is dropped (reset).
                let _ = w.partner.send(stream);
            }
            Some(w) => {
                tracing::debug!(request, ?kind, "port-forward stream repeated; reset");
                waiting.insert(request, w);
                drop(stream);
            }
            None => {
                let (partner, rx) = oneshot::channel();
                waiting.insert(request, Waiting { first: kind, partner });
                let task = pair(stream, kind, rx, limits.clone(), dial.clone());
                requests.spawn(task);
            }
        }
    };
    // Aborting the tasks drops their streams and dialled connections.
    requests.shutdown().await;
    result
}

/// A stream's role and request id, per the kubelet's `httpStreamReceived` and `requestID`.
fn classify(stream: &Stream) -> Result<(Kind, String), &'static str> {
    let headers = stream.headers();
    let kind = match headers.get(STREAM_TYPE) {
        Some("error") => Kind::Error,
        Some("data") => Kind::Data,
        Some(_) => return Err("unknown streamType"),
        None => return Err("no streamType header"),
    };
    port(stream)?;
    let request = match headers.get(REQUEST_ID) {
        Some(id) if !id.is_empty() => id.to_owned(),
        // Clients before request ids open the error stream, then the data stream, two ids
        // apart: both map to the error stream's id.
        _ => match kind {
            Kind::Error => stream.id().to_string(),
            Kind::Data => stream.id().saturating_sub(2).to_string(),
        },
    };
    Ok((kind, request))
}

fn port(stream: &Stream) -> Result<u16, &'static str> {
    let port = stream.headers().get(PORT).ok_or("no port header")?;
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err("port header is not a port"),
        Ok(port) => Ok(port),
    }
}

/// One request: waits for the second stream, dials, copies, reports.
async fn pair<F, Fut, D>(first: Stream, kind: Kind, partner: oneshot::Receiver<Stream>, limits: Limits, dial: Arc<F>)
where
    F: Fn(u16) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<D, String>> + Send + 'static,
    D: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let second = match tokio::time::timeout(limits.pair_timeout, partner).await {
        Ok(Ok(second)) => second,
        _ => {
            tracing::debug!(stream = first.id(), "port-forward request incomplete; dropped");
            if kind == Kind::Error {
                let (_, error) = first.split();
                report(&error, "timed out waiting for the port-forward data stream").await;
            }
            return;
        }
    };
    let (data, error) = match kind {
        Kind::Data => (first, second),
        Kind::Error => (second, first),
    };
    // `classify` accepted the data stream's port header.
    let Ok(port) = port(&data) else { return };
    let (_, error) = error.split();
    let (data_in, data_out) = data.split();
    match dial(port).await {
        Err(message) => {
            tracing::debug!(port, message, "port-forward dial failed");
            report(&error, &message).await;
            let _ = data_out.close().await;
        }
        Ok(conn) => match copy(conn, data_in, &data_out).await {
            Ok(()) => {
                let _ = error.close().await;
            }
            // client-go resets the data stream once it has read our FIN: the usual end.
            Err(CopyError::Stream(e)) => {
                tracing::trace!(port, error = %e, "port-forward data stream ended");
                let _ = error.close().await;
            }
            Err(CopyError::Conn(e)) => {
                let _ = data_out.reset(rst::CANCEL).await;
                report(&error, &format!("port {port}: {e}")).await;
            }
        },
    }
}

/// Writes `message` on the error stream and closes it; a gone peer is no longer told anything.
async fn report(error: &StreamWriter, message: &str) {
    let _ = error.write(message.as_bytes()).await;
    let _ = error.close().await;
}

/// Which side of a copy failed.
#[derive(Debug)]
enum CopyError {
    /// The peer reset the data stream, or the session ended.
    Stream(SpdyError),
    /// The dialled connection failed.
    Conn(std::io::Error),
}

/// Copies both ways until both directions ended, or either failed.
async fn copy<D>(conn: D, mut data_in: StreamReader, data_out: &StreamWriter) -> Result<(), CopyError>
where
    D: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut conn_read, mut conn_write) = tokio::io::split(conn);
    let inbound = async {
        while let Some(bytes) = data_in.read().await.map_err(CopyError::Stream)? {
            conn_write.write_all(&bytes).await.map_err(CopyError::Conn)?;
        }
        conn_write.shutdown().await.map_err(CopyError::Conn)
    };
    let outbound = async {
        let mut buf = vec![0; COPY_CHUNK];
        loop {
            let n = conn_read.read(&mut buf).await.map_err(CopyError::Conn)?;
            if n == 0 {
                return data_out.close().await.map_err(CopyError::Stream);
            }
            data_out.write(&buf[..n]).await.map_err(CopyError::Stream)?;
        }
    };
    tokio::try_join!(inbound, outbound).map(|_| ())
}

#[cfg(test)]
#[path = "portforward_tests.rs"]
mod tests;

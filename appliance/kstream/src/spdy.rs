//! SPDY/3.1, the multiplexing under `kubectl port-forward`: the frames ([`Frame`],
//! [`FrameDecoder`], [`FrameEncoder`]), their compressed header blocks ([`Headers`]), and a
//! server [`Session`] that accepts the streams the peer opens.
//!
//! The peer is `github.com/moby/spdystream` driven by `k8s.io/streaming/pkg/httpstream/spdy`.
//! spdystream does no flow control (it ignores WINDOW_UPDATE and never sends one), so neither
//! do we: a stream whose reader falls [`Limits::max_pending_bytes`] behind stops the session
//! reading from the connection until the reader catches up. Everything the peer can make us
//! hold has a cap in [`Limits`].

use std::time::Duration;

mod dictionary;
mod frame;
mod headers;
mod session;
#[cfg(test)]
pub(crate) mod test_client;

pub use frame::{goaway, rst, Frame, FrameDecoder, FrameEncoder, Setting};
pub use headers::Headers;
pub use session::{Session, Stream, StreamReader, StreamWriter};

/// Caps on what a peer can make us hold, and the session's timers.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Streams the peer may hold open at once; more are refused (RST_STREAM REFUSED_STREAM).
    pub max_streams: usize,
    /// Inbound bytes buffered per stream before the session stops reading the connection.
    pub max_pending_bytes: usize,
    /// The session ends (GOAWAY) after this long without a frame either way; the kubelet's
    /// default `streamingConnectionIdleTimeout` is 4 hours.
    pub idle_timeout: Duration,
    /// How long the first stream of a port-forward request waits for its partner; the
    /// kubelet's stream creation timeout is 30 seconds.
    pub pair_timeout: Duration,
    /// Largest data frame payload accepted, and the largest we send. Go peers write at most
    /// 32 KiB per frame (`io.Copy`'s buffer).
    pub max_frame_size: usize,
    /// Largest control frame payload accepted, compressed header block included.
    pub max_header_block: usize,
    /// Largest header block accepted once decompressed (the decompression-bomb cap).
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_streams: 64,
            max_pending_bytes: 256 * 1024,
            idle_timeout: Duration::from_secs(4 * 60 * 60),
            pair_timeout: Duration::from_secs(30),
            max_frame_size: 256 * 1024,
            max_header_block: 16 * 1024,
            max_header_bytes: 16 * 1024,
        }
    }
}

/// A broken frame, session or stream.
#[derive(Debug, thiserror::Error)]
pub enum SpdyError {
    /// Reading or writing the connection failed.
    #[error("SPDY connection I/O failed")]
    Io(#[from] std::io::Error),
    /// A frame's stated length is over our cap.
    #[error("SPDY frame of {len} bytes refused (at most {cap})")]
    FrameTooLarge { len: usize, cap: usize },
    /// A control frame of another SPDY version.
    #[error("SPDY version {0} is not spoken here (only 3)")]
    Version(u16),
    /// A frame whose layout is wrong.
    #[error("malformed SPDY frame: {0}")]
    BadFrame(&'static str),
    /// A header block whose layout is wrong.
    #[error("malformed SPDY header block: {0}")]
    BadHeaderBlock(&'static str),
    /// A header block that inflates past [`Limits::max_header_bytes`].
    #[error("SPDY header block inflates past {0} bytes; refused")]
    HeadersTooLarge(usize),
    /// zlib refused our own header block.
    #[error("compressing a SPDY header block failed: {0}")]
    Compress(String),
    /// zlib refused the peer's header block.
    #[error("decompressing a SPDY header block failed: {0}")]
    Decompress(String),
    /// The peer broke the session's rules (stream ids).
    #[error("SPDY protocol error: {0}")]
    Protocol(&'static str),
    /// The peer reset the stream (status from [`rst`]).
    #[error("stream reset by the peer (status {0})")]
    Reset(u32),
    /// The session is gone: connection closed, idle, or broken.
    #[error("SPDY session closed")]
    SessionClosed,
    /// Writing on a stream the peer reset, or whose session ended.
    #[error("stream reset or its session ended")]
    StreamGone,
    /// Writing on a stream we already half-closed.
    #[error("stream already closed for writing")]
    StreamClosed,
}

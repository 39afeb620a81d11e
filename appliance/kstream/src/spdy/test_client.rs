//! A test-side SPDY client on our own framer: opens streams, sends frames, waits for the
//! frames it expects (others wait their turn in a backlog).

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::{DuplexStream, ReadHalf, WriteHalf};
use tokio_util::codec::{FramedRead, FramedWrite};

use super::{Frame, FrameDecoder, FrameEncoder, Headers, Limits, SpdyError};

const WAIT: Duration = Duration::from_secs(5);

pub(crate) struct Client {
    read: FramedRead<ReadHalf<DuplexStream>, FrameDecoder>,
    write: FramedWrite<WriteHalf<DuplexStream>, FrameEncoder>,
    backlog: VecDeque<Frame>,
}

impl Client {
    pub(crate) fn new(io: DuplexStream) -> Client {
        let (read, write) = tokio::io::split(io);
        Client {
            read: FramedRead::new(read, FrameDecoder::new(&Limits::default())),
            write: FramedWrite::new(write, FrameEncoder::new().expect("zlib initialises")),
            backlog: VecDeque::new(),
        }
    }

    pub(crate) async fn send(&mut self, frame: Frame) -> Result<(), SpdyError> {
        self.write.send(frame).await
    }

    pub(crate) async fn open(&mut self, id: u32, pairs: &[(&str, &str)]) -> Result<(), SpdyError> {
        let mut headers = Headers::new();
        for (n, v) in pairs {
            headers.insert(n, v);
        }
        self.send(Frame::SynStream {
            stream_id: id,
            associated_to: 0,
            priority: 0,
            slot: 0,
            fin: false,
            unidirectional: false,
            headers,
        })
        .await
    }

    pub(crate) async fn data(&mut self, id: u32, data: &[u8], fin: bool) -> Result<(), SpdyError> {
        let data = Bytes::copy_from_slice(data);
        self.send(Frame::Data { stream_id: id, fin, data }).await
    }

    /// The next frame from the server within `wait`, backlog first.
    pub(crate) async fn try_expect(&mut self, wait: Duration) -> Option<Frame> {
        if let Some(frame) = self.backlog.pop_front() {
            return Some(frame);
        }
        match tokio::time::timeout(wait, self.read.next()).await {
            Ok(Some(Ok(frame))) => Some(frame),
            Ok(Some(Err(e))) => panic!("client could not decode a frame: {e}"),
            Ok(None) | Err(_) => None,
        }
    }

    /// Waits for the first frame that matches; others stay in the backlog.
    pub(crate) async fn expect(&mut self, want: impl Fn(&Frame) -> bool) -> Frame {
        if let Some(i) = self.backlog.iter().position(&want) {
            return self.backlog.remove(i).expect("position is in range");
        }
        loop {
            match tokio::time::timeout(WAIT, self.read.next()).await {
                Ok(Some(Ok(frame))) if want(&frame) => return frame,
                Ok(Some(Ok(frame))) => self.backlog.push_back(frame),
                other => panic!("expected frame never came: {other:?}; backlog {:?}", self.backlog),
            }
        }
    }

    pub(crate) async fn expect_reply(&mut self, id: u32) {
        self.expect(|f| matches!(f, Frame::SynReply { stream_id, .. } if *stream_id == id)).await;
    }

    pub(crate) async fn expect_rst(&mut self, id: u32) -> u32 {
        match self.expect(|f| matches!(f, Frame::RstStream { stream_id, .. } if *stream_id == id)).await {
            Frame::RstStream { status, .. } => status,
            _ => unreachable!("matched a RST_STREAM"),
        }
    }

    pub(crate) async fn expect_data(&mut self, id: u32) -> (Bytes, bool) {
        match self.expect(|f| matches!(f, Frame::Data { stream_id, .. } if *stream_id == id)).await {
            Frame::Data { data, fin, .. } => (data, fin),
            _ => unreachable!("matched a data frame"),
        }
    }

    /// Everything the stream sends until its FIN, concatenated.
    pub(crate) async fn read_to_fin(&mut self, id: u32) -> Vec<u8> {
        let mut all = Vec::new();
        loop {
            let (data, fin) = self.expect_data(id).await;
            all.extend_from_slice(&data);
            if fin {
                return all;
            }
        }
    }
}

/// Bytes from a hex string (fixtures captured from the Go implementation).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_default()).collect()
}

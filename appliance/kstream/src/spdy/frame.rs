//! SPDY/3.1 frames on the wire (SPDY Protocol Draft 3.1, section 2.2 and 2.6): an 8-byte
//! header (control bit, version and type, or a stream id; then flags and a 24-bit length), then
//! the payload. [`FrameDecoder`] and [`FrameEncoder`] are the two directions of one
//! connection, each holding its header compression context.
//!
//! The Go peer is `github.com/moby/spdystream/spdy` (`types.go`, `read.go`, `write.go`).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use super::headers::{HeaderCompressor, HeaderDecompressor, Headers};
use super::{Limits, SpdyError};

/// The SPDY version we speak.
const VERSION: u16 = 3;
/// Frame header length.
const HEADER_LEN: usize = 8;
/// The largest length a frame header can state.
const MAX_LENGTH: usize = 0xff_ffff;
/// Stream ids and a few other fields are 31 bits; the top bit is reserved.
const ID_MASK: u32 = 0x7fff_ffff;

const FLAG_FIN: u8 = 0x01;
const FLAG_UNIDIRECTIONAL: u8 = 0x02;
const FLAG_CLEAR_SETTINGS: u8 = 0x01;

const TYPE_SYN_STREAM: u16 = 1;
const TYPE_SYN_REPLY: u16 = 2;
const TYPE_RST_STREAM: u16 = 3;
const TYPE_SETTINGS: u16 = 4;
const TYPE_PING: u16 = 6;
const TYPE_GOAWAY: u16 = 7;
const TYPE_HEADERS: u16 = 8;
const TYPE_WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes (section 2.6.3).
pub mod rst {
    /// The peer broke the protocol on this stream.
    pub const PROTOCOL_ERROR: u32 = 1;
    /// No such stream.
    pub const INVALID_STREAM: u32 = 2;
    /// Refused before any processing (over the stream cap, or after GOAWAY).
    pub const REFUSED_STREAM: u32 = 3;
    /// The stream is no longer needed.
    pub const CANCEL: u32 = 5;
    /// Something failed on our side.
    pub const INTERNAL_ERROR: u32 = 6;
    /// A frame arrived on a half-closed stream.
    pub const STREAM_ALREADY_CLOSED: u32 = 9;
}

/// GOAWAY status codes (section 2.6.6).
pub mod goaway {
    /// A normal end.
    pub const OK: u32 = 0;
    /// The peer broke the protocol.
    pub const PROTOCOL_ERROR: u32 = 1;
    /// Something failed on our side.
    pub const INTERNAL_ERROR: u32 = 2;
}

/// One SETTINGS entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// Entry flags (persist values).
    pub flags: u8,
    /// The setting's 24-bit id.
    pub id: u32,
    /// Its value.
    pub value: u32,
}

/// One SPDY/3.1 frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Opens a stream.
    SynStream {
        stream_id: u32,
        associated_to: u32,
        /// 0 (highest) to 7.
        priority: u8,
        slot: u8,
        fin: bool,
        unidirectional: bool,
        headers: Headers,
    },
    /// Accepts a stream.
    SynReply { stream_id: u32, fin: bool, headers: Headers },
    /// Ends a stream abnormally; `status` is one of [`rst`].
    RstStream { stream_id: u32, status: u32 },
    /// Connection settings.
    Settings { clear: bool, entries: Vec<Setting> },
    /// A liveness probe; the receiver echoes a probe the sender started.
    Ping { id: u32 },
    /// The sender opens no more streams; `status` is one of [`goaway`].
    GoAway { last_good_stream_id: u32, status: u32 },
    /// More headers on a stream.
    Headers { stream_id: u32, fin: bool, headers: Headers },
    /// Flow-control credit.
    WindowUpdate { stream_id: u32, delta: u32 },
    /// A stream's bytes; `fin` half-closes the sender's side.
    Data { stream_id: u32, fin: bool, data: Bytes },
}

/// Reads frames from the peer; decompresses every header block in order, whether or not the
/// stream is wanted, so the shared compression context stays in step.
pub struct FrameDecoder {
    headers: HeaderDecompressor,
    max_data: usize,
    max_control: usize,
}

impl FrameDecoder {
    /// A decoder for a fresh connection under `limits`.
    pub fn new(limits: &Limits) -> FrameDecoder {
        FrameDecoder {
            headers: HeaderDecompressor::new(limits.max_header_bytes),
            max_data: limits.max_frame_size.min(MAX_LENGTH),
            max_control: limits.max_header_block.min(MAX_LENGTH),
        }
    }

    fn control(&mut self, kind: u16, flags: u8, mut p: Bytes) -> Result<Option<Frame>, SpdyError> {
        let fin = flags & FLAG_FIN != 0;
        let frame = match kind {
            TYPE_SYN_STREAM => {
                need(&p, 10, false)?;
                let stream_id = p.get_u32() & ID_MASK;
                let associated_to = p.get_u32() & ID_MASK;
                let priority = p.get_u8() >> 5;
                let slot = p.get_u8();
                Frame::SynStream {
                    stream_id,
                    associated_to,
                    priority,
                    slot,
                    fin,
                    unidirectional: flags & FLAG_UNIDIRECTIONAL != 0,
                    headers: self.headers.decompress(&p)?,
                }
            }
            TYPE_SYN_REPLY | TYPE_HEADERS => {
                need(&p, 4, false)?;
                let stream_id = p.get_u32() & ID_MASK;
                let headers = self.headers.decompress(&p)?;
                if kind == TYPE_SYN_REPLY {
                    Frame::SynReply { stream_id, fin, headers }
                } else {
                    Frame::Headers { stream_id, fin, headers }
                }
            }
            TYPE_RST_STREAM => {
                need(&p, 8, true)?;
                Frame::RstStream { stream_id: p.get_u32() & ID_MASK, status: p.get_u32() }
            }
            TYPE_SETTINGS => {
                need(&p, 4, false)?;
                let count = p.get_u32() as usize;
                if Some(p.len()) != count.checked_mul(8) {
                    return Err(SpdyError::BadFrame("SETTINGS length and count disagree"));
                }
                let entries = (0..count)
                    .map(|_| {
                        let word = p.get_u32();
                        Setting { flags: (word >> 24) as u8, id: word & 0xff_ffff, value: p.get_u32() }
                    })
                    .collect();
                Frame::Settings { clear: flags & FLAG_CLEAR_SETTINGS != 0, entries }
            }
            TYPE_PING => {
                need(&p, 4, true)?;
                Frame::Ping { id: p.get_u32() }
            }
            TYPE_GOAWAY => {
                need(&p, 8, true)?;
                Frame::GoAway { last_good_stream_id: p.get_u32() & ID_MASK, status: p.get_u32() }
            }
            TYPE_WINDOW_UPDATE => {
                need(&p, 8, true)?;
                Frame::WindowUpdate { stream_id: p.get_u32() & ID_MASK, delta: p.get_u32() & ID_MASK }
            }
            // Section 2.2.1: a control frame of an unknown type is ignored.
            _ => return Ok(None),
        };
        Ok(Some(frame))
    }
}

/// Checks a control payload's length: exactly `len`, or at least `len`.
fn need(p: &Bytes, len: usize, exact: bool) -> Result<(), SpdyError> {
    if p.len() < len || (exact && p.len() != len) {
        return Err(SpdyError::BadFrame("control frame of the wrong length"));
    }
    Ok(())
}

impl Decoder for FrameDecoder {
    type Item = Frame;
    type Error = SpdyError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, SpdyError> {
        loop {
            let Some(head) = src.first_chunk::<HEADER_LEN>() else {
                return Ok(None);
            };
            let word = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            let flags = head[4];
            let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
            let control = word & 0x8000_0000 != 0;
            let cap = if control { self.max_control } else { self.max_data };
            if len > cap {
                return Err(SpdyError::FrameTooLarge { len, cap });
            }
            if src.len() < HEADER_LEN + len {
                src.reserve(HEADER_LEN + len - src.len());
                return Ok(None);
            }
            src.advance(HEADER_LEN);
            let payload = src.split_to(len).freeze();
            if !control {
                return Ok(Some(Frame::Data { stream_id: word & ID_MASK, fin: flags & FLAG_FIN != 0, data: payload }));
            }
            let version = ((word >> 16) & 0x7fff) as u16;
            if version != VERSION {
                return Err(SpdyError::Version(version));
            }
            if let Some(frame) = self.control((word & 0xffff) as u16, flags, payload)? {
                return Ok(Some(frame));
            }
        }
    }
}

/// Writes frames to the peer, compressing header blocks in our context.
pub struct FrameEncoder {
    headers: HeaderCompressor,
}

impl FrameEncoder {
    /// An encoder for a fresh connection.
    pub fn new() -> Result<FrameEncoder, SpdyError> {
        Ok(FrameEncoder { headers: HeaderCompressor::new()? })
    }
}

fn put_control(dst: &mut BytesMut, kind: u16, flags: u8, payload: &[u8]) -> Result<(), SpdyError> {
    put_head(dst, 0x8000_0000 | u32::from(VERSION) << 16 | u32::from(kind), flags, payload)
}

fn put_head(dst: &mut BytesMut, word: u32, flags: u8, payload: &[u8]) -> Result<(), SpdyError> {
    if payload.len() > MAX_LENGTH {
        return Err(SpdyError::FrameTooLarge { len: payload.len(), cap: MAX_LENGTH });
    }
    dst.reserve(HEADER_LEN + payload.len());
    dst.put_u32(word);
    // The length fits 24 bits (checked above).
    dst.put_u32(u32::from(flags) << 24 | payload.len() as u32);
    dst.put_slice(payload);
    Ok(())
}

fn flag(set: bool, bit: u8) -> u8 {
    if set {
        bit
    } else {
        0
    }
}

impl Encoder<Frame> for FrameEncoder {
    type Error = SpdyError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), SpdyError> {
        let mut p = BytesMut::new();
        match frame {
            Frame::SynStream { stream_id, associated_to, priority, slot, fin, unidirectional, headers } => {
                p.put_u32(stream_id & ID_MASK);
                p.put_u32(associated_to & ID_MASK);
                p.put_u8((priority & 0x7) << 5);
                p.put_u8(slot);
                p.put_slice(&self.headers.compress(&headers)?);
                let flags = flag(fin, FLAG_FIN) | flag(unidirectional, FLAG_UNIDIRECTIONAL);
                put_control(dst, TYPE_SYN_STREAM, flags, &p)
            }
            Frame::SynReply { stream_id, fin, headers } => {
                p.put_u32(stream_id & ID_MASK);
                p.put_slice(&self.headers.compress(&headers)?);
                put_control(dst, TYPE_SYN_REPLY, flag(fin, FLAG_FIN), &p)
            }
            Frame::Headers { stream_id, fin, headers } => {
                p.put_u32(stream_id & ID_MASK);
                p.put_slice(&self.headers.compress(&headers)?);
                put_control(dst, TYPE_HEADERS, flag(fin, FLAG_FIN), &p)
            }
            Frame::RstStream { stream_id, status } => {
                p.put_u32(stream_id & ID_MASK);
                p.put_u32(status);
                put_control(dst, TYPE_RST_STREAM, 0, &p)
            }
            Frame::Settings { clear, entries } => {
                p.put_u32(u32::try_from(entries.len()).unwrap_or(u32::MAX));
                for e in &entries {
                    p.put_u32(u32::from(e.flags) << 24 | (e.id & 0xff_ffff));
                    p.put_u32(e.value);
                }
                put_control(dst, TYPE_SETTINGS, flag(clear, FLAG_CLEAR_SETTINGS), &p)
            }
            Frame::Ping { id } => put_control(dst, TYPE_PING, 0, &id.to_be_bytes()),
            Frame::GoAway { last_good_stream_id, status } => {
                p.put_u32(last_good_stream_id & ID_MASK);
                p.put_u32(status);
                put_control(dst, TYPE_GOAWAY, 0, &p)
            }
            Frame::WindowUpdate { stream_id, delta } => {
                p.put_u32(stream_id & ID_MASK);
                p.put_u32(delta & ID_MASK);
                put_control(dst, TYPE_WINDOW_UPDATE, 0, &p)
            }
            Frame::Data { stream_id, fin, data } => put_head(dst, stream_id & ID_MASK, flag(fin, FLAG_FIN), &data),
        }
    }
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;

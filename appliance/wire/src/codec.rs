//! Newline-delimited JSON framing under the 8 MiB cap, both ways.
//!
//! - [`FrameSplitter`] turns a byte stream into frames (lines); a line longer than
//!   [`MAX_FRAME`] is an error and is discarded up to its newline, so the stream stays usable.
//! - [`decode_request`] / [`decode_response`] parse one frame, with a fast path for the exact
//!   `data`/`stdin`/`stdout`/`stderr` shapes the SDK and silkd emit.
//! - [`encode_request`] / [`encode_response`] render one frame (with its newline) and refuse
//!   one over the cap.

use crate::{Bytes64, Request, Response};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use thiserror::Error;

/// The largest frame either side accepts, newline included: 8 MiB.
pub const MAX_FRAME: usize = 8 * 1024 * 1024;

/// Why a frame could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    /// A line exceeded [`MAX_FRAME`]; it was discarded up to its newline.
    #[error("frame exceeds the {MAX_FRAME}-byte cap")]
    TooLarge,
    /// Not a JSON object of the protocol.
    #[error("parse: {0}")]
    Parse(String),
    /// A well-formed request naming an op this protocol does not have.
    #[error("unknown op {0:?}")]
    UnknownOp(String),
}

/// Why a frame could not be written.
#[derive(Debug, Error)]
pub enum EncodeError {
    /// The rendered frame would exceed [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte cap")]
    TooLarge(usize),
    #[error("serialize: {0}")]
    Serialize(#[source] serde_json::Error),
}

/// Splits a byte stream into newline-terminated frames without unbounded buffering.
#[derive(Debug, Default)]
pub struct FrameSplitter {
    buf: Vec<u8>,
    /// Bytes of `buf` already known to hold no newline.
    scanned: usize,
    /// Dropping an oversized line until its newline.
    discarding: bool,
}

impl FrameSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes buffered and not yet returned as a frame (never more than [`MAX_FRAME`]).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame (without its newline), an error for an oversized line, or
    /// `None` until more bytes arrive. Call repeatedly after each [`push`](Self::push).
    pub fn next_frame(&mut self) -> Option<Result<Vec<u8>, DecodeError>> {
        loop {
            let newline = self.buf[self.scanned..].iter().position(|&b| b == b'\n').map(|i| i + self.scanned);
            match newline {
                Some(end) if self.discarding => {
                    self.buf.drain(..=end);
                    self.scanned = 0;
                    self.discarding = false;
                    continue;
                }
                Some(end) => {
                    let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                    self.scanned = 0;
                    line.pop();
                    if line.len() + 1 > MAX_FRAME {
                        return Some(Err(DecodeError::TooLarge));
                    }
                    return Some(Ok(line));
                }
                None if self.discarding => {
                    self.buf.clear();
                    self.scanned = 0;
                    return None;
                }
                None if self.buf.len() >= MAX_FRAME => {
                    // No newline within the cap: report once, then drop up to the next newline.
                    self.buf.clear();
                    self.scanned = 0;
                    self.discarding = true;
                    return Some(Err(DecodeError::TooLarge));
                }
                None => {
                    self.scanned = self.buf.len();
                    return None;
                }
            }
        }
    }
}

/// `{"v":1,"op":"<op>","data":"<b64>"}` exactly, as the SDK renders bare data frames.
fn fast_data_request(line: &[u8]) -> Option<Request> {
    let rest = line.strip_prefix(br#"{"v":1,"op":""#)?;
    let (op, rest) = if let Some(r) = rest.strip_prefix(br#"data","data":""#) {
        ("data", r)
    } else if let Some(r) = rest.strip_prefix(br#"stdin","data":""#) {
        ("stdin", r)
    } else {
        return None;
    };
    let b64 = rest.strip_suffix(br#""}"#)?;
    let data = Bytes64(STANDARD.decode(b64).ok()?);
    Some(if op == "data" { Request::Data { data } } else { Request::Stdin { data } })
}

/// Parses one request frame (the newline already stripped, or not).
pub fn decode_request(line: &[u8]) -> Result<Request, DecodeError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    if line.len() + 1 > MAX_FRAME {
        return Err(DecodeError::TooLarge);
    }
    if let Some(req) = fast_data_request(line) {
        return Ok(req);
    }
    match serde_json::from_slice::<Request>(line) {
        Ok(req) => Ok(req),
        Err(err) => Err(explain_request_error(line, err)),
    }
}

/// Tells an unknown op apart from a malformed frame.
fn explain_request_error(line: &[u8], err: serde_json::Error) -> DecodeError {
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(line) {
        match map.get("op") {
            Some(serde_json::Value::String(op)) if !Request::OPS.contains(&op.as_str()) => {
                return DecodeError::UnknownOp(op.clone());
            }
            None => return DecodeError::Parse("missing op".into()),
            _ => {}
        }
    }
    DecodeError::Parse(err.to_string())
}

/// Parses one response frame.
pub fn decode_response(line: &[u8]) -> Result<Response, DecodeError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    if line.len() + 1 > MAX_FRAME {
        return Err(DecodeError::TooLarge);
    }
    serde_json::from_slice(line).map_err(|e| DecodeError::Parse(e.to_string()))
}

fn push_data_frame(out: &mut Vec<u8>, head: &[u8], data: &[u8]) -> Result<(), EncodeError> {
    let len = head.len() + base64::encoded_len(data.len(), true).unwrap_or(usize::MAX) + 3;
    if len > MAX_FRAME {
        return Err(EncodeError::TooLarge(len));
    }
    out.reserve(len);
    out.extend_from_slice(head);
    let start = out.len();
    out.resize(start + len - head.len() - 3, 0);
    // The buffer was sized by encoded_len, so this cannot run out of room.
    let written = STANDARD.encode_slice(data, &mut out[start..]).map_err(|_| EncodeError::TooLarge(len))?;
    out.truncate(start + written);
    out.extend_from_slice(b"\"}\n");
    Ok(())
}

/// Appends one response frame and its newline to `out`.
pub fn encode_response_into(resp: &Response, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    match resp {
        Response::Stdout { data } => return push_data_frame(out, br#"{"type":"stdout","data":""#, &data.0),
        Response::Stderr { data } => return push_data_frame(out, br#"{"type":"stderr","data":""#, &data.0),
        Response::Data { data } => return push_data_frame(out, br#"{"type":"data","data":""#, &data.0),
        _ => {}
    }
    let start = out.len();
    serde_json::to_writer(&mut *out, resp).map_err(EncodeError::Serialize)?;
    out.push(b'\n');
    let len = out.len() - start;
    if len > MAX_FRAME {
        out.truncate(start);
        return Err(EncodeError::TooLarge(len));
    }
    Ok(())
}

/// One response frame with its newline.
pub fn encode_response(resp: &Response) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    encode_response_into(resp, &mut out)?;
    Ok(out)
}

#[derive(serde::Serialize)]
struct Envelope<'a> {
    v: u32,
    #[serde(flatten)]
    req: &'a Request,
}

/// One request frame (`"v":1` first) with its newline.
pub fn encode_request(req: &Request) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    match req {
        Request::Data { data } => push_data_frame(&mut out, br#"{"v":1,"op":"data","data":""#, &data.0)?,
        Request::Stdin { data } => push_data_frame(&mut out, br#"{"v":1,"op":"stdin","data":""#, &data.0)?,
        _ => {
            serde_json::to_writer(&mut out, &Envelope { v: 1, req }).map_err(EncodeError::Serialize)?;
            out.push(b'\n');
            if out.len() > MAX_FRAME {
                return Err(EncodeError::TooLarge(out.len()));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitter_yields_lines_across_pushes() {
        let mut s = FrameSplitter::new();
        s.push(b"{\"a\":1}\n{\"b\"");
        assert_eq!(s.next_frame(), Some(Ok(b"{\"a\":1}".to_vec())));
        assert_eq!(s.next_frame(), None);
        s.push(b":2}\n");
        assert_eq!(s.next_frame(), Some(Ok(b"{\"b\":2}".to_vec())));
        assert_eq!(s.next_frame(), None);
        assert_eq!(s.buffered(), 0);
    }

    #[test]
    fn oversized_line_is_refused_then_stream_recovers() {
        let mut s = FrameSplitter::new();
        let chunk = vec![b'x'; 1 << 20];
        let mut errors = 0;
        for _ in 0..9 {
            s.push(&chunk);
            while let Some(f) = s.next_frame() {
                assert_eq!(f, Err(DecodeError::TooLarge));
                errors += 1;
            }
            assert!(s.buffered() <= MAX_FRAME);
        }
        s.push(b"tail\n{\"ok\":1}\n");
        assert_eq!(s.next_frame(), Some(Ok(b"{\"ok\":1}".to_vec())));
        assert_eq!(errors, 1);
    }

    #[test]
    fn line_of_exactly_the_cap_is_accepted_and_one_more_refused() {
        let mut s = FrameSplitter::new();
        let mut line = vec![b' '; MAX_FRAME - 1];
        line.push(b'\n');
        s.push(&line);
        assert_eq!(s.next_frame().map(|r| r.map(|v| v.len())), Some(Ok(MAX_FRAME - 1)));
        let mut line = vec![b' '; MAX_FRAME];
        line.push(b'\n');
        s.push(&line);
        assert_eq!(s.next_frame(), Some(Err(DecodeError::TooLarge)));
    }

    #[test]
    fn data_fast_path_matches_serde() {
        let frame = br#"{"v":1,"op":"data","data":"aGVsbG8="}"#;
        assert_eq!(decode_request(frame), Ok(Request::Data { data: Bytes64(b"hello".to_vec()) }));
        let spaced = br#"{"op": "stdin", "v": 1, "data": "aGVsbG8="}"#;
        assert_eq!(decode_request(spaced), Ok(Request::Stdin { data: Bytes64(b"hello".to_vec()) }));
        let enc = encode_request(&Request::Data { data: Bytes64(b"hello".to_vec()) }).expect("small frame");
        assert_eq!(enc, b"{\"v\":1,\"op\":\"data\",\"data\":\"aGVsbG8=\"}\n");
    }

    #[test]
    fn nulls_are_absent_and_unknown_fields_ignored() {
        let req = decode_request(br#"{"v":1,"op":"exec","argv":["true"],"cwd":null,"env":null,"extra":7}"#);
        assert_eq!(
            req,
            Ok(Request::Exec {
                argv: vec!["true".into()],
                cwd: None,
                env: None,
                user: None,
                detach: None,
                session: None
            })
        );
    }

    #[test]
    fn pty_open_argv_is_an_optional_extension() {
        let shell = decode_request(br#"{"v":1,"op":"pty_open","argv":null}"#).expect("null argv");
        assert_eq!(shell, Request::PtyOpen { argv: None, cols: 80, rows: 24, cwd: None, env: None, user: None });
        let enc = encode_request(&shell).expect("small");
        assert_eq!(enc, b"{\"v\":1,\"op\":\"pty_open\",\"cols\":80,\"rows\":24}\n", "argv omitted when absent");
        let cmd =
            Request::PtyOpen { argv: Some(vec!["top".into()]), cols: 1, rows: 2, cwd: None, env: None, user: None };
        let enc = encode_request(&cmd).expect("small");
        assert_eq!(decode_request(&enc), Ok(cmd));
    }

    #[test]
    fn unknown_op_and_garbage_are_typed() {
        assert_eq!(decode_request(br#"{"v":1,"op":"teleport"}"#), Err(DecodeError::UnknownOp("teleport".into())));
        assert!(matches!(decode_request(b"not json"), Err(DecodeError::Parse(_))));
        assert!(matches!(decode_request(br#"{"v":1}"#), Err(DecodeError::Parse(m)) if m == "missing op"));
        assert!(decode_request(br#"{"v":1,"op":"data","data":"%%%"}"#).is_err());
    }

    #[test]
    fn rpc_ends_follow_the_protocol() {
        let exit = Response::Exit { code: 0 };
        assert!(exit.ends_rpc("exec", false));
        assert!(!exit.ends_rpc("logs", false), "logs sends exit then done");
        assert!(Response::Done.ends_rpc("logs", false));
        assert!(Response::Started { pid: 1 }.ends_rpc("exec", true));
        assert!(!Response::Started { pid: 1 }.ends_rpc("exec", false));
        assert!(!Response::Ready.ends_rpc("port_forward", false));
    }

    #[test]
    fn writer_refuses_oversized_frames() {
        let big = Response::Stdout { data: Bytes64(vec![0u8; 7 * 1024 * 1024]) };
        assert!(matches!(encode_response(&big), Err(EncodeError::TooLarge(_))));
        let ok = Response::Stdout { data: Bytes64(vec![0u8; 6_000_000]) };
        let enc = encode_response(&ok).expect("6 MB of payload fits");
        assert!(enc.len() <= MAX_FRAME);
        assert_eq!(decode_response(&enc).expect("round trip"), ok);
    }

    #[test]
    fn response_type_comes_first_and_optionals_are_omitted() {
        let enc = encode_response(&Response::Exit { code: 3 }).expect("small");
        assert_eq!(enc, b"{\"type\":\"exit\",\"code\":3}\n");
        let enc = encode_response(&Response::error(crate::ErrorKind::NotFound, "no such pid")).expect("small");
        assert_eq!(enc, b"{\"type\":\"error\",\"kind\":\"not_found\",\"message\":\"no such pid\"}\n");
        let missing_kind = decode_response(br#"{"type":"error","message":"x"}"#).expect("parses");
        assert_eq!(missing_kind, Response::error(crate::ErrorKind::Internal, "x"));
    }
}

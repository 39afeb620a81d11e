//! The connection state machine of `proto` 2, apart from any socket (like Firecracker's
//! vsock connection state machine): it decides what each inbound frame means and when an
//! RPC ends, and the driver in [`super`] does the IO.
//!
//! Rules (`docs/sandboxd.md` §9.3):
//! - RPCs run back to back; an RPC ends at its terminal reply ([`Response::ends_rpc`]).
//! - Continuation frames (`stdin`, `stdin_close`, `data`, `data_end`) feed the RPC in
//!   flight while its input is open, and are silently dropped otherwise — except the frame
//!   that *opens* a connection, which is answered `error{bad_request,"stray data/stdin frame"}`.
//! - A request arriving while an RPC is in flight ends that RPC's input and is held until it
//!   ends (the driver stops reading meanwhile, so at most one frame is held).
//! - An unparseable or oversized frame is a failed request: answered with an `error` frame
//!   in request order (held like a request when an RPC is in flight); the connection stays.

use crate::rpc::Input;
use wire::{DecodeError, ErrorKind, Request, Response};

/// The message of the error that answers a continuation frame opening a connection.
pub use crate::ops::STRAY_MESSAGE;

/// What the driver must do with one inbound frame.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Start this request as the RPC in flight.
    Start(Request),
    /// Feed this continuation frame to the RPC in flight.
    Feed(Input),
    /// Write this reply now (no RPC is in flight).
    Reply(Response),
    /// Drop the frame silently.
    Drop,
    /// The frame is held until the RPC in flight ends; that RPC's input has ended. Stop
    /// reading until [`ConnState::next_held`] hands it back.
    Held,
}

/// A frame waiting for the RPC in flight to end.
#[derive(Debug)]
enum Pending {
    Request(Request),
    Reply(Response),
}

#[derive(Debug)]
struct Running {
    op: &'static str,
    detached: bool,
    input_open: bool,
}

/// Per-connection protocol state.
#[derive(Debug, Default)]
pub struct ConnState {
    opened: bool,
    running: Option<Running>,
    held: Option<Pending>,
}

impl ConnState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Classifies one inbound frame (already split and decoded).
    pub fn on_inbound(&mut self, inbound: Result<Request, DecodeError>) -> Verdict {
        let first = !self.opened;
        self.opened = true;
        match inbound {
            Ok(req) if req.is_continuation() => match &self.running {
                Some(run) if run.input_open => Verdict::Feed(to_input(req)),
                Some(_) => Verdict::Drop,
                None if first => Verdict::Reply(Response::error(ErrorKind::BadRequest, STRAY_MESSAGE)),
                None => Verdict::Drop,
            },
            Ok(req) => self.request_or_hold(Pending::Request(req)),
            Err(err) => self.request_or_hold(Pending::Reply(decode_error_frame(&err))),
        }
    }

    fn request_or_hold(&mut self, pending: Pending) -> Verdict {
        match &mut self.running {
            Some(run) => {
                run.input_open = false;
                self.held = Some(pending);
                Verdict::Held
            }
            None => self.begin(pending),
        }
    }

    fn begin(&mut self, pending: Pending) -> Verdict {
        match pending {
            Pending::Request(req) => {
                let detached = matches!(&req, Request::Exec { detach: Some(true), .. });
                self.running = Some(Running { op: req.op(), detached, input_open: true });
                Verdict::Start(req)
            }
            Pending::Reply(resp) => Verdict::Reply(resp),
        }
    }

    /// Records one reply frame of the RPC in flight; `true` when it ended the RPC.
    ///
    /// `logs` is the one op whose `exit` is not terminal: it replays `exit{code}` of an
    /// exited process and then ends with `done` (the SDK reads both), so for `logs` only
    /// `done`/`error` end the RPC.
    pub fn on_reply(&mut self, resp: &Response) -> bool {
        let ended = match &self.running {
            Some(run) if run.op == "logs" => matches!(resp, Response::Done | Response::Error { .. }),
            Some(run) => resp.ends_rpc(run.op, run.detached),
            None => true,
        };
        if ended {
            self.running = None;
        }
        ended
    }

    /// The RPC's op stopped without a terminal frame (a bug, or a panic): the RPC ends with
    /// the returned `internal` error.
    pub fn on_rpc_gone(&mut self) -> Response {
        let op = self.running.take().map_or("rpc", |r| r.op);
        Response::error(ErrorKind::Internal, format!("{op}: ended without a reply"))
    }

    /// The RPC's reply could not be encoded (over the frame cap): the RPC ends with the
    /// returned `internal` error.
    pub fn on_reply_unencodable(&mut self, why: &str) -> Response {
        let op = self.running.take().map_or("rpc", |r| r.op);
        Response::error(ErrorKind::Internal, format!("{op}: {why}"))
    }

    /// The client will send nothing more (EOF): the RPC in flight's input ends.
    pub fn end_input(&mut self) {
        if let Some(run) = &mut self.running {
            run.input_open = false;
        }
    }

    /// Once no RPC is in flight, the held frame (if any) as a fresh verdict.
    pub fn next_held(&mut self) -> Option<Verdict> {
        if self.running.is_some() {
            return None;
        }
        let pending = self.held.take()?;
        Some(self.begin(pending))
    }

    /// Whether an RPC is in flight.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// Whether the RPC in flight still takes input.
    pub fn input_open(&self) -> bool {
        self.running.as_ref().is_some_and(|r| r.input_open)
    }

    /// Whether the driver may take another inbound frame (nothing is held).
    pub fn can_take(&self) -> bool {
        self.held.is_none()
    }

    /// Nothing in flight and nothing held.
    pub fn idle(&self) -> bool {
        self.running.is_none() && self.held.is_none()
    }
}

fn to_input(req: Request) -> Input {
    match req {
        Request::Stdin { data } => Input::Stdin(data.0),
        Request::StdinClose => Input::StdinClose,
        Request::Data { data } => Input::Data(data.0),
        // is_continuation() admits only the four continuation ops.
        _ => Input::DataEnd,
    }
}

/// The `error` frame answering a frame that could not be decoded.
pub fn decode_error_frame(err: &DecodeError) -> Response {
    match err {
        DecodeError::TooLarge => Response::error(ErrorKind::BadRequest, err.to_string()),
        DecodeError::Parse(_) => Response::error(ErrorKind::BadRequest, err.to_string()),
        DecodeError::UnknownOp(op) => Response::error(ErrorKind::Unimplemented, format!("unknown op {op:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::Bytes64;

    fn exec(detach: bool) -> Request {
        Request::Exec {
            argv: vec!["true".into()],
            cwd: None,
            env: None,
            user: None,
            detach: Some(detach),
            session: None,
        }
    }

    fn stdin(b: &[u8]) -> Request {
        Request::Stdin { data: Bytes64(b.to_vec()) }
    }

    #[test]
    fn stray_continuation_only_when_it_opens_the_connection() {
        let mut s = ConnState::new();
        assert_eq!(
            s.on_inbound(Ok(Request::DataEnd)),
            Verdict::Reply(Response::error(ErrorKind::BadRequest, STRAY_MESSAGE))
        );
        assert_eq!(s.on_inbound(Ok(stdin(b"x"))), Verdict::Drop);
        assert!(s.idle());
    }

    #[test]
    fn continuation_after_exit_is_dropped() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(exec(false))), Verdict::Start(_)));
        assert_eq!(s.on_inbound(Ok(stdin(b"a"))), Verdict::Feed(Input::Stdin(b"a".to_vec())));
        assert!(!s.on_reply(&Response::Started { pid: 1 }));
        assert!(!s.on_reply(&Response::Stdout { data: Bytes64(b"a".to_vec()) }));
        assert!(s.on_reply(&Response::Exit { code: 0 }));
        assert_eq!(s.on_inbound(Ok(Request::StdinClose)), Verdict::Drop);
        assert!(matches!(s.on_inbound(Ok(Request::Ps)), Verdict::Start(Request::Ps)));
    }

    #[test]
    fn logs_exit_is_followed_by_done() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(Request::Logs { pid: 3 })), Verdict::Start(_)));
        assert!(!s.on_reply(&Response::Exit { code: 0 }));
        assert!(s.on_reply(&Response::Done));
    }

    #[test]
    fn detached_exec_ends_at_started() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(exec(true))), Verdict::Start(_)));
        assert!(s.on_reply(&Response::Started { pid: 7 }));
        assert!(!s.running());
    }

    #[test]
    fn request_mid_stream_is_held_and_ends_input() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(Request::Info)), Verdict::Start(Request::Info)));
        assert_eq!(s.on_inbound(Ok(exec(false))), Verdict::Held);
        assert!(!s.input_open());
        assert!(!s.can_take());
        assert!(s.next_held().is_none(), "info still in flight");
        assert!(s.on_reply(&Response::Info { version: "x".into(), proto: 2, uptime_secs: 0, procs: 0, sessions: 0 }));
        assert!(matches!(s.next_held(), Some(Verdict::Start(Request::Exec { .. }))));
        assert!(s.input_open());
    }

    #[test]
    fn parse_errors_are_answered_in_order() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(Request::Ps)), Verdict::Start(_)));
        assert_eq!(s.on_inbound(Err(DecodeError::Parse("x".into()))), Verdict::Held);
        assert!(s.on_reply(&Response::Procs { procs: vec![] }));
        match s.next_held() {
            Some(Verdict::Reply(Response::Error { kind: ErrorKind::BadRequest, message })) => {
                assert_eq!(message, "parse: x")
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(s.idle());
        let oversized = s.on_inbound(Err(DecodeError::TooLarge));
        assert!(matches!(oversized, Verdict::Reply(Response::Error { kind: ErrorKind::BadRequest, .. })));
    }

    #[test]
    fn op_gone_without_reply_is_internal() {
        let mut s = ConnState::new();
        assert!(matches!(s.on_inbound(Ok(Request::Ps)), Verdict::Start(_)));
        let err = s.on_rpc_gone();
        assert_eq!(err, Response::error(ErrorKind::Internal, "ps: ended without a reply"));
        assert!(s.idle());
    }
}

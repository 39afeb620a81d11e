//! The connection engine: serves `proto` 2 on any byte stream (vsock, a mux stream, a Unix
//! socket in tests).
//!
//! One task per connection runs a `select!` loop over: writing buffered reply bytes,
//! taking the next reply of the RPC in flight (only while fewer than [`OUT_HIGH_WATER`]
//! bytes wait to be written, so a slow client back-pressures the op), handing one
//! continuation frame to the op (while it is pending, nothing more is read, so a slow op
//! back-pressures the client), and reading the socket. Each RPC runs as its own task
//! ([`crate::ops::dispatch`]) connected by an [`Rpc`] pair of small bounded channels, so
//! nothing is buffered without bound either way. Protocol decisions live in
//! [`state::ConnState`].
//!
//! Oversized inbound frames (> 8 MiB) are answered with `error{bad_request, "frame exceeds
//! the 8388608-byte cap"}` and the rest of that line is discarded; the connection stays
//! usable. When the socket fails the RPC's reply channel closes, so a foreground op sees
//! [`crate::RpcClosed`] on its next send (and kills its child); sessions and detached
//! processes live in [`crate::agent::Agent`] and survive.

pub mod state;

use crate::agent::Agent;
use crate::rpc::{Input, Rpc, RpcPeer};
use state::{ConnState, Verdict};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::Instrument;
use wire::codec::{decode_request, encode_response_into};
use wire::{FrameSplitter, Response};

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Reply bytes that may wait for the socket before the engine stops taking replies.
pub const OUT_HIGH_WATER: usize = 256 * 1024;
/// Frames of buffering each way between the engine and an op.
const RPC_DEPTH: usize = 4;

static CONN_IDS: AtomicU64 = AtomicU64::new(1);

/// Why a connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("read: {0}")]
    Read(#[source] std::io::Error),
    #[error("write: {0}")]
    Write(#[source] std::io::Error),
}

/// Serves one connection until the client hangs up and the RPC in flight has ended.
/// `via` names the listener in logs.
pub async fn serve<S>(stream: S, agent: Arc<Agent>, via: &str) -> Result<(), ConnError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let conn = CONN_IDS.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!("conn", conn, via);
    let result = Engine::new(agent, conn).run(stream).instrument(span.clone()).await;
    match &result {
        Ok(()) => tracing::debug!(parent: &span, "connection closed"),
        Err(err) => tracing::debug!(parent: &span, %err, "connection ended"),
    }
    result
}

struct Engine {
    agent: Arc<Agent>,
    conn: u64,
    state: ConnState,
    /// Replies of the RPC in flight (dropped when it ends).
    out_rx: Option<mpsc::Receiver<Response>>,
    /// Input of the RPC in flight (dropped when its input ends).
    in_tx: Option<mpsc::Sender<Input>>,
    /// A continuation frame waiting for room in the op's input channel.
    pending_input: Option<Input>,
    out_buf: Vec<u8>,
    out_pos: usize,
    needs_flush: bool,
    rpcs: u64,
}

/// What one turn of the engine loop observed.
enum Event {
    Write(WriteStep),
    Reply(Option<Response>),
    Fed,
    Read,
    Eof,
}

enum WriteStep {
    Wrote(usize),
    Flushed,
}

async fn write_step<W: AsyncWrite + Unpin>(wr: &mut W, buf: &[u8]) -> std::io::Result<WriteStep> {
    if buf.is_empty() {
        wr.flush().await.map(|()| WriteStep::Flushed)
    } else {
        wr.write(buf).await.map(WriteStep::Wrote)
    }
}

async fn next_reply(rx: &mut Option<mpsc::Receiver<Response>>) -> Option<Response> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn input_room(tx: &Option<mpsc::Sender<Input>>) -> Option<mpsc::Permit<'_, Input>> {
    match tx {
        Some(tx) => tx.reserve().await.ok(),
        None => None,
    }
}

impl Engine {
    fn new(agent: Arc<Agent>, conn: u64) -> Self {
        Self {
            agent,
            conn,
            state: ConnState::new(),
            out_rx: None,
            in_tx: None,
            pending_input: None,
            out_buf: Vec::new(),
            out_pos: 0,
            needs_flush: false,
            rpcs: 0,
        }
    }

    async fn run<S>(mut self, stream: S) -> Result<(), ConnError>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mut rd, mut wr) = tokio::io::split(stream);
        let mut splitter = FrameSplitter::new();
        let mut read_buf = vec![0u8; READ_CHUNK];
        let mut eof = false;
        loop {
            if let Some(verdict) = self.state.next_held() {
                self.apply(verdict);
            }
            while self.pending_input.is_none() && self.state.can_take() {
                let Some(frame) = splitter.next_frame() else { break };
                let verdict = self.state.on_inbound(frame.and_then(|line| decode_request(&line)));
                self.apply(verdict);
            }
            let unwritten = self.out_buf.len() - self.out_pos;
            if eof && self.state.idle() && unwritten == 0 && !self.needs_flush {
                return Ok(());
            }
            let want_read = !eof && self.pending_input.is_none() && self.state.can_take();
            let want_reply = self.out_rx.is_some() && unwritten < OUT_HIGH_WATER;
            let want_write = unwritten > 0 || self.needs_flush;
            let event = tokio::select! {
                step = write_step(&mut wr, &self.out_buf[self.out_pos..]), if want_write => {
                    Event::Write(step.map_err(ConnError::Write)?)
                }
                reply = next_reply(&mut self.out_rx), if want_reply => Event::Reply(reply),
                permit = input_room(&self.in_tx), if self.pending_input.is_some() => {
                    if let (Some(permit), Some(input)) = (permit, self.pending_input.take()) {
                        permit.send(input);
                    }
                    // A closed input channel: the op no longer reads input; the frame is dropped.
                    self.pending_input = None;
                    Event::Fed
                }
                read = rd.read(&mut read_buf), if want_read => match read {
                    Ok(0) => Event::Eof,
                    Ok(n) => {
                        splitter.push(&read_buf[..n]);
                        Event::Read
                    }
                    Err(err) => return Err(ConnError::Read(err)),
                },
            };
            match event {
                Event::Write(WriteStep::Wrote(0)) => {
                    return Err(ConnError::Write(std::io::ErrorKind::WriteZero.into()));
                }
                Event::Write(WriteStep::Wrote(n)) => {
                    self.out_pos += n;
                    if self.out_pos == self.out_buf.len() {
                        self.out_buf.clear();
                        self.out_pos = 0;
                        self.needs_flush = true;
                    }
                }
                Event::Write(WriteStep::Flushed) => self.needs_flush = false,
                Event::Reply(Some(resp)) => self.on_reply(resp),
                Event::Reply(None) => {
                    let err = self.state.on_rpc_gone();
                    tracing::warn!("op ended without a terminal reply");
                    self.end_rpc();
                    self.push_frame(&err);
                }
                Event::Eof => {
                    eof = true;
                    self.state.end_input();
                    self.in_tx = None;
                }
                Event::Fed | Event::Read => {}
            }
        }
    }

    fn apply(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Start(req) => self.start(req),
            Verdict::Feed(input) => self.pending_input = Some(input),
            Verdict::Reply(resp) => {
                if let Response::Error { message, .. } = &resp {
                    tracing::debug!(%message, "refused frame");
                }
                self.push_frame(&resp);
            }
            Verdict::Drop => {}
            Verdict::Held => {
                // The held request ends the running RPC's input.
                self.in_tx = None;
                self.pending_input = None;
            }
        }
    }

    fn start(&mut self, req: wire::Request) {
        self.rpcs += 1;
        let (rpc, RpcPeer { out, input }) = Rpc::pair(RPC_DEPTH);
        self.out_rx = Some(out);
        self.in_tx = Some(input);
        self.pending_input = None;
        let span = tracing::info_span!("rpc", conn = self.conn, n = self.rpcs, op = req.op());
        let agent = Arc::clone(&self.agent);
        tokio::spawn(
            async move {
                let mut rpc = rpc;
                tracing::debug!("start");
                if let Err(err) = crate::ops::dispatch(&mut rpc, &agent, req).await {
                    tracing::debug!(kind = err.kind.as_str(), message = %err.message, "op failed");
                    // The client may be gone; then there is nobody to tell.
                    let _ = rpc.send(err.to_frame()).await;
                }
            }
            .instrument(span),
        );
    }

    fn on_reply(&mut self, resp: Response) {
        self.compact();
        let start = self.out_buf.len();
        if let Err(err) = encode_response_into(&resp, &mut self.out_buf) {
            self.out_buf.truncate(start);
            let why = err.to_string();
            tracing::warn!(%why, "unencodable reply");
            let frame = self.state.on_reply_unencodable(&why);
            self.end_rpc();
            self.push_frame(&frame);
            return;
        }
        if self.state.on_reply(&resp) {
            self.end_rpc();
        }
    }

    /// Drops both ends of the finished RPC: its later sends fail, its input ends.
    fn end_rpc(&mut self) {
        self.out_rx = None;
        self.in_tx = None;
        self.pending_input = None;
    }

    /// Drops the already written prefix of the output buffer.
    fn compact(&mut self) {
        if self.out_pos > 0 {
            self.out_buf.drain(..self.out_pos);
            self.out_pos = 0;
        }
    }

    fn push_frame(&mut self, resp: &Response) {
        self.compact();
        let start = self.out_buf.len();
        if encode_response_into(resp, &mut self.out_buf).is_err() {
            // Engine frames are small errors; this cannot exceed the cap.
            self.out_buf.truncate(start);
        }
    }
}

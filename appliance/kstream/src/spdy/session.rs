//! A server SPDY session: the peer opens streams, we accept them, reply, and move bytes.
//!
//! [`Session::accept`] is the session's only reader: it decodes frames, answers PINGs,
//! queues each stream's data for its [`StreamReader`] and returns each new stream. Someone must
//! keep calling it for any stream to make progress. Writes go straight to the connection from
//! any task, one frame at a time under a lock, each flushed (so the header compression
//! context advances in the order frames reach the wire).
//!
//! Follows what `github.com/moby/spdystream` (`connection.go`, `stream.go`) does as the other
//! end: client-initiated streams have odd, increasing ids; a PING with an odd id is echoed;
//! GOAWAY stops new streams but not the open ones.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, FramedWrite};

use super::frame::{goaway, rst, Frame, FrameDecoder, FrameEncoder};
use super::{Headers, Limits, SpdyError};

/// How long a parting GOAWAY may take to write before we give up on it.
const GOAWAY_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

type Writer = FramedWrite<Box<dyn AsyncWrite + Send + Unpin>, FrameEncoder>;

/// What the session hands a stream's reader.
enum Inbound {
    /// Bytes, and the budget permits they hold.
    Data(Bytes, u32),
    Fin,
    Reset(u32),
}

/// The session's record of an open stream.
struct Entry {
    tx: mpsc::UnboundedSender<Inbound>,
    /// Inbound bytes not yet read, counted down from `max_pending_bytes`.
    budget: Arc<Semaphore>,
    remote_closed: bool,
    local_closed: bool,
}

#[derive(Default)]
struct Table {
    entries: HashMap<u32, Entry>,
    /// Streams whose handles were dropped unfinished: the reader resets them.
    abandoned: Vec<u32>,
}

/// What the reader and every stream share.
struct Shared {
    writer: tokio::sync::Mutex<Writer>,
    closed: AtomicBool,
    table: Mutex<Table>,
    abandoned: Notify,
    last_activity: Mutex<Instant>,
    max_frame_size: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The tables hold no invariant a panicking holder could break half-way.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    async fn send(&self, frame: Frame) -> Result<(), SpdyError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(SpdyError::SessionClosed);
        }
        let mut writer = self.writer.lock().await;
        if self.closed.load(Ordering::Acquire) {
            return Err(SpdyError::SessionClosed);
        }
        if let Err(e) = writer.send(frame).await {
            self.closed.store(true, Ordering::Release);
            return Err(e);
        }
        *lock(&self.last_activity) = Instant::now();
        Ok(())
    }

    fn is_open(&self, id: u32) -> bool {
        lock(&self.table).entries.contains_key(&id)
    }

    /// Records that we half-closed `id`; forgets the stream once both sides are closed.
    fn local_closed(&self, id: u32) {
        let mut table = lock(&self.table);
        if let Some(entry) = table.entries.get_mut(&id) {
            entry.local_closed = true;
            if entry.remote_closed {
                table.entries.remove(&id);
            }
        }
    }

    fn abandon(&self, id: u32) {
        let mut table = lock(&self.table);
        if table.entries.remove(&id).is_some() {
            table.abandoned.push(id);
            drop(table);
            self.abandoned.notify_one();
        }
    }
}

/// Inbound data waiting for room in its stream's budget.
struct Delivery {
    stream_id: u32,
    budget: Arc<Semaphore>,
    data: Bytes,
    fin: bool,
}

/// The server side of a SPDY/3.1 connection.
pub struct Session<S> {
    reader: FramedRead<ReadHalf<S>, FrameDecoder>,
    shared: Arc<Shared>,
    limits: Limits,
    last_stream_id: u32,
    goaway_received: bool,
    /// Data taken off the connection but not yet handed over (keeps `accept` cancel-safe).
    pending: Option<Delivery>,
    ended: bool,
}

impl<S: AsyncRead + AsyncWrite + Send + Unpin + 'static> Session<S> {
    /// A session on `io`, which already speaks SPDY (upgraded, or tunnelled).
    pub fn new(io: S, limits: Limits) -> Result<Session<S>, SpdyError> {
        let (read, write) = tokio::io::split(io);
        let write: Box<dyn AsyncWrite + Send + Unpin> = Box::new(write);
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new(FramedWrite::new(write, FrameEncoder::new()?)),
            closed: AtomicBool::new(false),
            table: Mutex::new(Table::default()),
            abandoned: Notify::new(),
            last_activity: Mutex::new(Instant::now()),
            max_frame_size: limits.max_frame_size.max(1),
        });
        Ok(Session {
            reader: FramedRead::new(read, FrameDecoder::new(&limits)),
            shared,
            limits,
            last_stream_id: 0,
            goaway_received: false,
            pending: None,
            ended: false,
        })
    }

    /// Runs the session until the peer opens a stream (returned, not yet replied to), the
    /// peer goes away (`None`: end of connection, or idle past `idle_timeout`), or the peer
    /// breaks the protocol. After `None` or an error the session is over: every stream's reads
    /// fail and writes are refused. Cancel-safe.
    pub async fn accept(&mut self) -> Result<Option<Stream>, SpdyError> {
        if self.ended {
            return Ok(None);
        }
        let result = self.run().await;
        if !matches!(result, Ok(Some(_))) {
            self.end();
        }
        result
    }

    fn end(&mut self) {
        self.ended = true;
        self.pending = None;
        self.shared.closed.store(true, Ordering::Release);
        // Dropping the senders ends every reader with `SessionClosed`.
        lock(&self.shared.table).entries.clear();
    }

    async fn go_away(&self, status: u32) {
        let frame = Frame::GoAway { last_good_stream_id: self.last_stream_id, status };
        let _ = tokio::time::timeout(GOAWAY_WRITE_TIMEOUT, self.shared.send(frame)).await;
    }

    async fn run(&mut self) -> Result<Option<Stream>, SpdyError> {
        loop {
            self.deliver().await;
            let abandoned = std::mem::take(&mut lock(&self.shared.table).abandoned);
            for stream_id in abandoned {
                let status = rst::CANCEL;
                self.shared.send(Frame::RstStream { stream_id, status }).await?;
            }
            let deadline = *lock(&self.shared.last_activity) + self.limits.idle_timeout;
            let next = tokio::select! {
                biased;
                () = self.shared.abandoned.notified() => continue,
                next = tokio::time::timeout_at(deadline, self.reader.next()) => next,
            };
            let frame = match next {
                Err(_idle) => {
                    if *lock(&self.shared.last_activity) + self.limits.idle_timeout > Instant::now() {
                        continue;
                    }
                    tracing::debug!(timeout = ?self.limits.idle_timeout, "SPDY session idle; going away");
                    self.go_away(goaway::OK).await;
                    return Ok(None);
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    self.go_away(goaway::PROTOCOL_ERROR).await;
                    return Err(e);
                }
                Ok(Some(Ok(frame))) => frame,
            };
            *lock(&self.shared.last_activity) = Instant::now();
            if let Some(stream) = self.handle(frame).await? {
                return Ok(Some(stream));
            }
        }
    }

    async fn handle(&mut self, frame: Frame) -> Result<Option<Stream>, SpdyError> {
        match frame {
            Frame::SynStream { stream_id, fin, headers, .. } => return self.open(stream_id, fin, headers).await,
            Frame::Data { stream_id, fin, data } => self.receive(stream_id, data, fin).await?,
            Frame::Headers { stream_id, fin: true, .. } => self.receive(stream_id, Bytes::new(), true).await?,
            Frame::RstStream { stream_id, status } => {
                if let Some(entry) = lock(&self.shared.table).entries.remove(&stream_id) {
                    let _ = entry.tx.send(Inbound::Reset(status));
                }
            }
            // Odd ids are the peer's own probes; even ones would answer ours, and we send none.
            Frame::Ping { id } if id & 1 == 1 => self.shared.send(Frame::Ping { id }).await?,
            Frame::GoAway { .. } => self.goaway_received = true,
            // No flow control (see the module docs); we open no streams to be replied to.
            Frame::Ping { .. }
            | Frame::Headers { .. }
            | Frame::SynReply { .. }
            | Frame::Settings { .. }
            | Frame::WindowUpdate { .. } => {}
        }
        Ok(None)
    }

    async fn open(&mut self, stream_id: u32, fin: bool, headers: Headers) -> Result<Option<Stream>, SpdyError> {
        if stream_id & 1 == 0 || stream_id <= self.last_stream_id {
            self.go_away(goaway::PROTOCOL_ERROR).await;
            return Err(SpdyError::Protocol("the peer's stream ids must be odd and increasing"));
        }
        self.last_stream_id = stream_id;
        let open = lock(&self.shared.table).entries.len();
        if self.goaway_received || open >= self.limits.max_streams {
            tracing::debug!(stream_id, open, "SPDY stream refused");
            let status = rst::REFUSED_STREAM;
            self.shared.send(Frame::RstStream { stream_id, status }).await?;
            return Ok(None);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let budget = Arc::new(Semaphore::new(self.limits.max_pending_bytes.max(1)));
        if fin {
            let _ = tx.send(Inbound::Fin);
        }
        let entry = Entry { tx, budget: budget.clone(), remote_closed: fin, local_closed: false };
        lock(&self.shared.table).entries.insert(stream_id, entry);
        let core = Arc::new(Core { id: stream_id, shared: self.shared.clone(), local_closed: AtomicBool::new(false) });
        Ok(Some(Stream {
            headers,
            reader: StreamReader { core: core.clone(), rx, budget, done: false },
            writer: StreamWriter { core },
        }))
    }

    async fn receive(&mut self, stream_id: u32, data: Bytes, fin: bool) -> Result<(), SpdyError> {
        let budget = self.budget_for(stream_id);
        let Some(budget) = budget else {
            return Ok(());
        };
        let Ok(budget) = budget else {
            let status = rst::STREAM_ALREADY_CLOSED;
            return self.shared.send(Frame::RstStream { stream_id, status }).await;
        };
        self.pending = Some(Delivery { stream_id, budget, data, fin });
        self.deliver().await;
        Ok(())
    }

    /// The budget of an open stream; `None` for a stream that is gone (late frames are
    /// dropped); `Err` when the peer already half-closed it (the stream is reset).
    fn budget_for(&self, stream_id: u32) -> Option<Result<Arc<Semaphore>, ()>> {
        let mut table = lock(&self.shared.table);
        let entry = table.entries.get(&stream_id)?;
        if !entry.remote_closed {
            return Some(Ok(entry.budget.clone()));
        }
        if let Some(entry) = table.entries.remove(&stream_id) {
            let _ = entry.tx.send(Inbound::Reset(rst::STREAM_ALREADY_CLOSED));
        }
        Some(Err(()))
    }

    /// Hands the pending data to its stream once the stream's budget has room.
    async fn deliver(&mut self) {
        let Some(delivery) = &self.pending else {
            return;
        };
        let budget = delivery.budget.clone();
        // A frame is at most `max_frame_size`; a budget smaller than that holds one frame.
        let cost = delivery.data.len().min(self.limits.max_pending_bytes.max(1));
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        let accepted = cost == 0
            || match budget.acquire_many_owned(cost).await {
                Ok(permits) => {
                    permits.forget();
                    true
                }
                Err(_reader_gone) => false,
            };
        let Some(Delivery { stream_id, data, fin, .. }) = self.pending.take() else {
            return;
        };
        let mut table = lock(&self.shared.table);
        let Some(entry) = table.entries.get_mut(&stream_id) else {
            return;
        };
        if accepted && !data.is_empty() {
            let _ = entry.tx.send(Inbound::Data(data, cost));
        }
        if fin {
            entry.remote_closed = true;
            let _ = entry.tx.send(Inbound::Fin);
            if entry.local_closed {
                table.entries.remove(&stream_id);
            }
        }
    }
}

/// What both halves of a stream share; dropping the last half of an unfinished stream resets
/// it.
struct Core {
    id: u32,
    shared: Arc<Shared>,
    local_closed: AtomicBool,
}

impl Drop for Core {
    fn drop(&mut self) {
        self.shared.abandon(self.id);
    }
}

/// A stream the peer opened.
pub struct Stream {
    headers: Headers,
    reader: StreamReader,
    writer: StreamWriter,
}

impl Stream {
    /// The stream's id.
    pub fn id(&self) -> u32 {
        self.writer.core.id
    }

    /// The headers the peer opened it with.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// Accepts the stream (SYN_REPLY, no headers); the peer waits for it before it writes.
    pub async fn reply(&self) -> Result<(), SpdyError> {
        let frame = Frame::SynReply { stream_id: self.id(), fin: false, headers: Headers::new() };
        self.writer.core.shared.send(frame).await
    }

    /// Refuses or abandons the stream (RST_STREAM with `status`, one of [`super::rst`]).
    pub async fn reset(self, status: u32) -> Result<(), SpdyError> {
        self.writer.reset(status).await
    }

    /// The reading and writing halves, usable from two tasks.
    pub fn split(self) -> (StreamReader, StreamWriter) {
        (self.reader, self.writer)
    }
}

/// The peer's side of a stream.
pub struct StreamReader {
    core: Arc<Core>,
    rx: mpsc::UnboundedReceiver<Inbound>,
    budget: Arc<Semaphore>,
    done: bool,
}

impl StreamReader {
    /// The next bytes from the peer; `None` once the peer half-closed the stream. Fails when
    /// the peer resets the stream or the session ends.
    pub async fn read(&mut self) -> Result<Option<Bytes>, SpdyError> {
        if self.done {
            return Ok(None);
        }
        match self.rx.recv().await {
            Some(Inbound::Data(data, cost)) => {
                self.budget.add_permits(cost as usize);
                Ok(Some(data))
            }
            Some(Inbound::Fin) => {
                self.done = true;
                Ok(None)
            }
            Some(Inbound::Reset(status)) => Err(SpdyError::Reset(status)),
            None => Err(SpdyError::SessionClosed),
        }
    }

    /// The stream's id.
    pub fn id(&self) -> u32 {
        self.core.id
    }
}

impl Drop for StreamReader {
    fn drop(&mut self) {
        // Nobody reads any more: let the session drop this stream's data instead of waiting.
        self.budget.close();
    }
}

/// Our side of a stream.
pub struct StreamWriter {
    core: Arc<Core>,
}

impl StreamWriter {
    /// Sends `data`, in frames of at most `max_frame_size`.
    pub async fn write(&self, data: &[u8]) -> Result<(), SpdyError> {
        let shared = &self.core.shared;
        if self.core.local_closed.load(Ordering::Acquire) {
            return Err(SpdyError::StreamClosed);
        }
        if !shared.is_open(self.core.id) {
            return Err(SpdyError::StreamGone);
        }
        for chunk in data.chunks(shared.max_frame_size) {
            let frame = Frame::Data { stream_id: self.core.id, fin: false, data: Bytes::copy_from_slice(chunk) };
            shared.send(frame).await?;
        }
        Ok(())
    }

    /// Half-closes our side (an empty data frame with FIN); closing twice is a no-op.
    pub async fn close(&self) -> Result<(), SpdyError> {
        if self.core.local_closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let frame = Frame::Data { stream_id: self.core.id, fin: true, data: Bytes::new() };
        self.core.shared.send(frame).await?;
        self.core.shared.local_closed(self.core.id);
        Ok(())
    }

    /// Ends the stream abnormally (RST_STREAM with `status`, one of [`super::rst`]).
    pub async fn reset(&self, status: u32) -> Result<(), SpdyError> {
        self.core.local_closed.store(true, Ordering::Release);
        let removed = lock(&self.core.shared.table).entries.remove(&self.core.id).is_some();
        if !removed {
            return Ok(());
        }
        let stream_id = self.core.id;
        self.core.shared.send(Frame::RstStream { stream_id, status }).await
    }

    /// The stream's id.
    pub fn id(&self) -> u32 {
        self.core.id
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;

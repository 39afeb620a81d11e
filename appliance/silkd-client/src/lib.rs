//! A host-side silkd client over any `AsyncRead + AsyncWrite` stream (an agent
//! connection opened by `vmm`, a test socket). One [`AgentConn`] is one proto-2
//! connection: RPCs run back to back on it.
//!
//! The client mirrors what the public SDK does on the wire, so tests and tools that use
//! it exercise the same frames users send.
//!
//! Everything a guest sends is untrusted: a call that collects output ([`AgentConn::exec`],
//! [`AgentConn::download`]) keeps at most the connection's output cap in memory
//! ([`DEFAULT_OUTPUT_CAP`], [`AgentConn::with_output_cap`]) and fails with
//! [`ClientError::OutputTooLarge`] past it. [`OutputBuffer`] is that bounded collector, for
//! callers that run their own exec loop (sandboxd's `/exec`). After `OutputTooLarge` the
//! connection is mid-RPC: drop it (silkd kills a foreground child once its output can no
//! longer be sent).
//!
//! Streaming calls hand the connection over: [`start_session`] (an interactive exec or a
//! command on a pty, as `kubectl exec`/`attach` need) returns an input and an output half,
//! and [`port_stream`] turns a `port_forward` into a plain byte stream. Neither collects
//! output: each hands on one frame's worth at a time, so a slow reader stalls the guest.

#![forbid(unsafe_code)]

mod port;
mod session;
#[cfg(test)]
mod test_utils;

pub use port::{port_stream, PortStream};
pub use session::{start_session, SessionEvent, SessionInput, SessionOutput, SessionSpec, TermSize};

use std::collections::BTreeMap;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wire::codec::{decode_response, encode_request, FrameSplitter};
pub use wire::ErrorKind;
use wire::{Bytes64, DecodeError, EncodeError, Request, Response};

/// The largest payload this client puts in one `stdin` or `data` frame.
pub const INPUT_CHUNK: usize = 256 * 1024;

/// Reads the next reply frame from `rd`, through `splitter` (whose bytes survive between
/// calls) and the scratch `buf`; an `error` frame is returned as a frame.
async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    splitter: &mut FrameSplitter,
    buf: &mut [u8],
) -> Result<Response, ClientError> {
    loop {
        if let Some(frame) = splitter.next_frame() {
            return Ok(decode_response(&frame?)?);
        }
        let n = rd.read(buf).await?;
        if n == 0 {
            return Err(ClientError::Closed);
        }
        splitter.push(&buf[..n]);
    }
}

/// Writes one request frame to `wr`.
async fn write_frame<W: AsyncWrite + Unpin>(wr: &mut W, req: &Request) -> Result<(), ClientError> {
    wr.write_all(&encode_request(req)?).await?;
    Ok(())
}

/// Writes `data` as `stdin` frames of at most [`INPUT_CHUNK`] bytes.
async fn write_stdin<W: AsyncWrite + Unpin>(wr: &mut W, data: &[u8]) -> Result<(), ClientError> {
    for chunk in data.chunks(INPUT_CHUNK) {
        write_frame(wr, &Request::Stdin { data: Bytes64(chunk.to_vec()) }).await?;
    }
    Ok(())
}

/// Bytes of host randomness sent to each clone (512 bits, twice the CRNG key).
pub const HOST_RESEED_BYTES: usize = 64;

/// What went wrong talking to silkd.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("agent connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("agent closed the connection mid-RPC")]
    Closed,
    #[error("agent sent a bad frame")]
    Decode(#[from] DecodeError),
    #[error("could not encode a request")]
    Encode(#[from] EncodeError),
    /// silkd answered an `error` frame.
    #[error("silkd {kind:?}: {message}")]
    Agent { kind: ErrorKind, message: String },
    #[error("expected a {expected} frame, got {got}")]
    Unexpected { expected: &'static str, got: String },
    /// The guest sent more output than the call keeps (the connection is mid-RPC: drop it).
    #[error(transparent)]
    OutputTooLarge(#[from] OutputTooLarge),
}

/// Default cap on the bytes one collecting call keeps: stdout + stderr of an
/// [`AgentConn::exec`], the data of an [`AgentConn::download`]. The same 8 MiB sandboxd's
/// `/exec` has always answered `413` past.
pub const DEFAULT_OUTPUT_CAP: usize = 8 * 1024 * 1024;

/// Guest output went past a collector's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the guest sent more than {cap} bytes of output (the cap of this call; raise it with AgentConn::with_output_cap if the output is expected)")]
pub struct OutputTooLarge {
    /// The cap, in bytes.
    pub cap: usize,
}

/// Which output stream a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Collects a process's stdout and stderr under one byte cap on their sum. A chunk that would
/// take the total past the cap is refused whole, so the buffer never holds more than `cap`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputBuffer {
    cap: usize,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl OutputBuffer {
    /// An empty buffer keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self { cap, stdout: Vec::new(), stderr: Vec::new() }
    }

    /// Appends `data` to `stream`, or refuses it (nothing appended) past the cap.
    pub fn push(&mut self, stream: Stream, data: &[u8]) -> Result<(), OutputTooLarge> {
        let total = self.len().checked_add(data.len()).filter(|&t| t <= self.cap);
        if total.is_none() {
            return Err(OutputTooLarge { cap: self.cap });
        }
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(data),
            Stream::Stderr => self.stderr.extend_from_slice(data),
        }
        Ok(())
    }

    /// Bytes held (stdout + stderr).
    pub fn len(&self) -> usize {
        self.stdout.len() + self.stderr.len()
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cap, in bytes.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// `(stdout, stderr)`.
    pub fn into_parts(self) -> (Vec<u8>, Vec<u8>) {
        (self.stdout, self.stderr)
    }
}

/// The result of a buffered exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Fields of an exec request beyond argv.
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    pub cwd: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    pub user: Option<String>,
}

/// One silkd connection.
pub struct AgentConn<S> {
    stream: S,
    splitter: FrameSplitter,
    buf: Vec<u8>,
    output_cap: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AgentConn<S> {
    pub fn new(stream: S) -> Self {
        Self { stream, splitter: FrameSplitter::new(), buf: vec![0; 256 * 1024], output_cap: DEFAULT_OUTPUT_CAP }
    }

    /// Sets the cap on the output one collecting call keeps ([`DEFAULT_OUTPUT_CAP`] by default).
    pub fn with_output_cap(mut self, cap: usize) -> Self {
        self.output_cap = cap;
        self
    }

    /// The cap on the output one collecting call keeps.
    pub fn output_cap(&self) -> usize {
        self.output_cap
    }

    /// The underlying stream (for splicing after a `port_forward` `ready`, say).
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The stream, with the frame bytes already read from it and the read buffer (for a
    /// streaming call that takes the connection over).
    fn into_parts(self) -> (S, FrameSplitter, Vec<u8>) {
        (self.stream, self.splitter, self.buf)
    }

    /// Sends one request frame.
    pub async fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        write_frame(&mut self.stream, req).await
    }

    /// Reads one reply frame; an `error` frame is returned as a frame, not an `Err`.
    pub async fn recv_frame(&mut self) -> Result<Response, ClientError> {
        read_frame(&mut self.stream, &mut self.splitter, &mut self.buf).await
    }

    /// Reads one reply frame; an `error` frame becomes [`ClientError::Agent`].
    pub async fn recv(&mut self) -> Result<Response, ClientError> {
        match self.recv_frame().await? {
            Response::Error { kind, message } => Err(ClientError::Agent { kind, message }),
            other => Ok(other),
        }
    }

    /// `info`.
    pub async fn info(&mut self) -> Result<Response, ClientError> {
        self.send(&Request::Info).await?;
        match self.recv().await? {
            info @ Response::Info { .. } => Ok(info),
            other => Err(unexpected("info", &other)),
        }
    }

    /// Sends a single-reply request and returns its reply (`done` included).
    pub async fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        self.send(req).await?;
        self.recv().await
    }

    /// Runs argv to completion, feeding `stdin` (then `stdin_close`), collecting output: at
    /// most [`AgentConn::output_cap`] bytes of stdout + stderr, else
    /// [`ClientError::OutputTooLarge`].
    pub async fn exec(&mut self, argv: &[&str], opts: ExecOptions, stdin: &[u8]) -> Result<ExecOutput, ClientError> {
        let req = Request::Exec {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: opts.cwd,
            env: opts.env,
            user: opts.user,
            detach: None,
            session: None,
        };
        self.send(&req).await?;
        let mut output = OutputBuffer::new(self.output_cap);
        let (mut reader, mut writer) = tokio::io::split(&mut self.stream);
        let feed = async {
            write_stdin(&mut writer, stdin).await?;
            write_frame(&mut writer, &Request::StdinClose).await
        };
        let splitter = &mut self.splitter;
        let buf = &mut self.buf;
        let read = async {
            loop {
                match read_frame(&mut reader, splitter, buf).await? {
                    Response::Started { .. } => {}
                    Response::Stdout { data } => output.push(Stream::Stdout, &data.0)?,
                    Response::Stderr { data } => output.push(Stream::Stderr, &data.0)?,
                    Response::Exit { code } => return Ok(code),
                    Response::Error { kind, message } => return Err(ClientError::Agent { kind, message }),
                    other => return Err(unexpected("exec output", &other)),
                }
            }
        };
        // The output cap ends the call at once, whatever the stdin feed is doing.
        let (fed, code) = tokio::join!(feed, read);
        let code = code?;
        // A write failure after the child exited is not an error of the exec.
        if let Err(e) = fed {
            tracing::debug!(error = %e, "stdin feed ended early");
        }
        let (stdout, stderr) = output.into_parts();
        Ok(ExecOutput { code, stdout, stderr })
    }

    /// Starts argv detached (`detach: true`): the RPC ends at `started`, whose guest pid is
    /// returned; the process outlives this connection and its output is not collected.
    pub async fn exec_detached(&mut self, argv: &[&str], opts: ExecOptions) -> Result<u32, ClientError> {
        self.send(&Request::Exec {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: opts.cwd,
            env: opts.env,
            user: opts.user,
            detach: Some(true),
            session: None,
        })
        .await?;
        match self.recv().await? {
            Response::Started { pid } => Ok(pid),
            other => Err(unexpected("started", &other)),
        }
    }

    /// Uploads `data` with `fs_write` and waits for `done`.
    pub async fn write_file(&mut self, path: &str, data: &[u8], mode: Option<u32>) -> Result<(), ClientError> {
        self.send(&Request::FsWrite { path: path.into(), mode }).await?;
        self.upload(data, 256 * 1024).await
    }

    /// Streams `data` as `data` frames then `data_end`, and waits for `done`.
    pub async fn upload(&mut self, data: &[u8], chunk: usize) -> Result<(), ClientError> {
        for piece in data.chunks(chunk.max(1)) {
            self.send(&Request::Data { data: Bytes64(piece.to_vec()) }).await?;
        }
        self.send(&Request::DataEnd).await?;
        self.expect_done().await
    }

    /// Collects the `data` frames of an RPC up to `done` (`fs_read`, `fs_pull`): at most
    /// [`AgentConn::output_cap`] bytes, else [`ClientError::OutputTooLarge`].
    pub async fn download(&mut self, req: &Request) -> Result<Vec<u8>, ClientError> {
        self.send(req).await?;
        let mut out = OutputBuffer::new(self.output_cap);
        loop {
            match self.recv().await? {
                Response::Data { data } => out.push(Stream::Stdout, &data.0)?,
                Response::Done => return Ok(out.into_parts().0),
                other => return Err(unexpected("data", &other)),
            }
        }
    }

    /// `reseed`: mixes `data` into the guest kernel's entropy pool and forces a CRNG reseed
    /// (at most [`wire::RESEED_MAX_BYTES`] bytes).
    pub async fn reseed(&mut self, data: &[u8]) -> Result<(), ClientError> {
        self.send(&Request::Reseed { data: Bytes64(data.to_vec()) }).await?;
        self.expect_done().await
    }

    /// Reseeds the guest with [`HOST_RESEED_BYTES`] fresh bytes from the host's CSPRNG: what
    /// the host does to every clone of a snapshot before handing it out.
    pub async fn reseed_from_host(&mut self) -> Result<(), ClientError> {
        let mut data = [0u8; HOST_RESEED_BYTES];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut data);
        self.reseed(&data).await
    }

    /// `set_clock`: steps the guest's realtime clock to `at`.
    pub async fn set_clock(&mut self, at: std::time::SystemTime) -> Result<(), ClientError> {
        let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let unix_ns = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        self.send(&Request::SetClock { unix_ns }).await?;
        self.expect_done().await
    }

    /// Sets the guest's clock to the host's now: what the host does to every VM restored from
    /// a snapshot or resumed after waiting paused, before handing it out.
    pub async fn set_clock_from_host(&mut self) -> Result<(), ClientError> {
        self.set_clock(std::time::SystemTime::now()).await
    }

    /// `volume_mount`: the guest links (and, with `mount`, mounts) the disk the host plugged
    /// at SCSI target `target`.
    pub async fn volume_mount(
        &mut self,
        name: &str,
        target: u16,
        mount: Option<&str>,
        read_only: bool,
    ) -> Result<(), ClientError> {
        self.send(&Request::VolumeMount {
            name: name.to_string(),
            target,
            mount: mount.map(str::to_string),
            read_only,
        })
        .await?;
        self.expect_done().await
    }

    /// `volume_unmount`: the guest lets go of the disk at SCSI target `target` before the host
    /// unplugs it.
    pub async fn volume_unmount(&mut self, name: &str, target: u16) -> Result<(), ClientError> {
        self.send(&Request::VolumeUnmount { name: name.to_string(), target }).await?;
        self.expect_done().await
    }

    /// `pty_resize`: sets the terminal size of the pty whose child is `pid` (a pid from
    /// [`start_session`] with a tty). Send it on a second connection: the session's own is
    /// taken by the session. A pid without a pty is [`ClientError::Agent`] `not_found`.
    pub async fn pty_resize(&mut self, pid: u32, cols: u16, rows: u16) -> Result<(), ClientError> {
        self.send(&Request::PtyResize { pid, cols, rows }).await?;
        self.expect_done().await
    }

    /// Waits for `done`.
    pub async fn expect_done(&mut self) -> Result<(), ClientError> {
        match self.recv().await? {
            Response::Done => Ok(()),
            other => Err(unexpected("done", &other)),
        }
    }
}

fn unexpected(expected: &'static str, got: &Response) -> ClientError {
    ClientError::Unexpected { expected, got: got.type_name().to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::codec::{decode_request, encode_response};

    /// Runs [`AgentConn::exec_detached`] against a fake agent that answers `reply` to the one
    /// request it reads; returns the result and that request.
    async fn detached_against(reply: Response, opts: ExecOptions) -> (Result<u32, ClientError>, Request) {
        let (client, mut agent) = tokio::io::duplex(64 * 1024);
        let fake = tokio::spawn(async move {
            let mut splitter = FrameSplitter::new();
            let mut buf = vec![0; 4096];
            let frame = loop {
                if let Some(frame) = splitter.next_frame() {
                    break frame.expect("frame");
                }
                let n = agent.read(&mut buf).await.expect("read");
                assert_ne!(n, 0, "the client closed before sending a request");
                splitter.push(&buf[..n]);
            };
            agent.write_all(&encode_response(&reply).expect("encode")).await.expect("write");
            decode_request(&frame).expect("decode")
        });
        let got = AgentConn::new(client).exec_detached(&["sleep", "9"], opts).await;
        (got, fake.await.expect("fake agent"))
    }

    #[tokio::test]
    async fn exec_detached_sends_detach_and_returns_the_pid() {
        let opts = ExecOptions { cwd: Some("/tmp".into()), env: None, user: Some("dev".into()) };
        let (got, req) = detached_against(Response::Started { pid: 42 }, opts).await;
        assert_eq!(got.expect("started"), 42);
        assert_eq!(
            req,
            Request::Exec {
                argv: vec!["sleep".into(), "9".into()],
                cwd: Some("/tmp".into()),
                env: None,
                user: Some("dev".into()),
                detach: Some(true),
                session: None,
            }
        );
    }

    #[tokio::test]
    async fn exec_detached_fails_on_any_other_reply() {
        let (got, _) = detached_against(Response::Exit { code: 0 }, ExecOptions::default()).await;
        assert!(matches!(got, Err(ClientError::Unexpected { expected: "started", .. })), "{got:?}");
        let refusal = Response::Error { kind: ErrorKind::NotFound, message: "no sleep".into() };
        let (got, _) = detached_against(refusal, ExecOptions::default()).await;
        assert!(matches!(got, Err(ClientError::Agent { kind: ErrorKind::NotFound, .. })), "{got:?}");
    }

    /// A fake agent that reads one request, then sends `chunks` stdout (or `data`) frames of
    /// `chunk` bytes each (forever if `None`) and, if it got that far, `exit 0` (or `done`).
    fn flooding_agent(
        mut agent: tokio::io::DuplexStream,
        chunk: usize,
        chunks: Option<usize>,
        data: bool,
    ) -> tokio::task::JoinHandle<usize> {
        tokio::spawn(async move {
            let mut splitter = FrameSplitter::new();
            let mut buf = vec![0; 4096];
            while splitter.next_frame().is_none() {
                let n = agent.read(&mut buf).await.expect("read");
                assert_ne!(n, 0, "the client closed before sending a request");
                splitter.push(&buf[..n]);
            }
            // Drain whatever the client sends next (stdin, stdin_close) so it never blocks.
            let (mut rd, mut wr) = tokio::io::split(agent);
            tokio::spawn(async move { while rd.read(&mut buf).await.is_ok_and(|n| n > 0) {} });
            let payload = Bytes64(vec![b'x'; chunk]);
            let frame = if data { Response::Data { data: payload } } else { Response::Stdout { data: payload } };
            let frame = encode_response(&frame).expect("encode");
            if !data && wr.write_all(&encode_response(&Response::Started { pid: 7 }).expect("encode")).await.is_err() {
                return 0;
            }
            let mut sent = 0;
            while chunks.is_none_or(|c| sent < c) {
                if wr.write_all(&frame).await.is_err() {
                    return sent;
                }
                sent += 1;
            }
            let end = if data { Response::Done } else { Response::Exit { code: 0 } };
            let _ = wr.write_all(&encode_response(&end).expect("encode")).await;
            sent
        })
    }

    #[test]
    fn output_buffer_holds_at_most_its_cap() {
        let mut b = OutputBuffer::new(10);
        b.push(Stream::Stdout, b"hello").expect("5 of 10");
        b.push(Stream::Stderr, b"world").expect("10 of 10: exactly the cap");
        assert_eq!(b.push(Stream::Stdout, b"!"), Err(OutputTooLarge { cap: 10 }));
        assert_eq!(b.len(), 10, "a refused chunk is not appended");
        assert_eq!(b.into_parts(), (b"hello".to_vec(), b"world".to_vec()));
        let mut b = OutputBuffer::new(0);
        b.push(Stream::Stdout, b"").expect("empty fits");
        assert!(b.push(Stream::Stderr, b"x").is_err());
    }

    #[tokio::test]
    async fn exec_of_endless_stdout_stops_at_the_cap() {
        let (client, agent) = tokio::io::duplex(64 * 1024);
        let fake = flooding_agent(agent, 64 * 1024, None, false);
        let got = AgentConn::new(client).with_output_cap(1024 * 1024).exec(&["yes"], ExecOptions::default(), b"").await;
        assert!(matches!(got, Err(ClientError::OutputTooLarge(OutputTooLarge { cap: 1048576 }))), "{got:?}");
        // The client stopped reading right past the cap and hung up.
        let sent = fake.await.expect("fake agent");
        assert!(sent <= 16 + 2, "the client kept reading after the cap: {sent} frames");
    }

    #[tokio::test]
    async fn exec_output_up_to_the_cap_is_kept() {
        let (client, agent) = tokio::io::duplex(64 * 1024);
        let _fake = flooding_agent(agent, 1000, Some(8), false);
        let out = AgentConn::new(client).with_output_cap(8000).exec(&["x"], ExecOptions::default(), b"in").await;
        let out = out.expect("8000 bytes fit a cap of 8000");
        assert_eq!((out.code, out.stdout.len()), (0, 8000));
    }

    #[tokio::test]
    async fn exec_has_the_default_cap() {
        let (client, agent) = tokio::io::duplex(256 * 1024);
        let fake = flooding_agent(agent, 256 * 1024, None, false);
        let conn = AgentConn::new(client);
        assert_eq!(conn.output_cap(), DEFAULT_OUTPUT_CAP);
        let got = { conn }.exec(&["yes"], ExecOptions::default(), b"").await;
        assert!(matches!(got, Err(ClientError::OutputTooLarge(OutputTooLarge { cap: DEFAULT_OUTPUT_CAP }))), "{got:?}");
        assert!(fake.await.expect("fake agent") <= 32 + 2);
    }

    #[tokio::test]
    async fn download_stops_at_the_cap() {
        let (client, agent) = tokio::io::duplex(64 * 1024);
        let _fake = flooding_agent(agent, 4096, None, true);
        let req = Request::FsRead { path: "/dev/zero".into() };
        let got = AgentConn::new(client).with_output_cap(100_000).download(&req).await;
        assert!(matches!(got, Err(ClientError::OutputTooLarge(OutputTooLarge { cap: 100_000 }))), "{got:?}");
        let (client, agent) = tokio::io::duplex(64 * 1024);
        let _fake = flooding_agent(agent, 4096, Some(2), true);
        let got = AgentConn::new(client).with_output_cap(8192).download(&req).await.expect("8192 fit");
        assert_eq!(got.len(), 8192);
    }
}

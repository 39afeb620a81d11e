//! A host-side silkd client over any `AsyncRead + AsyncWrite` stream (an agent
//! connection opened by `vmm`, a test socket). One [`AgentConn`] is one proto-2
//! connection: RPCs run back to back on it.
//!
//! The client mirrors what the public SDK does on the wire, so tests and tools that use
//! it exercise the same frames users send.

use std::collections::BTreeMap;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wire::codec::{decode_response, encode_request, FrameSplitter};
use wire::{Bytes64, DecodeError, EncodeError, ErrorKind, Request, Response};

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
}

impl<S: AsyncRead + AsyncWrite + Unpin> AgentConn<S> {
    pub fn new(stream: S) -> Self {
        Self { stream, splitter: FrameSplitter::new(), buf: vec![0; 256 * 1024] }
    }

    /// The underlying stream (for splicing after a `port_forward` `ready`, say).
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// Sends one request frame.
    pub async fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        let bytes = encode_request(req)?;
        self.stream.write_all(&bytes).await?;
        Ok(())
    }

    /// Reads one reply frame; an `error` frame is returned as a frame, not an `Err`.
    pub async fn recv_frame(&mut self) -> Result<Response, ClientError> {
        loop {
            if let Some(frame) = self.splitter.next_frame() {
                return Ok(decode_response(&frame?)?);
            }
            let n = self.stream.read(&mut self.buf).await?;
            if n == 0 {
                return Err(ClientError::Closed);
            }
            self.splitter.push(&self.buf[..n]);
        }
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

    /// Runs argv to completion, feeding `stdin` (then `stdin_close`), collecting output.
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
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let (mut reader, mut writer) = tokio::io::split(&mut self.stream);
        let feed = async {
            for chunk in stdin.chunks(256 * 1024) {
                let bytes = encode_request(&Request::Stdin { data: Bytes64(chunk.to_vec()) })?;
                writer.write_all(&bytes).await?;
            }
            writer.write_all(&encode_request(&Request::StdinClose)?).await?;
            Ok::<(), ClientError>(())
        };
        let splitter = &mut self.splitter;
        let buf = &mut self.buf;
        let read = async {
            loop {
                let frame = loop {
                    if let Some(frame) = splitter.next_frame() {
                        break decode_response(&frame?)?;
                    }
                    let n = reader.read(buf).await?;
                    if n == 0 {
                        return Err(ClientError::Closed);
                    }
                    splitter.push(&buf[..n]);
                };
                match frame {
                    Response::Started { .. } => {}
                    Response::Stdout { data } => out.extend_from_slice(&data.0),
                    Response::Stderr { data } => err.extend_from_slice(&data.0),
                    Response::Exit { code } => return Ok(code),
                    Response::Error { kind, message } => return Err(ClientError::Agent { kind, message }),
                    other => return Err(unexpected("exec output", &other)),
                }
            }
        };
        let (fed, code) = tokio::join!(feed, read);
        let code = code?;
        // A write failure after the child exited is not an error of the exec.
        if let Err(e) = fed {
            tracing::debug!(error = %e, "stdin feed ended early");
        }
        Ok(ExecOutput { code, stdout: out, stderr: err })
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

    /// Collects the `data` frames of an RPC up to `done` (`fs_read`, `fs_pull`).
    pub async fn download(&mut self, req: &Request) -> Result<Vec<u8>, ClientError> {
        self.send(req).await?;
        let mut out = Vec::new();
        loop {
            match self.recv().await? {
                Response::Data { data } => out.extend_from_slice(&data.0),
                Response::Done => return Ok(out),
                other => return Err(unexpected("data", &other)),
            }
        }
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
}

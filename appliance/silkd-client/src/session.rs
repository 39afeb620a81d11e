//! Interactive sessions: a foreground `exec` whose stdin and output stream while it runs, or a
//! command on a pseudo-terminal (`pty_open` with `argv`), split into an input and an output
//! half that two tasks can drive at once (what `kubectl exec` and `attach` need).
//!
//! Output is never collected: [`SessionOutput::next`] reads one frame (at most the codec's
//! frame cap) per call, so a caller that stops reading stalls the guest process on a full
//! pipe instead of growing a buffer here.

use crate::{read_frame, unexpected, write_frame, write_stdin, AgentConn, ClientError};
use std::collections::BTreeMap;
use tokio::io::{AsyncRead, AsyncWrite};
use wire::codec::FrameSplitter;
use wire::{Request, Response};

/// A terminal size in character cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermSize {
    pub cols: u16,
    pub rows: u16,
}

/// What to run and how.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionSpec {
    /// The command. With a tty, an empty argv runs the user's login shell; without one it is
    /// refused by silkd (`bad_request`).
    pub argv: Vec<String>,
    /// Run on a pseudo-terminal of this size (stdout and stderr merge into
    /// [`SessionEvent::Stdout`]); `None`: plain pipes, stderr apart.
    pub tty: Option<TermSize>,
    /// Whether the caller feeds stdin. Without it the process sees end of input at once
    /// (a pty has no end of input: its program runs until it exits or the session drops).
    pub stdin: bool,
    pub env: Option<BTreeMap<String, String>>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

/// One piece of a session's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The process exited with this code (`128 + signal` when killed); the last event.
    Exit(i32),
}

/// The input half of a session. Dropping both halves hangs up: silkd kills a foreground
/// process, and sends a pty's process group SIGHUP (then SIGKILL).
pub struct SessionInput {
    wr: Box<dyn AsyncWrite + Send + Unpin>,
    closed: bool,
}

impl SessionInput {
    /// Sends `data` to the process's stdin (the terminal's input with a tty).
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ClientError> {
        if self.closed {
            return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "session stdin is closed").into());
        }
        write_stdin(&mut self.wr, data).await
    }

    /// Ends the input (`stdin_close`); later writes fail. Idempotent. A pty ignores it: its
    /// program runs until it exits or the session is dropped.
    pub async fn close(&mut self) -> Result<(), ClientError> {
        if std::mem::replace(&mut self.closed, true) {
            return Ok(());
        }
        write_frame(&mut self.wr, &Request::StdinClose).await
    }
}

/// The output half of a session.
pub struct SessionOutput {
    rd: Box<dyn AsyncRead + Send + Unpin>,
    splitter: FrameSplitter,
    buf: Vec<u8>,
    tty: bool,
    exited: bool,
}

impl SessionOutput {
    /// The next output chunk, then [`SessionEvent::Exit`], then `None`. An `error` frame from
    /// silkd is [`ClientError::Agent`]; the connection ending before the exit is
    /// [`ClientError::Closed`].
    pub async fn next(&mut self) -> Result<Option<SessionEvent>, ClientError> {
        if self.exited {
            return Ok(None);
        }
        let event = match read_frame(&mut self.rd, &mut self.splitter, &mut self.buf).await? {
            Response::Stdout { data } => SessionEvent::Stdout(data.0),
            // A pty has one output stream; silkd never sends stderr for one, but be sure.
            Response::Stderr { data } if self.tty => SessionEvent::Stdout(data.0),
            Response::Stderr { data } => SessionEvent::Stderr(data.0),
            Response::Exit { code } => {
                self.exited = true;
                SessionEvent::Exit(code)
            }
            Response::Error { kind, message } => return Err(ClientError::Agent { kind, message }),
            other => return Err(unexpected("session output", &other)),
        };
        Ok(Some(event))
    }
}

/// Starts `spec` on `conn`: a foreground `exec`, or `pty_open` with `argv` when
/// [`SessionSpec::tty`] is set. Waits for `started` and returns the guest pid (for
/// [`AgentConn::pty_resize`] on another connection) and the two halves. The connection
/// belongs to the session from here on.
pub async fn start_session<S>(
    mut conn: AgentConn<S>,
    spec: SessionSpec,
) -> Result<(u32, SessionInput, SessionOutput), ClientError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let SessionSpec { argv, tty, stdin, env, cwd, user } = spec;
    let req = match tty {
        Some(size) => Request::PtyOpen {
            argv: (!argv.is_empty()).then_some(argv),
            cols: size.cols,
            rows: size.rows,
            cwd,
            env,
            user,
        },
        None => Request::Exec { argv, cwd, env, user, detach: None, session: None },
    };
    conn.send(&req).await?;
    // Without stdin, end the input at once (pipelined: silkd feeds it to the RPC in flight).
    let close_now = !stdin && tty.is_none();
    if close_now {
        conn.send(&Request::StdinClose).await?;
    }
    let pid = match conn.recv().await? {
        Response::Started { pid } => pid,
        other => return Err(unexpected("started", &other)),
    };
    let (stream, splitter, buf) = conn.into_parts();
    let (rd, wr) = tokio::io::split(stream);
    let input = SessionInput { wr: Box::new(wr), closed: !stdin };
    let output = SessionOutput { rd: Box::new(rd), splitter, buf, tty: tty.is_some(), exited: false };
    Ok((pid, input, output))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_utils::FakeAgent;
    use wire::{Bytes64, DecodeError, MAX_FRAME};

    fn tty_spec() -> SessionSpec {
        SessionSpec { argv: vec!["top".into()], tty: Some(TermSize { cols: 90, rows: 20 }), ..SessionSpec::default() }
    }

    #[tokio::test]
    async fn a_tty_session_is_pty_open_with_argv_and_its_output_is_all_stdout() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            let req = agent.recv().await;
            agent.send(&Response::Started { pid: 9 }).await.expect("started");
            agent.send(&Response::Stderr { data: Bytes64(b"e".to_vec()) }).await.expect("stderr");
            agent.send(&Response::Exit { code: 0 }).await.expect("exit");
            req
        });
        let (pid, _input, mut output) = start_session(conn, tty_spec()).await.expect("started");
        assert_eq!(pid, 9);
        assert_eq!(output.next().await.expect("event"), Some(SessionEvent::Stdout(b"e".to_vec())));
        assert_eq!(output.next().await.expect("event"), Some(SessionEvent::Exit(0)));
        let want =
            Request::PtyOpen { argv: Some(vec!["top".into()]), cols: 90, rows: 20, cwd: None, env: None, user: None };
        assert_eq!(fake.await.expect("fake agent"), Some(want));
    }

    #[tokio::test]
    async fn a_tty_session_without_argv_opens_the_login_shell() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            let req = agent.recv().await;
            agent.send(&Response::error(wire::ErrorKind::Internal, "no")).await.expect("error");
            req
        });
        let spec = SessionSpec { argv: Vec::new(), ..tty_spec() };
        let got = start_session(conn, spec).await.map(|(pid, ..)| pid);
        assert!(matches!(got, Err(ClientError::Agent { .. })), "{got:?}");
        assert!(matches!(fake.await.expect("fake agent"), Some(Request::PtyOpen { argv: None, .. })));
    }

    #[tokio::test]
    async fn an_oversized_output_frame_is_refused_without_holding_it() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            agent.recv().await;
            agent.send(&Response::Started { pid: 9 }).await.expect("started");
            // A frame one byte past the cap, sent in pieces; the client must stop at the cap.
            let piece = vec![b'x'; 1024 * 1024];
            let mut sent = 0;
            while sent <= MAX_FRAME {
                if agent.send_raw(&piece).await.is_err() {
                    break;
                }
                sent += piece.len();
            }
        });
        let (_, input, mut output) = start_session(conn, tty_spec()).await.expect("started");
        let got = output.next().await;
        assert!(matches!(got, Err(ClientError::Decode(DecodeError::TooLarge))), "{got:?}");
        assert!(output.splitter.buffered() <= MAX_FRAME);
        // Both halves gone: the connection closes and the fake's write fails.
        drop((input, output));
        fake.await.expect("fake agent");
    }

    #[tokio::test]
    async fn a_connection_that_ends_before_the_exit_is_closed() {
        let (conn, mut agent) = FakeAgent::pair(64 * 1024);
        let fake = tokio::spawn(async move {
            agent.recv().await;
            agent.send(&Response::Started { pid: 9 }).await.expect("started");
        });
        let spec = SessionSpec { argv: vec!["true".into()], ..SessionSpec::default() };
        let (_, _input, mut output) = start_session(conn, spec).await.expect("started");
        fake.await.expect("fake agent");
        assert!(matches!(output.next().await, Err(ClientError::Closed)));
    }
}

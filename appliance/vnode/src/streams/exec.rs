//! `/exec/{ns}/{pod}/{container}` and `/attach/{ns}/{pod}/{container}` over WebSocket with the
//! channel protocol (`v5`/`v4.channel.k8s.io`), as the kubelet serves them when the API server
//! passes kubectl's upgrade through (`pkg/kubelet/server/server.go`, `getExec`/`getAttach`).
//!
//! Exec runs the command in a silkd session: stdin and resizes in, stdout and stderr out, and
//! the exit on the error channel (`Success`, or `NonZeroExitCode` with the code), then close.
//! Attach streams the VM's live console on stdout (a VM has no container process to attach
//! to); asked for stdin it says to use exec instead. A session whose VM goes away ends with an
//! error status; one whose client goes ends at once.

use super::checks::{running_container, RouteError};
use super::upgrade::{accept, Upgrade};
use super::{AgentIo, PodStreams, Streaming};
use crate::provider::PodKey;
use axum::extract::ws::{Message, WebSocket};
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt as _, StreamExt as _};
use kstream::channel::{self, Inbound, Protocol, TermSize};
use kstream::logs::LogQuery;
use silkd_client::AgentConn;
use silkd_client::{start_session, SessionEvent, SessionSpec};
use std::sync::Arc;

/// What we speak on these routes, for refusals.
const SPEAKS: &str = "v5.channel.k8s.io or v4.channel.k8s.io";
/// What attach answers a request for stdin.
pub(super) const ATTACH_OUTPUT_ONLY: &str = "attach to a sandbox VM is output-only; use kubectl exec -it";
/// A terminal's size until the client sends its own.
const FIRST_SIZE: TermSize = TermSize { width: 80, height: 24 };

/// The query of exec and attach (`command` repeated; flags `true` or `1`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct StreamOptions {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl StreamOptions {
    /// Parses the raw query. The API server names the streams `input`, `output` and `error`
    /// when it forwards to a kubelet (`pkg/apis/core/types.go`, `ExecStdinParam` and its
    /// siblings); the Pod API's own `stdin`, `stdout` and `stderr` are accepted too. At least
    /// one stream must be asked for; with a terminal, stderr is folded into it (the kubelet's
    /// rule too).
    pub(super) fn parse(raw: Option<&str>) -> Result<StreamOptions, RouteError> {
        let mut o = StreamOptions::default();
        for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            let on = v == "true" || v == "1";
            match k.as_ref() {
                "command" => o.command.push(v.into_owned()),
                "input" | "stdin" => o.stdin = on,
                "output" | "stdout" => o.stdout = on,
                "error" | "stderr" => o.stderr = on,
                "tty" => o.tty = on,
                _ => {}
            }
        }
        if !(o.stdin || o.stdout || o.stderr) {
            return Err(RouteError::Query("ask for at least one of stdin, stdout and stderr".into()));
        }
        o.stderr &= !o.tty;
        Ok(o)
    }
}

/// How a session ended.
enum End {
    Exit(i32),
    Failed(String),
    ClientGone,
}

type Tx = SplitSink<WebSocket, Message>;
type Rx = SplitStream<WebSocket>;

/// `EXEC` for [`channel_route`]: the route is `/exec`, else `/attach`.
pub(super) const EXEC: bool = true;
pub(super) const ATTACH: bool = false;

/// `/exec` (`EXEC`) or `/attach`: the checks (options, Pod, container, a session slot, then
/// the protocol), then the upgrade, then the session until either side ends. The slot comes
/// before the protocol: when the WebSocket attempt is refused 429, kubectl falls back to SPDY,
/// and that retry must say 429 too, not "no SPDY here".
pub(super) async fn channel_route<const IS_EXEC: bool>(
    State(s): State<Streaming>,
    Path((ns, pod, container)): Path<(String, String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    ws: Upgrade,
) -> Result<Response, RouteError> {
    let route = if IS_EXEC { "exec" } else { "attach" };
    let opts = StreamOptions::parse(raw.as_deref())?;
    if IS_EXEC && opts.command.is_empty() {
        return Err(RouteError::Query("exec needs a command (query parameter command, repeated)".into()));
    }
    let key = PodKey::new(ns, pod);
    running_container(&s, &key, &container)?;
    let guard = s.sessions.open(&key)?;
    let (ws, protocol) = accept(ws, &headers, route, SPEAKS, Protocol::negotiate, Protocol::name, s.sessions.limits())?;
    let streams = s.streams.clone();
    Ok(ws.on_upgrade(move |socket| async move {
        let _guard = guard;
        let (mut tx, rx) = socket.split();
        let end = if IS_EXEC {
            run_exec(&streams, &key, &opts, protocol, &mut tx, rx).await
        } else {
            run_attach(&streams, &key, &opts, &mut tx, rx).await
        };
        finish(&mut tx, end).await;
    }))
}

/// Writes the end on the error channel (unless the client is gone) and closes.
async fn finish(tx: &mut Tx, end: End) {
    let status = match end {
        End::Exit(0) => channel::status_success(),
        End::Exit(code) => channel::status_exit(code),
        End::Failed(message) => channel::status_error(&message),
        End::ClientGone => return,
    };
    let _ = send(tx, channel::ERROR, &status).await;
    // A normal closure (1000): client-go reads any other close, even one without a code, as a
    // broken error stream and exits 1 (gorilla's `CloseNormalClosure` is its only clean end).
    let normal = axum::extract::ws::CloseFrame { code: axum::extract::ws::close_code::NORMAL, reason: "".into() };
    let _ = tx.send(Message::Close(Some(normal))).await;
    let _ = tx.close().await;
}

/// One message on `channel`; `Err` = the client is gone.
async fn send(tx: &mut Tx, channel: u8, data: &[u8]) -> Result<(), ()> {
    tx.send(Message::Binary(channel::frame(channel, data).into())).await.map_err(drop)
}

async fn run_exec(
    streams: &Arc<dyn PodStreams>,
    key: &PodKey,
    opts: &StreamOptions,
    protocol: Protocol,
    tx: &mut Tx,
    mut rx: Rx,
) -> End {
    let io = match streams.dial_agent(key).await {
        Ok(io) => io,
        Err(e) => return End::Failed(e.to_string()),
    };
    let spec = SessionSpec {
        argv: opts.command.clone(),
        tty: opts.tty.then_some(silkd_client::TermSize { cols: FIRST_SIZE.width, rows: FIRST_SIZE.height }),
        stdin: opts.stdin,
        ..Default::default()
    };
    let (pid, mut input, mut output) = match start_session(AgentConn::new(io), spec).await {
        Ok(started) => started,
        Err(e) => {
            return End::Failed(format!("starting {:?} in the VM: {}", opts.command, foundation::error_chain(&e)))
        }
    };
    // Output and input run side by side: a guest blocked on a full stdout never stalls stdin.
    let out = async {
        loop {
            let event = match output.next().await {
                Ok(Some(event)) => event,
                Ok(None) => return End::Failed("the VM's agent ended the session without an exit status".into()),
                Err(e) => return End::Failed(format!("the VM's agent went away: {}", foundation::error_chain(&e))),
            };
            let sent = match event {
                SessionEvent::Exit(code) => return End::Exit(code),
                SessionEvent::Stdout(d) if opts.stdout => send(tx, channel::STDOUT, &d).await,
                SessionEvent::Stderr(d) if opts.stderr => send(tx, channel::STDERR, &d).await,
                SessionEvent::Stdout(_) | SessionEvent::Stderr(_) => Ok(()),
            };
            if sent.is_err() {
                return End::ClientGone;
            }
        }
    };
    let mut resizer: Option<AgentConn<AgentIo>> = None;
    let inp = async {
        while let Some(Ok(msg)) = rx.next().await {
            let data = match msg {
                Message::Binary(data) => data,
                Message::Close(_) => break,
                Message::Text(_) | Message::Ping(_) | Message::Pong(_) => continue,
            };
            let written = match channel::parse(protocol, &data) {
                Ok(Inbound::Stdin(d)) if opts.stdin => input.write(&d).await,
                Ok(Inbound::StdinClosed) => input.close().await,
                Ok(Inbound::Resize(size)) if opts.tty => {
                    resize(streams, key, &mut resizer, pid, size).await;
                    Ok(())
                }
                Ok(Inbound::Stdin(_) | Inbound::Resize(_) | Inbound::Ignored) => Ok(()),
                Err(e) => return End::Failed(format!("a bad message from the client: {e}")),
            };
            if let Err(e) = written {
                return End::Failed(format!("writing stdin to the VM: {}", foundation::error_chain(&e)));
            }
        }
        End::ClientGone
    };
    tokio::select! {
        end = out => end,
        end = inp => end,
    }
}

/// Resizes the session's terminal on a second agent connection, dialled at the first resize.
/// A failure is logged: the session goes on at its old size.
async fn resize(
    streams: &Arc<dyn PodStreams>,
    key: &PodKey,
    conn: &mut Option<AgentConn<AgentIo>>,
    pid: u32,
    size: TermSize,
) {
    if conn.is_none() {
        match streams.dial_agent(key).await {
            Ok(io) => *conn = Some(AgentConn::new(io)),
            Err(e) => return tracing::debug!(pod = %key, error = %e, "no agent connection for a resize"),
        }
    }
    if let Some(c) = conn.as_mut() {
        if let Err(e) = c.pty_resize(pid, size.width, size.height).await {
            tracing::debug!(pod = %key, error = %foundation::error_chain(&e), "resize failed");
            *conn = None;
        }
    }
}

async fn run_attach(streams: &Arc<dyn PodStreams>, key: &PodKey, opts: &StreamOptions, tx: &mut Tx, mut rx: Rx) -> End {
    if opts.stdin {
        return End::Failed(ATTACH_OUTPUT_ONLY.into());
    }
    let live = LogQuery { follow: true, tail_lines: Some(0), ..Default::default() };
    let query = match live.validate() {
        Ok(q) => q,
        Err(e) => return End::Failed(foundation::error_chain(&e)),
    };
    let mut console = match streams.container_logs(key, &query).await {
        Ok(body) => body,
        Err(e) => return End::Failed(e.to_string()),
    };
    let channel = if opts.stdout { channel::STDOUT } else { channel::STDERR };
    loop {
        tokio::select! {
            chunk = console.next() => match chunk {
                Some(Ok(data)) => if send(tx, channel, &data).await.is_err() { return End::ClientGone },
                Some(Err(e)) => return End::Failed(format!("reading the VM's console: {e}")),
                None => return End::Failed(format!("the console of pod {key} ended: its VM is gone")),
            },
            msg = rx.next() => match msg {
                Some(Ok(Message::Close(_)) | Err(_)) | None => return End::ClientGone,
                Some(Ok(_)) => {}
            },
        }
    }
}

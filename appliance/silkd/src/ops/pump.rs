//! Moves a child's output to where it goes (reply frames, or a detached process's ring)
//! until the child exited and its output drained, and feeds its stdin from the RPC.
//!
//! Output is read in chunks of at most [`CHUNK`] bytes and each chunk is handed on before
//! the next read, so a slow client stalls the child on a full pipe instead of growing a
//! buffer. After the child exits, output is drained for at most [`DRAIN_TIME`] and
//! [`DRAIN_BYTES`] (a background grandchild may hold the pipe open forever).

use crate::procs::{ProcRecord, Stream};
use crate::rpc::{Input, Rpc, RpcClosed, RpcSender};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};
use wire::Response;

/// The largest output chunk silkd emits.
pub const CHUNK: usize = 256 * 1024;
/// How long output is drained after the child exited.
pub const DRAIN_TIME: Duration = Duration::from_secs(2);
/// How many bytes are drained after the child exited.
pub const DRAIN_BYTES: usize = 8 * 1024 * 1024;

/// Where output goes.
pub enum Sink {
    /// `stdout`/`stderr` frames of an RPC.
    Frames(RpcSender),
    /// A detached process's ring.
    Ring(Arc<ProcRecord>),
}

impl Sink {
    async fn emit(&self, stream: Stream, data: &[u8]) -> Result<(), RpcClosed> {
        match self {
            Sink::Frames(tx) => {
                let data = data.to_vec().into();
                tx.send(match stream {
                    Stream::Stdout => Response::Stdout { data },
                    Stream::Stderr => Response::Stderr { data },
                })
                .await
            }
            Sink::Ring(rec) => {
                rec.push_output(stream, data);
                Ok(())
            }
        }
    }
}

async fn read_opt<R: AsyncRead + Unpin>(r: &mut Option<R>, buf: &mut [u8]) -> std::io::Result<usize> {
    match r {
        Some(r) => r.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn sleep_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Pumps `out` and `err` into `sink` until `child` exited and its output drained; the
/// child's exit code (see [`crate::sys::exit_code`]). `Err` when the client is gone.
pub async fn pump_child<O, E>(
    child: &mut Child,
    mut out: Option<O>,
    mut err: Option<E>,
    sink: &Sink,
) -> Result<i32, RpcClosed>
where
    O: AsyncRead + Unpin,
    E: AsyncRead + Unpin,
{
    let mut obuf = vec![0u8; CHUNK];
    let mut ebuf = vec![0u8; CHUNK];
    let mut code: Option<i32> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut drained = 0usize;
    loop {
        if let Some(code) = code {
            if (out.is_none() && err.is_none()) || drained >= DRAIN_BYTES {
                return Ok(code);
            }
        }
        tokio::select! {
            r = read_opt(&mut out, &mut obuf) => match r {
                Ok(0) | Err(_) => out = None,
                Ok(n) => {
                    if code.is_some() {
                        drained += n;
                    }
                    sink.emit(Stream::Stdout, &obuf[..n]).await?;
                }
            },
            r = read_opt(&mut err, &mut ebuf) => match r {
                Ok(0) | Err(_) => err = None,
                Ok(n) => {
                    if code.is_some() {
                        drained += n;
                    }
                    sink.emit(Stream::Stderr, &ebuf[..n]).await?;
                }
            },
            status = child.wait(), if code.is_none() => {
                code = Some(status.map(crate::sys::exit_code).unwrap_or(-1));
                deadline = Some(tokio::time::Instant::now() + DRAIN_TIME);
            }
            () = sleep_opt(deadline) => {
                // Only armed once the child exited.
                return Ok(code.unwrap_or(-1));
            }
        }
    }
}

/// Feeds `stdin` frames to the child's stdin; `stdin_close` (or the end of the RPC's
/// input) closes it. Never returns: run it beside the output pump and drop it when that
/// finishes. Input after the close, and `data` frames, are consumed and ignored.
pub async fn feed_stdin(rpc: &mut Rpc, mut stdin: Option<ChildStdin>) -> Infallible {
    loop {
        match rpc.input().await {
            Some(Input::Stdin(data)) => {
                if let Some(pipe) = &mut stdin {
                    if pipe.write_all(&data).await.is_err() {
                        // The child closed its stdin (or exited); later input goes nowhere.
                        stdin = None;
                    }
                }
            }
            Some(Input::StdinClose) => stdin = None,
            Some(Input::Data(_) | Input::DataEnd) => {}
            None => {
                drop(stdin);
                return std::future::pending().await;
            }
        }
    }
}

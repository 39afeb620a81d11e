//! `ps`, `kill`, `logs`, `attach`: the tracked processes (see [`crate::procs`]).

use crate::agent::Agent;
use crate::error::OpError;
use crate::procs::{Chunk, ProcRecord, Stream};
use crate::rpc::Rpc;
use crate::sys;
use std::sync::Arc;
use wire::Response;

fn record(agent: &Agent, pid: u32) -> Result<Arc<ProcRecord>, OpError> {
    agent.procs.get(pid).ok_or_else(|| OpError::not_found("no such pid"))
}

fn frame(chunk: &Chunk) -> Response {
    let data = chunk.data.to_vec().into();
    match chunk.stream {
        Stream::Stdout => Response::Stdout { data },
        Stream::Stderr => Response::Stderr { data },
    }
}

/// `ps` → `procs{procs}` sorted by pid.
pub async fn ps(rpc: &mut Rpc, agent: &Agent) -> Result<(), OpError> {
    rpc.send(Response::Procs { procs: agent.procs.list() }).await?;
    Ok(())
}

/// `kill {pid, signal?}` → `done`; default SIGKILL, a no-op once the process exited.
pub async fn kill(rpc: &mut Rpc, agent: &Agent, pid: u32, signal: Option<i32>) -> Result<(), OpError> {
    let sig = sys::parse_signal(signal)?;
    let rec = record(agent, pid)?;
    rec.signal(sig).map_err(|e| OpError::internal(format!("kill: {e}")))?;
    tracing::info!(pid, signal = %sig, "signalled");
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `logs {pid}` → the ring's `stdout`/`stderr` frames, `exit{code}` if exited, `done`.
pub async fn logs(rpc: &mut Rpc, agent: &Agent, pid: u32) -> Result<(), OpError> {
    let rec = record(agent, pid)?;
    let snapshot = rec.since(0);
    for chunk in &snapshot.chunks {
        rpc.send(frame(chunk)).await?;
    }
    if let Some(code) = snapshot.exit {
        rpc.send(Response::Exit { code }).await?;
    }
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `attach {pid}` → the ring replayed, then live output, then `exit{code}`; `done` if the
/// record disappears first.
pub async fn attach(rpc: &mut Rpc, agent: &Agent, pid: u32) -> Result<(), OpError> {
    let rec = record(agent, pid)?;
    let mut changes = rec.subscribe();
    let mut next = 0;
    loop {
        let snapshot = rec.since(next);
        for chunk in &snapshot.chunks {
            rpc.send(frame(chunk)).await?;
        }
        next = snapshot.next;
        if let Some(code) = snapshot.exit {
            rpc.send(Response::Exit { code }).await?;
            return Ok(());
        }
        if snapshot.removed {
            rpc.send(Response::Done).await?;
            return Ok(());
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    rpc.send(Response::Done).await?;
                    return Ok(());
                }
            }
            () = rpc.closed() => return Ok(()),
        }
    }
}

//! One module per op family. Each op is `async fn(&mut Rpc, …) -> Result<(), OpError>`;
//! [`dispatch`] routes a request to its op.

/// The answer to a data or stdin frame that belongs to no running op.
pub const STRAY_MESSAGE: &str = "stray data/stdin frame";

pub mod clock;
pub mod entropy;
pub mod exec;
pub mod fs;
pub mod git;
pub mod port;
pub mod proc;
pub mod pty;
mod pump;
pub mod session;
pub mod unimplemented;
pub mod volume;

use crate::agent::Agent;
use crate::error::OpError;
use crate::rpc::Rpc;
use std::sync::Arc;
use wire::{Request, Response, PROTO_KEEP_ALIVE};

/// Runs one request to completion on `rpc`. Continuation frames never get here (the
/// connection engine feeds them to the RPC in flight).
pub async fn dispatch(rpc: &mut Rpc, agent: &Arc<Agent>, req: Request) -> Result<(), OpError> {
    match req {
        Request::Info => info(rpc, agent).await,
        Request::Exec { argv, cwd, env, user, detach, session } => {
            exec::exec(rpc, agent, exec::ExecRequest { argv, cwd, env, user, detach, session }).await
        }
        Request::Stdin { .. } | Request::StdinClose | Request::Data { .. } | Request::DataEnd => {
            Err(OpError::bad_request(STRAY_MESSAGE))
        }
        Request::Ps => proc::ps(rpc, agent).await,
        Request::Kill { pid, signal } => proc::kill(rpc, agent, pid, signal).await,
        Request::Logs { pid } => proc::logs(rpc, agent, pid).await,
        Request::Attach { pid } => proc::attach(rpc, agent, pid).await,
        Request::SessionCreate { id, cwd, env } => session::session_create(rpc, agent, id, cwd, env).await,
        Request::SessionList => session::session_list(rpc, agent).await,
        Request::SessionRm { id } => session::session_rm(rpc, agent, id).await,
        Request::FsWrite { path, mode } => fs::fs_write(rpc, path, mode).await,
        Request::FsRead { path } => fs::fs_read(rpc, path).await,
        Request::FsList { path } => fs::fs_list(rpc, path).await,
        Request::FsStat { path } => fs::fs_stat(rpc, path).await,
        Request::FsMkdir { path, parents } => fs::fs_mkdir(rpc, path, parents.unwrap_or(false)).await,
        Request::FsRm { path, recursive } => fs::fs_rm(rpc, path, recursive.unwrap_or(false)).await,
        Request::FsRename { from, to } => fs::fs_rename(rpc, from, to).await,
        Request::FsPush { dest } => fs::fs_push(rpc, dest).await,
        Request::FsPull { path } => fs::fs_pull(rpc, path).await,
        Request::FsFind { path, pattern, glob } => fs::fs_find(rpc, path, pattern, glob).await,
        Request::FsReplace { files, pattern, replacement } => fs::fs_replace(rpc, files, pattern, replacement).await,
        Request::FsWatch { path, recursive } => fs::fs_watch(rpc, path, recursive.unwrap_or(false)).await,
        Request::PtyOpen { argv, cols, rows, cwd, env, user } => {
            pty::pty_open(rpc, agent, pty::PtyRequest { argv, cols, rows, cwd, env, user }).await
        }
        Request::PtyResize { pid, cols, rows } => pty::pty_resize(rpc, agent, pid, cols, rows).await,
        Request::PortForward { port } => port::port_forward(rpc, port).await,
        Request::Reseed { data } => entropy::reseed(rpc, data.0).await,
        Request::SetClock { unix_ns } => clock::set_clock(rpc, unix_ns).await,
        Request::VolumeMount { name, target, mount, read_only } => {
            volume::volume_mount(rpc, name, target, mount, read_only).await
        }
        Request::VolumeUnmount { name, target } => volume::volume_unmount(rpc, name, target).await,
        Request::GitClone { url, path, branch, depth, auth } => {
            git::git_clone(rpc, url, path, branch, depth, auth).await
        }
        Request::GitAdd { path, files } => git::git_add(rpc, path, files).await,
        Request::GitPush { path, auth } => git::git_push(rpc, path, auth).await,
        Request::GitPull { path, auth } => git::git_pull(rpc, path, auth).await,
        Request::GitStatus { path } => git::git_status(rpc, path).await,
        Request::GitCommit { path, message, author } => git::git_commit(rpc, path, message, author).await,
        Request::GitBranch { path, action, name } => git::git_branch(rpc, path, action, name).await,
        other @ (Request::LspStart { .. } | Request::LspRequest { .. } | Request::LspStop { .. }) => {
            Err(unimplemented::refuse(other.op()))
        }
    }
}

/// `info{version, proto, uptime_secs, procs, sessions}`: `procs` counts running tracked
/// processes, `sessions` live shell sessions.
async fn info(rpc: &mut Rpc, agent: &Agent) -> Result<(), OpError> {
    rpc.send(Response::Info {
        version: env!("CARGO_PKG_VERSION").to_string(),
        proto: PROTO_KEEP_ALIVE,
        uptime_secs: agent.uptime_secs(),
        procs: agent.procs.running(),
        sessions: agent.sessions.len() as u64,
    })
    .await?;
    Ok(())
}

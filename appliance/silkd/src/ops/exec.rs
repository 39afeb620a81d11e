//! `exec`: run a process in the foreground (streamed), detached (ring-buffered), or inside
//! a shell session (see [`super::session`]).
//!
//! Foreground: `started{pid}` → `stdout`/`stderr` chunks (≤ 256 KiB) → `exit{code}`; input
//! `stdin`/`stdin_close`. If the client goes away, the child's process group is killed on
//! the next failed send. Detached: ends at `started{pid}`; output goes into a 256 KiB ring
//! (`logs`, `attach`), the record is kept 5 minutes after exit. Exit codes: the child's
//! code, or `128 + signal` (see [`crate::sys`]).

use super::pump::{feed_stdin, pump_child, Sink};
use crate::agent::Agent;
use crate::error::OpError;
use crate::procs::{ProcKind, DETACHED_RETENTION};
use crate::rpc::Rpc;
use crate::sys::Env;
use crate::sys::{self, ChildSetup, UserSpec};
use nix::sys::signal::Signal;
use std::process::Stdio;
use std::sync::Arc;
use tokio::process::{Child, Command};
use wire::Response;

/// The fields of an `exec` request.
#[derive(Debug, Default)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Option<Env>,
    pub user: Option<String>,
    pub detach: Option<bool>,
    pub session: Option<String>,
}

/// Validates a working directory: missing → `not_found`, not a directory → `bad_request`.
pub(crate) fn check_cwd(op: &str, cwd: Option<&str>) -> Result<(), OpError> {
    let Some(cwd) = cwd else { return Ok(()) };
    match std::fs::metadata(cwd) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(OpError::bad_request(format!("{op}: cwd {cwd}: not a directory"))),
        Err(err) => Err(OpError::io(&format!("{op}: cwd {cwd}"), &err)),
    }
}

/// A command with the protocol's environment, cwd and user applied.
pub(crate) fn command(
    program: &str,
    args: &[String],
    cwd: Option<&str>,
    env: Option<&Env>,
    user: Option<&UserSpec>,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args).env_clear().envs(sys::child_env(user, env));
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    sys::apply_setup(
        &mut cmd,
        ChildSetup { user: user.map(|u| (u.uid, u.gid, u.groups.clone())), controlling_tty: false },
    );
    cmd
}

/// `exec`.
pub async fn exec(rpc: &mut Rpc, agent: &Arc<Agent>, req: ExecRequest) -> Result<(), OpError> {
    if req.argv.is_empty() {
        return Err(OpError::bad_request("argv must not be empty"));
    }
    let detach = req.detach.unwrap_or(false);
    if let Some(session) = req.session.as_deref() {
        if detach {
            return Err(OpError::bad_request("detach is not supported with session"));
        }
        return super::session::exec_in_session(rpc, agent, session, &req.argv).await;
    }
    sys::check_env(req.env.as_ref())?;
    check_cwd("exec", req.cwd.as_deref())?;
    let user = req.user.as_deref().map(sys::lookup_user).transpose()?;
    let mut cmd = command(&req.argv[0], &req.argv[1..], req.cwd.as_deref(), req.env.as_ref(), user.as_ref());
    cmd.stdin(if detach { Stdio::null() } else { Stdio::piped() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().map_err(|e| match e.kind() {
        // A NUL byte in argv or env: the request can never succeed.
        std::io::ErrorKind::InvalidInput => OpError::bad_request(format!("exec: {e}")),
        _ => OpError::io(&format!("exec {}", req.argv[0]), &e),
    })?;
    drop(cmd);
    let Some(pid) = child.id() else {
        return Err(OpError::internal("exec: child vanished before it was tracked"));
    };
    tracing::debug!(pid, argv0 = %req.argv[0], detach, "started");
    if detach {
        run_detached(rpc, agent, child, pid, req.argv).await
    } else {
        run_foreground(rpc, agent, child, pid, req.argv).await
    }
}

async fn run_foreground(
    rpc: &mut Rpc,
    agent: &Arc<Agent>,
    mut child: Child,
    pid: u32,
    argv: Vec<String>,
) -> Result<(), OpError> {
    let rec = agent.procs.insert(pid, argv, ProcKind::Foreground, None);
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let sink = Sink::Frames(rpc.sender());
    let outcome = match rpc.send(Response::Started { pid }).await {
        Err(closed) => Err(closed),
        Ok(()) => {
            let feed = feed_stdin(rpc, stdin);
            let pump = pump_child(&mut child, stdout, stderr, &sink);
            tokio::pin!(feed, pump);
            tokio::select! {
                r = &mut pump => r,
                never = &mut feed => match never {},
            }
        }
    };
    drop(sink);
    match outcome {
        Ok(code) => {
            rec.set_exit(code);
            agent.procs.remove(&rec);
            tracing::debug!(pid, code, "exited");
            rpc.send(Response::Exit { code }).await?;
            Ok(())
        }
        Err(closed) => {
            tracing::info!(pid, "client gone; killing the foreground process group");
            if let Err(err) = rec.signal(Signal::SIGKILL) {
                tracing::warn!(pid, %err, "kill failed");
            }
            let agent = Arc::clone(agent);
            tokio::spawn(async move {
                let code = child.wait().await.map(sys::exit_code).unwrap_or(-1);
                rec.set_exit(code);
                agent.procs.remove(&rec);
            });
            Err(closed.into())
        }
    }
}

async fn run_detached(
    rpc: &mut Rpc,
    agent: &Arc<Agent>,
    mut child: Child,
    pid: u32,
    argv: Vec<String>,
) -> Result<(), OpError> {
    let rec = agent.procs.insert(pid, argv, ProcKind::Detached, None);
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let agent = Arc::clone(agent);
    let keep = Arc::clone(&rec);
    tokio::spawn(async move {
        let sink = Sink::Ring(Arc::clone(&keep));
        // A ring sink never reports a closed client.
        let code = pump_child(&mut child, stdout, stderr, &sink).await.unwrap_or(-1);
        keep.set_exit(code);
        tracing::info!(pid, code, "detached process exited");
        tokio::time::sleep(DETACHED_RETENTION).await;
        agent.procs.remove(&keep);
    });
    rpc.send(Response::Started { pid }).await?;
    Ok(())
}

//! Shell sessions: `session_create`, `session_list`, `session_rm`, and `exec {session}`.
//!
//! A session is one long-lived shell (`bash`, else `/bin/sh`) reading commands from a
//! pipe, in its own process group. At start it runs `exec 9>&1 2>&1`: fd 9 is a private
//! copy of the output pipe, and stderr merges into stdout. Each `exec {session, argv}`
//! writes (argv shell-quoted and joined, so `cd`/`export` run in the shell itself):
//!
//! ```text
//! printf '%s\n' '__silkd_begin_<token>' >&9
//! { 'argv0' 'argv1' …
//! } </dev/null 9>&-
//! printf '\n__silkd_end_<token> %s\n' "$?" >&9
//! ```
//!
//! and reads the shell's output: bytes before the begin marker (late output of earlier
//! background jobs) are discarded, bytes up to `\n__silkd_end_<token> ` are the command's
//! output, the number after it is the exit code. The token is 128 random bits per command,
//! so output cannot forge it; the command's stdin is `/dev/null` so it cannot swallow the
//! marker commands, and fd 9 is closed for it so a command redirecting its own stdout
//! cannot hide the markers. If the shell exits (`exit 3`), the command's exit code is the
//! shell's and the session is removed. Commands of one session run one at a time. A session
//! idle for [`IDLE_TTL`] is reaped. If the client goes away mid-command the output is
//! drained to the end marker, so the session stays in sync.

use super::pump::CHUNK;
use crate::agent::Agent;
use crate::sessions::{lock, SessionIo};
pub use crate::sessions::{Session, SessionTable, IDLE_TTL};

/// Cap on the bytes after an end marker scanned for its exit code line.
const CODE_LINE_MAX: usize = 64;

use crate::error::OpError;
use crate::rpc::{Rpc, RpcClosed};
use crate::sys::{self, Env};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wire::Response;

/// POSIX single-quoting.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `session_create {id?, cwd?, env?}` → `session_created{id}`.
pub async fn session_create(
    rpc: &mut Rpc,
    agent: &Agent,
    id: Option<String>,
    cwd: Option<String>,
    env: Option<Env>,
) -> Result<(), OpError> {
    let id = match id {
        Some(id) if !id.is_empty() => id,
        _ => format!("sess-{}", &sys::random_token()[..12]),
    };
    if agent.sessions.get(&id).is_some() {
        return Err(OpError::bad_request(format!("session {id:?} already exists")));
    }
    sys::check_env(env.as_ref())?;
    super::exec::check_cwd("session_create", cwd.as_deref())?;
    let shell = sys::pick_shell(["/bin/bash", "/usr/bin/bash"]);
    let mut cmd = super::exec::command(&shell, &[], cwd.as_deref(), env.as_ref(), None);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| OpError::io("session_create", &e))?;
    drop(cmd);
    let (Some(pid), Some(mut stdin), Some(stdout)) = (child.id(), child.stdin.take(), child.stdout.take()) else {
        return Err(OpError::internal("session_create: shell vanished at start"));
    };
    stdin.write_all(b"exec 9>&1 2>&1\n").await.map_err(|e| OpError::io("session_create", &e))?;
    let session = Arc::new(Session {
        id: id.clone(),
        pid,
        io: tokio::sync::Mutex::new(SessionIo { stdin, stdout, child }),
        last_used: Mutex::new(Instant::now()),
    });
    {
        let mut map = lock(&agent.sessions.map);
        if map.contains_key(&id) {
            drop(map);
            session.kill();
            return Err(OpError::bad_request(format!("session {id:?} already exists")));
        }
        map.insert(id.clone(), session);
    }
    tracing::info!(%id, pid, %shell, "session created");
    rpc.send(Response::SessionCreated { id }).await?;
    Ok(())
}

/// `session_list` → `sessions{sessions}` (sorted).
pub async fn session_list(rpc: &mut Rpc, agent: &Agent) -> Result<(), OpError> {
    rpc.send(Response::Sessions { sessions: agent.sessions.ids() }).await?;
    Ok(())
}

/// `session_rm {id}` → `done`; unknown → `not_found`.
pub async fn session_rm(rpc: &mut Rpc, agent: &Agent, id: String) -> Result<(), OpError> {
    if !agent.sessions.remove(&id) {
        return Err(OpError::not_found("no such session"));
    }
    tracing::info!(%id, "session removed");
    rpc.send(Response::Done).await?;
    Ok(())
}

/// Where a command's output goes: the client while it listens, else nowhere (the output is
/// still read to keep the session in sync).
struct Output<'a> {
    rpc: &'a mut Rpc,
    gone: bool,
}

impl Output<'_> {
    async fn emit(&mut self, mut data: &[u8]) {
        while !data.is_empty() && !self.gone {
            let n = data.len().min(CHUNK);
            if self.rpc.send(Response::Stdout { data: data[..n].to_vec().into() }).await.is_err() {
                self.gone = true;
            }
            data = &data[n..];
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `exec {session, argv}`: no `started`, stdout frames (stderr merged), `exit{code}`.
pub async fn exec_in_session(rpc: &mut Rpc, agent: &Agent, id: &str, argv: &[String]) -> Result<(), OpError> {
    let session = agent.sessions.get(id).ok_or_else(|| OpError::not_found("no such session"))?;
    let mut io = session.io.lock().await;
    session.touch();
    let token = sys::random_token();
    let begin = format!("__silkd_begin_{token}\n").into_bytes();
    let end = format!("\n__silkd_end_{token} ").into_bytes();
    let cmdline: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
    let script = format!(
        "printf '%s\\n' '__silkd_begin_{token}' >&9\n{{ {}\n}} </dev/null 9>&-\nprintf '\\n__silkd_end_{token} %s\\n' \"$?\" >&9\n",
        cmdline.join(" ")
    );
    let mut out = Output { rpc, gone: false };
    let result = converse(&mut io, script.as_bytes(), &begin, &end, &mut out).await;
    session.touch();
    let code = match result {
        Ok(code) => code,
        Err(why) => {
            // The shell died (an `exit` in the command, or session_rm): its status is the code.
            tracing::info!(id, %why, "session shell ended");
            let code = io.child.wait().await.map(sys::exit_code).unwrap_or(-1);
            agent.sessions.remove_exact(&session);
            code
        }
    };
    drop(io);
    if out.gone {
        return Err(RpcClosed.into());
    }
    out.rpc.send(Response::Exit { code }).await?;
    Ok(())
}

/// Runs one script and streams its delimited output; `Err` when the shell is gone.
async fn converse(
    io: &mut SessionIo,
    script: &[u8],
    begin: &[u8],
    end: &[u8],
    out: &mut Output<'_>,
) -> Result<i32, std::io::Error> {
    io.stdin.write_all(script).await?;
    io.stdin.flush().await?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut acc: Vec<u8> = Vec::new();
    let mut started = false;
    loop {
        let n = io.stdout.read(&mut buf).await?;
        if n == 0 {
            if started {
                out.emit(&acc).await;
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        acc.extend_from_slice(&buf[..n]);
        if !started {
            match find(&acc, begin) {
                Some(at) => {
                    acc.drain(..at + begin.len());
                    started = true;
                }
                None => {
                    let keep = acc.len().min(begin.len() - 1);
                    acc.drain(..acc.len() - keep);
                    continue;
                }
            }
        }
        if let Some(at) = find(&acc, end) {
            out.emit(&acc[..at]).await;
            let mut rest = acc.split_off(at + end.len());
            while !rest.contains(&b'\n') && rest.len() < CODE_LINE_MAX {
                let n = io.stdout.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                rest.extend_from_slice(&buf[..n]);
            }
            let line_end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            let code = String::from_utf8_lossy(&rest[..line_end]).trim().parse().unwrap_or(-1);
            return Ok(code);
        }
        let keep = acc.len().min(end.len() - 1);
        let emit_upto = acc.len() - keep;
        if emit_upto > 0 {
            out.emit(&acc[..emit_upto]).await;
            acc.drain(..emit_upto);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn find_locates_needles() {
        assert_eq!(find(b"xxabcx", b"abc"), Some(2));
        assert_eq!(find(b"ab", b"abc"), None);
    }
}

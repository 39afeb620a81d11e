//! `pty_open` and `pty_resize`: a login shell (or a given command) under a real
//! pseudo-terminal.
//!
//! `pty_open {argv?, cols, rows, cwd?, env?, user?}` → `started{pid}`, `stdout` chunks (the
//! pty merges both streams), input as `stdin` frames, then `exit{code}`. Without `argv` the
//! program is the user's passwd shell (silkd's own user's without `user`), started as a login
//! shell (`argv[0]` = `-<name>`); with `argv` (a Chrysalis extension, what `kubectl exec -t`
//! needs) it is that command, looked up on `PATH` like `exec`'s. Either way the child is a
//! session leader with the pty as controlling terminal, and its environment is the exec
//! environment plus `HOME`, `USER` and `SHELL` of that user (a login shell needs them). When
//! the client's input ends (it hung up, or sent its next request) the child's process group
//! gets SIGHUP, as on a terminal hangup, and SIGKILL [`HANGUP_GRACE`] later if it is still
//! there (a program that traps or ignores SIGHUP does not outlive its client).

use super::pump::{pump_child, Sink};
use crate::agent::Agent;
use crate::error::OpError;
use crate::procs::ProcKind;
use crate::rpc::{Input, Rpc};
use crate::sys::{self, ChildSetup, Env, UserSpec};
use nix::sys::signal::Signal;
use std::convert::Infallible;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::process::Command;
use wire::Response;

/// How long a hung-up shell may take to exit before its process group is killed.
pub const HANGUP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A non-blocking pty master shared by the output pump and the input feeder.
#[derive(Clone)]
struct Master {
    fd: Arc<AsyncFd<Arc<OwnedFd>>>,
}

impl Master {
    async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|inner| rustix::io::write(inner.get_ref(), data).map_err(io::Error::from)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

impl AsyncRead for Master {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|inner| rustix::io::read(inner.get_ref(), &mut *unfilled).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Every slave fd closed (the shell and its children exited): end of output.
                Ok(Err(e)) if e.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => {
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

fn winsize(cols: u16, rows: u16) -> rustix::termios::Winsize {
    rustix::termios::Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 }
}

/// Opens a pty pair (both ends close-on-exec; the master non-blocking) of the given size.
fn open_pty(cols: u16, rows: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::OpenptFlags;
    let master = rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(name.as_c_str(), OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC, Mode::empty())?;
    rustix::termios::tcsetwinsize(&slave, winsize(cols, rows))?;
    rustix::io::ioctl_fionbio(&master, true)?;
    Ok((master, slave))
}

/// The fields of a `pty_open` request.
#[derive(Debug, Default)]
pub struct PtyRequest {
    /// The command to run; `None` runs the user's login shell.
    pub argv: Option<Vec<String>>,
    pub cols: u16,
    pub rows: u16,
    pub cwd: Option<String>,
    pub env: Option<Env>,
    pub user: Option<String>,
}

/// `pty_open`.
pub async fn pty_open(rpc: &mut Rpc, agent: &Arc<Agent>, req: PtyRequest) -> Result<(), OpError> {
    let PtyRequest { argv, cols, rows, cwd, env, user } = req;
    if argv.as_ref().is_some_and(Vec::is_empty) {
        return Err(OpError::bad_request("pty_open: argv must not be empty when given"));
    }
    sys::check_env(env.as_ref())?;
    super::exec::check_cwd("pty_open", cwd.as_deref())?;
    let switch = user.as_deref().map(sys::lookup_user).transpose()?;
    let who: Option<UserSpec> = switch.clone().or_else(sys::current_user);
    let shell =
        sys::pick_shell([who.as_ref().map_or("", |u| u.shell.as_str()), "/bin/bash", "/usr/bin/bash", "/bin/sh"]);
    let name = std::path::Path::new(&shell).file_name().map_or("sh".into(), |n| n.to_string_lossy().into_owned());
    let (master, slave) = open_pty(cols.max(1), rows.max(1)).map_err(|e| OpError::io("pty_open", &e))?;
    let mut full_env = sys::child_env(who.as_ref(), env.as_ref());
    if let Some(who) = &who {
        full_env.entry("SHELL".into()).or_insert_with(|| shell.clone());
        full_env.entry("HOME".into()).or_insert_with(|| who.home.clone());
        full_env.entry("USER".into()).or_insert_with(|| who.name.clone());
    }
    let (mut cmd, what) = match &argv {
        Some(argv) => {
            let mut cmd = Command::new(&argv[0]);
            cmd.args(&argv[1..]);
            (cmd, argv.clone())
        }
        None => {
            let mut cmd = Command::new(&shell);
            cmd.arg0(format!("-{name}"));
            (cmd, vec![shell.clone(), "-l".into()])
        }
    };
    cmd.env_clear().envs(full_env);
    match cwd.as_deref().or(who.as_ref().map(|u| u.home.as_str())) {
        Some(dir) if std::path::Path::new(dir).is_dir() => {
            cmd.current_dir(dir);
        }
        _ => {
            cmd.current_dir("/");
        }
    }
    let stdio = |fd: &OwnedFd| fd.try_clone().map(Stdio::from).map_err(|e| OpError::io("pty_open", &e));
    cmd.stdin(stdio(&slave)?).stdout(stdio(&slave)?).stderr(stdio(&slave)?);
    sys::apply_setup(
        &mut cmd,
        ChildSetup { user: switch.as_ref().map(|u| (u.uid, u.gid, u.groups.clone())), controlling_tty: true },
    );
    let mut child = cmd.spawn().map_err(|e| match e.kind() {
        // A NUL byte in argv or env: the request can never succeed.
        io::ErrorKind::InvalidInput => OpError::bad_request(format!("pty_open: {e}")),
        _ => OpError::io(&format!("pty_open {}", what[0]), &e),
    })?;
    // The parent's copies of the slave must go, or the master never sees the end.
    drop(cmd);
    drop(slave);
    let Some(pid) = child.id() else {
        return Err(OpError::internal("pty_open: child vanished before it was tracked"));
    };
    let master = Arc::new(master);
    // SAFETY: the fd is owned by `master`, an `Arc<OwnedFd>` the AsyncFd holds a clone of,
    // so it stays open and the same file description for the AsyncFd's whole life.
    let fd = unsafe { AsyncFd::register(Arc::clone(&master)) }
        .map_err(|e| OpError::internal(format!("pty_open: register pty master: {e}")))?;
    let master_io = Master { fd: Arc::new(fd) };
    tracing::info!(pid, program = %what[0], cols, rows, "pty opened");
    let rec = agent.procs.insert(pid, what, ProcKind::Pty, Some(master));
    let sink = Sink::Frames(rpc.sender());
    let outcome = match rpc.send(Response::Started { pid }).await {
        Err(closed) => Err(closed),
        Ok(()) => {
            let feed = feed_pty(rpc, master_io.clone(), pid);
            let pump = pump_child(&mut child, Some(master_io), None::<tokio::io::Empty>, &sink);
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
            tracing::info!(pid, code, "pty child exited");
            rpc.send(Response::Exit { code }).await?;
            Ok(())
        }
        Err(closed) => {
            let _ = rec.signal(Signal::SIGKILL);
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

/// Writes `stdin` frames to the pty; the end of input hangs the terminal up: SIGHUP to the
/// shell's process group, then SIGKILL after [`HANGUP_GRACE`]. (The caller stops polling this
/// future as soon as the shell has exited, so the SIGKILL only reaches a shell that stayed.)
async fn feed_pty(rpc: &mut Rpc, master: Master, pid: u32) -> Infallible {
    loop {
        match rpc.input().await {
            Some(Input::Stdin(data)) => {
                if let Err(err) = master.write_all(&data).await {
                    tracing::debug!(pid, %err, "pty write failed");
                }
            }
            Some(_) => {}
            None => {
                let _ = sys::signal_group(pid, Signal::SIGHUP);
                tokio::time::sleep(HANGUP_GRACE).await;
                tracing::info!(pid, "pty shell ignored its hangup; killing its process group");
                let _ = sys::signal_group(pid, Signal::SIGKILL);
                return std::future::pending().await;
            }
        }
    }
}

/// `pty_resize {pid, cols, rows}` → `done`; a pid without a pty → `not_found`.
pub async fn pty_resize(rpc: &mut Rpc, agent: &Agent, pid: u32, cols: u16, rows: u16) -> Result<(), OpError> {
    let rec = agent.procs.get(pid).ok_or_else(|| OpError::not_found("no such pty"))?;
    let Some(master) = rec.pty.as_ref() else {
        return Err(OpError::not_found("no such pty"));
    };
    rustix::termios::tcsetwinsize(&**master, winsize(cols.max(1), rows.max(1)))
        .map_err(|e| OpError::internal(format!("pty_resize: {e}")))?;
    rpc.send(Response::Done).await?;
    Ok(())
}

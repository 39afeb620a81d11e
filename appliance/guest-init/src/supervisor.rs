//! PID 1's main loop: runs the services (silkd, optionally a debug shell), reaps every
//! zombie, restarts a service that exits (with a backoff), and powers off on SIGTERM/SIGINT.
//!
//! Signals are blocked and consumed synchronously with `sigtimedwait`, so there are no
//! handlers and no races; `std::process::Command` clears the mask again in each child.

use crate::console::say;
use nix::errno::Errno;
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A supervisor setup step that failed.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("blocking signals")]
    Sigmask(#[source] nix::Error),
}

/// First restart delay; doubles on every quick exit.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest restart delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A run at least this long resets the backoff.
const HEALTHY_RUN: Duration = Duration::from_secs(10);
/// How long processes get between SIGTERM and SIGKILL at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The environment every service starts with.
const BASE_ENV: &[(&str, &str)] =
    &[("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("HOME", "/root"), ("TERM", "linux")];

/// A supervised program.
#[derive(Debug)]
pub struct Service {
    pub name: &'static str,
    pub path: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Give it the console as stdin (the debug shell); otherwise stdin is /dev/null.
    pub console_stdin: bool,
    pid: Option<Pid>,
    started: Instant,
    backoff: Duration,
    next_start: Option<Instant>,
}

impl Service {
    pub fn new(name: &'static str, path: PathBuf) -> Self {
        Service {
            name,
            path,
            args: Vec::new(),
            env: Vec::new(),
            console_stdin: false,
            pid: None,
            started: Instant::now(),
            backoff: BACKOFF_MIN,
            next_start: Some(Instant::now()),
        }
    }

    fn start(&mut self) {
        self.next_start = None;
        self.started = Instant::now();
        let mut cmd = Command::new(&self.path);
        cmd.args(&self.args).env_clear().envs(BASE_ENV.iter().copied()).envs(self.env.iter().map(|(k, v)| (k, v)));
        if !self.console_stdin {
            cmd.stdin(Stdio::null());
        }
        match cmd.spawn() {
            Ok(child) => {
                let pid = Pid::from_raw(child.id() as i32);
                // `child` is dropped without waiting: every child is reaped by `reap_all`.
                drop(child);
                say!("started {} ({}) pid {pid}", self.name, self.path.display());
                self.pid = Some(pid);
            }
            Err(e) => {
                say!("cannot start {} ({}): {e}", self.name, self.path.display());
                self.schedule_restart();
            }
        }
    }

    fn schedule_restart(&mut self) {
        self.pid = None;
        if self.started.elapsed() >= HEALTHY_RUN {
            self.backoff = BACKOFF_MIN;
        }
        say!("restarting {} in {} ms", self.name, self.backoff.as_millis());
        self.next_start = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }
}

/// Blocks the signals PID 1 handles; call first thing so none is lost.
pub fn block_signals() -> Result<SigSet, SupervisorError> {
    let mut set = SigSet::empty();
    for sig in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGPWR, Signal::SIGUSR1] {
        set.add(sig);
    }
    nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None).map_err(SupervisorError::Sigmask)?;
    Ok(set)
}

/// Waits up to `timeout` for one of `set`; returns the signal number.
fn wait_signal(set: &SigSet, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec { tv_sec: timeout.as_secs().min(3600) as _, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: `set` is a valid sigset, `ts` a valid timespec; siginfo may be null.
    let rc = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &ts) };
    (rc > 0).then_some(rc)
}

/// Reaps every exited child; returns the (pid, status) pairs.
fn reap_all() -> Vec<(Pid, WaitStatus)> {
    let mut out = Vec::new();
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
            Ok(status) => {
                if let Some(pid) = status.pid() {
                    out.push((pid, status));
                }
            }
            Err(Errno::EINTR) => continue,
            Err(e) => {
                say!("waitpid: {e}");
                break;
            }
        }
    }
    out
}

fn describe(status: &WaitStatus) -> String {
    match status {
        WaitStatus::Exited(_, code) => format!("exited with {code}"),
        WaitStatus::Signaled(_, sig, _) => format!("killed by {sig}"),
        other => format!("{other:?}"),
    }
}

/// Runs `services` forever (an empty list still reaps zombies and handles shutdown signals).
pub fn run(set: &SigSet, mut services: Vec<Service>) -> ! {
    loop {
        let now = Instant::now();
        for svc in services.iter_mut() {
            if svc.next_start.is_some_and(|t| t <= now) {
                svc.start();
            }
        }
        let timeout = services
            .iter()
            .filter_map(|s| s.next_start)
            .map(|t| t.saturating_duration_since(Instant::now()))
            .min()
            .unwrap_or(Duration::from_secs(60))
            .max(Duration::from_millis(1));
        let signal = wait_signal(set, timeout);
        for (pid, status) in reap_all() {
            if let Some(svc) = services.iter_mut().find(|s| s.pid == Some(pid)) {
                say!("{} (pid {pid}) {}", svc.name, describe(&status));
                svc.schedule_restart();
            }
        }
        match signal {
            Some(s) if s == libc::SIGTERM || s == libc::SIGINT || s == libc::SIGPWR => {
                say!("received signal {s}, powering off");
                shutdown(set);
            }
            _ => {}
        }
    }
}

/// Stops every process, syncs, powers off. Never returns.
pub fn shutdown(set: &SigSet) -> ! {
    let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while Instant::now() < deadline {
        reap_all();
        // Every user process descends from PID 1 (orphans are reparented to us), so ECHILD
        // means none is left. (`kill(-1, 0)` would never answer ESRCH: it counts kernel threads.)
        if waitpid(None, Some(WaitPidFlag::WNOHANG)) == Err(Errno::ECHILD) {
            break;
        }
        let _ = wait_signal(set, Duration::from_millis(20));
    }
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    reap_all();
    nix::unistd::sync();
    say!("power off");
    let err = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    say!("power off failed ({err:?}), rebooting");
    let err = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    say!("reboot failed ({err:?}); idling");
    loop {
        reap_all();
        let _ = wait_signal(set, Duration::from_secs(60));
    }
}

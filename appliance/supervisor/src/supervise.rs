//! Running the services: process groups, restarts with backoff, reaping, shutdown.
//!
//! # Guarantees
//! * **Crash isolation.** Each service is its own process group; one exiting (for any reason,
//!   `kill -9` included) only schedules its own restart.
//! * **Backoff.** A service that exits is restarted after 1 s, doubling on each further exit up
//!   to 60 s; a service that ran for 60 s before exiting starts again at 1 s ([`Backoff`]).
//! * **Reaping.** The supervisor is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so daemonized
//!   grandchildren (QEMU) are re-parented to it. On `SIGCHLD` and every tick it reaps its
//!   services by pid, then every other zombie (`waitid(P_ALL, WNOWAIT)` to look,
//!   `waitpid(pid)` to reap). A zombie that is not a service is reaped after a 1 s grace so
//!   that code elsewhere in the process waiting for its own child (`Command::output`) gets the
//!   status first. Live processes are never touched.
//! * **Shutdown never kills VMs.** `SIGTERM` goes to each service's process group; after the
//!   bounded wait, `SIGKILL` to the same groups. QEMU daemonizes into its own session, so it
//!   is in none of these groups and keeps running for the services to re-adopt.
//! * **No duplicates across supervisor restarts.** Each service's pid and start time are kept
//!   in `<run>/services/<svc>.pid`; a new supervisor first stops a still-running service of
//!   its predecessor (same pid *and* start time) by its process group.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::logs::{self, ServiceLog, Stream};
use crate::services::{Layout, ServiceName, ServiceSpec, SCRUBBED_ENV};

/// How long every service must have been running before the supervisor reports ready.
pub const STABLE_AFTER: Duration = Duration::from_secs(1);

/// How long a zombie that is not a service may wait for another waiter before we reap it.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(1);

/// Why supervision could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// `PR_SET_CHILD_SUBREAPER` failed.
    #[error("becoming a child subreaper")]
    Subreaper(#[source] nix::Error),
}

/// Restart delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// First delay.
    pub initial: Duration,
    /// Ceiling.
    pub max: Duration,
    /// A run at least this long resets the delay to `initial`.
    pub reset_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(60), reset_after: Duration::from_secs(60) }
    }
}

impl Backoff {
    /// The delay before the next start, given the previous delay and how long the run lasted.
    pub fn after_exit(&self, previous: Option<Duration>, ran_for: Duration) -> Duration {
        match previous {
            Some(p) if ran_for < self.reset_after => (p * 2).min(self.max),
            _ => self.initial,
        }
    }
}

/// Where a service is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Not started yet.
    Starting,
    /// Its process is alive.
    Running,
    /// Exited; waiting to be restarted.
    Backoff,
    /// Being stopped.
    Stopping,
    /// Stopped for good (shutdown).
    Stopped,
}

/// How a service's process ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// Exit status, when it exited.
    pub code: Option<i32>,
    /// Signal number, when killed.
    pub signal: Option<i32>,
    /// Unix time of the exit.
    pub at_unix: u64,
    /// How long it ran, in seconds.
    pub ran_for_secs: f64,
    /// `exited with status 1`, `killed by SIGKILL`, `could not start: …`.
    pub text: String,
}

impl ExitInfo {
    /// A code for metrics: the status, 128 + signal, or -1 for a failed start.
    pub fn metric_code(&self) -> i64 {
        match (self.code, self.signal) {
            (Some(c), _) => i64::from(c),
            (None, Some(s)) => 128 + i64::from(s),
            (None, None) => -1,
        }
    }
}

/// A service's state, as the API and metrics show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// `sandboxd`, `vk-sandbox`, `vk-cocoon`.
    pub name: String,
    /// Its state.
    pub state: RunState,
    /// Its pid while running.
    pub pid: Option<u32>,
    /// Unix time it was (last) started.
    pub since_unix: Option<u64>,
    /// Restarts so far.
    pub restarts: u64,
    /// The last exit.
    pub last_exit: Option<ExitInfo>,
    /// Seconds until the next start, in backoff.
    pub restart_in_secs: Option<f64>,
    /// Resident memory of its main process (`VmRSS`, KiB) while running; its VMs are not in it.
    #[serde(default)]
    pub rss_kib: Option<u64>,
}

/// A process's resident memory (`VmRSS` of `/proc/<pid>/status`) in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()
}

struct Child {
    spec: ServiceSpec,
    log: Arc<ServiceLog>,
    pid: Option<Pid>,
    started: Option<Instant>,
    started_unix: Option<u64>,
    delay: Option<Duration>,
    next_start: Option<Instant>,
    starts: u64,
    last_exit: Option<ExitInfo>,
    stopping: bool,
}

/// The services and their processes. Owned by the main loop; not shared.
pub struct Supervisor {
    children: Vec<Child>,
    backoff: Backoff,
    layout: Layout,
    orphans: HashMap<Pid, Instant>,
    stopping: bool,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Makes this process the subreaper of its descendants.
pub fn become_subreaper() -> Result<(), SuperviseError> {
    nix::sys::prctl::set_child_subreaper(true).map_err(SuperviseError::Subreaper)
}

/// `(state, start time in clock ticks)` of a process, from `/proc/<pid>/stat`.
pub fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((f.first()?.chars().next()?, f.get(19)?.parse().ok()?))
}

fn describe(status: &WaitStatus) -> (Option<i32>, Option<i32>, String) {
    match status {
        WaitStatus::Exited(_, c) => (Some(*c), None, format!("exited with status {c}")),
        WaitStatus::Signaled(_, s, core) => {
            let core = if *core { " (core dumped)" } else { "" };
            (None, Some(*s as i32), format!("killed by {}{core}", s.as_str()))
        }
        other => (None, None, format!("ended ({other:?})")),
    }
}

impl Supervisor {
    /// A supervisor for `specs` (nothing started yet); `logs` holds one log per spec.
    pub fn new(
        specs: Vec<ServiceSpec>,
        logs: &HashMap<ServiceName, Arc<ServiceLog>>,
        backoff: Backoff,
        layout: Layout,
    ) -> Self {
        let children = specs
            .into_iter()
            .map(|spec| {
                let log = logs
                    .get(&spec.name)
                    .cloned()
                    // Every spec has a log (built from the same plan); memory-only as a fallback.
                    .unwrap_or_else(|| Arc::new(ServiceLog::memory(spec.name.as_str())));
                Child {
                    spec,
                    log,
                    pid: None,
                    started: None,
                    started_unix: None,
                    delay: None,
                    next_start: Some(Instant::now()),
                    starts: 0,
                    last_exit: None,
                    stopping: false,
                }
            })
            .collect();
        Supervisor { children, backoff, layout, orphans: HashMap::new(), stopping: false }
    }

    /// Stops services a previous supervisor left running (see the module doc), bounded by
    /// `timeout` per service.
    pub async fn stop_stale(&self, timeout: Duration) {
        for c in &self.children {
            let path = self.layout.pid_file(c.spec.name);
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            let mut it = text.split_whitespace().map(str::parse::<u64>);
            let (Some(Ok(pid)), Some(Ok(start))) = (it.next(), it.next()) else { continue };
            let Ok(pid) = i32::try_from(pid) else { continue };
            let alive = || matches!(proc_stat(pid), Some((state, t)) if t == start && state != 'Z');
            if alive() {
                tracing::warn!(service = %c.spec.name, pid, "a previous supervisor's service is still running; stopping it");
                c.log.push(Stream::Supervisor, &format!("stopping pid {pid} left by a previous supervisor"));
                let _ = killpg(Pid::from_raw(pid), Signal::SIGTERM);
                let deadline = Instant::now() + timeout;
                while alive() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if alive() {
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Starts every service whose start is due. Call from the runtime (log capture spawns tasks).
    pub fn start_due(&mut self) {
        if self.stopping {
            return;
        }
        let now = Instant::now();
        for i in 0..self.children.len() {
            let due = {
                let c = &self.children[i];
                c.pid.is_none() && c.next_start.is_some_and(|t| t <= now)
            };
            if due {
                self.start(i);
            }
        }
    }

    fn start(&mut self, i: usize) {
        let pid_file = self.layout.pid_file(self.children[i].spec.name);
        let backoff = self.backoff;
        let c = &mut self.children[i];
        c.next_start = None;
        let name = c.spec.name;
        let result = c
            .spec
            .prepare()
            .map_err(|e| crate::error_chain(&e))
            .and_then(|()| spawn(&c.spec, &c.log).map_err(|e| e.to_string()));
        match result {
            Ok(pid) => {
                c.pid = Some(pid);
                c.started = Some(Instant::now());
                c.started_unix = Some(unix_now());
                c.starts += 1;
                c.stopping = false;
                if let Some((_, t)) = proc_stat(pid.as_raw()) {
                    if let Some(d) = pid_file.parent() {
                        let _ = std::fs::create_dir_all(d);
                    }
                    let _ = std::fs::write(&pid_file, format!("{} {t}\n", pid.as_raw()));
                }
                tracing::info!(service = %name, pid = pid.as_raw(), "service started");
                c.log.push(Stream::Supervisor, &format!("started, pid {}", pid.as_raw()));
            }
            Err(e) => {
                let delay = backoff.after_exit(c.delay, Duration::ZERO);
                c.delay = Some(delay);
                c.next_start = Some(Instant::now() + delay);
                let text = format!("could not start: {e}");
                tracing::error!(service = %name, error = %e, retry_in = ?delay, "service could not start");
                c.log.push(Stream::Supervisor, &format!("{text}; retrying in {}", humantime::format_duration(delay)));
                c.last_exit = Some(ExitInfo { code: None, signal: None, at_unix: unix_now(), ran_for_secs: 0.0, text });
            }
        }
    }

    /// Reaps exited services (scheduling restarts) and orphaned zombies.
    pub fn reap(&mut self) {
        for i in 0..self.children.len() {
            let Some(pid) = self.children[i].pid else { continue };
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(status) => self.exited(i, &status),
                Err(e) => {
                    // ECHILD: someone else reaped it; treat as an exit with unknown status.
                    tracing::warn!(service = %self.children[i].spec.name, error = %e, "lost track of the service's process");
                    self.exited(i, &WaitStatus::StillAlive);
                }
            }
        }
        self.reap_orphans();
    }

    fn exited(&mut self, i: usize, status: &WaitStatus) {
        let backoff = self.backoff;
        let stopping = self.stopping;
        let pid_file = self.layout.pid_file(self.children[i].spec.name);
        let c = &mut self.children[i];
        let ran_for = c.started.map(|s| s.elapsed()).unwrap_or_default();
        let (code, signal, text) = describe(status);
        c.pid = None;
        c.last_exit = Some(ExitInfo {
            code,
            signal,
            at_unix: unix_now(),
            ran_for_secs: ran_for.as_secs_f64(),
            text: text.clone(),
        });
        let _ = std::fs::remove_file(pid_file);
        let ran = humantime::format_duration(Duration::from_secs(ran_for.as_secs()));
        if stopping || c.stopping {
            c.next_start = None;
            tracing::info!(service = %c.spec.name, status = %text, "service stopped");
            c.log.push(Stream::Supervisor, &format!("{text} (stopping)"));
            return;
        }
        let delay = backoff.after_exit(c.delay, ran_for);
        c.delay = Some(delay);
        c.next_start = Some(Instant::now() + delay);
        tracing::warn!(service = %c.spec.name, status = %text, ran_for = %ran, restart_in = ?delay, "service exited; restarting");
        c.log.push(
            Stream::Supervisor,
            &format!("{text} after {ran}; restarting in {}", humantime::format_duration(delay)),
        );
    }

    fn reap_orphans(&mut self) {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        loop {
            let pid = match waitid(Id::All, flags) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(s) => match s.pid() {
                    Some(p) => p,
                    None => break,
                },
            };
            if let Some(i) = self.children.iter().position(|c| c.pid == Some(pid)) {
                match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) => break,
                    Ok(status) => self.exited(i, &status),
                    Err(_) => break,
                }
                continue;
            }
            let first = *self.orphans.entry(pid).or_insert_with(Instant::now);
            if first.elapsed() < ORPHAN_GRACE {
                break; // look again on the next tick
            }
            self.orphans.remove(&pid);
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(status) => {
                    tracing::debug!(pid = pid.as_raw(), status = %describe(&status).2, "reaped an orphaned process")
                }
                Err(_) => {} // another waiter got it first
            }
        }
        self.orphans.retain(|_, t| t.elapsed() < Duration::from_secs(60));
    }

    /// Every service has a live process that has run for at least `min` (so a service that
    /// crashes right after each start never makes the box "ready"), and none is stopping.
    pub fn all_running_for(&self, min: Duration) -> bool {
        !self.stopping
            && self
                .children
                .iter()
                .all(|c| c.pid.is_some() && !c.stopping && c.started.is_some_and(|s| s.elapsed() >= min))
    }

    /// The pids of running services (tests, diagnostics).
    pub fn pids(&self) -> Vec<(ServiceName, Option<u32>)> {
        self.children.iter().map(|c| (c.spec.name, c.pid.map(|p| p.as_raw() as u32))).collect()
    }

    /// The earliest pending (re)start.
    pub fn next_start(&self) -> Option<Instant> {
        self.children.iter().filter_map(|c| c.next_start).min()
    }

    /// Current state of every service.
    pub fn statuses(&self) -> Vec<ServiceStatus> {
        let now = Instant::now();
        self.children
            .iter()
            .map(|c| {
                let state = match (c.pid, c.next_start) {
                    (Some(_), _) if c.stopping || self.stopping => RunState::Stopping,
                    (Some(_), _) => RunState::Running,
                    (None, Some(_)) if c.starts == 0 && c.last_exit.is_none() => RunState::Starting,
                    (None, Some(_)) => RunState::Backoff,
                    (None, None) => RunState::Stopped,
                };
                ServiceStatus {
                    name: c.spec.name.to_string(),
                    state,
                    pid: c.pid.map(|p| p.as_raw() as u32),
                    since_unix: c.started_unix,
                    restarts: c.starts.saturating_sub(1),
                    last_exit: c.last_exit.clone(),
                    restart_in_secs: c
                        .next_start
                        .filter(|_| c.pid.is_none())
                        .map(|t| t.saturating_duration_since(now).as_secs_f64()),
                    rss_kib: c.pid.and_then(|p| rss_kib(p.as_raw() as u32)),
                }
            })
            .collect()
    }

    /// Stops every service: `SIGTERM` to each process group, up to `timeout` for them to
    /// exit, then `SIGKILL` to the groups still there. Never signals anything else.
    pub async fn shutdown(&mut self, timeout: Duration) {
        self.stopping = true;
        for c in &mut self.children {
            c.next_start = None;
            if let Some(pid) = c.pid {
                c.stopping = true;
                tracing::info!(service = %c.spec.name, pid = pid.as_raw(), "stopping service (SIGTERM)");
                c.log.push(Stream::Supervisor, "stopping (SIGTERM)");
                let _ = killpg(pid, Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + timeout;
        while self.children.iter().any(|c| c.pid.is_some()) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.reap();
        }
        for c in &self.children {
            if let Some(pid) = c.pid {
                tracing::warn!(service = %c.spec.name, pid = pid.as_raw(), "service did not stop in time; SIGKILL to its process group");
                c.log.push(Stream::Supervisor, "did not stop in time: SIGKILL");
                let _ = killpg(pid, Signal::SIGKILL);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.children.iter().any(|c| c.pid.is_some()) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.reap();
        }
    }

    /// Makes every service startable again after a [`Supervisor::shutdown`] (a failed reboot).
    pub fn resume(&mut self) {
        self.stopping = false;
        let now = Instant::now();
        for c in &mut self.children {
            c.stopping = false;
            if c.pid.is_none() {
                c.next_start = Some(now);
            }
        }
    }
}

/// Spawns one service in its own process group with piped output captured into `log`.
fn spawn(spec: &ServiceSpec, log: &Arc<ServiceLog>) -> std::io::Result<Pid> {
    use std::os::unix::process::CommandExt as _;
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(&spec.program);
    cmd.args(&spec.args);
    for k in SCRUBBED_ENV {
        cmd.env_remove(k);
    }
    cmd.envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.process_group(0);
    cmd.current_dir(Path::new("/"));
    let mut child = cmd.spawn()?;
    let pid = Pid::from_raw(child.id() as i32);
    // The std handle is dropped without waiting: we reap by pid ourselves.
    let out = child.stdout.take().map(OwnedFd::from);
    let err = child.stderr.take().map(OwnedFd::from);
    drop(child);
    for (fd, stream) in [(out, Stream::Stdout), (err, Stream::Stderr)] {
        let Some(fd) = fd else { continue };
        match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
            Ok(rx) => {
                tokio::spawn(logs::capture(rx, stream, log.clone()));
            }
            Err(e) => tracing::warn!(service = %spec.name, error = %e, "cannot capture the service's output"),
        }
    }
    Ok(pid)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let b = Backoff::default();
        let s = Duration::from_secs;
        assert_eq!(b.after_exit(None, s(0)), s(1));
        assert_eq!(b.after_exit(Some(s(1)), s(2)), s(2));
        assert_eq!(b.after_exit(Some(s(2)), s(2)), s(4));
        assert_eq!(b.after_exit(Some(s(32)), s(2)), s(60));
        assert_eq!(b.after_exit(Some(s(60)), s(59)), s(60));
        assert_eq!(b.after_exit(Some(s(60)), s(60)), s(1), "60 s healthy resets");
    }

    #[test]
    fn proc_stat_reads_this_process() {
        let (state, start) = proc_stat(std::process::id() as i32).unwrap();
        assert!(state == 'R' || state == 'S', "{state}");
        assert!(start > 0);
        assert_eq!(proc_stat(-5), None);
    }

    #[test]
    fn exit_descriptions_and_codes() {
        let p = Pid::from_raw(1);
        let (c, s, t) = describe(&WaitStatus::Exited(p, 3));
        assert_eq!((c, s, t.as_str()), (Some(3), None, "exited with status 3"));
        let (c, s, t) = describe(&WaitStatus::Signaled(p, Signal::SIGKILL, false));
        assert_eq!((c, s, t.as_str()), (None, Some(9), "killed by SIGKILL"));
        let e = ExitInfo { code: None, signal: Some(9), at_unix: 0, ran_for_secs: 0.0, text: t };
        assert_eq!(e.metric_code(), 137);
    }
}

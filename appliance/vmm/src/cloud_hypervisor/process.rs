//! The cloud-hypervisor process: finding the binary, spawning it with its API socket, waiting
//! until the API answers, and stopping it for sure.
//!
//! The binary is `$CLOUD_HYPERVISOR_BIN` (a path, or a name looked up in `PATH`), default
//! `cloud-hypervisor` in `PATH`; a missing one is [`ProcessError::BinaryNotFound`] before
//! anything is created. The process gets its own session and survives our own restart
//! (the driver re-attaches by pid + start time); it is never left running after a stop.
//! It always runs with its own seccomp filters (`--seccomp true`), and its stdout and stderr go
//! through a pipe into the size-capped `vmm.log` ([`crate::jail::output`]).

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use cloud_hypervisor_client::models::VmmPingResponse;
use tokio::process::{Child, Command};

use super::api::{ApiClient, ApiError};
use crate::jail::output::{spawn_logged, OutputDrain, OutputError};
use crate::jail::SpawnPlan;
use crate::record;

/// Environment variable naming the cloud-hypervisor binary.
pub const BIN_ENV: &str = "CLOUD_HYPERVISOR_BIN";
/// Binary name looked up in `PATH` when [`BIN_ENV`] is unset.
pub const DEFAULT_BIN: &str = "cloud-hypervisor";
/// How often liveness and API readiness are polled.
const POLL: Duration = Duration::from_millis(10);
/// Bytes of cloud-hypervisor's own output (`vmm.log`, both segments) kept per VM.
pub const LOG_CAP: u64 = crate::jail::output::LOG_CAP;
/// How long to wait for the kernel to tear a SIGKILLed process down.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Errors of the process lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// No executable cloud-hypervisor binary where we looked.
    #[error(
        "cloud-hypervisor binary {wanted:?} not found or not executable (set {BIN_ENV} or put {DEFAULT_BIN} in PATH)"
    )]
    BinaryNotFound {
        /// The path or name we looked for.
        wanted: OsString,
    },
    /// Opening the log, making the output pipe or forking failed.
    #[error("starting {bin}")]
    Spawn {
        /// The binary.
        bin: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The process exited before its API answered.
    #[error("cloud-hypervisor (pid {pid}) exited before its API answered ({status}); log tail: {log_tail}")]
    ExitedEarly {
        /// Its pid.
        pid: u32,
        /// Its exit status.
        status: ExitStatus,
        /// The last lines of its log.
        log_tail: String,
    },
    /// The API socket did not answer `vmm.ping` in time.
    #[error("cloud-hypervisor API {socket} did not answer within {after:?}")]
    ApiNotReady {
        /// The API socket.
        socket: PathBuf,
        /// How long we waited.
        after: Duration,
        /// The last ping failure.
        #[source]
        last: Option<ApiError>,
    },
    /// The API socket is served by another process than the one spawned (or is a link): the
    /// start fails at once, without retrying.
    #[error("cloud-hypervisor API {socket} refused")]
    ApiPeer {
        /// The API socket.
        socket: PathBuf,
        /// Who should and who did answer.
        #[source]
        source: crate::peer::PeerError,
    },
    /// Signalling or reaping the process failed.
    #[error("stopping cloud-hypervisor pid {pid}")]
    Stop {
        /// Its pid.
        pid: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It still existed 10 s after SIGKILL.
    #[error("cloud-hypervisor pid {pid} survived SIGKILL for {after:?}")]
    Unkillable {
        /// Its pid.
        pid: u32,
        /// How long we waited.
        after: Duration,
    },
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Resolves the binary from the value of [`BIN_ENV`] (`configured`) and `PATH` (`path_var`):
/// a value with a `/` is used as a path, anything else is looked up in `PATH`.
pub fn resolve_binary(configured: Option<&OsStr>, path_var: Option<&OsStr>) -> Result<PathBuf, ProcessError> {
    let wanted = configured.filter(|v| !v.is_empty()).unwrap_or(OsStr::new(DEFAULT_BIN));
    let not_found = || ProcessError::BinaryNotFound { wanted: wanted.to_os_string() };
    if wanted.as_encoded_bytes().contains(&b'/') {
        let p = PathBuf::from(wanted);
        return if is_executable(&p) { Ok(p) } else { Err(not_found()) };
    }
    path_var
        .into_iter()
        .flat_map(std::env::split_paths)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(wanted))
        .find(|p| is_executable(p))
        .ok_or_else(not_found)
}

/// Resolves the binary from this process's environment.
pub fn binary_from_env() -> Result<PathBuf, ProcessError> {
    resolve_binary(std::env::var_os(BIN_ENV).as_deref(), std::env::var_os("PATH").as_deref())
}

/// A running (or just stopped) cloud-hypervisor process, spawned by us or adopted by pid.
#[derive(Debug)]
pub struct VmmProcess {
    pid: u32,
    start_time: u64,
    child: Option<Child>,
    /// The drain of its output into `vmm.log` (only for a process we spawned).
    output: Option<OutputDrain>,
}

impl VmmProcess {
    /// Starts `bin --api-socket <api_socket> --seccomp true` (its own seccomp filters, always
    /// on) with `plan` installed between fork and exec ([`crate::jail`]: its own session, the
    /// cgroup leaf, the netns, the VM user); stdout and stderr go through a pipe into the
    /// capped `log` ([`crate::jail::output`], [`LOG_CAP`]).
    pub fn spawn(bin: &Path, api_socket: &Path, log: &Path, plan: SpawnPlan) -> Result<Self, ProcessError> {
        let mut cmd = Command::new(bin);
        cmd.arg("--api-socket").arg(api_socket).args(["--seccomp", "true"]);
        plan.install(&mut cmd);
        let (child, output) = spawn_logged(cmd, log, LOG_CAP).map_err(|e| match e {
            OutputError::Log { source, .. } => ProcessError::Spawn { bin: bin.to_path_buf(), source },
            OutputError::Spawn { source } => match source.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                    ProcessError::BinaryNotFound { wanted: bin.as_os_str().to_os_string() }
                }
                _ => ProcessError::Spawn { bin: bin.to_path_buf(), source },
            },
        })?;
        let pid = child.id().unwrap_or(0);
        // Right after fork the /proc entry exists; if it raced with an immediate exit the start
        // time stays 0 and liveness checks treat the process as gone, which it is.
        let start_time = record::pid_start_time(pid).unwrap_or(0);
        tracing::debug!(pid, bin = %bin.display(), "spawned cloud-hypervisor");
        Ok(VmmProcess { pid, start_time, child: Some(child), output: Some(output) })
    }

    /// Adopts a process started by an earlier incarnation of us (no child handle).
    pub fn adopt(pid: u32, start_time: u64) -> Self {
        VmmProcess { pid, start_time, child: None, output: None }
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The pid's start time (clock ticks since boot).
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    /// Whether the process still runs (reaps it if it is our child and exited).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => record::is_alive(self.pid, self.start_time),
        }
    }

    fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Polls `vmm.ping` until it answers, failing early if the process exits.
    pub async fn wait_api(
        &mut self,
        api: &ApiClient,
        log: &Path,
        timeout: Duration,
    ) -> Result<VmmPingResponse, ProcessError> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Some(status) = self.exit_status() {
                // Its last words may still be in the pipe.
                if let Some(drain) = self.output.take() {
                    drain.finish(Duration::from_secs(2)).await;
                }
                return Err(ProcessError::ExitedEarly { pid: self.pid, status, log_tail: log_tail(log) });
            }
            if self.child.is_none() && !self.is_running() {
                return Err(ProcessError::ApiNotReady { socket: api.socket().to_path_buf(), after: timeout, last });
            }
            match api.ping().await {
                Ok(p) => return Ok(p),
                Err(ApiError::Peer { source, .. }) => {
                    return Err(ProcessError::ApiPeer { socket: api.socket().to_path_buf(), source })
                }
                Err(e) => last = Some(e),
            }
            if Instant::now() >= deadline {
                return Err(ProcessError::ApiNotReady { socket: api.socket().to_path_buf(), after: timeout, last });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits up to `within` for the process to exit on its own; true if it did.
    pub async fn wait_exit(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if !self.is_running() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGKILLs the process (if it still runs) and waits until it is gone (reaped, if ours).
    pub async fn kill(&mut self) -> Result<(), ProcessError> {
        let pid = self.pid;
        if let Some(child) = &mut self.child {
            if let Ok(Some(_)) = child.try_wait() {
                return Ok(());
            }
            let stop = |source| ProcessError::Stop { pid, source };
            child.start_kill().map_err(stop)?;
            return match tokio::time::timeout(KILL_WAIT, child.wait()).await {
                Ok(r) => r.map(|_| ()).map_err(stop),
                Err(_) => Err(ProcessError::Unkillable { pid, after: KILL_WAIT }),
            };
        }
        if !record::is_alive(pid, self.start_time) {
            return Ok(());
        }
        let rpid = i32::try_from(pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .ok_or(ProcessError::Stop { pid, source: std::io::Error::from(std::io::ErrorKind::InvalidInput) })?;
        match rustix::process::kill_process(rpid, rustix::process::Signal::KILL) {
            Ok(()) | Err(rustix::io::Errno::SRCH) => {}
            Err(e) => return Err(ProcessError::Stop { pid, source: e.into() }),
        }
        if self.wait_exit(KILL_WAIT).await {
            Ok(())
        } else {
            Err(ProcessError::Unkillable { pid, after: KILL_WAIT })
        }
    }
}

/// The last ~2 KiB of `log`, lossily decoded (empty if unreadable), read by seeking: the log
/// may hold whatever a guest made cloud-hypervisor print.
pub fn log_tail(log: &Path) -> String {
    crate::console::tail_string(log, 2048).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn exe(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).expect("write script");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }

    #[test]
    fn missing_binary_is_a_typed_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Not in an empty PATH.
        let e = resolve_binary(None, Some(dir.path().as_os_str())).expect_err("not found");
        assert!(matches!(&e, ProcessError::BinaryNotFound { wanted } if wanted == DEFAULT_BIN), "{e:?}");
        assert!(e.to_string().contains(BIN_ENV), "{e}");
        // An explicit path that does not exist.
        let gone = dir.path().join("nope/cloud-hypervisor");
        let e = resolve_binary(Some(gone.as_os_str()), None).expect_err("not found");
        assert!(matches!(e, ProcessError::BinaryNotFound { .. }), "{e:?}");
        // A file that is not executable.
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "").expect("write");
        let e = resolve_binary(Some(plain.as_os_str()), None).expect_err("not executable");
        assert!(matches!(e, ProcessError::BinaryNotFound { .. }), "{e:?}");
    }

    #[test]
    fn binary_found_in_path_or_by_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ch = exe(dir.path(), DEFAULT_BIN, "#!/bin/sh\n");
        let path = std::env::join_paths([Path::new("/nonexistent"), dir.path()]).expect("join");
        assert_eq!(resolve_binary(None, Some(&path)).expect("found"), ch);
        assert_eq!(resolve_binary(Some(OsStr::new("")), Some(&path)).expect("found"), ch);
        assert_eq!(resolve_binary(Some(ch.as_os_str()), None).expect("found"), ch);
    }

    #[tokio::test]
    async fn early_exit_is_reported_with_log_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = exe(dir.path(), "ch", "#!/bin/sh\necho \"bad flag $1\" >&2\nexit 3\n");
        let log = dir.path().join("vmm.log");
        let sock = dir.path().join("api.sock");
        let mut p = VmmProcess::spawn(&bin, &sock, &log, SpawnPlan::default()).expect("spawn");
        let api = ApiClient::new(&sock, Duration::from_millis(200), None);
        let e = p.wait_api(&api, &log, Duration::from_secs(10)).await.expect_err("exits");
        match e {
            ProcessError::ExitedEarly { status, log_tail, .. } => {
                assert_eq!(status.code(), Some(3));
                assert!(log_tail.contains("bad flag --api-socket"), "{log_tail}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(!p.is_running());
    }

    #[tokio::test]
    async fn kill_stops_spawned_and_adopted_processes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = exe(dir.path(), "ch", "#!/bin/sh\nexec sleep 600\n");
        let log = dir.path().join("vmm.log");
        let sock = dir.path().join("api.sock");

        let mut p = VmmProcess::spawn(&bin, &sock, &log, SpawnPlan::default()).expect("spawn");
        let (pid, st) = (p.pid(), p.start_time());
        assert!(p.is_running());
        assert!(!p.wait_exit(Duration::from_millis(50)).await);
        p.kill().await.expect("kill");
        assert!(!record::is_alive(pid, st));
        assert!(record::pid_start_time(pid).is_none(), "child was not reaped");

        // Adopted: spawned by "someone else" (a std child we reap on a thread).
        let mut other = std::process::Command::new(&bin).spawn().expect("spawn std child");
        let opid = other.id();
        let reaper = std::thread::spawn(move || other.wait());
        let ost = record::pid_start_time(opid).expect("start time");
        let mut adopted = VmmProcess::adopt(opid, ost);
        assert!(adopted.is_running());
        adopted.kill().await.expect("kill adopted");
        let status = reaper.join().expect("join").expect("wait");
        assert!(!status.success());
        assert!(!adopted.is_running());
        // Killing again is a no-op.
        adopted.kill().await.expect("idempotent");
    }
}

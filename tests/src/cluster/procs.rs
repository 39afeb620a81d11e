//! The cluster's daemons: started detached (own process group, reparented away from the
//! caller, output to a log file), recorded by pid and executable, and stopped only after
//! `/proc/<pid>/cmdline` confirms the pid is still the process we started.

use super::ClusterError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon `up` started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Daemon {
    pub name: String,
    pub pid: i32,
    /// argv\[0\] as started: the absolute path of the binary.
    pub exe: PathBuf,
    pub log: PathBuf,
}

/// Starts `exe args` detached with `env`, stdout and stderr appended to `log`.
///
/// A short-lived `sh` backgrounds the daemon and exits, so the daemon is reparented to
/// init (no zombie in a long-lived test process), in a new process group (a terminal's
/// Ctrl-C does not reach it).
pub fn spawn(
    name: &str,
    exe: &Path,
    args: &[String],
    env: &[(&str, String)],
    log: &Path,
) -> Result<Daemon, ClusterError> {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!"#)
        .arg("sh")
        .arg(log)
        .arg(exe)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().map_err(|source| ClusterError::Io { what: format!("starting {name}"), source })?;
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| ClusterError::Process {
        name: name.to_owned(),
        detail: format!("sh printed no pid: {:?}", String::from_utf8_lossy(&out.stdout)),
    })?;
    let daemon = Daemon { name: name.to_owned(), pid, exe: exe.to_path_buf(), log: log.to_path_buf() };
    // `$!` is the background subshell, which execs the daemon a moment later (longer on a busy
    // machine): until then its cmdline is `sh`, and `is_ours` would call it dead. Wait for the
    // exec (or for the process to be gone), so callers see the daemon or a real exit.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.is_ours() && !is_zombie(pid) {
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(daemon)
}

impl Daemon {
    /// The pid is alive (not a zombie) and still runs our executable.
    pub fn is_ours(&self) -> bool {
        let proc_dir = PathBuf::from(format!("/proc/{}", self.pid));
        let Ok(cmdline) = std::fs::read(proc_dir.join("cmdline")) else {
            return false;
        };
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        if argv0 != self.exe.as_os_str().as_encoded_bytes() {
            return false;
        }
        !is_zombie(self.pid)
    }

    /// SIGTERM, then SIGKILL after `grace`; waits until the process is gone. A pid that is
    /// no longer ours is left alone.
    pub fn stop(&self, grace: Duration) -> Result<(), ClusterError> {
        if !self.is_ours() {
            return Ok(());
        }
        signal(self.pid, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while self.is_ours() {
            if Instant::now() >= deadline {
                signal(self.pid, libc::SIGKILL);
                let hard = Instant::now() + Duration::from_secs(5);
                while self.is_ours() {
                    if Instant::now() >= hard {
                        return Err(ClusterError::Process {
                            name: self.name.clone(),
                            detail: format!("pid {} survived SIGKILL", self.pid),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // A dying process stops looking like ours (its exe link goes) before it is gone: wait
        // until it has really exited, so a caller may reuse its ports at once.
        let gone = Instant::now() + Duration::from_secs(5);
        while PathBuf::from(format!("/proc/{}", self.pid)).exists() && !is_zombie(self.pid) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// The last `lines` lines of the daemon's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

/// The last `lines` lines of the file at `path` (empty when unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) takes no pointers; the pid was verified to run our executable just before.
    unsafe {
        libc::kill(pid, sig);
    }
}

fn is_zombie(pid: i32) -> bool {
    // /proc/<pid>/stat: "pid (comm) S ..."; comm may hold spaces and parentheses, so the
    // state is the first field after the last ')'.
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some("Z") | Some("X") | None)
}

/// Fails when something already listens on `127.0.0.1:port`.
pub fn ensure_port_free(port: u16, what: &str) -> Result<(), ClusterError> {
    match std::net::TcpListener::bind(("127.0.0.1", port)) {
        Ok(_) => Ok(()),
        Err(source) => Err(ClusterError::PortInUse { port, what: what.to_owned(), source }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn spawns_detached_verifies_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sleep.log");
        let sleep = PathBuf::from("/bin/sleep");
        let d = spawn("sleep", &sleep, &["300".into()], &[], &log).unwrap();
        assert!(d.is_ours(), "a just-started daemon is ours");
        // The same pid with another recorded executable is not ours: stop must not touch it.
        let impostor = Daemon { exe: PathBuf::from("/bin/true"), ..d.clone() };
        assert!(!impostor.is_ours());
        impostor.stop(Duration::from_millis(100)).unwrap();
        assert!(d.is_ours(), "stopping an impostor record left the real process alone");
        d.stop(Duration::from_secs(5)).unwrap();
        assert!(!d.is_ours());
        assert!(!PathBuf::from(format!("/proc/{}", d.pid)).exists() || is_zombie(d.pid));
    }
}

//! A hypervisor's own stdout and stderr: one pipe, drained by a task of the driver into a
//! size-capped log ([`CappedLog`]), for QEMU (`qemu.log`) and cloud-hypervisor (`vmm.log`)
//! alike.
//!
//! The hypervisor prints what some guest actions provoke (device errors, warnings), so its
//! output is guest-influenced and capped like the console. It never holds the log file itself:
//! it writes into the pipe, and the log stays the driver's (root's) file. When no one drains
//! (after the driver's own restart) the hypervisor's writes fail with `EPIPE` (QEMU ignores
//! it; cloud-hypervisor, a Rust program, ignores `SIGPIPE` and sees the error from its log
//! writes — no cloud-hypervisor binary here to confirm it carries on, see its module docs).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use crate::console::CappedLog;

/// Bytes of a hypervisor's own output (both segments of its log) kept per VM.
pub const LOG_CAP: u64 = 64 * 1024;

/// How much one read from the pipe takes.
const CHUNK: usize = 16 * 1024;

/// Errors of [`spawn_logged`].
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// Opening the capped log or making the pipe failed (before anything was spawned).
    #[error("opening the log {path}")]
    Log {
        /// The log.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Forking or exec'ing the program failed.
    #[error("spawning the process")]
    Spawn {
        /// The cause (`NotFound`/`PermissionDenied` for a missing or unusable binary).
        #[source]
        source: std::io::Error,
    },
}

/// The task draining a hypervisor's output; ends when the hypervisor (and every process that
/// inherited its stdout/stderr) has exited.
#[derive(Debug)]
pub struct OutputDrain {
    done: tokio::sync::oneshot::Receiver<()>,
}

impl OutputDrain {
    /// Waits (at most `within`) until the output ended (the hypervisor exited), so the log is
    /// complete.
    pub async fn finish(self, within: Duration) {
        let _ = tokio::time::timeout(within, self.done).await;
    }
}

/// Spawns `cmd` (its jail already installed, [`super::SpawnPlan::install`]) with stdin from
/// `/dev/null` and stdout and stderr into one pipe whose other end a task of ours drains into
/// the [`CappedLog`] at `log` (at most `cap` bytes on disk). The child is not killed when
/// dropped. Needs a tokio runtime.
pub fn spawn_logged(mut cmd: Command, log: &Path, cap: u64) -> Result<(Child, OutputDrain), OutputError> {
    let opening = |source| OutputError::Log { path: log.to_path_buf(), source };
    let mut capped = CappedLog::open(log, cap).map_err(opening)?;
    let (reader, writer) = std::io::pipe().map_err(opening)?;
    let err = writer.try_clone().map_err(opening)?;
    let reader = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader)).map_err(opening)?;
    cmd.stdin(Stdio::null()).stdout(writer).stderr(err).kill_on_drop(false);
    let child = cmd.spawn().map_err(|source| OutputError::Spawn { source })?;
    // The parent's write ends close with `cmd`: the pipe ends when the child exits.
    drop(cmd);
    let (tx, done) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut reader = reader;
        let mut buf = vec![0u8; CHUNK];
        while let Ok(n) = reader.read(&mut buf).await {
            if n == 0 || capped.write(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = tx.send(());
    });
    Ok((child, OutputDrain { done }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_flood_is_capped_and_the_end_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("x.log");
        let mut cmd = Command::new("/bin/sh");
        // 256 KiB on stdout and stderr, then a last line.
        cmd.args(["-c", "head -c 131072 /dev/zero; head -c 131072 /dev/zero >&2; echo last words >&2"]);
        let (mut child, drain) = spawn_logged(cmd, &log, LOG_CAP).expect("spawn");
        assert!(child.wait().await.expect("wait").success());
        drain.finish(Duration::from_secs(10)).await;
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let on_disk = size(&log) + size(&crate::console::rotated_path(&log));
        assert!(on_disk <= LOG_CAP, "{on_disk} bytes on disk");
        assert!(crate::console::tail_string(&log, 64).ends_with("last words\n"));
    }

    #[tokio::test]
    async fn a_missing_program_is_a_spawn_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cmd = Command::new(dir.path().join("nope"));
        let e = spawn_logged(cmd, &dir.path().join("x.log"), LOG_CAP).expect_err("missing");
        assert!(matches!(&e, OutputError::Spawn { source } if source.kind() == std::io::ErrorKind::NotFound), "{e:?}");
    }
}

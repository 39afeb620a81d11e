//! The QEMU process: daemonized start, pid file, kill, and helpers like `qemu-img`.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::driver::DriverError;
use crate::record;

/// How long QEMU's parent may take to daemonize (it exits once the VM is set up).
pub const DAEMONIZE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a helper program to completion; a non-zero exit is an error carrying its stderr.
pub async fn run(program: &Path, args: &[String]) -> Result<(), DriverError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| DriverError::Spawn { program: program.display().to_string(), detail: e.to_string() })?;
    if !out.status.success() {
        return Err(DriverError::Spawn {
            program: program.display().to_string(),
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    Ok(())
}

/// Starts QEMU with `-daemonize -pidfile <pidfile>` and returns `(pid, start_time)` of the
/// daemon once the parent has exited successfully.
pub async fn start_daemonized(qemu: &Path, args: &[String], pidfile: &Path) -> Result<(u32, u64), DriverError> {
    start_daemonized_in(qemu, args, pidfile, None).await
}

/// [`start_daemonized`] inside the network namespace file `netns` (e.g. `/run/netns/<name>`):
/// the child joins it (`setns(CLONE_NEWNET)`) between fork and exec, so QEMU opens its TAP there.
pub async fn start_daemonized_in(
    qemu: &Path,
    args: &[String],
    pidfile: &Path,
    netns: Option<&Path>,
) -> Result<(u32, u64), DriverError> {
    let program = qemu.display().to_string();
    let mut cmd = tokio::process::Command::new(qemu);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    // Opened close-on-exec; kept open until the child has exec'ed (spawn returns after exec).
    let ns_file = match netns {
        Some(path) => Some(
            std::fs::File::open(path)
                .map_err(|e| DriverError::io(format!("opening network namespace {}", path.display()), e))?,
        ),
        None => None,
    };
    if let Some(f) = &ns_file {
        let fd = f.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only calls setns(2), which
        // is async-signal-safe, on a descriptor the parent keeps open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd.spawn().map_err(|e| DriverError::Spawn { program: program.clone(), detail: e.to_string() })?;
    drop(ns_file);
    let out = tokio::time::timeout(DAEMONIZE_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| DriverError::Spawn {
            program: program.clone(),
            detail: format!("did not daemonize within {DAEMONIZE_TIMEOUT:?}"),
        })?
        .map_err(|e| DriverError::Spawn { program: program.clone(), detail: e.to_string() })?;
    // The daemon may already have written its pid file even if the parent failed: read it
    // in every case so the caller can kill it.
    let pid = read_pidfile(pidfile);
    if !out.status.success() {
        if let Some(pid) = pid {
            if let Some(st) = record::pid_start_time(pid) {
                kill_and_wait(pid, st, Duration::from_secs(5)).await;
            }
        }
        return Err(DriverError::Spawn {
            program,
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    let pid = pid.ok_or_else(|| DriverError::Spawn {
        program: program.clone(),
        detail: format!("no pid in {}", pidfile.display()),
    })?;
    let start = record::pid_start_time(pid).ok_or_else(|| DriverError::Spawn {
        program,
        detail: format!("daemon pid {pid} vanished right after start"),
    })?;
    Ok((pid, start))
}

fn read_pidfile(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reaps `pid` if it happens to be our child (no-op otherwise).
fn reap(pid: u32) {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG on a specific pid only reads into `status`.
    unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
}

/// Sends `sig` to `pid` if it is still the process that started at `start_time`.
pub fn signal(pid: u32, start_time: u64, sig: libc::c_int) -> bool {
    if !record::is_alive(pid, start_time) {
        return false;
    }
    // SAFETY: kill(2) with a positive pid and a valid signal number has no memory effects.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// Waits until `pid` (with `start_time`) is gone; true if it is gone within `timeout`.
pub async fn wait_gone(pid: u32, start_time: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        reap(pid);
        if !record::is_alive(pid, start_time) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGKILLs the process and waits for it to disappear; true if it is gone.
pub async fn kill_and_wait(pid: u32, start_time: u64, timeout: Duration) -> bool {
    signal(pid, start_time, libc::SIGKILL);
    wait_gone(pid, start_time, timeout).await
}

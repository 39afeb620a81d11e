//! On-disk VM state: `<state_dir>/vms/<id>/vm.json` (one record per VM, written atomically)
//! and the pid + start-time liveness check that defeats pid reuse.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// File name of a VM record inside its directory.
pub const VM_JSON: &str = "vm.json";

/// Errors reading or writing state records.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Filesystem error.
    #[error("{what} {path}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file holds invalid JSON for its type.
    #[error("parsing {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// `$CHRYSALIS_STATE`, default `/var/lib/chrysalis`.
pub fn default_state_dir() -> PathBuf {
    std::env::var_os("CHRYSALIS_STATE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/chrysalis"))
}

/// `<state_dir>/vms`.
pub fn vms_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("vms")
}

/// Writes `value` as JSON to `path` atomically: temp file in the same dir, fsync, rename, fsync dir.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), RecordError> {
    let io = |what, source| RecordError::Io { what, path: path.to_path_buf(), source };
    let bytes =
        serde_json::to_vec_pretty(value).map_err(|source| RecordError::Parse { path: path.to_path_buf(), source })?;
    foundation::write_atomic(path, &bytes, foundation::PUBLIC_FILE).map_err(|e| io("writing", e))
}

/// Reads a JSON record.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, RecordError> {
    let bytes =
        std::fs::read(path).map_err(|source| RecordError::Io { what: "reading", path: path.to_path_buf(), source })?;
    serde_json::from_slice(&bytes).map_err(|source| RecordError::Parse { path: path.to_path_buf(), source })
}

/// Start time of `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`), or `None`
/// if the process does not exist.
pub fn pid_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); starttime is field 22 → index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The process state letter of `pid` (`R`, `S`, `Z`, …), if it exists.
pub fn pid_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next()?.chars().next()
}

/// Whether `pid` is alive (not a zombie) and is the same process that started at `start_time`.
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    pid != 0 && pid_start_time(pid) == Some(start_time) && !matches!(pid_state(pid), Some('Z') | Some('X') | None)
}

/// Reaps `pid` if it happens to be our child (no-op otherwise).
fn reap(pid: u32) {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG on a specific pid only reads into `status`.
    unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
}

/// Sends `sig` to `pid` if it is still the process that started at `start_time`.
pub fn signal(pid: u32, start_time: u64, sig: libc::c_int) -> bool {
    if !is_alive(pid, start_time) {
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
        if !is_alive(pid, start_time) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_round_trips_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("x.json");
        write_json_atomic(&p, &serde_json::json!({"a": 1})).expect("write");
        write_json_atomic(&p, &serde_json::json!({"a": 2})).expect("overwrite");
        let v: serde_json::Value = read_json(&p).expect("read");
        assert_eq!(v, serde_json::json!({"a": 2}));
        let names: Vec<_> =
            std::fs::read_dir(dir.path()).expect("readdir").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.json")]);
        assert!(matches!(read_json::<serde_json::Value>(&dir.path().join("nope")), Err(RecordError::Io { .. })));
    }

    #[test]
    fn liveness_uses_start_time() {
        let me = std::process::id();
        let st = pid_start_time(me).expect("own stat");
        assert!(is_alive(me, st));
        assert!(!is_alive(me, st + 1), "a different start time means pid reuse");
        assert!(!is_alive(0, st));
        assert_eq!(pid_start_time(u32::MAX), None);
    }
}

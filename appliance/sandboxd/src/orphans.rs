//! The restart sweep of half-created QEMU VMs that [`vmm::Driver::list`] cannot see.
//!
//! The QEMU driver writes `<vms>/<id>/vm.json` only once a boot or clone completed, and `list`
//! skips directories without it. When sandboxd is killed (`kill -9`) mid-refill, the daemonized
//! QEMU of that refill keeps running in a directory with no record: no claim, no pool and no
//! listing names it, so it would leak forever. This sweep runs inside the restart reconcile,
//! after a successful `list` and before refill starts (so no boot of ours is in flight), over
//! the driver's VM directory:
//! - only directories named `sbx-…` (ours) that `list` did not report as live are touched;
//! - every `qemu-system*` process whose command line names such a directory is SIGKILLed;
//! - the directory is then removed (a record whose process is dead is stale state).
//!
//! Nothing is destroyed on ambiguity: an unreadable VM directory aborts the sweep, and a process
//! that will not die keeps its directory. The driver-neutral fix is for the driver to list (or
//! clean up) incomplete VMs itself; until then [`crate::NodeOptions::vm_dir`] turns this on.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a SIGKILLed QEMU may take to disappear.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Errors of the sweep.
#[derive(Debug, thiserror::Error)]
pub enum OrphansError {
    /// The VM directory could not be listed.
    #[error("listing {path}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What the sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Processes killed.
    pub killed: usize,
    /// Directories removed.
    pub removed: usize,
}

/// One process: pid, start time, argv.
struct Proc {
    pid: u32,
    start_time: u64,
    argv: Vec<String>,
}

fn qemu_processes() -> Vec<Proc> {
    let Ok(rd) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else { continue };
        let argv: Vec<String> =
            raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let is_qemu = argv
            .first()
            .and_then(|a0| Path::new(a0).file_name())
            .is_some_and(|n| n.to_string_lossy().starts_with("qemu-system"));
        if !is_qemu {
            continue;
        }
        let Some(start_time) = vmm::record::pid_start_time(pid) else { continue };
        out.push(Proc { pid, start_time, argv });
    }
    out
}

/// Whether `argv` names a path inside `dir`.
fn mentions(argv: &[String], dir: &Path) -> bool {
    let prefix = format!("{}/", dir.display());
    argv.iter().any(|a| a.contains(&prefix))
}

/// Kills the QEMU processes of, and removes, every `sbx-` VM directory under `vms_dir` whose id
/// is not in `live`. A missing `vms_dir` is an empty one.
pub async fn sweep(vms_dir: &Path, live: &HashSet<String>) -> Result<SweepReport, OrphansError> {
    let rd = match std::fs::read_dir(vms_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SweepReport::default()),
        Err(source) => return Err(OrphansError::List { path: vms_dir.to_path_buf(), source }),
    };
    let mut stale = Vec::new();
    for e in rd {
        let e = e.map_err(|source| OrphansError::List { path: vms_dir.to_path_buf(), source })?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("sbx-") && !live.contains(&name) && e.path().is_dir() {
            stale.push(e.path());
        }
    }
    let mut report = SweepReport::default();
    if stale.is_empty() {
        return Ok(report);
    }
    let procs = qemu_processes();
    for dir in stale {
        let mut all_gone = true;
        for p in procs.iter().filter(|p| mentions(&p.argv, &dir)) {
            tracing::info!(dir = %dir.display(), pid = p.pid, "killing the QEMU of a half-created VM");
            if vmm::qemu::process::kill_and_wait(p.pid, p.start_time, KILL_WAIT).await {
                report.killed += 1;
            } else {
                tracing::warn!(dir = %dir.display(), pid = p.pid, "QEMU did not exit after SIGKILL; keeping its dir");
                all_gone = false;
            }
        }
        if !all_gone {
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "removed a stale VM dir");
                report.removed += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "removing a stale VM dir failed"),
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mentions_needs_a_path_inside_the_dir() {
        let dir = Path::new("/s/vms/sbx-a");
        let argv = |a: &str| vec!["qemu-system-x86_64".to_string(), "-pidfile".to_string(), a.to_string()];
        assert!(mentions(&argv("/s/vms/sbx-a/qemu.pid"), dir));
        assert!(mentions(&argv("socket,id=agent0,path=/s/vms/sbx-a/agent-serial.sock"), dir));
        assert!(!mentions(&argv("/s/vms/sbx-ab/qemu.pid"), dir));
        assert!(!mentions(&argv("/s/vms/sbx-a"), dir));
    }

    #[tokio::test]
    async fn removes_unlisted_sbx_dirs_only() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for d in ["sbx-live", "sbx-stale", "other-vm"] {
            std::fs::create_dir(tmp.path().join(d)).expect("mkdir");
        }
        let live: HashSet<String> = ["sbx-live".to_string()].into_iter().collect();
        let r = sweep(tmp.path(), &live).await.expect("sweep");
        assert_eq!(r, SweepReport { killed: 0, removed: 1 });
        assert!(tmp.path().join("sbx-live").exists());
        assert!(tmp.path().join("other-vm").exists());
        assert!(!tmp.path().join("sbx-stale").exists());
        let missing = sweep(&tmp.path().join("nope"), &live).await.expect("missing dir");
        assert_eq!(missing, SweepReport::default());
    }
}

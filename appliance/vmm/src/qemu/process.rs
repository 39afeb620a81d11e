//! The QEMU process: a jailed start, readiness, pid file, kill, and helpers like `qemu-img`.

use std::path::Path;
use std::time::{Duration, Instant};

use tokio::process::Child;

use super::qmp::Qmp;
use crate::driver::DriverError;
use crate::jail::output::{spawn_logged, OutputDrain, OutputError};
use crate::jail::SpawnPlan;

/// How long QEMU may take to set the VM up (until QMP answers).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a helper program to completion; a non-zero exit is an error carrying its stderr.
pub async fn run(program: &Path, args: &[String]) -> Result<(), DriverError> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_output(program, &args).await.map(drop)
}

/// Runs a helper program to completion and returns its stdout; a non-zero exit is an error
/// carrying its stderr (see [`foundation::tool`]).
pub async fn run_output(program: &Path, args: &[&str]) -> Result<Vec<u8>, DriverError> {
    let name = program.display().to_string();
    let (program, args) = (program.to_path_buf(), args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    tokio::task::spawn_blocking(move || foundation::tool::run(&program, &args, None))
        .await
        .map_err(|e| DriverError::Spawn { program: name.clone(), detail: e.to_string() })?
        .map_err(|e| DriverError::Spawn { program: name, detail: e.to_string() })
}

/// Bytes of QEMU's own output (`qemu.log`, both segments) kept per VM: QEMU prints what some
/// guest actions provoke (device errors), so it is capped like the console.
pub const LOG_CAP: u64 = crate::jail::output::LOG_CAP;

/// Spawns QEMU (in the foreground: no `-daemonize`) with `plan` installed between fork and
/// exec (its own session, netns, cgroup, inherited descriptors, the user switch; see
/// [`crate::jail`]); stdout and stderr go through a pipe into the capped `log`
/// ([`crate::jail::output`]). The child is not killed when dropped: the VM outlives its
/// driver, and tokio reaps it if it exits while we still run.
pub fn spawn(qemu: &Path, args: &[String], log: &Path, plan: SpawnPlan) -> Result<(Child, OutputDrain), DriverError> {
    let mut cmd = tokio::process::Command::new(qemu);
    cmd.args(args);
    plan.install(&mut cmd);
    spawn_logged(cmd, log, LOG_CAP).map_err(|e| match e {
        OutputError::Log { path, source } => DriverError::io(format!("opening {}", path.display()), source),
        OutputError::Spawn { source } => {
            DriverError::Spawn { program: qemu.display().to_string(), detail: source.to_string() }
        }
    })
}

/// Waits until QEMU's QMP socket answers (its set-up is done: devices, disks, the incoming
/// side), or fails with the end of `log` if QEMU exits first.
pub async fn wait_ready(
    qemu: &Path,
    child: &mut Child,
    output: &mut Option<OutputDrain>,
    qmp: &Path,
    log: &Path,
) -> Result<(), DriverError> {
    let program = qemu.display().to_string();
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            if let Some(drain) = output.take() {
                drain.finish(Duration::from_secs(2)).await;
            }
            return Err(DriverError::Spawn {
                program,
                detail: format!("{status}: {}", crate::console::tail_string(log, 2048).trim()),
            });
        }
        // The listening socket is QEMU's: a connection waits in its backlog until QEMU's main
        // loop greets it, and breaks if QEMU exits.
        if Qmp::connect(qmp, Duration::from_secs(1)).await.is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(DriverError::Spawn { program, detail: format!("QMP did not answer within {START_TIMEOUT:?}") });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes `pid` into the pid file (QEMU cannot: it reaches none of our directories).
pub fn write_pidfile(path: &Path, pid: u32) -> Result<(), DriverError> {
    std::fs::write(path, format!("{pid}\n")).map_err(|e| DriverError::io(format!("writing {}", path.display()), e))
}

pub use crate::record::{kill_and_wait, signal, wait_gone};

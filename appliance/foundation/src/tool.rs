//! Running an external tool (`qemu-img`, `nft`, …) to completion, with what it said in the error.
//!
//! One rule for every crate: stdin is closed (or fed the given bytes), stdout is returned,
//! and a failure names the program, its arguments, its exit status and the start of its
//! stderr (at most [`STDERR_EXCERPT`] bytes, so a chatty tool cannot bloat a log line).

use std::ffi::OsStr;
use std::io::Write;
use std::process::{Command, Stdio};

/// How much of a failed tool's stderr an error keeps.
pub const STDERR_EXCERPT: usize = 4096;

/// A tool that could not be run, or that failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The program could not be started (not installed, not executable), or its stdin or
    /// output could not be handled.
    #[error("cannot run {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The program ran and exited unsuccessfully.
    #[error("{program} {args} failed ({status}): {stderr}")]
    Failed {
        /// The program.
        program: String,
        /// Its arguments, space-separated.
        args: String,
        /// Its exit status.
        status: String,
        /// The start of its stderr, trimmed.
        stderr: String,
    },
}

/// Runs `program` with `args` to completion, feeding it `stdin` (or nothing), and returns its
/// stdout. A non-zero exit is [`ToolError::Failed`] with the start of its stderr.
pub fn run<S: AsRef<OsStr>>(
    program: impl AsRef<OsStr>,
    args: &[S],
    stdin: Option<&[u8]>,
) -> Result<Vec<u8>, ToolError> {
    let program = program.as_ref();
    let name = || program.to_string_lossy().into_owned();
    let spawn = |source| ToolError::Spawn { program: name(), source };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn)?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(bytes).map_err(spawn)?;
    }
    let out = child.wait_with_output().map_err(spawn)?;
    if !out.status.success() {
        let stderr = &out.stderr[..out.stderr.len().min(STDERR_EXCERPT)];
        return Err(ToolError::Failed {
            program: name(),
            args: args.iter().map(|a| a.as_ref().to_string_lossy()).collect::<Vec<_>>().join(" "),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(stderr).trim().to_owned(),
        });
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stdout_comes_back_and_stdin_goes_in() {
        assert_eq!(run("echo", &["a", "b"], None).expect("echo"), b"a b\n");
        assert_eq!(run("cat", &[] as &[&str], Some(b"fed")).expect("cat"), b"fed");
    }

    #[test]
    fn a_failure_names_program_args_status_and_stderr() {
        let e = run("sh", &["-c", "echo boom >&2; exit 3"], None).expect_err("fails");
        let msg = e.to_string();
        assert!(matches!(e, ToolError::Failed { .. }), "{e:?}");
        assert!(
            msg.contains("sh -c echo boom >&2; exit 3") && msg.contains("exit status: 3") && msg.ends_with("boom"),
            "{msg}"
        );
    }

    #[test]
    fn stderr_is_cut_to_the_excerpt() {
        let e = run("sh", &["-c", "head -c 100000 /dev/zero | tr '\\0' x >&2; exit 1"], None).expect_err("fails");
        let ToolError::Failed { stderr, .. } = e else { panic!("{e:?}") };
        assert_eq!(stderr.len(), STDERR_EXCERPT);
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let e = run("/nonexistent/tool", &["x"], None).expect_err("missing");
        assert!(matches!(&e, ToolError::Spawn { program, .. } if program == "/nonexistent/tool"), "{e:?}");
    }
}

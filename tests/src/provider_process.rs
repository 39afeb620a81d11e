//! A provider binary (vk-sandbox, vk-cocoon) run as a child of a test or benchmark:
//! restartable, killable like a crash (`kill -9`) or stopped cleanly (SIGTERM), one log file
//! per start, killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct ProviderProcess {
    /// Names the log files and log headers (`<name>-<n>.log`).
    name: &'static str,
    pub bin: PathBuf,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    /// `RUST_LOG` for the child.
    rust_log: &'static str,
    dir: PathBuf,
    child: Option<Child>,
    starts: usize,
}

impl Drop for ProviderProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

impl ProviderProcess {
    /// Not started yet: [`ProviderProcess::ensure_running`] starts it.
    pub fn new(
        name: &'static str,
        bin: PathBuf,
        args: Vec<String>,
        envs: Vec<(String, String)>,
        rust_log: &'static str,
        dir: PathBuf,
    ) -> ProviderProcess {
        ProviderProcess { name, bin, args, envs, rust_log, dir, child: None, starts: 0 }
    }

    pub fn log_path(&self, n: usize) -> PathBuf {
        self.dir.join(format!("{}-{n}.log", self.name))
    }

    /// How many times it was started.
    pub fn starts(&self) -> usize {
        self.starts
    }

    /// Starts it unless it runs.
    pub fn ensure_running(&mut self) -> Result<(), String> {
        if let Some(c) = self.child.as_mut() {
            if c.try_wait().map_err(|e| e.to_string())?.is_none() {
                return Ok(());
            }
            self.child = None;
        }
        self.starts += 1;
        let log = std::fs::File::create(self.log_path(self.starts)).map_err(|e| e.to_string())?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(&self.bin)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("RUST_LOG", self.rust_log)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// The running child's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A flag's value (`--flag value`), else an environment variable's.
    pub fn setting(&self, flag: &str, env: &str) -> Option<String> {
        let by_flag = self.args.iter().position(|a| a == flag).and_then(|i| self.args.get(i + 1));
        by_flag.cloned().or_else(|| self.envs.iter().find(|(k, _)| k == env).map(|(_, v)| v.clone()))
    }

    /// SIGKILL, like a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM (a clean stop leaves claims and VMs as they are), then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last `lines` lines of the current run's log, with a header.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(self.starts)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "---- {} run {} (last lines) ----\n{}",
            self.name,
            self.starts,
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
}

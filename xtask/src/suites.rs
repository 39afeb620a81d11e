//! The test binaries of the workspace, run the way `cargo test` runs them (working directory
//! the package's, `CARGO_MANIFEST_DIR` set), but in two lanes and timed.
//!
//! `cargo test --no-run --message-format=json` builds every test binary and names it; the
//! suites in [`PARALLEL`] (long, mostly waiting on a booting machine) run beside the others,
//! their output kept in a log and printed when they end; the rest run one after another,
//! streaming. Each suite's wall-clock time and every failed test's name are printed at the end
//! of the run, so a CI log's tail says what failed and where the time went.

use anyhow::{Context, Result};
use serde::Deserialize;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Suites that run in their own lane, beside the rest: the appliance suite spends most of its
/// time waiting for a booting, rebooting or trial-deadline-bound machine.
pub const PARALLEL: &[&str] = &["appliance_e2e"];

/// One test binary.
#[derive(Debug, Clone)]
pub struct Suite {
    /// `package::target` (`sandboxd::secure_e2e`, `vmm` for unit tests).
    pub name: String,
    /// The target's own name (`secure_e2e`).
    pub target: String,
    pub exe: PathBuf,
    pub manifest_dir: PathBuf,
}

/// Counts of one or more suites' results, from libtest's `test result:` lines.
#[derive(Default, Debug)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
    pub skipped: u64,
    /// `suite: test` for each failed test.
    pub failed_tests: Vec<String>,
}

impl Tally {
    /// Adds one line of a test binary's output: `test result: ok. 8 passed; 0 failed; 1
    /// ignored; …` counts, `test name ... FAILED` names a failure.
    pub fn add_line(&mut self, suite: &str, line: &str) {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... FAILED")) {
            self.failed_tests.push(format!("{suite}: {name}"));
            return;
        }
        let Some(rest) = line.strip_prefix("test result: ") else { return };
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let (num, what) = match words.as_slice() {
                [.., n, w] => (n.trim_start_matches("ok.").trim_start_matches("FAILED."), *w),
                _ => continue,
            };
            let Ok(n) = num.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.skipped += n,
                _ => {}
            }
        }
    }

    /// Moves `n` tests that passed by returning early (they said why, `foundation::testing::skip`)
    /// from passed to skipped.
    pub fn count_runtime_skips(&mut self, n: u64) {
        let n = n.min(self.passed);
        self.passed -= n;
        self.skipped += n;
    }

    pub fn merge(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
        self.failed_tests.extend(other.failed_tests);
    }
}

/// How one suite ended.
#[derive(Debug)]
pub struct Ran {
    pub name: String,
    pub elapsed: Duration,
    /// The binary exited 0.
    pub ok: bool,
}

#[derive(Deserialize)]
struct Message {
    reason: String,
    #[serde(default)]
    executable: Option<PathBuf>,
    #[serde(default)]
    manifest_path: Option<PathBuf>,
    #[serde(default)]
    target: Option<Target>,
    #[serde(default)]
    profile: Option<Profile>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

/// Builds every test binary of `cargo test <args>` and returns them in cargo's order.
pub fn build(args: &[String]) -> Result<Vec<Suite>> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["test", "--no-run", "--message-format=json-render-diagnostics"]).args(args);
    let mut child = cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut suites = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(msg) = serde_json::from_str::<Message>(&line) else { continue };
        if msg.reason != "compiler-artifact" || !msg.profile.is_some_and(|p| p.test) {
            continue;
        }
        let (Some(exe), Some(manifest), Some(target)) = (msg.executable, msg.manifest_path, msg.target) else {
            continue;
        };
        let manifest_dir = manifest.parent().map(Path::to_path_buf).unwrap_or_default();
        let package = manifest_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let unit = target.kind.iter().any(|k| k == "lib" || k == "proc-macro");
        let name = if unit { package } else { format!("{package}::{}", target.name) };
        suites.push(Suite { name, target: target.name, exe, manifest_dir });
    }
    anyhow::ensure!(child.wait()?.success(), "building the test binaries failed (the errors are above)");
    Ok(suites)
}

/// Runs `suite`, passing `filter` on; every stdout line goes to `out` and is counted.
pub fn run(
    suite: &Suite,
    filter: Option<&str>,
    env: &[(String, PathBuf)],
    stderr: Stdio,
    out: &mut dyn FnMut(&str),
) -> Result<(Ran, Tally)> {
    let mut tally = Tally::default();
    let started = Instant::now();
    let mut cmd = Command::new(&suite.exe);
    cmd.current_dir(&suite.manifest_dir).env("CARGO_MANIFEST_DIR", &suite.manifest_dir);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    if let Some(f) = filter {
        cmd.arg(f);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("running {}", suite.exe.display()))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        out(&line);
        tally.add_line(&suite.name, &line);
    }
    let ok = child.wait()?.success();
    if !ok && tally.failed == 0 {
        // Crashed or aborted before its summary: still a failure, with a name.
        tally.failed += 1;
        tally.failed_tests.push(format!("{}: (the test binary exited with an error)", suite.name));
    }
    Ok((Ran { name: suite.name.clone(), elapsed: started.elapsed(), ok }, tally))
}

/// Runs `suite` into `log` (stdout and stderr), for a lane beside the streaming one.
pub fn run_logged(suite: &Suite, filter: Option<&str>, env: &[(String, PathBuf)], log: &Path) -> Result<(Ran, Tally)> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut stdout_log = file.try_clone()?;
    run(suite, filter, env, Stdio::from(file), &mut |l| drop(writeln!(stdout_log, "{l}")))
}

/// The end-of-run table: each suite's time, longest first (suites under a second summed).
pub fn print_times(ran: &[Ran]) {
    let mut sorted: Vec<&Ran> = ran.iter().collect();
    sorted.sort_by_key(|r| std::cmp::Reverse(r.elapsed));
    println!("suite times (the {} ran beside the others):", PARALLEL.join(", "));
    let mut quick = (0, Duration::ZERO);
    for r in sorted {
        if r.elapsed < Duration::from_secs(1) {
            quick = (quick.0 + 1, quick.1 + r.elapsed);
            continue;
        }
        let mark = if r.ok { "" } else { "  FAILED" };
        println!("  {:<52} {:>7.1} s{mark}", r.name, r.elapsed.as_secs_f64());
    }
    println!("  {:<52} {:>7.1} s", format!("{} suites under a second", quick.0), quick.1.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn tally_reads_cargo_result_lines_and_failed_names() {
        let mut t = Tally::default();
        t.add_line(
            "a",
            "test result: ok. 8 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.60s",
        );
        t.add_line("a", "test some::name ... FAILED");
        t.add_line("a", "test result: FAILED. 1 passed; 3 failed; 0 ignored; 0 measured; 0 filtered out");
        t.add_line("a", "running 4 tests");
        assert_eq!((t.passed, t.failed, t.skipped), (9, 3, 2));
        assert_eq!(t.failed_tests, vec!["a: some::name".to_string()]);
    }
}

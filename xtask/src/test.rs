//! `cargo xtask test`: the whole test suite, as CI runs it.
//!
//! 1. host prerequisites (apt packages, the musl target);
//! 2. the guest kernel and every guest image (cached);
//! 3. `cargo test` over the workspace with every suite enabled: real QEMU VMs, the public
//!    Python SDK (pinned venv), sandboxd with real VMs, and the test control plane (Kubernetes
//!    built from its Go modules, cached);
//! 4. a bounded fuzz run of the wire decoder.
//!
//! Tests that cannot run on this machine are `#[ignore = "why"]` and are counted as
//! skipped, never as passed. The last line is `N passed, N failed, N skipped`.

use crate::flags::{FuzzArgs, TestArgs, VmImageArgs};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[derive(Default, Debug)]
struct Tally {
    passed: u64,
    failed: u64,
    skipped: u64,
}

impl Tally {
    /// Adds one `test result: ok. 8 passed; 0 failed; 1 ignored; …` line.
    fn add_cargo_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
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
}

/// Runs a command, echoing its stdout and feeding each line to `tally`.
fn run_counted(cmd: &mut Command, tally: &mut Tally) -> Result<bool> {
    let mut child = cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        tally.add_cargo_line(&line);
    }
    Ok(child.wait()?.success())
}

pub fn run(args: &TestArgs) -> Result<()> {
    crate::prereqs::ensure_all()?;
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })
        .context("building the guest images the end-to-end suites boot")?;

    let python = crate::python::ensure_sdk_venv()?;

    // The suites in tests/ run these binaries from the target directory they are built into.
    let built = Command::new("cargo")
        .args(["build", "-p", "sandboxd", "-p", "vk-sandbox", "-p", "vk-cocoon", "--bins"])
        .status()
        .context("running cargo build")?;
    anyhow::ensure!(built.success(), "building the sandboxd, vk-sandbox and vk-cocoon binaries failed");

    let mut tally = Tally::default();
    let mut cargo = Command::new("cargo");
    cargo.args(["test", "--workspace", "--no-fail-fast", "--features", "chrysalis-tests/e2e,chrysalis-tests/cluster,join/cluster,vnode/cluster,sandboxd/sdk-tests,sandboxd/e2e,silkd/sdk-tests,vmm/qemu-tests,images/qemu-tests,chrysalis/qemu-tests,vmnet/vm-tests"]);
    cargo.env("CHRYSALIS_PYTHON", &python);
    if let Some(filter) = &args.filter {
        cargo.arg(filter);
    }
    cargo.env("CHRYSALIS_CACHE", crate::paths::cache_dir());
    let tests_ok = run_counted(&mut cargo, &mut tally)?;

    let fuzz_ok = if args.no_fuzz {
        true
    } else {
        match crate::fuzz::run(&FuzzArgs { seconds: args.fuzz_seconds }) {
            Ok(()) => {
                tally.passed += 1;
                true
            }
            Err(e) => {
                eprintln!("fuzz: {e:#}");
                tally.failed += 1;
                false
            }
        }
    };

    println!("{} passed, {} failed, {} skipped", tally.passed, tally.failed, tally.skipped);
    if !tests_ok || !fuzz_ok || tally.failed > 0 {
        bail!("the test suite failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn tally_reads_cargo_result_lines() {
        let mut t = Tally::default();
        t.add_cargo_line(
            "test result: ok. 8 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.60s",
        );
        t.add_cargo_line("test result: FAILED. 1 passed; 3 failed; 0 ignored; 0 measured; 0 filtered out");
        t.add_cargo_line("running 4 tests");
        assert_eq!((t.passed, t.failed, t.skipped), (9, 3, 2));
    }
}

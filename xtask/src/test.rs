//! `cargo xtask test`: the whole test suite, as CI runs it.
//!
//! 1. host prerequisites (apt packages, the musl target);
//! 2. the guest kernel and every guest image (cached);
//! 3. the appliance image of the `qemu-x86_64` board (cached; trusting this machine's dev update
//!    keys, asked for explicitly), a second version of it one `security_version` higher, two
//!    signed bundles of that version (a good one, one whose supervisor never becomes healthy)
//!    and a bundle of the first version (replayed after the upgrade: a downgrade) for the
//!    appliance suite, in `$CHRYSALIS_CACHE/appliance-test/`
//!    (`CHRYSALIS_APPLIANCE_TESTS=0` leaves the suite out: reported as skipped);
//! 4. `cargo test` over the workspace with every suite enabled: real QEMU VMs, the public
//!    Python SDK (pinned venv), sandboxd with real VMs, the test control plane (Kubernetes
//!    built from its Go modules, cached), the supervisor with the real services, and the
//!    appliance booted under OVMF;
//! 5. a bounded fuzz run of the wire decoder.
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

/// Wall-clock time of each phase of the run, printed at the end (also when it fails).
#[derive(Default)]
struct Phases {
    done: Vec<(&'static str, std::time::Duration)>,
    started: Option<(&'static str, std::time::Instant)>,
}

impl Phases {
    /// Ends the running phase (if any) and starts `name`.
    fn start(&mut self, name: &'static str) {
        self.end();
        self.started = Some((name, std::time::Instant::now()));
    }

    fn end(&mut self) {
        if let Some((name, t)) = self.started.take() {
            self.done.push((name, t.elapsed()));
        }
    }

    fn print(&mut self) {
        self.end();
        let total: std::time::Duration = self.done.iter().map(|(_, d)| *d).sum();
        println!("phase times:");
        for (name, d) in &self.done {
            println!("  {name:<44} {:>7.1} min", d.as_secs_f64() / 60.0);
        }
        println!("  {:<44} {:>7.1} min", "total", total.as_secs_f64() / 60.0);
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
    let mut phases = Phases::default();
    let result = run_phases(args, &mut phases);
    phases.print();
    result
}

fn run_phases(args: &TestArgs, phases: &mut Phases) -> Result<()> {
    phases.start("prerequisites");
    crate::prereqs::ensure_all()?;
    phases.start("guest kernel and images");
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })
        .context("building the guest images the end-to-end suites boot")?;

    phases.start("Python SDK venv");
    let python = crate::python::ensure_sdk_venv()?;

    // The appliance suite boots the built host image through the whole upgrade matrix.
    // `CHRYSALIS_APPLIANCE_TESTS=0` leaves it out (its scenarios are then reported as skipped,
    // with the reason); CI never sets it.
    let appliance = if std::env::var_os(APPLIANCE_ENV).is_some_and(|v| v == "0") {
        eprintln!("test: the appliance suite is skipped ({APPLIANCE_ENV}=0)");
        None
    } else {
        phases.start("appliance image, second version and bundles");
        Some(prepare_appliance().context("building the appliance image and bundles the appliance suite boots")?)
    };
    crate::prereqs::ensure_apt(&["erofs-utils", "cryptsetup-bin", "dosfstools", "mtools", "fdisk"])?;

    phases.start("test control plane binaries (Go modules, cached)");
    let opts = test_infra::cluster::Options::default();
    test_infra::cluster::lock::Lock::load()
        .and_then(|lock| test_infra::cluster::build::ensure_all(&lock, &opts.bin_dir))
        .context("building the test control plane")?;

    phases.start("build (service binaries)");
    // The suites in tests/ run these binaries from the target directory they are built into.
    let built = Command::new("cargo")
        .args(["build", "-p", "sandboxd", "-p", "vk-sandbox", "-p", "vk-cocoon", "-p", "chrysalis", "--bins"])
        .status()
        .context("running cargo build")?;
    anyhow::ensure!(built.success(), "building the sandboxd, vk-sandbox and vk-cocoon binaries failed");

    let mut tally = Tally::default();
    phases.start("cargo test (every suite; builds the test binaries first)");
    let mut cargo = Command::new("cargo");
    cargo.args(["test", "--workspace", "--no-fail-fast", "--features", "chrysalis-tests/e2e,chrysalis-tests/cluster,join/cluster,vnode/cluster,sandboxd/sdk-tests,sandboxd/e2e,silkd/sdk-tests,vmm/qemu-tests,images/qemu-tests,chrysalis/qemu-tests,vmnet/vm-tests,xtask/image-tests"]);
    cargo.env("CHRYSALIS_PYTHON", &python);
    if let Some(dir) = &appliance {
        cargo.args(["--features", "chrysalis-tests/appliance,xtask/appliance-image"]);
        cargo.env("CHRYSALIS_APPLIANCE_TEST_DIR", dir);
    }
    if let Some(filter) = &args.filter {
        cargo.arg(filter);
    }
    cargo.env("CHRYSALIS_CACHE", crate::paths::cache_dir());
    let tests_ok = run_counted(&mut cargo, &mut tally)?;

    phases.start("fuzz");
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

/// The board the appliance suite boots.
const APPLIANCE_BOARD: &str = "qemu-x86_64";
/// The trial deadline the never-healthy bundle sets for itself (the appliance suite's
/// `NEVER_HEALTHY_DEADLINE` matches it).
const NEVER_HEALTHY_DEADLINE_SECS: u64 = 300;
/// Set to `0` to leave the appliance suite out (it is then reported as skipped).
const APPLIANCE_ENV: &str = "CHRYSALIS_APPLIANCE_TESTS";

/// Builds (or finds) the appliance image (the repository's security_version N), a second
/// version of it at N + 1, and the bundles, and gathers them in
/// `$CHRYSALIS_CACHE/appliance-test/`: `disk.raw` (the first version), `good.chrysalis-bundle`
/// and `never-healthy.chrysalis-bundle` (the second version), `old.chrysalis-bundle` (the first
/// version, level N: a downgrade once the second is committed). Everything trusts and is
/// signed with this machine's dev keys (asked for explicitly: `--dev-keys`).
fn prepare_appliance() -> Result<std::path::PathBuf> {
    let first = crate::image::build(&crate::image::BuildOptions::dev(APPLIANCE_BOARD))?;
    let next_version = format!("{}-next", first.manifest.version);
    let next = crate::image::build(&crate::image::BuildOptions {
        version: Some(&next_version),
        security_version: Some(first.manifest.security_version + 1),
        ..crate::image::BuildOptions::dev(APPLIANCE_BOARD)
    })?;
    let dir = crate::paths::cache_dir().join("appliance-test");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let disk = dir.join("disk.raw");
    let _ = std::fs::remove_file(&disk);
    std::os::unix::fs::symlink(&first.disk, &disk).with_context(|| format!("linking {}", disk.display()))?;
    // The failing bundle also shortens its own trial deadline through the kernel command line
    // (`chrysalis.set=`, the configuration's last layer), so the revert comes in minutes.
    let failing = format!(
        "chrysalis.fault=never-healthy chrysalis.set=update.health_deadline_secs={NEVER_HEALTHY_DEADLINE_SECS}"
    );
    for (name, image, extra) in
        [("good", &next, None), ("never-healthy", &next, Some(failing.as_str())), ("old", &first, None)]
    {
        crate::bundle::run(&crate::flags::BundleArgs {
            board: APPLIANCE_BOARD.into(),
            image_dir: Some(image.dir.clone()),
            key: None,
            dev_keys: true,
            security_version: None,
            out: Some(dir.join(format!("{name}.chrysalis-bundle"))),
            cmdline_extra: extra.map(str::to_string),
            version: None,
            root: None,
            kernel: None,
            verity_json: None,
            build_id: None,
        })
        .with_context(|| format!("making the {name} bundle"))?;
    }
    // Reset `current` to the first version: `cargo xtask run` and `bundle` default to it.
    let _ = crate::image::build(&crate::image::BuildOptions::dev(APPLIANCE_BOARD))?;
    Ok(dir)
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

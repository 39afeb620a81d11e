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
//! 4. the appliance suite's binary first, then that suite runs beside everything that follows
//!    (it is the longest: boots, reboots, trial deadlines; its output goes to a log printed at
//!    the end); then every other test binary of the workspace with every suite enabled (built
//!    by `cargo test --no-run`, run one after another by [`crate::suites`], each timed): real
//!    QEMU VMs, the public Python SDK (pinned venv), sandboxd with real VMs, the test control
//!    plane (Kubernetes built from its Go modules, cached), the supervisor with the real
//!    services, and the doc tests;
//! 5. a bounded fuzz run of the wire decoder.
//!
//! Tests that cannot run on this machine are `#[ignore = "why"]` and are counted as
//! skipped, never as passed. The run ends with each suite's time, the failed tests by name,
//! `N passed, N failed, N skipped` and the phase times.

use crate::flags::{FuzzArgs, TestArgs, VmImageArgs};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::suites::Tally;

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
        tally.add_line("doc tests", &line);
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

    // The appliance suite is the longest (boots, reboots, trial deadlines): its binary is built
    // first and it runs beside everything that follows.
    phases.start("build the appliance suite (then it runs beside the rest)");
    // The appliance suite drives the box with the `chrysalis` CLI from the target directory:
    // build it before the suite starts (the service binaries follow later, beside it).
    let cli = Command::new("cargo")
        .args(["build", "-p", "chrysalis", "--bin", "chrysalis"])
        .status()
        .context("running cargo build -p chrysalis")?;
    anyhow::ensure!(cli.success(), "building the chrysalis CLI failed");
    let mut cargo_args: Vec<String> = ["--workspace", "--features", TEST_FEATURES].map(String::from).to_vec();
    let mut env: Vec<(String, std::path::PathBuf)> =
        vec![("CHRYSALIS_PYTHON".into(), python.clone()), ("CHRYSALIS_CACHE".into(), crate::paths::cache_dir())];
    // Tests that cannot run here record why (`foundation::testing::skip`); they count as skipped.
    let skip_log = crate::paths::cache_dir().join("test-logs").join("skips.txt");
    if let Some(parent) = skip_log.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    match std::fs::remove_file(&skip_log) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", skip_log.display()))
        }
        _ => {}
    }
    env.push((foundation::testing::SKIP_LOG.into(), skip_log.clone()));
    if let Some(dir) = &appliance {
        cargo_args.extend(["--features", "chrysalis-tests/appliance,xtask/appliance-image"].map(String::from));
        env.push(("CHRYSALIS_APPLIANCE_TEST_DIR".into(), dir.clone()));
    }
    let filter = args.filter.as_deref();
    let mut early = cargo_args.clone();
    early.extend(crate::suites::PARALLEL.iter().flat_map(|t| ["--test".to_string(), t.to_string()]));
    let beside: Vec<_> = crate::suites::build(&early)?
        .into_iter()
        .filter(|s| crate::suites::PARALLEL.contains(&s.target.as_str()))
        .collect();
    let logs = crate::paths::cache_dir().join("test-logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let lane = {
        let (env, logs, filter) = (env.clone(), logs.clone(), filter.map(str::to_string));
        std::thread::spawn(move || {
            beside
                .iter()
                .map(|s| {
                    let log = logs.join(format!("{}.log", s.target));
                    eprintln!("test: {} runs beside the other suites; its output: {}", s.name, log.display());
                    crate::suites::run_logged(s, filter.as_deref(), &env, &log).map(|r| (r, log))
                })
                .collect::<Vec<_>>()
        })
    };

    phases.start("build (service binaries)");
    // The suites in tests/ run these binaries from the target directory they are built into.
    let built = Command::new("cargo")
        .args(["build", "-p", "sandboxd", "-p", "vk-sandbox", "-p", "vk-cocoon", "-p", "chrysalis", "--bins"])
        .status()
        .context("running cargo build")?;
    anyhow::ensure!(built.success(), "building the sandboxd, vk-sandbox and vk-cocoon binaries failed");

    let mut tally = Tally::default();
    phases.start("build the other test binaries");
    let serial: Vec<_> = crate::suites::build(&cargo_args)?
        .into_iter()
        .filter(|s| !crate::suites::PARALLEL.contains(&s.target.as_str()))
        .collect();

    phases.start("the other suites, one after another");
    let mut ran = Vec::new();
    for suite in &serial {
        let (r, t) = crate::suites::run(suite, filter, &env, Stdio::inherit(), &mut |l| println!("{l}"))?;
        ran.push(r);
        tally.merge(t);
    }
    // Doc tests, which `cargo test` would also run.
    let mut doc = Command::new("cargo");
    doc.args(["test", "--doc"]).args(&cargo_args).envs(env.iter().map(|(k, v)| (k, v)));
    if let Some(f) = filter {
        doc.arg(f);
    }
    let doc_ok = run_counted(&mut doc, &mut tally)?;

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

    phases.start("waiting for the appliance suite");
    for outcome in lane.join().map_err(|_| anyhow::anyhow!("the parallel lane panicked"))? {
        let ((r, t), log) = outcome?;
        println!("---- {} (ran beside the others; {}) ----", r.name, log.display());
        print!("{}", std::fs::read_to_string(&log).unwrap_or_default());
        ran.push(r);
        tally.merge(t);
    }
    let tests_ok = doc_ok && ran.iter().all(|r| r.ok);
    crate::suites::print_times(&ran);

    if !tally.failed_tests.is_empty() {
        println!("failed:");
        for name in &tally.failed_tests {
            println!("  {name}");
        }
    }
    let skips = std::fs::read_to_string(&skip_log).unwrap_or_default();
    let skips: Vec<&str> = skips.lines().filter(|l| !l.trim().is_empty()).collect();
    if !skips.is_empty() {
        println!("skipped at run time (counted as skipped, not passed):");
        for s in &skips {
            println!("  {s}");
        }
    }
    tally.count_runtime_skips(skips.len() as u64);
    println!("{} passed, {} failed, {} skipped", tally.passed, tally.failed, tally.skipped);
    if !tests_ok || !fuzz_ok || tally.failed > 0 {
        bail!("the test suite failed");
    }
    Ok(())
}

/// The features that turn every suite on (real QEMU VMs, the SDK, the control plane, the
/// root-only network-namespace and TAP tests of `vmm`).
const TEST_FEATURES: &str = "foundation/testing,chrysalis-tests/e2e,chrysalis-tests/cluster,join/cluster,vnode/cluster,sandboxd/sdk-tests,\
    sandboxd/e2e,silkd/sdk-tests,vmm/qemu-tests,vmm/netns-tests,images/qemu-tests,chrysalis/qemu-tests,vmnet/vm-tests,xtask/image-tests";

/// The board the appliance suite boots.
const APPLIANCE_BOARD: &str = "qemu-x86_64";
/// The trial deadline the never-healthy bundle sets for itself (the appliance suite's
/// `NEVER_HEALTHY_DEADLINE` matches it).
const NEVER_HEALTHY_DEADLINE_SECS: u64 = 150;
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

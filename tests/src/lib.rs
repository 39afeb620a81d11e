//! `test_infra`: what the integration suites, `cargo xtask vm run` and `cargo xtask bench`
//! share to boot a real VM from the built catalog and talk to its agent.

pub mod appliance_vm;
pub mod cluster;
pub mod kubelet_streams;
pub mod netns;
pub mod provider_process;
pub mod sandboxd;
pub mod secrets;
pub mod suite;
pub mod vfat;
pub mod vk_cocoon;
pub mod vk_sandbox;

use anyhow::{Context, Result};
use silkd_client::AgentConn;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm::{AgentStream, BootSpec, Catalog, Driver, SizeClass, Vm, AGENT_PORT};

/// How long a cold boot may take before the agent answers (TCG is slow; KVM is not).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// Logs to stderr once per process (`RUST_LOG` filters; default `info`).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// The built-image catalog (`$CHRYSALIS_CACHE/images/catalog.json`), with a message that
/// says how to build it when it is missing.
pub fn catalog() -> Result<Catalog> {
    Catalog::load_default().context("no built guest images: run `cargo xtask vm-image --all` first")
}

/// The QEMU driver keeping its VM state under `state_dir`.
pub fn qemu(state_dir: &Path) -> Result<Arc<dyn Driver>> {
    let mut cfg = vmm::qemu::QemuConfig::from_env();
    cfg.state_dir = state_dir.to_path_buf();
    Ok(Arc::new(vmm::qemu::QemuDriver::new(cfg)))
}

/// A booted VM and how long it took until its agent answered.
pub struct Booted {
    pub vm: Vm,
    pub ready_after: Duration,
}

/// Boots `template` at `size` and waits for its agent.
pub async fn boot(driver: &Arc<dyn Driver>, catalog: &Catalog, template: &str, size: SizeClass) -> Result<Booted> {
    let spec = BootSpec::from_template(catalog, template, size)?;
    let started = Instant::now();
    let vm = driver.boot(&spec).await.with_context(|| format!("booting {template}"))?;
    if let Err(e) = driver.wait_agent(&vm, BOOT_TIMEOUT).await {
        let console = vmm::console::tail_text(&vm.console_log, 40);
        let _ = driver.kill(&vm).await;
        return Err(
            anyhow::Error::new(e).context(format!("agent of {template} never answered; console tail:\n{console}"))
        );
    }
    Ok(Booted { vm, ready_after: started.elapsed() })
}

/// A fresh agent connection to `vm` (hybrid vsock `CONNECT 2048`).
pub async fn agent(driver: &Arc<dyn Driver>, vm: &Vm) -> Result<AgentConn<AgentStream>> {
    let stream = driver.connect(vm, AGENT_PORT).await.context("connecting to the agent")?;
    Ok(AgentConn::new(stream))
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `(Rss, Pss)` of a process in KiB, from `/proc/<pid>/smaps_rollup` (`None` once it is gone).
pub fn rss_pss_kib(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
    };
    Some((field("Rss:")?, field("Pss:")?))
}

/// Pids of live `qemu-system*` processes with an argument naming `dir` or a path under it
/// (for leak checks). A zombie has an empty command line and is never counted.
pub fn qemu_processes_under(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let argv: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let is_qemu = argv
                .first()
                .and_then(|a| Path::new(a).file_name())
                .is_some_and(|n| n.to_string_lossy().starts_with("qemu-system"));
            is_qemu && argv.iter().any(|a| a.contains(&needle))
        })
        .collect()
}

/// Checks from the host that `vm`'s QEMU runs jailed (`vmm::jail`): as the VM user (all four
/// uids), with no capabilities (`CapEff`, `CapPrm`, `CapBnd` 0), seccomp filtering
/// (`Seccomp: 2`), `NoNewPrivs: 1`, and in a cgroup leaf named after the VM with the limits of
/// its size class. Where the jail is off (`CHRYSALIS_JAIL=0`, not root) only the seccomp
/// sandbox is checked, and that is said on stderr.
pub fn assert_jailed(vm: &Vm) -> Result<()> {
    let j =
        vmm::jail::inspect::process_jail(vm.pid).with_context(|| format!("vm {}: pid {} is gone", vm.id, vm.pid))?;
    anyhow::ensure!(j.seccomp == 2, "vm {}: QEMU's seccomp sandbox is off: {j:?}", vm.id);
    let Some(jail) = vmm::jail::JailSettings::from_env().resolve()? else {
        eprintln!("vm {}: the jail is off here (CHRYSALIS_JAIL=0 or not root): only seccomp checked", vm.id);
        return Ok(());
    };
    anyhow::ensure!(
        j.uids == [jail.uid; 4],
        "vm {}: QEMU runs as {:?}, not {} ({})",
        vm.id,
        j.uids,
        jail.user,
        jail.uid
    );
    anyhow::ensure!((j.cap_eff, j.cap_prm, j.cap_bnd) == (0, 0, 0), "vm {}: QEMU holds capabilities: {j:?}", vm.id);
    anyhow::ensure!(j.no_new_privs, "vm {}: NoNewPrivs is 0", vm.id);
    let want = vmm::jail::Limits::for_vm(vm.spec.size, vm.accel);
    anyhow::ensure!(
        j.limits == Some(want),
        "vm {}: cgroup limits {:?} in {:?}, want {want:?}",
        vm.id,
        j.limits,
        j.cgroups
    );
    anyhow::ensure!(
        !j.cgroups.is_empty() && j.cgroups.iter().all(|d| d.ends_with(vm.id.as_str())),
        "vm {}: not in its own cgroup leaf: {:?}",
        vm.id,
        j.cgroups
    );
    Ok(())
}

/// A scratch state directory for one test's VMs.
pub fn state_dir() -> Result<tempfile::TempDir> {
    let base = PathBuf::from(std::env::var_os("CHRYSALIS_TEST_STATE").unwrap_or_else(|| "/tmp".into()));
    std::fs::create_dir_all(&base)?;
    Ok(tempfile::Builder::new().prefix("chrysalis-test-").tempdir_in(base)?)
}

//! The QEMU appliance machine: boots a built host image (`cargo xtask image`) the way a UEFI
//! server would, for the end-to-end tests and `cargo xtask run`.
//!
//! `qemu-system-x86_64 -M q35` with OVMF (Debian `ovmf`: the code read-only, a per-VM copy of the
//! vars), the disk as a qcow2 overlay on the built `disk.raw` (the image itself is never written),
//! an optional config disk (vfat labelled `CHRYSALIS`, built rootless with `mkfs.vfat -C` +
//! `mcopy`), an `i6300esb` watchdog, a virtio RNG, the serial console in a file, and user
//! networking with `restrict=on` (nothing leaves the host): sandboxd (7777) and the supervisor
//! API (7780) forwarded to free loopback ports, and optionally the guest address
//! `10.0.2.100:<port>` forwarded to a host loopback port (a test API server) through `socat`.
//!
//! The accelerator follows `vmm::accel` (KVM only when usable, PVM-only KVM → TCG,
//! `CHRYSALIS_ACCEL` overrides). Under TCG the CPU model hides VMX/SVM, so the appliance's own
//! microVMs run under nested TCG too. Guest reboots keep the machine running (no `-no-reboot`);
//! [`ApplianceVm::kill`] is a power cut; dropping the value kills QEMU.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vmm::Accel;

/// OVMF firmware (Debian `ovmf`, 4 MiB flash layout).
pub const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
pub const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
/// sandboxd's port in the appliance.
pub const GUEST_SANDBOXD_PORT: u16 = 7777;
/// The supervisor API's port in the appliance.
pub const GUEST_API_PORT: u16 = 7780;
/// The guest-side address of the forwarded host API server.
pub const GUEST_FORWARD_ADDR: &str = "10.0.2.100";
/// What the supervisor logs (to the journal, forwarded to the console on this board) before the
/// fingerprint of each certificate it serves: the out-of-band channel a host pins it from.
pub const FINGERPRINT_LINE: &str = "TLS certificate SHA-256 fingerprint ";

/// The fingerprint following [`FINGERPRINT_LINE`] in `line` (`AB:CD:…`, 32 hex pairs).
pub fn fingerprint_in(line: &str) -> Option<String> {
    let at = line.find(FINGERPRINT_LINE)? + FINGERPRINT_LINE.len();
    let fp: String = line[at..].chars().take(95).collect();
    let ok = fp.len() == 95
        && fp.split(':').count() == 32
        && fp.split(':').all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()));
    ok.then_some(fp)
}

/// How to start the machine.
#[derive(Debug, Clone)]
pub struct Options {
    /// The built raw disk (`$CHRYSALIS_CACHE/appliance/<board>/current/disk.raw`).
    pub disk: PathBuf,
    /// Where the overlay, the firmware vars, the config disk and the console log go.
    pub work_dir: PathBuf,
    /// Reuse `work_dir`'s overlay and firmware vars when present (a second boot of the same box).
    pub keep_disk: bool,
    pub memory_mib: u32,
    pub cpus: u32,
    /// Files of the config disk (path inside the vfat → content); `None` = no config disk.
    pub config_files: Option<BTreeMap<String, Vec<u8>>>,
    /// Host loopback port for sandboxd; `None` picks a free one.
    pub sandboxd_port: Option<u16>,
    /// Host loopback port for the supervisor API; `None` picks a free one.
    pub api_port: Option<u16>,
    /// A host loopback port the guest reaches as `10.0.2.100:<same port>`.
    pub guest_forward_port: Option<u16>,
    /// Extra QEMU arguments.
    pub extra_args: Vec<String>,
}

impl Options {
    /// 4 GiB, 2 vCPUs, no config disk, free ports.
    pub fn new(disk: impl Into<PathBuf>, work_dir: impl Into<PathBuf>) -> Options {
        Options {
            disk: disk.into(),
            work_dir: work_dir.into(),
            keep_disk: false,
            memory_mib: 4096,
            cpus: 2,
            config_files: None,
            sandboxd_port: None,
            api_port: None,
            guest_forward_port: None,
            extra_args: Vec::new(),
        }
    }
}

/// A running appliance machine.
pub struct ApplianceVm {
    child: Option<Child>,
    args: Vec<String>,
    /// The serial console log.
    pub console: PathBuf,
    /// The QMP socket.
    pub qmp: PathBuf,
    /// Host ports on 127.0.0.1.
    pub sandboxd_port: u16,
    pub api_port: u16,
    /// The accelerator QEMU runs with.
    pub accel: Accel,
    /// Console offset `wait_for_console` searches from.
    mark: u64,
}

impl ApplianceVm {
    /// Prepares the work directory and starts QEMU.
    pub fn start(opts: &Options) -> Result<ApplianceVm> {
        for tool in ["qemu-system-x86_64", "qemu-img"] {
            if !on_path(tool) {
                bail!("{tool} is not installed (cargo xtask prereqs)");
            }
        }
        for fw in [OVMF_CODE, OVMF_VARS] {
            if !Path::new(fw).is_file() {
                bail!("{fw} is missing: install Debian's `ovmf` (cargo xtask prereqs)");
            }
        }
        if !opts.disk.is_file() {
            bail!("no disk image {} (cargo xtask image)", opts.disk.display());
        }
        fs::create_dir_all(&opts.work_dir).with_context(|| format!("creating {}", opts.work_dir.display()))?;
        let w = &opts.work_dir;
        let overlay = w.join("disk.qcow2");
        let vars = w.join("OVMF_VARS.fd");
        if !(opts.keep_disk && overlay.is_file()) {
            let _ = fs::remove_file(&overlay);
            let out = Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
                .arg(fs::canonicalize(&opts.disk)?)
                .arg(&overlay)
                .output()
                .context("running qemu-img create")?;
            if !out.status.success() {
                bail!("qemu-img create failed: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        if !(opts.keep_disk && vars.is_file()) {
            fs::copy(OVMF_VARS, &vars).context("copying the OVMF vars")?;
        }
        let config_disk = match &opts.config_files {
            Some(files) => {
                let img = w.join("config.img");
                make_config_disk(&img, files, w)?;
                Some(img)
            }
            None => None,
        };
        let console = w.join("console.log");
        let qmp = w.join("qmp.sock");
        let _ = fs::remove_file(&console);
        let _ = fs::remove_file(&qmp);
        let sandboxd_port = match opts.sandboxd_port {
            Some(p) => p,
            None => free_port()?,
        };
        let api_port = match opts.api_port {
            Some(p) => p,
            None => free_port()?,
        };
        let accel = vmm::accel::probe();

        let mut net = format!(
            "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:{sandboxd_port}-:{GUEST_SANDBOXD_PORT},\
             hostfwd=tcp:127.0.0.1:{api_port}-:{GUEST_API_PORT}"
        );
        if let Some(port) = opts.guest_forward_port {
            let relay = if on_path("socat") {
                format!("socat - TCP:127.0.0.1:{port}")
            } else if on_path("nc") {
                format!("nc 127.0.0.1 {port}")
            } else {
                bail!("guest_forward_port needs socat or nc (cargo xtask prereqs)");
            };
            net.push_str(&format!(",guestfwd=tcp:{GUEST_FORWARD_ADDR}:{port}-cmd:{relay}"));
        }
        let mut args: Vec<String> = Vec::new();
        let mut push = |xs: &[&str]| args.extend(xs.iter().map(|s| s.to_string()));
        push(&["-name", "chrysalis-appliance", "-M", "q35"]);
        match accel {
            Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
            // No VMX/SVM: the appliance's own microVMs must take TCG, not a half-emulated KVM.
            Accel::Tcg => push(&["-accel", "tcg", "-cpu", "max,-vmx,-svm"]),
        }
        push(&["-m", &opts.memory_mib.to_string(), "-smp", &opts.cpus.to_string()]);
        push(&["-nodefaults", "-no-user-config", "-display", "none"]);
        push(&["-drive", &format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}")]);
        push(&["-drive", &format!("if=pflash,format=raw,unit=1,file={}", vars.display())]);
        push(&["-drive", &format!("if=virtio,format=qcow2,file={}", overlay.display())]);
        if let Some(img) = &config_disk {
            push(&["-drive", &format!("if=virtio,format=raw,readonly=on,file={}", img.display())]);
        }
        push(&["-device", "i6300esb", "-action", "watchdog=reset"]);
        push(&["-device", "virtio-rng-pci"]);
        push(&["-netdev", &net, "-device", "virtio-net-pci,netdev=net0"]);
        push(&["-serial", &format!("file:{}", console.display())]);
        push(&["-qmp", &format!("unix:{},server=on,wait=off", qmp.display())]);
        args.extend(opts.extra_args.iter().cloned());

        let mut vm = ApplianceVm { child: None, args, console, qmp, sandboxd_port, api_port, accel, mark: 0 };
        vm.spawn()?;
        Ok(vm)
    }

    fn spawn(&mut self) -> Result<()> {
        let log = fs::File::create(self.console.with_file_name("qemu.log"))?;
        let child = Command::new("qemu-system-x86_64")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting qemu-system-x86_64")?;
        self.child = Some(child);
        self.mark = 0;
        Ok(())
    }

    /// The full QEMU command line (for humans).
    pub fn command_line(&self) -> String {
        format!("qemu-system-x86_64 {}", self.args.join(" "))
    }

    /// QEMU's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether QEMU still runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Power cut: SIGKILL to QEMU (the disk keeps whatever reached it).
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            c.wait().context("reaping QEMU")?;
        }
        Ok(())
    }

    /// Power cut, then power on again with the same disk and firmware vars.
    pub fn power_cycle(&mut self) -> Result<()> {
        self.kill()?;
        let _ = fs::remove_file(&self.qmp);
        self.spawn()
    }

    /// Waits for QEMU to exit by itself (e.g. after Ctrl-C); returns its status.
    pub fn wait(&mut self) -> Result<std::process::ExitStatus> {
        let mut c = self.child.take().context("QEMU is not running")?;
        Ok(c.wait()?)
    }

    /// The console so far (lossy UTF-8).
    pub fn console_text(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.console).unwrap_or_default()).into_owned()
    }

    /// From now on, [`Self::wait_for_console`] only looks at output written after this call
    /// (e.g. to wait for the second boot after a reboot).
    pub fn mark_console(&mut self) {
        self.mark = fs::metadata(&self.console).map(|m| m.len()).unwrap_or(0);
    }

    /// Waits until the console (after the mark) contains `pattern`; returns that line.
    /// Fails early when QEMU exits, and with the console's tail on timeout.
    pub fn wait_for_console(&mut self, pattern: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let bytes = fs::read(&self.console).unwrap_or_default();
            let from = (self.mark as usize).min(bytes.len());
            let text = String::from_utf8_lossy(&bytes[from..]);
            if let Some(line) = text.lines().find(|l| l.contains(pattern)) {
                return Ok(line.to_string());
            }
            if !self.is_running() {
                bail!("QEMU exited while waiting for {pattern:?}; console tail:\n{}", crate::tail(&text, 40));
            }
            if Instant::now() >= deadline {
                bail!(
                    "no {pattern:?} on the console within {}s ({}); console tail:\n{}",
                    timeout.as_secs(),
                    self.console.display(),
                    crate::tail(&text, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl ApplianceVm {
    /// Waits for the supervisor to print its certificate's fingerprint on the console (after the
    /// mark: call [`Self::mark_console`] first to wait for the next boot's).
    pub fn wait_for_fingerprint(&mut self, timeout: Duration) -> Result<String> {
        let line = self.wait_for_console(FINGERPRINT_LINE, timeout)?;
        fingerprint_in(&line).with_context(|| format!("no fingerprint in the console line {line:?}"))
    }

    /// A clean power-off: ACPI power button through QMP (systemd stops the services and
    /// unmounts), then waits for QEMU to exit; a machine still up after `timeout` is killed.
    pub fn power_off(&mut self, timeout: Duration) -> Result<()> {
        use std::io::{BufRead as _, BufReader};
        use std::os::unix::net::UnixStream;
        let sent = (|| -> std::io::Result<()> {
            let s = UnixStream::connect(&self.qmp)?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut r = BufReader::new(s.try_clone()?);
            let mut w = s;
            let mut line = String::new();
            r.read_line(&mut line)?; // greeting
            w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n")?;
            line.clear();
            r.read_line(&mut line)?;
            w.write_all(b"{\"execute\":\"system_powerdown\"}\n")?;
            line.clear();
            r.read_line(&mut line)?;
            Ok(())
        })();
        if let Err(e) = sent {
            eprintln!("appliance_vm: ACPI power-off through QMP failed ({e}); cutting the power");
            return self.kill();
        }
        let deadline = Instant::now() + timeout;
        while self.is_running() {
            if Instant::now() >= deadline {
                eprintln!("appliance_vm: still up {}s after the power button; cutting the power", timeout.as_secs());
                return self.kill();
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        self.child = None;
        Ok(())
    }

    /// The machine's disk (the qcow2 overlay on the built image).
    pub fn disk(&self) -> PathBuf {
        self.console.with_file_name("disk.qcow2")
    }
}

impl Drop for ApplianceVm {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// What a box joined to a test cluster is told on its config disk (the appliance suite and
/// `cargo xtask bench appliance` boot such boxes).
#[derive(Debug, Clone)]
pub struct JoinedBox<'a> {
    /// The API server as the box reaches it (`https://10.0.2.100:<port>`).
    pub endpoint: String,
    /// `sha256:<hex>` of the cluster CA's public key.
    pub ca_hash: &'a str,
    /// The bootstrap token.
    pub bootstrap_token: &'a str,
    /// The two virtual nodes' names.
    pub sandbox_node: &'a str,
    pub cocoon_node: &'a str,
    /// The bearer token of the supervisor's remote API (on [`GUEST_API_PORT`]).
    pub api_token: &'a str,
    /// The trial boot's health deadline.
    pub health_deadline_secs: u64,
}

impl JoinedBox<'_> {
    /// Binds what each of the box's two nodes needs to that node's user alone (as an admin does
    /// per box before it joins a real cluster).
    pub fn bind_nodes(&self, cluster: &crate::cluster::Cluster) -> Result<(), crate::cluster::ClusterError> {
        cluster.bind_node("vk-sandbox", self.sandbox_node)?;
        cluster.bind_node("vk-cocoon", self.cocoon_node)?;
        Ok(())
    }

    /// The config disk's files: the cluster, the node names, one warm `base` VM (under TCG the
    /// box's microVMs run under nested emulation), the remote API and the trial deadline. The
    /// pool is named `base`, as in the baked default; the seed's Sandbox asks for
    /// `ghcr.io/cocoonstack/sandbox/rt:24.04`, which this board's catalog aliases to `base`, so
    /// its claim is served from this pool (issue #16: an alias claims from its target's pool).
    pub fn config_files(&self) -> BTreeMap<String, Vec<u8>> {
        let toml = format!(
            r#"[supervisor]
api_listen = "0.0.0.0:{GUEST_API_PORT}"
api_token_file = "api-token"

[sandboxd]
refill_concurrency = 1
boot_timeout_secs = 900

[[sandboxd.pools]]
template = "base"
size = "small"
net = "none"
warm = 1

[cluster]
endpoint = "{endpoint}"
ca_cert_hashes = ["{ca_hash}"]
bootstrap_token_file = "bootstrap-token"

[vk_sandbox]
node_name = "{sandbox_node}"

[vk_cocoon]
node_name = "{cocoon_node}"

[update]
health_deadline_secs = {deadline}
"#,
            endpoint = self.endpoint,
            ca_hash = self.ca_hash,
            sandbox_node = self.sandbox_node,
            cocoon_node = self.cocoon_node,
            deadline = self.health_deadline_secs,
        );
        BTreeMap::from([
            ("config.toml".to_string(), toml.into_bytes()),
            ("api-token".to_string(), format!("{}\n", self.api_token).into_bytes()),
            ("bootstrap-token".to_string(), format!("{}\n", self.bootstrap_token).into_bytes()),
        ])
    }
}

/// Builds a vfat image labelled `CHRYSALIS` holding `files`, rootless (`mkfs.vfat -C`, mtools).
pub fn make_config_disk(img: &Path, files: &BTreeMap<String, Vec<u8>>, work: &Path) -> Result<()> {
    for tool in ["mkfs.vfat", "mcopy", "mmd"] {
        if !on_path(tool) {
            bail!("{tool} is not installed (dosfstools, mtools: cargo xtask prereqs)");
        }
    }
    let _ = fs::remove_file(img);
    run(Command::new("mkfs.vfat").args(["-n", "CHRYSALIS", "-C"]).arg(img).arg("16384"), "mkfs.vfat")?;
    let staging = work.join("config-staging");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging)?;
    let mut copies = Vec::new();
    for (i, (name, content)) in files.iter().enumerate() {
        let src = staging.join(i.to_string());
        fs::File::create(&src)?.write_all(content)?;
        copies.push((name.clone(), src));
    }
    crate::vfat::fill(img, &copies, None)?;
    let _ = fs::remove_dir_all(&staging);
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(l.local_addr()?.port())
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        || ["/usr/sbin", "/sbin"].iter().any(|d| Path::new(d).join(tool).is_file())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("{what}: running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_read_off_console_lines() {
        let fp = ["AB"; 32].join(":");
        let json = format!(
            "[   12.3] chrysalis[301]: {{\"level\":\"INFO\",\"message\":\"{FINGERPRINT_LINE}{fp}\",\"minted\":true}}"
        );
        assert_eq!(fingerprint_in(&json), Some(fp.clone()));
        assert_eq!(fingerprint_in(&format!("{FINGERPRINT_LINE}{}", &fp[..40])), None);
        assert_eq!(fingerprint_in("nothing here"), None);
    }

    #[test]
    fn config_disk_holds_the_files_under_the_label() {
        assert!(
            on_path("mkfs.vfat") && on_path("mcopy"),
            "needs dosfstools and mtools (cargo xtask prereqs installs them)"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("config.img");
        let mut files = BTreeMap::new();
        files.insert("config.toml".to_string(), b"[sandboxd]\nenabled = true\n".to_vec());
        files.insert("secrets/token".to_string(), b"t0k3n\n".to_vec());
        make_config_disk(&img, &files, dir.path()).expect("config disk");
        let out = Command::new("mtype").arg("-i").arg(&img).arg("::/secrets/token").output().expect("mtype");
        assert_eq!(out.stdout, b"t0k3n\n");
        let label = Command::new("mlabel").arg("-s").arg("-i").arg(&img).arg("::").output().expect("mlabel");
        assert!(String::from_utf8_lossy(&label.stdout).contains("CHRYSALIS"), "{:?}", label);
        assert!(make_config_disk(&img, &BTreeMap::from([("../x".to_string(), vec![])]), dir.path()).is_err());
    }
}

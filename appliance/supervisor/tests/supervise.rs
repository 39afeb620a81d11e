//! The real supervisor (`supervisor::run` in its own process) with fake services.
//!
//! This file is its own harness (`harness = false`): the binary plays three roles, chosen by
//! how it is started:
//! * as the test runner (no special arguments): runs every scenario below in sequence;
//! * as the supervisor (`--supervisor <dir>`): `supervisor::run` with options from `<dir>`;
//! * as a fake service, through symlinks `sandboxd`, `vk-sandbox`, `vk-cocoon` → this binary in
//!   the scenario's bin dir. Each fake reads `<ctl>/<svc>.mode` (words: `serve`, `crash`,
//!   `orphan`, `vm`, `ignore-term`), appends `<ms> <pid>` to `<ctl>/<svc>.starts`, prints a
//!   line on stdout and one on stderr, and records whether it inherited `NOTIFY_SOCKET`.
//!
//! Scenarios: restart with backoff + crash isolation; `kill -9` of a child; reaping of a
//! re-parented grandchild; graceful shutdown that leaves a daemonized "VM" alive and SIGKILLs
//! a child ignoring SIGTERM; sd-notify READY/STATUS/WATCHDOG; API status, logs and metrics
//! over the Unix socket; a configuration error naming its key; the reboot path; and the real
//! sandboxd (READY once it answers `/healthz`; no VMs).

use std::io::{BufRead as _, Write as _};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use supervisor::client::Client;
use supervisor::http::Endpoint;

const HASH: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let argv0 = Path::new(&args[0]).file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    match (argv0.as_str(), args.get(1).map(String::as_str)) {
        ("sandboxd" | "vk-sandbox" | "vk-cocoon", _) => fake_service(&argv0, &args[1..]),
        (_, Some("--supervisor")) => supervisor_main(Path::new(&args[2])),
        (_, Some("--spawn")) => spawn_grandchild(&args[2], Path::new(&args[3])),
        (_, Some("--grandchild")) => grandchild(&args[2]),
        _ => runner(&args[1..]),
    }
}

// ------------------------------------------------------------------------------ fake roles

fn fake_service(name: &str, args: &[String]) {
    let ctl = PathBuf::from(std::env::var("FAKE_CTL").expect("FAKE_CTL"));
    let mode = std::fs::read_to_string(ctl.join(format!("{name}.mode"))).unwrap_or_default();
    let has = |w: &str| mode.split_whitespace().any(|m| m == w);
    let mut f =
        std::fs::OpenOptions::new().create(true).append(true).open(ctl.join(format!("{name}.starts"))).expect("starts");
    writeln!(f, "{} {}", now_ms(), std::process::id()).expect("write starts");
    std::fs::write(
        ctl.join(format!("{name}.env")),
        format!("NOTIFY_SOCKET={:?}\nargs={args:?}\n", std::env::var("NOTIFY_SOCKET").ok()),
    )
    .expect("env");
    println!("hello from {name} on stdout");
    eprintln!("hello from {name} on stderr");
    if has("ignore-term") {
        // SAFETY: setting a signal to SIG_IGN installs no handler code.
        unsafe { nix::sys::signal::signal(Signal::SIGTERM, nix::sys::signal::SigHandler::SigIgn) }
            .expect("ignore SIGTERM");
    }
    if has("crash") {
        std::thread::sleep(Duration::from_millis(100));
        eprintln!("{name} crashing");
        std::process::exit(3);
    }
    for (word, pidfile) in [("orphan", "orphan.pid"), ("vm", "vm.pid")] {
        if has(word) && !ctl.join(pidfile).exists() {
            let exe = std::env::current_exe().expect("exe");
            let st = Command::new(exe).args(["--spawn", word]).arg(ctl.join(pidfile)).status().expect("spawn helper");
            assert!(st.success());
        }
    }
    if has("serve") {
        let cfg_path = args.windows(2).find(|w| w[0] == "--config").map(|w| w[1].clone()).expect("--config");
        let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(cfg_path).expect("config")).expect("json");
        let listener = std::net::TcpListener::bind(cfg["listen"].as_str().expect("listen")).expect("bind");
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let mut line = String::new();
            let _ = std::io::BufReader::new(&s).read_line(&mut line);
            let body = if line.contains("/v1/info") {
                r#"{"pools":[{"key":{"template":"base","net":"none","size":"small"},"warm":1,"refilling":0,"target":1,"golden":false}],"claimed":0}"#
            } else {
                "ok"
            };
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The intermediate process: starts the grandchild (a "VM" in its own session, or a plain
/// short-lived orphan), records its pid, and exits so the grandchild is re-parented.
fn spawn_grandchild(kind: &str, pidfile: &Path) {
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().expect("exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--grandchild", kind]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    if kind == "vm" {
        // Like QEMU -daemonize: a new session (and process group) of its own.
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(std::io::Error::from));
        }
    }
    #[allow(clippy::zombie_processes)] // deliberately orphaned: the supervisor under test reaps it
    let child = cmd.spawn().expect("spawn grandchild");
    std::fs::write(pidfile, child.id().to_string()).expect("pidfile");
}

fn grandchild(kind: &str) {
    let life = if kind == "vm" { 600 } else { 2 };
    std::thread::sleep(Duration::from_secs(life));
}

fn supervisor_main(dir: &Path) {
    std::env::set_var("CHRYSALIS_LOG_FORMAT", "json");
    supervisor::init_logging();
    let mut o = supervisor::RunOptions::new(Arc::new(supervisor::NoUpdates));
    o.sources = supervisor::config::SourcePaths {
        baked: dir.join("config.toml"),
        esp: dir.join("esp.toml"),
        config_disk: dir.join("disk.toml"),
        cmdline: Some(dir.join("cmdline")),
    };
    o.state_dir = Some(dir.join("state"));
    o.api_socket = Some(dir.join("api.sock"));
    o.run_dir = dir.join("run");
    o.bin_dir = dir.join("bin");
    o.catalog = dir.join("catalog.json");
    o.hostname = Some("testbox".into());
    o.shutdown_timeout = Duration::from_secs(2);
    o.health_interval = Duration::from_secs(1);
    o.reboot_command =
        Some(vec!["sh".into(), "-c".into(), format!("echo rebooted > {}", dir.join("rebooted").display())]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    match rt.block_on(supervisor::run(o)) {
        Ok(exit) => {
            std::fs::write(dir.join("exit"), format!("{exit:?}")).expect("exit file");
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("supervisor: {}", supervisor::error_chain(&e));
            std::process::exit(1)
        }
    }
}

// --------------------------------------------------------------------------------- harness

/// One scenario's world: a temp dir, the supervisor process, the notify socket.
struct Rig {
    dir: tempfile::TempDir,
    sup: Option<Child>,
    notify: Arc<Mutex<Vec<(Instant, String)>>>,
    rt: tokio::runtime::Runtime,
    /// Extra environment of the supervisor (test hooks).
    env: Vec<(&'static str, String)>,
}

impl Rig {
    fn new(config: &str, modes: &[(&str, &str)]) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let exe = std::env::current_exe().expect("exe");
        std::fs::create_dir_all(d.join("bin")).expect("bin");
        std::fs::create_dir_all(d.join("ctl")).expect("ctl");
        for svc in ["sandboxd", "vk-sandbox", "vk-cocoon"] {
            std::os::unix::fs::symlink(&exe, d.join("bin").join(svc)).expect("symlink");
        }
        for (svc, mode) in modes {
            std::fs::write(d.join("ctl").join(format!("{svc}.mode")), mode).expect("mode");
        }
        std::fs::write(d.join("bootstrap-token"), "abcdef.0123456789abcdef\n").expect("token");
        std::fs::write(d.join("config.toml"), config).expect("config");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        Rig { dir, sup: None, notify: Arc::new(Mutex::new(Vec::new())), rt, env: Vec::new() }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn start(&mut self) {
        let d = self.dir.path().to_path_buf();
        let sock = UnixDatagram::bind(d.join("notify.sock")).expect("notify socket");
        sock.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        let log = self.notify.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match sock.recv(&mut buf) {
                    Ok(n) => log
                        .lock()
                        .expect("lock")
                        .push((Instant::now(), String::from_utf8_lossy(&buf[..n]).into_owned())),
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut =>
                    {
                        if !d.exists() {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
        });
        let stderr = std::fs::File::create(self.path("supervisor.log")).expect("log");
        let child = Command::new(std::env::current_exe().expect("exe"))
            .arg("--supervisor")
            .arg(self.dir.path())
            .env("FAKE_CTL", self.path("ctl"))
            .env("NOTIFY_SOCKET", self.path("notify.sock"))
            .env("WATCHDOG_USEC", "1000000")
            .env_remove("WATCHDOG_PID")
            .env("RUST_LOG", "info")
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn supervisor");
        self.sup = Some(child);
    }

    fn pid(&self) -> i32 {
        self.sup.as_ref().map(|c| c.id() as i32).expect("started")
    }

    fn client(&self) -> Client {
        Client::new(Endpoint::Unix(self.path("api.sock")), None)
    }

    fn status(&self) -> Option<supervisor::state::Status> {
        self.rt.block_on(self.client().status()).ok()
    }

    fn starts(&self, svc: &str) -> Vec<(u64, i32)> {
        std::fs::read_to_string(self.path(&format!("ctl/{svc}.starts")))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
            })
            .collect()
    }

    fn notes(&self) -> Vec<String> {
        self.notify.lock().expect("lock").iter().map(|(_, m)| m.clone()).collect()
    }

    fn sup_log(&self) -> String {
        std::fs::read_to_string(self.path("supervisor.log")).unwrap_or_default()
    }

    /// SIGTERM and wait (bounded); returns the exit status.
    fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.sup.take().expect("running");
        let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(s) = c.try_wait().expect("wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "the supervisor did not stop in 15 s:\n{}", self.sup_log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.sup_log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
            println!("--- supervisor log (last 40 lines) ---\n{}\n---", tail.join("\n"));
        }
        // Failure cleanup: the supervisor, its services' groups, and any grandchildren we made.
        if let Some(mut c) = self.sup.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Ok(rd) = std::fs::read_dir(self.path("run/services")) {
            for e in rd.flatten() {
                if let Some(pid) =
                    std::fs::read_to_string(e.path()).ok().and_then(|t| t.split_whitespace().next()?.parse().ok())
                {
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
        for f in ["ctl/vm.pid", "ctl/orphan.pid"] {
            if let Some(pid) = std::fs::read_to_string(self.path(f)).ok().and_then(|t| t.trim().parse().ok()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn alive(pid: i32) -> bool {
    matches!(supervisor::supervise::proc_stat(pid), Some((s, _)) if s != 'Z')
}

fn ppid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
}

/// Zombies whose parent is `parent`.
fn zombies_of(parent: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if ppid(pid) == Some(parent) && matches!(supervisor::supervise::proc_stat(pid), Some(('Z', _))) {
            out.push(pid);
        }
    }
    out
}

fn cluster_config(extra: &str) -> String {
    format!(
        "[sandboxd]\nlisten = \"127.0.0.1:{port}\"\n[cluster]\nendpoint = \"https://127.0.0.1:9\"\n\
         ca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"bootstrap-token\"\n{extra}",
        port = free_port()
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port")
}

// ------------------------------------------------------------------------------- scenarios

/// vk-sandbox crashes 100 ms after every start: restarts come 1 s, 2 s, 4 s apart while
/// sandboxd and vk-cocoon keep their pids; READY waits for every service to run.
fn restart_backoff_and_crash_isolation() {
    let mut r = Rig::new(&cluster_config(""), &[("sandboxd", "serve"), ("vk-sandbox", "crash"), ("vk-cocoon", "")]);
    r.start();
    wait_until("four vk-sandbox starts", Duration::from_secs(20), || r.starts("vk-sandbox").len() >= 4);
    let s = r.starts("vk-sandbox");
    let gaps: Vec<f64> = s.windows(2).map(|w| (w[1].0 - w[0].0) as f64 / 1000.0).collect();
    // Each gap = 0.1 s of life + the delay (+ ≤ 0.25 s tick + spawn time).
    for (i, (gap, delay)) in gaps.iter().zip([1.0, 2.0, 4.0]).enumerate() {
        assert!(*gap >= delay && *gap < delay + 1.5, "gap {i} is {gap:.2}s, want {delay}s backoff (gaps {gaps:?})");
    }
    assert_eq!(r.starts("sandboxd").len(), 1, "sandboxd was not disturbed");
    assert_eq!(r.starts("vk-cocoon").len(), 1, "vk-cocoon was not disturbed");
    let st = r.status().expect("status");
    let vs = st.health.services.iter().find(|s| s.name == "vk-sandbox").expect("vk-sandbox");
    assert!(vs.restarts >= 3, "{vs:?}");
    assert_eq!(vs.last_exit.as_ref().and_then(|e| e.code), Some(3), "{vs:?}");
    assert!(!st.health.ready, "not ready while a service is down");
    assert!(!r.notes().iter().any(|n| n.contains("READY=1")), "no READY while vk-sandbox crash-loops: {:?}", r.notes());
    let metrics = r.rt.block_on(r.client().metrics()).expect("metrics");
    assert!(metrics.contains("chrysalis_service_restarts_total{service=\"vk-sandbox\"}"), "{metrics}");
    assert!(metrics.contains("chrysalis_service_last_exit_code{service=\"vk-sandbox\"} 3.0"), "{metrics}");
    let logs = r.rt.block_on(r.client().logs("vk-sandbox", 50)).expect("logs");
    assert!(
        logs.iter().any(|l| l.line.contains("exited with status 3") && l.line.contains("restarting in 2s")),
        "{logs:?}"
    );
    assert!(r.stop().success());
}

/// `kill -9` of sandboxd: a new process within ~1.5 s, the others untouched, READY kept.
fn kill_9_is_recovered() {
    let mut r = Rig::new(&cluster_config(""), &[("sandboxd", "serve"), ("vk-sandbox", ""), ("vk-cocoon", "")]);
    r.start();
    wait_until("ready", Duration::from_secs(20), || r.status().is_some_and(|s| s.health.ready));
    for svc in ["sandboxd", "vk-sandbox", "vk-cocoon"] {
        let before = r.starts(svc);
        let (_, pid) = *before.last().expect("started");
        kill(Pid::from_raw(pid), Signal::SIGKILL).expect("kill -9");
        let t = Instant::now();
        wait_until(&format!("{svc} restarted"), Duration::from_secs(5), || r.starts(svc).len() == before.len() + 1);
        assert!(t.elapsed() < Duration::from_millis(2500), "{svc} took {:?}", t.elapsed());
        wait_until("ready again", Duration::from_secs(10), || r.status().is_some_and(|s| s.health.ready));
        let st = r.status().expect("status");
        let s = st.health.services.iter().find(|s| s.name == svc).expect("svc");
        assert_eq!(s.last_exit.as_ref().and_then(|e| e.signal), Some(9), "{s:?}");
        assert_eq!(s.restarts, 1);
    }
    for svc in ["sandboxd", "vk-sandbox", "vk-cocoon"] {
        assert_eq!(r.starts(svc).len(), 2, "{svc}: one restart each, no collateral restarts");
    }
    assert!(r.stop().success());
}

/// A grandchild orphaned by its parent is re-parented to the supervisor and reaped when it
/// exits; a daemonized "VM" survives graceful shutdown; a child ignoring SIGTERM is SIGKILLed.
fn reaping_and_graceful_shutdown() {
    let mut r = Rig::new(
        &cluster_config(""),
        &[("sandboxd", "serve vm"), ("vk-sandbox", "orphan"), ("vk-cocoon", "ignore-term")],
    );
    r.start();
    let sup = r.pid();
    wait_until("orphan and vm pids", Duration::from_secs(20), || {
        r.path("ctl/orphan.pid").exists() && r.path("ctl/vm.pid").exists()
    });
    let pid_of = |f: &str| std::fs::read_to_string(r.path(f)).expect("pid").trim().parse::<i32>().expect("pid");
    let (orphan, vm) = (pid_of("ctl/orphan.pid"), pid_of("ctl/vm.pid"));
    wait_until("the orphan re-parented to the supervisor", Duration::from_secs(5), || {
        ppid(orphan) == Some(sup) || !alive(orphan)
    });
    assert_eq!(ppid(vm), Some(sup), "the daemonized VM is re-parented to the subreaper");
    // The orphan exits 2 s after it started; the supervisor must reap it (no zombie left).
    wait_until("the orphan gone (reaped)", Duration::from_secs(8), || {
        supervisor::supervise::proc_stat(orphan).is_none()
    });
    assert!(zombies_of(sup).is_empty(), "zombies left: {:?}", zombies_of(sup));
    wait_until("ready", Duration::from_secs(20), || r.status().is_some_and(|s| s.health.ready));
    let services: Vec<i32> =
        ["sandboxd", "vk-sandbox", "vk-cocoon"].iter().map(|s| r.starts(s).last().expect("started").1).collect();
    let t = Instant::now();
    let exit = r.stop();
    assert!(exit.success(), "{exit:?}\n{}", r.sup_log());
    assert!(t.elapsed() >= Duration::from_secs(2), "waited the shutdown timeout for the SIGTERM-ignoring child");
    for (svc, pid) in ["sandboxd", "vk-sandbox", "vk-cocoon"].iter().zip(&services) {
        assert!(!alive(*pid), "{svc} (pid {pid}) still runs after shutdown");
    }
    assert!(alive(vm), "the VM must survive the supervisor's shutdown");
    assert_eq!(std::fs::read_to_string(r.path("exit")).expect("exit"), "Signal(\"SIGTERM\")");
    let logs = r.sup_log();
    assert!(logs.contains("did not stop in time"), "vk-cocoon ignored SIGTERM and got SIGKILL:\n{logs}");
    assert!(!r.path("api.sock").exists(), "the socket is removed");
    let _ = kill(Pid::from_raw(vm), Signal::SIGKILL);
}

/// READY=1 once, STATUS lines, WATCHDOG=1 at half of WATCHDOG_USEC; children do not inherit
/// NOTIFY_SOCKET; logs and status over the socket; the log file.
fn notify_api_and_logs() {
    let mut r = Rig::new(&format!("[sandboxd]\nlisten = \"127.0.0.1:{}\"\n", free_port()), &[("sandboxd", "serve")]);
    r.start();
    wait_until("READY=1", Duration::from_secs(20), || r.notes().iter().any(|n| n.contains("READY=1")));
    std::thread::sleep(Duration::from_secs(3));
    let notes = r.notes();
    assert_eq!(notes.iter().filter(|n| n.contains("READY=1")).count(), 1, "{notes:?}");
    let ready = notes.iter().find(|n| n.contains("READY=1")).expect("ready");
    assert!(ready.contains("STATUS=ready: sandboxd running"), "{ready}");
    let wd: Vec<Instant> =
        r.notify.lock().expect("lock").iter().filter(|(_, m)| m.trim() == "WATCHDOG=1").map(|(t, _)| *t).collect();
    assert!(wd.len() >= 5, "WATCHDOG=1 about every 0.5 s: {}", wd.len());
    for w in wd.windows(2).skip(1) {
        let gap = w[1] - w[0];
        assert!(gap > Duration::from_millis(250) && gap < Duration::from_millis(1000), "watchdog gap {gap:?}");
    }
    let env = std::fs::read_to_string(r.path("ctl/sandboxd.env")).expect("env");
    assert!(env.contains("NOTIFY_SOCKET=None"), "a child inherited NOTIFY_SOCKET: {env}");
    assert!(env.contains("--config"), "{env}");

    let st = r.status().expect("status");
    assert!(st.health.ready && st.config_errors.is_empty());
    assert_eq!(st.health.sandboxd_answers, Some(true));
    assert_eq!(st.health.api_reachable, None, "no cluster");
    wait_until("pools probed", Duration::from_secs(5), || r.status().is_some_and(|s| s.health.pools.len() == 1));
    let st = r.status().expect("status");
    assert_eq!((st.health.pools[0].warm, st.health.pools[0].target), (1, 1));
    assert!(st.health.healthy());
    let lines = r.rt.block_on(r.client().logs("sandboxd", 100)).expect("logs");
    let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
    assert!(
        text.contains(&"hello from sandboxd on stdout") && text.contains(&"hello from sandboxd on stderr"),
        "{text:?}"
    );
    assert!(text.iter().any(|l| l.starts_with("started, pid")), "{text:?}");
    let e = r.rt.block_on(r.client().logs("vk-nope", 1)).expect_err("unknown service");
    assert!(matches!(e, supervisor::client::ClientError::Api { ref kind, .. } if kind == "unknown_service"), "{e:?}");
    let file = std::fs::read_to_string(r.path("state/logs/sandboxd.log")).expect("log file");
    assert!(file.contains(" stdout hello from sandboxd on stdout"), "{file}");
    let cfg = r.rt.block_on(r.client().config()).expect("config");
    assert_eq!(cfg["config"]["sandboxd"]["enabled"], true);
    let sup_log = r.sup_log();
    let line = sup_log.lines().find(|l| l.contains("hello from sandboxd on stdout")).expect("re-emitted");
    let j: serde_json::Value = serde_json::from_str(line).expect("JSON log line");
    assert_eq!(j["service"], "sandboxd", "{j}");
    assert!(r.stop().success());
    assert!(r.notes().iter().any(|n| n.contains("STOPPING=1")));
}

/// A configuration error starts nothing, names the key in STATUS, the log and the API, and
/// keeps the supervisor up (READY so systemd does not reboot-loop the box).
fn config_error_names_the_key() {
    let bad = cluster_config("").replace(HASH, "sha256:zz");
    let mut r = Rig::new(&bad, &[("sandboxd", "serve")]);
    r.start();
    wait_until("READY=1", Duration::from_secs(20), || r.notes().iter().any(|n| n.contains("READY=1")));
    let ready = r.notes().into_iter().find(|n| n.contains("READY=1")).expect("ready");
    assert!(ready.contains("STATUS=configuration error: cluster.ca_cert_hashes[0] in "), "{ready}");
    assert!(ready.contains("copy the value printed by kubeadm token create"), "{ready}");
    let st = r.status().expect("status");
    assert_eq!(st.config_errors.len(), 1);
    assert_eq!(st.config_errors[0].key, "cluster.ca_cert_hashes[0]");
    assert!(!st.health.ready && st.health.services.is_empty());
    assert!(r.sup_log().contains("cluster.ca_cert_hashes[0]"));
    std::thread::sleep(Duration::from_millis(500));
    assert!(r.starts("sandboxd").is_empty(), "no service starts with a bad config");
    assert!(r.stop().success());
}

/// `POST /v1/reboot` stops the services, then runs the reboot command and exits.
fn reboot_stops_services_then_reboots() {
    let mut r = Rig::new(&format!("[sandboxd]\nlisten = \"127.0.0.1:{}\"\n", free_port()), &[("sandboxd", "serve")]);
    r.start();
    wait_until("ready", Duration::from_secs(20), || r.status().is_some_and(|s| s.health.ready));
    let pid = r.starts("sandboxd")[0].1;
    r.rt.block_on(r.client().reboot()).expect("reboot accepted");
    let mut c = r.sup.take().expect("sup");
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = c.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after reboot");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    assert!(!alive(pid), "services are stopped before the reboot");
    assert_eq!(std::fs::read_to_string(r.path("rebooted")).expect("reboot command ran").trim(), "rebooted");
    assert_eq!(std::fs::read_to_string(r.path("exit")).expect("exit"), "Reboot");
}

/// The real sandboxd (no pools, no VMs): READY once it answers /healthz.
/// A main loop that stalls (as a deadlock would) stops kicking the watchdog, so systemd's
/// `WatchdogSec=` restarts the service: the pings come from the loop itself, not from a helper.
fn a_stalled_main_loop_stops_the_watchdog() {
    let mut r = Rig::new(&format!("[sandboxd]\nlisten = \"127.0.0.1:{}\"\n", free_port()), &[("sandboxd", "serve")]);
    r.env.push((supervisor::FAULT_STALL_ENV, "3000".into()));
    r.start();
    wait_until("the main loop to stall", Duration::from_secs(20), || r.sup_log().contains("stalling the main loop"));
    let stalled = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let wd: Vec<Instant> =
        r.notify.lock().expect("lock").iter().filter(|(_, m)| m.trim() == "WATCHDOG=1").map(|(t, _)| *t).collect();
    assert!(wd.len() >= 3, "WATCHDOG=1 every 0.5 s before the stall: {}", wd.len());
    let silent = wd.last().map(|last| Instant::now().saturating_duration_since(*last)).unwrap_or_default();
    // Four intervals without a ping: systemd (WATCHDOG_USEC = 1 s here) would have fired.
    assert!(silent >= Duration::from_secs(2), "a ping {silent:?} ago, {:?} after the stall", stalled.elapsed());
}

fn real_sandboxd_becomes_ready() {
    let sandboxd = built_sandboxd();
    let mut r = Rig::new(&format!("[sandboxd]\nlisten = \"127.0.0.1:{}\"\n", free_port()), &[]);
    std::fs::remove_file(r.path("bin/sandboxd")).expect("rm fake");
    std::os::unix::fs::symlink(&sandboxd, r.path("bin/sandboxd")).expect("symlink");
    r.start();
    let t = Instant::now();
    wait_until("READY=1 from the real sandboxd", Duration::from_secs(60), || {
        r.notes().iter().any(|n| n.contains("READY=1"))
    });
    println!("    real sandboxd ready in {:?}", t.elapsed());
    let st = r.status().expect("status");
    assert!(st.health.ready && st.health.sandboxd_answers == Some(true), "{:?}", st.health);
    wait_until("pools read", Duration::from_secs(10), || {
        r.status().is_some_and(|s| s.health.pools_error.is_none() && s.health.checked_at > 0)
    });
    let gen: serde_json::Value =
        serde_json::from_slice(&std::fs::read(r.path("run/sandboxd.json")).expect("generated config")).expect("json");
    assert_eq!(gen["data_dir"], serde_json::json!(r.path("state/sandboxd")));
    let lines = r.rt.block_on(r.client().logs("sandboxd", 200)).expect("logs");
    assert!(lines.iter().any(|l| l.line.contains("sandboxd listening")), "{lines:?}");
    assert!(r.stop().success());
}

/// The real sandboxd behind the box certificate (configured, so TLS even on loopback): it
/// serves HTTPS with the minted root token; the supervisor's probe trusts exactly that
/// certificate (which does not name 127.0.0.1) and reads the pools with the token.
fn real_sandboxd_over_tls_with_the_minted_token() {
    let sandboxd = built_sandboxd();
    let certs = tempfile::tempdir().expect("tempdir");
    let (cert, key) = (certs.path().join("box.crt"), certs.path().join("box.key"));
    let fp = httpd::tls::ensure_self_signed(&cert, &key, &["box.example".to_string()]).expect("cert").fingerprint;
    let port = free_port();
    let mut r = Rig::new(
        &format!(
            "[supervisor]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n[sandboxd]\nlisten = \"127.0.0.1:{port}\"\n",
            cert.display(),
            key.display()
        ),
        &[],
    );
    std::fs::remove_file(r.path("bin/sandboxd")).expect("rm fake");
    std::os::unix::fs::symlink(&sandboxd, r.path("bin/sandboxd")).expect("symlink");
    r.start();
    wait_until("READY=1 from sandboxd over HTTPS", Duration::from_secs(60), || {
        r.notes().iter().any(|n| n.contains("READY=1"))
    });
    wait_until("pools read over HTTPS with the token", Duration::from_secs(10), || {
        r.status().is_some_and(|s| s.health.pools_error.is_none() && s.health.checked_at > 0)
    });
    let st = r.status().expect("status");
    assert_eq!(st.tls.len(), 1, "{:?}", st.tls);
    assert_eq!((st.tls[0].fingerprint.as_str(), st.tls[0].minted), (fp.as_str(), false));
    assert_eq!(st.tls[0].surfaces, ["sandboxd"]);
    let gen: serde_json::Value =
        serde_json::from_slice(&std::fs::read(r.path("run/sandboxd.json")).expect("generated config")).expect("json");
    assert_eq!(gen["tls_cert_file"], serde_json::json!(cert));
    assert_eq!(gen["api_token_file"], serde_json::json!(r.path("state/secrets/sandboxd-token")));
    let token = r.rt.block_on(r.client().token("sandboxd")).expect("token").token;
    // From outside: plain HTTP gets nothing; HTTPS needs the token.
    let tls = httpd::tls::client_config(&httpd::tls::Trust::Fingerprint(fp), httpd::tls::ALPN_HTTP1).expect("tls");
    let ep = Endpoint::Https(format!("127.0.0.1:{port}"));
    let get = |token: Option<&str>| {
        r.rt.block_on(supervisor::http::send(
            &ep,
            Some(&tls),
            hyper::Method::GET,
            "/v1/info",
            token,
            supervisor::http::empty(),
            Duration::from_secs(10),
        ))
        .expect("HTTPS")
        .status
    };
    assert_eq!(get(None).as_u16(), 401);
    assert_eq!(get(Some(&token)).as_u16(), 200);
    let plain = r.rt.block_on(supervisor::http::send(
        &Endpoint::Tcp(format!("127.0.0.1:{port}")),
        None,
        hyper::Method::GET,
        "/healthz",
        None,
        supervisor::http::empty(),
        Duration::from_secs(5),
    ));
    assert!(!plain.is_ok_and(|r| r.status.is_success()), "sandboxd answered plain HTTP on its TLS port");
    assert!(r.stop().success());
}

// ----------------------------------------------------------------------------------- runner

/// The sandboxd binary next to this test's target directory.
fn built_sandboxd() -> PathBuf {
    let exe = std::env::current_exe().expect("exe");
    // <target>/debug/deps/supervise-… → <target>/debug/sandboxd
    exe.parent().and_then(Path::parent).map(|d| d.join("sandboxd")).expect("target dir")
}

/// Why a scenario cannot run here (it is then counted as ignored, with the reason).
fn cannot_run(name: &str) -> Option<String> {
    let sandboxd = built_sandboxd();
    (name.starts_with("real_sandboxd") && !sandboxd.exists())
        .then(|| format!("{} is not built (cargo build -p sandboxd; cargo xtask test builds it)", sandboxd.display()))
}

fn runner(args: &[String]) {
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let scenarios: [(&str, fn()); 9] = [
        ("restart_backoff_and_crash_isolation", restart_backoff_and_crash_isolation),
        ("kill_9_is_recovered", kill_9_is_recovered),
        ("reaping_and_graceful_shutdown", reaping_and_graceful_shutdown),
        ("notify_api_and_logs", notify_api_and_logs),
        ("config_error_names_the_key", config_error_names_the_key),
        ("reboot_stops_services_then_reboots", reboot_stops_services_then_reboots),
        ("a_stalled_main_loop_stops_the_watchdog", a_stalled_main_loop_stops_the_watchdog),
        ("real_sandboxd_becomes_ready", real_sandboxd_becomes_ready),
        ("real_sandboxd_over_tls_with_the_minted_token", real_sandboxd_over_tls_with_the_minted_token),
    ];
    if args.iter().any(|a| a == "--list") {
        for (name, _) in scenarios {
            println!("{name}: test");
        }
        return;
    }
    let mut failed = Vec::new();
    let mut ran = 0;
    let mut ignored = 0;
    for (name, f) in scenarios {
        if !filters.is_empty() && !filters.iter().any(|flt| name.contains(flt.as_str())) {
            continue;
        }
        if let Some(why) = cannot_run(name) {
            println!("test {name} ... ignored, {why}");
            ignored += 1;
            continue;
        }
        ran += 1;
        println!("test {name} ...");
        let t = Instant::now();
        match std::panic::catch_unwind(f) {
            Ok(()) => println!("test {name} ... ok ({:.1}s)", t.elapsed().as_secs_f64()),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed.push(name);
            }
        }
    }
    // The line `cargo xtask test` tallies (libtest's format).
    let verdict = if failed.is_empty() { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {verdict}. {} passed; {} failed; {ignored} ignored; 0 measured; 0 filtered out",
        ran - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        let _ = std::io::stdout().flush();
        std::process::exit(1);
    }
}

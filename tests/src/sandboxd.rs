//! A real `sandboxd` child process on a fresh temp dir, for the suites that need one (sandboxd's
//! own end-to-end tests, vk-sandbox's, the benchmarks): a config ([`sandboxd_api::Config`])
//! with a data dir, a root token (0600, 32+ characters, as sandboxd demands), a loopback
//! listener and the given pools; start, `kill -9`, restart (also with a changed config);
//! blocking HTTP helpers, typed ([`sandboxd_api`] bodies) where they read sandboxd's answers; and
//! at the end every QEMU of the test killed and checked gone. Needs the built-image catalog and
//! QEMU.
//!
//! The node budget is set explicitly from the pools (twice the warm VMs plus 8, each at the
//! largest size asked for), so a suite behaves the same on any host; [`Harness::with_tls`]
//! serves TLS on `listen` with a minted certificate and keeps plain HTTP on `local_listen`
//! for the harness's own calls.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sandboxd_api::{ClaimRequest, Config, ExecRequest, Grant, Info, PoolConfig, PoolInfo, SandboxList};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How long a pool may take to fill (golden boot + clones under TCG on a busy machine).
pub const FILL_TIMEOUT: Duration = Duration::from_secs(240);
/// The root API token every harness configures (sandboxd wants at least 32 characters).
pub const TOKEN: &str = "e2e-root-token-0123456789abcdef0123";

pub fn catalog_path() -> PathBuf {
    let p = vmm::Catalog::default_path().expect("resolving the catalog path ($CHRYSALIS_CACHE / $HOME)");
    assert!(
        p.is_file(),
        "the e2e suite needs the built-image catalog at {}: run `cargo xtask vm-image base` (cargo xtask test does)",
        p.display()
    );
    p
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    l.local_addr().expect("local addr").port()
}

/// A `qemu-system*` process whose command line names `path` (the harness's one scanner).
pub fn qemu_pids(path: &str) -> Vec<u32> {
    crate::qemu_processes_under(Path::new(path))
}

/// Whether `GET /healthz` answers `200`; any connection or read error (a node still starting,
/// or one whose start resets a connection) is a `false`, never a panic.
fn healthz(addr: &str) -> bool {
    let probe = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        Ok(raw.starts_with(b"HTTP/1.1 200"))
    };
    probe().unwrap_or(false)
}

/// How long [`http`] waits for a response.
pub const HTTP_WAIT: Duration = Duration::from_secs(120);

/// One HTTP/1.1 request (`Connection: close`); returns status and the body as JSON (or a string).
pub fn http(addr: &str, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
    http_waiting(addr, method, path, token, body, HTTP_WAIT)
}

/// [`http`], waiting up to `wait` for the response (an exec with a long timeout).
pub fn http_waiting(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
    wait: Duration,
) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to sandboxd at {addr}: {e}"));
    s.set_read_timeout(Some(wait)).expect("timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() || method != "GET" {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes()).expect("sending the request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reading the response");
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("malformed response: {text:?}"));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("malformed status line: {head:?}"));
    let v = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
    (status, v)
}

pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < until, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The budget keys a harness sets for `pools`: room for every warm VM twice over plus 8, each
/// counted at the largest size the pools ask for.
pub fn budget_for(pools: &[PoolConfig]) -> (usize, u64) {
    let warm: usize = pools.iter().map(|p| p.warm.unwrap_or(sandboxd_api::config::DEFAULT_WARM)).sum();
    let mib = pools
        .iter()
        .filter_map(|p| p.size.as_deref())
        .filter_map(|s| s.parse::<vmm::SizeClass>().ok())
        .map(vmm::SizeClass::memory_mib)
        .max()
        .unwrap_or(512)
        .max(512);
    let vms = warm * 2 + 8;
    (vms, vms as u64 * mib)
}

/// A temp dir with a config, and the sandboxd child running on it (restartable).
pub struct Harness {
    pub dir: tempfile::TempDir,
    /// `127.0.0.1:<port>` where sandboxd serves plain HTTP (`listen`, or `local_listen` with TLS).
    pub addr: String,
    /// `127.0.0.1:<port>` of the TLS `listen`, when [`Harness::with_tls`] made it.
    pub tls_addr: Option<String>,
    /// The TLS certificate (PEM) clients pin, with TLS.
    pub cert: Option<PathBuf>,
    pub config: PathBuf,
    bin: PathBuf,
    child: Option<Child>,
    starts: usize,
    finished: bool,
}

impl Harness {
    /// Writes a config with `pools` and starts `bin` (the sandboxd binary) on it.
    pub fn new(bin: &Path, pools: Vec<PoolConfig>) -> Harness {
        Self::with_config(bin, pools, |_| {})
    }

    /// [`Harness::new`] with the config changed by `extra` after the harness set its own keys.
    pub fn with_config(bin: &Path, pools: Vec<PoolConfig>, extra: impl FnOnce(&mut Config)) -> Harness {
        let mut h = Self::prepare(bin, pools, extra, false);
        h.start();
        h
    }

    /// [`Harness::with_config`] serving TLS on `listen` (a certificate minted for 127.0.0.1 into
    /// the temp dir, [`Harness::cert`]) and plain HTTP on `local_listen` ([`Harness::addr`]).
    pub fn with_tls(bin: &Path, pools: Vec<PoolConfig>, extra: impl FnOnce(&mut Config)) -> Harness {
        let mut h = Self::prepare(bin, pools, extra, true);
        h.start();
        h
    }

    fn prepare(bin: &Path, pools: Vec<PoolConfig>, extra: impl FnOnce(&mut Config), tls: bool) -> Harness {
        let catalog = catalog_path();
        // A short path: QEMU's Unix sockets live under it (108-byte limit).
        let dir = tempfile::Builder::new().prefix("sbxe2e").tempdir_in("/tmp").expect("tempdir");
        let listen: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let token_file = dir.path().join("token");
        foundation::write_secret(&token_file, format!("{TOKEN}\n").as_bytes()).expect("token file");
        let config = dir.path().join("config.json");
        let (max_vms, max_memory_mib) = budget_for(&pools);
        let mut cfg = Config {
            listen,
            data_dir: dir.path().join("data"),
            api_token_file: Some(token_file),
            catalog: Some(catalog),
            pools,
            refill_concurrency: 2,
            max_vms: Some(max_vms),
            max_memory_mib: Some(max_memory_mib),
            ..Config::default()
        };
        let (mut addr, mut tls_addr, mut cert) = (listen.to_string(), None, None);
        if tls {
            let (c, k) = (dir.path().join("tls/cert.pem"), dir.path().join("tls/key.pem"));
            httpd::tls::ensure_self_signed(&c, &k, &["127.0.0.1".to_string(), "localhost".to_string()])
                .expect("minting the TLS certificate");
            let local: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
            addr = local.to_string();
            cfg.tls_cert_file = Some(c.clone());
            cfg.tls_key_file = Some(k);
            cfg.local_listen = Some(local);
            tls_addr = Some(listen.to_string());
            cert = Some(c);
        }
        extra(&mut cfg);
        write_config(&config, &cfg);
        Harness { dir, addr, tls_addr, cert, config, bin: bin.to_path_buf(), child: None, starts: 0, finished: false }
    }

    /// Runs a Python SDK script (`python script args…`) against this node, its output kept in
    /// `<label>.out` in the temp dir and printed; it must exit 0 within `timeout` with `last` as
    /// its last line. Panics with the script's output and sandboxd's logs otherwise.
    pub fn run_python(
        &self,
        python: &std::ffi::OsStr,
        script: &Path,
        args: &[String],
        label: &str,
        timeout: Duration,
        last: &str,
    ) -> String {
        let out_path = self.dir.path().join(format!("{label}.out"));
        let out = std::fs::File::create(&out_path).expect("script output file");
        let mut child = Command::new(python)
            .arg(script)
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("running {}: {e}", Path::new(python).display()));
        let until = Instant::now() + timeout;
        let status = loop {
            if let Some(st) = child.try_wait().expect("waiting for the script") {
                break st;
            }
            if Instant::now() >= until {
                let _ = child.kill();
                let _ = child.wait();
                let text = std::fs::read_to_string(&out_path).unwrap_or_default();
                panic!("{} did not finish within {timeout:?}:\n{text}\n{}", script.display(), self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        println!("{text}");
        assert!(status.success(), "{} failed ({status}):\n{text}\n{}", script.display(), self.logs());
        assert_eq!(text.lines().last(), Some(last), "{} did not reach its end:\n{text}", script.display());
        text
    }

    /// Changes the config file with `change` (takes effect at the next [`Harness::start`]).
    pub fn update_config(&self, change: impl FnOnce(&mut Config)) {
        let mut cfg: Config =
            serde_json::from_slice(&std::fs::read(&self.config).expect("config")).expect("config json");
        change(&mut cfg);
        write_config(&self.config, &cfg);
    }

    pub fn dir_str(&self) -> String {
        self.dir.path().display().to_string()
    }

    pub fn log_path(&self, n: usize) -> PathBuf {
        self.dir.path().join(format!("sandboxd-{n}.log"))
    }

    pub fn start(&mut self) {
        assert!(self.child.is_none(), "sandboxd already runs");
        self.starts += 1;
        let log = std::fs::File::create(self.log_path(self.starts)).expect("log file");
        let err = log.try_clone().expect("log file");
        let child = Command::new(&self.bin)
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info,sandboxd=debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .expect("spawning sandboxd");
        self.child = Some(child);
        let addr = self.addr.clone();
        wait_for("sandboxd /healthz", Duration::from_secs(30), || {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("sandboxd exited during start: {st}\n{}", self.logs());
                }
            }
            healthz(&addr).then_some(())
        });
    }

    /// sandboxd's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `kill -9` sandboxd (VMs keep running: they are daemonized QEMUs).
    pub fn kill9(&mut self) {
        let mut c = self.child.take().expect("sandboxd runs");
        c.kill().expect("SIGKILL sandboxd");
        c.wait().expect("reaping sandboxd");
    }

    pub fn logs(&self) -> String {
        let mut out = String::new();
        for n in 1..=self.starts {
            let text = std::fs::read_to_string(self.log_path(n)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            out.push_str(&format!("---- sandboxd run {n} (last {} lines) ----\n{}\n", tail.len(), tail.join("\n")));
        }
        out
    }

    pub fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
        http(&self.addr, method, path, token, body.as_ref())
    }

    /// [`Harness::call`], waiting up to `wait` for the response.
    pub fn call_waiting(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        wait: Duration,
    ) -> (u16, Value) {
        http_waiting(&self.addr, method, path, token, body.as_ref(), wait)
    }

    pub fn root(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (s, v) = self.call(method, path, Some(TOKEN), body);
        assert!((200..300).contains(&s), "{method} {path}: HTTP {s}: {v}\n{}", self.logs());
        v
    }

    /// [`Harness::root`], the answer decoded as `T`.
    pub fn root_as<T: DeserializeOwned>(&self, method: &str, path: &str, body: Option<Value>) -> T {
        let v = self.root(method, path, body);
        serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{method} {path}: {e}: {v}"))
    }

    pub fn info(&self) -> Info {
        self.root_as("GET", "/v1/info", None)
    }

    pub fn pool(&self, template: &str) -> PoolInfo {
        let info = self.info();
        info.pools
            .iter()
            .find(|p| p.key.template == template)
            .cloned()
            .unwrap_or_else(|| panic!("no {template} pool in {info:?}"))
    }

    /// Waits until the pool is full and nothing is refilling.
    pub fn wait_full(&self, template: &str) {
        wait_for(&format!("the {template} pool to fill"), FILL_TIMEOUT, || {
            let p = self.pool(template);
            (p.warm == p.target && p.refilling == 0).then_some(())
        });
    }

    /// Claims with the root token; returns the sandbox's id and token.
    pub fn claim(&self, req: &ClaimRequest) -> (String, String) {
        let body = serde_json::to_value(req).expect("claim body");
        let g: Grant = self.root_as("POST", "/v1/claim", Some(body));
        assert!(!g.id.is_empty() && !g.token.is_empty(), "a grant without an id or a token: {g:?}");
        (g.id, g.token)
    }

    pub fn exec(&self, id: &str, token: &str, argv: &[&str]) -> (u16, Value) {
        let body = serde_json::to_value(ExecRequest::new(argv.iter().copied())).expect("exec body");
        self.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(body))
    }

    pub fn sandbox_ids(&self) -> BTreeSet<String> {
        let list: SandboxList = self.root_as("GET", "/v1/sandboxes", None);
        list.sandboxes.into_iter().map(|r| r.id).collect()
    }

    /// QEMU processes of this test.
    pub fn qemus(&self) -> Vec<u32> {
        qemu_pids(&self.dir_str())
    }

    /// VM directories under the driver's state dir.
    pub fn vm_dirs(&self) -> BTreeSet<String> {
        let vms = self.dir.path().join("data").join("vms").join("vms");
        match std::fs::read_dir(&vms) {
            Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
            Err(_) => BTreeSet::new(),
        }
    }

    /// Asserts the live VMs are exactly `n` QEMU processes in `n` VM dirs.
    pub fn assert_vms(&self, n: usize, why: &str) {
        let (q, d) = (self.qemus(), self.vm_dirs());
        assert_eq!(q.len(), n, "{why}: want {n} QEMU processes, found {q:?} (dirs {d:?})\n{}", self.logs());
        let records: Vec<String> = d
            .iter()
            .map(|id| {
                let path = self.dir.path().join("data/vms/vms").join(id).join("vm.json");
                format!("{id}: {}", std::fs::read_to_string(&path).unwrap_or_else(|e| format!("no vm.json ({e})")))
            })
            .collect();
        assert_eq!(
            d.len(),
            n,
            "{why}: want {n} VM dirs, found {d:?}\nrecords:\n{}\n{}",
            records.join("\n"),
            self.logs()
        );
    }

    pub fn kill_everything(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in self.qemus() {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }

    /// Kills sandboxd and every VM of the test, then asserts that no QEMU mentions the temp dir.
    pub fn finish(mut self) {
        self.finished = true;
        self.kill_everything();
        let dir = self.dir_str();
        let left = wait_for_gone(&dir);
        assert!(left.is_empty(), "QEMU processes still mention {dir}: {left:?}");
    }
}

fn write_config(path: &Path, cfg: &Config) {
    std::fs::write(path, serde_json::to_vec_pretty(cfg).expect("config json")).expect("writing the config");
}

pub fn wait_for_gone(needle: &str) -> Vec<u32> {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let left = qemu_pids(needle);
        if left.is_empty() || Instant::now() >= until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        self.kill_everything();
        let left = wait_for_gone(&self.dir_str());
        if !left.is_empty() {
            eprintln!("warning: QEMU processes survived cleanup: {left:?}");
        }
    }
}

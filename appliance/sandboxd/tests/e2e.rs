#![cfg(feature = "e2e")]
//! End-to-end tests of the real `sandboxd` binary with real QEMU VMs (issue #3).
//!
//! Each test writes a config into a fresh temp dir (data dir, token file, a `base` pool), runs
//! `sandboxd` as a child process on a free loopback port and drives it over HTTP (a tiny
//! blocking client below) or through the public Python SDK (`tests/sdk/e2e.py`, interpreter from
//! `CHRYSALIS_PYTHON`). Needs the built-image catalog (`cargo xtask vm-image base`) and
//! `qemu-system-x86_64`; `cargo xtask test` provides both and enables the `e2e` feature.
//!
//! At the end of every test, sandboxd and every QEMU whose command line names the temp dir are
//! killed, and the test asserts that none is left. The tests take a process-wide lock so they
//! run one at a time even without `--test-threads=1` (2 cores, TCG).

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long a pool may take to fill (golden boot + clones under TCG on a busy machine).
const FILL_TIMEOUT: Duration = Duration::from_secs(240);
/// How long the SDK suite may run.
const SDK_TIMEOUT: Duration = Duration::from_secs(600);
const TOKEN: &str = "e2e-root-token-0123456789";

/// Serializes the tests: each boots several TCG VMs.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    // A test that panicked while holding the lock left nothing shared behind: keep going.
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn catalog_path() -> PathBuf {
    let p = vmm::Catalog::default_path().expect("resolving the catalog path ($CHRYSALIS_CACHE / $HOME)");
    assert!(
        p.is_file(),
        "the e2e suite needs the built-image catalog at {}: run `cargo xtask vm-image base` (cargo xtask test does)",
        p.display()
    );
    p
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    l.local_addr().expect("local addr").port()
}

/// A `qemu-system*` process whose command line names `path` (the harness's one scanner).
fn qemu_pids(path: &str) -> Vec<u32> {
    test_infra::qemu_processes_under(Path::new(path))
}

/// One HTTP/1.1 request (`Connection: close`); returns status and the body as JSON (or a string).
fn http(addr: &str, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to sandboxd at {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
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

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < until, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A temp dir with a config, and the sandboxd child running on it (restartable).
struct Harness {
    dir: tempfile::TempDir,
    addr: String,
    config: PathBuf,
    child: Option<Child>,
    starts: usize,
    finished: bool,
}

impl Harness {
    fn new(pools: Value) -> Harness {
        let catalog = catalog_path();
        // A short path: QEMU's Unix sockets live under it (108-byte limit).
        let dir = tempfile::Builder::new().prefix("sbxe2e").tempdir_in("/tmp").expect("tempdir");
        let addr = format!("127.0.0.1:{}", free_port());
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
        let config = dir.path().join("config.json");
        let cfg = json!({
            "listen": addr,
            "data_dir": dir.path().join("data"),
            "api_token_file": token_file,
            "catalog": catalog,
            "pools": pools,
            "refill_concurrency": 2,
        });
        std::fs::write(&config, serde_json::to_vec_pretty(&cfg).expect("json")).expect("config");
        let mut h = Harness { dir, addr, config, child: None, starts: 0, finished: false };
        h.start();
        h
    }

    fn dir_str(&self) -> String {
        self.dir.path().display().to_string()
    }

    fn log_path(&self, n: usize) -> PathBuf {
        self.dir.path().join(format!("sandboxd-{n}.log"))
    }

    fn start(&mut self) {
        assert!(self.child.is_none(), "sandboxd already runs");
        self.starts += 1;
        let log = std::fs::File::create(self.log_path(self.starts)).expect("log file");
        let err = log.try_clone().expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
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
            TcpStream::connect(&addr).ok().map(|_| ()).and_then(|()| {
                let (s, _) = http(&addr, "GET", "/healthz", None, None);
                (s == 200).then_some(())
            })
        });
    }

    /// `kill -9` sandboxd (VMs keep running: they are daemonized QEMUs).
    fn kill9(&mut self) {
        let mut c = self.child.take().expect("sandboxd runs");
        c.kill().expect("SIGKILL sandboxd");
        c.wait().expect("reaping sandboxd");
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for n in 1..=self.starts {
            let text = std::fs::read_to_string(self.log_path(n)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            out.push_str(&format!("---- sandboxd run {n} (last {} lines) ----\n{}\n", tail.len(), tail.join("\n")));
        }
        out
    }

    fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
        http(&self.addr, method, path, token, body.as_ref())
    }

    fn root(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (s, v) = self.call(method, path, Some(TOKEN), body);
        assert!((200..300).contains(&s), "{method} {path}: HTTP {s}: {v}\n{}", self.logs());
        v
    }

    fn info(&self) -> Value {
        self.root("GET", "/v1/info", None)
    }

    fn pool(&self, template: &str) -> Value {
        let info = self.info();
        info["pools"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["key"]["template"] == template).cloned())
            .unwrap_or_else(|| panic!("no {template} pool in {info}"))
    }

    /// Waits until the pool is full and nothing is refilling.
    fn wait_full(&self, template: &str) {
        wait_for(&format!("the {template} pool to fill"), FILL_TIMEOUT, || {
            let p = self.pool(template);
            (p["warm"] == p["target"] && p["refilling"] == 0).then_some(())
        });
    }

    fn claim(&self, body: Value) -> (String, String) {
        let v = self.root("POST", "/v1/claim", Some(body));
        let id = v["id"].as_str().unwrap_or_else(|| panic!("claim without id: {v}")).to_string();
        let token = v["token"].as_str().unwrap_or_else(|| panic!("claim without token: {v}")).to_string();
        (id, token)
    }

    fn exec(&self, id: &str, token: &str, argv: &[&str]) -> (u16, Value) {
        self.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(json!({ "argv": argv })))
    }

    fn sandbox_ids(&self) -> BTreeSet<String> {
        let v = self.root("GET", "/v1/sandboxes", None);
        v["sandboxes"]
            .as_array()
            .unwrap_or_else(|| panic!("bad listing {v}"))
            .iter()
            .map(|r| r["id"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// QEMU processes of this test.
    fn qemus(&self) -> Vec<u32> {
        qemu_pids(&self.dir_str())
    }

    /// VM directories under the driver's state dir.
    fn vm_dirs(&self) -> BTreeSet<String> {
        let vms = self.dir.path().join("data").join("vms").join("vms");
        match std::fs::read_dir(&vms) {
            Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
            Err(_) => BTreeSet::new(),
        }
    }

    /// Asserts the live VMs are exactly `n` QEMU processes in `n` VM dirs.
    fn assert_vms(&self, n: usize, why: &str) {
        let (q, d) = (self.qemus(), self.vm_dirs());
        assert_eq!(q.len(), n, "{why}: want {n} QEMU processes, found {q:?} (dirs {d:?})\n{}", self.logs());
        let records: Vec<String> = d
            .iter()
            .map(|id| {
                let path = self.dir.path().join("data/vms/vms").join(id).join("vm.json");
                format!("{id}: {}", std::fs::read_to_string(&path).unwrap_or_else(|e| format!("no vm.json ({e})")))
            })
            .collect();
        assert_eq!(d.len(), n, "{why}: want {n} VM dirs, found {d:?}\nrecords:\n{}\n{}", records.join("\n"), self.logs());
    }

    fn kill_everything(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in self.qemus() {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }

    /// Kills sandboxd and every VM of the test, then asserts that no QEMU mentions the temp dir.
    fn finish(mut self) {
        self.finished = true;
        self.kill_everything();
        let dir = self.dir_str();
        let left = wait_for_gone(&dir);
        assert!(left.is_empty(), "QEMU processes still mention {dir}: {left:?}");
    }
}

fn wait_for_gone(needle: &str) -> Vec<u32> {
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

/// The public SDK, unmodified, against the live daemon: the whole surface of issue #3.
#[test]
fn sdk_suite() {
    let _serial = serial();
    let python = std::env::var_os("CHRYSALIS_PYTHON").unwrap_or_else(|| {
        panic!(
            "CHRYSALIS_PYTHON is unset: point it at a python with cocoonstack-sandbox==0.1.19 \
             (cargo xtask test does; locally: python3 -m venv /tmp/sdkvenv && \
             /tmp/sdkvenv/bin/pip install cocoonstack-sandbox==0.1.19)"
        )
    });
    let h = Harness::new(json!([{"template": "base", "warm": 2}]));
    h.wait_full("base");
    h.assert_vms(2, "a full pool of 2");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/e2e.py");
    let out_path = h.dir.path().join("sdk.out");
    let out = std::fs::File::create(&out_path).expect("sdk output file");
    let mut child = Command::new(&python)
        .arg(&script)
        .arg(&h.addr)
        .arg(TOKEN)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", Path::new(&python).display()));
    let until = Instant::now() + SDK_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("waiting for the SDK suite") {
            break st;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&out_path).unwrap_or_default();
            panic!("the SDK suite did not finish within {SDK_TIMEOUT:?}:\n{text}\n{}", h.logs());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    println!("{text}");
    assert!(status.success(), "the SDK suite failed ({status}):\n{text}\n{}", h.logs());
    assert_eq!(text.lines().last(), Some("sdk e2e ok"), "the SDK suite did not reach its end:\n{text}");
    // Everything the suite claimed is gone; the pool refills to its target and nothing leaked.
    assert!(h.sandbox_ids().is_empty(), "claims left behind");
    h.wait_full("base");
    h.assert_vms(2, "after the SDK suite, only the warm pool");
    h.finish();
}

/// `kill -9` with claims live and a refill in flight: claims survive, nothing leaks, the pool refills.
#[test]
fn restart_after_kill9_keeps_claims_and_leaks_nothing() {
    let _serial = serial();
    let mut h = Harness::new(json!([{"template": "base", "warm": 2}]));
    h.wait_full("base");
    h.assert_vms(2, "a full pool of 2");
    let mut claims = Vec::new();
    for n in 0..2 {
        let (id, token) = h.claim(json!({"template": "base", "ttl_seconds": 600, "claim_ref": format!("r{n}")}));
        // Leave a mark in the guest: after the restart it proves the claim kept its VM.
        let (s, v) = h.exec(&id, &token, &["sh", "-c", &format!("echo {id} > /tmp/mark")]);
        assert_eq!(s, 200, "exec before the restart: {v}");
        claims.push((id, token));
    }
    // Raise the target so a refill is surely in flight at the kill (`pools.json` keeps it).
    h.root("PUT", "/v1/pools", Some(json!({"pools": [{"template": "base", "warm": 3}]})));
    let refilling = wait_for("a refill in flight", Duration::from_secs(5), || {
        let p = h.pool("base");
        let r = p["refilling"].as_u64().unwrap_or(0);
        (r > 0).then_some(r)
    });
    h.kill9();
    let at_kill = h.vm_dirs();
    println!("killed sandboxd with {refilling} refills in flight; VM dirs: {at_kill:?}");
    assert!(at_kill.len() >= 2, "the claims' VMs must outlive sandboxd: {at_kill:?}");
    h.start();
    for (id, token) in &claims {
        let (s, v) = h.exec(id, token, &["cat", "/tmp/mark"]);
        assert_eq!(s, 200, "exec on {id} after the restart: {v}\n{}", h.logs());
        assert_eq!(v["exit_code"], 0, "{v}");
        assert_eq!(v["stdout"], format!("{id}\n"), "{id} is not the VM it was: {v}");
    }
    let want: BTreeSet<String> = claims.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(h.sandbox_ids(), want);
    assert_eq!(h.info()["claimed"], 2);
    // A wrong token still answers 404 after the restart (the journal kept the tokens).
    let (s, _) = h.exec(&claims[0].0, &claims[1].1, &["true"]);
    assert_eq!(s, 404);
    h.wait_full("base");
    assert_eq!(h.pool("base")["target"], 3, "the PUT target survives the restart");
    h.assert_vms(2 + 3, "after the restart: 2 claims + 3 warm");
    // Release one claim: its VM goes, the other keeps answering.
    let (s, v) = h.call("POST", &format!("/v1/sandboxes/{}/release", claims[0].0), Some(&claims[0].1), None);
    assert_eq!(s, 204, "{v}");
    let (s, v) = h.exec(&claims[1].0, &claims[1].1, &["echo", "still"]);
    assert_eq!((s, v["stdout"].as_str()), (200, Some("still\n")), "{v}");
    h.wait_full("base");
    h.assert_vms(1 + 3, "after a release: 1 claim + 3 warm");
    h.finish();
}

/// A 2-second lease is reaped within seconds and its VM is destroyed.
#[test]
fn short_lease_is_reaped_and_its_vm_destroyed() {
    let _serial = serial();
    let h = Harness::new(json!([{"template": "base", "warm": 1}]));
    h.wait_full("base");
    h.assert_vms(1, "a full pool of 1");
    let before = h.vm_dirs();
    let claimed_vm = before.iter().next().cloned().expect("one warm VM");
    let t0 = Instant::now();
    let (id, token) = h.claim(json!({"template": "base", "ttl_seconds": 2}));
    let (s, v) = h.exec(&id, &token, &["echo", "leased"]);
    assert_eq!((s, v["stdout"].as_str()), (200, Some("leased\n")), "{v}");
    wait_for("the lease to be reaped", Duration::from_secs(12), || (!h.sandbox_ids().contains(&id)).then_some(()));
    let reaped_after = t0.elapsed();
    println!("2 s lease reaped after {reaped_after:?}");
    assert!(reaped_after <= Duration::from_secs(10), "reaped only after {reaped_after:?}");
    assert!(reaped_after >= Duration::from_secs(2), "reaped before its deadline: {reaped_after:?}");
    let vm_dir = h.dir.path().join("data/vms/vms").join(&claimed_vm).display().to_string();
    wait_for("the reaped VM's QEMU to exit", Duration::from_secs(10), || qemu_pids(&vm_dir).is_empty().then_some(()));
    assert!(!h.vm_dirs().contains(&claimed_vm), "the reaped VM's dir is still there");
    let (s, v) = h.exec(&id, &token, &["true"]);
    assert_eq!(s, 404, "a reaped sandbox must be unknown: {v}");
    h.wait_full("base");
    h.assert_vms(1, "after the reap, only the warm pool");
    h.finish();
}

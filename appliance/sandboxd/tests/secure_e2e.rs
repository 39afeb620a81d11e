#![cfg(feature = "e2e")]
//! Secure by default, end to end (issue #12): the real `sandboxd` binary, real QEMU VMs and the
//! unmodified public SDK (`cocoonstack-sandbox` 0.1.19, `tests/sdk/e2e.py`).
//!
//! - `open_listen_is_refused`: a node on 0.0.0.0 without a token, or with a token file others
//!   can read, or a short token, does not start; the error names the key, where it was set and
//!   the fix.
//! - `sdk_plain_and_tls_then_limits`: one sandboxd with a `base` pool of 2, TLS on `listen` and
//!   plain HTTP on `local_listen`, shared by every scenario in order:
//!   1. the SDK e2e suite over plain HTTP, then over TLS (`https://`, `ssl_context`), each also
//!      checking that an unauthenticated SDK claim gets 401;
//!   2. the modes of the data dir (0700) and its journal files (0600) after those claims;
//!   3. a claim within a second while 2,000 idle connections are open;
//!   4. `PUT /v1/pools` with `warm: 100000`: 422, `pools.json` unchanged;
//!   5. restart with small per-claim caps, a 2 s head timeout and a 3 s relay idle timeout: the
//!      old pools are still in force; relay and exec caps are hit (429) and freed; a slowloris
//!      client is cut off; an idle relay is closed;
//!   6. restart with `max_lifetime_secs = 5`: a claim-and-renew loop stops at the horizon (409).
//!
//! Needs the built-image catalog, `qemu-system-x86_64` and `CHRYSALIS_PYTHON` (the SDK venv);
//! `cargo xtask test` provides all three. Run under `flock /tmp/chrysalis-heavy.lock`.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sandboxd_api::{ClaimRequest, Config, ExecRequest, PoolConfig, PoolList, RenewRequest};
use serde_json::Value;
use test_infra::sandboxd::{free_port, http, wait_for, Harness, TOKEN};

/// A request body.
fn to_body(b: impl serde::Serialize) -> Value {
    serde_json::to_value(b).expect("body")
}

/// `PUT /v1/pools` with one `base` pool of `warm`.
fn base_pools(warm: usize) -> Value {
    to_body(PoolList { pools: vec![PoolConfig::warm("base", warm)] })
}

/// How long one run of the SDK suite may take.
const SDK_TIMEOUT: Duration = Duration::from_secs(600);

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_sandboxd"))
}

fn step(name: &str) {
    println!("== {name}");
}

/// Runs sandboxd on `config` with `args`; it must exit (not serve) within 20 s. Returns the exit
/// code and stderr.
fn refused(config: &Path, args: &[&str]) -> (i32, String) {
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(config)
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning sandboxd");
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sandboxd started instead of refusing ({config:?} {args:?})");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("stderr");
    (status.code().unwrap_or(-1), err)
}

#[test]
fn open_listen_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let write = |name: &str, c: Config| {
        let p = dir.path().join(name);
        std::fs::write(&p, serde_json::to_vec(&c).expect("json")).expect("write");
        p
    };
    let port = free_port();
    let on = |ip: [u8; 4]| std::net::SocketAddr::from((ip, port));
    // From the config file.
    let cfg = write("open.json", Config { listen: on([0, 0, 0, 0]), data_dir: data.clone(), ..Config::default() });
    let (code, err) = refused(&cfg, &[]);
    println!("{err}");
    assert_eq!(code, 1, "{err}");
    for want in [
        "listen / api_token_file",
        &format!("listen 0.0.0.0:{port} (set in {})", cfg.display()),
        "set api_token_file",
        "listen on 127.0.0.1:7777",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    // From the flag, over a loopback config.
    let cfg = write("loop.json", Config { listen: on([127, 0, 0, 1]), data_dir: data.clone(), ..Config::default() });
    let (code, err) = refused(&cfg, &["--listen", &format!("0.0.0.0:{port}")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("set by the --listen flag"), "{err}");
    // The default listen address: a file that does not name `listen` at all (the typed
    // `Config` always writes it, so this one file is written by hand).
    let cfg = dir.path().join("default.json");
    let body = serde_json::json!({ "data_dir": data });
    std::fs::write(&cfg, serde_json::to_vec(&body).expect("json")).expect("write");
    let (code, err) = refused(&cfg, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("(the default 0.0.0.0:7777)"), "{err}");
    // A token file others can read, and a short token.
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let cfg = write(
        "token.json",
        Config {
            listen: on([0, 0, 0, 0]),
            data_dir: data.clone(),
            api_token_file: Some(token.clone()),
            max_vms: Some(1),
            max_memory_mib: Some(512),
            ..Config::default()
        },
    );
    let (code, err) = refused(&cfg, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("api_token_file") && err.contains("mode 0644") && err.contains("chmod 600"), "{err}");
    std::fs::write(&token, "short\n").expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let (code, err) = refused(&cfg, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("fewer than 32"), "{err}");
    assert!(!data.join("claims.json").exists(), "a refused start wrote state");
}

/// Runs `tests/sdk/e2e.py` against `target` (`host:port` or `https://host:port`).
fn sdk(h: &Harness, python: &std::ffi::OsStr, target: &str, cafile: Option<&Path>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/e2e.py");
    let mut args = vec![target.to_string(), TOKEN.to_string()];
    args.extend(cafile.map(|c| c.display().to_string()));
    let label = if cafile.is_some() { "sdk-tls" } else { "sdk-plain" };
    h.run_python(python, &script, &args, label, SDK_TIMEOUT, "sdk e2e ok");
    assert!(h.sandbox_ids().is_empty(), "claims left behind");
}

/// Sends `head` and reads the reply head: the status, and the JSON body of a non-101 reply.
fn upgrade(addr: &str, path: &str, proto: &str, token: &str) -> (u16, Value, BufReader<TcpStream>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: {proto}\r\nAuthorization: Bearer {token}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let code: u16 =
        line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("bad status {line:?}"));
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        if h == "\r\n" || h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().expect("length");
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).expect("body");
    (code, serde_json::from_slice(&body).unwrap_or(Value::Null), r)
}

/// Polls an upgrade until it switches (a freed slot is released asynchronously).
fn upgrade_ok(addr: &str, path: &str, proto: &str, token: &str) -> BufReader<TcpStream> {
    wait_for(&format!("{path} to switch protocols"), Duration::from_secs(30), || {
        let (code, _, r) = upgrade(addr, path, proto, token);
        (code == 101).then_some(r)
    })
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).expect("metadata").permissions().mode() & 0o7777
}

#[test]
fn sdk_plain_and_tls_then_limits() {
    let python = std::env::var_os("CHRYSALIS_PYTHON").unwrap_or_else(|| {
        panic!(
            "CHRYSALIS_PYTHON is unset: point it at a python with cocoonstack-sandbox==0.1.19 \
             (cargo xtask test does; locally: python3 -m venv /tmp/sdkvenv && \
             /tmp/sdkvenv/bin/pip install cocoonstack-sandbox==0.1.19)"
        )
    });
    let mut h = Harness::with_tls(bin(), vec![PoolConfig::warm("base", 2)], |_| {});
    let tls_origin = format!("https://{}", h.tls_addr.clone().expect("tls addr"));
    let cert = h.cert.clone().expect("cert");
    h.wait_full("base");
    h.assert_vms(2, "a full pool of 2");

    step("1. the SDK e2e suite over plain HTTP (local_listen), then over TLS");
    sdk(&h, &python, &h.addr, None);
    h.wait_full("base");
    sdk(&h, &python, &tls_origin, Some(&cert));
    h.wait_full("base");
    h.assert_vms(2, "after both SDK runs, only the warm pool");

    step("2. data dir and journal modes");
    // A PUT of the same pools leaves a pools.json to check too.
    h.root("PUT", "/v1/pools", Some(base_pools(2)));
    let data = h.dir.path().join("data");
    assert_eq!(mode(&data), 0o700, "data dir");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&data).expect("ls") {
        let e = e.expect("entry");
        if e.file_type().expect("type").is_file() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert_eq!(mode(&e.path()), 0o600, "{name} is {:04o}", mode(&e.path()));
            files.push(name);
        }
    }
    files.sort();
    println!("data dir files: {files:?}");
    for want in ["claims.json", "claims.log", "pools.json"] {
        assert!(files.iter().any(|f| f == want), "{want} missing: {files:?}");
    }

    step("3. a claim within a second while 2,000 idle connections are open");
    httpd::raise_nofile_limit().expect("raising RLIMIT_NOFILE");
    let idle: Vec<TcpStream> = (0..2000).map(|_| TcpStream::connect(&h.addr).expect("idle connection")).collect();
    let open = || {
        let (_, m) = h.call("GET", "/metrics", Some(TOKEN), None);
        m.as_str()
            .and_then(|t| t.lines().find_map(|l| l.strip_prefix("sandboxd_http_connections_open ")))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    wait_for("2,000 connections open on sandboxd", Duration::from_secs(30), || (open() >= 2000).then_some(()));
    let t = Instant::now();
    let (s, c) = h.call(
        "POST",
        "/v1/claim",
        Some(TOKEN),
        Some(to_body(ClaimRequest { ttl_seconds: Some(60), ..ClaimRequest::new("base") })),
    );
    let took = t.elapsed();
    println!("claim with 2,000 idle connections open: {took:?}");
    assert_eq!(s, 200, "{c}");
    assert!(took < Duration::from_secs(1), "the claim took {took:?}");
    drop(idle);
    let (s, _) =
        h.call("POST", &format!("/v1/sandboxes/{}/release", c["id"].as_str().expect("id")), c["token"].as_str(), None);
    assert_eq!(s, 204);

    step("4. PUT /v1/pools with warm: 100000 is refused, nothing is persisted");
    let pools_json = data.join("pools.json");
    let before = std::fs::read(&pools_json).expect("pools.json");
    let (s, v) = h.call("PUT", "/v1/pools", Some(TOKEN), Some(base_pools(100_000)));
    println!("{s} {v}");
    assert_eq!(s, 422, "{v}");
    let msg = v["error"].as_str().expect("msg");
    assert!(msg.contains("100000 VMs") && msg.contains("max_vms"), "{msg}");
    let (s, _) = h.call("PUT", "/v1/pools", None, Some(base_pools(1)));
    assert_eq!(s, 401, "PUT /v1/pools without the root token");
    assert_eq!(std::fs::read(&pools_json).expect("pools.json"), before);
    assert_eq!(h.pool("base").target, 2);

    step("5. restart with small caps and short timeouts");
    h.update_config(|c| {
        c.max_agent_relays_per_claim = 2;
        c.max_port_relays_per_claim = 1;
        c.max_execs_per_claim = 1;
        c.header_timeout_secs = 2;
        c.relay_idle_timeout_secs = 3;
    });
    h.kill9();
    h.start();
    assert_eq!(std::fs::read(&pools_json).expect("pools.json"), before, "pools.json changed by the restart");
    assert_eq!(h.pool("base").target, 2, "the old pools are in force after the restart");
    h.wait_full("base");
    let (id, token) = h.claim(&ClaimRequest { ttl_seconds: Some(600), ..ClaimRequest::new("base") });
    let agent = format!("/v1/sandboxes/{id}/agent");
    let (c1, _, r1) = upgrade(&h.addr, &agent, "silkd", &token);
    let (c2, _, r2) = upgrade(&h.addr, &agent, "silkd", &token);
    assert_eq!((c1, c2), (101, 101));
    let (c3, body, _) = upgrade(&h.addr, &agent, "silkd", &token);
    assert_eq!(c3, 429, "{body}");
    assert!(body["error"].as_str().expect("msg").contains("max_agent_relays_per_claim = 2"), "{body}");
    drop(r1);
    let r4 = upgrade_ok(&h.addr, &agent, "silkd", &token);
    println!("agent relays: cap hit (429) and freed");
    drop((r2, r4));
    // /ports: a listener in the guest, one relay, the next refused, then freed.
    let (s, v) = h.exec(&id, &token, &["sh", "-c", "nc -ll -p 7000 -e cat </dev/null >/dev/null 2>&1 &"]);
    assert_eq!(s, 200, "{v}");
    let ports = format!("/v1/sandboxes/{id}/ports/7000");
    let p1 = upgrade_ok(&h.addr, &ports, "tcp", &token);
    let (c, body, _) = upgrade(&h.addr, &ports, "tcp", &token);
    assert_eq!(c, 429, "{body}");
    assert!(body["error"].as_str().expect("msg").contains("max_port_relays_per_claim = 1"), "{body}");
    drop(p1);
    drop(upgrade_ok(&h.addr, &ports, "tcp", &token));
    println!("port relays: cap hit (429) and freed");
    // /exec: one in flight, the next refused, then free again. The long exec gets a head
    // start; if a probe took the slot first (the long one was refused), try again.
    let refused = wait_for("a second exec to be refused", Duration::from_secs(60), || {
        let long = {
            let (addr, id, token) = (h.addr.clone(), id.clone(), token.clone());
            let body = to_body(ExecRequest::new(["sleep", "3"]));
            std::thread::spawn(move || {
                http(&addr, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(&token), Some(&body))
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        loop {
            if long.is_finished() {
                let (s, v) = long.join().expect("join");
                println!("the long exec ended before a probe was refused ({s} {v}); again");
                return None;
            }
            let (s, v) = h.exec(&id, &token, &["true"]);
            if s == 429 {
                let (ls, lv) = long.join().expect("join");
                assert_eq!(ls, 200, "the long exec: {lv}");
                return Some(v);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert!(refused["error"].as_str().expect("msg").contains("max_execs_per_claim = 1"), "{refused}");
    let (s, v) = h.exec(&id, &token, &["echo", "free"]);
    assert_eq!((s, v["stdout"].as_str()), (200, Some("free\n")), "{v}");
    println!("exec: cap hit (429) and freed");
    // Slowloris: cut off at the 2 s head timeout.
    let mut slow = TcpStream::connect(&h.addr).expect("connect");
    slow.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").expect("write");
    let t = Instant::now();
    let cut = loop {
        let mut b = [0u8; 64];
        match slow.read(&mut b) {
            Ok(0) => break t.elapsed(),
            Ok(_) => panic!("the slow head was answered"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break t.elapsed(),
        }
        if slow.write_all(b"X-Slow: 1\r\n").is_err() {
            break t.elapsed();
        }
        assert!(t.elapsed() < Duration::from_secs(15), "the slowloris client was never cut off");
    };
    println!("slowloris cut off after {cut:?}");
    assert!(cut >= Duration::from_millis(1500), "cut before the head timeout: {cut:?}");
    // An idle relay is closed after 3 s.
    let mut idle = upgrade_ok(&h.addr, &agent, "silkd", &token);
    idle.get_mut().set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let t = Instant::now();
    let mut rest = Vec::new();
    let _ = idle.read_to_end(&mut rest);
    let closed = t.elapsed();
    println!("idle relay closed after {closed:?}");
    assert!(closed >= Duration::from_millis(2500) && closed < Duration::from_secs(15), "{closed:?}");
    assert!(rest.is_empty(), "unsolicited bytes on an idle relay");
    let (s, _) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(&token), None);
    assert_eq!(s, 204);

    step("6. restart with max_lifetime_secs = 5: a claim-and-renew loop stops at the horizon");
    h.update_config(|c| c.max_lifetime_secs = 5);
    h.kill9();
    h.start();
    h.wait_full("base");
    let t0 = Instant::now();
    let (id, token) = h.claim(&ClaimRequest { ttl_seconds: Some(600), ..ClaimRequest::new("base") });
    let renew = format!("/v1/sandboxes/{id}/renew");
    let mut renewed = 0;
    let (refused_after, v) = loop {
        let (s, v) = h.call("POST", &renew, Some(&token), Some(to_body(RenewRequest { ttl_seconds: Some(2) })));
        match s {
            200 => renewed += 1,
            409 => break (t0.elapsed(), v),
            other => panic!("renew answered {other}: {v}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the renew loop never stopped");
        std::thread::sleep(Duration::from_millis(250));
    };
    println!("renewed {renewed} times; refused after {refused_after:?}: {v}");
    assert!(renewed >= 3, "{renewed}");
    assert!(refused_after >= Duration::from_millis(2500), "{refused_after:?}");
    assert!(v["error"].as_str().expect("msg").contains("max_lifetime_secs = 5"), "{v}");
    wait_for("the lease to end at the horizon", Duration::from_secs(15), || {
        (!h.sandbox_ids().contains(&id)).then_some(())
    });
    h.wait_full("base");
    // The reaper drops the claim from the listing first, then destroys its VM: wait for that too.
    wait_for("the expired claim's VM to be destroyed", Duration::from_secs(30), || {
        (h.vm_dirs().len() == 2 && h.qemus().len() == 2).then_some(())
    });
    h.assert_vms(2, "after every scenario, only the warm pool");
    h.finish();
}

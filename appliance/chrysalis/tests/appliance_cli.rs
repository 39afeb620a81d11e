//! The appliance verbs of the `chrysalis` binary: `config check` exit codes and messages,
//! `config default`, and `run` + `status` / `logs` / `update` / `reboot` over the Unix socket
//! with a fake sandboxd (a shell script). The supervisor's behaviour itself is tested in
//! `appliance/supervisor/tests/supervise.rs`.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const HASH: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn chrysalis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_chrysalis"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("CHRYSALIS_API")
        .env_remove("NOTIFY_SOCKET")
        .output()
        .expect("run chrysalis")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf8 path")
}

/// `chrysalis run` laid out under `d`: the baked layer `d/config.toml`, ESP and disk layers at the
/// missing `d/x`, no kernel command line, state in `d/state`, runtime files in `d/run`, the API on
/// `api_socket`, and no `NOTIFY_SOCKET`. Each test adds its own flags, log format and stdio.
fn run_under(d: &Path, api_socket: &Path) -> Command {
    let mut run = Command::new(env!("CARGO_BIN_EXE_chrysalis"));
    run.args(["run", "--config-baked", p(&d.join("config.toml")), "--config-esp", p(&d.join("x"))])
        .args(["--config-disk", p(&d.join("x")), "--no-cmdline", "--state-dir", p(&d.join("state"))])
        .args(["--run-dir", p(&d.join("run")), "--api-socket", p(api_socket)])
        .env_remove("NOTIFY_SOCKET");
    run
}

#[test]
fn config_check_exit_codes_and_messages() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.toml");
    std::fs::write(dir.path().join("bootstrap-token"), "abcdef.0123456789abcdef\n").expect("token");
    std::fs::write(
        &good,
        format!(
            "[cluster]\nendpoint = \"https://10.0.2.100:16443\"\nca_cert_hashes = [\"{HASH}\"]\n\
             bootstrap_token_file = \"bootstrap-token\"\n"
        ),
    )
    .expect("write");
    let o = chrysalis(&["config", "check", p(&good), "--hostname", "edge1"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("configuration OK") && out.contains("vk-sandbox as node edge1-sandbox"), "{out}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[cluster]\nendpoint = \"https://a:1\"\nca_cert_hashes = [\"sha256:zz\"]\nbootstrap_token_file = \"nope\"\n",
    )
    .expect("write");
    let o = chrysalis(&["config", "check", p(&bad)]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!(
            "error: cluster.ca_cert_hashes[0] in {}: \"sha256:zz\" is not sha256:<64 hex>; copy the value printed by kubeadm token create --print-join-command",
            bad.display()
        )),
        "{err}"
    );
    assert!(err.contains("error: cluster.bootstrap_token_file in "), "{err}");
    assert!(err.contains("chrysalis: 2 configuration errors"), "{err}");

    let o = chrysalis(&["config", "check", p(&bad), "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["ok"], false);
    assert_eq!(j["errors"][0]["key"], "cluster.ca_cert_hashes[0]");
    assert_eq!(j["errors"][0]["source"]["path"], p(&bad));

    // Syntax errors and missing files are errors too.
    std::fs::write(&bad, "[cluster\n").expect("write");
    let o = chrysalis(&["config", "check", p(&bad)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("(syntax)"), "{}", text(&o.stderr));
    let o = chrysalis(&["config", "check", p(&dir.path().join("missing.toml"))]);
    assert_eq!(o.status.code(), Some(1));

    // The layered form: flags name the layer files; a kernel argument overrides.
    let cmdline = dir.path().join("cmdline");
    std::fs::write(&cmdline, "ro chrysalis.set=sandboxd.listen=\"0.0.0.0:x\"\n").expect("write");
    let none = dir.path().join("none.toml");
    let o = chrysalis(&[
        "config",
        "check",
        "--config-baked",
        p(&good),
        "--config-esp",
        p(&none),
        "--config-disk",
        p(&none),
        "--cmdline",
        p(&cmdline),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr)
            .contains("sandboxd.listen in the kernel command line (chrysalis.set=sandboxd.listen=\"0.0.0.0:x\")"),
        "{}",
        text(&o.stderr)
    );

    let o = chrysalis(&["config", "default"]);
    assert!(o.status.success());
    let d = dir.path().join("default.toml");
    std::fs::write(&d, &o.stdout).expect("write");
    let o = chrysalis(&["config", "check", p(&d)]);
    assert!(o.status.success(), "the printed default checks clean: {}", text(&o.stderr));
}

#[test]
fn client_verbs_without_a_supervisor_fail_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = format!("unix:{}", dir.path().join("api.sock").display());
    let o = chrysalis(&["status", "--api", &sock]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("cannot reach the supervisor API"), "{}", text(&o.stderr));
    let o = chrysalis(&["status", "--api", "ftp://x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--api ftp://x"), "{}", text(&o.stderr));
}

#[test]
fn run_status_logs_update_reboot_and_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::create_dir_all(d.join("bin")).expect("bin");
    let fake = d.join("bin/sandboxd");
    std::fs::write(&fake, "#!/bin/sh\necho \"fake sandboxd $*\"\nexec sleep 600\n").expect("fake");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    std::fs::write(d.join("config.toml"), "[sandboxd]\nlisten = \"127.0.0.1:1\"\n").expect("config");
    let sock = d.join("api.sock");
    let api = format!("unix:{}", sock.display());
    let mut sup = run_under(d, &sock)
        .args(["--bin-dir", p(&d.join("bin")), "--hostname", "box", "--shutdown-timeout", "3"])
        .env("CHRYSALIS_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join("run.log")).expect("log"))
        .spawn()
        .expect("chrysalis run");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let o = chrysalis(&["status", "--api", &api, "--json"]);
        if o.status.success() {
            let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
            if j["health"]["services"][0]["state"] == "running" {
                break j;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no running sandboxd: {}",
            std::fs::read_to_string(d.join("run.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status["health"]["services"][0]["name"], "sandboxd");
    assert_eq!(status["health"]["ready"], false, "the fake does not answer /healthz");
    assert_eq!(status["update"]["state"], "unavailable");
    let o = chrysalis(&["status", "--api", &api]);
    assert!(o.status.success());
    let human = text(&o.stdout);
    assert!(human.contains("sandboxd  running"), "{human}");
    assert!(human.contains("cluster     none configured"), "{human}");

    let o = chrysalis(&["logs", "sandboxd", "--api", &api, "--tail", "10"]);
    assert!(o.status.success());
    let logs = text(&o.stdout);
    assert!(logs.contains("fake sandboxd --config"), "{logs}");
    let o = chrysalis(&["logs", "nope", "--api", &api]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("unknown service \"nope\""), "{}", text(&o.stderr));

    let bundle = d.join("x.chrysalis-bundle");
    std::fs::write(&bundle, b"not a bundle").expect("bundle");
    let o = chrysalis(&["update", "apply", p(&bundle), "--api", &api]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("updates unavailable: not running from an A/B image"), "{}", text(&o.stderr));
    let o = chrysalis(&["update", "status", "--api", &api, "--json"]);
    assert!(o.status.success());
    let o = chrysalis(&["reboot", "--api", &api]);
    assert_eq!(o.status.code(), Some(1), "no NOTIFY_SOCKET and no --reboot-command: refused");
    assert!(text(&o.stderr).contains("reboot refused"), "{}", text(&o.stderr));

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sup.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Some(s) = sup.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "chrysalis run did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(code.success(), "{code:?}");
    assert!(!sock.exists());
}

#[test]
fn run_exits_on_config_error_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("config.toml"), "[sandboxd]\nlisten = \"nowhere\"\n").expect("config");
    let o = run_under(d, &d.join("s"))
        .arg("--exit-on-config-error")
        .env("CHRYSALIS_LOG_FORMAT", "text")
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("sandboxd.listen") && err.contains("\"nowhere\" is not an ip:port address"), "{err}");
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).permissions().mode() & 0o7777
}

/// Starts `chrysalis run` under `d` with the fake sandboxd and waits until its socket answers;
/// returns the child and `status --json`.
fn start_supervisor(d: &Path, sock: &Path, log: &str) -> (std::process::Child, serde_json::Value) {
    let api = format!("unix:{}", sock.display());
    let mut sup = run_under(d, sock)
        .args(["--bin-dir", p(&d.join("bin")), "--hostname", "box", "--shutdown-timeout", "3"])
        .env("CHRYSALIS_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join(log)).expect("log"))
        .spawn()
        .expect("chrysalis run");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = chrysalis(&["status", "--api", &api, "--json"]);
        if o.status.success() {
            return (sup, serde_json::from_slice(&o.stdout).expect("json"));
        }
        if Instant::now() > deadline || sup.try_wait().expect("wait").is_some() {
            let _ = sup.kill();
            panic!("the supervisor did not answer: {}", std::fs::read_to_string(d.join(log)).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn stop_supervisor(mut sup: std::process::Child) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sup.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(15);
    while sup.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = sup.kill();
            panic!("chrysalis run did not stop");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The remote API beyond loopback: TLS with a certificate minted on first boot (fingerprint in
/// `status`, stable across restarts), sandboxd's root token minted once and handed out only
/// with the bearer token, no trust = no connection, and the connection cap closing the one too
/// many. Every secret the supervisor writes is 0600 in a 0700 directory.
#[test]
fn remote_api_serves_tls_hands_out_the_sandboxd_token_and_caps_connections() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::create_dir_all(d.join("bin")).expect("bin");
    let fake = d.join("bin/sandboxd");
    std::fs::write(&fake, "#!/bin/sh\necho \"fake sandboxd $*\"\nexec sleep 600\n").expect("fake");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    std::fs::write(d.join("api-token"), "admin-token\n").expect("api token");
    std::fs::write(
        d.join("config.toml"),
        format!(
            "[supervisor]\napi_listen = \"0.0.0.0:{port}\"\napi_token_file = \"api-token\"\n\
             [sandboxd]\nlisten = \"127.0.0.1:1\"\n"
        ),
    )
    .expect("config");
    let sock = d.join("api.sock");
    let api = format!("unix:{}", sock.display());
    let (sup, status) = start_supervisor(d, &sock, "run.log");

    // The minted certificate serves the API (sandboxd listens on loopback: plain).
    let tls = &status["tls"];
    assert_eq!(tls.as_array().map(Vec::len), Some(1), "{status}");
    let fp = tls[0]["fingerprint"].as_str().expect("fingerprint").to_string();
    assert_eq!((fp.len(), tls[0]["minted"].as_bool()), (95, Some(true)), "{tls}");
    assert_eq!(tls[0]["surfaces"], serde_json::json!(["api"]));
    let human = text(&chrysalis(&["status", "--api", &api]).stdout);
    assert!(
        human.contains(&format!("tls         SHA-256 {fp} (self-signed, minted by the box; serves api)")),
        "{human}"
    );

    // The secrets and the generated config: 0600 in 0700 directories.
    let st = d.join("state");
    let token = std::fs::read_to_string(st.join("secrets/sandboxd-token")).expect("minted token");
    let token = token.trim().to_string();
    assert_eq!(token.len(), 64);
    for (file, dir) in [
        (st.join("secrets/sandboxd-token"), st.join("secrets")),
        (st.join("tls/key.pem"), st.join("tls")),
        (d.join("run/sandboxd.json"), d.join("run")),
        (st.join("logs/sandboxd.log"), st.join("logs")),
    ] {
        assert_eq!((mode(&file), mode(&dir)), (0o600, 0o700), "{}", file.display());
    }
    assert_eq!(mode(&st.join("sandboxd")), 0o700);
    let generated: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("run/sandboxd.json")).expect("json")).expect("json");
    assert_eq!(generated["api_token_file"], p(&st.join("secrets/sandboxd-token")));
    assert!(generated.get("tls_cert_file").is_none(), "sandboxd on loopback serves plain HTTP");

    // The token on the local socket, and remotely with the bearer token over verified TLS.
    let o = chrysalis(&["token", "show", "sandboxd", "--api", &api]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{token}\n"));
    let https = format!("https://127.0.0.1:{port}");
    let tok = p(&d.join("api-token")).to_string();
    fn with<'a>(base: [&'a str; 4], extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        args
    }
    let base = ["--api", https.as_str(), "--api-token-file", tok.as_str()];

    let o = chrysalis(&[&["token", "show", "sandboxd"][..], &with(base, &["--api-fingerprint", &fp])].concat());
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{token}\n"));
    let o =
        chrysalis(&[&["status", "--json"][..], &with(base, &["--api-ca-file", p(&st.join("tls/cert.pem"))])].concat());
    assert!(o.status.success(), "{}", text(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["tls"][0]["fingerprint"], fp.as_str());
    assert!(!text(&o.stdout).contains(&token), "the status shows the token");
    // Without the bearer token: 401. A wrong fingerprint, no trust, or plain HTTP: no answer.
    let o = chrysalis(&["token", "show", "sandboxd", "--api", &https, "--api-fingerprint", &fp]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("missing or invalid bearer token"), "{}", text(&o.stderr));
    let zeros = "00".repeat(32);
    let o = chrysalis(&[&["token", "show", "sandboxd"][..], &with(base, &["--api-fingerprint", &zeros])].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(!text(&o.stdout).contains(&token) && text(&o.stderr).contains("TLS"), "{}", text(&o.stderr));
    let o = chrysalis(&[&["token", "show", "sandboxd"][..], &with(base, &[])].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--api-fingerprint"), "{}", text(&o.stderr));
    let plain = format!("http://127.0.0.1:{port}");
    let o = chrysalis(&["token", "show", "sandboxd", "--api", &plain, "--api-token-file", &tok]);
    assert_eq!(o.status.code(), Some(1), "plain HTTP to the TLS port");

    // The connection cap (64 on the remote API): the 65th connection is closed at once, and the
    // API answers again once the others go.
    let held: Vec<std::net::TcpStream> =
        (0..64).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    extra.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let n = std::io::Read::read(&mut extra, &mut buf).unwrap_or(0);
    assert!(n == 0 && started.elapsed() < Duration::from_secs(3), "the connection over the cap was kept");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = chrysalis(&[&["status"][..], &with(base, &["--api-fingerprint", &fp])].concat());
        if o.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "the API did not come back: {}", text(&o.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
    stop_supervisor(sup);

    // A restart keeps the certificate (pinned fingerprints stay valid) and the token.
    let (sup, status) = start_supervisor(d, &sock, "run2.log");
    assert_eq!(status["tls"][0]["fingerprint"], fp.as_str());
    let o = chrysalis(&["token", "show", "sandboxd", "--api", &api]);
    assert_eq!(text(&o.stdout), format!("{token}\n"));
    stop_supervisor(sup);
}

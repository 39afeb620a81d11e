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

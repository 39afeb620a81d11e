//! The public Python SDK (`cocoonstack-sandbox` 0.1.19 from PyPI), unmodified, against silkd
//! on a Unix socket: `tests/sdk_smoke.py` drives the SDK's own `Sandbox`/`Conn` code paths.
//! `cargo xtask test` installs the SDK in a venv and sets `CHRYSALIS_PYTHON`; a plain
//! `cargo test` reports this test as ignored, with the reason.

mod common;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(feature = "sdk-tests"), ignore = "needs the public Python SDK: run through `cargo xtask test`")]
async fn public_sdk_against_silkd() {
    let python = std::env::var("CHRYSALIS_PYTHON")
        .expect("CHRYSALIS_PYTHON must name a python with cocoonstack-sandbox installed (cargo xtask test sets it)");
    let server = common::Server::start().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk_smoke.py");
    let run = tokio::process::Command::new(&python).arg(script).arg(&server.path).output();
    let out =
        tokio::time::timeout(Duration::from_secs(120), run).await.expect("sdk smoke in time").expect("run python");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "sdk smoke failed:\n{stdout}\n{stderr}");
}

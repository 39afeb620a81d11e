#![cfg(feature = "e2e")]
//! End-to-end tests of the real `sandboxd` binary with real QEMU VMs (issue #3).
//!
//! Each test writes a config into a fresh temp dir (data dir, token file, a `base` pool), runs
//! `sandboxd` as a child process on a free loopback port (`test_infra::sandboxd::Harness`) and
//! drives it over HTTP (a tiny blocking client there) or through the public Python SDK (`tests/sdk/e2e.py`, interpreter from
//! `CHRYSALIS_PYTHON`). Needs the built-image catalog (`cargo xtask vm-image base`) and
//! `qemu-system-x86_64`; `cargo xtask test` provides both and enables the `e2e` feature.
//!
//! At the end of every test, sandboxd and every QEMU whose command line names the temp dir are
//! killed, and the test asserts that none is left. The tests take a process-wide lock so they
//! run one at a time even without `--test-threads=1` (2 cores, TCG).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use test_infra::sandboxd::{qemu_pids, wait_for, Harness, TOKEN};

/// How long the SDK suite may run.
const SDK_TIMEOUT: Duration = Duration::from_secs(600);

/// Serializes the tests: each boots several TCG VMs.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    // A test that panicked while holding the lock left nothing shared behind: keep going.
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn sandboxd(pools: serde_json::Value) -> Harness {
    Harness::new(Path::new(env!("CARGO_BIN_EXE_sandboxd")), pools)
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
    let h = sandboxd(json!([{"template": "base", "warm": 2}]));
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
    let mut h = sandboxd(json!([{"template": "base", "warm": 2}]));
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
    let h = sandboxd(json!([{"template": "base", "warm": 1}]));
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
    // The claim leaves the listing first; its VM is destroyed right after
    // (QEMU stopped, then its directory removed), so wait for both.
    wait_for("the reaped VM's QEMU to exit and its dir to go", Duration::from_secs(10), || {
        (qemu_pids(&vm_dir).is_empty() && !h.vm_dirs().contains(&claimed_vm)).then_some(())
    });
    let (s, v) = h.exec(&id, &token, &["true"]);
    assert_eq!(s, 404, "a reaped sandbox must be unknown: {v}");
    h.wait_full("base");
    h.assert_vms(1, "after the reap, only the warm pool");
    h.finish();
}

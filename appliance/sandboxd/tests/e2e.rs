#![cfg(feature = "e2e")]
//! End-to-end tests of the real `sandboxd` binary with real QEMU VMs (issue #3).
//!
//! Each test writes a config into a fresh temp dir (data dir, token file, a `base` pool), runs
//! `sandboxd` as a child process on a free loopback port (`test_infra::sandboxd::Harness`) and
//! drives it over HTTP (a tiny blocking client there). The public Python SDK suite
//! (`tests/sdk/e2e.py`) runs in `secure_e2e.rs`, over plain HTTP and TLS. Needs the built-image
//! catalog (`cargo xtask vm-image base`) and `qemu-system-x86_64`; `cargo xtask test` provides
//! both and enables the `e2e` feature.
//!
//! At the end of every test, sandboxd and every QEMU whose command line names the temp dir are
//! killed, and the test asserts that none is left. The tests take a process-wide lock so they
//! run one at a time even without `--test-threads=1` (2 cores, TCG).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use sandboxd_api::{ClaimRequest, PoolConfig, PoolList};
use test_infra::sandboxd::{qemu_pids, wait_for, Harness};

/// Serializes the tests: each boots several TCG VMs.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    // A test that panicked while holding the lock left nothing shared behind: keep going.
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn sandboxd(pools: Vec<PoolConfig>) -> Harness {
    Harness::new(Path::new(env!("CARGO_BIN_EXE_sandboxd")), pools)
}

/// `kill -9` with claims live and a refill in flight: claims survive, nothing leaks, the pool refills.
#[test]
fn restart_after_kill9_keeps_claims_and_leaks_nothing() {
    let _serial = serial();
    let mut h = sandboxd(vec![PoolConfig::warm("base", 2)]);
    h.wait_full("base");
    h.assert_vms(2, "a full pool of 2");
    let mut claims = Vec::new();
    for n in 0..2 {
        let (id, token) = h.claim(&ClaimRequest {
            ttl_seconds: Some(600),
            claim_ref: Some(format!("r{n}")),
            ..ClaimRequest::new("base")
        });
        // Leave a mark in the guest: after the restart it proves the claim kept its VM.
        let (s, v) = h.exec(&id, &token, &["sh", "-c", &format!("echo {id} > /tmp/mark")]);
        assert_eq!(s, 200, "exec before the restart: {v}");
        claims.push((id, token));
    }
    // Raise the target so a refill is surely in flight at the kill (`pools.json` keeps it).
    let pools = PoolList { pools: vec![PoolConfig::warm("base", 3)] };
    h.root("PUT", "/v1/pools", Some(serde_json::to_value(pools).expect("pools")));
    let refilling = wait_for("a refill in flight", Duration::from_secs(5), || {
        let r = h.pool("base").refilling;
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
    assert_eq!(h.info().claimed, 2);
    // A wrong token still answers 404 after the restart (the journal kept the tokens).
    let (s, _) = h.exec(&claims[0].0, &claims[1].1, &["true"]);
    assert_eq!(s, 404);
    h.wait_full("base");
    assert_eq!(h.pool("base").target, 3, "the PUT target survives the restart");
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

/// A paused warm VM outlives a `kill -9` of sandboxd and is warm again after the restart (not
/// rebuilt); claimed after waiting paused it runs on the host's time; a 2-second lease is
/// reaped within seconds and its VM is destroyed.
#[test]
fn short_lease_is_reaped_and_its_vm_destroyed() {
    let _serial = serial();
    let mut h = sandboxd(vec![PoolConfig::warm("base", 1)]);
    h.wait_full("base");
    h.assert_vms(1, "a full pool of 1");
    let before = h.vm_dirs();
    h.kill9();
    h.start();
    h.wait_full("base");
    h.assert_vms(1, "after a restart, the pool of 1");
    assert_eq!(h.vm_dirs(), before, "the paused warm VM was not re-adopted\n{}", h.logs());
    assert!(h.logs().contains("is warm again"), "{}", h.logs());
    let claimed_vm = before.iter().next().cloned().expect("one warm VM");
    // The warm VM was made at the background CPU weight and waits paused, its clock standing
    // still; the claim gives it the normal weight and the host's time.
    let vm_dir = h.dir.path().join("data/vms/vms").join(&claimed_vm);
    let qemu_pid = vmm::lifecycle::VmRecord::load(&vm_dir).expect("vm.json").expect("a record").vm.pid;
    let weight = || vmm::jail::inspect::process_jail(qemu_pid).and_then(|j| j.cpu_weight);
    assert_eq!(weight(), Some(vmm::jail::CpuWeight::Background), "a warm VM runs in the background");
    std::thread::sleep(Duration::from_secs(4));
    let t0 = Instant::now();
    let (id, token) = h.claim(&ClaimRequest { ttl_seconds: Some(2), ..ClaimRequest::new("base") });
    let (s, v) = h.exec(&id, &token, &["echo", "leased"]);
    assert_eq!((s, v["stdout"].as_str()), (200, Some("leased\n")), "{v}");
    let (s, v) = h.exec(&id, &token, &["date", "+%s"]);
    let host = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now").as_secs_f64();
    let guest: f64 = v["stdout"].as_str().and_then(|o| o.trim().parse().ok()).unwrap_or_else(|| panic!("{s} {v}"));
    assert!((host - guest).abs() <= 2.0, "the guest clock is {:.1} s off the host's after the pause", host - guest);
    assert_eq!(weight(), Some(vmm::jail::CpuWeight::Normal), "a claimed VM runs at the normal weight");
    wait_for("the lease to be reaped", Duration::from_secs(12), || (!h.sandbox_ids().contains(&id)).then_some(()));
    let reaped_after = t0.elapsed();
    println!("2 s lease reaped after {reaped_after:?}");
    assert!(reaped_after <= Duration::from_secs(10), "reaped only after {reaped_after:?}");
    assert!(reaped_after >= Duration::from_secs(2), "reaped before its deadline: {reaped_after:?}");
    let vm_dir = vm_dir.display().to_string();
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

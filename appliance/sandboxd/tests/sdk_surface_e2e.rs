#![cfg(feature = "e2e")]
//! The SDK's surface beyond the core verbs (issue #16), end to end: the real `sandboxd` binary,
//! real QEMU VMs, and the unmodified public SDK with its LangChain and OpenAI Agents adapters
//! (`tests/sdk/surface.py`), each with its default settings.
//!
//! One sandboxd with a `base` pool, an `rt` pool (the adapters' default `rt:24.04` is the
//! short name of the catalog's `ghcr.io/cocoonstack/sandbox/rt:24.04`, an alias of `rt`) and a
//! medium `base` pool whose sandboxes hibernate after 2 idle seconds.
//!
//! Needs the built-image catalog, `qemu-system-x86_64` and `CHRYSALIS_PYTHON` (the SDK venv with
//! the adapters); `cargo xtask test` provides all three.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use sandboxd_api::{CheckpointList, ClaimRequest, Info, PoolConfig, SandboxList, VolumeConfig};
use test_infra::sandboxd::{Harness, TOKEN};

/// How long the pools may take to fill after a restart.
const FILL: Duration = Duration::from_secs(300);
/// How long the surface script may take.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(900);

#[test]
fn sdk_surface_and_adapters_with_their_defaults() {
    let python = std::env::var_os("CHRYSALIS_PYTHON").unwrap_or_else(|| {
        panic!(
            "CHRYSALIS_PYTHON is unset: point it at a python with tests/python-requirements.txt installed \
             (cargo xtask test does)"
        )
    });
    // A medium `base` pool hibernates its sandboxes after 2 idle seconds.
    let idle =
        PoolConfig { size: Some("medium".into()), idle_hibernate_seconds: Some(2), ..PoolConfig::warm("base", 1) };
    let preview = std::net::SocketAddr::from(([127, 0, 0, 1], test_infra::sandboxd::free_port()));
    let h = Harness::with_config(
        Path::new(env!("CARGO_BIN_EXE_sandboxd")),
        vec![PoolConfig::warm("base", 1), PoolConfig::warm("rt", 1), idle],
        |c| {
            c.preview_listen = Some(preview);
            // The catalog volume `surface.py` attaches (made at start, 32 MiB of ext4).
            c.volumes = vec![VolumeConfig { name: "datasets".into(), size_mib: 32 }];
        },
    );
    h.wait_full("base");
    h.wait_full("rt");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/surface.py");
    h.run_python(&python, &script, &[h.addr.clone(), TOKEN.to_string()], "surface", SCRIPT_TIMEOUT, "sdk surface ok");
    assert!(h.sandbox_ids().is_empty(), "claims left behind");

    // `kill -9` in the middle of a fork, a checkpoint and a hibernate, each `after` ms into
    // it: after a restart nothing is lost or half-made, whatever point the kill hit.
    let mut h = h;
    for (verb, after) in [("fork", 300), ("checkpoint", 100), ("hibernate", 100)] {
        crash_mid(&mut h, verb, Duration::from_millis(after));
    }
    h.finish();
}

/// Starts `verb` on a fresh `rt` sandbox, kills sandboxd `after` into it, restarts, and checks
/// the invariants: the sandbox is still claimed and answers (waking if it hibernated); every
/// claim has its VM or its snapshot; the QEMU processes are exactly the warm VMs and the
/// claimed, awake sandboxes; snapshots are only what a claim or a checkpoint needs.
fn crash_mid(h: &mut Harness, verb: &str, after: Duration) {
    println!("== kill -9 {after:?} into a {verb}");
    h.wait_full("rt");
    let (id, token) = h.claim(&ClaimRequest::new("rt"));
    let (s, v) = h.exec(&id, &token, &["sh", "-c", "echo state > /srv/crash.txt"]);
    assert_eq!(s, 200, "{v}");
    let (path, body) = match verb {
        "fork" => (format!("/v1/sandboxes/{id}/fork"), serde_json::json!({"token": token, "count": 2})),
        "checkpoint" => (format!("/v1/sandboxes/{id}/checkpoint"), serde_json::json!({"token": token})),
        _ => (format!("/v1/sandboxes/{id}/hibernate"), serde_json::json!({})),
    };
    let auth = if verb == "hibernate" { &token } else { TOKEN };
    // Sent, not awaited: sandboxd dies before it answers (or just after).
    let body = body.to_string();
    let mut conn = std::net::TcpStream::connect(&h.addr).expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {auth}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("send");
    std::thread::sleep(after);
    h.kill9();
    drop(conn);
    h.start();
    h.wait_full("rt");
    // What the restart found (for the reader: which point the kill hit).
    let logs = h.logs();
    let start = logs.rfind("---- sandboxd run").unwrap_or(0);
    for l in logs[start..].lines().filter(|l| l.contains("interrupted") || l.contains("reconciled")) {
        println!("  {l}");
    }
    let ids = h.sandbox_ids();
    assert!(ids.contains(&id), "the sandbox was lost: {ids:?}\n{}", h.logs());
    let (s, v) = h.exec(&id, &token, &["cat", "/srv/crash.txt"]);
    if s != 200 {
        // The guests' side of it (their agents log each mux session), for the reader.
        for vm in h.vm_dirs() {
            let log = h.dir.path().join("data/vms/vms").join(&vm).join("console.log");
            let c = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = c.lines().collect();
            println!(
                "---- console of {vm} (last 20 lines) ----\n{}",
                lines[lines.len().saturating_sub(20)..].join("\n")
            );
        }
    }
    assert_eq!((s, v["stdout"].as_str()), (200, Some("state\n")), "{v}\n{}", h.logs());
    // Every claim is served; a child a fork finished before the kill is a full sandbox.
    let info: Info = test_infra::sandboxd::wait_for("every pool full", FILL, || {
        let info: Info = h.root_as("GET", "/v1/info", None);
        info.pools.iter().all(|p| p.warm == p.target && p.refilling == 0).then_some(info)
    });
    let list: SandboxList = h.root_as("GET", "/v1/sandboxes", None);
    let warm: usize = info.pools.iter().map(|p| p.warm).sum();
    let awake = list.sandboxes.iter().filter(|r| !r.hibernated).count();
    h.assert_vms(warm + awake, &format!("after a kill -9 mid-{verb}: warm + awake claims, nothing half-made"));
    let checkpoints: CheckpointList = h.root_as("GET", "/v1/checkpoints", None);
    println!(
        "after the restart: {} claims, {} checkpoints, {} bytes of snapshots",
        list.sandboxes.len(),
        checkpoints.checkpoints.len(),
        info.checkpoint_disk_bytes
    );
    for c in checkpoints.checkpoints {
        h.root("DELETE", &format!("/v1/checkpoints/{}", c.id), None);
    }
    for r in list.sandboxes {
        let tok = if r.id == id { token.clone() } else { TOKEN.to_string() };
        let (s, _) = h.call("POST", &format!("/v1/sandboxes/{}/release", r.id), Some(&tok), None);
        assert_eq!(s, 204);
    }
    // With nothing claimed and no checkpoint, no snapshot is left (the gc runs every minute
    // and at start; a restart runs it now).
    h.kill9();
    h.start();
    let snaps = std::fs::read_dir(h.dir.path().join("data/snapshots")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(snaps, 0, "snapshots left after everything ended\n{}", h.logs());
}

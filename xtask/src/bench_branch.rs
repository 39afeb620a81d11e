//! Branching benchmarks with the real `sandboxd` binary and real `rt` VMs: a fork of 4, a
//! checkpoint, and a claim from a checkpoint, each the median of `runs`. Under TCG the
//! figures are this machine's; the anchor is upstream's clone on KVM.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sandboxd_api::{
    CheckpointReply, CheckpointRequest, ClaimRequest, Config, ForkReply, ForkRequest, Grant, PoolConfig,
};

use super::bench::{ms, percentile, Figure};
use super::bench_sandboxd::{post_json, wait_warm};

/// Runs the branching figures on a node with one warm `rt` VM.
pub async fn run(figures: &mut Vec<Figure>, bin: &std::path::Path, runs: usize) -> Result<()> {
    let dir = tempfile::Builder::new().prefix("chrysalis-bench-branch-").tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let addr = listen.to_string();
    let config = Config {
        listen,
        data_dir: dir.path().join("data"),
        pools: vec![PoolConfig::warm("rt", 1)],
        refill_concurrency: 1,
        boot_timeout_secs: 300,
        ..Config::default()
    };
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
    let mut child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(&config_path)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .context("starting sandboxd")?;
    let result = measure(figures, &addr, runs.max(1)).await;
    let _ = child.kill().await;
    for pid in test_infra::qemu_processes_under(dir.path()) {
        // SAFETY: plain kill(2) on a pid we just listed as our own QEMU.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    result
}

async fn release(addr: &str, g: &Grant) -> Result<()> {
    let path = format!("/v1/sandboxes/{}/release", g.id);
    super::bench_sandboxd::post_status(addr, &path, &g.token).await
}

async fn measure(figures: &mut Vec<Figure>, addr: &str, runs: usize) -> Result<()> {
    wait_warm(addr, 1, Duration::from_secs(900)).await?;
    let parent: Grant = post_json(addr, "/v1/claim", &ClaimRequest::new("rt")).await?;
    let accel = vmm::accel::probe();
    let (mut forks, mut checkpoints, mut claims) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let reply: ForkReply = post_json(
            addr,
            &format!("/v1/sandboxes/{}/fork", parent.id),
            &ForkRequest { token: parent.token.clone(), count: 4, ..ForkRequest::default() },
        )
        .await?;
        forks.push(t.elapsed());
        for c in &reply.children {
            release(addr, c).await?;
        }
        let t = Instant::now();
        let ck: CheckpointReply = post_json(
            addr,
            &format!("/v1/sandboxes/{}/checkpoint", parent.id),
            &CheckpointRequest { token: parent.token.clone(), name: None },
        )
        .await?;
        checkpoints.push(t.elapsed());
        let t = Instant::now();
        let g: Grant =
            post_json(addr, &format!("/v1/checkpoints/{}/claim", ck.checkpoint.id), &serde_json::json!({})).await?;
        claims.push(t.elapsed());
        release(addr, &g).await?;
    }
    for v in [&mut forks, &mut checkpoints, &mut claims] {
        v.sort();
    }
    let anchor = "anchor: upstream fork/clone 26–44 ms per VM on KVM";
    figures.push(Figure {
        name: format!("fork of 4 (rt, {accel}), p50 of {runs}"),
        value: ms(percentile(&forks, 0.5)),
        target: anchor,
    });
    figures.push(Figure {
        name: format!("checkpoint (rt, {accel}), p50 of {runs}"),
        value: ms(percentile(&checkpoints, 0.5)),
        target: "reported: a snapshot of a running sandbox (memory and disk overlay)",
    });
    figures.push(Figure {
        name: format!("claim from a checkpoint (rt, {accel}), p50 of {runs}"),
        value: ms(percentile(&claims, 0.5)),
        target: anchor,
    });
    Ok(())
}

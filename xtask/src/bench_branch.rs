//! Branching benchmarks with the real `sandboxd` binary and real `rt` VMs: a fork of 4, a
//! checkpoint, a claim from a checkpoint, a hibernate and a wake, each the median of `runs`;
//! then what 20 hibernated sandboxes hold (VM processes, snapshot bytes on disk, sandboxd's
//! RSS). Under TCG the figures are this machine's; the anchors are upstream's on KVM.

use std::time::{Duration, Instant};

use anyhow::Result;
use sandboxd_api::{CheckpointReply, CheckpointRequest, ClaimRequest, ForkReply, ForkRequest, Grant, PoolConfig};

use super::bench::{ms, percentile, Figure};
use super::bench_sandboxd::{post_json, wait_warm, BenchNode};

/// Runs the branching figures on a node with one warm `rt` VM, then the hibernation memory
/// figures on a node with a `base` pool of [`HIBERNATED`] (separate, so that the first figures
/// are not taken beside 20 idle emulated VMs).
pub async fn run(figures: &mut Vec<Figure>, bin: &std::path::Path, runs: usize) -> Result<()> {
    let node = BenchNode::start(bin, |c| c.pools = vec![PoolConfig::warm("rt", 1)])?;
    let r = measure(figures, &node.addr, runs.max(1)).await;
    node.stop().await;
    r?;
    let node = BenchNode::start(bin, |c| c.pools = vec![PoolConfig::warm("base", HIBERNATED)])?;
    let r = hibernated(figures, &node.addr, node.pid, node.dir.path()).await;
    node.stop().await;
    r
}

/// Sandboxes hibernated for the memory figure.
const HIBERNATED: usize = 20;

async fn release(addr: &str, g: &Grant) -> Result<()> {
    let path = format!("/v1/sandboxes/{}/release", g.id);
    super::bench_sandboxd::post_status(addr, &path, &g.token).await
}

async fn measure(figures: &mut Vec<Figure>, addr: &str, runs: usize) -> Result<()> {
    wait_warm(addr, 1, Duration::from_secs(900)).await?;
    let parent: Grant = post_json(addr, "/v1/claim", &ClaimRequest::new("rt")).await?;
    let accel = vmm::accel::probe();
    let (mut forks, mut checkpoints, mut claims) = (Vec::new(), Vec::new(), Vec::new());
    let (mut hibernates, mut wakes) = (Vec::new(), Vec::new());
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
        let t = Instant::now();
        super::bench_sandboxd::post_status(addr, &format!("/v1/sandboxes/{}/hibernate", parent.id), &parent.token)
            .await?;
        hibernates.push(t.elapsed());
        let t = Instant::now();
        super::bench_sandboxd::post_status(addr, &format!("/v1/sandboxes/{}/wake", parent.id), &parent.token).await?;
        wakes.push(t.elapsed());
    }
    for v in [&mut forks, &mut checkpoints, &mut claims, &mut hibernates, &mut wakes] {
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
    figures.push(Figure {
        name: format!("hibernate (rt, {accel}), p50 of {runs}"),
        value: ms(percentile(&hibernates, 0.5)),
        target: "reported: snapshot of memory and disk, then the VM stops",
    });
    figures.push(Figure {
        name: format!("wake (rt, {accel}), p50 of {runs}"),
        value: ms(percentile(&wakes, 0.5)),
        target: "budget: ≤ 15 s",
    });
    Ok(())
}

/// Claims and hibernates [`HIBERNATED`] `base` sandboxes, then reports what they hold.
async fn hibernated(figures: &mut Vec<Figure>, addr: &str, pid: u32, dir: &std::path::Path) -> Result<()> {
    wait_warm(addr, HIBERNATED as u64, Duration::from_secs(1800)).await?;
    let before = test_infra::qemu_processes_under(dir).len();
    let rss_before = super::bench::rss_kib(pid).unwrap_or(0);
    let mut grants = Vec::new();
    for _ in 0..HIBERNATED {
        let g: Grant = post_json(addr, "/v1/claim", &ClaimRequest::new("base")).await?;
        super::bench_sandboxd::post_status(addr, &format!("/v1/sandboxes/{}/hibernate", g.id), &g.token).await?;
        grants.push(g);
    }
    // The pool refills behind the claims: count the VMs of the hibernated sandboxes only.
    let info: sandboxd_api::Info = super::bench_sandboxd::get_json(addr, "/v1/info").await?;
    let running = test_infra::qemu_processes_under(dir).len();
    let warm_and_refilling: usize = info.pools.iter().map(|p| p.warm + p.refilling).sum();
    let held = running.saturating_sub(warm_and_refilling);
    let rss_after = super::bench::rss_kib(pid).unwrap_or(0);
    figures.push(Figure {
        name: format!("{HIBERNATED} hibernated sandboxes: VM processes held"),
        value: format!(
            "{held} (QEMUs before {before}, after {running}, of which warm or refilling {warm_and_refilling})"
        ),
        target: "target: 0 VM processes",
    });
    figures.push(Figure {
        name: format!("{HIBERNATED} hibernated sandboxes: state on disk / sandboxd RSS growth"),
        value: format!(
            "{:.1} MiB on disk / {:.1} MiB RSS",
            info.checkpoint_disk_bytes as f64 / 1048576.0,
            rss_after.saturating_sub(rss_before) as f64 / 1024.0
        ),
        target: "target: a few MiB of state in RAM (the snapshots live on disk)",
    });
    for g in &grants {
        release(addr, g).await?;
    }
    Ok(())
}

//! `cargo xtask bench density`: what a warm VM costs while it waits, with the real `sandboxd`
//! and real QEMU VMs (issue #17).
//!
//! A pool of `--density-vms` warm `base` VMs fills (clones of a golden whose RAM they map
//! copy-on-write, paused until claimed); then:
//! - proportional set size (PSS) per idle warm VM, from `smaps_rollup` of every QEMU (RSS
//!   beside it for comparison), plus the golden's RAM, held once per pool in a sealed memfd
//!   mapped by every clone; how many VMs of one pool fit in 8 GiB beside their golden;
//! - host CPU the idle warm VMs use together (their QEMUs' utime + stime over 10 s), scaled to
//!   100 VMs;
//! - claim latency over HTTP with paused warm VMs (the resume included), and the resume alone
//!   as sandboxd times it (`sandboxd_claim_resume_seconds`, mean).

use super::bench::{ms, percentile, Figure};
use super::bench_sandboxd::{get_json, post_json, wait_warm, BenchNode};
use anyhow::{Context, Result};
use sandboxd_api::{ClaimRequest, Grant, Info, PoolConfig};
use std::time::{Duration, Instant};

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// KiB of the goldens' RAM under `data`: each golden's sealed copy is allocated whole (no
/// holes, see `vmm::qemu::memory`), so it holds the RAM file's full size.
fn golden_ram_kib(data: &std::path::Path) -> u64 {
    let goldens = data.join("goldens");
    let Ok(rd) = std::fs::read_dir(goldens) else { return 0 };
    rd.flatten().filter_map(|e| std::fs::metadata(e.path().join("memory")).ok()).map(|m| m.len() / 1024).sum()
}

fn mean_from_metrics(text: &str, name: &str) -> Option<Duration> {
    let none = std::collections::HashMap::new();
    crate::bench_vnode::mean_between(&none, &crate::bench_vnode::samples(text), name, "").map(Duration::from_secs_f64)
}

/// sandboxd's `/metrics` at `addr`, as root when `token` is given.
pub(crate) async fn metrics_text(addr: &str, token: Option<&str>) -> Result<String> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = hyper::Request::get("/metrics").header("host", addr);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req.body(http_body_util::Full::new(hyper::body::Bytes::new()))?;
    let body = http_body_util::BodyExt::collect(sender.send_request(req).await?.into_body()).await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

pub async fn run(figures: &mut Vec<Figure>, bin: &std::path::Path, vms: u64, claims: u64) -> Result<()> {
    let node = BenchNode::start(bin, |c| {
        c.advertise_addr = Some(c.listen.to_string());
        c.pools = vec![PoolConfig::warm("base", vms as usize)];
        c.boot_timeout_secs = 180;
        c.max_vms = Some(vms as usize + claims as usize + 2);
        c.max_memory_mib = Some((vms + claims + 2) * 512);
    })?;
    let addr = node.addr.clone();
    let data = node.dir.path().join("data");
    let result = async {
        let filled = wait_warm(&addr, vms, Duration::from_secs(1200)).await?;
        let accel = vmm::accel::probe();
        eprintln!("bench density: {vms} warm base VMs ({accel}) after {filled:?}");
        // Let the last clone settle (its probe and reseed ran just before it was paused).
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pids = test_infra::qemu_processes_under(node.dir.path());
        let usage: Vec<(u64, u64)> = pids.iter().filter_map(|p| test_infra::rss_pss_kib(*p)).collect();
        anyhow::ensure!(!usage.is_empty(), "no QEMU process found under {}", node.dir.path().display());
        let n = usage.len() as f64;
        let pss = usage.iter().map(|u| u.1).sum::<u64>() as f64 / n / 1024.0;
        let rss = usage.iter().map(|u| u.0).sum::<u64>() as f64 / n / 1024.0;
        let golden = golden_ram_kib(&data) as f64 / 1024.0;
        figures.push(Figure {
            name: format!("PSS per idle warm VM (base, small, {accel}, {} VMs)", usage.len()),
            value: format!("{pss:.1} MiB (RSS {rss:.1} MiB)"),
            target: "target ≤ 24 MiB (was 188 MiB RSS)",
        });
        figures.push(Figure {
            name: "golden RAM, held once per pool (sealed memfd)".into(),
            value: format!("{golden:.1} MiB ({:.1} MiB per VM here)", golden / n),
            target: "shared by every clone of the pool",
        });
        figures.push(Figure {
            name: format!("warm VMs of one pool that fit in 8 GiB, its golden included ({accel})"),
            value: format!("{:.0}", (8192.0 - golden) / pss),
            target: "target ≥ 300",
        });
        // CPU of the idle (paused) warm VMs.
        let ticks = |pids: &[u32]| pids.iter().filter_map(|p| cpu_ticks(*p)).sum::<u64>();
        // SAFETY: sysconf(3) reads a constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let (t0, c0) = (Instant::now(), ticks(&pids));
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (secs, c1) = (t0.elapsed().as_secs_f64(), ticks(&pids));
        let pct = (c1.saturating_sub(c0)) as f64 / hz / secs * 100.0;
        figures.push(Figure {
            name: format!("host CPU of idle warm VMs, scaled to 100 ({} measured, {accel})", pids.len()),
            value: format!("{:.2} % of one core", pct * 100.0 / n),
            target: "target < 5 % of one core",
        });
        // Claims with paused warm VMs: the resume is inside.
        let mut lat = Vec::new();
        for _ in 0..claims.min(vms) {
            let t = Instant::now();
            let _: Grant = post_json(&addr, "/v1/claim", &ClaimRequest::new("base")).await?;
            lat.push(t.elapsed());
        }
        lat.sort();
        let text = metrics_text(&addr, None).await?;
        let resume = mean_from_metrics(&text, "sandboxd_claim_resume_seconds").context("resume histogram")?;
        figures.push(Figure {
            name: format!("claim over HTTP, paused warm VM ({accel}, p50 of {})", lat.len()),
            value: ms(percentile(&lat, 0.5)),
            target: "target p50 ≤ 0.1 ms + resume (HTTP included here)",
        });
        figures.push(Figure {
            name: format!("resume of a paused warm VM inside the claim ({accel}, mean)"),
            value: ms(resume),
            target: "reported beside the claim",
        });
        let info: Info = get_json(&addr, "/v1/info").await?;
        eprintln!("bench density: {} claimed, pools {:?}", info.claimed, info.pools.len());
        anyhow::Ok(())
    }
    .await;
    node.stop().await;
    result
}

//! sandboxd benchmarks: claim latency over HTTP on loopback, claims per second, refill rate
//! with real QEMU VMs, and sandboxd's own RSS idle and with 32 claims.
//!
//! Claim latency comes from `cargo bench -p sandboxd --bench claim` (optimized; a pool
//! pre-filled through the fake driver, since the claim path does no VM work by design);
//! refill rate and RSS come from the real `sandboxd` binary with real QEMU VMs.

use super::bench::Figure;
use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use sandboxd_api::{ClaimRequest, Config, Grant, Info, PoolConfig};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::{Duration, Instant};

fn rss_mib(pid: u32) -> Option<f64> {
    super::bench::rss_kib(pid).map(|k| k as f64 / 1024.0)
}

pub(crate) async fn get_json<T: DeserializeOwned>(addr: &str, path: &str) -> Result<T> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::get(path).header("host", addr).body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&bytes)?)
}

pub(crate) async fn post_json<B: Serialize, T: DeserializeOwned>(addr: &str, path: &str, body: &B) -> Result<T> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::post(path)
        .header("host", addr)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{path} answered {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// A `POST` with a bearer token and no body; any non-2xx status is an error.
pub(crate) async fn post_status(addr: &str, path: &str, token: &str) -> Result<()> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::post(path)
        .header("host", addr)
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::new()))?;
    let status = sender.send_request(req).await?.status();
    if !status.is_success() {
        bail!("{path} answered {status}");
    }
    Ok(())
}

fn warm(info: &Info) -> u64 {
    info.pools.iter().map(|p| p.warm as u64).sum()
}

/// A claim from the `base` pool.
async fn claim_base(addr: &str) -> Result<Grant> {
    post_json(addr, "/v1/claim", &ClaimRequest::new("base")).await
}

pub(crate) async fn wait_warm(addr: &str, want: u64, budget: Duration) -> Result<Duration> {
    let t = Instant::now();
    loop {
        if let Ok(info) = get_json::<Info>(addr, "/v1/info").await {
            if warm(&info) >= want {
                return Ok(t.elapsed());
            }
        }
        if t.elapsed() > budget {
            bail!("pool did not reach {want} warm VMs within {budget:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the optimized claim-latency bench and collects its `FIGURE|…` lines.
pub fn claim_latency(figures: &mut Vec<Figure>) -> Result<()> {
    let out = std::process::Command::new("cargo")
        .args(["bench", "-p", "sandboxd", "--bench", "claim"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo bench -p sandboxd --bench claim")?;
    if !out.status.success() {
        bail!("the claim bench failed");
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut parts = line.splitn(4, '|');
        if parts.next() != Some("FIGURE") {
            continue;
        }
        let (Some(name), Some(value), Some(target)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let target: &'static str = Box::leak(target.to_string().into_boxed_str());
        figures.push(Figure { name: name.into(), value: value.into(), target });
    }
    Ok(())
}

/// A `sandboxd` on a loopback port over a temp dir, for the benchmarks: its config is the
/// default with `listen` and `data_dir` set, refill concurrency 2, a 300 s boot timeout, then
/// changed by the caller.
pub(crate) struct BenchNode {
    pub dir: tempfile::TempDir,
    child: tokio::process::Child,
    pub addr: String,
    pub pid: u32,
}

impl BenchNode {
    pub fn start(bin: &std::path::Path, change: impl FnOnce(&mut Config)) -> Result<BenchNode> {
        let dir = tempfile::Builder::new().prefix("chrysalis-bench-sandboxd-").tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut config = Config {
            listen,
            data_dir: dir.path().join("data"),
            refill_concurrency: 2,
            boot_timeout_secs: 300,
            ..Config::default()
        };
        change(&mut config);
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let child = tokio::process::Command::new(bin)
            .arg("--config")
            .arg(&config_path)
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .context("starting sandboxd")?;
        let pid = child.id().context("sandboxd pid")?;
        Ok(BenchNode { dir, child, addr: listen.to_string(), pid })
    }

    /// Kills sandboxd and every QEMU under its temp dir (claims go with their VMs).
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
        for pid in test_infra::qemu_processes_under(self.dir.path()) {
            // SAFETY: plain kill(2) on a pid we just listed as our own QEMU.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// Refill rate and sandboxd RSS with the real binary and real QEMU VMs.
pub async fn real_node(figures: &mut Vec<Figure>, bin: &std::path::Path, rss_claims: u64) -> Result<()> {
    let refill_batch = 4u64;
    // The budget holds the warm pool, the claims whose RSS is measured, and a golden builder
    // (TCG base VMs take far less than their nominal 512 MiB).
    let max_vms = refill_batch + rss_claims.max(refill_batch) + 2;
    let node = BenchNode::start(bin, |c| {
        c.advertise_addr = Some(c.listen.to_string());
        c.pools = vec![PoolConfig::warm("base", refill_batch as usize)];
        c.boot_timeout_secs = 180;
        c.max_vms = Some(max_vms as usize);
        c.max_memory_mib = Some(max_vms * 512);
    })?;
    let (addr, pid) = (node.addr.clone(), node.pid);
    let result = async {
        wait_warm(&addr, refill_batch, Duration::from_secs(600)).await?;
        let accel = vmm::accel::probe();
        tokio::time::sleep(Duration::from_secs(2)).await;
        figures.push(Figure {
            name: format!("sandboxd RSS, idle ({refill_batch} warm VMs)"),
            value: format!("{:.1} MiB", rss_mib(pid).context("rss")?),
            target: "lower is better",
        });
        // Refill: drain the pool by claiming, then time the refill back to target.
        for _ in 0..refill_batch {
            claim_base(&addr).await?;
        }
        let refill = wait_warm(&addr, refill_batch, Duration::from_secs(600)).await?;
        figures.push(Figure {
            name: format!("refill rate (clone from golden, base, {accel}, {refill_batch} VMs)"),
            value: format!("{:.2} VMs/s", refill_batch as f64 / refill.as_secs_f64()),
            target: "anchor: clone 26–44 ms per VM on KVM",
        });
        // RSS with 32 claims.
        let mut claimed = refill_batch;
        while claimed < rss_claims {
            wait_warm(&addr, 1, Duration::from_secs(600)).await?;
            claim_base(&addr).await?;
            claimed += 1;
        }
        figures.push(Figure {
            name: format!("sandboxd RSS with {claimed} claims"),
            value: format!("{:.1} MiB", rss_mib(pid).context("rss")?),
            target: "lower is better",
        });
        anyhow::Ok(())
    }
    .await;
    node.stop().await;
    result
}

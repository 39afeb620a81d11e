//! Claim latency over HTTP on loopback with a pre-filled pool (`cargo bench -p sandboxd
//! --bench claim`; `cargo xtask bench sandboxd` runs it and prints its figures).
//!
//! The claim path does no VM work by design (ownership transfer), so the pool is pre-filled
//! through the fake driver: the HTTP stack, auth, the pool lock, minting and the journal
//! write are the real ones. Prints one `FIGURE|name|value|target` line per figure.

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(idx.min(sorted.len().saturating_sub(1))).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

const CLAIMS: usize = 1000;

/// Claim latency and claims per second over a pre-filled pool.
async fn claim_latency() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let driver = sandboxd::test_utils::FakeDriver::new(dir.path());
    let mut opts = sandboxd::node::NodeOptions::new(dir.path().join("data"), sandboxd::test_utils::fake_catalog());
    opts.pools = vec![sandboxd::config::PoolConfig {
        template: "base".into(),
        net: None,
        size: None,
        warm: Some(2 * CLAIMS + 10),
        warm_max: None,
        idle_hibernate_seconds: None,
        archive_after_seconds: None,
        archive_delete_after_seconds: None,
    }];
    opts.refill_concurrency = 64;
    let node = sandboxd::Node::start(driver, opts).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while node.info().pools.iter().map(|p| p.warm).sum::<usize>() < 2 * CLAIMS + 10 {
        if Instant::now() > deadline {
            bail!("the fake pool did not pre-fill in time");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(sandboxd::http::serve(listener, sandboxd::http::app(Arc::clone(&node)), std::future::pending()));

    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let body = Bytes::from_static(br#"{"template":"base","ttl_seconds":600}"#);
    let mut lat = Vec::with_capacity(CLAIMS);
    let all = Instant::now();
    for _ in 0..CLAIMS {
        let req = hyper::Request::post("/v1/claim")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let t = Instant::now();
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        lat.push(t.elapsed());
        if !status.is_success() {
            bail!("claim answered {status}: {}", String::from_utf8_lossy(&bytes));
        }
    }
    let total = all.elapsed();
    lat.sort();
    println!(
        "FIGURE|claim latency over HTTP, {CLAIMS} claims, p50 / p90 / p99 / max|{} / {} / {} / {}|target p50 ≤ 0.1 ms, p99 ≤ 0.3 ms (upstream p50 0.2 ms, max 0.6 ms)",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.9)),
        ms(percentile(&lat, 0.99)),
        ms(*lat.last().context("no claims")?)
    );
    println!(
        "FIGURE|claims per second (one keep-alive connection)|{:.0}/s|higher is better",
        CLAIMS as f64 / total.as_secs_f64()
    );
    // The same claims without HTTP: what the node itself costs (pool pop, minting, journal).
    let key = sandboxd::pool::PoolKey::parse("base", None, None)?;
    let mut inproc = Vec::with_capacity(CLAIMS);
    for _ in 0..CLAIMS {
        let req = sandboxd::node::ClaimRequest { key: key.clone(), ttl: Duration::from_secs(600), claim_ref: None };
        let t = Instant::now();
        node.claim(req)?;
        inproc.push(t.elapsed());
    }
    inproc.sort();
    println!(
        "FIGURE|Node::claim in-process (no HTTP), {CLAIMS} claims, p50 / p99 / max|{} / {} / {}|the node's share of the HTTP figure",
        ms(percentile(&inproc, 0.5)),
        ms(percentile(&inproc, 0.99)),
        ms(*inproc.last().context("no claims")?)
    );
    node.shutdown();
    Ok(())
}


fn main() -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(claim_latency())
}

//! Claim latency over HTTP on loopback with a pre-filled pool (`cargo bench -p sandboxd
//! --bench claim`; `cargo xtask bench sandboxd` runs it and prints its figures).
//!
//! The claim path does no VM work by design (ownership transfer), so the pool is pre-filled
//! through the fake driver: the HTTP server (`httpd::serve`, as the daemon runs it), auth with
//! a root token, the pool lock, minting and the journal append are the real ones. Prints one
//! `FIGURE|name|value|target` line per figure: the headline is with auth on and refill running
//! (as on a real node, each claim kicks a background refill); then the same over TLS (one
//! keep-alive connection, the handshake not counted) and with 2,000 idle connections open;
//! three diagnostics split it into the HTTP path with refill stopped, `Node::claim` alone, and
//! the loopback floor (`GET /healthz`). The claims journal's log is not compacted during the
//! run (compaction runs off the claim path, once the log passes 1 MiB).

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The root token the bench's node requires.
const ROOT: &str = "bench-root-token-0123456789abcdef";
/// Idle connections held open for the loaded figure.
const IDLE_CONNECTIONS: usize = 2000;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(idx.min(sorted.len().saturating_sub(1))).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

const CLAIMS: usize = 1000;
/// Phases that each take `CLAIMS` VMs from the pool: HTTP with refill running, redirected from
/// a peer, over TLS, with idle connections open, HTTP with refill stopped, in-process.
const PHASES: usize = 6;

fn figure(name: &str, lat: &mut [Duration], target: &str) -> Result<()> {
    lat.sort();
    println!(
        "FIGURE|{name}, {} requests, p50 / p90 / p99 / max|{} / {} / {} / {}|{target}",
        lat.len(),
        ms(percentile(lat, 0.5)),
        ms(percentile(lat, 0.9)),
        ms(percentile(lat, 0.99)),
        ms(*lat.last().context("no claims")?)
    );
    Ok(())
}

/// A keep-alive HTTP/1.1 connection (plain TCP).
async fn plain(addr: std::net::SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// A keep-alive HTTP/1.1 connection over TLS (ALPN `http/1.1`), trusting `cert_der` only.
async fn tls(addr: std::net::SocketAddr, cert_der: Vec<u8>) -> Result<SendRequest<Full<Bytes>>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(cert_der))?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, stream).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// `CLAIMS` sequential claims (root token) over one keep-alive connection; returns latencies
/// and the total.
async fn http_claims(mut sender: SendRequest<Full<Bytes>>) -> Result<(Vec<Duration>, Duration)> {
    let body = Bytes::from_static(br#"{"template":"base","ttl_seconds":600}"#);
    let mut lat = Vec::with_capacity(CLAIMS);
    let all = Instant::now();
    for _ in 0..CLAIMS {
        let req = hyper::Request::post("/v1/claim")
            .header("host", "sandboxd")
            .header("authorization", format!("Bearer {ROOT}"))
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
    Ok((lat, all.elapsed()))
}

/// `CLAIMS` sequential `GET /healthz` round trips over one keep-alive connection.
async fn healthz_round_trips(addr: std::net::SocketAddr) -> Result<Vec<Duration>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut lat = Vec::with_capacity(CLAIMS);
    for _ in 0..CLAIMS {
        let req = hyper::Request::get("/healthz").header("host", addr.to_string()).body(Full::new(Bytes::new()))?;
        let t = Instant::now();
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        resp.into_body().collect().await?;
        lat.push(t.elapsed());
        if !status.is_success() {
            bail!("healthz answered {status}");
        }
    }
    Ok(lat)
}

/// Claim latency and claims per second over a pre-filled pool.
async fn claim_latency() -> Result<()> {
    httpd::raise_nofile_limit().context("raising the open-file limit for the idle connections")?;
    let dir = tempfile::tempdir()?;
    let driver = sandboxd::test_utils::FakeDriver::new(dir.path());
    let mut opts = sandboxd::node::NodeOptions::new(dir.path().join("data"), sandboxd::test_utils::fake_catalog());
    let prefill = PHASES * CLAIMS + 10;
    // Fake VMs take no memory: a budget that holds the whole pre-fill.
    opts.limits.budget = sandboxd::limits::Budget {
        max_vms: prefill * 2,
        max_memory_mib: (prefill as u64) * 2 * 512,
        max_disk_mib: sandboxd::limits::UNLIMITED_DISK_MIB,
    };
    opts.api_token = Some(ROOT.into());
    opts.pools = vec![sandboxd::config::PoolConfig::warm("base", prefill)];
    opts.refill_concurrency = 64;
    let node = sandboxd::Node::start(driver, opts).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while node.info().pools.iter().map(|p| p.warm).sum::<usize>() < prefill {
        if Instant::now() > deadline {
            bail!("the fake pool did not pre-fill in time");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(sandboxd::http::serve(listener, Arc::clone(&node), None, std::future::pending()));
    let pair = httpd::tls::self_signed(&["127.0.0.1".into()])?;
    let (chain, key) = httpd::tls::pair_der(&pair)?;
    let cert_der = chain[0].to_vec();
    let server_tls = httpd::tls::server_config(chain, key, httpd::tls::ALPN_HTTP1, None)?;
    let tls_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tls_addr = tls_listener.local_addr()?;
    tokio::spawn(sandboxd::http::serve(tls_listener, Arc::clone(&node), Some(server_tls), std::future::pending()));

    // 1. What a real node does: auth on, every claim kicks the refill, which refills in the
    //    background on the same runtime (here through the in-process fake driver).
    let (mut lat, total) = http_claims(plain(addr).await?).await?;
    figure(
        "claim latency over HTTP, auth on, refill running",
        &mut lat,
        "target p50 ≤ 0.1 ms, p99 ≤ 0.3 ms (upstream p50 0.2 ms, max 0.6 ms)",
    )?;
    println!(
        "FIGURE|claims per second (one keep-alive connection, auth on, refill running)|{:.0}/s|higher is better",
        CLAIMS as f64 / total.as_secs_f64()
    );

    // 1b. A claim redirected from a box with no warm VM (issue #19), shaped as SDK 0.1.19 sends
    //     it: the claim at the empty box, its `{"redirect"}` answer, the resend to the named
    //     peer with `no_redirect` (each box over its own keep-alive connection).
    let mut lat = redirected_claims(&dir, addr).await?;
    figure(
        "claim redirected from an empty box to a warm peer, over HTTP (2 requests)",
        &mut lat,
        "target: a warm local claim plus one loopback round trip (compare the first figure)",
    )?;

    // 2. The same over TLS (one keep-alive connection; the handshake is not in the figures).
    let (mut lat, _) = http_claims(tls(tls_addr, cert_der).await?).await?;
    figure("claim latency over TLS, auth on, refill running", &mut lat, "reported separately (no target)")?;

    // 3. With 2,000 idle connections open on the same listener.
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    for _ in 0..IDLE_CONNECTIONS {
        idle.push(tokio::net::TcpStream::connect(addr).await.context("opening an idle connection")?);
    }
    // The server accepts them asynchronously: wait until it holds all of them.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let open = node.conn_stats.open.load(std::sync::atomic::Ordering::Relaxed);
        if open >= IDLE_CONNECTIONS {
            break;
        }
        if Instant::now() > until {
            bail!("only {open} connections open on the server, want {IDLE_CONNECTIONS}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut lat, _) = http_claims(plain(addr).await?).await?;
    figure(
        &format!("claim latency over HTTP with {IDLE_CONNECTIONS} idle connections open, auth on"),
        &mut lat,
        "a slow or idle client never blocks claims (same target as above)",
    )?;
    drop(idle);

    // 4. Diagnostic: the same with the refill (and reaper) tasks stopped, to show what the
    //    refill's CPU on the shared cores costs the claim path.
    node.shutdown();
    let (mut lat, _) = http_claims(plain(addr).await?).await?;
    figure("claim latency over HTTP, refill stopped (diagnostic)", &mut lat, "the HTTP path alone")?;

    // 5. The same claims without HTTP: what the node itself costs (pool pop, minting, journal).
    let key = sandboxd::pool::PoolKey::parse("base", None, None)?;
    let mut inproc = Vec::with_capacity(CLAIMS);
    for _ in 0..CLAIMS {
        let req = sandboxd::node::ClaimRequest { key: key.clone(), ttl: Duration::from_secs(600), claim_ref: None };
        let t = Instant::now();
        node.claim(req).await?;
        inproc.push(t.elapsed());
    }
    figure("Node::claim in-process (no HTTP)", &mut inproc, "the node's share: pool pop, minting, journal append")?;

    // 6. The floor: the cheapest route (`GET /healthz`) over the same kind of connection, so
    //    the claim's own cost over loopback HTTP on this machine can be read off.
    let mut floor = healthz_round_trips(addr).await?;
    figure("GET /healthz over HTTP (the loopback HTTP floor)", &mut floor, "diagnostic: no claim work at all")?;
    Ok(())
}

/// `CLAIMS` SDK-shaped claims that start at a second, empty node whose peer report names the
/// node at `warm` (the one every phase claims from) as warm.
async fn redirected_claims(dir: &tempfile::TempDir, warm: std::net::SocketAddr) -> Result<Vec<Duration>> {
    let driver = sandboxd::test_utils::FakeDriver::new(&dir.path().join("empty"));
    let mut opts =
        sandboxd::node::NodeOptions::new(dir.path().join("empty/data"), sandboxd::test_utils::fake_catalog());
    opts.api_token = Some(ROOT.into());
    opts.pools = vec![sandboxd::config::PoolConfig::warm("base", 0)];
    let empty = sandboxd::Node::start(driver, opts).await?;
    let key = sandboxd_api::Key { template: "base".into(), net: "none".into(), size: "small".into() };
    let peer = sandboxd_api::PeerBox {
        addr: warm.to_string(),
        pools: vec![sandboxd_api::PeerPool { key, warm: CLAIMS }],
        ttl_seconds: None,
    };
    empty.set_peers(sandboxd_api::PeerReport { peers: vec![peer], ttl_seconds: 3600 })?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let entry = listener.local_addr()?;
    tokio::spawn(sandboxd::http::serve(listener, Arc::clone(&empty), None, std::future::pending()));
    let (mut at_entry, mut at_peer) = (plain(entry).await?, plain(warm).await?);
    let post = |body: &'static [u8]| {
        hyper::Request::post("/v1/claim")
            .header("host", "sandboxd")
            .header("authorization", format!("Bearer {ROOT}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body)))
    };
    let mut lat = Vec::with_capacity(CLAIMS);
    for _ in 0..CLAIMS {
        let t = Instant::now();
        at_entry.ready().await?;
        let resp = at_entry.send_request(post(br#"{"template":"base","ttl_seconds":600}"#)?).await?;
        let reply: sandboxd_api::ClaimReply = serde_json::from_slice(&resp.into_body().collect().await?.to_bytes())?;
        if reply.redirect.first().map(String::as_str) != Some(&warm.to_string()) {
            bail!("the empty box did not redirect to its warm peer: {:?}", reply.redirect);
        }
        at_peer.ready().await?;
        let resp = at_peer.send_request(post(br#"{"template":"base","ttl_seconds":600,"no_redirect":true}"#)?).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        lat.push(t.elapsed());
        if !status.is_success() {
            bail!("the redirected claim answered {status}: {}", String::from_utf8_lossy(&bytes));
        }
    }
    empty.shutdown();
    Ok(lat)
}

fn main() -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(claim_latency())
}

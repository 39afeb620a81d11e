//! The accept loop: connection cap, TLS handshake, HTTP/1.1 (or HTTP/2 when ALPN chose it) with
//! upgrades, and the [`Peer`] extension on every request.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::CertificateDer;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt as _;

/// The bounds every connection lives within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open connections at most; one more is closed at once. One remote address (loopback
    /// excepted) may hold an eighth of them at most (at least 4; see [`per_peer_cap`]), so a
    /// single host cannot fill the cap and lock everyone else out.
    pub max_connections: usize,
    /// How long a client may take to send a request head, and how long a keep-alive
    /// connection may sit idle between requests.
    pub header_timeout: Duration,
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Which HTTP versions a connection may speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 only (sandboxd: the SDK offers ALPN `http/1.1`, and relays are HTTP/1.1 upgrades).
    Http1,
    /// HTTP/2 when the TLS handshake negotiated `h2` through ALPN, HTTP/1.1 otherwise (the
    /// kubelet port). The version is never sniffed from the first bytes: that read would have
    /// no deadline. An HTTP/2 connection on which no request starts for
    /// [`Limits::header_timeout`] is sent GOAWAY (requests in flight finish).
    Auto,
}

/// How [`serve`] runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Names the server in logs (`sandboxd`, `kubelet`, `supervisor api`).
    pub name: &'static str,
    /// The limits.
    pub limits: Limits,
    /// HTTP versions.
    pub protocol: Protocol,
    /// TLS, when the surface serves it.
    pub tls: Option<Arc<ServerConfig>>,
}

/// The most connections one non-loopback address may hold under `max_connections`.
pub fn per_peer_cap(max_connections: usize) -> usize {
    (max_connections / 8).max(4).min(max_connections)
}

/// Open connections per remote address (loopback peers are not counted: they are this host).
#[derive(Debug)]
struct PeerCounts {
    cap: usize,
    open: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

/// One admitted connection of a counted peer; gives its place back when dropped.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: std::net::IpAddr,
}

impl PeerCounts {
    fn new(max_connections: usize) -> Arc<Self> {
        Arc::new(PeerCounts { cap: per_peer_cap(max_connections), open: Default::default() })
    }

    /// Admits a connection from `ip`, or `Err(())` when that address already holds `cap`.
    fn admit(self: &Arc<Self>, ip: std::net::IpAddr) -> Result<Option<PeerSlot>, ()> {
        if ip.is_loopback() || ip.to_canonical().is_loopback() {
            return Ok(None);
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_default();
        if *n >= self.cap {
            return Err(());
        }
        *n += 1;
        Ok(Some(PeerSlot { counts: Arc::clone(self), ip }))
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Live connection counts, for metrics.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections closed at once because [`Limits::max_connections`] were open.
    pub refused: AtomicU64,
    /// Connections closed because the client was too slow (request head or TLS handshake).
    pub timed_out: AtomicU64,
}

/// Who sent a request (a request extension).
#[derive(Debug, Clone)]
pub struct Peer {
    /// The remote address.
    pub addr: SocketAddr,
    /// The client's certificate chain, leaf first, as presented in the TLS handshake (empty
    /// without TLS or without a client certificate). The handshake proved the client holds the
    /// leaf's key; whether the chain was checked against roots is the configuration's
    /// `ClientCertVerifier`'s business (the kubelet port's accepts any chain and verifies it per
    /// request, so an unknown certificate gets a 401, not a handshake failure).
    pub certificates: Arc<[CertificateDer<'static>]>,
}

/// Raises the soft open-file limit to the hard limit, so a connection cap in the thousands is
/// reachable. Returns the (soft, hard) limit now in force.
pub fn raise_nofile_limit() -> std::io::Result<(u64, u64)> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let cur = getrlimit(Resource::Nofile);
    if cur.current != cur.maximum {
        setrlimit(Resource::Nofile, Rlimit { current: cur.maximum, maximum: cur.maximum })?;
    }
    let now = getrlimit(Resource::Nofile);
    Ok((now.current.unwrap_or(u64::MAX), now.maximum.unwrap_or(u64::MAX)))
}

/// Serves `router` on `listener` until `shutdown` resolves, within `opts`' limits. Connections
/// in flight (relays) are not waited for. `stats` is updated as connections come and go.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    opts: ServeOptions,
    stats: Arc<ConnStats>,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(opts.limits.max_connections));
    let peers = PeerCounts::new(opts.limits.max_connections);
    let acceptor = opts.tls.clone().map(TlsAcceptor::from);
    tokio::pin!(shutdown);
    loop {
        let (tcp, addr) = tokio::select! {
            () = &mut shutdown => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(server = opts.name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(peer_slot) = peers.admit(addr.ip()) else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(server = opts.name, peer = %addr, max = peers.cap, "per-address connection cap reached; closing");
            drop(tcp);
            continue;
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(server = opts.name, peer = %addr, max = opts.limits.max_connections, "connection cap reached; closing");
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (router, acceptor, stats, opts) = (router.clone(), acceptor.clone(), Arc::clone(&stats), opts.clone());
        stats.open.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            connection(tcp, addr, acceptor, router, &opts, &stats).await;
            stats.open.fetch_sub(1, Ordering::Relaxed);
            drop((permit, peer_slot));
        });
    }
}

async fn connection(
    tcp: TcpStream,
    addr: SocketAddr,
    acceptor: Option<TlsAcceptor>,
    router: Router,
    opts: &ServeOptions,
    stats: &ConnStats,
) {
    let Some(acceptor) = acceptor else {
        let peer = Peer { addr, certificates: Arc::from(Vec::new()) };
        return http(TokioIo::new(tcp), peer, false, router, opts, stats).await;
    };
    let tls = match tokio::time::timeout(opts.limits.handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            tracing::debug!(server = opts.name, peer = %addr, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            stats.timed_out.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(server = opts.name, peer = %addr, "TLS handshake timed out");
            return;
        }
    };
    let certificates: Arc<[CertificateDer<'static>]> = tls
        .get_ref()
        .1
        .peer_certificates()
        .map(|c| c.iter().map(|d| d.clone().into_owned()).collect())
        .unwrap_or_default();
    let h2 = opts.protocol == Protocol::Auto && tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
    http(TokioIo::new(tls), Peer { addr, certificates }, h2, router, opts, stats).await;
}

async fn http<I>(io: TokioIo<I>, peer: Peer, h2: bool, router: Router, opts: &ServeOptions, stats: &ConnStats)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let addr = peer.addr;
    // When the last request started (ms since `epoch`, plus one; 0: none yet): an idle HTTP/2
    // connection is sent GOAWAY, and one that never sent a request is then dropped.
    let epoch = tokio::time::Instant::now();
    let last_request = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&last_request);
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        seen.store(epoch.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        req.extensions_mut().insert(peer.clone());
        let router = router.clone();
        async move { Ok::<_, Infallible>(router.oneshot(req).await.unwrap_or_else(|never| match never {})) }
    });
    let result = if h2 {
        let idle = opts.limits.header_timeout;
        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        b.timer(TokioTimer::new()).keep_alive_interval(Some(idle));
        let conn = b.serve_connection(io, service);
        tokio::pin!(conn);
        let mut closing = false;
        loop {
            let since = Duration::from_millis(last_request.load(Ordering::Relaxed));
            let deadline = epoch + since + idle;
            tokio::select! {
                r = conn.as_mut() => break r.map_err(|e| (e.is_timeout(), e.to_string())),
                () = tokio::time::sleep_until(deadline + if closing { idle } else { Duration::ZERO }) => {
                    if closing {
                        // GOAWAY went out a whole `idle` ago on a connection that never sent a
                        // request (no preface, or a client that ignores GOAWAY): drop it.
                        if last_request.load(Ordering::Relaxed) == 0 {
                            break Err((false, "no request on an idle HTTP/2 connection".into()));
                        }
                        // Requests were served: the ones in flight finish at their own pace.
                        break conn.as_mut().await.map_err(|e| (e.is_timeout(), e.to_string()));
                    }
                    if Duration::from_millis(last_request.load(Ordering::Relaxed)) == since {
                        tracing::debug!(server = opts.name, peer = %addr, "idle HTTP/2 connection; sending GOAWAY");
                        stats.timed_out.fetch_add(1, Ordering::Relaxed);
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
            }
        }
    } else {
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(TokioTimer::new()).header_read_timeout(opts.limits.header_timeout);
        if opts.protocol == Protocol::Http1 {
            b.title_case_headers(true).auto_date_header(false);
        }
        b.serve_connection(io, service).with_upgrades().await.map_err(|e| (e.is_timeout(), e.to_string()))
    };
    if let Err((timeout, e)) = result {
        if timeout {
            stats.timed_out.fetch_add(1, Ordering::Relaxed);
        }
        tracing::debug!(server = opts.name, peer = %addr, error = %e, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn one_remote_address_holds_an_eighth_of_the_cap_and_loopback_is_not_counted() {
        assert_eq!((per_peer_cap(4096), per_peer_cap(64), per_peer_cap(16), per_peer_cap(2)), (512, 8, 4, 2));
        let counts = PeerCounts::new(64);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().expect("ip"), "192.0.2.2".parse().expect("ip"));
        let held: Vec<_> = (0..8).map(|_| counts.admit(a).expect("under the cap")).collect();
        assert!(counts.admit(a).is_err(), "the ninth connection from one address");
        assert!(counts.admit(b).expect("another address").is_some());
        for lo in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            let lo: IpAddr = lo.parse().expect("ip");
            assert!((0..100).all(|_| matches!(counts.admit(lo), Ok(None))), "{lo} is not counted");
        }
        drop(held);
        let again = counts.admit(a).expect("freed");
        assert!(again.is_some());
        assert_eq!(counts.open.lock().expect("lock").get(&a), Some(&1));
        drop(again);
        assert!(counts.open.lock().expect("lock").is_empty(), "a freed address leaves no entry");
    }
}

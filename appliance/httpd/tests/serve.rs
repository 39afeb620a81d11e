//! The server's limits, TLS and upgrades, over real sockets.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use httpd::{ConnStats, Limits, Peer, Protocol, ServeOptions};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

fn router() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/peer", get(|Extension(p): Extension<Peer>| async move { p.certificates.len().to_string() }))
        .route("/echo", get(echo))
}

/// An `Upgrade: echo` route: after the 101, echoes every byte.
async fn echo(req: Request) -> Response {
    if req.headers().get(header::UPGRADE).is_none() {
        return StatusCode::UPGRADE_REQUIRED.into_response();
    }
    tokio::spawn(async move {
        if let Ok(up) = hyper::upgrade::on(req).await {
            let mut io = hyper_util::rt::TokioIo::new(up);
            let mut buf = [0u8; 1024];
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::UPGRADE, "echo")
        .header(header::CONNECTION, "Upgrade")
        .body(Body::empty())
        .expect("response")
}

async fn start(limits: Limits, tls: Option<Arc<rustls::ServerConfig>>) -> (SocketAddr, Arc<ConnStats>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stats = Arc::new(ConnStats::default());
    let opts = ServeOptions { name: "test", limits, protocol: Protocol::Http1, tls };
    tokio::spawn(httpd::serve(listener, router(), opts, Arc::clone(&stats), std::future::pending()));
    (addr, stats)
}

/// Reads until EOF or `limit`; true when the server closed the connection.
async fn closed_within(s: &mut (impl tokio::io::AsyncRead + Unpin), limit: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

async fn get_ok(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

#[tokio::test]
async fn the_connection_cap_closes_the_one_too_many_and_frees_on_close() {
    let (addr, stats) = start(Limits { max_connections: 2, ..Limits::default() }, None).await;
    let a = TcpStream::connect(addr).await.expect("a");
    let _b = TcpStream::connect(addr).await.expect("b");
    // Let the server accept both before the third arrives.
    while stats.open.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut c = TcpStream::connect(addr).await.expect("c");
    assert!(closed_within(&mut c, Duration::from_secs(2)).await, "the third connection is closed at once");
    assert_eq!(stats.refused.load(Ordering::SeqCst), 1);
    drop(a);
    while stats.open.load(Ordering::SeqCst) > 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"), "a freed slot serves again");
}

#[tokio::test]
async fn a_slow_request_head_and_an_idle_keepalive_are_cut_off() {
    let limits = Limits { header_timeout: Duration::from_millis(300), ..Limits::default() };
    let (addr, stats) = start(limits, None).await;
    // Slowloris: half a head, then a byte now and then.
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET / HTTP/1.1\r\nHo").await.expect("write");
    let t = Instant::now();
    let dribble = async {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow.write_all(b"s").await.is_err() {
                return;
            }
        }
    };
    dribble.await;
    assert!(closed_within(&mut slow, Duration::from_secs(1)).await, "slowloris cut off");
    assert!(t.elapsed() < Duration::from_secs(3));
    // Idle keep-alive after a request.
    let mut idle = TcpStream::connect(addr).await.expect("connect");
    idle.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    assert!(closed_within(&mut idle, Duration::from_secs(2)).await, "an idle keep-alive connection is closed");
    assert!(stats.timed_out.load(Ordering::SeqCst) >= 1);
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[tokio::test]
async fn tls_with_alpn_http1_serves_upgrades_and_shows_client_certificates() {
    // A CA, a server certificate it signs, and a client certificate it signs.
    let ca_key = rcgen::KeyPair::generate().expect("ca key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(names).expect("params").signed_by(&key, &issuer).expect("sign");
        (cert.der().clone(), rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()))
    };
    let (server_cert, server_key) = leaf(vec!["127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["client".into()]);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).expect("root");
    let roots = Arc::new(roots);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), ring())
        .allow_unauthenticated()
        .build()
        .expect("verifier");
    let server = httpd::tls::server_config(vec![server_cert], server_key, httpd::tls::ALPN_HTTP1, Some(verifier))
        .expect("server config");
    let (addr, _) = start(Limits::default(), Some(server)).await;

    let client = |cert: Option<(CertificateDer<'static>, rustls::pki_types::PrivateKeyDer<'static>)>| {
        let b = rustls::ClientConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(Arc::clone(&roots));
        let mut c = match cert {
            Some((c, k)) => b.with_client_auth_cert(vec![c], k).expect("client auth"),
            None => b.with_no_client_auth(),
        };
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(c))
    };
    let name = ServerName::try_from("127.0.0.1").expect("name");

    // Anonymous: served, no certificates; ALPN http/1.1 negotiated.
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut tls = client(None).connect(name.clone(), tcp).await.expect("handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    tls.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut out = String::new();
    tls.read_to_string(&mut out).await.ok();
    assert!(out.starts_with("HTTP/1.1 200") && out.ends_with('0'), "{out}");

    // With a client certificate: the handler sees it.
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut tls = client(Some((client_cert, client_key))).connect(name.clone(), tcp).await.expect("handshake");
    tls.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut out = String::new();
    tls.read_to_string(&mut out).await.ok();
    assert!(out.ends_with('1'), "{out}");

    // An upgrade over TLS: 101, then bytes echo.
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut tls = client(None).connect(name, tcp).await.expect("handshake");
    tls.write_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
        .await
        .expect("write");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        tls.read_exact(&mut b).await.expect("head");
        head.push(b[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
    tls.write_all(b"ping").await.expect("write");
    let mut got = [0u8; 4];
    tls.read_exact(&mut got).await.expect("echo");
    assert_eq!(&got, b"ping");
}

/// A TLS `GET /` through `httpd::tls::client_config(trust)` to `name`; the error text on failure.
async fn get_with_trust(addr: SocketAddr, trust: &httpd::tls::Trust, name: &str) -> Result<String, String> {
    let config = httpd::tls::client_config(trust, httpd::tls::ALPN_HTTP1).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    let mut tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.map_err(|e| e.to_string())?;
    tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.map_err(|e| e.to_string())?;
    let mut out = String::new();
    tls.read_to_string(&mut out).await.ok();
    Ok(out)
}

#[tokio::test]
async fn clients_trust_the_exact_certificate_a_pinned_fingerprint_or_a_ca() {
    use httpd::tls::Trust;
    let dir = tempfile::tempdir().expect("tempdir");
    // A self-signed box certificate that does not name 127.0.0.1: the exact-certificate rule
    // trusts it anyway (the bytes are the pin); a fingerprint pin does too.
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let minted = httpd::tls::ensure_self_signed(&cert, &key, &["box.example".to_string()]).expect("mint");
    let server = httpd::tls::server_config_from_files(&cert, &key, httpd::tls::ALPN_HTTP1).expect("server");
    let (addr, _) = start(Limits::default(), Some(server)).await;
    let ok = get_with_trust(addr, &Trust::File(cert.clone()), "127.0.0.1").await.expect("exact certificate");
    assert!(ok.ends_with("ok"), "{ok}");
    let pin = Trust::Fingerprint(minted.fingerprint.to_lowercase().replace(':', ""));
    assert!(get_with_trust(addr, &pin, "127.0.0.1").await.expect("pinned").ends_with("ok"));
    // Another certificate, another fingerprint: refused.
    let other = dir.path().join("other.pem");
    std::fs::write(&other, httpd::tls::self_signed(&["127.0.0.1".to_string()]).expect("other").cert_pem).expect("w");
    let e = get_with_trust(addr, &Trust::File(other), "127.0.0.1").await.expect_err("a stranger's certificate");
    assert!(e.contains("not the trusted one") || e.contains("certificate"), "{e}");
    let zeros = Trust::Fingerprint("00".repeat(32));
    assert!(get_with_trust(addr, &zeros, "127.0.0.1").await.is_err());
    let e = httpd::tls::client_config(&Trust::Fingerprint("AB:CD".into()), &[]).expect_err("short");
    assert!(e.to_string().contains("SHA-256 fingerprint"), "{e}");

    // A CA-issued certificate: trusting the CA checks the name as any client does.
    let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("ca key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "test ca");
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca_params, &ca_key);
    let leaf_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("leaf key");
    let leaf = rcgen::CertificateParams::new(vec!["sandboxd.example".to_string()])
        .expect("leaf params")
        .signed_by(&leaf_key, &issuer)
        .expect("leaf");
    let server = httpd::tls::server_config(
        vec![leaf.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        httpd::tls::ALPN_HTTP1,
        None,
    )
    .expect("server");
    let (addr, _) = start(Limits::default(), Some(server)).await;
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("w");
    let ok = get_with_trust(addr, &Trust::File(ca_file.clone()), "sandboxd.example").await.expect("via the CA");
    assert!(ok.ends_with("ok"), "{ok}");
    let e = get_with_trust(addr, &Trust::File(ca_file), "127.0.0.1").await.expect_err("a name the cert lacks");
    assert!(e.contains("certificate"), "{e}");
}

/// An `Auto` server (the kubelet port's) over TLS with ALPN `h2`/`http/1.1`, and a client
/// configuration that pins its certificate and offers `alpn`.
async fn start_auto(header_timeout: Duration, alpn: &[&[u8]]) -> (SocketAddr, Arc<rustls::ClientConfig>) {
    let pair = httpd::tls::self_signed(&["127.0.0.1".into()]).expect("cert");
    let (chain, key) = httpd::tls::pair_der(&pair).expect("der");
    let trust = httpd::tls::Trust::Fingerprint(httpd::tls::fingerprint(&chain[0]));
    let server = httpd::tls::server_config(chain, key, httpd::tls::ALPN_H2_HTTP1, None).expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let limits = Limits { header_timeout, ..Limits::default() };
    let opts = ServeOptions { name: "test", limits, protocol: Protocol::Auto, tls: Some(server) };
    tokio::spawn(httpd::serve(listener, router(), opts, Arc::new(ConnStats::default()), std::future::pending()));
    (addr, httpd::tls::client_config(&trust, alpn).expect("client"))
}

async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("127.0.0.1".to_string()).expect("name");
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.expect("handshake")
}

#[tokio::test]
async fn auto_speaks_h2_when_alpn_chose_it_and_closes_idle_or_silent_connections() {
    let idle = Duration::from_millis(800);
    // HTTP/2 chosen by ALPN: a request is served, then the idle connection gets GOAWAY.
    let (addr, h2_client) = start_auto(idle, &[b"h2"]).await;
    let tls = tls_connect(addr, Arc::clone(&h2_client)).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(b"h2".as_slice()));
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    let conn = tokio::spawn(conn);
    let req =
        hyper::Request::get("https://127.0.0.1/").body(http_body_util::Empty::<bytes::Bytes>::new()).expect("req");
    let resp = send.send_request(req).await.expect("h2 request");
    assert_eq!(resp.status(), StatusCode::OK);
    let ended = tokio::time::timeout(idle * 5, conn).await;
    assert!(ended.is_ok(), "an idle HTTP/2 connection was not closed");

    // TLS done, ALPN h2, then silence (no connection preface): closed, not held forever.
    let mut silent = tls_connect(addr, Arc::clone(&h2_client)).await;
    assert!(closed_within(&mut silent, idle * 5).await, "a silent h2 connection was kept open");

    // TLS done without ALPN, then silence: HTTP/1.1's header timeout closes it.
    let (addr, plain_client) = start_auto(idle, &[]).await;
    let mut silent = tls_connect(addr, plain_client).await;
    assert_eq!(silent.get_ref().1.alpn_protocol(), None);
    assert!(closed_within(&mut silent, idle * 5).await, "a silent HTTP/1.1 connection was kept open");
}

//! The kubelet HTTPS endpoint (`docs/virtual-node.md` §1.3): `/healthz` → `ok`, `/pods` → the
//! provider's pods as a `PodList`; `/containerLogs`, `/exec`, `/attach`, `/portForward` →
//! [`crate::streams`]; `/stats/summary`, `/metrics/resource` and `/metrics` → [`crate::stats`];
//! `/runningpods/` and anything else → `501`.
//!
//! Every route, `/healthz` included, sits behind [`auth::guard`] (authenticate, then a
//! `SubjectAccessReview`), as on a kubelet's authenticated port. Served through
//! [`httpd::serve`]: connection cap, request-head and idle timeouts, TLS handshake timeout,
//! HTTP/1.1 or HTTP/2 (ALPN).

use crate::auth::{self, KubeletAuth};
use crate::error::VnodeError;
use crate::provider::Provider;
use crate::stats::Stats;
use crate::streams::{Bound, StreamLimits};
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use k8s_openapi::api::core::v1::Pod;
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The kubelet port's default limits: a connection cap well above what an API server and a
/// few scrapers open, the shared head/idle and handshake timeouts.
pub fn default_limits() -> httpd::Limits {
    httpd::Limits { max_connections: 1024, ..httpd::Limits::default() }
}

/// The routes, over `provider`, its `streams` (within `limits`) and `stats`, each behind `auth`.
pub fn router(
    provider: Arc<dyn Provider>,
    streams: Bound,
    limits: StreamLimits,
    stats: Arc<Stats>,
    auth: Arc<KubeletAuth>,
) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/pods", get(pods))
        .fallback(not_implemented)
        .with_state(provider.clone())
        .merge(crate::streams::routes(provider, streams, limits, stats.runtime().stream_sessions()))
        .merge(crate::stats::routes(stats))
        .layer(axum::middleware::from_fn_with_state(auth, auth::guard))
}

async fn pods(State(provider): State<Arc<dyn Provider>>) -> Json<k8s_openapi::List<Pod>> {
    Json(k8s_openapi::List { items: provider.get_pods(), metadata: Default::default() })
}

async fn not_implemented(uri: Uri) -> impl IntoResponse {
    (StatusCode::NOT_IMPLEMENTED, format!("{} is not implemented by this virtual node\n", uri.path()))
}

/// Binds the kubelet port (a failure is fatal for the runtime).
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, VnodeError> {
    TcpListener::bind(addr).await.map_err(|source| VnodeError::KubeletListen { addr, source })
}

/// Serves HTTPS on `listener` until `cancel`, within `limits`; `stats` counts connections.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    router: Router,
    limits: httpd::Limits,
    stats: Arc<httpd::ConnStats>,
    cancel: CancellationToken,
) {
    let opts = httpd::ServeOptions { name: "kubelet", limits, protocol: httpd::Protocol::Auto, tls: Some(tls) };
    httpd::serve(listener, router, opts, stats, cancel.cancelled_owned()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::testing::FakeReviewer;
    use crate::auth::x509::testing::{stranger, Ca, Leaf};
    use crate::auth::x509::ClientCa;
    use crate::auth::AuthConfig;
    use crate::streams::tests::{FakeProvider, FakeStreams};
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A running endpoint: its address, the fake API server behind it and the CA it trusts.
    struct Endpoint {
        addr: SocketAddr,
        fake: Arc<FakeReviewer>,
        ca: Ca,
        stats: Arc<httpd::ConnStats>,
        cancel: CancellationToken,
        server: tokio::task::JoinHandle<()>,
    }

    impl Endpoint {
        async fn start(limits: httpd::Limits) -> Endpoint {
            let ca = Ca::new("kubernetes");
            let fake = Arc::new(
                FakeReviewer::default()
                    .with_token("sa-token", "system:serviceaccount:ns:reader")
                    .with_token("nobody-token", "system:serviceaccount:ns:nobody")
                    .allow("system:serviceaccount:ns:reader", "get", "proxy")
                    .allow("kube-apiserver-kubelet-client", "get", "proxy")
                    .allow("kube-apiserver-kubelet-client", "get", "stats")
                    .allow("kube-apiserver-kubelet-client", "create", "proxy"),
            );
            let client_ca = ClientCa::new(std::slice::from_ref(&ca.der)).expect("ca");
            let (tls, _) = crate::tls::server_config(None, None, "vk-t", None, client_ca.tls_verifier()).expect("tls");
            let auth = Arc::new(KubeletAuth::new("vk-t", client_ca, fake.clone(), AuthConfig::default()));
            let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let cancel = CancellationToken::new();
            let stats = Arc::new(httpd::ConnStats::default());
            let server = tokio::spawn(serve(
                listener,
                tls,
                router(
                    Arc::new(FakeProvider::default().with("ns", "p1", "Running")),
                    Bound::unwatched(Arc::new(FakeStreams::default())),
                    crate::streams::StreamLimits::default(),
                    Arc::new(Stats::new("vk-t", Default::default())),
                    auth,
                ),
                limits,
                stats.clone(),
                cancel.clone(),
            ));
            Endpoint { addr, fake, ca, stats, cancel, server }
        }

        async fn stop(self) {
            self.cancel.cancel();
            self.server.await.expect("server task");
        }
    }

    fn client_config(
        cert: Option<&Leaf>,
        alpn: &[&[u8]],
        version: &'static rustls::SupportedProtocolVersion,
    ) -> rustls::ClientConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[version])
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(join::tls::NoVerify::new(provider));
        let mut config = match cert {
            Some(leaf) => {
                let chain = vec![CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).expect("cert")];
                let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).expect("key");
                builder.with_client_auth_cert(chain, key).expect("client cert")
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        config
    }

    async fn connect(
        addr: SocketAddr,
        config: rustls::ClientConfig,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = ServerName::try_from("127.0.0.1").expect("name");
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await
    }

    /// `method path` over HTTP/1.1 and TLS `version`, with an optional client certificate and
    /// bearer token; returns (status, body).
    async fn call(
        addr: SocketAddr,
        method: &str,
        path: &str,
        cert: Option<&Leaf>,
        token: Option<&str>,
        version: &'static rustls::SupportedProtocolVersion,
    ) -> (u16, String) {
        let mut tls = connect(addr, client_config(cert, &[b"http/1.1"], version)).await.expect("handshake");
        let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        tls.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let mut raw = Vec::new();
        let _ = tls.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    async fn get(addr: SocketAddr, path: &str, cert: Option<&Leaf>, token: Option<&str>) -> (u16, String) {
        call(addr, "GET", path, cert, token, &rustls::version::TLS13).await
    }

    #[tokio::test]
    async fn the_endpoint_authenticates_and_authorizes_every_route() {
        let ep = Endpoint::start(default_limits()).await;
        let apiserver = ep.ca.client(Some("kube-apiserver-kubelet-client"), &[]);
        let unbound = ep.ca.client(Some("someone"), &["system:authenticated"]);
        let random = stranger("kube-apiserver-kubelet-client");

        // Anonymous: 401 everywhere, /healthz included.
        for path in ["/healthz", "/pods", "/exec/ns/p/c", "/anything"] {
            let (status, body) = get(ep.addr, path, None, None).await;
            assert_eq!((status, body.as_str()), (401, "Unauthorized\n"), "{path}");
        }
        // A certificate no CA vouches for passes the handshake, then gets 401 (TLS 1.2 too).
        assert_eq!(get(ep.addr, "/pods", Some(&random), None).await.0, 401);
        assert_eq!(call(ep.addr, "GET", "/pods", Some(&random), None, &rustls::version::TLS12).await.0, 401);
        // A bad token: 401.
        assert_eq!(get(ep.addr, "/pods", None, Some("not-a-token")).await.0, 401);
        assert_eq!(ep.fake.calls().1, 0, "nothing unauthenticated reached authorization");

        // The API server's kubelet-client identity.
        let (status, body) = get(ep.addr, "/pods", Some(&apiserver), None).await;
        assert_eq!(status, 200, "{body}");
        let list: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(list["kind"], "PodList");
        assert_eq!(list["items"][0]["metadata"]["name"], "p1");
        assert_eq!(
            call(ep.addr, "GET", "/healthz", Some(&apiserver), None, &rustls::version::TLS12).await,
            (200, "ok".into())
        );
        for path in ["/runningpods/", "/anything"] {
            let (status, body) = get(ep.addr, path, Some(&apiserver), None).await;
            assert_eq!(status, 501, "{path}: {body}");
            assert!(body.contains("not implemented"), "{path}: {body}");
        }
        // The streaming routes are served: the pod is not on this node.
        let (status, body) = get(ep.addr, "/containerLogs/ns/p/c", Some(&apiserver), None).await;
        assert_eq!((status, body.as_str()), (404, "pod ns/p is not on this node (check its spec.nodeName)\n"));
        assert_eq!(
            call(ep.addr, "POST", "/exec/ns/p/c?stdout=1&command=ls", Some(&apiserver), None, &rustls::version::TLS13)
                .await
                .0,
            404
        );
        // Authenticated by the CA but without a grant: 403 naming the attributes.
        let (status, body) = get(ep.addr, "/pods", Some(&unbound), None).await;
        assert_eq!(status, 403);
        assert_eq!(body, "Forbidden (user=someone, verb=get, resource=nodes, subresource=proxy)\n");
        // nodes/stats is granted, nodes/metrics is not.
        let (status, body) = get(ep.addr, "/stats/summary", Some(&apiserver), None).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"nodeName\":\"vk-t\""), "{body}");
        for path in ["/metrics/resource", "/metrics"] {
            let (status, body) = get(ep.addr, path, Some(&apiserver), None).await;
            assert_eq!(status, 403, "no metrics grant: {path}");
            assert!(body.contains("subresource=metrics"), "{body}");
        }

        // A service account token: TokenReview, then SubjectAccessReview.
        assert_eq!(get(ep.addr, "/pods", None, Some("sa-token")).await.0, 200);
        assert_eq!(call(ep.addr, "POST", "/exec/ns/p/c", None, Some("sa-token"), &rustls::version::TLS13).await.0, 403);
        assert_eq!(get(ep.addr, "/pods", None, Some("nobody-token")).await.0, 403);

        // The API server goes away: a new token cannot be reviewed (503); cached answers hold.
        ep.fake.down.store(true, Ordering::SeqCst);
        ep.fake.tokens.lock().expect("lock").insert("late-token".into(), "system:serviceaccount:ns:reader".into());
        let (status, body) = get(ep.addr, "/pods", None, Some("late-token")).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(get(ep.addr, "/pods", None, Some("sa-token")).await.0, 200, "cached");
        ep.stop().await;
    }

    #[tokio::test]
    async fn http2_is_negotiated_and_guarded_too() {
        let ep = Endpoint::start(default_limits()).await;
        let apiserver = ep.ca.client(Some("kube-apiserver-kubelet-client"), &[]);
        for (cert, want) in [(None, 401u16), (Some(&apiserver), 200)] {
            let tls = connect(ep.addr, client_config(cert, &[b"h2", b"http/1.1"], &rustls::version::TLS13))
                .await
                .expect("handshake");
            assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
            let (mut send, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(tls),
            )
            .await
            .expect("h2 handshake");
            tokio::spawn(conn);
            let req = hyper::Request::get("https://127.0.0.1/pods")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .expect("request");
            let resp = send.send_request(req).await.expect("h2 response");
            assert_eq!(resp.status().as_u16(), want);
        }
        ep.stop().await;
    }

    #[tokio::test]
    async fn the_connection_cap_closes_one_more_at_once() {
        let ep = Endpoint::start(httpd::Limits { max_connections: 2, ..default_limits() }).await;
        let apiserver = ep.ca.client(Some("kube-apiserver-kubelet-client"), &[]);
        let config = || client_config(Some(&apiserver), &[b"http/1.1"], &rustls::version::TLS13);
        let held =
            [connect(ep.addr, config()).await.expect("first"), connect(ep.addr, config()).await.expect("second")];
        // The server counts both before the third arrives.
        for _ in 0..100 {
            if ep.stats.open.load(Ordering::SeqCst) == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ep.stats.open.load(Ordering::SeqCst), 2);
        let third = connect(ep.addr, config()).await;
        assert!(third.is_err(), "a third connection past the cap of 2 completed a handshake");
        assert_eq!(ep.stats.refused.load(Ordering::SeqCst), 1);
        drop(held);
        let mut status = 0;
        for _ in 0..100 {
            // The freed slots come back once the server sees the closes.
            if ep.stats.open.load(Ordering::SeqCst) == 0 {
                status = get(ep.addr, "/healthz", Some(&apiserver), None).await.0;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(status, 200, "a connection after the others closed is served");
        ep.stop().await;
    }

    #[tokio::test]
    async fn a_busy_port_is_a_clear_error() {
        let held = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = held.local_addr().expect("addr");
        let e = bind(addr).await.expect_err("the port is taken");
        assert!(matches!(e, VnodeError::KubeletListen { .. }));
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }
}

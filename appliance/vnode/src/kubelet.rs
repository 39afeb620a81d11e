//! The kubelet HTTPS endpoint (`virtual-node.md` §1.3): `/healthz` → `ok`, `/pods` → the
//! provider's pods as a `PodList`; `/containerLogs`, `/exec`, `/attach`, `/portForward`,
//! `/runningpods/`, `/stats/summary`, `/metrics/resource` and anything else → `501`.

use crate::error::VnodeError;
use crate::provider::Provider;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::core::v1::Pod;
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How long a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The routes, over `provider`.
pub fn router(provider: Arc<dyn Provider>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/pods", get(pods))
        .fallback(not_implemented)
        .with_state(provider)
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

/// Serves HTTPS on `listener` until `cancel`.
pub(crate) async fn serve(listener: TcpListener, tls: Arc<ServerConfig>, router: Router, cancel: CancellationToken) {
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(error = %e, "kubelet endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (acceptor, router, cancel) = (acceptor.clone(), router.clone(), cancel.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = connection(acceptor, tcp, peer, router) => {}
            }
        });
    }
}

async fn connection(acceptor: TlsAcceptor, tcp: tokio::net::TcpStream, peer: SocketAddr, router: Router) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "kubelet endpoint: TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!(%peer, "kubelet endpoint: TLS handshake timed out");
            return;
        }
    };
    let service = TowerToHyperService::new(router);
    if let Err(e) =
        auto::Builder::new(TokioExecutor::new()).serve_connection_with_upgrades(TokioIo::new(tls), service).await
    {
        debug!(%peer, error = %e, "kubelet endpoint: connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{PodKey, PodNotifier, ProviderError};
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct OnePod;

    #[async_trait::async_trait]
    impl Provider for OnePod {
        async fn create_pod(&self, _: &Pod) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn update_pod(&self, _: &Pod) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn delete_pod(&self, _: &Pod) -> Result<(), ProviderError> {
            Ok(())
        }
        fn get_pod(&self, _: &PodKey) -> Option<Pod> {
            None
        }
        fn get_pods(&self) -> Vec<Pod> {
            let mut p = Pod::default();
            p.metadata.name = Some("p1".into());
            p.metadata.namespace = Some("ns".into());
            vec![p]
        }
        fn notify_pods(&self, _: PodNotifier) {}
    }

    /// `GET path` over TLS (`version` only); returns (status, body).
    async fn get(addr: SocketAddr, path: &str, version: &'static rustls::SupportedProtocolVersion) -> (u16, String) {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[version])
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(join::http::NoVerify::new(Arc::new(
                rustls::crypto::ring::default_provider(),
            )))
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let name = ServerName::try_from("127.0.0.1").expect("name");
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("handshake");
        tls.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let mut raw = Vec::new();
        let _ = tls.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    #[tokio::test]
    async fn the_endpoint_serves_healthz_pods_and_501s_over_tls() {
        let (tls, _) = crate::tls::server_config(None, None, "vk-t", None).expect("tls");
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cancel = CancellationToken::new();
        let server = tokio::spawn(serve(listener, tls, router(Arc::new(OnePod)), cancel.clone()));

        let (status, body) = get(addr, "/healthz", &rustls::version::TLS13).await;
        assert_eq!((status, body.as_str()), (200, "ok"));
        let (status, _) = get(addr, "/healthz", &rustls::version::TLS12).await;
        assert_eq!(status, 200, "TLS 1.2 is accepted");

        let (status, body) = get(addr, "/pods", &rustls::version::TLS13).await;
        assert_eq!(status, 200);
        let list: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(list["kind"], "PodList");
        assert_eq!(list["items"][0]["metadata"]["name"], "p1");

        for path in [
            "/containerLogs/ns/p/c",
            "/exec/ns/p/c",
            "/attach/ns/p/c",
            "/portForward/ns/p",
            "/runningpods/",
            "/stats/summary",
            "/metrics/resource",
            "/anything",
        ] {
            let (status, body) = get(addr, path, &rustls::version::TLS13).await;
            assert_eq!(status, 501, "{path}");
            assert!(body.contains("not implemented"), "{path}: {body}");
        }
        cancel.cancel();
        server.await.expect("server task");
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

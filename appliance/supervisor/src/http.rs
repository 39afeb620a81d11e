//! A minimal HTTP/1.1 client over TCP, TLS or a Unix socket (hyper's connection API, one
//! request per connection): the CLI talks to the supervisor API with it, the health prober to
//! sandboxd. An `https://` endpoint needs a trust ([`httpd::tls::client_config`]): there is no
//! fallback to an unverified connection.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt as _;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper::{header, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

/// A request body.
pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// Why a request failed before a response arrived.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The endpoint string is not `unix:PATH`, an absolute path, `http://host:port` or
    /// `https://host:port`.
    #[error("{0:?} is not unix:/path/to.sock, http://host:port or https://host:port")]
    BadEndpoint(String),
    /// An `https://` endpoint without a trust to verify it with.
    #[error("{0} is HTTPS: give the certificate to trust (--api-ca-file FILE) or its SHA-256 fingerprint (--api-fingerprint, shown by `chrysalis status` on the box and on its console at start)")]
    NoTrust(String),
    /// The TLS handshake failed (wrong certificate, wrong name, not TLS).
    #[error("TLS with {endpoint}")]
    Tls {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Could not connect.
    #[error("connecting to {endpoint}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("HTTP exchange with {endpoint}")]
    Exchange {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: hyper::Error,
    },
    /// The request could not be built.
    #[error("building the request")]
    Build(#[source] hyper::http::Error),
    /// No response in time.
    #[error("{endpoint} did not answer within {secs} s")]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The limit.
        secs: u64,
    },
}

impl HttpError {
    /// A connect error (nothing listens / unreachable), as opposed to a broken exchange.
    pub fn is_connect(&self) -> bool {
        matches!(self, HttpError::Connect { .. } | HttpError::Timeout { .. })
    }
}

/// Where a server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket.
    Unix(PathBuf),
    /// `host:port` over TCP.
    Tcp(String),
    /// `host:port` over TLS.
    Https(String),
}

impl Endpoint {
    /// Whether requests go over the network (they then carry the bearer token).
    pub fn is_network(&self) -> bool {
        !matches!(self, Endpoint::Unix(_))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "http://{a}"),
            Endpoint::Https(a) => write!(f, "https://{a}"),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = HttpError;

    fn from_str(s: &str) -> Result<Self, HttpError> {
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(p.into()));
        }
        if s.starts_with('/') {
            return Ok(Endpoint::Unix(s.into()));
        }
        for (scheme, make) in [("http://", Endpoint::Tcp as fn(String) -> Endpoint), ("https://", Endpoint::Https)] {
            if let Some(a) = s.strip_prefix(scheme) {
                let a = a.trim_end_matches('/');
                if !a.is_empty() && !a.contains('/') {
                    return Ok(make(a.to_string()));
                }
            }
        }
        Err(HttpError::BadEndpoint(s.to_string()))
    }
}

/// A response, body collected.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status.
    pub status: StatusCode,
    /// Body.
    pub body: Bytes,
}

/// An empty body.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// A body from bytes.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A body streamed from a file.
pub fn file(f: tokio::fs::File) -> Body {
    let stream = tokio_util::io::ReaderStream::new(f).map_ok(Frame::data);
    StreamBody::new(stream).boxed_unsync()
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// The host of `host:port` / `[v6]:port`, as a TLS server name.
fn server_name(authority: &str) -> Option<rustls::pki_types::ServerName<'static>> {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map(|(h, _)| h)?,
        None => authority.rsplit_once(':').map(|(h, _)| h).unwrap_or(authority),
    };
    rustls::pki_types::ServerName::try_from(host.to_string()).ok()
}

async fn connect(ep: &Endpoint, tls: Option<&TlsClient>) -> Result<Box<dyn Io>, HttpError> {
    let err = |source| HttpError::Connect { endpoint: ep.to_string(), source };
    Ok(match ep {
        Endpoint::Unix(p) => Box::new(tokio::net::UnixStream::connect(p).await.map_err(err)?),
        Endpoint::Tcp(a) => Box::new(tokio::net::TcpStream::connect(a.as_str()).await.map_err(err)?),
        Endpoint::Https(a) => {
            let config = tls.ok_or_else(|| HttpError::NoTrust(ep.to_string()))?;
            let name = server_name(a).ok_or_else(|| HttpError::BadEndpoint(ep.to_string()))?;
            let tcp = tokio::net::TcpStream::connect(a.as_str()).await.map_err(err)?;
            let stream = tokio_rustls::TlsConnector::from(config.clone())
                .connect(name, tcp)
                .await
                .map_err(|source| HttpError::Tls { endpoint: ep.to_string(), source })?;
            Box::new(stream)
        }
    })
}

/// A TLS client configuration ([`httpd::tls::client_config`]).
pub type TlsClient = std::sync::Arc<rustls::ClientConfig>;

/// Sends one request and collects the response, all within `timeout`. `tls` is required for an
/// `https://` endpoint.
pub async fn send(
    ep: &Endpoint,
    tls: Option<&TlsClient>,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: Body,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let fut = async {
        let io = connect(ep, tls).await?;
        let exchange = |source| HttpError::Exchange { endpoint: ep.to_string(), source };
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.map_err(exchange)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let host = match ep {
            Endpoint::Unix(_) => "localhost".to_string(),
            Endpoint::Tcp(a) | Endpoint::Https(a) => a.clone(),
        };
        let mut req = Request::builder().method(method).uri(path).header(header::HOST, host);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req.body(body).map_err(HttpError::Build)?;
        let resp = tx.send_request(req).await.map_err(exchange)?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(exchange)?.to_bytes();
        Ok(Response { status, body })
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| HttpError::Timeout { endpoint: ep.to_string(), secs: timeout.as_secs() })?
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!("unix:/run/a.sock".parse::<Endpoint>().unwrap(), Endpoint::Unix("/run/a.sock".into()));
        assert_eq!("/run/a.sock".parse::<Endpoint>().unwrap(), Endpoint::Unix("/run/a.sock".into()));
        assert_eq!("http://10.0.0.1:7780/".parse::<Endpoint>().unwrap(), Endpoint::Tcp("10.0.0.1:7780".into()));
        assert_eq!("https://x:1".parse::<Endpoint>().unwrap(), Endpoint::Https("x:1".into()));
        assert!("ftp://x:1".parse::<Endpoint>().is_err());
        assert!("http://x/y".parse::<Endpoint>().is_err());
        assert!("relative.sock".parse::<Endpoint>().is_err());
    }

    #[tokio::test]
    async fn connect_errors_are_connect_errors() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("none.sock"));
        let e = send(&ep, None, Method::GET, "/", None, empty(), Duration::from_secs(2)).await.unwrap_err();
        assert!(e.is_connect(), "{e:?}");
        // HTTPS without a trust never connects unverified.
        let e =
            send(&Endpoint::Https("127.0.0.1:1".into()), None, Method::GET, "/", None, empty(), Duration::from_secs(2))
                .await
                .unwrap_err();
        assert!(matches!(e, HttpError::NoTrust(_)), "{e:?}");
        assert_eq!(server_name("[::1]:7780").unwrap().to_str(), "::1");
        assert_eq!(server_name("box.example:7780").unwrap().to_str(), "box.example");
    }
}

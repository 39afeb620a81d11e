//! A minimal HTTPS client for the few apiserver calls the join makes: one HTTP/1.1 request per
//! connection over rustls, with either no server verification (the first `cluster-info` read)
//! or verification against one pinned CA, and anonymous, Bearer or client-certificate auth.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The endpoint is not `https://host[:port]`.
    #[error("endpoint {0:?} is not https://host[:port]")]
    Endpoint(String),
    /// The pinned CA or client identity cannot be loaded.
    #[error("TLS material: {0}")]
    Tls(String),
    /// Connecting, the handshake or the exchange failed.
    #[error("{method} {url}: {what}")]
    Io {
        method: String,
        url: String,
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer in time.
    #[error("{method} {url}: no answer within {0:?}", .timeout)]
    Timeout { method: String, url: String, timeout: Duration },
}

/// How the server is verified.
#[derive(Clone)]
pub enum Trust {
    /// Not at all: only for the first, JWS-verified read of `cluster-info`.
    Insecure,
    /// Against this CA (PEM) only.
    Ca(String),
}

/// How the client authenticates.
#[derive(Clone)]
pub enum Auth {
    Anonymous,
    Bearer(String),
    /// Client certificate and key (PEM).
    ClientCert {
        cert_pem: String,
        key_pem: String,
    },
}

/// An answer: status and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Bytes,
}

const TIMEOUT: Duration = Duration::from_secs(15);

/// Accepts any server certificate (still checking the handshake signatures): the unpinned first
/// read of `cluster-info`, and clients of self-signed endpoints in tests.
#[derive(Debug)]
pub struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl NoVerify {
    pub fn new(provider: Arc<rustls::crypto::CryptoProvider>) -> Arc<NoVerify> {
        Arc::new(NoVerify(provider))
    }
}

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn tls_config(trust: &Trust, auth: &Auth) -> Result<rustls::ClientConfig, HttpError> {
    use rustls::pki_types::pem::PemObject;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| HttpError::Tls(e.to_string()))?;
    let builder = match trust {
        Trust::Insecure => builder.dangerous().with_custom_certificate_verifier(NoVerify::new(provider)),
        Trust::Ca(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|e| HttpError::Tls(format!("CA PEM: {e}")))?;
                roots.add(cert).map_err(|e| HttpError::Tls(format!("CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(HttpError::Tls("the CA PEM holds no certificate".into()));
            }
            builder.with_root_certificates(roots)
        }
    };
    let mut config = match auth {
        Auth::ClientCert { cert_pem, key_pem } => {
            let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| HttpError::Tls(format!("client certificate: {e}")))?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
                .map_err(|e| HttpError::Tls(format!("client key: {e}")))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| HttpError::Tls(format!("client identity: {e}")))?
        }
        Auth::Anonymous | Auth::Bearer(_) => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// `https://host:port` → (host, port).
fn host_port(endpoint: &str) -> Result<(String, u16), HttpError> {
    let bad = || HttpError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("https://").ok_or_else(bad)?.trim_end_matches('/');
    if rest.contains('/') || rest.is_empty() {
        return Err(bad());
    }
    if let Some(v6) = rest.strip_prefix('[') {
        let (host, tail) = v6.split_once(']').ok_or_else(bad)?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad())?,
            None if tail.is_empty() => 443,
            None => return Err(bad()),
        };
        return Ok((host.to_owned(), port));
    }
    match rest.rsplit_once(':') {
        Some((host, port)) => Ok((host.to_owned(), port.parse().map_err(|_| bad())?)),
        None => Ok((rest.to_owned(), 443)),
    }
}

/// Sends one request to `endpoint` + `path` and reads the whole answer.
pub async fn request(
    endpoint: &str,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
    trust: &Trust,
    auth: &Auth,
) -> Result<Response, HttpError> {
    let url = format!("{}{path}", endpoint.trim_end_matches('/'));
    let (host, port) = host_port(endpoint)?;
    let config = tls_config(trust, auth)?;
    let io = |what: &str| {
        let (method, url, what) = (method.to_owned(), url.clone(), what.to_owned());
        move |e: Box<dyn std::error::Error + Send + Sync>| HttpError::Io { method, url, what, source: e }
    };
    let exchange = async {
        let server_name =
            ServerName::try_from(host.clone()).map_err(|e| HttpError::Endpoint(format!("{endpoint}: {e}")))?;
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await.map_err(|e| io("connect")(e.into()))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name, tcp)
            .await
            .map_err(|e| io("TLS handshake")(e.into()))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| io("HTTP handshake")(e.into()))?;
        let conn = tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, "chrysalis-join");
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Auth::Bearer(token) = auth {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|e| io("request")(e.into()))?;
        let resp = sender.send_request(req).await.map_err(|e| io("send")(e.into()))?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map_err(|e| io("read body")(e.into()))?.to_bytes();
        conn.abort();
        Ok(Response { status, body })
    };
    tokio::time::timeout(TIMEOUT, exchange).await.map_err(|_| HttpError::Timeout {
        method: method.to_owned(),
        url,
        timeout: TIMEOUT,
    })?
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(host_port("https://127.0.0.1:6443").unwrap(), ("127.0.0.1".into(), 6443));
        assert_eq!(host_port("https://k8s.example/").unwrap(), ("k8s.example".into(), 443));
        assert_eq!(host_port("https://[::1]:6443").unwrap(), ("::1".into(), 6443));
        for bad in ["http://127.0.0.1:6443", "https://", "https://h:x", "https://h:1/api"] {
            assert!(host_port(bad).is_err(), "{bad}");
        }
    }
}

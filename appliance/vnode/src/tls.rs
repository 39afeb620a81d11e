//! The kubelet endpoint's TLS: the configured PEM pair, or (unset, unreadable or unusable) a
//! self-signed P-256 certificate for the node name, the node IP and 127.0.0.1. TLS 1.2 and
//! 1.3, ALPN `h2` then `http/1.1`. Client certificates are *requested* (the cluster CA named as
//! the acceptable issuer) but not required, and any chain passes the handshake: the request
//! layer ([`crate::auth`]) verifies it against the cluster CA and answers 401 when it does not,
//! as a kubelet does (Go's `tls.RequestClientCert`).

use httpd::tls::{CertPair, ALPN_H2_HTTP1};
use rustls::server::danger::ClientCertVerifier;
use rustls::ServerConfig;
use std::path::Path;
use std::sync::Arc;
use tracing::{info, warn};

/// Why no TLS configuration could be built at all.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("minting the self-signed kubelet certificate")]
    SelfSigned(#[source] httpd::tls::TlsError),
}

/// Where the serving certificate came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertSource {
    Files,
    /// Self-signed, and why the files were not used.
    SelfSigned {
        why: String,
    },
}

/// A self-signed P-256 certificate (PEM chain of one) and its PKCS#8 key for `node`, `node_ip`
/// (when it is an IP address) and 127.0.0.1.
pub fn self_signed(node: &str, node_ip: Option<&str>) -> Result<CertPair, TlsError> {
    let mut names = vec![node.to_string()];
    if let Some(ip) = node_ip.filter(|ip| ip.parse::<std::net::IpAddr>().is_ok()) {
        names.push(ip.to_string());
    }
    names.push("127.0.0.1".into());
    names.dedup();
    httpd::tls::self_signed(&names).map_err(TlsError::SelfSigned)
}

fn from_files(
    cert: &Path,
    key: &Path,
    client: Arc<dyn ClientCertVerifier>,
) -> Result<Arc<ServerConfig>, httpd::tls::TlsError> {
    let chain = httpd::tls::load_chain(cert)?;
    let key = httpd::tls::load_key(key)?;
    httpd::tls::server_config(chain, key, ALPN_H2_HTTP1, Some(client))
}

/// The server configuration: the files when both are set and usable, else self-signed; client
/// certificates requested through `client` (from [`crate::auth::x509::ClientCa::tls_verifier`]).
pub fn server_config(
    cert: Option<&Path>,
    key: Option<&Path>,
    node: &str,
    node_ip: Option<&str>,
    client: Arc<dyn ClientCertVerifier>,
) -> Result<(Arc<ServerConfig>, CertSource), TlsError> {
    let why = match (cert, key) {
        (Some(cert), Some(key)) => match from_files(cert, key, client.clone()) {
            Ok(config) => {
                info!(cert = %cert.display(), "kubelet endpoint: serving the configured certificate");
                return Ok((config, CertSource::Files));
            }
            Err(e) => {
                let e = foundation::error_chain(&e);
                warn!(error = %e, "kubelet endpoint: the configured certificate is unusable; using a self-signed one");
                e
            }
        },
        _ => "no certificate configured".to_string(),
    };
    let pair = self_signed(node, node_ip)?;
    let config = httpd::tls::pair_der(&pair)
        .and_then(|(chain, key)| httpd::tls::server_config(chain, key, ALPN_H2_HTTP1, Some(client)))
        .map_err(TlsError::SelfSigned)?;
    info!(node, "kubelet endpoint: serving a self-signed P-256 certificate");
    Ok((config, CertSource::SelfSigned { why }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::x509::ClientCa;

    fn verifier() -> Arc<dyn ClientCertVerifier> {
        ClientCa::none().tls_verifier()
    }

    #[test]
    fn unset_or_unreadable_files_fall_back_to_self_signed() {
        let (config, src) = server_config(None, None, "vk-a", Some("10.1.2.3"), verifier()).expect("self-signed");
        assert!(matches!(src, CertSource::SelfSigned { .. }));
        assert_eq!(config.alpn_protocols, [b"h2".to_vec(), b"http/1.1".to_vec()]);
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nope.crt");
        let (_, src) = server_config(Some(&missing), Some(&missing), "vk-a", None, verifier()).expect("self-signed");
        match src {
            CertSource::SelfSigned { why } => assert!(why.contains("nope.crt"), "{why}"),
            other => panic!("{other:?}"),
        }
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not pem").expect("write");
        let (_, src) = server_config(Some(&garbage), Some(&garbage), "vk-a", None, verifier()).expect("self-signed");
        assert!(matches!(src, CertSource::SelfSigned { .. }));
    }

    #[test]
    fn readable_files_are_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pair = self_signed("vk-b", None).expect("generate");
        let (c, k) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&c, pair.cert_pem).expect("write");
        std::fs::write(&k, pair.key_pem).expect("write");
        let (_, src) = server_config(Some(&c), Some(&k), "vk-b", None, verifier()).expect("files");
        assert_eq!(src, CertSource::Files);
    }
}

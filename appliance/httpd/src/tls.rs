//! TLS for the box's servers: a [`ServerConfig`] from PEM files, self-signed certificates minted
//! on first boot ([`ensure_self_signed`]), and SHA-256 fingerprints an operator compares before
//! trusting one.
//!
//! And for the box's clients of those servers ([`client_config`]): trust a certificate file (each
//! certificate in it is accepted as the server's exact certificate, whatever names it carries,
//! or as a CA the server's chain leads to, with the host name checked), or pin a SHA-256
//! fingerprint ([`Trust`]). A box's own clients (vk-sandbox, the supervisor's probes) reach
//! sandboxd on `127.0.0.1`, which an operator's certificate need not name: the exact-certificate
//! rule is what lets them trust it.
//!
//! TLS 1.2 and 1.3 only (rustls' safe defaults, the ring provider).

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use sha2::Digest as _;

/// ALPN for HTTP/1.1 only (the SDK offers exactly this; upgrades need HTTP/1.1).
pub const ALPN_HTTP1: &[&[u8]] = &[b"http/1.1"];
/// ALPN for HTTP/2 then HTTP/1.1.
pub const ALPN_H2_HTTP1: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Why a TLS configuration or certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {problem}")]
    Pem {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// rustls refused the certificate and key.
    #[error("building the TLS server configuration")]
    Config(#[source] rustls::Error),
    /// Generating a certificate failed.
    #[error("generating a self-signed certificate")]
    Generate(#[source] rcgen::Error),
    /// A certificate fingerprint is not 32 bytes of hex.
    #[error("{0:?} is not a SHA-256 fingerprint (64 hex digits, colons allowed, as `chrysalis status` prints it)")]
    Fingerprint(String),
    /// Writing a minted certificate or key failed.
    #[error("writing {path}")]
    Write {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// A certificate chain and its key, as PEM.
#[derive(Clone)]
pub struct CertPair {
    /// The chain, leaf first.
    pub cert_pem: String,
    /// The PKCS#8 private key.
    pub key_pem: String,
}

impl std::fmt::Debug for CertPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertPair").field("cert_pem", &self.cert_pem).field("key_pem", &"<redacted>").finish()
    }
}

fn pem_err(path: &Path, problem: impl std::fmt::Display) -> TlsError {
    TlsError::Pem { path: path.display().to_string(), problem: problem.to_string() }
}

/// Reads a PEM certificate chain (leaf first).
pub fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| pem_err(path, e))?;
    if chain.is_empty() {
        return Err(pem_err(path, "no CERTIFICATE block"));
    }
    Ok(chain)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| pem_err(path, e))
}

/// A server configuration over a chain and key, offering `alpn`, with an optional client
/// certificate verifier (the kubelet port's).
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    alpn: &[&[u8]],
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let builder = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?;
    let builder = match client_verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(TlsError::Config)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A server configuration from a PEM certificate file and a PEM key file.
pub fn server_config_from_files(cert: &Path, key: &Path, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
    server_config(load_chain(cert)?, load_key(key)?, alpn, None)
}

/// A self-signed P-256 certificate for `names` (DNS names or IP addresses; the first is also
/// the common name), valid for ten years.
pub fn self_signed(names: &[String]) -> Result<CertPair, TlsError> {
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(TlsError::Generate)?;
    if let Some(cn) = names.first() {
        params.distinguished_name.push(rcgen::DnType::CommonName, cn.as_str());
    }
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2036, 1, 1);
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(TlsError::Generate)?;
    let cert = params.self_signed(&key).map_err(TlsError::Generate)?;
    Ok(CertPair { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// The key of a [`CertPair`] as DER (for [`server_config`] without files).
pub fn pair_der(pair: &CertPair) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let chain = CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(Path::new("<minted>"), e))?;
    let key =
        PrivatePkcs8KeyDer::from_pem_slice(pair.key_pem.as_bytes()).map_err(|e| pem_err(Path::new("<minted>"), e))?;
    Ok((chain, PrivateKeyDer::Pkcs8(key)))
}

/// The SHA-256 fingerprint of a DER certificate, as `openssl x509 -fingerprint -sha256`
/// prints it: upper-case hex pairs joined by colons.
pub fn fingerprint(cert_der: &[u8]) -> String {
    let digest = sha2::Sha256::digest(cert_der);
    digest.iter().map(|b| format!("{b:02X}")).collect::<Vec<_>>().join(":")
}

/// The fingerprint of the leaf certificate of a PEM file.
pub fn file_fingerprint(cert: &Path) -> Result<String, TlsError> {
    let chain = load_chain(cert)?;
    Ok(fingerprint(chain[0].as_ref()))
}

/// What [`ensure_self_signed`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ensured {
    /// The leaf's SHA-256 fingerprint.
    pub fingerprint: String,
    /// Whether a new pair was minted now.
    pub minted: bool,
}

/// Keeps a usable certificate and key at `cert`/`key`, or mints a self-signed pair for `names`
/// there: the key 0600 in a 0700 directory, written before the certificate (a certificate
/// without its key is never left behind; a key without a certificate is replaced).
pub fn ensure_self_signed(cert: &Path, key: &Path, names: &[String]) -> Result<Ensured, TlsError> {
    if let (Ok(chain), Ok(k)) = (load_chain(cert), load_key(key)) {
        if server_config(chain.clone(), k, ALPN_HTTP1, None).is_ok() {
            return Ok(Ensured { fingerprint: fingerprint(chain[0].as_ref()), minted: false });
        }
    }
    let pair = self_signed(names)?;
    fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
        move |source| TlsError::Write { path: path.display().to_string(), source }
    }
    foundation::write_secret(key, pair.key_pem.as_bytes()).map_err(write_err(key))?;
    if let Some(dir) = cert.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    }
    foundation::write_atomic(cert, pair.cert_pem.as_bytes(), foundation::PUBLIC_FILE).map_err(write_err(cert))?;
    Ok(Ensured { fingerprint: file_fingerprint(cert)?, minted: true })
}

// ------------------------------------------------------------------------------- clients

/// What a client of a box's server trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// A PEM file: each certificate in it is accepted as the server's exact certificate (no
    /// name check: the bytes are the pin), or as a CA the server's chain must lead to (names
    /// checked, as any TLS client does).
    File(std::path::PathBuf),
    /// The SHA-256 fingerprint of the server's certificate (`AB:CD:…` or plain hex).
    Fingerprint(String),
}

/// Parses a SHA-256 fingerprint: 64 hex digits, optionally colon-separated and prefixed with
/// `sha256:` or `SHA256=`, any case.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], TlsError> {
    let bad = || TlsError::Fingerprint(s.to_string());
    let t = s.trim();
    let t = t.strip_prefix("sha256:").or_else(|| t.strip_prefix("SHA256:")).unwrap_or(t);
    let t = t.strip_prefix("sha256=").or_else(|| t.strip_prefix("SHA256=")).unwrap_or(t);
    let hex: String = t.chars().filter(|c| *c != ':').collect();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The verifier behind [`client_config`]: exact certificates (by SHA-256), else a CA chain.
#[derive(Debug)]
struct TrustVerifier {
    pinned: Vec<[u8; 32]>,
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for TrustVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let digest: [u8; 32] = sha2::Sha256::digest(end_entity.as_ref()).into();
        if self.pinned.contains(&digest) {
            return Ok(ServerCertVerified::assertion());
        }
        match &self.chain {
            Some(v) => v.verify_server_cert(end_entity, intermediates, server_name, ocsp, now),
            None => Err(rustls::Error::General(format!(
                "the server's certificate (SHA-256 {}) is not the trusted one",
                fingerprint(end_entity.as_ref())
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// A client configuration that trusts `trust` (see [`Trust`]) and offers `alpn`.
pub fn client_config(trust: &Trust, alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = match trust {
        Trust::Fingerprint(f) => {
            TrustVerifier { pinned: vec![parse_fingerprint(f)?], chain: None, provider: provider.clone() }
        }
        Trust::File(path) => {
            let certs = load_chain(path)?;
            let pinned = certs.iter().map(|c| sha2::Sha256::digest(c.as_ref()).into()).collect();
            let mut roots = RootCertStore::empty();
            // A leaf that cannot be a trust anchor is still pinned above; only usable CAs are roots.
            let (added, _) = roots.add_parsable_certificates(certs);
            let chain = if added > 0 {
                Some(
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| pem_err(path, e))?,
                )
            } else {
                None
            };
            TrustVerifier { pinned, chain, provider: provider.clone() }
        }
    };
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn minted_once_then_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = (dir.path().join("tls/cert.pem"), dir.path().join("tls/key.pem"));
        let names = vec!["box.local".to_string(), "127.0.0.1".to_string()];
        let first = ensure_self_signed(&cert, &key, &names).expect("mint");
        assert!(first.minted);
        assert_eq!(first.fingerprint.len(), 32 * 3 - 1);
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&key), 0o600);
        assert_eq!(mode(key.parent().expect("dir")), 0o700);
        let again = ensure_self_signed(&cert, &key, &names).expect("keep");
        assert_eq!(again, Ensured { fingerprint: first.fingerprint.clone(), minted: false });
        // A garbled key is replaced by a fresh pair.
        std::fs::write(&key, "garbage").expect("garble");
        let fresh = ensure_self_signed(&cert, &key, &names).expect("re-mint");
        assert!(fresh.minted && fresh.fingerprint != first.fingerprint);
    }
}

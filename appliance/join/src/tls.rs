//! [`NoVerify`], a server-certificate verifier that accepts any certificate but still checks
//! the handshake signatures: for clients of self-signed endpoints in tests (vnode's kubelet
//! port tests). The join itself never uses it: its one unverified read (the first
//! `cluster-info` fetch) goes through kube's `accept_invalid_certs` and is trusted only once
//! its JWS verifies. Compiled only for tests (`cfg(test)` or the `test-utils` feature, which
//! only dev-dependencies enable).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// Accepts any server certificate (still checking the handshake signatures).
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

//! Client certificates on the kubelet port, as Go's `tls.RequestClientCert` plus the
//! kubelet's x509 authenticator do it: the TLS layer *asks* for a certificate (naming the
//! cluster CA as the acceptable issuer) and checks that the client holds its key, but accepts
//! any chain; the request layer then verifies the chain against the cluster CA (`webpki`, client
//! auth usage, validity now). So an unknown certificate gets an HTTP 401 instead of a handshake
//! failure, and a verified one is the identity `CN` = user, `O` = groups.
//!
//! Without a CA ([`ClientCa::none`]) certificates are still requested (so a client's
//! handshake does not change) but none is ever accepted.

use super::UserInfo;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use std::sync::Arc;

/// Why a client certificate is not an identity (each answers 401).
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("no client CA is configured on this node, so no client certificate is accepted")]
    NoClientCa,
    #[error("the client certificate does not verify against the cluster CA")]
    Unverified(#[source] rustls::Error),
    #[error("the client certificate does not parse: {0}")]
    Parse(String),
    #[error("the client certificate has no common name (the user name)")]
    NoCommonName,
    #[error("the client certificate has more than one common name")]
    ManyCommonNames,
}

/// Why the client CA cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ClientCaError {
    #[error("CA certificate {index} of the client CA bundle is unusable")]
    BadCertificate {
        index: usize,
        #[source]
        source: rustls::Error,
    },
    #[error("building the client certificate verifier")]
    Verifier(#[source] rustls::server::VerifierBuilderError),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The CA client certificates must chain to (the kubelet's `--client-ca-file`).
#[derive(Debug, Clone)]
pub struct ClientCa {
    verifier: Option<Arc<dyn ClientCertVerifier>>,
    hints: Arc<[DistinguishedName]>,
}

impl ClientCa {
    /// Accepts certificates chaining to one of `roots`; no roots is [`ClientCa::none`].
    pub fn new(roots: &[CertificateDer<'static>]) -> Result<ClientCa, ClientCaError> {
        if roots.is_empty() {
            return Ok(ClientCa::none());
        }
        let mut store = RootCertStore::empty();
        for (index, root) in roots.iter().enumerate() {
            store.add(root.clone()).map_err(|source| ClientCaError::BadCertificate { index, source })?;
        }
        let hints: Arc<[DistinguishedName]> = store.subjects().into();
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider())
            .build()
            .map_err(ClientCaError::Verifier)?;
        Ok(ClientCa { verifier: Some(verifier), hints })
    }

    /// Accepts no certificate.
    pub fn none() -> ClientCa {
        ClientCa { verifier: None, hints: Arc::from(Vec::new()) }
    }

    /// Whether a CA is configured.
    pub fn is_configured(&self) -> bool {
        self.verifier.is_some()
    }

    /// The handshake-level verifier: requests a certificate, proves key possession, accepts any
    /// chain (the request layer calls [`ClientCa::identify`]).
    pub fn tls_verifier(&self) -> Arc<dyn ClientCertVerifier> {
        Arc::new(RequestClientCert {
            hints: self.hints.clone(),
            algorithms: provider().signature_verification_algorithms,
        })
    }

    /// The identity of a client that presented `chain` (leaf first): verified against the CA
    /// now, then `CN` → user name, each `O` → a group.
    pub fn identify(&self, chain: &[CertificateDer<'static>]) -> Result<UserInfo, CertError> {
        let verifier = self.verifier.as_ref().ok_or(CertError::NoClientCa)?;
        let (leaf, intermediates) = chain.split_first().ok_or(CertError::Parse("an empty chain".into()))?;
        verifier.verify_client_cert(leaf, intermediates, UnixTime::now()).map_err(CertError::Unverified)?;
        subject_identity(leaf)
    }
}

/// `CN` → user name, `O`s → groups, as the Kubernetes x509 authenticator maps a subject.
pub fn subject_identity(leaf: &CertificateDer<'_>) -> Result<UserInfo, CertError> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).map_err(|e| CertError::Parse(e.to_string()))?;
    let subject = cert.subject();
    let text = |a: &x509_parser::x509::AttributeTypeAndValue<'_>| {
        a.as_str().map(str::to_owned).map_err(|e| CertError::Parse(format!("a subject attribute is not text: {e}")))
    };
    let cns = subject.iter_common_name().map(text).collect::<Result<Vec<_>, _>>()?;
    let username = match cns.as_slice() {
        [] => return Err(CertError::NoCommonName),
        [cn] if cn.is_empty() => return Err(CertError::NoCommonName),
        [cn] => cn.clone(),
        _ => return Err(CertError::ManyCommonNames),
    };
    let groups = subject.iter_organization().map(text).collect::<Result<Vec<_>, _>>()?;
    Ok(UserInfo { username, uid: String::new(), groups, extra: Default::default() })
}

/// Go's `tls.RequestClientCert`: offer client authentication, never require it, and accept any
/// chain whose handshake signature checks out.
#[derive(Debug)]
struct RequestClientCert {
    hints: Arc<[DistinguishedName]>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for RequestClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        // Deliberately accepted here: the request layer verifies the chain and answers 401.
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Test certificates: a CA and leaves it signs, and self-signed strangers.
#[cfg(test)]
pub(crate) mod testing {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
    use rustls::pki_types::CertificateDer;

    /// A certificate and its key (PEM).
    pub struct Leaf {
        pub der: CertificateDer<'static>,
        pub cert_pem: String,
        pub key_pem: String,
    }

    /// A test CA.
    pub struct Ca {
        pub der: CertificateDer<'static>,
        issuer: Issuer<'static, KeyPair>,
    }

    impl Ca {
        pub fn new(cn: &str) -> Ca {
            let key = KeyPair::generate().expect("key");
            let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let cert = p.self_signed(&key).expect("self-sign");
            Ca { der: cert.der().clone(), issuer: Issuer::new(p, key) }
        }

        /// A client certificate for `cn` in `orgs` (at most one: rcgen keeps one value per
        /// attribute type), valid now.
        pub fn client(&self, cn: Option<&str>, orgs: &[&str]) -> Leaf {
            self.leaf(cn, orgs, ExtendedKeyUsagePurpose::ClientAuth, false)
        }

        /// A leaf with `usage`, or one that expired a year ago.
        pub fn leaf(&self, cn: Option<&str>, orgs: &[&str], usage: ExtendedKeyUsagePurpose, expired: bool) -> Leaf {
            let key = KeyPair::generate().expect("key");
            let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
            // rcgen's default subject has a CN; a DN holds one value per attribute type.
            p.distinguished_name = rcgen::DistinguishedName::new();
            if let Some(cn) = cn {
                p.distinguished_name.push(DnType::CommonName, cn);
            }
            for o in orgs {
                p.distinguished_name.push(DnType::OrganizationName, *o);
            }
            p.extended_key_usages = vec![usage];
            if expired {
                p.not_before = rcgen::date_time_ymd(2020, 1, 1);
                p.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let cert = p.signed_by(&key, &self.issuer).expect("sign");
            Leaf { der: cert.der().clone(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
        }
    }

    /// A self-signed client certificate no CA vouches for.
    pub fn stranger(cn: &str) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.distinguished_name.push(DnType::CommonName, cn);
        p.distinguished_name.push(DnType::OrganizationName, "system:masters");
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.self_signed(&key).expect("self-sign");
        Leaf { der: cert.der().clone(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{stranger, Ca};
    use super::*;
    use rcgen::ExtendedKeyUsagePurpose;

    #[test]
    fn a_certificate_from_the_ca_is_its_cn_and_orgs() {
        let ca = Ca::new("kubernetes");
        let client = ClientCa::new(std::slice::from_ref(&ca.der)).expect("ca");
        assert!(client.is_configured());
        let leaf = ca.client(Some("kube-apiserver-kubelet-client"), &["system:masters"]);
        let who = client.identify(&[leaf.der]).expect("verified");
        assert_eq!(who.username, "kube-apiserver-kubelet-client");
        assert_eq!(who.groups, ["system:masters"]);
        let who = client.identify(&[ca.client(Some("u"), &[]).der]).expect("verified");
        assert!(who.groups.is_empty());
        assert!(who.uid.is_empty() && who.extra.is_empty());
    }

    #[test]
    fn everything_else_is_refused() {
        let ca = Ca::new("kubernetes");
        let client = ClientCa::new(std::slice::from_ref(&ca.der)).expect("ca");
        let other_ca = Ca::new("kubernetes");
        let e = client.identify(&[stranger("system:admin").der]).expect_err("self-signed");
        assert!(matches!(e, CertError::Unverified(_)), "{e}");
        let e = client.identify(&[other_ca.client(Some("u"), &[]).der]).expect_err("another CA with the same name");
        assert!(matches!(e, CertError::Unverified(_)), "{e}");
        let e = client
            .identify(&[ca.leaf(Some("u"), &[], ExtendedKeyUsagePurpose::ClientAuth, true).der])
            .expect_err("expired");
        assert!(matches!(e, CertError::Unverified(_)), "{e}");
        let e = client
            .identify(&[ca.leaf(Some("u"), &[], ExtendedKeyUsagePurpose::ServerAuth, false).der])
            .expect_err("a serving certificate is not a client identity");
        assert!(matches!(e, CertError::Unverified(_)), "{e}");
        let e = client.identify(&[ca.client(None, &["g"]).der]).expect_err("no CN");
        assert!(matches!(e, CertError::NoCommonName), "{e}");
        let e = client.identify(&[]).expect_err("empty chain");
        assert!(matches!(e, CertError::Parse(_)), "{e}");
        let e = ClientCa::none().identify(&[ca.client(Some("u"), &[]).der]).expect_err("no CA configured");
        assert!(matches!(e, CertError::NoClientCa), "{e}");
        assert!(ClientCa::new(&[]).expect("empty").verifier.is_none());
        let e = ClientCa::new(&[CertificateDer::from(b"garbage".to_vec())]).expect_err("garbage CA");
        assert!(matches!(e, ClientCaError::BadCertificate { index: 0, .. }), "{e}");
    }

    #[test]
    fn the_handshake_verifier_asks_but_does_not_insist() {
        let ca = Ca::new("kubernetes");
        let v = ClientCa::new(std::slice::from_ref(&ca.der)).expect("ca").tls_verifier();
        assert!(v.offer_client_auth() && !v.client_auth_mandatory());
        assert_eq!(v.root_hint_subjects().len(), 1, "the CA is named as the acceptable issuer");
        assert!(v.verify_client_cert(&stranger("x").der, &[], UnixTime::now()).is_ok());
        assert!(!v.supported_verify_schemes().is_empty());
        let none = ClientCa::none().tls_verifier();
        assert!(none.offer_client_auth() && none.root_hint_subjects().is_empty());
    }
}

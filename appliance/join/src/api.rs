//! The apiserver clients of a join: a `kube::Client` per step, built from a `kube::Config`
//! that names one `https://` endpoint, how the server is trusted ([`Trust`]) and who the
//! client is ([`Identity`]); nothing comes from the environment (`$KUBECONFIG`, in-cluster
//! files). Every call is bounded by [`TIMEOUT`] ([`call`]).

use std::future::Future;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use secrecy::SecretString;

use crate::token::BootstrapToken;
use crate::JoinError;

/// How long one request may take, from connecting to the last byte of the answer.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);

/// How the server is verified.
#[derive(Clone, Copy)]
pub(crate) enum Trust<'a> {
    /// Not at all: only for the first read of `cluster-info`, trusted once its JWS verifies.
    Insecure,
    /// Against this CA (PEM) only, never the system roots.
    Ca(&'a str),
}

/// How the client authenticates.
#[derive(Clone, Copy)]
pub(crate) enum Identity<'a> {
    Anonymous,
    /// `Authorization: Bearer <id>.<secret>` (as `system:bootstrap:<id>`).
    Token(&'a BootstrapToken),
    /// A client certificate and its key (PEM).
    Certificate {
        cert_pem: &'a str,
        key_pem: &'a str,
    },
}

/// The configuration for `endpoint`: `https://host[:port]` and nothing else (no path, no
/// query), so no request ever goes out in clear.
fn config(endpoint: &str) -> Result<kube::Config, JoinError> {
    let bad = || JoinError::Endpoint { endpoint: endpoint.to_owned() };
    let config = kube::Config::new(endpoint.trim_end_matches('/').parse().map_err(|_| bad())?);
    let url = &config.cluster_url;
    // host[:port] with a valid port, no user info.
    let authority_ok = url.authority().is_some_and(|a| {
        !a.host().is_empty() && !a.as_str().contains('@') && (a.as_str() == a.host() || a.port_u16().is_some())
    });
    if url.scheme_str() != Some("https") || !authority_ok || !matches!(url.path(), "" | "/") || url.query().is_some() {
        return Err(bad());
    }
    Ok(config)
}

/// The DER certificates of a PEM bundle (at least one).
/// A self-signed certificate made for this client only (see [`Trust::Insecure`] in [`client`]).
fn throwaway_cert() -> Result<Vec<u8>, JoinError> {
    let made = rcgen::KeyPair::generate()
        .and_then(|key| rcgen::CertificateParams::new(Vec::<String>::new())?.self_signed(&key));
    made.map(|cert| cert.der().to_vec()).map_err(|e| JoinError::Csr(format!("a throwaway certificate: {e}")))
}

fn roots(pem: &str) -> Result<Vec<Vec<u8>>, JoinError> {
    let roots = CertificateDer::pem_slice_iter(pem.as_bytes())
        .map(|cert| cert.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| JoinError::BadCa(format!("PEM: {e}")))?;
    if roots.is_empty() {
        return Err(JoinError::BadCa("the CA PEM holds no certificate".into()));
    }
    Ok(roots)
}

/// A client of `endpoint` that trusts and authenticates as told. Requests are never retried
/// (a retried `create` could leave a second CSR behind).
pub(crate) fn client(endpoint: &str, trust: Trust<'_>, identity: Identity<'_>) -> Result<kube::Client, JoinError> {
    let mut config = config(endpoint)?;
    config.connect_timeout = Some(TIMEOUT);
    // Per call instead (`call`): a read timeout would also cut the CSR watch.
    config.read_timeout = None;
    config.write_timeout = Some(TIMEOUT);
    config.default_retry = false;
    match trust {
        Trust::Insecure => {
            config.accept_invalid_certs = true;
            // With no roots of its own, kube loads the system's, and a box has none (no CA
            // bundle in the image): building the client would fail. These roots are never
            // consulted (the verifier accepts anything here), so a throwaway certificate will do.
            config.root_cert = Some(vec![throwaway_cert()?]);
        }
        Trust::Ca(pem) => config.root_cert = Some(roots(pem)?),
    }
    match identity {
        Identity::Anonymous => {}
        Identity::Token(token) => config.auth_info.token = Some(SecretString::from(token.bearer())),
        Identity::Certificate { cert_pem, key_pem } => {
            config.auth_info.client_certificate_data = Some(STANDARD.encode(cert_pem));
            config.auth_info.client_key_data = Some(SecretString::from(STANDARD.encode(key_pem)));
        }
    }
    kube::Client::try_from(config)
        .map_err(|source| JoinError::Client { endpoint: endpoint.to_owned(), source: Box::new(source) })
}

/// Awaits one API call on `endpoint` for at most [`TIMEOUT`]; `what` names it in errors.
pub(crate) async fn call<T>(
    endpoint: &str,
    what: impl Into<String>,
    request: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, JoinError> {
    match tokio::time::timeout(TIMEOUT, request).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(source)) => {
            Err(JoinError::Api { endpoint: endpoint.to_owned(), what: what.into(), source: Box::new(source) })
        }
        Err(_) => Err(JoinError::Timeout { endpoint: endpoint.to_owned(), what: what.into(), timeout: TIMEOUT }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn only_bare_https_endpoints_are_accepted() {
        for good in ["https://127.0.0.1:6443", "https://k8s.example/", "https://[::1]:6443"] {
            assert!(config(good).is_ok(), "{good} refused");
        }
        assert_eq!(config("https://[::1]:6443").unwrap().cluster_url.port_u16(), Some(6443));
        for bad in [
            "http://127.0.0.1:6443",
            "https://",
            "https://h:x",
            "https://h:1/api",
            "https://h?x=1",
            "https://u@h:1",
            "h:1",
            "",
        ] {
            assert!(matches!(config(bad), Err(JoinError::Endpoint { .. })), "{bad} accepted");
        }
    }

    #[test]
    fn a_pinned_ca_must_hold_a_certificate() {
        assert!(matches!(roots("no PEM here"), Err(JoinError::BadCa(_))));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap();
        assert_eq!(roots(&cert.pem()).unwrap(), vec![cert.der().to_vec()]);
    }
}

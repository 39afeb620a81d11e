//! kubeadm token discovery: read `kube-public/cluster-info` unverified, check the bootstrap
//! signer's detached JWS with the token, pin the CA by its SubjectPublicKeyInfo hash, then
//! re-read over TLS pinned to that CA and require the same kubeconfig. Both reads are anonymous
//! `kube::Api<ConfigMap>` gets; only the second verifies the server.

use k8s_openapi::api::core::v1::ConfigMap;

use crate::api::{self, Identity, Trust};
use crate::token::{BootstrapToken, CaHash};
use crate::{jws, kubeconfig, JoinError};

/// The cluster, as discovery established it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    /// The cluster CA (PEM), pinned.
    pub ca_pem: String,
    /// The apiserver URL from the discovery kubeconfig.
    pub server: String,
}

/// The CA pin (`sha256:` of the SubjectPublicKeyInfo) of the first certificate in `pem`.
pub fn ca_hash_of_pem(pem: &str) -> Result<CaHash, JoinError> {
    let (_, parsed) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| JoinError::BadCa(format!("PEM: {e}")))?;
    let cert = parsed.parse_x509().map_err(|e| JoinError::BadCa(format!("certificate: {e}")))?;
    Ok(CaHash::of_spki(cert.tbs_certificate.subject_pki.raw))
}

/// Reads `kube-public/cluster-info` anonymously, trusting the server as `trust` says: its
/// discovery kubeconfig and the signature for `token`, if any.
async fn read_kubeconfig(
    endpoint: &str,
    trust: Trust<'_>,
    token: &BootstrapToken,
) -> Result<(String, Option<String>), JoinError> {
    let client = api::client(endpoint, trust, Identity::Anonymous)?;
    let cluster_info = kube::Api::<ConfigMap>::namespaced(client, "kube-public");
    let cm = api::call(endpoint, "reading kube-public/cluster-info", cluster_info.get("cluster-info")).await?;
    let mut data = cm.data.unwrap_or_default();
    let kubeconfig = data
        .remove("kubeconfig")
        .ok_or_else(|| JoinError::ClusterInfo { endpoint: endpoint.to_owned(), what: "no data.kubeconfig".into() })?;
    let sig = data.remove(&format!("jws-kubeconfig-{}", token.id()));
    Ok((kubeconfig, sig))
}

/// Discovers the cluster at `endpoint` (`https://host:port`) with `token`, accepting only a CA
/// whose public-key hash is among `pins`. Fails closed on any doubt.
#[tracing::instrument(skip_all, fields(endpoint, token_id = token.id()))]
pub async fn discover(endpoint: &str, token: &BootstrapToken, pins: &[CaHash]) -> Result<ClusterInfo, JoinError> {
    if pins.is_empty() {
        return Err(JoinError::NoPins { endpoint: endpoint.to_owned() });
    }
    let (kubeconfig, sig) = read_kubeconfig(endpoint, Trust::Insecure, token).await?;
    let sig =
        sig.ok_or_else(|| JoinError::Unsigned { endpoint: endpoint.to_owned(), token_id: token.id().to_owned() })?;
    jws::verify_detached(&sig, kubeconfig.as_bytes(), token).map_err(|source| JoinError::BadSignature {
        endpoint: endpoint.to_owned(),
        token_id: token.id().to_owned(),
        source,
    })?;
    let (ca_pem, server) = kubeconfig::parse_discovery(&kubeconfig)
        .map_err(|source| JoinError::Kubeconfig { endpoint: endpoint.to_owned(), source })?;
    let actual = ca_hash_of_pem(&ca_pem)?;
    if !pins.contains(&actual) {
        return Err(JoinError::CaHashMismatch { endpoint: endpoint.to_owned(), expected: pins.to_vec(), actual });
    }
    let (again, _) = read_kubeconfig(endpoint, Trust::Ca(&ca_pem), token).await?;
    if again != kubeconfig {
        return Err(JoinError::ClusterInfo {
            endpoint: endpoint.to_owned(),
            what: "the CA-pinned read of cluster-info differs from the signed one".into(),
        });
    }
    tracing::info!(ca_hash = %actual, server, "discovered the cluster");
    Ok(ClusterInfo { ca_pem, server })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use rcgen::PublicKeyData;

    #[test]
    fn ca_hash_is_the_sha256_of_the_subject_public_key_info() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap();
        let expected = {
            use sha2::Digest;
            format!("sha256:{}", hex::encode(sha2::Sha256::digest(key.subject_public_key_info())))
        };
        assert_eq!(ca_hash_of_pem(&cert.pem()).unwrap().as_str(), expected);
        // Not the hash of the whole certificate.
        let whole = CaHash::of_spki(cert.der());
        assert_ne!(ca_hash_of_pem(&cert.pem()).unwrap(), whole);
        assert!(ca_hash_of_pem("not a pem").is_err());
    }
}

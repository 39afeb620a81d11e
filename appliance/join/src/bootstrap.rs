//! The kubelet TLS bootstrap for one virtual node: a `system:node:<name>` client certificate
//! obtained through a `kubernetes.io/kube-apiserver-client-kubelet` CSR, kept 0600 in the
//! node's state directory, reused across restarts and renewed at a jittered 70–90 % of its life.
//! The CSR is created through `kube::Api<CertificateSigningRequest>` on a client pinned to the
//! cluster CA, and its issuance awaited with kube-runtime's `await_condition`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use rand::Rng;

use crate::api::{self, Identity, Trust};
use crate::discovery::ClusterInfo;
use crate::token::BootstrapToken;
use crate::{kubeconfig, JoinError};

/// The node's client identity on disk.
#[derive(Debug, Clone)]
pub struct NodeCredentials {
    pub cert_pem: String,
    pub key_pem: String,
    /// A kubeconfig for `system:node:<name>` (its identity in the combined PEM beside it).
    pub kubeconfig_path: PathBuf,
    /// Validity of the certificate (seconds since the epoch).
    pub not_before: u64,
    pub not_after: u64,
}

/// Combined cert + key PEM (as kubelet's `kubelet-client-current.pem`): one file, one rename.
pub const IDENTITY_FILE: &str = "kubelet-client-current.pem";
/// The node kubeconfig.
pub use foundation::KUBECONFIG_FILE;
const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
const ISSUE_TIMEOUT: Duration = Duration::from_secs(60);

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> JoinError + 'a {
    move |source| JoinError::State { path: path.to_owned(), what, source }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The `CN`, `notBefore`, `notAfter` of the first certificate in `pem`.
fn cert_facts(pem: &str) -> Result<(String, u64, u64), JoinError> {
    let (_, parsed) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| JoinError::BadCert(format!("PEM: {e}")))?;
    let cert = parsed.parse_x509().map_err(|e| JoinError::BadCert(format!("certificate: {e}")))?;
    let cn = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).unwrap_or_default().to_owned();
    let secs = |t: x509_parser::time::ASN1Time| u64::try_from(t.timestamp()).unwrap_or(0);
    Ok((cn, secs(cert.validity().not_before), secs(cert.validity().not_after)))
}

/// Splits the combined PEM into (certificate PEM, key PEM).
fn split_identity(pem: &str) -> Option<(String, String)> {
    let key_start = pem.find("-----BEGIN PRIVATE KEY-----").or_else(|| pem.find("-----BEGIN EC PRIVATE KEY-----"))?;
    let (cert, key) = pem.split_at(key_start);
    cert.contains("-----BEGIN CERTIFICATE-----").then(|| (cert.trim().to_owned() + "\n", key.trim().to_owned() + "\n"))
}

/// Loads the stored identity of `node_name` from `state_dir`, if any and well-formed.
pub fn load(state_dir: &Path, node_name: &str) -> Result<Option<NodeCredentials>, JoinError> {
    let path = state_dir.join(IDENTITY_FILE);
    let pem = match std::fs::read_to_string(&path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, "reading the node identity")(e)),
    };
    let Some((cert_pem, key_pem)) = split_identity(&pem) else {
        tracing::warn!(path = %path.display(), "stored node identity is malformed; bootstrapping again");
        return Ok(None);
    };
    let Ok((cn, not_before, not_after)) = cert_facts(&cert_pem) else {
        tracing::warn!(path = %path.display(), "stored node certificate does not parse; bootstrapping again");
        return Ok(None);
    };
    if cn != format!("system:node:{node_name}") {
        tracing::warn!(path = %path.display(), cn, "stored node certificate is another node's; bootstrapping again");
        return Ok(None);
    }
    Ok(Some(NodeCredentials {
        cert_pem,
        key_pem,
        kubeconfig_path: state_dir.join(KUBECONFIG_FILE),
        not_before,
        not_after,
    }))
}

/// Fraction of the lifetime `[not_before, not_after]` elapsed at `now` (≥ 1 once expired).
fn elapsed_fraction(not_before: u64, not_after: u64, now: u64) -> f64 {
    if not_after <= not_before {
        return 1.0;
    }
    now.saturating_sub(not_before) as f64 / (not_after - not_before) as f64
}

/// When to renew: a uniformly jittered point in 70–90 % of the lifetime (seconds since the epoch).
pub fn rotation_deadline(creds: &NodeCredentials) -> u64 {
    let life = creds.not_after.saturating_sub(creds.not_before) as f64;
    let at = rand::rng().random_range(0.7..0.9);
    creds.not_before + (life * at) as u64
}

/// Writes a secret of the node (its identity, its kubeconfig) with `foundation::write_secret`:
/// born 0600 (no window in which it is readable), fsynced, renamed over `path`, in a directory
/// made 0700.
fn write_secret(path: &Path, contents: &[u8]) -> Result<(), JoinError> {
    foundation::write_secret(path, contents).map_err(io_err(path, "writing the secret atomically"))
}

/// Writes the node kubeconfig for `system:node:<node_name>` on `cluster`, its identity in the
/// combined PEM `identity`.
fn write_kubeconfig(cluster: &ClusterInfo, node_name: &str, identity: &Path, path: &Path) -> Result<(), JoinError> {
    let user = format!("system:node:{node_name}");
    let kc = kubeconfig::node_kubeconfig(&cluster.server, &cluster.ca_pem, &user, identity)
        .map_err(|source| JoinError::NodeKubeconfig { path: path.to_owned(), source })?;
    write_secret(path, kc.as_bytes())
}

/// Creates the state directory (and its missing parents) and makes it 0700.
fn prepare_dir(state_dir: &Path) -> Result<(), JoinError> {
    foundation::private_dir(state_dir).map_err(io_err(state_dir, "creating the state directory 0700"))
}

/// A fresh ECDSA P-256 key and its PEM CSR for `CN=system:node:<name>, O=system:nodes`, no SANs.
pub fn node_csr(node_name: &str) -> Result<(String, String), JoinError> {
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};
    let csr_err = |e: rcgen::Error| JoinError::Csr(e.to_string());
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(csr_err)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(csr_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "system:nodes");
    dn.push(DnType::CommonName, format!("system:node:{node_name}"));
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key).map_err(csr_err)?.pem().map_err(csr_err)?;
    Ok((key.serialize_pem(), csr))
}

/// The label naming the node a CSR is for.
const NODE_LABEL: &str = "chrysalis.cocoonstack.io/node";

/// The CSR object for `csr_pem` of `node_name`: the kubelet client signer, client auth only.
fn csr_object(node_name: &str, csr_pem: &str) -> CertificateSigningRequest {
    CertificateSigningRequest {
        metadata: ObjectMeta {
            generate_name: Some("node-csr-".into()),
            labels: Some(BTreeMap::from([(NODE_LABEL.to_owned(), node_name.to_owned())])),
            ..ObjectMeta::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(csr_pem.as_bytes().to_vec()),
            signer_name: SIGNER.into(),
            usages: Some(vec!["digital signature".into(), "client auth".into()]),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    }
}

/// Where a CSR stands: `None` while pending, else the issued certificate (PEM) or why it was
/// refused (a `Denied` or `Failed` condition, which wins over a certificate).
fn outcome(csr: &CertificateSigningRequest) -> Option<Result<String, String>> {
    let status = csr.status.as_ref()?;
    let refused = status.conditions.iter().flatten().find(|c| matches!(c.type_.as_str(), "Denied" | "Failed"));
    if let Some(c) = refused {
        return Some(Err(format!("{}: {}", c.type_, c.message.as_deref().unwrap_or_default())));
    }
    let cert = status.certificate.as_ref().filter(|c| !c.0.is_empty())?;
    Some(Ok(String::from_utf8_lossy(&cert.0).into_owned()))
}

/// Creates the CSR as `identity` and waits for the signed certificate.
async fn request_certificate(
    cluster: &ClusterInfo,
    identity: Identity<'_>,
    node_name: &str,
    csr_pem: &str,
) -> Result<String, JoinError> {
    let server = cluster.server.as_str();
    let client = api::client(server, Trust::Ca(&cluster.ca_pem), identity)?;
    let csrs = kube::Api::<CertificateSigningRequest>::all(client);
    let what = format!("creating the CSR for system:node:{node_name}");
    let created = api::call(server, what, csrs.create(&PostParams::default(), &csr_object(node_name, csr_pem))).await?;
    let name = created
        .metadata
        .name
        .clone()
        .ok_or_else(|| JoinError::CsrState { csr: String::new(), what: "the created CSR has no name".into() })?;
    tracing::info!(csr = name, "created the CSR; waiting for approval and signing");
    let settled = match outcome(&created) {
        Some(settled) => settled,
        None => {
            // Done when issued, refused or gone.
            let done = |csr: Option<&CertificateSigningRequest>| csr.is_none_or(|csr| outcome(csr).is_some());
            let waited = tokio::time::timeout(ISSUE_TIMEOUT, kube::runtime::wait::await_condition(csrs, &name, done))
                .await
                .map_err(|_| JoinError::CsrTimeout { csr: name.clone(), timeout: ISSUE_TIMEOUT })?
                .map_err(|source| JoinError::CsrWait { csr: name.clone(), source })?;
            let gone = || JoinError::CsrState { csr: name.clone(), what: "deleted before it was issued".into() };
            waited.as_ref().and_then(outcome).ok_or_else(gone)?
        }
    };
    settled.map_err(|what| JoinError::CsrState { csr: name, what })
}

/// Mints a fresh identity as `identity` and stores it.
async fn mint(
    cluster: &ClusterInfo,
    identity: Identity<'_>,
    node_name: &str,
    state_dir: &Path,
) -> Result<NodeCredentials, JoinError> {
    prepare_dir(state_dir)?;
    let (key_pem, csr_pem) = node_csr(node_name)?;
    let cert_pem = request_certificate(cluster, identity, node_name, &csr_pem).await?;
    let (cn, not_before, not_after) = cert_facts(&cert_pem)?;
    if cn != format!("system:node:{node_name}") {
        return Err(JoinError::BadCert(format!("issued certificate is for {cn:?}, not system:node:{node_name}")));
    }
    let identity = state_dir.join(IDENTITY_FILE);
    write_secret(&identity, format!("{}\n{}", cert_pem.trim(), key_pem).as_bytes())?;
    let kubeconfig_path = state_dir.join(KUBECONFIG_FILE);
    write_kubeconfig(cluster, node_name, &identity, &kubeconfig_path)?;
    tracing::info!(not_after, "stored the node identity");
    Ok(NodeCredentials { cert_pem, key_pem, kubeconfig_path, not_before, not_after })
}

/// The TLS bootstrap of `node_name`: the stored identity if it has more than 20 % of its
/// lifetime left, else a fresh key and certificate obtained with the bootstrap token.
#[tracing::instrument(skip_all, fields(node = node_name, token_id = token.id()))]
pub async fn bootstrap(
    cluster: &ClusterInfo,
    token: &BootstrapToken,
    node_name: &str,
    state_dir: &Path,
) -> Result<NodeCredentials, JoinError> {
    if let Some(creds) = load(state_dir, node_name)? {
        if elapsed_fraction(creds.not_before, creds.not_after, now_secs()) < 0.8 {
            tracing::info!("reusing the stored node identity");
            // The kubeconfig may predate a server move; rewrite it (cheap, atomic).
            write_kubeconfig(cluster, node_name, &state_dir.join(IDENTITY_FILE), &creds.kubeconfig_path)?;
            return Ok(creds);
        }
        tracing::info!("stored node identity is within 20 % of expiry; bootstrapping again");
    }
    mint(cluster, Identity::Token(token), node_name, state_dir).await
}

/// Re-keys and re-CSRs `node_name`, authenticating with its current client certificate
/// (approved as `selfnodeclient`).
#[tracing::instrument(skip_all, fields(node = node_name))]
pub async fn renew(
    cluster: &ClusterInfo,
    current: &NodeCredentials,
    node_name: &str,
    state_dir: &Path,
) -> Result<NodeCredentials, JoinError> {
    let identity = Identity::Certificate { cert_pem: &current.cert_pem, key_pem: &current.key_pem };
    mint(cluster, identity, node_name, state_dir).await
}

/// Renews when past `deadline` (from [`rotation_deadline`]); `None` when not yet due.
pub async fn renew_if_due(
    cluster: &ClusterInfo,
    current: &NodeCredentials,
    deadline: u64,
    node_name: &str,
    state_dir: &Path,
) -> Result<Option<NodeCredentials>, JoinError> {
    if now_secs() < deadline {
        return Ok(None);
    }
    renew(cluster, current, node_name, state_dir).await.map(Some)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn csr_has_the_node_subject_and_no_sans() {
        let (key, csr) = node_csr("vk-1").unwrap();
        assert!(key.contains("BEGIN PRIVATE KEY"));
        let (_, pem) = x509_parser::pem::parse_x509_pem(csr.as_bytes()).unwrap();
        use x509_parser::prelude::FromDer;
        let (_, req) = x509_parser::certification_request::X509CertificationRequest::from_der(&pem.contents).unwrap();
        let info = &req.certification_request_info;
        let cn: Vec<_> = info.subject.iter_common_name().map(|a| a.as_str().unwrap().to_owned()).collect();
        let o: Vec<_> = info.subject.iter_organization().map(|a| a.as_str().unwrap().to_owned()).collect();
        assert_eq!(cn, ["system:node:vk-1"]);
        assert_eq!(o, ["system:nodes"]);
        assert!(
            req.requested_extensions().into_iter().flatten().next().is_none(),
            "a CSR extension (SAN) was requested"
        );
        assert_eq!(info.subject_pki.algorithm.algorithm.to_id_string(), "1.2.840.10045.2.1", "not an EC key");
    }

    #[test]
    fn a_csr_settles_when_issued_or_refused_and_a_refusal_wins() {
        use k8s_openapi::api::certificates::v1::{CertificateSigningRequestCondition, CertificateSigningRequestStatus};
        let mut csr = csr_object("vk-1", "PEM");
        assert_eq!(csr.spec.request.0, b"PEM");
        assert_eq!(csr.metadata.labels.as_ref().unwrap()[NODE_LABEL], "vk-1");
        assert_eq!(outcome(&csr), None);
        csr.status = Some(CertificateSigningRequestStatus::default());
        assert_eq!(outcome(&csr), None);
        csr.status.as_mut().unwrap().certificate = Some(ByteString(Vec::new()));
        assert_eq!(outcome(&csr), None, "an empty certificate is not an issued one");
        csr.status.as_mut().unwrap().certificate = Some(ByteString(b"CERT".to_vec()));
        assert_eq!(outcome(&csr), Some(Ok("CERT".to_owned())));
        csr.status.as_mut().unwrap().conditions = Some(vec![CertificateSigningRequestCondition {
            type_: "Failed".into(),
            status: "True".into(),
            message: Some("signer down".into()),
            ..Default::default()
        }]);
        assert_eq!(outcome(&csr), Some(Err("Failed: signer down".to_owned())));
    }

    #[test]
    fn lifetime_fraction_and_jittered_deadline() {
        assert!((elapsed_fraction(100, 200, 150) - 0.5).abs() < 1e-9);
        assert!(elapsed_fraction(100, 200, 300) >= 1.0);
        assert_eq!(elapsed_fraction(200, 200, 200), 1.0);
        let creds = NodeCredentials {
            cert_pem: String::new(),
            key_pem: String::new(),
            kubeconfig_path: PathBuf::new(),
            not_before: 1000,
            not_after: 2000,
        };
        for _ in 0..100 {
            let d = rotation_deadline(&creds);
            assert!((1700..=1900).contains(&d), "{d}");
        }
    }

    #[test]
    fn atomic_write_is_0600_and_identity_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("node");
        prepare_dir(&state).unwrap();
        assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o777, 0o700);
        let p = state.join(IDENTITY_FILE);
        write_secret(&p, b"x").unwrap();
        write_secret(&p, b"y").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"y");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(&state).unwrap().count(), 1, "a temp file was left behind");
        // A directory someone loosened is made 0700 again by the next secret written into it
        // (the reuse path rewrites the kubeconfig without minting).
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
        write_secret(&state.join(KUBECONFIG_FILE), b"kc").unwrap();
        assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(state.join(KUBECONFIG_FILE)).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::remove_file(state.join(KUBECONFIG_FILE)).unwrap();
        // Garbage is not an identity: load says "none", so bootstrap mints a new one.
        assert!(load(&state, "n").unwrap().is_none());
        assert!(load(&dir.path().join("absent"), "n").unwrap().is_none());
        let (s_cert, s_key) = split_identity("-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nB\n-----END PRIVATE KEY-----\n").unwrap();
        assert!(s_cert.starts_with("-----BEGIN CERTIFICATE-----") && !s_cert.contains("PRIVATE"));
        assert!(s_key.starts_with("-----BEGIN PRIVATE KEY-----"));
    }
}

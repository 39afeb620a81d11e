//! The kubelet TLS bootstrap for one virtual node: a `system:node:<name>` client certificate
//! obtained through a `kubernetes.io/kube-apiserver-client-kubelet` CSR, kept 0600 in the
//! node's state directory, reused across restarts and renewed at a jittered 70–90 % of its life.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use rand::Rng;

use crate::discovery::ClusterInfo;
use crate::http::{self, Auth, Trust};
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
const CSR_PATH: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
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

/// Creates the CSR as `auth` and waits for the signed certificate.
async fn request_certificate(
    cluster: &ClusterInfo,
    auth: &Auth,
    node_name: &str,
    csr_pem: &str,
) -> Result<String, JoinError> {
    let server = cluster.server.as_str();
    let trust = Trust::Ca(cluster.ca_pem.clone());
    let body = serde_json::json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"generateName": "node-csr-", "labels": {"chrysalis.cocoonstack.io/node": node_name}},
        "spec": {
            "request": STANDARD.encode(csr_pem),
            "signerName": SIGNER,
            "usages": ["digital signature", "client auth"],
        },
    });
    let http_err = |source| JoinError::Http { endpoint: server.to_owned(), source };
    let resp = http::request(server, "POST", CSR_PATH, Some(body.to_string().into_bytes()), &trust, auth)
        .await
        .map_err(http_err)?;
    if resp.status != 201 {
        return Err(JoinError::Status {
            endpoint: server.to_owned(),
            what: format!("creating the CSR for system:node:{node_name}"),
            status: resp.status,
            body: String::from_utf8_lossy(&resp.body).chars().take(300).collect(),
        });
    }
    let created: serde_json::Value = serde_json::from_slice(&resp.body)
        .map_err(|e| JoinError::CsrState { csr: String::new(), what: format!("the created CSR is not JSON: {e}") })?;
    let name = created["metadata"]["name"]
        .as_str()
        .ok_or_else(|| JoinError::CsrState { csr: String::new(), what: "the created CSR has no name".into() })?
        .to_owned();
    tracing::info!(csr = name, "created the CSR; waiting for approval and signing");
    let deadline = Instant::now() + ISSUE_TIMEOUT;
    let mut csr = created;
    loop {
        if let Some(conds) = csr["status"]["conditions"].as_array() {
            for c in conds {
                if matches!(c["type"].as_str(), Some("Denied" | "Failed")) {
                    return Err(JoinError::CsrState {
                        csr: name,
                        what: format!("{}: {}", c["type"], c["message"].as_str().unwrap_or_default()),
                    });
                }
            }
        }
        if let Some(cert) = csr["status"]["certificate"].as_str().filter(|c| !c.is_empty()) {
            let pem = STANDARD.decode(cert).map_err(|e| JoinError::CsrState {
                csr: name.clone(),
                what: format!("certificate is not base64: {e}"),
            })?;
            return Ok(String::from_utf8_lossy(&pem).into_owned());
        }
        if Instant::now() >= deadline {
            return Err(JoinError::CsrTimeout { csr: name, timeout: ISSUE_TIMEOUT });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        let resp =
            http::request(server, "GET", &format!("{CSR_PATH}/{name}"), None, &trust, auth).await.map_err(http_err)?;
        if resp.status != 200 {
            return Err(JoinError::Status {
                endpoint: server.to_owned(),
                what: format!("reading CSR {name}"),
                status: resp.status,
                body: String::from_utf8_lossy(&resp.body).chars().take(300).collect(),
            });
        }
        csr = serde_json::from_slice(&resp.body)
            .map_err(|e| JoinError::CsrState { csr: name.clone(), what: format!("not JSON: {e}") })?;
    }
}

/// Mints a fresh identity as `auth` and stores it.
async fn mint(
    cluster: &ClusterInfo,
    auth: &Auth,
    node_name: &str,
    state_dir: &Path,
) -> Result<NodeCredentials, JoinError> {
    prepare_dir(state_dir)?;
    let (key_pem, csr_pem) = node_csr(node_name)?;
    let cert_pem = request_certificate(cluster, auth, node_name, &csr_pem).await?;
    let (cn, not_before, not_after) = cert_facts(&cert_pem)?;
    if cn != format!("system:node:{node_name}") {
        return Err(JoinError::BadCert(format!("issued certificate is for {cn:?}, not system:node:{node_name}")));
    }
    let identity = state_dir.join(IDENTITY_FILE);
    write_secret(&identity, format!("{}\n{}", cert_pem.trim(), key_pem).as_bytes())?;
    let kubeconfig_path = state_dir.join(KUBECONFIG_FILE);
    let kc =
        kubeconfig::node_kubeconfig(&cluster.server, &cluster.ca_pem, &format!("system:node:{node_name}"), &identity);
    write_secret(&kubeconfig_path, kc.as_bytes())?;
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
            let kc = kubeconfig::node_kubeconfig(
                &cluster.server,
                &cluster.ca_pem,
                &format!("system:node:{node_name}"),
                &state_dir.join(IDENTITY_FILE),
            );
            write_secret(&creds.kubeconfig_path, kc.as_bytes())?;
            return Ok(creds);
        }
        tracing::info!("stored node identity is within 20 % of expiry; bootstrapping again");
    }
    mint(cluster, &Auth::Bearer(token.bearer()), node_name, state_dir).await
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
    let auth = Auth::ClientCert { cert_pem: current.cert_pem.clone(), key_pem: current.key_pem.clone() };
    mint(cluster, &auth, node_name, state_dir).await
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

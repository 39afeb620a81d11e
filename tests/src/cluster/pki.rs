//! Fresh PKI for one cluster (ECDSA P-256, like `kubeadm --encryption-algorithm=ECDSA-P256`):
//! the cluster CA (which also signs kubelet client CSRs), the apiserver serving cert, the
//! client certs of the admin, controller-manager, scheduler and the apiserver's kubelet
//! client, the service-account key pair, and the kubeconfigs that use them.

use super::ClusterError;
use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PublicKeyData, SerialNumber,
};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

/// The apiserver's in-cluster Service IP (first address of the service CIDR).
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";
/// The CN of the apiserver's kubelet client certificate (`--kubelet-client-certificate`).
pub const KUBELET_CLIENT: &str = "kube-apiserver-kubelet-client";
/// The CN of the apiserver's front-proxy client (`--requestheader-allowed-names`).
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";
/// The user metrics-server runs as (`tests/cluster/manifests/metrics-server.yaml` binds it).
pub const METRICS_SERVER_USER: &str = "chrysalis:metrics-server";
/// The name the aggregator checks metrics-server's serving certificate for: `<service>.<namespace>.svc`.
pub const METRICS_SERVER_DNS: &str = "metrics-server.kube-system.svc";

/// Paths of everything [`generate`] wrote.
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    /// `sha256:<hex>` of the CA's SubjectPublicKeyInfo (kubeadm's `--discovery-token-ca-cert-hash`).
    pub ca_hash: String,
    pub ca_pem: String,
    pub apiserver_cert: PathBuf,
    pub apiserver_key: PathBuf,
    pub kubelet_client_cert: PathBuf,
    pub kubelet_client_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
    /// The front-proxy CA (`--requestheader-client-ca-file`) and the apiserver's proxy client.
    pub front_proxy_ca: PathBuf,
    pub front_proxy_client_cert: PathBuf,
    pub front_proxy_client_key: PathBuf,
    /// metrics-server's serving certificate (names [`METRICS_SERVER_DNS`]), signed by the CA.
    pub metrics_server_cert: PathBuf,
    pub metrics_server_key: PathBuf,
}

/// A client identity: certificate and key PEM.
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The control-plane users' client certs, by kubeconfig name.
pub type Users = Vec<(&'static str, ClientCert)>;

/// Writes a fresh PKI into `dir` and returns its paths, plus the client certs of the
/// control-plane users: `admin` (`O=system:masters`), `controller-manager`, `scheduler`,
/// `metrics-server`.
pub fn generate(dir: &Path) -> Result<(Pki, Users), ClusterError> {
    std::fs::create_dir_all(dir).map_err(|source| io(format!("creating {}", dir.display()), source))?;
    let now = OffsetDateTime::now_utc();

    let ca_key = KeyPair::generate().map_err(pki_err("CA key"))?;
    let mut ca = params(Vec::new(), now, Duration::days(3650))?;
    ca.distinguished_name.push(DnType::CommonName, "kubernetes");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages =
        vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment, KeyUsagePurpose::KeyCertSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(pki_err("CA certificate"))?;
    let ca_hash = format!("sha256:{}", hex::encode(Sha256::digest(ca_key.subject_public_key_info())));
    let ca_pem = ca_cert.pem();
    let issuer = Issuer::new(ca, ca_key);

    let pki = Pki {
        dir: dir.to_path_buf(),
        ca_cert: dir.join("ca.crt"),
        ca_key: dir.join("ca.key"),
        ca_hash,
        ca_pem: ca_pem.clone(),
        apiserver_cert: dir.join("apiserver.crt"),
        apiserver_key: dir.join("apiserver.key"),
        kubelet_client_cert: dir.join("apiserver-kubelet-client.crt"),
        kubelet_client_key: dir.join("apiserver-kubelet-client.key"),
        sa_key: dir.join("sa.key"),
        sa_pub: dir.join("sa.pub"),
        front_proxy_ca: dir.join("front-proxy-ca.crt"),
        front_proxy_client_cert: dir.join("front-proxy-client.crt"),
        front_proxy_client_key: dir.join("front-proxy-client.key"),
        metrics_server_cert: dir.join("metrics-server.crt"),
        metrics_server_key: dir.join("metrics-server.key"),
    };
    write(&pki.ca_cert, &ca_pem)?;
    write_secret(&pki.ca_key, &issuer.key().serialize_pem())?;

    // The apiserver's serving cert: loopback, the in-cluster names, and the address QEMU's user
    // networking forwards to this host for an appliance VM (see `appliance_vm`).
    let sans = [
        "127.0.0.1",
        super::APPLIANCE_API_ADDR,
        "::1",
        KUBERNETES_SERVICE_IP,
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ];
    let serving = leaf(&issuer, "kube-apiserver", None, &sans, ExtendedKeyUsagePurpose::ServerAuth, now)?;
    write(&pki.apiserver_cert, &serving.cert_pem)?;
    write_secret(&pki.apiserver_key, &serving.key_pem)?;

    // No system:masters: what it may do on a kubelet port comes from RBAC
    // (bootstrap-rbac.yaml binds system:kubelet-api-admin to this user, as kubeadm does).
    let kubelet_client = leaf(&issuer, KUBELET_CLIENT, None, &[], ExtendedKeyUsagePurpose::ClientAuth, now)?;
    write(&pki.kubelet_client_cert, &kubelet_client.cert_pem)?;
    write_secret(&pki.kubelet_client_key, &kubelet_client.key_pem)?;

    let sa = KeyPair::generate().map_err(pki_err("service-account key"))?;
    write_secret(&pki.sa_key, &sa.serialize_pem())?;
    write(&pki.sa_pub, &sa.public_key_pem())?;

    // The front-proxy CA, as kubeadm makes it: without it the controller-manager and the
    // scheduler complain about the missing requestheader CA bundle forever.
    let fp_key = KeyPair::generate().map_err(pki_err("front-proxy CA key"))?;
    let mut fp = params(Vec::new(), now, Duration::days(3650))?;
    fp.distinguished_name.push(DnType::CommonName, "front-proxy-ca");
    fp.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    fp.key_usages =
        vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment, KeyUsagePurpose::KeyCertSign];
    write(&pki.front_proxy_ca, &fp.self_signed(&fp_key).map_err(pki_err("front-proxy CA"))?.pem())?;
    let fp_issuer = Issuer::new(fp, fp_key);
    let proxy_client = leaf(&fp_issuer, FRONT_PROXY_CLIENT, None, &[], ExtendedKeyUsagePurpose::ClientAuth, now)?;
    write(&pki.front_proxy_client_cert, &proxy_client.cert_pem)?;
    write_secret(&pki.front_proxy_client_key, &proxy_client.key_pem)?;

    // Cheap enough to make for every cluster; used only when `Options::metrics_server` is set.
    let ms = leaf(&issuer, "metrics-server", None, &[METRICS_SERVER_DNS], ExtendedKeyUsagePurpose::ServerAuth, now)?;
    write(&pki.metrics_server_cert, &ms.cert_pem)?;
    write_secret(&pki.metrics_server_key, &ms.key_pem)?;

    let client = |cn: &str, org: Option<&str>| leaf(&issuer, cn, org, &[], ExtendedKeyUsagePurpose::ClientAuth, now);
    let users = vec![
        ("admin", client("kubernetes-admin", Some("system:masters"))?),
        ("controller-manager", client("system:kube-controller-manager", None)?),
        ("scheduler", client("system:kube-scheduler", None)?),
        ("metrics-server", client(METRICS_SERVER_USER, None)?),
    ];
    Ok((pki, users))
}

/// A kubeconfig with everything embedded: the CA, `server`, and (when given) a client cert.
pub fn kubeconfig(ca_pem: &str, server: &str, user: Option<(&str, &ClientCert)>) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let mut out = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: chrysalis\n  cluster:\n    certificate-authority-data: {}\n    server: {server}\n",
        b64(ca_pem)
    );
    match user {
        Some((name, cert)) => out.push_str(&format!(
            "contexts:\n- name: {name}@chrysalis\n  context:\n    cluster: chrysalis\n    user: {name}\ncurrent-context: {name}@chrysalis\nusers:\n- name: {name}\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&cert.cert_pem),
            b64(&cert.key_pem)
        )),
        // The discovery kubeconfig of cluster-info: a cluster and nothing else, as kubeadm writes it.
        None => out.push_str("contexts: null\ncurrent-context: \"\"\nusers: null\n"),
    }
    out
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    cn: &str,
    org: Option<&str>,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
    now: OffsetDateTime,
) -> Result<ClientCert, ClusterError> {
    let key = KeyPair::generate().map_err(pki_err("leaf key"))?;
    let mut p = params(sans.iter().map(|s| (*s).to_owned()).collect(), now, Duration::days(365))?;
    p.distinguished_name.push(DnType::CommonName, cn);
    if let Some(org) = org {
        p.distinguished_name.push(DnType::OrganizationName, org);
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![usage];
    p.use_authority_key_identifier_extension = true;
    let cert = p.signed_by(&key, issuer).map_err(pki_err("leaf certificate"))?;
    Ok(ClientCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

fn params(sans: Vec<String>, now: OffsetDateTime, lifetime: Duration) -> Result<CertificateParams, ClusterError> {
    let mut p = CertificateParams::new(sans).map_err(pki_err("subject alternative names"))?;
    // Back-date a little: the machines that read these certs may lag by seconds.
    p.not_before = now - Duration::hours(1);
    p.not_after = now + lifetime;
    let mut serial: [u8; 16] = rand::random();
    serial[0] &= 0x7f; // a positive DER integer
    p.serial_number = Some(SerialNumber::from_slice(&serial));
    Ok(p)
}

fn pki_err(what: &'static str) -> impl Fn(rcgen::Error) -> ClusterError {
    move |source| ClusterError::Pki { what, source }
}

fn io(what: String, source: std::io::Error) -> ClusterError {
    ClusterError::Io { what, source }
}

/// Writes a public file (certificates, kubeconfigs without keys).
pub fn write(path: &Path, text: &str) -> Result<(), ClusterError> {
    std::fs::write(path, text).map_err(|source| io(format!("writing {}", path.display()), source))
}

/// Writes a file only its owner may read (keys, kubeconfigs with keys).
pub fn write_secret(path: &Path, text: &str) -> Result<(), ClusterError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| io(format!("creating {}", path.display()), source))?;
    f.write_all(text.as_bytes()).map_err(|source| io(format!("writing {}", path.display()), source))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn writes_a_ca_whose_hash_matches_openssl() {
        let dir = tempfile::tempdir().unwrap();
        let (pki, users) = generate(dir.path()).unwrap();
        assert!(pki.ca_hash.starts_with("sha256:") && pki.ca_hash.len() == 7 + 64, "{}", pki.ca_hash);
        assert_eq!(
            users.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            ["admin", "controller-manager", "scheduler", "metrics-server"]
        );
        for key in [&pki.ca_key, &pki.apiserver_key, &pki.sa_key, &pki.kubelet_client_key, &pki.metrics_server_key] {
            let mode = std::fs::metadata(key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{} is {mode:o}", key.display());
        }
        // kubeadm's hash is sha256 over the certificate's SubjectPublicKeyInfo; check ours
        // against openssl's reading of the written certificate where openssl exists.
        let Ok(out) = std::process::Command::new("sh")
            .arg("-c")
            .arg("openssl x509 -pubkey -noout -in \"$1\" | openssl pkey -pubin -outform der | sha256sum")
            .arg("sh")
            .arg(&pki.ca_cert)
            .output()
        else {
            panic!("the openssl cross-check needs sh");
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !text.trim().is_empty(),
            "the openssl cross-check needs openssl (apt openssl; cargo xtask prereqs installs it): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let hex = text.split_whitespace().next().unwrap_or_default();
        assert_eq!(pki.ca_hash, format!("sha256:{hex}"));
    }

    #[test]
    fn discovery_kubeconfig_has_no_user() {
        let k = kubeconfig("-----BEGIN CERTIFICATE-----\n", "https://127.0.0.1:1", None);
        assert!(k.contains("server: https://127.0.0.1:1\n"));
        assert!(k.contains("users: null"));
        assert!(!k.contains("client-key-data"));
    }
}

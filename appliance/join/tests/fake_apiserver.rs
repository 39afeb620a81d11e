//! Discovery and the TLS bootstrap against a fake apiserver on loopback (TLS through `httpd`,
//! its own CA, CSRs signed with rcgen): what the join sends (anonymous reads, the bootstrap
//! token, the node's certificate), what it trusts (only a pinned CA, only a signed
//! `cluster-info`) and how it fails closed. No cluster needed; `join_e2e` does the same
//! against a real control plane.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use join::{BootstrapToken, CaHash, JoinError};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};

const TOKEN: &str = "abcdef.0123456789abcdef";
const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
const CLUSTER_INFO: &str = "/api/v1/namespaces/kube-public/configmaps/cluster-info";

fn token() -> BootstrapToken {
    TOKEN.parse().unwrap()
}

/// A CA: its PEM and the issuer that signs with it.
struct Ca {
    pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { pem, issuer: rcgen::Issuer::new(params, key) }
    }

    fn hash(&self) -> CaHash {
        join::ca_hash_of_pem(&self.pem).unwrap()
    }

    fn der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(self.pem.as_bytes()).unwrap()
    }
}

/// How the fake behaves.
#[derive(Default, Clone)]
struct Options {
    /// The CA `cluster-info` names, when not the one that signed the serving certificate.
    advertised_ca: Option<String>,
    /// `cluster-info` changes after its first read.
    changes_after_first_read: bool,
    /// The approver denies every CSR instead of issuing it.
    deny: bool,
}

/// One request as the fake saw it: method, path, and who sent it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: &'static str,
    path: &'static str,
    who: Option<String>,
}

struct Fake {
    ca: Ca,
    opts: Options,
    endpoint: String,
    seen: Mutex<Vec<Seen>>,
    csrs: Mutex<Vec<Value>>,
    cluster_info_reads: Mutex<usize>,
}

impl Fake {
    /// Who sent a request: the CN of a client certificate (verified against the CA by the
    /// handshake), or the bootstrap token's user, or nobody.
    fn who(&self, headers: &HeaderMap, peer: &httpd::Peer) -> Option<String> {
        if let Some(leaf) = peer.certificates.first() {
            let (_, cert) = x509_parser::parse_x509_certificate(leaf).unwrap();
            return cert.subject().iter_common_name().next().map(|cn| cn.as_str().unwrap().to_owned());
        }
        let bearer = headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
        (bearer == TOKEN).then(|| format!("system:bootstrap:{}", token().id()))
    }

    fn saw(&self, method: &'static str, path: &'static str, who: Option<String>) {
        self.seen.lock().unwrap().push(Seen { method, path, who });
    }

    /// The CSR signed (the approver and the signer in one), or denied.
    fn settle(&self, csr: &mut Value) {
        if self.opts.deny {
            csr["status"] = json!({"conditions": [{"type": "Denied", "status": "True", "message": "not today"}]});
            return;
        }
        let request = STANDARD.decode(csr["spec"]["request"].as_str().unwrap()).unwrap();
        let mut params =
            rcgen::CertificateSigningRequestParams::from_pem(std::str::from_utf8(&request).unwrap()).unwrap();
        params.params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&self.ca.issuer).unwrap().pem();
        csr["status"] = json!({
            "conditions": [{"type": "Approved", "status": "True"}],
            "certificate": STANDARD.encode(cert),
        });
    }
}

fn unauthorized() -> Response {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Unauthorized", "code": 401, "message": "Unauthorized"});
    (StatusCode::UNAUTHORIZED, Json(status)).into_response()
}

async fn cluster_info(
    State(fake): State<Arc<Fake>>,
    Extension(peer): Extension<httpd::Peer>,
    headers: HeaderMap,
) -> Response {
    fake.saw("GET", CLUSTER_INFO, fake.who(&headers, &peer));
    let reads = {
        let mut n = fake.cluster_info_reads.lock().unwrap();
        *n += 1;
        *n
    };
    let ca = fake.opts.advertised_ca.as_deref().unwrap_or(&fake.ca.pem);
    let mut kubeconfig = format!(
        "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: {}\n  name: \"\"\ncontexts: null\ncurrent-context: \"\"\nkind: Config\npreferences: {{}}\nusers: null\n",
        STANDARD.encode(ca),
        fake.endpoint,
    );
    let jws = join::jws::sign_detached(kubeconfig.as_bytes(), &token());
    if fake.opts.changes_after_first_read && reads > 1 {
        kubeconfig.push_str("# changed\n");
    }
    Json(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cluster-info", "namespace": "kube-public"},
        "data": {"kubeconfig": kubeconfig, format!("jws-kubeconfig-{}", token().id()): jws},
    }))
    .into_response()
}

async fn create_csr(
    State(fake): State<Arc<Fake>>,
    Extension(peer): Extension<httpd::Peer>,
    headers: HeaderMap,
    Json(mut csr): Json<Value>,
) -> Response {
    let who = fake.who(&headers, &peer);
    fake.saw("POST", CSRS, who.clone());
    if who.is_none() {
        return unauthorized();
    }
    let mut csrs = fake.csrs.lock().unwrap();
    let name = format!("node-csr-{}", csrs.len());
    csr["metadata"]["name"] = json!(name);
    csr["metadata"]["resourceVersion"] = json!("1");
    csrs.push(csr.clone());
    (StatusCode::CREATED, Json(csr)).into_response()
}

/// The list and the watch of CSRs by `metadata.name`: the list shows the CSR pending, the
/// watch settles it and sends one `MODIFIED` event.
async fn list_or_watch_csrs(
    State(fake): State<Arc<Fake>>,
    Extension(peer): Extension<httpd::Peer>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let who = fake.who(&headers, &peer);
    fake.saw(if watch { "WATCH" } else { "LIST" }, CSRS, who.clone());
    if who.is_none() {
        return unauthorized();
    }
    let name = query.get("fieldSelector").and_then(|f| f.strip_prefix("metadata.name=")).unwrap_or_default();
    let mut csrs = fake.csrs.lock().unwrap();
    let Some(csr) = csrs.iter_mut().find(|c| c["metadata"]["name"] == name) else {
        return Json(json!({"kind": "CertificateSigningRequestList", "apiVersion": "certificates.k8s.io/v1", "metadata": {"resourceVersion": "1"}, "items": []})).into_response();
    };
    if !watch {
        let list = json!({"kind": "CertificateSigningRequestList", "apiVersion": "certificates.k8s.io/v1", "metadata": {"resourceVersion": "1"}, "items": [csr.clone()]});
        return Json(list).into_response();
    }
    fake.settle(csr);
    csr["metadata"]["resourceVersion"] = json!("2");
    let event = json!({"type": "MODIFIED", "object": csr.clone()}).to_string() + "\n";
    ([("content-type", "application/json")], event).into_response()
}

/// Serves a fake apiserver on loopback with a certificate for 127.0.0.1 from its own CA;
/// client certificates of that CA are verified when presented.
async fn start(opts: Options) -> Arc<Fake> {
    let ca = Ca::new("fake-kubernetes");
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .allow_unauthenticated()
        .build()
        .unwrap();
    let tls = httpd::tls::server_config(
        vec![cert.der().clone()],
        PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap(),
        &[b"http/1.1"],
        Some(clients),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("https://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let fake = Arc::new(Fake {
        ca,
        opts,
        endpoint,
        seen: Mutex::default(),
        csrs: Mutex::default(),
        cluster_info_reads: Mutex::default(),
    });
    let router = Router::new()
        .route(CLUSTER_INFO, get(cluster_info))
        .route(CSRS, get(list_or_watch_csrs).post(create_csr))
        .with_state(fake.clone());
    let serve = httpd::ServeOptions {
        name: "fake apiserver",
        limits: httpd::Limits::default(),
        protocol: httpd::Protocol::Http1,
        tls: Some(tls),
    };
    tokio::spawn(httpd::serve(listener, router, serve, Arc::default(), std::future::pending()));
    fake
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn discovery_pins_the_ca_and_bootstrap_mints_reuses_and_renews_an_identity() {
    let fake = start(Options::default()).await;
    let wrong: CaHash = format!("sha256:{}", "0".repeat(64)).parse().unwrap();

    // Discovery: two anonymous reads, the second over TLS pinned to the signed CA.
    let info = join::discover(&fake.endpoint, &token(), &[wrong, fake.ca.hash()]).await.unwrap();
    assert_eq!(info.ca_pem, fake.ca.pem);
    assert_eq!(info.server, fake.endpoint);
    let anonymous = Seen { method: "GET", path: CLUSTER_INFO, who: None };
    assert_eq!(*fake.seen.lock().unwrap(), vec![anonymous.clone(), anonymous]);

    // Bootstrap: a CSR created with the bootstrap token, awaited through a watch, stored 0600
    // in a 0700 directory with a kubeconfig kube reads.
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().join("nodes").join("vk-1");
    let creds = join::bootstrap(&info, &token(), "vk-1", &dir).await.unwrap();
    let bootstrapper = Some("system:bootstrap:abcdef".to_owned());
    let csr_calls: Vec<_> = fake.seen.lock().unwrap().iter().skip(2).cloned().collect();
    assert_eq!(csr_calls.first(), Some(&Seen { method: "POST", path: CSRS, who: bootstrapper.clone() }));
    assert!(csr_calls.iter().all(|s| s.who == bootstrapper), "{csr_calls:?}");
    assert!(csr_calls.iter().any(|s| s.method == "WATCH"), "the issuance was not awaited with a watch: {csr_calls:?}");
    let csr = fake.csrs.lock().unwrap()[0].clone();
    assert_eq!(csr["spec"]["signerName"], "kubernetes.io/kube-apiserver-client-kubelet");
    assert_eq!(csr["spec"]["usages"], json!(["digital signature", "client auth"]));
    assert_eq!(csr["metadata"]["labels"]["chrysalis.cocoonstack.io/node"], "vk-1");
    assert_eq!(csr["metadata"]["generateName"], "node-csr-");
    assert_eq!(mode(&dir), 0o700);
    for entry in std::fs::read_dir(&dir).unwrap() {
        assert_eq!(mode(&entry.unwrap().path()), 0o600);
    }
    let kubeconfig = kube::config::Kubeconfig::read_from(&creds.kubeconfig_path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.unwrap();
    assert_eq!(config.cluster_url.to_string().trim_end_matches('/'), fake.endpoint);
    assert_eq!(config.root_cert, Some(vec![fake.ca.der().to_vec()]));

    // A restart reuses the stored identity: no new CSR.
    let again = join::bootstrap(&info, &token(), "vk-1", &dir).await.unwrap();
    assert_eq!((again.cert_pem.as_str(), again.key_pem.as_str()), (creds.cert_pem.as_str(), creds.key_pem.as_str()));
    assert_eq!(fake.csrs.lock().unwrap().len(), 1);

    // Renewal authenticates with the current certificate and stores a new identity.
    let seen_before = fake.seen.lock().unwrap().len();
    let renewed = join::renew(&info, &creds, "vk-1", &dir).await.unwrap();
    assert_ne!(renewed.key_pem, creds.key_pem);
    let node = Some("system:node:vk-1".to_owned());
    let renewal: Vec<_> = fake.seen.lock().unwrap().iter().skip(seen_before).cloned().collect();
    assert_eq!(renewal.first(), Some(&Seen { method: "POST", path: CSRS, who: node.clone() }));
    assert!(renewal.iter().all(|s| s.who == node), "{renewal:?}");
    let reloaded = join::bootstrap(&info, &token(), "vk-1", &dir).await.unwrap();
    assert_eq!(reloaded.cert_pem, renewed.cert_pem, "the renewed identity was not stored");
}

#[tokio::test]
async fn discovery_fails_closed() {
    let fake = start(Options::default()).await;
    let pin = fake.ca.hash();
    let discover = |endpoint: String, token: BootstrapToken, pins: Vec<CaHash>| async move {
        join::discover(&endpoint, &token, &pins).await.err().unwrap()
    };
    let e = fake.endpoint.clone();
    assert!(matches!(discover(e.clone(), token(), vec![]).await, JoinError::NoPins { .. }));
    let wrong: CaHash = format!("sha256:{}", "1".repeat(64)).parse().unwrap();
    match discover(e.clone(), token(), vec![wrong.clone()]).await {
        err @ JoinError::CaHashMismatch { .. } => {
            let msg = err.to_string();
            assert!(msg.contains(pin.as_str()) && msg.contains(wrong.as_str()), "{msg}");
        }
        other => panic!("a wrong CA hash was not refused: {other}"),
    }
    let unknown: BootstrapToken = "zzzzzz.0123456789abcdef".parse().unwrap();
    assert!(matches!(discover(e.clone(), unknown, vec![pin.clone()]).await, JoinError::Unsigned { .. }));
    let forged: BootstrapToken = format!("abcdef.{}", "a".repeat(16)).parse().unwrap();
    assert!(matches!(discover(e.clone(), forged, vec![pin.clone()]).await, JoinError::BadSignature { .. }));
    let plain = e.replace("https://", "http://");
    assert!(matches!(discover(plain, token(), vec![pin.clone()]).await, JoinError::Endpoint { .. }));
    assert!(fake.csrs.lock().unwrap().is_empty());

    // The pinned re-read must return what was signed.
    let changing = start(Options { changes_after_first_read: true, ..Options::default() }).await;
    let err = discover(changing.endpoint.clone(), token(), vec![changing.ca.hash()]).await;
    assert!(matches!(err, JoinError::ClusterInfo { .. }), "{err}");

    // A signed cluster-info naming a CA that did not sign the server's certificate: the pin
    // matches, but the pinned read does not trust the server.
    let other = Ca::new("other");
    let lying = start(Options { advertised_ca: Some(other.pem.clone()), ..Options::default() }).await;
    let err = discover(lying.endpoint.clone(), token(), vec![other.hash()]).await;
    assert!(matches!(err, JoinError::Api { .. }), "{err}");
    assert_eq!(*lying.cluster_info_reads.lock().unwrap(), 1, "the pinned read reached the handler");
}

#[tokio::test]
async fn bootstrap_fails_closed() {
    let fake = start(Options { deny: true, ..Options::default() }).await;
    let info = join::discover(&fake.endpoint, &token(), &[fake.ca.hash()]).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    match join::bootstrap(&info, &token(), "vk-1", state.path()).await {
        Err(JoinError::CsrState { csr, what }) => {
            assert_eq!(csr, "node-csr-0");
            assert!(what.contains("Denied") && what.contains("not today"), "{what}");
        }
        other => panic!("a denied CSR was not an error: {other:?}"),
    }
    assert!(!state.path().join(join::bootstrap::IDENTITY_FILE).exists());

    // A token the server does not know: refused, nothing stored.
    let stranger: BootstrapToken = "zzzzzz.0123456789abcdef".parse().unwrap();
    let err = join::bootstrap(&info, &stranger, "vk-1", state.path()).await.err().unwrap();
    assert!(matches!(err, JoinError::Api { .. }), "{err}");
    assert!(err.to_string().contains("creating the CSR for system:node:vk-1"), "{err}");

    // A server the discovery did not pin is not trusted with the token.
    let other = start(Options::default()).await;
    let moved = join::ClusterInfo { server: other.endpoint.clone(), ..info };
    let err = join::bootstrap(&moved, &token(), "vk-1", state.path()).await.err().unwrap();
    assert!(matches!(err, JoinError::Api { .. }), "{err}");
    assert!(other.seen.lock().unwrap().is_empty(), "the token reached an unpinned server");
}

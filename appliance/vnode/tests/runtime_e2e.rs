//! The node runtime against the real test control plane (`test_infra::cluster`, own port and
//! state, NodeRestriction + Node authorizer on), as a `system:node:<name>` identity minted by
//! the join crate, with a tiny in-memory provider.
//!
//! Asserts: the Node registers with its labels and taint (no `kubernetes.io/role`) and turns
//! Ready (`KubeletReady`); the Lease is held, owned by the Node and renewed; a provider pod the
//! API does not have is deleted at start-up; a bound Pod is created in the provider and its
//! pushed status (Running, pod IP) and annotation reach the API; a failing Pod becomes
//! Pending/`ProviderFailed` with a Warning event, and Failed (terminal, no more creates) under
//! `restartPolicy: Never`; a graceful delete goes through the provider and the pod leaves the
//! API; a force-deleted pod is deleted in the provider; `/healthz` answers over HTTPS and
//! `/exec/…` is 501; what a node may write on a pod (the annotation write-back finding);
//! registering another node's Node fails naming NodeRestriction; a clean stop leaves the Node.
//!
//! Then, on a node started through `vnode::session::Session` (the provider binaries' path: the
//! client CA comes from the join), the kubelet port authenticates and authorizes like a kubelet
//! in webhook mode: anonymous, a stranger's certificate and a bad token get 401; the API
//! server's kubelet-client certificate is allowed (directly and as the API server itself sends
//! it for `kubectl logs`); a service account token with `nodes/proxy` is allowed (TokenReview +
//! SubjectAccessReview) and one without, or a cluster-CA certificate of an unbound user, gets
//! 403. The node's RBAC reaches only its own user: it lists Sandboxes, another bootstrapped
//! node gets 403; join's credentials are 0600 in a 0700 directory.
//!
//! Enabled by `--features cluster`.
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use futures::FutureExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStatus, Event, Node, Pod, PodCondition, PodIP, PodSpec,
    PodStatus, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Api;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use test_infra::cluster::{Cluster, Options};
use vnode::{NodeConfig, PodKey, PodNotifier, Provider, ProviderError, RuntimeConfig, VnodeError};

const NODE: &str = "vk-vnode-e2e";
const CLAIM: &str = "sandbox.cocoonstack.io/claim-id";
const POD_IP: &str = "10.77.0.9";

/// Streams nothing (the kubelet port's streams are tested in `vnode::streams`).
struct NoStreams;

#[async_trait::async_trait]
impl vnode::PodStreams for NoStreams {
    async fn dial_agent(&self, _: &PodKey) -> Result<vnode::streams::AgentIo, vnode::StreamError> {
        Err(vnode::StreamError::Unavailable("no streams in this test".into()))
    }
    async fn container_logs(
        &self,
        _: &PodKey,
        _: &vnode::streams::ValidLogQuery,
    ) -> Result<vnode::streams::LogBody, vnode::StreamError> {
        Err(vnode::StreamError::Unavailable("no streams in this test".into()))
    }
}

/// In-memory provider: create pushes Running with a pod IP and a claim annotation; a pod with
/// annotation `test/fail: "yes"` is refused.
#[derive(Default)]
struct TestProvider {
    pods: Mutex<HashMap<PodKey, Pod>>,
    notifier: Mutex<Option<PodNotifier>>,
    creates: Mutex<HashMap<PodKey, u32>>,
    deleted: Mutex<Vec<PodKey>>,
}

impl TestProvider {
    fn creates(&self, key: &PodKey) -> u32 {
        self.creates.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    fn was_deleted(&self, key: &PodKey) -> bool {
        self.deleted.lock().unwrap().contains(key)
    }
}

fn running_copy(pod: &Pod) -> Pod {
    let mut p = pod.clone();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    p.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(CLAIM.into(), format!("claim-{}", PodKey::of(pod).name));
    let containers = pod.spec.as_ref().map(|s| s.containers.clone()).unwrap_or_default();
    let cond = |t: &str| PodCondition { type_: t.into(), status: "True".into(), ..Default::default() };
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some(POD_IP.into()),
        pod_ips: Some(vec![PodIP { ip: POD_IP.into() }]),
        host_ip: Some("127.0.0.1".into()),
        start_time: Some(now.clone()),
        conditions: Some(vec![cond("PodScheduled"), cond("Initialized"), cond("Ready")]),
        container_statuses: Some(
            containers
                .iter()
                .map(|c| ContainerStatus {
                    name: c.name.clone(),
                    image: c.image.clone().unwrap_or_default(),
                    image_id: "test://x".into(),
                    ready: true,
                    started: Some(true),
                    state: Some(ContainerState {
                        running: Some(ContainerStateRunning { started_at: Some(now.clone()) }),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        ),
        ..Default::default()
    });
    p
}

#[async_trait::async_trait]
impl Provider for TestProvider {
    async fn create_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        let key = PodKey::of(pod);
        *self.creates.lock().unwrap().entry(key.clone()).or_default() += 1;
        if pod.metadata.annotations.as_ref().and_then(|a| a.get("test/fail")).map(String::as_str) == Some("yes") {
            return Err(ProviderError::new(std::io::Error::other("test provider: no capacity for this pod")));
        }
        let running = running_copy(pod);
        self.pods.lock().unwrap().insert(key, running.clone());
        if let Some(n) = self.notifier.lock().unwrap().as_ref() {
            n.notify(running);
        }
        Ok(())
    }
    async fn update_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        let key = PodKey::of(pod);
        let mut pods = self.pods.lock().unwrap();
        if let Some(have) = pods.get_mut(&key) {
            have.spec = pod.spec.clone();
        }
        Ok(())
    }
    async fn delete_pod(&self, pod: &Pod) -> Result<(), ProviderError> {
        let key = PodKey::of(pod);
        self.pods.lock().unwrap().remove(&key);
        self.deleted.lock().unwrap().push(key);
        Ok(())
    }
    fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        self.pods.lock().unwrap().get(key).cloned()
    }
    fn get_pods(&self) -> Vec<Pod> {
        self.pods.lock().unwrap().values().cloned().collect()
    }
    fn notify_pods(&self, notifier: PodNotifier) {
        *self.notifier.lock().unwrap() = Some(notifier);
    }
}

async fn client_from(path: &Path, via: Option<u16>) -> kube::Client {
    let kc = Kubeconfig::read_from(path).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    if let Some(port) = via {
        // Same host (the apiserver certificate's 127.0.0.1 SAN still matches), other port.
        config.cluster_url = format!("https://127.0.0.1:{port}").parse().unwrap();
    }
    kube::Client::try_from(config).unwrap()
}

/// A TCP proxy to the API server whose link the test can cut (the API server "goes away"
/// for the node) and restore.
struct Proxy {
    port: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (up2, conns2) = (up.clone(), conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else { continue };
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: connection closed at once
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut upstream) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut upstream).await;
                    }
                });
                conns2.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy { port, up, conns }
    }
    fn cut(&self) {
        self.up.store(false, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
    fn restore(&self) {
        self.up.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Polls `f` every 250 ms until it yields `Some`, or panics after `timeout`.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            eprintln!("  ok after {:.1}s: {what}", start.elapsed().as_secs_f64());
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn test_pod(name: &str, fail: bool, restart: &str) -> Pod {
    let mut annotations = BTreeMap::new();
    if fail {
        annotations.insert("test/fail".to_string(), "yes".to_string());
    }
    Pod {
        metadata: ObjectMeta { name: Some(name.into()), annotations: Some(annotations), ..Default::default() },
        spec: Some(PodSpec {
            node_name: Some(NODE.into()),
            restart_policy: Some(restart.into()),
            automount_service_account_token: Some(false),
            tolerations: Some(vec![Toleration {
                key: Some("virtual-kubelet.io/provider".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "main".into(),
                image: Some("example.invalid/rt:1".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

/// Creates `pod` as the admin, retrying while the namespace's default ServiceAccount is not
/// there yet (the ServiceAccount admission plugin needs it).
async fn create_pod(pods: &Api<Pod>, pod: &Pod) -> Pod {
    eventually(&format!("creating pod {:?}", pod.metadata.name), Duration::from_secs(60), || async {
        match pods.create(&PostParams::default(), pod).await {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("  pod create: {e}");
                None
            }
        }
    })
    .await
}

async fn events_for(events: &Api<Event>, pod: &str) -> Vec<Event> {
    let lp = ListParams::default().fields(&format!("involvedObject.name={pod}"));
    events.list(&lp).await.map(|l| l.items).unwrap_or_default()
}

fn has_event(evs: &[Event], type_: &str, reason: &str) -> bool {
    evs.iter().any(|e| e.type_.as_deref() == Some(type_) && e.reason.as_deref() == Some(reason))
}

mod https {
    //! A bare HTTPS request to the kubelet port that accepts its self-signed certificate, with
    //! an optional client certificate and bearer token.
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::net::SocketAddr;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client identity: certificate and key PEM.
    pub struct Identity {
        pub cert_pem: String,
        pub key_pem: String,
    }

    /// Who sends a request.
    #[derive(Default, Clone, Copy)]
    pub struct As<'a> {
        pub cert: Option<&'a Identity>,
        pub token: Option<&'a str>,
    }

    /// (status, body, server certificate DER) of `method path`.
    pub async fn call(addr: SocketAddr, method: &str, path: &str, who: As<'_>) -> (u16, String, Vec<u8>) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(join::tls::NoVerify::new(provider));
        let config = match who.cert {
            Some(id) => builder
                .with_client_auth_cert(
                    CertificateDer::pem_slice_iter(id.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap(),
                    PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .expect("the TLS handshake (it must succeed whatever the client certificate)");
        let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| c.to_vec()).unwrap_or_default();
        let auth = who.token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        tls.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut raw = Vec::new();
        let _ = tls.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body, cert)
    }

    /// `GET path` as `who`.
    pub async fn get(addr: SocketAddr, path: &str, who: As<'_>) -> (u16, String, Vec<u8>) {
        call(addr, "GET", path, who).await
    }
}

/// The cluster CA (DER), which the kubelet port trusts for client certificates.
fn cluster_ca(cluster: &Cluster) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_file_iter(&cluster.ca_cert).unwrap().collect::<Result<_, _>>().unwrap()
}

/// The API server's own kubelet client identity (`--kubelet-client-certificate`).
fn kubelet_client(cluster: &Cluster) -> https::Identity {
    let pki = cluster.state_dir.join("pki");
    https::Identity {
        cert_pem: std::fs::read_to_string(pki.join("apiserver-kubelet-client.crt")).unwrap(),
        key_pem: std::fs::read_to_string(pki.join("apiserver-kubelet-client.key")).unwrap(),
    }
}

/// A client certificate for `cn`, signed by the cluster CA (so authenticated, and authorized by
/// whatever RBAC says about `cn`).
fn ca_signed(cluster: &Cluster, cn: &str) -> https::Identity {
    let pki = cluster.state_dir.join("pki");
    let ca_key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(pki.join("ca.key")).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&std::fs::read_to_string(&cluster.ca_cert).unwrap(), ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, &issuer).unwrap();
    https::Identity { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}

/// A self-signed client certificate naming the API server's kubelet client (and masters).
fn stranger() -> https::Identity {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
    p.distinguished_name.push(rcgen::DnType::OrganizationName, "system:masters");
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.self_signed(&key).unwrap();
    https::Identity { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}

/// `kubectl <args>` as admin; its stdout.
fn kubectl(cluster: &Cluster, args: &[&str]) -> String {
    let out = cluster.kubectl().args(args).output().unwrap();
    assert!(out.status.success(), "kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `GET path` on the API server through `client`: the HTTP status (200 or the API error's code).
async fn api_status(client: &kube::Client, path: &str) -> u16 {
    let req = http::Request::get(path).body(Vec::new()).unwrap();
    match client.request::<serde_json::Value>(req).await {
        Ok(_) => 200,
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("GET {path}: {e}"),
    }
}

fn node_config(name: &str, port: u16) -> NodeConfig {
    NodeConfig {
        name: name.into(),
        labels: BTreeMap::from([("sandbox.cocoonstack.io/runtime".into(), "sandboxd".into())]),
        taints: vec![Taint {
            key: "virtual-kubelet.io/provider".into(),
            value: Some("sandboxd".into()),
            effect: "NoSchedule".into(),
            ..Default::default()
        }],
        capacity: BTreeMap::from([
            ("cpu".into(), Quantity("4000".into())),
            ("memory".into(), Quantity("8Ti".into())),
            ("pods".into(), Quantity("2000".into())),
        ]),
        internal_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
        kubelet_port: port,
        kubelet_version: "v1.13.0-vnode-e2e".into(),
        ..Default::default()
    }
}

async fn scenario(cluster: &Cluster, state: &Path) {
    let token: join::BootstrapToken = cluster.token.parse().unwrap();
    let pin: join::CaHash = cluster.ca_hash.parse().unwrap();
    let info = join::discover(&cluster.endpoint, &token, &[pin]).await.unwrap();
    let creds = join::bootstrap(&info, &token, NODE, &state.join("nodes").join(NODE)).await.unwrap();
    // The node talks to the API server through a proxy the test can cut.
    let proxy = Proxy::start(([127, 0, 0, 1], 28443).into()).await;
    let node_client = client_from(&creds.kubeconfig_path, Some(proxy.port)).await;
    let admin = client_from(&cluster.kubeconfig, None).await;

    // A provider that remembers a pod the API never had: deleted at start-up.
    let provider = Arc::new(TestProvider::default());
    let ghost = PodKey::new("default", "ghost");
    let mut ghost_pod = test_pod("ghost", false, "Always");
    ghost_pod.metadata.namespace = Some("default".into());
    ghost_pod.metadata.uid = Some("00000000-0000-0000-0000-000000000000".into());
    provider.pods.lock().unwrap().insert(ghost.clone(), ghost_pod);

    let port = free_port();
    let listen: SocketAddr = ([127, 0, 0, 1], port).into();
    let cfg = RuntimeConfig {
        listen_addr: listen,
        client_ca: cluster_ca(cluster),
        lease_renew: Duration::from_secs(2),
        status_interval: Duration::from_secs(5),
        resync: Duration::from_secs(10),
        ping_interval: Duration::from_secs(2),
        workers: 2,
        ..RuntimeConfig::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let runtime = tokio::spawn(vnode::run(
        node_client.clone(),
        node_config(NODE, port),
        cfg,
        provider.clone(),
        Arc::new(NoStreams),
        async move {
            let _ = stop_rx.await;
        },
    ));

    // Node: labels, taint, addresses, capacity, Ready.
    let nodes: Api<Node> = Api::all(admin.clone());
    let node = eventually("the Node is Ready (KubeletReady)", Duration::from_secs(60), || async {
        let n = nodes.get_opt(NODE).await.ok().flatten()?;
        let ready = n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?.clone();
        (ready.status == "True").then_some(())?;
        assert_eq!(ready.reason.as_deref(), Some("KubeletReady"));
        assert_eq!(ready.message.as_deref(), Some("Kubelet is ready"));
        Some(n)
    })
    .await;
    let labels = node.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("type").map(String::as_str), Some("virtual-kubelet"));
    assert_eq!(labels.get("kubernetes.io/hostname").map(String::as_str), Some(NODE));
    assert_eq!(labels.get("sandbox.cocoonstack.io/runtime").map(String::as_str), Some("sandboxd"));
    assert!(!labels.contains_key("kubernetes.io/role"));
    let taints = node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
    assert!(
        taints.iter().any(|t| t.key == "virtual-kubelet.io/provider"
            && t.value.as_deref() == Some("sandboxd")
            && t.effect == "NoSchedule"),
        "{taints:?}"
    );
    let st = node.status.clone().unwrap();
    assert_eq!(st.phase.as_deref(), Some("Running"));
    assert_eq!(st.capacity, st.allocatable);
    assert_eq!(st.capacity.as_ref().unwrap()["pods"], Quantity("2k".into()), "2000, canonicalised by the API");
    let addrs: Vec<_> = st.addresses.unwrap().into_iter().map(|a| a.type_).collect();
    assert_eq!(addrs, ["InternalIP"], "only the InternalIP: the API server dials the first address it prefers, and a Hostname it cannot resolve would win");
    assert_eq!(st.daemon_endpoints.unwrap().kubelet_endpoint.unwrap().port, i32::from(port));
    assert_eq!(st.node_info.unwrap().kubelet_version, "v1.13.0-vnode-e2e");
    assert!(
        node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(vnode::node::LAST_APPLIED_ANNOTATION)),
        "the last-applied annotation is written through nodes/status"
    );
    let node_uid = node.metadata.uid.clone().unwrap();

    let heartbeat = |n: &Node| {
        n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?.last_heartbeat_time.clone()
    };
    let first_beat = heartbeat(&node).unwrap();
    eventually("the Node status heartbeat advances", Duration::from_secs(20), || async {
        (heartbeat(&nodes.get(NODE).await.ok()?)? > first_beat).then_some(())
    })
    .await;

    // Start-up reconcile deleted the ghost.
    assert!(provider.was_deleted(&ghost), "the provider pod unknown to the API was not deleted at start-up");

    // Lease: holder, owner, duration, renewals.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-node-lease");
    let lease = eventually("the node Lease exists", Duration::from_secs(30), || async {
        leases.get_opt(NODE).await.ok().flatten()
    })
    .await;
    let spec = lease.spec.clone().unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some(NODE));
    assert_eq!(spec.lease_duration_seconds, Some(40));
    let owner = &lease.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()), ("Node", NODE, node_uid.as_str()));
    let first_renew = spec.renew_time.unwrap();
    eventually("the Lease is renewed", Duration::from_secs(20), || async {
        let l = leases.get(NODE).await.ok()?;
        (l.spec?.renew_time? > first_renew).then_some(())
    })
    .await;

    // A bound Pod: created in the provider, pushed status + annotation reach the API.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    create_pod(&pods, &test_pod("ok-pod", false, "Always")).await;
    let ok = eventually("ok-pod is Running with the pushed status and annotation", Duration::from_secs(30), || async {
        let p = pods.get("ok-pod").await.ok()?;
        let s = p.status.as_ref()?;
        (s.phase.as_deref() == Some("Running") && s.pod_ip.as_deref() == Some(POD_IP)).then_some(())?;
        (p.metadata.annotations.as_ref()?.get(CLAIM)? == "claim-ok-pod").then_some(p)
    })
    .await;
    assert!(ok.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .running
        .is_some());
    eventually("a Normal ProviderCreateSuccess event", Duration::from_secs(20), || async {
        has_event(&events_for(&events, "ok-pod").await, "Normal", "ProviderCreateSuccess").then_some(())
    })
    .await;

    // What a node identity may write on its pod (the annotation write-back finding).
    let node_pods: Api<Pod> = Api::namespaced(node_client.clone(), "default");
    let meta_patch = serde_json::json!({"metadata": {"annotations": {"test/direct": "x"}}});
    let direct = node_pods.patch("ok-pod", &PatchParams::default(), &Patch::Merge(&meta_patch)).await;
    eprintln!(
        "  node identity: merge patch of pod metadata → {:?}",
        direct.as_ref().map(|_| "accepted").map_err(|e| e.to_string())
    );
    assert!(
        matches!(&direct, Err(kube::Error::Api(s)) if s.code == 403),
        "a node identity patched a pod's metadata directly: {direct:?}"
    );
    let status_ann = node_pods.patch_status("ok-pod", &PatchParams::default(), &Patch::Merge(&meta_patch)).await;
    eprintln!(
        "  node identity: annotation via pods/status → {:?}",
        status_ann.as_ref().map(|_| "accepted").map_err(|e| e.to_string())
    );
    assert!(status_ann.is_ok(), "{status_ann:?}");
    assert_eq!(
        pods.get("ok-pod").await.unwrap().metadata.annotations.unwrap().get("test/direct").map(String::as_str),
        Some("x")
    );
    let label_patch = serde_json::json!({"metadata": {"labels": {"test": "x"}}});
    let status_label = node_pods.patch_status("ok-pod", &PatchParams::default(), &Patch::Merge(&label_patch)).await;
    eprintln!(
        "  node identity: label via pods/status → {:?}",
        status_label.as_ref().map(|_| "accepted").map_err(|e| e.to_string())
    );
    assert!(matches!(&status_label, Err(kube::Error::Api(s)) if s.code == 403), "{status_label:?}");

    // A failing Pod: Pending + ProviderFailed + Warning event, retried.
    create_pod(&pods, &test_pod("fail-pod", true, "Always")).await;
    let failing = eventually("fail-pod is Pending/ProviderFailed", Duration::from_secs(30), || async {
        let p = pods.get("fail-pod").await.ok()?;
        let s = p.status.clone()?;
        (s.phase.as_deref() == Some("Pending") && s.reason.as_deref() == Some("ProviderFailed")).then_some(s)
    })
    .await;
    assert!(failing.message.as_deref().unwrap_or_default().contains("no capacity"), "{failing:?}");
    eventually("a Warning ProviderCreateFailed event", Duration::from_secs(20), || async {
        has_event(&events_for(&events, "fail-pod").await, "Warning", "ProviderCreateFailed").then_some(())
    })
    .await;
    let fail_key = PodKey::new("default", "fail-pod");
    eventually("fail-pod is retried", Duration::from_secs(20), || async {
        (provider.creates(&fail_key) >= 3).then_some(())
    })
    .await;
    eventually("repeated failures aggregate into one event with a count", Duration::from_secs(20), || async {
        let evs: Vec<Event> = events_for(&events, "fail-pod")
            .await
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ProviderCreateFailed"))
            .collect();
        (evs.len() == 1 && evs[0].count.unwrap_or(0) >= 3).then_some(())
    })
    .await;

    // restartPolicy Never: Failed, terminal.
    create_pod(&pods, &test_pod("never-pod", true, "Never")).await;
    eventually("never-pod is Failed/ProviderFailed", Duration::from_secs(30), || async {
        let s = pods.get("never-pod").await.ok()?.status?;
        (s.phase.as_deref() == Some("Failed") && s.reason.as_deref() == Some("ProviderFailed")).then_some(())
    })
    .await;
    let never_key = PodKey::new("default", "never-pod");
    let creates = provider.creates(&never_key);
    tokio::time::sleep(Duration::from_secs(12)).await; // past one resync
    assert_eq!(provider.creates(&never_key), creates, "a Failed pod was synced to the provider again");
    assert_eq!(pods.get("never-pod").await.unwrap().status.unwrap().phase.as_deref(), Some("Failed"));

    // HTTPS endpoint: anonymous requests are refused; the API server's kubelet client is served.
    let (status, body, cert) = https::get(listen, "/healthz", https::As::default()).await;
    assert_eq!((status, body.as_str()), (401, "Unauthorized\n"));
    assert!(!cert.is_empty());
    let apiserver = kubelet_client(cluster);
    let as_apiserver = https::As { cert: Some(&apiserver), token: None };
    let (status, body, _) = https::get(listen, "/healthz", as_apiserver).await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    let (status, body, _) = https::get(listen, "/exec/default/ok-pod/main?command=true&output=1", as_apiserver).await;
    assert_eq!(status, 400, "a plain GET is no stream: {body}");
    assert!(body.contains("WebSocket upgrade"), "the refusal names what is needed: {body}");
    let (status, body, _) = https::get(listen, "/pods", as_apiserver).await;
    assert_eq!(status, 200);
    assert!(body.contains("\"PodList\"") && body.contains("ok-pod"), "{body}");

    // Graceful delete: provider delete, then the runtime removes the pod from the API.
    let ok_key = PodKey::new("default", "ok-pod");
    pods.delete("ok-pod", &DeleteParams { grace_period_seconds: Some(2), ..DeleteParams::default() }).await.unwrap();
    eventually("delete_pod was called for ok-pod", Duration::from_secs(20), || async {
        provider.was_deleted(&ok_key).then_some(())
    })
    .await;
    eventually("ok-pod is gone from the API", Duration::from_secs(30), || async {
        pods.get_opt("ok-pod").await.ok()?.is_none().then_some(())
    })
    .await;
    eventually("a Normal ProviderDeleteSuccess event", Duration::from_secs(20), || async {
        has_event(&events_for(&events, "ok-pod").await, "Normal", "ProviderDeleteSuccess").then_some(())
    })
    .await;

    // A pending (never running) pod being deleted is force-deleted without a provider call.
    pods.delete("fail-pod", &DeleteParams::default()).await.unwrap();
    eventually("fail-pod (no container running) is force-deleted", Duration::from_secs(20), || async {
        pods.get_opt("fail-pod").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(!provider.was_deleted(&fail_key), "rule 1 must not call the provider");

    // Force-deleted by an admin: the watch delete reaches the provider.
    create_pod(&pods, &test_pod("gone-pod", false, "Always")).await;
    let gone_key = PodKey::new("default", "gone-pod");
    eventually("gone-pod is Running", Duration::from_secs(30), || async {
        (pods.get("gone-pod").await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
    pods.delete("gone-pod", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await.unwrap();
    eventually("delete_pod was called for the force-deleted gone-pod", Duration::from_secs(20), || async {
        provider.was_deleted(&gone_key).then_some(())
    })
    .await;

    // The API server goes away for the node: no crash, no Lease renewals, and everything
    // resumes when it is back (a pod created meanwhile is then run).
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let renew = || async { leases.get(NODE).await.unwrap().spec.unwrap().renew_time.unwrap() };
    let during = renew().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(renew().await, during, "the Lease was renewed while the API server was unreachable");
    assert!(!runtime.is_finished(), "the runtime stopped while the API server was away");
    create_pod(&pods, &test_pod("late-pod", false, "Always")).await;
    proxy.restore();
    eventually("the Lease is renewed again", Duration::from_secs(30), || async {
        (renew().await > during).then_some(())
    })
    .await;
    eventually("late-pod (created during the outage) is Running", Duration::from_secs(60), || async {
        (pods.get("late-pod").await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;

    // Registering another node's Node is refused, naming NodeRestriction.
    let other = vnode::run(
        node_client.clone(),
        node_config("someone-else", free_port()),
        RuntimeConfig { listen_addr: ([127, 0, 0, 1], free_port()).into(), ..RuntimeConfig::default() },
        Arc::new(TestProvider::default()),
        Arc::new(NoStreams),
        std::future::pending(),
    );
    match tokio::time::timeout(Duration::from_secs(30), other).await {
        Ok(Err(e @ VnodeError::NodeForbidden { .. })) => {
            eprintln!("  another node's Node: {e}");
            assert!(e.to_string().contains("NodeRestriction"));
        }
        other => panic!("registering another node's Node was not refused as Forbidden: {other:?}"),
    }
    // The kubelet port in use is fatal too.
    let busy = vnode::run(
        node_client.clone(),
        node_config(NODE, port),
        RuntimeConfig { listen_addr: listen, ..RuntimeConfig::default() },
        Arc::new(TestProvider::default()),
        Arc::new(NoStreams),
        std::future::pending(),
    )
    .await;
    assert!(matches!(busy, Err(VnodeError::KubeletListen { .. })), "{busy:?}");

    // Clean stop: Ok, the Node stays.
    stop_tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), runtime).await.expect("run stops").expect("join");
    assert!(result.is_ok(), "{result:?}");
    assert!(nodes.get_opt(NODE).await.unwrap().is_some(), "a clean stop must leave the Node");
}

/// The kubelet port of a node started as the provider binaries start it (a [`vnode::session::Session`]
/// joined with the bootstrap token: the cluster CA comes from the join), and the node's RBAC.
async fn kubelet_port(cluster: &Cluster, state: &Path) {
    const AUTH_NODE: &str = "vk-vnode-auth";
    cluster.bind_node("vk-sandbox", AUTH_NODE).unwrap();
    let token_file = state.join("bootstrap-token");
    std::fs::write(&token_file, &cluster.token).unwrap();
    let args = vnode::session::JoinArgs {
        kubeconfig: None,
        join_server: Some(cluster.endpoint.clone()),
        join_api_server: None,
        join_token_file: Some(token_file.clone()),
        join_ca_hash: vec![cluster.ca_hash.clone()],
        credentials_dir: state.join("auth-node/pki"),
        client_ca_file: None,
    };
    let session = vnode::session::Session::open(&args, AUTH_NODE).await.unwrap();
    let port = free_port();
    let listen: SocketAddr = ([127, 0, 0, 1], port).into();
    let provider = Arc::new(TestProvider::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let runtime = RuntimeConfig { listen_addr: listen, workers: 1, ..RuntimeConfig::default() };
    let node = tokio::spawn(session.run(
        node_config(AUTH_NODE, port),
        runtime,
        provider.clone(),
        Arc::new(NoStreams),
        async move {
            let _ = stop_rx.await;
        },
        |_| {},
    ));
    let admin = client_from(&cluster.kubeconfig, None).await;
    let nodes: Api<Node> = Api::all(admin.clone());
    eventually("the session's Node is Ready", Duration::from_secs(60), || async {
        let n = nodes.get_opt(AUTH_NODE).await.ok().flatten()?;
        n.status?.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut pod = test_pod("auth-pod", false, "Always");
    pod.spec.as_mut().unwrap().node_name = Some(AUTH_NODE.into());
    create_pod(&pods, &pod).await;
    eventually("auth-pod is Running", Duration::from_secs(30), || async {
        (pods.get("auth-pod").await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;

    // Anonymous, a stranger's certificate (it names the kubelet client, in system:masters, but
    // no CA vouches for it) and a bad token: 401. The handshake itself succeeds for the stranger.
    let nobody = https::As::default();
    for path in ["/pods", "/healthz", "/stats/summary", "/exec/default/auth-pod/main"] {
        assert_eq!(https::get(listen, path, nobody).await.0, 401, "anonymous {path}");
    }
    let random = stranger();
    let (status, body, _) = https::get(listen, "/pods", https::As { cert: Some(&random), token: None }).await;
    assert_eq!((status, body.as_str()), (401, "Unauthorized\n"));
    assert_eq!(
        https::get(listen, "/pods", https::As { cert: None, token: Some("abcdef.0123456789abcdef") }).await.0,
        401
    );

    // The API server's kubelet client (bound to system:kubelet-api-admin): allowed.
    let apiserver = kubelet_client(cluster);
    let as_apiserver = https::As { cert: Some(&apiserver), token: None };
    let (status, body, _) = https::get(listen, "/pods", as_apiserver).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"PodList\"") && body.contains("auth-pod"), "{body}");
    for path in ["/stats/summary", "/metrics/resource"] {
        let (status, body, _) = https::get(listen, path, as_apiserver).await;
        assert_eq!(status, 200, "{path}: authorized, then served: {body}");
        assert!(body.contains(AUTH_NODE) || body.contains("node_cpu_usage_seconds_total"), "{path}: {body}");
    }
    let (status, body, _) = https::get(listen, "/containerLogs/default/auth-pod/main", as_apiserver).await;
    assert_eq!(status, 502, "authorized, then the provider's refusal: {body}");
    assert!(body.contains("no streams in this test"), "{body}");
    let (status, body, _) =
        https::call(listen, "POST", "/exec/default/auth-pod/main?command=true&output=1", as_apiserver).await;
    assert_eq!(status, 400, "authorized, then no upgrade: {body}");
    // ... and through the API server itself: `kubectl logs` makes it dial the node's InternalIP
    // with that identity; the request is authorized, then the provider's refusal comes back.
    // (`nodes/<name>/proxy` cannot be used here: the API server refuses to proxy to loopback.)
    let logs = cluster.kubectl().args(["logs", "auth-pod", "-c", "main", "-n", "default"]).output().unwrap();
    let said = String::from_utf8_lossy(&logs.stderr);
    assert!(!logs.status.success(), "kubectl logs succeeded?");
    assert!(said.contains("no streams in this test"), "kubectl logs through the API server: {said}");

    // A cluster-CA certificate for a user no RBAC names: authenticated, then 403.
    let unbound = ca_signed(cluster, "chrysalis-e2e-unbound");
    let (status, body, _) = https::get(listen, "/pods", https::As { cert: Some(&unbound), token: None }).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("user=chrysalis-e2e-unbound") && body.contains("subresource=proxy"), "{body}");

    // Service account tokens: TokenReview, then SubjectAccessReview.
    kubectl(cluster, &["create", "serviceaccount", "kubelet-reader", "-n", "default"]);
    kubectl(cluster, &["create", "serviceaccount", "kubelet-nobody", "-n", "default"]);
    kubectl(cluster, &["create", "clusterrole", "e2e-kubelet-reader", "--verb=get", "--resource=nodes/proxy"]);
    kubectl(
        cluster,
        &[
            "create",
            "clusterrolebinding",
            "e2e-kubelet-reader",
            "--clusterrole=e2e-kubelet-reader",
            "--serviceaccount=default:kubelet-reader",
        ],
    );
    let reader = kubectl(cluster, &["create", "token", "kubelet-reader", "-n", "default"]).trim().to_owned();
    let stranger_sa = kubectl(cluster, &["create", "token", "kubelet-nobody", "-n", "default"]).trim().to_owned();
    let as_reader = https::As { cert: None, token: Some(&reader) };
    let (status, body, _) = https::get(listen, "/pods", as_reader).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("auth-pod"), "{body}");
    let (status, body, _) = https::get(listen, "/stats/summary", as_reader).await;
    assert_eq!(status, 403, "no nodes/stats grant: {body}");
    assert!(body.contains("subresource=stats"), "{body}");
    assert_eq!(https::call(listen, "POST", "/exec/default/auth-pod/main", as_reader).await.0, 403, "no create");
    let (status, body, _) = https::get(listen, "/pods", https::As { cert: None, token: Some(&stranger_sa) }).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("user=system:serviceaccount:default:kubelet-nobody"), "{body}");
    let mut tampered = reader.clone();
    tampered.push('x');
    assert_eq!(https::get(listen, "/pods", https::As { cert: None, token: Some(&tampered) }).await.0, 401);

    // The node's RBAC reaches this node only: it reads Sandboxes; another node joined with the
    // same bootstrap token cannot.
    let sandboxes = "/apis/agents.x-k8s.io/v1beta1/sandboxes";
    let me = client_from(&state.join("auth-node/pki/kubeconfig"), None).await;
    assert_eq!(api_status(&me, sandboxes).await, 200, "the bound node cannot list Sandboxes");
    let token: join::BootstrapToken = cluster.token.parse().unwrap();
    let pin: join::CaHash = cluster.ca_hash.parse().unwrap();
    let info = join::discover(&cluster.endpoint, &token, &[pin]).await.unwrap();
    let other_dir = state.join("other-node");
    let other = join::bootstrap(&info, &token, "vk-vnode-other", &other_dir).await.unwrap();
    let other = client_from(&other.kubeconfig_path, None).await;
    assert_eq!(api_status(&other, sandboxes).await, 403, "another node identity lists Sandboxes");
    assert_eq!(api_status(&other, "/apis/agents.x-k8s.io/v1beta1/namespaces/default/sandboxes").await, 403);
    // join keeps that identity 0600 in a 0700 directory.
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&other_dir), 0o700);
    for f in std::fs::read_dir(&other_dir).unwrap() {
        let f = f.unwrap().path();
        assert_eq!(mode(&f), 0o600, "{}", f.display());
    }

    stop_tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), node).await.expect("the session stops").expect("join");
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_registers_a_node_and_runs_pods_through_a_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "vnode=info".into()))
        .with_ansi(false)
        .with_test_writer()
        .try_init();
    let state = tempfile::tempdir().unwrap();
    let opts = Options { state_dir: state.path().join("state"), port: 28443, ..Options::default() };
    let cluster = Cluster::up_with(&opts).expect("cluster up");
    let result = std::panic::AssertUnwindSafe(async {
        scenario(&cluster, state.path()).await;
        eprintln!("-- the kubelet port and the node's RBAC");
        kubelet_port(&cluster, state.path()).await;
    })
    .catch_unwind()
    .await;
    Cluster::down_with(&opts).expect("cluster down");
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

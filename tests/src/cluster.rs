//! A real Kubernetes control plane on loopback for tests and demos (`cargo xtask cluster
//! up|down|status` and [`Cluster::up`] in test suites share this one implementation).
//!
//! `up` builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and the
//! upstream agent-sandbox controller from the Go modules pinned in `tests/cluster/cluster.toml`
//! (cached, see [`build`]), generates a fresh PKI, starts everything on 127.0.0.1 with RBAC,
//! NodeRestriction, bootstrap-token authentication and the CSR signing/approving, bootstrap
//! signer and token cleaner controllers, then applies what kubeadm would for token discovery
//! and the kubelet TLS bootstrap, installs the agent-sandbox CRDs and runs its controller.
//!
//! State lives in `$CHRYSALIS_CACHE/cluster/state/`: `cluster.json` (the [`Cluster`] facts),
//! `pki/`, `*.kubeconfig`, `logs/`, `etcd/`, `manifests/`. `up` is idempotent: when every
//! recorded daemon still runs and the apiserver is ready it returns the recorded facts;
//! otherwise it stops what is left and starts afresh. `down` stops every recorded daemon
//! (each verified by its `/proc/<pid>/cmdline`). A file lock serialises concurrent callers.
//!
//! With [`Options::metrics_server`], `up` also runs metrics-server (`kubectl top`) registered as
//! the aggregated API `v1beta1.metrics.k8s.io` (see [`metrics`]).
//!
//! Ports (all on 127.0.0.1, from `--port`/`CHRYSALIS_CLUSTER_PORT`, default 16443): apiserver
//! `P`, etcd client `P+1` and peer `P+2`, controller-manager `P+3`, scheduler `P+4`,
//! agent-sandbox metrics `P+5` and health probe `P+6`; metrics-server `P+7` on its own address
//! ([`metrics::MetricsServer::for_port`]).

pub mod bootstrap;
pub mod build;
pub mod lock;
pub mod metrics;
mod objects;
pub mod pki;
pub mod procs;

use bootstrap::{Kubectl, Token};
use metrics::MetricsServer;
use procs::Daemon;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Default apiserver port; the others follow it.
pub const DEFAULT_PORT: u16 = 16443;

/// Everything that can go wrong bringing the cluster up or down.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {detail}", path.display())]
    Lock { path: PathBuf, detail: String },
    #[error("building {component}: {detail}")]
    Build { component: String, detail: String },
    #[error("generating the {what}")]
    Pki {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("127.0.0.1:{port} (for {what}) is in use; stop its owner or pick another --port")]
    PortInUse {
        port: u16,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name}: {detail}")]
    Process { name: String, detail: String },
    #[error("{name} did not become ready within {timeout:?}; log tail:\n{log_tail}")]
    NotReady { name: String, timeout: Duration, log_tail: String },
    #[error("kubectl {args}: {stderr}")]
    Kubectl { args: String, stderr: String },
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    #[error("reading {}", path.display())]
    State {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// Where an appliance VM (QEMU user networking, `guestfwd`) reaches this host's apiserver; the
/// serving certificate names it, so a box joins with `--join-api-server https://<this>:<port>`.
pub const APPLIANCE_API_ADDR: &str = "10.0.2.100";

/// Where the cluster lives and which ports it takes.
#[derive(Debug, Clone)]
pub struct Options {
    /// Cached builds: `$CHRYSALIS_CACHE/cluster/bin`.
    pub bin_dir: PathBuf,
    /// Runtime state: `$CHRYSALIS_CACHE/cluster/state` (a test may use its own).
    pub state_dir: PathBuf,
    /// The apiserver port; see the module doc for the others.
    pub port: u16,
    /// Also run metrics-server (builds it on first use). Off by default: only suites that
    /// check `kubectl top` pay for it.
    pub metrics_server: bool,
}

impl Default for Options {
    fn default() -> Self {
        let port = std::env::var("CHRYSALIS_CLUSTER_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(DEFAULT_PORT);
        let root = cache_dir().join("cluster");
        Options { bin_dir: root.join("bin"), state_dir: root.join("state"), port, metrics_server: false }
    }
}

impl Options {
    fn state_file(&self) -> PathBuf {
        self.state_dir.join("cluster.json")
    }
    /// Beside the state directory, so clearing the state keeps the lock.
    fn lock_file(&self) -> PathBuf {
        let name = self.state_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        self.state_dir.with_file_name(format!(".{name}.lock"))
    }
}

/// A running cluster: what `up` prints and `cluster.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cluster {
    /// `https://127.0.0.1:<port>`.
    pub endpoint: String,
    /// The admin kubeconfig (`O=system:masters`).
    pub kubeconfig: PathBuf,
    /// The bootstrap token `<id>.<secret>` (groups `system:bootstrappers`, `system:bootstrappers:chrysalis`).
    pub token: String,
    /// `sha256:<hex>` of the CA's SubjectPublicKeyInfo, for `--discovery-token-ca-cert-hash`.
    pub ca_hash: String,
    /// The cluster CA certificate (PEM).
    pub ca_cert: PathBuf,
    /// The pinned kubectl.
    pub kubectl: PathBuf,
    /// `$CHRYSALIS_CACHE/cluster/state`.
    pub state_dir: PathBuf,
    /// Component versions, from the lock.
    pub versions: BTreeMap<String, String>,
    /// The daemons `up` started, in start order.
    pub daemons: Vec<Daemon>,
    /// Where metrics-server listens, when [`Options::metrics_server`] started it.
    #[serde(default)]
    pub metrics_server: Option<MetricsServer>,
    /// Whether this call started the cluster (false: it was already running). Not persisted.
    #[serde(skip)]
    pub started: bool,
}

/// One daemon's health, for `status`.
#[derive(Debug, Clone)]
pub struct DaemonStatus {
    pub daemon: Daemon,
    pub running: bool,
}

/// What `status` reports.
#[derive(Debug, Clone)]
pub struct Status {
    /// The recorded cluster, if `up` ever wrote one.
    pub cluster: Option<Cluster>,
    pub daemons: Vec<DaemonStatus>,
    /// `GET /readyz` answered `ok`.
    pub apiserver_ready: bool,
}

impl Cluster {
    /// Starts the cluster with default [`Options`], or returns the running one.
    pub fn up() -> Result<Cluster, ClusterError> {
        Cluster::up_with(&Options::default())
    }

    /// Starts the cluster described by `opts`, or returns it when it already runs.
    pub fn up_with(opts: &Options) -> Result<Cluster, ClusterError> {
        let _lock = flock(&opts.lock_file())?;
        if let Some(running) = load(opts)? {
            let wanted = !opts.metrics_server || running.metrics_server.is_some();
            if wanted && running.daemons.iter().all(Daemon::is_ours) && running.kubectl_handle().ready() {
                return Ok(Cluster { started: false, ..running });
            }
            eprintln!(
                "cluster: the recorded cluster is not healthy or lacks metrics-server; restarting it from scratch"
            );
            teardown(&running)?;
        }
        start(opts)
    }

    /// Stops every daemon recorded under `opts` and forgets the cluster. Returns the daemons
    /// it stopped (empty when nothing ran).
    pub fn down_with(opts: &Options) -> Result<Vec<Daemon>, ClusterError> {
        let _lock = flock(&opts.lock_file())?;
        let Some(cluster) = load(opts)? else {
            return Ok(Vec::new());
        };
        let running: Vec<Daemon> = cluster.daemons.iter().filter(|d| d.is_ours()).cloned().collect();
        teardown(&cluster)?;
        let _ = std::fs::remove_file(opts.state_file());
        Ok(running)
    }

    /// Stops the default cluster.
    pub fn down() -> Result<Vec<Daemon>, ClusterError> {
        Cluster::down_with(&Options::default())
    }

    /// What runs under `opts`, and whether the apiserver is ready.
    pub fn status_with(opts: &Options) -> Result<Status, ClusterError> {
        let cluster = load(opts)?;
        let daemons = cluster
            .iter()
            .flat_map(|c| c.daemons.iter())
            .map(|d| DaemonStatus { running: d.is_ours(), daemon: d.clone() })
            .collect();
        let apiserver_ready = cluster.as_ref().is_some_and(|c| c.kubectl_handle().ready());
        Ok(Status { cluster, daemons, apiserver_ready })
    }

    /// A `kubectl` command (the pinned one) talking to this cluster as admin.
    pub fn kubectl(&self) -> std::process::Command {
        self.kubectl_handle().command()
    }

    fn kubectl_handle(&self) -> Kubectl {
        Kubectl { bin: self.kubectl.clone(), kubeconfig: self.kubeconfig.clone() }
    }

    /// Binds what a `provider` (`vk-sandbox`, `vk-cocoon`) node named `node` needs to
    /// `system:node:<node>` alone (`appliance/<provider>/manifests/node-rbac.yaml.in`). Every
    /// harness that joins a node calls this before the node starts.
    pub fn bind_node(&self, provider: &str, node: &str) -> Result<PathBuf, ClusterError> {
        bootstrap::bind_node(&self.kubectl_handle(), &self.state_dir.join("manifests"), provider, node)
    }

    /// Waits until the metrics API answers (`kubectl get --raw
    /// /apis/metrics.k8s.io/v1beta1/nodes`): the aggregator reaches metrics-server. Fails at
    /// once when the cluster runs without it, and with its log tail on timeout.
    pub fn wait_metrics_api(&self, timeout: Duration) -> Result<(), ClusterError> {
        let daemon = self.daemons.iter().find(|d| d.name == "metrics-server").ok_or_else(|| ClusterError::Process {
            name: "metrics-server".into(),
            detail: "this cluster runs without it: start it with Options { metrics_server: true, .. }".into(),
        })?;
        let kubectl = self.kubectl_handle();
        wait_until(daemon, timeout, || metrics::api_answers(&kubectl))
    }

    /// The token id (the part before the dot).
    pub fn token_id(&self) -> &str {
        self.token.split('.').next().unwrap_or_default()
    }
}

fn start(opts: &Options) -> Result<Cluster, ClusterError> {
    let started_at = Instant::now();
    let p = opts.port;
    let ports = [
        (p, "kube-apiserver"),
        (p + 1, "etcd clients"),
        (p + 2, "etcd peers"),
        (p + 3, "kube-controller-manager"),
        (p + 4, "kube-scheduler"),
        (p + 5, "agent-sandbox metrics"),
        (p + 6, "agent-sandbox health"),
    ];
    for (port, what) in ports {
        procs::ensure_port_free(port, what)?;
    }

    let lock = lock::Lock::load()?;
    let bins = build::ensure(&lock, &opts.bin_dir, |c| opts.metrics_server || c.name != "metrics-server")?;
    let metrics_server = opts.metrics_server.then(|| MetricsServer::for_port(p));
    let sandbox = lock.component("agent-sandbox")?;
    let crd_dir = build::module_source_dir(sandbox)?.join(sandbox.crds.as_deref().unwrap_or("k8s/crds"));

    let state = opts.state_dir.clone();
    if state.exists() {
        std::fs::remove_dir_all(&state).map_err(|source| io(format!("clearing {}", state.display()), source))?;
    }
    for d in ["logs", "etcd", "manifests", "apiserver", "flexvolume"] {
        let dir = state.join(d);
        std::fs::create_dir_all(&dir).map_err(|source| io(format!("creating {}", dir.display()), source))?;
    }
    set_mode(&state.join("etcd"), 0o700)?;

    let endpoint = format!("https://127.0.0.1:{p}");
    let (pki, users) = pki::generate(&state.join("pki"))?;
    let mut kubeconfigs = BTreeMap::new();
    for (name, cert) in &users {
        let path = state.join(format!("{name}.kubeconfig"));
        pki::write_secret(&path, &pki::kubeconfig(&pki.ca_pem, &endpoint, Some((name, cert))))?;
        kubeconfigs.insert(*name, path);
    }
    let kc = |name: &str| kubeconfigs.get(name).map(|p| p.display().to_string()).unwrap_or_default();
    let s = |p: &Path| p.display().to_string();
    let log = |name: &str| state.join("logs").join(format!("{name}.log"));
    let kubectl = Kubectl { bin: bins.get("kubectl")?.to_path_buf(), kubeconfig: PathBuf::from(kc("admin")) };

    let mut daemons = Vec::new();
    let result = (|| -> Result<Token, ClusterError> {
        // etcd, over plain HTTP on loopback; fsync off: a throwaway test store.
        let etcd_client = format!("http://127.0.0.1:{}", p + 1);
        let etcd_peer = format!("http://127.0.0.1:{}", p + 2);
        let etcd = procs::spawn(
            "etcd",
            bins.get("etcd")?,
            &[
                "--name=chrysalis".into(),
                format!("--data-dir={}", s(&state.join("etcd"))),
                format!("--listen-client-urls={etcd_client}"),
                format!("--advertise-client-urls={etcd_client}"),
                format!("--listen-peer-urls={etcd_peer}"),
                format!("--initial-advertise-peer-urls={etcd_peer}"),
                format!("--initial-cluster=chrysalis={etcd_peer}"),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
            &[],
            &log("etcd"),
        )?;
        daemons.push(etcd.clone());
        wait_until(&etcd, Duration::from_secs(60), || http_ok(p + 1, "/health"))?;

        let apiserver = procs::spawn(
            "kube-apiserver",
            bins.get("kube-apiserver")?,
            &[
                format!("--etcd-servers={etcd_client}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={p}"),
                // A loopback advertise address cannot back the `kubernetes` Service's endpoints.
                "--endpoint-reconciler-type=none".into(),
                format!("--cert-dir={}", s(&state.join("apiserver"))),
                format!("--tls-cert-file={}", s(&pki.apiserver_cert)),
                format!("--tls-private-key-file={}", s(&pki.apiserver_key)),
                format!("--client-ca-file={}", s(&pki.ca_cert)),
                format!("--kubelet-client-certificate={}", s(&pki.kubelet_client_cert)),
                format!("--kubelet-client-key={}", s(&pki.kubelet_client_key)),
                // Virtual nodes name themselves (Hostname) and give 127.0.0.1 as InternalIP; the
                // name does not resolve, so the apiserver reaches a kubelet port by address.
                "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", s(&pki.sa_pub)),
                format!("--service-account-signing-key-file={}", s(&pki.sa_key)),
                format!("--service-cluster-ip-range={}", pki::SERVICE_CIDR),
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                "--enable-bootstrap-token-auth=true".into(),
                "--allow-privileged=true".into(),
                format!("--requestheader-client-ca-file={}", s(&pki.front_proxy_ca)),
                format!("--requestheader-allowed-names={}", pki::FRONT_PROXY_CLIENT),
                "--requestheader-username-headers=X-Remote-User".into(),
                "--requestheader-group-headers=X-Remote-Group".into(),
                "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
                format!("--proxy-client-cert-file={}", s(&pki.front_proxy_client_cert)),
                format!("--proxy-client-key-file={}", s(&pki.front_proxy_client_key)),
                // Aggregated APIs (metrics-server) are dialled at their EndpointSlice's address:
                // there is no kube-proxy to route a ClusterIP.
                "--enable-aggregator-routing=true".into(),
                "--profiling=false".into(),
            ],
            &[],
            &log("kube-apiserver"),
        )?;
        daemons.push(apiserver.clone());
        wait_until(&apiserver, Duration::from_secs(180), || kubectl.ready())?;

        let component_flags = |name: &str, port: u16| -> Vec<String> {
            vec![
                format!("--kubeconfig={}", kc(name)),
                format!("--authentication-kubeconfig={}", kc(name)),
                format!("--authorization-kubeconfig={}", kc(name)),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                "--leader-elect=false".into(),
            ]
        };
        let mut kcm_args = component_flags("controller-manager", p + 3);
        kcm_args.extend([
            "--controllers=*,bootstrapsigner,tokencleaner".into(),
            format!("--cluster-signing-cert-file={}", s(&pki.ca_cert)),
            format!("--cluster-signing-key-file={}", s(&pki.ca_key)),
            format!("--client-ca-file={}", s(&pki.ca_cert)),
            format!("--root-ca-file={}", s(&pki.ca_cert)),
            format!("--service-account-private-key-file={}", s(&pki.sa_key)),
            "--use-service-account-credentials=true".into(),
            format!("--service-cluster-ip-range={}", pki::SERVICE_CIDR),
            format!("--requestheader-client-ca-file={}", s(&pki.front_proxy_ca)),
            // Else it creates /usr/libexec/kubernetes/... on the host.
            format!("--flex-volume-plugin-dir={}", s(&state.join("flexvolume"))),
        ]);
        daemons.push(procs::spawn(
            "kube-controller-manager",
            bins.get("kube-controller-manager")?,
            &kcm_args,
            &[],
            &log("kube-controller-manager"),
        )?);
        daemons.push(procs::spawn(
            "kube-scheduler",
            bins.get("kube-scheduler")?,
            &component_flags("scheduler", p + 4),
            &[],
            &log("kube-scheduler"),
        )?);

        let token = Token::generate();
        let discovery = pki::kubeconfig(&pki.ca_pem, &endpoint, None);
        let rbac = lock::cluster_src_dir().join("manifests").join("bootstrap-rbac.yaml");
        bootstrap::apply_all(&kubectl, &state.join("manifests"), &rbac, &discovery, &token, &crd_dir)?;

        let controller = procs::spawn(
            "agent-sandbox-controller",
            bins.get("agent-sandbox-controller")?,
            &[
                format!("--kubeconfig={}", kc("admin")),
                "--extensions=true".into(),
                "--leader-elect=false".into(),
                format!("--metrics-bind-address=127.0.0.1:{}", p + 5),
                format!("--health-probe-bind-address=127.0.0.1:{}", p + 6),
            ],
            &[("KUBECONFIG", kc("admin"))],
            &log("agent-sandbox-controller"),
        )?;
        daemons.push(controller.clone());
        wait_until(&controller, Duration::from_secs(120), || http_ok(p + 6, "/readyz"))?;

        // The bootstrap signer (in the controller-manager) signs cluster-info for the token.
        bootstrap::wait_signed(&kubectl, &token, Duration::from_secs(120))?;

        if let Some(ms) = &metrics_server {
            ms.add_link()?;
            ms.apply(&kubectl, &state.join("manifests"), &pki.ca_pem)?;
            let daemon = procs::spawn(
                "metrics-server",
                bins.get("metrics-server")?,
                &ms.args(Path::new(&kc("metrics-server")), &pki),
                &[],
                &log("metrics-server"),
            )?;
            daemons.push(daemon.clone());
            wait_until(&daemon, Duration::from_secs(120), || metrics::api_answers(&kubectl))?;
        }
        for d in &daemons {
            if !d.is_ours() {
                return Err(ClusterError::Process {
                    name: d.name.clone(),
                    detail: format!("exited during start-up; log tail:\n{}", d.log_tail(30)),
                });
            }
        }
        Ok(token)
    })();
    let token = match result {
        Ok(token) => token,
        Err(e) => {
            let _ = stop_all(&daemons);
            if let Some(ms) = &metrics_server {
                let _ = ms.remove_link();
            }
            return Err(e);
        }
    };

    let cluster = Cluster {
        endpoint,
        kubeconfig: kubectl.kubeconfig.clone(),
        token: token.full(),
        ca_hash: pki.ca_hash.clone(),
        ca_cert: pki.ca_cert.clone(),
        kubectl: kubectl.bin.clone(),
        state_dir: state.clone(),
        versions: lock.components.iter().map(|c| (c.upstream.clone(), c.version.clone())).collect(),
        daemons,
        metrics_server,
        started: true,
    };
    // Serialising a struct of strings and paths cannot fail.
    let json = serde_json::to_string_pretty(&cluster).unwrap_or_default();
    pki::write_secret(&opts.state_file(), &json)?;
    eprintln!("cluster: up in {:.1?}", started_at.elapsed());
    Ok(cluster)
}

/// Stops every daemon of `cluster` and deletes the link it made for metrics-server.
fn teardown(cluster: &Cluster) -> Result<(), ClusterError> {
    let stopped = stop_all(&cluster.daemons);
    let unlinked = cluster.metrics_server.as_ref().map_or(Ok(()), MetricsServer::remove_link);
    stopped.and(unlinked)
}

/// Stops `daemons` in reverse start order.
fn stop_all(daemons: &[Daemon]) -> Result<(), ClusterError> {
    let mut first_err = None;
    for d in daemons.iter().rev() {
        if let Err(e) = d.stop(Duration::from_secs(15)) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn load(opts: &Options) -> Result<Option<Cluster>, ClusterError> {
    let path = opts.state_file();
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|source| ClusterError::State { path, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io(format!("reading {}", path.display()), source)),
    }
}

/// Polls `ready` every 250 ms until it holds, failing early when `daemon` dies.
fn wait_until(daemon: &Daemon, timeout: Duration, mut ready: impl FnMut() -> bool) -> Result<(), ClusterError> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return Ok(());
        }
        if !daemon.is_ours() {
            return Err(ClusterError::Process {
                name: daemon.name.clone(),
                detail: format!("exited during start-up; log tail:\n{}", daemon.log_tail(30)),
            });
        }
        if Instant::now() >= deadline {
            return Err(ClusterError::NotReady { name: daemon.name.clone(), timeout, log_tail: daemon.log_tail(30) });
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A plain-HTTP `GET path` on 127.0.0.1:`port` answers 200.
fn http_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

/// `$CHRYSALIS_CACHE`, else `$XDG_CACHE_HOME/chrysalis`, else `~/.cache/chrysalis`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CHRYSALIS_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("chrysalis");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("chrysalis")
}

fn io(what: String, source: std::io::Error) -> ClusterError {
    ClusterError::Io { what, source }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ClusterError> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|source| io(format!("chmod {}", path.display()), source))
}

/// An exclusive `flock` on `path`, held while the returned file is open.
fn flock(path: &Path) -> Result<std::fs::File, ClusterError> {
    use std::os::fd::AsRawFd as _;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| io(format!("creating {}", dir.display()), source))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|source| io(format!("opening {}", path.display()), source))?;
    // SAFETY: flock(2) on a descriptor we own; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io(format!("locking {}", path.display()), std::io::Error::last_os_error()));
    }
    Ok(file)
}

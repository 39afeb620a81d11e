//! A virtual-node binary's cluster session, shared by `vk-sandbox` and `vk-cocoon`: the join
//! flags ([`JoinArgs`]), how an API client is obtained, and the run loop that keeps
//! [`crate::run`] going across certificate renewals until the process is told to stop.
//!
//! # Expected flow
//! 1. [`Session::open`]: with `--join-server`, kubeadm-style token discovery (the cluster CA is
//!    trusted only when its public-key hash matches a `--join-ca-hash` pin) and the kubelet TLS
//!    bootstrap for `system:node:<name>` (credentials kept in `--credentials-dir`); without it,
//!    nothing happens yet.
//! 2. [`Session::client`]: the joined identity's kubeconfig; else `--kubeconfig`; else the
//!    in-cluster service account; else `$KUBECONFIG`.
//! 3. [`Session::run`]: runs the node until `stop` resolves. With a joined identity, the
//!    certificate is renewed at its rotation deadline (failures are logged and retried every
//!    minute while the node keeps running) and the runtime is restarted with a fresh client;
//!    `on_client` sees every client before the runtime that uses it starts.
//!
//! # Guarantees
//! * A stop leaves the Node, its Lease, the Pods and every VM as they are (the runtime's clean
//!   stop); nothing here touches the provider's backing.
//! * Fails closed: no pin, no token or an unreadable token refuses to join.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::CertificateDer;
use tokio::sync::Notify;

use crate::{NodeConfig, PodStreams, Provider, RuntimeConfig, VnodeError};

/// The join flags. The binary sets the `credentials_dir` default with
/// `#[command(mut_arg("credentials_dir", |a| a.default_value("/var/lib/<binary>/pki")))]`;
/// without one, parsing fails when the flag is not given.
#[derive(Debug, Clone, clap::Args)]
pub struct JoinArgs {
    /// Kubeconfig file; else the in-cluster service account; else $KUBECONFIG.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Join this cluster (https://host:port) with a bootstrap token instead of using a kubeconfig.
    #[arg(long, value_name = "https://host:port")]
    pub join_server: Option<String>,
    /// The API server this node talks to after discovery, instead of the address cluster-info
    /// names (for a box behind NAT or a port forward; the server's certificate must name it).
    #[arg(long, value_name = "https://host:port", requires = "join_server")]
    pub join_api_server: Option<String>,
    /// File holding the bootstrap token (<id>.<secret>), with --join-server.
    #[arg(long, env = "VK_JOIN_TOKEN_FILE")]
    pub join_token_file: Option<PathBuf>,
    /// Accepted cluster CA public-key hash (sha256:<hex>); repeatable; at least one with --join-server.
    #[arg(long, value_name = "sha256:<hex>")]
    pub join_ca_hash: Vec<String>,
    /// Where the node's client identity and kubeconfig are kept, with --join-server.
    #[arg(long, required = false)]
    pub credentials_dir: PathBuf,
    /// CA bundle (PEM) that client certificates on the kubelet port must chain to; default: the
    /// cluster CA (from the join, or the kubeconfig's certificate authority).
    #[arg(long, env = "VK_CLIENT_CA_FILE", value_name = "PEM")]
    pub client_ca_file: Option<PathBuf>,
}

/// Why the session could not join, build a client, or keep the node running.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("--join-server needs --join-token-file (or VK_JOIN_TOKEN_FILE) with the bootstrap token")]
    NoTokenFile,
    #[error("reading the bootstrap token file {}", .path.display())]
    ReadToken {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the bootstrap token file {} is empty", .path.display())]
    EmptyToken { path: PathBuf },
    #[error("the bootstrap token")]
    BadToken(#[source] join::TokenError),
    #[error("--join-server needs at least one --join-ca-hash sha256:<hex>: an unpinned cluster CA is never trusted")]
    NoCaHash,
    #[error("--join-ca-hash {value:?}")]
    BadCaHash {
        value: String,
        #[source]
        source: join::TokenError,
    },
    #[error("discovering the cluster at {server}")]
    Discover {
        server: String,
        #[source]
        source: Box<join::JoinError>,
    },
    #[error("bootstrapping the identity system:node:{node}")]
    Bootstrap {
        node: String,
        #[source]
        source: Box<join::JoinError>,
    },
    #[error("reading kubeconfig {}", .path.display())]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("loading kubeconfig {}", .path.display())]
    LoadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("loading $KUBECONFIG")]
    EnvKubeconfig(#[source] kube::config::KubeconfigError),
    #[error("no --join-server, no --kubeconfig, not running in a cluster and no $KUBECONFIG")]
    NoCluster(#[source] kube::config::InClusterError),
    #[error("building the API client")]
    Client(#[source] kube::Error),
    #[error("reading the client CA {}: {problem}; point --client-ca-file (VK_CLIENT_CA_FILE) at a PEM bundle of CA certificates", .path.display())]
    ClientCa { path: PathBuf, problem: String },
    #[error("the node runtime failed")]
    Runtime(#[source] VnodeError),
    #[error("the node runtime stopped without being asked to")]
    StoppedUnasked,
}

/// A joined cluster: what renewal needs.
struct Joined {
    cluster: join::ClusterInfo,
    dir: PathBuf,
    creds: join::NodeCredentials,
}

/// Where this process's API clients come from.
pub struct Session {
    args: JoinArgs,
    node_name: String,
    joined: Option<Joined>,
}

fn read_token(path: &Path) -> Result<join::BootstrapToken, SessionError> {
    let s =
        std::fs::read_to_string(path).map_err(|source| SessionError::ReadToken { path: path.to_owned(), source })?;
    let s = s.trim();
    if s.is_empty() {
        return Err(SessionError::EmptyToken { path: path.to_owned() });
    }
    s.parse().map_err(SessionError::BadToken)
}

/// The pins of `--join-ca-hash` (at least one).
fn pins(hashes: &[String]) -> Result<Vec<join::CaHash>, SessionError> {
    if hashes.is_empty() {
        return Err(SessionError::NoCaHash);
    }
    hashes
        .iter()
        .map(|h| h.parse::<join::CaHash>().map_err(|source| SessionError::BadCaHash { value: h.clone(), source }))
        .collect()
}

async fn kubeconfig_config(path: &Path) -> Result<kube::Config, SessionError> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .map_err(|source| SessionError::ReadKubeconfig { path: path.to_owned(), source })?;
    kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|source| SessionError::LoadKubeconfig { path: path.to_owned(), source })
}

/// The certificates of a PEM bundle (at least one).
fn read_ca_bundle(path: &Path) -> Result<Vec<CertificateDer<'static>>, SessionError> {
    let err = |problem: String| SessionError::ClientCa { path: path.to_owned(), problem };
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("no CERTIFICATE block in it".into()));
    }
    Ok(certs)
}

/// The CA client certificates on the kubelet port must chain to: `--client-ca-file`, else the
/// CA the API client trusts (the cluster CA of the join or of the kubeconfig; in a Pod, the
/// service account's `ca.crt`). Empty when there is none (then no certificate is accepted).
fn client_ca(file: Option<&Path>, config: &kube::Config) -> Result<Vec<CertificateDer<'static>>, SessionError> {
    if let Some(path) = file {
        return read_ca_bundle(path);
    }
    if let Some(roots) = config.root_cert.as_ref().filter(|r| !r.is_empty()) {
        return Ok(roots.iter().map(|der| CertificateDer::from(der.clone())).collect());
    }
    match &config.root_cert_file {
        Some(path) => read_ca_bundle(path),
        None => Ok(Vec::new()),
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Session {
    /// Joins the cluster when `--join-server` is given (token discovery + TLS bootstrap of
    /// `system:node:<node_name>`); otherwise only remembers the flags.
    pub async fn open(args: &JoinArgs, node_name: &str) -> Result<Session, SessionError> {
        let mut s = Session { args: args.clone(), node_name: node_name.to_owned(), joined: None };
        let Some(server) = args.join_server.as_deref() else { return Ok(s) };
        let token_file = args.join_token_file.as_deref().ok_or(SessionError::NoTokenFile)?;
        let token = read_token(token_file)?;
        let pins = pins(&args.join_ca_hash)?;
        let mut cluster = join::discover(server, &token, &pins)
            .await
            .map_err(|e| SessionError::Discover { server: server.to_owned(), source: Box::new(e) })?;
        if let Some(api) = args.join_api_server.as_deref() {
            tracing::info!(discovered = %cluster.server, using = api, "using --join-api-server instead of cluster-info's address");
            cluster.server = api.to_owned();
        }
        let creds = join::bootstrap(&cluster, &token, node_name, &args.credentials_dir)
            .await
            .map_err(|e| SessionError::Bootstrap { node: node_name.to_owned(), source: Box::new(e) })?;
        s.joined = Some(Joined { cluster, dir: args.credentials_dir.clone(), creds });
        Ok(s)
    }

    /// Whether this session joined with a bootstrap token (and renews its certificate).
    pub fn is_joined(&self) -> bool {
        self.joined.is_some()
    }

    /// The API configuration of the current identity: the joined kubeconfig; else
    /// `--kubeconfig`; else in-cluster (when running in a Pod); else `$KUBECONFIG`.
    pub async fn config(&self) -> Result<kube::Config, SessionError> {
        if let Some(j) = &self.joined {
            return kubeconfig_config(&j.creds.kubeconfig_path).await;
        }
        if let Some(p) = &self.args.kubeconfig {
            return kubeconfig_config(p).await;
        }
        match kube::Config::incluster() {
            Ok(cfg) => Ok(cfg),
            Err(in_cluster) if std::env::var_os("KUBECONFIG").is_some_and(|v| !v.is_empty()) => {
                tracing::debug!(error = %in_cluster, "not in a cluster; using $KUBECONFIG");
                kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(SessionError::EnvKubeconfig)
            }
            Err(in_cluster) => Err(SessionError::NoCluster(in_cluster)),
        }
    }

    /// A client for the current identity ([`Session::config`]).
    pub async fn client(&self) -> Result<kube::Client, SessionError> {
        kube::Client::try_from(self.config().await?).map_err(SessionError::Client)
    }

    /// Resolves with renewed credentials once the joined certificate reaches its rotation
    /// deadline and renewal succeeds; never resolves without a joined identity.
    async fn renewed(&self) -> join::NodeCredentials {
        let Some(j) = &self.joined else { return std::future::pending().await };
        let deadline = join::rotation_deadline(&j.creds);
        tracing::info!(
            rotation_deadline = deadline,
            not_after = j.creds.not_after,
            "node certificate renewal scheduled"
        );
        loop {
            tokio::time::sleep(Duration::from_secs(deadline.saturating_sub(now_secs()))).await;
            match join::renew_if_due(&j.cluster, &j.creds, deadline, &self.node_name, &j.dir).await {
                Ok(Some(new)) => return new,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %foundation::error_chain(&e), "renewing the node certificate failed; retrying in 1 min");
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }
        }
    }

    /// Runs the node until `stop` resolves (then stops it cleanly and returns `Ok`). A renewed
    /// certificate restarts the runtime with a fresh client; `on_client` is called with each
    /// client before the runtime that uses it starts (e.g. to hand it to an owner lookup or an
    /// event recorder). The runtime stopping by itself is an error.
    ///
    /// Unless `runtime.client_ca` is already set, the kubelet endpoint trusts client
    /// certificates of `--client-ca-file`, else of the cluster CA the API client trusts.
    pub async fn run(
        mut self,
        node: NodeConfig,
        mut runtime: RuntimeConfig,
        provider: Arc<dyn Provider>,
        streams: Arc<dyn PodStreams>,
        stop: impl Future<Output = ()>,
        mut on_client: impl FnMut(&kube::Client),
    ) -> Result<(), SessionError> {
        let mut stop = std::pin::pin!(stop);
        loop {
            let config = self.config().await?;
            if runtime.client_ca.is_empty() {
                runtime.client_ca = client_ca(self.args.client_ca_file.as_deref(), &config)?;
            }
            let client = kube::Client::try_from(config).map_err(SessionError::Client)?;
            on_client(&client);
            let stop_run = Arc::new(Notify::new());
            let shutdown = {
                let s = stop_run.clone();
                async move { s.notified().await }
            };
            let mut running = std::pin::pin!(crate::run(
                client,
                node.clone(),
                runtime.clone(),
                provider.clone(),
                streams.clone(),
                shutdown,
            ));
            let new = tokio::select! {
                r = &mut running => {
                    r.map_err(SessionError::Runtime)?;
                    return Err(SessionError::StoppedUnasked);
                }
                _ = &mut stop => {
                    tracing::info!("stopping: the provider's VMs stay as they are");
                    stop_run.notify_one();
                    return running.await.map_err(SessionError::Runtime);
                }
                new = self.renewed() => new,
            };
            tracing::info!(
                not_after = new.not_after,
                "node certificate renewed; restarting the runtime with the new identity"
            );
            stop_run.notify_one();
            running.await.map_err(SessionError::Runtime)?;
            if let Some(j) = self.joined.as_mut() {
                j.creds = new;
            }
        }
    }
}

/// Resolves on SIGTERM or SIGINT (only SIGINT when SIGTERM cannot be watched).
pub async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the node");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    #[command(name = "t", mut_arg("credentials_dir", |a| a.default_value("/var/lib/t/pki")))]
    struct Cli {
        #[command(flatten)]
        join: JoinArgs,
    }

    #[derive(Debug, Parser)]
    #[command(name = "u")]
    struct NoDefault {
        #[command(flatten)]
        join: JoinArgs,
    }

    #[test]
    fn flags_parse_and_the_binary_sets_the_credentials_default() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from(["t"]).unwrap();
        assert_eq!(c.join.credentials_dir, PathBuf::from("/var/lib/t/pki"));
        assert!(c.join.join_server.is_none() && c.join.kubeconfig.is_none() && c.join.join_ca_hash.is_empty());
        let c = Cli::try_parse_from(["t", "--join-ca-hash", "sha256:aa", "--join-ca-hash", "sha256:bb"]).unwrap();
        assert_eq!(c.join.join_ca_hash.len(), 2);
        assert!(NoDefault::try_parse_from(["u"]).is_err(), "without a default the directory is required");
        let env = Cli::command()
            .get_arguments()
            .find(|a| a.get_id() == "join_token_file")
            .and_then(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned());
        assert_eq!(env.as_deref(), Some("VK_JOIN_TOKEN_FILE"));
    }

    #[tokio::test]
    async fn joining_fails_closed() {
        let dir = tempfile::tempdir().unwrap();
        let base = JoinArgs {
            kubeconfig: None,
            join_server: Some("https://127.0.0.1:1".into()),
            join_api_server: None,
            join_token_file: None,
            join_ca_hash: vec![],
            credentials_dir: dir.path().join("pki"),
            client_ca_file: None,
        };
        let e = Session::open(&base, "n").await.err().unwrap();
        assert!(matches!(e, SessionError::NoTokenFile), "{e}");
        let token = dir.path().join("token");
        std::fs::write(&token, "  \n").unwrap();
        let args = JoinArgs { join_token_file: Some(token.clone()), ..base.clone() };
        assert!(matches!(Session::open(&args, "n").await.err().unwrap(), SessionError::EmptyToken { .. }));
        std::fs::write(&token, "abcdef.0123456789abcdef\n").unwrap();
        let e = Session::open(&args, "n").await.err().unwrap();
        assert!(matches!(e, SessionError::NoCaHash), "{e}");
        let args = JoinArgs { join_ca_hash: vec!["md5:xx".into()], ..args };
        let e = Session::open(&args, "n").await.err().unwrap();
        assert!(matches!(e, SessionError::BadCaHash { .. }) && e.to_string().contains("md5:xx"), "{e}");
        std::fs::write(&token, "not-a-token").unwrap();
        assert!(matches!(Session::open(&args, "n").await.err().unwrap(), SessionError::BadToken(_)));
    }

    #[tokio::test]
    async fn without_join_server_nothing_happens_until_a_client_is_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let args = JoinArgs {
            kubeconfig: Some(dir.path().join("missing.yaml")),
            join_server: None,
            join_api_server: None,
            join_token_file: None,
            join_ca_hash: vec![],
            credentials_dir: dir.path().join("pki"),
            client_ca_file: None,
        };
        let s = Session::open(&args, "n").await.unwrap();
        assert!(!s.is_joined());
        let e = s.client().await.err().unwrap();
        assert!(matches!(e, SessionError::ReadKubeconfig { .. }), "{e}");
        assert!(e.to_string().contains("missing.yaml"));
    }

    #[tokio::test]
    async fn the_client_ca_is_the_flag_else_the_clusters() {
        let dir = tempfile::tempdir().unwrap();
        let ca = crate::auth::x509::testing::Ca::new("kubernetes");
        let ca_pem = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, ca.der.as_ref())
        );
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            join::kubeconfig::node_kubeconfig("https://127.0.0.1:1", &ca_pem, "u", Path::new("/none")).unwrap(),
        )
        .unwrap();
        let config = kubeconfig_config(&kubeconfig).await.unwrap();
        assert_eq!(client_ca(None, &config).unwrap(), vec![ca.der.clone()], "the kubeconfig's CA");

        let other = crate::auth::x509::testing::Ca::new("front-proxy");
        let bundle = dir.path().join("bundle.pem");
        let pem = |der: &CertificateDer<'_>| {
            format!(
                "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
                base64::Engine::encode(&base64::engine::general_purpose::STANDARD, der.as_ref())
            )
        };
        std::fs::write(&bundle, pem(&other.der) + &pem(&ca.der)).unwrap();
        assert_eq!(
            client_ca(Some(&bundle), &config).unwrap(),
            vec![other.der.clone(), ca.der.clone()],
            "the flag wins"
        );

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no pem here").unwrap();
        let e = client_ca(Some(&empty), &config).unwrap_err();
        assert!(matches!(e, SessionError::ClientCa { .. }) && e.to_string().contains("empty.pem"), "{e}");
        let e = client_ca(Some(&dir.path().join("missing.pem")), &config).unwrap_err();
        assert!(e.to_string().contains("missing.pem") && e.to_string().contains("--client-ca-file"), "{e}");

        let mut no_ca = config.clone();
        no_ca.root_cert = None;
        no_ca.root_cert_file = None;
        assert!(client_ca(None, &no_ca).unwrap().is_empty(), "no CA anywhere: none");
    }
}

//! `vk-cocoon`: the virtual node whose Pods each boot or clone one microVM
//! (`docs/virtual-node.md` §3). A thin binary: environment → [`CocoonConfig`] → the
//! [`CocoonProvider`] under the `vnode` runtime.
//!
//! Start-up: parse the environment (errors name the variable; inapplicable upstream variables
//! are logged as ignored); create `COCOON_ROOT_DIR` and measure the host; open the VM backend;
//! join the cluster (`--join-server`) or use a kubeconfig; list the node's Pods and run the
//! start-up reconcile — retried until it succeeds, since the node must not register before it
//! knows its VMs; start the VM watcher and the snapshot GC (`VK_SNAPSHOT_GC_INTERVAL`); run
//! the node until SIGTERM/SIGINT (restarted with a fresh client after each certificate
//! renewal). A stop — or a crash — leaves every VM running;
//! the next start adopts them. Errors print as one chain and exit 1.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use vk_cocoon::config::{self, CocoonConfig};
use vk_cocoon::events::KubeEvents;
use vk_cocoon::gc::KubePods;
use vk_cocoon::node::{self, HostResources};
use vk_cocoon::vmm_backend::{BackendConfig, VmmBackend};
use vk_cocoon::{CocoonProvider, ProviderConfig, VmBackend};
use vnode::session::{terminated, JoinArgs, Session};

/// How often the CocoonHibernation objects are read ([`vk_cocoon::hibernation`]).
const HIBERNATION_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, Parser)]
#[command(
    name = "vk-cocoon",
    version,
    about = "A virtual Kubernetes node whose Pods each boot or clone one microVM.",
    long_about = "A virtual Kubernetes node whose Pods each boot or clone one microVM.\n\n\
        A Pod scheduled here (nodeSelector cocoonstack.io/pool=<pool>, toleration \
        virtual-kubelet.io/provider Exists NoSchedule, annotation vm.cocoonstack.io/name; \
        cocoonset.cocoonstack.io/managed \"true\" with mode run + image, or mode clone + a \
        snapshot repo[:tag]) gets a VM of its own. Deleting it saves <vm-name>:latest per \
        cocoonset.cocoonstack.io/snapshot-policy, then removes the VM.\n\n\
        VM and snapshot names are scoped by namespace: a Pod adopts, clones and deletes only the \
        VMs and snapshots of its own namespace, unless VK_SHARED_NAMESPACES (below) puts both \
        namespaces in one sharing group; anything else is refused with Warning NamespaceRefused.\n\n\
        A VM reaches nothing but itself by default: no other VM, no host service, no route out. \
        vm.cocoonstack.io/shared-network=<group> lets the VMs of one namespace with the same group \
        talk; cocoonset.cocoonstack.io/network=egress gives a route out through VK_NET_UPLINK \
        (NAT; private, link-local and metadata addresses refused); VK_NET_HOST_ALLOW opens host \
        services at the gateway.\n\n\
        Configured by environment variables (below); the only flags are the cluster join flags. \
        The kubeconfig order is --kubeconfig, the in-cluster service account, then $KUBECONFIG.",
    after_long_help = config::env_help(),
    mut_arg("credentials_dir", |a| a.default_value("/var/lib/vk-cocoon/pki"))
)]
struct Cli {
    #[command(flatten)]
    join: JoinArgs,
}

/// The VM backend: microVMs through `vmm` (QEMU or cloud-hypervisor, `VK_HYPERVISOR`), the
/// image library and the VM network ([`VmmBackend`]), configured by `COCOON_ROOT_DIR`,
/// `CHRYSALIS_IMAGES`, `VK_BRIDGE`, `VK_VM_CIDR`, `VK_NETNS`, `VK_BOOT_TIMEOUT` and the filter's `VK_NET_HOST_ALLOW`,
/// `VK_NET_UPLINK`, `VK_NET_REFUSE` (see [`vk_cocoon::vmm_backend`]).
async fn open_backend(cfg: &CocoonConfig) -> anyhow::Result<Arc<dyn VmBackend>> {
    let bcfg = BackendConfig::from_env(&cfg.root_dir)?;
    let backend = VmmBackend::open(&bcfg)
        .await
        .map_err(|e| anyhow::anyhow!("{}", vnode::error_chain(&e)))
        .context("opening the VM backend")?;
    Ok(Arc::new(backend))
}

/// Every Pod bound to the node (a failure is an error: reconcile needs the complete list).
async fn node_pods(client: &kube::Client, node: &str) -> anyhow::Result<Vec<Pod>> {
    let api: kube::Api<Pod> = kube::Api::all(client.clone());
    let list = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .with_context(|| format!("listing the pods bound to {node}"))?;
    Ok(list.items)
}

async fn run(cli: Cli, cfg: CocoonConfig) -> anyhow::Result<()> {
    for (var, _) in &cfg.ignored {
        // Names only: a value may be a credential's location.
        let why = config::IGNORED.iter().find(|(v, _)| v == var).map(|(_, w)| *w).unwrap_or("");
        tracing::info!(var, why, "environment variable ignored on this node");
    }
    std::fs::create_dir_all(&cfg.root_dir)
        .with_context(|| format!("COCOON_ROOT_DIR={}: creating the directory", cfg.root_dir.display()))?;
    let host = HostResources::measure(&cfg.root_dir).context("measuring the host")?;
    let (node_cfg, mut runtime) = node::setup(&cfg, &host).context("the node's capacity")?;
    tracing::info!(node = %cfg.node_name, ip = %cfg.node_ip, capacity = ?node_cfg.capacity, "node configured");
    let backend = open_backend(&cfg).await?;
    let mut pcfg = ProviderConfig::new(cfg.node_ip.to_string());
    pcfg.cpu_class = cfg.snapshot_cpu_class.clone();
    pcfg.orphan_policy = cfg.orphan_policy;
    pcfg.namespaces = cfg.namespaces.clone();
    pcfg.restart_cooldown = cfg.restart_cooldown;
    tracing::info!(shared = ?cfg.namespaces.groups(), unrecorded_owner = cfg.namespaces.legacy(), "namespace scoping: a pod uses only VMs and snapshots of its own namespace or of one VK_SHARED_NAMESPACES groups with it");
    let provider = Arc::new(CocoonProvider::new(backend, pcfg));
    runtime.stats.pod_metrics = Some(provider.clone());
    // vk-cocoon's samples (`vk_cocoon::metrics`) beside the runtime's, on both listeners.
    runtime.stats.runtime = Arc::new(vnode::stats::RuntimeMetrics::with_provider(|r| provider.register_metrics(r)));
    if let Some(addr) = cfg.metrics_addr {
        let listener = vnode::stats::bind_metrics(addr)
            .await
            .with_context(|| format!("VK_METRICS_ADDR={addr}: binding the metrics listener"))?;
        tracing::info!(%addr, "serving /metrics in plain HTTP (VK_METRICS_ADDR)");
        tokio::spawn(vnode::stats::serve_metrics(listener, runtime.stats.runtime.clone(), std::future::pending()));
    }

    let session = Session::open(&cli.join, &cfg.node_name).await?;
    let mut stop = std::pin::pin!(terminated());
    // The node registers only after the reconcile succeeded.
    let mut delay = Duration::from_secs(1);
    loop {
        let attempt = async {
            let client = session.client().await?;
            let pods = node_pods(&client, &cfg.node_name).await?;
            let report = provider.reconcile_startup(&pods).await?;
            anyhow::Ok(report)
        };
        tokio::select! {
            r = attempt => match r {
                Ok(report) => {
                    tracing::info!(adoptable = report.adoptable.len(), orphans_destroyed = report.orphans_destroyed.len(), orphans_left = report.orphans_left.len(), "start-up reconcile succeeded");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), retry_in = ?delay, "start-up reconcile failed; the node does not register until it succeeds");
                }
            },
            _ = &mut stop => return Ok(()),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = &mut stop => return Ok(()),
        }
        delay = (delay * 2).min(Duration::from_secs(30));
    }
    let _watcher = provider.spawn_watcher();
    // The snapshot GC lists the node's Pods with the current client (none yet: passes skip).
    let gc_pods = Arc::new(KubePods::new(cfg.node_name.clone()));
    let _gc = provider.spawn_snapshot_gc(gc_pods.clone(), cfg.gc);
    let node_name = cfg.node_name.clone();
    let events_for = provider.clone();
    // The CocoonHibernation loop of the current client (replaced with the client).
    let mut hibernations: Option<tokio::task::JoinHandle<()>> = None;
    session
        .run(node_cfg, runtime, provider.clone(), provider, &mut stop, move |client| {
            events_for.set_events(Arc::new(KubeEvents(vnode::events::Recorder::new(
                client.clone(),
                node_name.clone(),
                false,
            ))));
            gc_pods.set_client(client.clone());
            if let Some(old) = hibernations.take() {
                old.abort();
            }
            let loop_ = vk_cocoon::hibernation::run(client.clone(), events_for.clone(), HIBERNATION_INTERVAL);
            hibernations = Some(tokio::spawn(loop_));
        })
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let cfg = match CocoonConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vk-cocoon: {}", vnode::error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let filter = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(f) => f,
        Err(_) => match tracing_subscriber::EnvFilter::try_new(&cfg.log_level) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("vk-cocoon: VK_LOG_LEVEL={:?}: {e}", cfg.log_level);
                return ExitCode::FAILURE;
            }
        },
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    // kube and the kubelet endpoint use rustls; pick its ring provider once (already set is fine).
    let _ = rustls::crypto::ring::default_provider().install_default();
    match run(cli, cfg).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vk-cocoon: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_has_only_the_join_flags_and_documents_the_environment() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["vk-cocoon"]).unwrap();
        assert_eq!(cli.join.credentials_dir, std::path::PathBuf::from("/var/lib/vk-cocoon/pki"));
        let help = Cli::command().render_long_help().to_string();
        for s in [
            "--join-server",
            "VK_ORPHAN_POLICY",
            "OCI_REGISTRY",
            "VK_COCOON_BIN",
            "ignored",
            "VK_NETNS",
            "VK_VM_CIDR",
            "VK_BRIDGE",
            "VK_SHARED_NAMESPACES",
            "VK_LEGACY_NAMESPACE",
            "VK_NET_HOST_ALLOW",
            "VK_NET_UPLINK",
            "VK_NET_REFUSE",
            "VK_SNAPSHOT_GC_INTERVAL",
            "VK_SNAPSHOT_RETENTION",
            "shared-network",
        ] {
            assert!(help.contains(s), "{s} missing from --help");
        }
        let ids: Vec<String> = Cli::command().get_arguments().map(|a| a.get_id().to_string()).collect();
        for id in &ids {
            assert!(
                [
                    "kubeconfig",
                    "join_server",
                    "join_api_server",
                    "join_token_file",
                    "join_ca_hash",
                    "credentials_dir",
                    "client_ca_file",
                    "help",
                    "version"
                ]
                .contains(&id.as_str()),
                "unexpected flag {id}"
            );
        }
    }
}

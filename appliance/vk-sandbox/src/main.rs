//! `vk-sandbox`: the virtual node whose Pods are claims on this machine's sandboxd warm pool
//! (`docs/virtual-node.md` §2). A thin binary: flags → configuration → the
//! [`vk_sandbox::SandboxProvider`] under the `vnode` runtime.
//!
//! Start-up: parse and validate flags; read the sandboxd token; open the claims state (fatal
//! if malformed or unwritable); join the cluster when `--join-server` is given (token discovery
//! and the kubelet TLS bootstrap), else use `--kubeconfig` / in-cluster / `$KUBECONFIG`; run
//! the node until SIGTERM/SIGINT. With a joined identity, the certificate is renewed at its
//! rotation deadline and the runtime restarted with a fresh client. Shutdown leaves every
//! claim and VM in place. Errors print as one chain and exit 1.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use foundation::quantity;
use k8s_openapi::api::core::v1::Taint;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use vk_sandbox::authority::KubeOwners;
use vk_sandbox::inventory::{InventoryConfig, Publisher};
use vk_sandbox::provider::BackgroundLoops;
use vk_sandbox::sandboxd::SandboxdClient;
use vk_sandbox::{status, ProviderConfig, SandboxProvider};
use vnode::session::{terminated, JoinArgs, Session};

/// The taint every vk-sandbox node registers with.
const TAINT_KEY: &str = "virtual-kubelet.io/provider";
const TAINT_VALUE: &str = "sandboxd";

#[derive(Debug, Parser)]
#[command(
    name = "vk-sandbox",
    version,
    about = "A virtual Kubernetes node whose Pods are claims on the local sandboxd warm pool.",
    long_about = "A virtual Kubernetes node whose Pods are claims on the local sandboxd warm pool.\n\n\
        A Pod scheduled here (nodeSelector sandbox.cocoonstack.io/runtime=sandboxd, toleration \
        virtual-kubelet.io/provider Exists NoSchedule, annotation sandbox.cocoonstack.io/template) \
        becomes one sandboxd claim. Deleting a Pod releases its VM only when the Pod's controller \
        owner is gone; otherwise the claim is kept for a same-name replacement.\n\n\
        Every flag with an environment variable may be set either way; the flag wins.",
    mut_arg("credentials_dir", |a| a.default_value("/var/lib/vk-sandbox/pki"))
)]
struct Cli {
    /// Node name (with --join-server, also the system:node:<name> identity).
    #[arg(long, env = "VK_NODE_NAME", default_value = "vk-sandboxd")]
    node_name: String,
    /// Node InternalIP, the address the API server dials for logs and exec (a name is resolved
    /// once at start); empty = this host's first non-loopback IPv4.
    #[arg(long, env = "VK_NODE_IP", default_value = "")]
    node_ip: String,
    /// Kubelet HTTPS endpoint, `[host]:port` (":10260" = all interfaces).
    #[arg(long, env = "VK_LISTEN_ADDR", default_value = ":10260")]
    listen_addr: String,
    /// Kubelet serving certificate (PEM); empty = self-signed P-256 for the node name, node IP and 127.0.0.1.
    #[arg(long, env = "VK_TLS_CERT", default_value = "")]
    tls_cert: String,
    /// Kubelet serving key (PEM), with --tls-cert.
    #[arg(long, env = "VK_TLS_KEY", default_value = "")]
    tls_key: String,
    /// Node CPU capacity (= allocatable) in millicores.
    #[arg(long, env = "VK_NODE_CPU", default_value = "4000")]
    node_cpu: String,
    /// Node memory capacity (= allocatable), a Kubernetes quantity.
    #[arg(long, env = "VK_NODE_MEMORY", default_value = "8Ti")]
    node_memory: String,
    /// Node pod capacity (= allocatable).
    #[arg(long, env = "VK_NODE_PODS", default_value = "2000")]
    node_pods: String,
    /// Pod queue (and API) rate: < 0 = backoff only, 0 = client-go's 5 qps / burst 10.
    #[arg(long, default_value_t = 200.0, allow_negative_numbers = true)]
    kube_api_qps: f64,
    /// Pod queue (and API) burst.
    #[arg(long, default_value_t = 400)]
    kube_api_burst: u32,
    /// Workers per pod queue: how many Pods are claimed (and statuses written) at once. A claim
    /// waits on sandboxd, not on a CPU, so this is not the core count; --kube-api-qps bounds the
    /// rate.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pod_sync_workers: u32,
    /// sandboxd's URL: http://host:port, or https://host:port with --sandboxd-ca-file.
    #[arg(long, env = "SANDBOXD_URL", default_value = "http://127.0.0.1:7777")]
    sandboxd_url: String,
    /// For an https:// --sandboxd-url: the PEM certificates to trust, sandboxd's own certificate
    /// (trusted exactly, whatever names it carries) or the CA that issued it; empty = none.
    #[arg(long, env = "SANDBOXD_CA_FILE", default_value = "")]
    sandboxd_ca_file: String,
    /// The address Pods are reported at when a claim carries no owner_addr, and (with
    /// --publish-inventory) the one other boxes redirect SDK claims to, whose host must then be
    /// the node's IP (--node-ip); empty = host:port of --sandboxd-url.
    #[arg(long, env = "SANDBOXD_ADVERTISE_ADDR", default_value = "")]
    sandboxd_advertise_addr: String,
    /// File holding sandboxd's node token (read once, trimmed); empty = none.
    #[arg(long, env = "SANDBOXD_TOKEN_FILE", default_value = "")]
    sandboxd_token_file: String,
    /// The claims state file: every claim's release credential (must be writable).
    #[arg(long, env = "VK_STATE_PATH", default_value = "/var/lib/vk-sandbox/claims.json")]
    state_path: PathBuf,
    /// Audit-only orphan scan period (0 = off).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    orphan_scan_interval: Duration,
    /// Publish this node's NodeInventory (sandbox.cocoonstack.io/v1beta1, named after the node:
    /// its sandboxd address, pools and sandboxes; needs manifests/nodeinventory-crd.yaml) and
    /// tell sandboxd the other boxes of the fleet from theirs (PUT /v1/peers), so that it
    /// redirects an SDK claim it has no warm VM for to a box that has one.
    #[arg(long, default_value_t = false)]
    publish_inventory: bool,
    /// How often the inventory is published and the warm capacity refreshed; also a second
    /// after each claim or release.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    publish_interval: Duration,
    /// A box whose NodeInventory was published longer ago than this is stale: sandboxd is not
    /// told of it (and the report sent to sandboxd holds this long).
    #[arg(long, default_value = "90s", value_parser = humantime::parse_duration)]
    inventory_stale_after: Duration,
    /// Advertise each pool's warm VMs as the extended resource
    /// sandbox.cocoonstack.io/warm-<template>-<net>-<size> on the Node (a Pod requesting 1 of
    /// it is scheduled only where its pool is warm); --advertise-warm-capacity=false turns it off.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    advertise_warm_capacity: bool,
    /// Node labels, a comma-separated k=v list.
    #[arg(long, default_value = "sandbox.cocoonstack.io/runtime=sandboxd")]
    node_labels: String,
    /// Open `kubectl logs -f`/`exec`/`attach`/`port-forward` sessions one Pod may have on the
    /// kubelet port; the next is refused with 429 Too Many Requests.
    #[arg(long, env = "VK_MAX_STREAMS_PER_POD", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    max_streams_per_pod: u32,
    /// Record only Warning pod events (each Normal event is an API write).
    #[arg(long, default_value_t = false)]
    disable_pod_events: bool,
    // --kubeconfig, --join-server, --join-token-file, --join-ca-hash, --credentials-dir.
    #[command(flatten)]
    join: JoinArgs,
}

/// `":port"` (all interfaces), `"ip:port"` or `"[v6]:port"`.
fn parse_listen_addr(s: &str) -> anyhow::Result<SocketAddr> {
    let s = s.trim();
    let full = if s.starts_with(':') { format!("0.0.0.0{s}") } else { s.to_owned() };
    full.parse().with_context(|| format!("--listen-addr {s:?} is not [ip]:port (e.g. :10260 or 10.0.0.5:10260)"))
}

/// `k=v,k2=v2` (blank entries skipped).
fn parse_labels(s: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (k, v) =
            entry.split_once('=').with_context(|| format!("--node-labels entry {entry:?} is not key=value"))?;
        if k.trim().is_empty() {
            bail!("--node-labels entry {entry:?} has an empty key");
        }
        out.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    Ok(out)
}

/// Millicores → a CPU quantity (`4000` → `4`, `4500` → `4500m`).
fn cpu_quantity(millis: &str) -> anyhow::Result<Quantity> {
    let m: u64 =
        millis.trim().parse().with_context(|| format!("--node-cpu {millis:?} is not a whole number of millicores"))?;
    if m == 0 {
        bail!("--node-cpu is 0: zero allocatable CPU rejects every pod");
    }
    Ok(Quantity(quantity::cpu_string(m)))
}

/// A memory quantity (`foundation::quantity`: digits, a fraction, a binary or decimal suffix
/// or an exponent), passed on as written.
fn memory_quantity(s: &str) -> anyhow::Result<Quantity> {
    let s = s.trim();
    let bytes = quantity::units_ceil(s)
        .with_context(|| format!("--node-memory {s:?} is not a quantity like 8Ti, 512Gi or 1000000000"))?;
    if bytes == 0 {
        bail!("--node-memory is 0: zero allocatable memory rejects every pod");
    }
    Ok(Quantity(s.to_owned()))
}

/// A positive pod count.
fn pods_quantity(s: &str) -> anyhow::Result<Quantity> {
    let n: u64 = s.trim().parse().with_context(|| format!("--node-pods {s:?} is not a whole number"))?;
    if n == 0 {
        bail!("--node-pods is 0: zero allocatable pods rejects every pod");
    }
    Ok(Quantity(n.to_string()))
}

fn non_empty(s: &str) -> Option<PathBuf> {
    (!s.trim().is_empty()).then(|| PathBuf::from(s.trim()))
}

fn read_trimmed(path: &Path, what: &str) -> anyhow::Result<String> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {what} {}", path.display()))?;
    let s = s.trim().to_owned();
    if s.is_empty() {
        bail!("{what} {} is empty", path.display());
    }
    Ok(s)
}

/// Everything the node runtime is started with.
struct NodeSetup {
    node: vnode::NodeConfig,
    runtime: vnode::RuntimeConfig,
}

fn node_setup(cli: &Cli) -> anyhow::Result<NodeSetup> {
    let listen_addr = parse_listen_addr(&cli.listen_addr)?;
    let capacity = BTreeMap::from([
        ("cpu".to_owned(), cpu_quantity(&cli.node_cpu)?),
        ("memory".to_owned(), memory_quantity(&cli.node_memory)?),
        ("pods".to_owned(), pods_quantity(&cli.node_pods)?),
    ]);
    let node = vnode::NodeConfig {
        name: cli.node_name.clone(),
        labels: parse_labels(&cli.node_labels)?,
        taints: vec![Taint {
            key: TAINT_KEY.into(),
            value: Some(TAINT_VALUE.into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }],
        capacity,
        internal_ip: vnode::host_ip::node_ip_for(&cli.node_ip, listen_addr).context("--node-ip")?,
        kubelet_port: listen_addr.port(),
        kubelet_version: concat!("v", env!("CARGO_PKG_VERSION"), "-vk-sandbox").to_owned(),
        provider_id: None,
        extra_conditions: Vec::new(),
        ..Default::default()
    };
    let runtime = vnode::RuntimeConfig {
        kube_api_qps: cli.kube_api_qps,
        kube_api_burst: cli.kube_api_burst.max(1),
        workers: cli.pod_sync_workers as usize,
        disable_pod_events: cli.disable_pod_events,
        listen_addr,
        tls_cert: non_empty(&cli.tls_cert),
        tls_key: non_empty(&cli.tls_key),
        stream_limits: vnode::streams::StreamLimits {
            per_pod: cli.max_streams_per_pod as usize,
            ..vnode::streams::StreamLimits::default()
        },
        ..Default::default()
    };
    Ok(NodeSetup { node, runtime })
}

/// The fleet loop's configuration from the flags.
fn inventory_config(cli: &Cli, address: &str, node_ip: Option<std::net::IpAddr>) -> anyhow::Result<InventoryConfig> {
    if cli.publish_interval.is_zero() {
        bail!("--publish-interval is 0: give a period such as 30s");
    }
    if cli.inventory_stale_after < Duration::from_secs(1) {
        bail!("--inventory-stale-after is under a second: give a window such as 90s");
    }
    if cli.publish_inventory && cli.inventory_stale_after <= cli.publish_interval {
        tracing::warn!(
            interval = ?cli.publish_interval,
            stale_after = ?cli.inventory_stale_after,
            "--inventory-stale-after is not longer than --publish-interval: live peers will flicker in and out"
        );
    }
    if cli.publish_inventory {
        // Peers believe an address only on its Node (inventory::peers): refuse to publish one
        // they would drop, such as the loopback default of --sandboxd-url.
        let host = vk_sandbox::status::host_of(address);
        let on_node = match (node_ip, host.parse::<std::net::IpAddr>()) {
            (Some(ip), Ok(h)) => ip == h,
            (Some(_), Err(_)) => false,
            (None, _) => host.eq_ignore_ascii_case(&cli.node_name),
        };
        if !on_node {
            let node_addr = node_ip.map_or_else(|| cli.node_name.clone(), |ip| ip.to_string());
            bail!(
                "--publish-inventory: the sandboxd address published to the fleet, {address} (--sandboxd-advertise-addr, \
                 else the host:port of --sandboxd-url), is not on this node's address {node_addr} (--node-ip); other \
                 boxes believe only an address of the Node: set --sandboxd-advertise-addr to {node_addr}:<sandboxd port>"
            );
        }
    }
    let mut cfg = InventoryConfig::new(cli.node_name.clone(), address.to_owned());
    cfg.publish = cli.publish_inventory;
    cfg.advertise_warm = cli.advertise_warm_capacity;
    cfg.interval = cli.publish_interval;
    cfg.stale_after = cli.inventory_stale_after;
    Ok(cfg)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut setup = node_setup(&cli)?;
    let node_token = match non_empty(&cli.sandboxd_token_file) {
        Some(p) => Some(read_trimmed(&p, "the sandboxd token file")?),
        None => None,
    };
    let ca = non_empty(&cli.sandboxd_ca_file);
    let sandboxd = SandboxdClient::with_ca(&cli.sandboxd_url, node_token, ca.as_deref()).with_context(|| {
        format!("--sandboxd-url {} (--sandboxd-ca-file {:?})", cli.sandboxd_url, cli.sandboxd_ca_file)
    })?;
    let advertise = match cli.sandboxd_advertise_addr.trim() {
        "" => sandboxd.host_port().to_owned(),
        a => a.to_owned(),
    };
    let icfg = inventory_config(&cli, &advertise, setup.node.internal_ip)?;
    match sandboxd.info().await {
        Ok(info) => {
            tracing::info!(url = %cli.sandboxd_url, pools = info.pools.len(), claimed = info.claimed, "sandboxd answers")
        }
        Err(e) => {
            tracing::warn!(url = %cli.sandboxd_url, error = %vnode::error_chain(&e), "sandboxd does not answer yet; pods fail until it does")
        }
    }
    let owners = Arc::new(KubeOwners::new());
    let mut pcfg = ProviderConfig::new(cli.state_path.clone(), status::host_of(&advertise));
    pcfg.orphan_scan_interval = cli.orphan_scan_interval;
    let provider =
        Arc::new(SandboxProvider::new(sandboxd.clone(), owners.clone(), pcfg).context("starting the provider")?);
    let _loops = provider.spawn_loops();
    let enabled = icfg.enabled();
    let publisher = Arc::new(Publisher::new(icfg, sandboxd, provider.clone(), setup.node.handle.clone()));
    let mut fleet = BackgroundLoops::default();
    if enabled {
        fleet.spawn(tracing::info_span!("inventory"), publisher.clone().run());
    }
    setup.runtime.stats.pod_metrics = Some(provider.clone());
    setup.runtime.stats.runtime =
        Arc::new(vnode::stats::RuntimeMetrics::with_provider(|r| provider.register_metrics(r)));

    let session = Session::open(&cli.join, &cli.node_name).await?;
    session
        .run(setup.node, setup.runtime, provider.clone(), provider, terminated(), |client| {
            owners.set_client(client.clone());
            publisher.set_client(client.clone());
        })
        .await?;
    drop(fleet);
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    // kube and the kubelet endpoint use rustls; pick its ring provider once (already set is fine).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vk-sandbox: {e:#}");
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
    fn cli_is_well_formed_and_defaults_match_the_spec() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["vk-sandbox"]).unwrap();
        assert_eq!(cli.node_name, "vk-sandboxd");
        assert_eq!(cli.listen_addr, ":10260");
        assert_eq!((cli.node_cpu.as_str(), cli.node_memory.as_str(), cli.node_pods.as_str()), ("4000", "8Ti", "2000"));
        assert_eq!((cli.kube_api_qps, cli.kube_api_burst), (200.0, 400));
        assert_eq!(cli.pod_sync_workers, 32);
        assert!(Cli::try_parse_from(["vk-sandbox", "--pod-sync-workers", "0"]).is_err());
        assert_eq!(cli.sandboxd_url, "http://127.0.0.1:7777");
        assert_eq!(cli.state_path, PathBuf::from("/var/lib/vk-sandbox/claims.json"));
        assert_eq!(cli.orphan_scan_interval, Duration::from_secs(60));
        assert_eq!(cli.publish_interval, Duration::from_secs(30));
        assert_eq!(cli.node_labels, "sandbox.cocoonstack.io/runtime=sandboxd");
        assert!(!cli.publish_inventory && !cli.disable_pod_events);
        assert_eq!(cli.inventory_stale_after, Duration::from_secs(90));
        assert!(cli.advertise_warm_capacity);
        assert_eq!(cli.max_streams_per_pod as usize, vnode::streams::StreamLimits::default().per_pod);
        assert_eq!(cli.join.credentials_dir, PathBuf::from("/var/lib/vk-sandbox/pki"));
        let cli = Cli::try_parse_from([
            "vk-sandbox",
            "--kube-api-qps",
            "-1",
            "--orphan-scan-interval",
            "0",
            "--join-ca-hash",
            "sha256:aa",
            "--join-ca-hash",
            "sha256:bb",
        ])
        .unwrap();
        assert_eq!(cli.kube_api_qps, -1.0);
        assert!(cli.orphan_scan_interval.is_zero());
        assert_eq!(cli.join.join_ca_hash.len(), 2);
    }

    #[test]
    fn env_variables_follow_the_spec_table() {
        let cmd = Cli::command();
        let env_of = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        for (id, env) in [
            ("node_name", "VK_NODE_NAME"),
            ("node_ip", "VK_NODE_IP"),
            ("listen_addr", "VK_LISTEN_ADDR"),
            ("tls_cert", "VK_TLS_CERT"),
            ("tls_key", "VK_TLS_KEY"),
            ("node_cpu", "VK_NODE_CPU"),
            ("node_memory", "VK_NODE_MEMORY"),
            ("node_pods", "VK_NODE_PODS"),
            ("sandboxd_url", "SANDBOXD_URL"),
            ("sandboxd_advertise_addr", "SANDBOXD_ADVERTISE_ADDR"),
            ("sandboxd_token_file", "SANDBOXD_TOKEN_FILE"),
            ("state_path", "VK_STATE_PATH"),
            ("max_streams_per_pod", "VK_MAX_STREAMS_PER_POD"),
            ("join_token_file", "VK_JOIN_TOKEN_FILE"),
        ] {
            assert_eq!(env_of(id).as_deref(), Some(env), "{id}");
        }
        for id in [
            "kube_api_qps",
            "kube_api_burst",
            "node_labels",
            "disable_pod_events",
            "publish_inventory",
            "inventory_stale_after",
            "advertise_warm_capacity",
        ] {
            assert_eq!(env_of(id), None, "{id} has no env var in the spec");
        }
    }

    #[test]
    fn listen_addr_forms() {
        assert_eq!(parse_listen_addr(":10260").unwrap(), "0.0.0.0:10260".parse().unwrap());
        assert_eq!(parse_listen_addr("127.0.0.1:9").unwrap(), "127.0.0.1:9".parse().unwrap());
        assert_eq!(parse_listen_addr("[::]:10250").unwrap(), "[::]:10250".parse().unwrap());
        assert!(parse_listen_addr("10260").is_err());
        assert!(parse_listen_addr(":x").is_err());
    }

    #[test]
    fn labels_and_quantities() {
        let l = parse_labels("sandbox.cocoonstack.io/runtime=sandboxd, zone=a,,").unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l["zone"], "a");
        assert!(parse_labels("novalue").is_err());
        assert!(parse_labels("=x").is_err());
        assert_eq!(cpu_quantity("4000").unwrap().0, "4");
        assert_eq!(cpu_quantity("4500").unwrap().0, "4500m");
        assert!(cpu_quantity("4.5").is_err() && cpu_quantity("0").is_err());
        assert_eq!(memory_quantity("8Ti").unwrap().0, "8Ti");
        assert_eq!(memory_quantity("1000000").unwrap().0, "1000000");
        assert_eq!(memory_quantity("1.5Gi").unwrap().0, "1.5Gi");
        assert!(memory_quantity("8Tb").is_err() && memory_quantity("Ti").is_err() && memory_quantity("0Gi").is_err());
        assert_eq!(pods_quantity("2000").unwrap().0, "2000");
        assert!(pods_quantity("0").is_err());
    }

    #[test]
    fn node_setup_carries_the_taint_labels_capacity_and_port() {
        let cli = Cli::try_parse_from(["vk-sandbox", "--listen-addr", ":10333", "--node-ip", "10.0.0.5"]).unwrap();
        let s = node_setup(&cli).unwrap();
        assert_eq!(s.node.kubelet_port, 10333);
        assert_eq!(s.node.internal_ip, Some("10.0.0.5".parse().unwrap()));
        assert_eq!(s.node.labels["sandbox.cocoonstack.io/runtime"], "sandboxd");
        let t = &s.node.taints[0];
        assert_eq!(
            (t.key.as_str(), t.value.as_deref(), t.effect.as_str()),
            (TAINT_KEY, Some("sandboxd"), "NoSchedule")
        );
        assert_eq!(s.node.capacity["cpu"].0, "4");
        assert_eq!(s.node.capacity["memory"].0, "8Ti");
        assert_eq!(s.node.capacity["pods"].0, "2000");
        assert_eq!(s.runtime.listen_addr.port(), 10333);
        assert_eq!((s.runtime.kube_api_qps, s.runtime.kube_api_burst), (200.0, 400));
        assert!(s.runtime.tls_cert.is_none());
    }

    #[test]
    fn fleet_flags_become_the_inventory_config() {
        let cli = Cli::try_parse_from(["vk-sandbox"]).unwrap();
        let ip: Option<std::net::IpAddr> = Some("10.0.0.5".parse().unwrap());
        let c = inventory_config(&cli, "10.0.0.5:7777", ip).unwrap();
        assert!(!c.publish && c.advertise_warm && c.enabled());
        assert_eq!((c.interval, c.stale_after), (Duration::from_secs(30), Duration::from_secs(90)));
        assert_eq!((c.node_name.as_str(), c.address.as_str()), ("vk-sandboxd", "10.0.0.5:7777"));
        let cli = Cli::try_parse_from([
            "vk-sandbox",
            "--publish-inventory",
            "--publish-interval",
            "2s",
            "--inventory-stale-after",
            "8s",
            "--advertise-warm-capacity=false",
        ])
        .unwrap();
        let c = inventory_config(&cli, "10.0.0.5:7777", ip).unwrap();
        assert!(c.publish && !c.advertise_warm);
        // Publishing an address other boxes would not believe (not on the Node) is refused,
        // naming the flag; the loopback default of --sandboxd-url is the common case.
        for (addr, node_ip) in [("127.0.0.1:7777", ip), ("sbx.example:7777", ip), ("10.0.0.6:7777", ip), ("a:1", None)]
        {
            let e = inventory_config(&cli, addr, node_ip).unwrap_err().to_string();
            assert!(e.contains("--sandboxd-advertise-addr"), "{addr}: {e}");
        }
        let v6: Option<std::net::IpAddr> = Some("fd00::1".parse().unwrap());
        assert!(inventory_config(&cli, "[fd00::1]:7777", v6).is_ok());
        assert!(inventory_config(&cli, "vk-sandboxd:7777", None).is_ok(), "no IP: the Node's Hostname address");
        assert_eq!((c.interval, c.stale_after), (Duration::from_secs(2), Duration::from_secs(8)));
        let off = Cli::try_parse_from(["vk-sandbox", "--advertise-warm-capacity", "false"]).unwrap();
        assert!(!inventory_config(&off, "a:1", None).unwrap().enabled(), "nothing to do: no loop");
        assert!(Cli::try_parse_from(["vk-sandbox", "--advertise-warm-capacity"]).unwrap().advertise_warm_capacity);
        for bad in [["--publish-interval", "0s"], ["--inventory-stale-after", "0s"]] {
            let cli = Cli::try_parse_from(["vk-sandbox", bad[0], bad[1]]).unwrap();
            assert!(inventory_config(&cli, "a:1", None).is_err(), "{bad:?}");
        }
    }
}

//! `sandboxd`: flags → config → [`sandboxd::Node`] → HTTP server. Everything else is the library.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use sandboxd::config::{Config, DEFAULT_PATH};
use sandboxd::{Node, NodeOptions};

/// The Chrysalis warm-pool daemon.
///
/// Keeps pools of pre-booted microVMs per (template, net, size) and hands them out over the
/// sandboxd HTTP API (`POST /v1/claim`, `…/agent`, `…/exec`, …), wire-compatible with the
/// public `cocoonstack-sandbox` Python SDK. Claims are journaled in `<data_dir>/claims.log`
/// (one line per change, compacted into the `claims.json` snapshot); on restart, VMs of
/// journaled claims are re-adopted and unowned `sbx-` VMs are destroyed.
///
/// Secure by default: sandboxd refuses to start when `listen` is not a loopback address and
/// the config has no `api_token_file` (the error names the key, where `listen` was set and the
/// fix). With a root token, every node route (claim, list, per-id read, stats, info, drain,
/// pools, peers, metrics) needs it (401 otherwise); sandbox routes need that sandbox's token
/// (or the root token); `/healthz` is open. On loopback without a token (development) node
/// routes are open, except `PUT /v1/pools`, which always needs the root token. The token file
/// must hold at least 32 characters and be readable by its owner only (chmod 600).
///
/// `tls_cert_file` + `tls_key_file` make `listen` serve TLS (ALPN http/1.1); `local_listen`
/// adds a plain-HTTP loopback listener for local clients. Limits: `max_vms` /
/// `max_memory_mib` / `max_disk_mib` (the node budget, derived from the host's memory and the
/// VM filesystem's size by default; each VM's disk counts as its overlay's worst case),
/// `max_lifetime_secs` (lease horizon, 7 days), per-claim caps on relays and execs, exec
/// timeouts, `max_connections`, header/body/relay-idle timeouts.
///
/// Network: a `net: none` VM has no NIC. `net: egress` (per pool and per claim) needs the
/// config's `network` section with an `uplink` (`{"network": {"uplink": "eno1"}}`; optional
/// `bridge` (chrysalis1), `cidr` (10.89.0.0/24), `refuse`, `netns`); each egress VM then gets
/// its own isolated TAP and address, reaches no host service and no other VM, and goes out of
/// the uplink only, masqueraded, never to private, link-local (169.254.169.254), loopback,
/// multicast or reserved addresses nor to the host's own. Without an uplink an egress pool is a
/// config error and an egress claim answers 409, both naming `network.uplink`.
///
/// Beyond the core verbs: template names resolve as the SDK writes them (`rt:24.04` is short
/// for an alias ending in it); fork (`max_fork_count`, 16) and checkpoints (kept under
/// `<data_dir>/snapshots`, `checkpoint_ttl_hours`, 168) restore VMs from a snapshot of a
/// running sandbox; hibernate and wake (explicit, on the next guest call, or after a pool's
/// `idle_hibernate_seconds`) free a sandbox's VM and RAM; promote keeps a sandbox as a template
/// a pool can clone (`<data_dir>/templates`); `preview_listen` (and `preview_url`) serves
/// expiring preview URLs to guest ports. Volumes: ext4 images under `<data_dir>/volumes`
/// (`{"volumes": [{"name": "datasets", "size_mib": 1024}]}` makes missing ones at start; any
/// `<name>.img` placed there counts), hot-plugged into a sandbox at claim time or by
/// `PUT/PATCH …/volumes` and mounted by the guest agent (`/mnt/<name>` unless told; `rw`
/// holds are exclusive). A sandbox holding volumes cannot fork, checkpoint, promote or
/// hibernate until it lets them go.
///
/// Density: a pool's golden keeps its RAM in a file that every clone maps copy-on-write (one
/// sealed copy per golden), warm VMs wait paused and the claim resumes them, and a claim on an
/// empty pool gets a VM made for it (a clone of its golden, or a cold boot when it has none)
/// while the node budget has room (`429` past it). `hypervisor` picks `qemu`,
/// `cloud-hypervisor` or `auto` (cloud-hypervisor when present and KVM works); `GET /v1/info`
/// shows the choice.
#[derive(Debug, Parser)]
#[command(name = "sandboxd", version)]
struct Args {
    /// JSON config file. A missing default file means built-in defaults (no pools).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Listen address, overriding the config's `listen` (default 0.0.0.0:7777, which needs
    /// `api_token_file`; use 127.0.0.1:7777 for an open development node).
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Data directory (journal, pools.json, goldens), overriding the config's `data_dir`.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

fn print_chain(e: &anyhow::Error) {
    eprintln!("sandboxd: {e}");
    for cause in e.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandboxd: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            print_chain(&e);
            std::process::ExitCode::FAILURE
        }
    }
}

fn load_config(args: &Args) -> anyhow::Result<Config> {
    let mut c = if !args.config.exists() && args.config == std::path::Path::new(DEFAULT_PATH) {
        tracing::warn!(path = DEFAULT_PATH, "no config file; using defaults (no pools)");
        Config::default()
    } else {
        Config::load(&args.config)?
    };
    if let Some(l) = args.listen {
        c.listen = l;
        c.listen_source = sandboxd::config::ListenSource::Flag;
    }
    if let Some(d) = &args.data_dir {
        c.data_dir = d.clone();
    }
    Ok(c)
}

fn load_catalog(c: &Config) -> vmm::Catalog {
    let path = match &c.catalog {
        Some(p) => Ok(p.clone()),
        None => vmm::Catalog::default_path(),
    };
    match path.and_then(|p| vmm::Catalog::load(&p)) {
        Ok(cat) => cat,
        Err(e) => {
            tracing::warn!(error = %vmm::error_chain(&e), "no image catalog; pools cannot fill until `cargo xtask vm-image` builds one");
            vmm::Catalog::default()
        }
    }
}

/// The one place that picks the hypervisor driver.
fn driver(c: &Config) -> anyhow::Result<Arc<dyn vmm::Driver>> {
    // The data dir holds every sandbox token (the journal): 0700 before anything goes in.
    foundation::private_dir(&c.data_dir).with_context(|| format!("creating (0700) {}", c.data_dir.display()))?;
    let state_dir = c.vm_state_dir();
    std::fs::create_dir_all(&state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let mut qemu = vmm::qemu::QemuConfig::from_env();
    qemu.state_dir = state_dir;
    qemu.console_cap = c.console_log_kib.saturating_mul(1024);
    let pref = match c.hypervisor {
        sandboxd_api::config::Hypervisor::Auto => vmm::hypervisor::HypervisorPreference::Auto,
        sandboxd_api::config::Hypervisor::Qemu => vmm::hypervisor::HypervisorPreference::Qemu,
        sandboxd_api::config::Hypervisor::CloudHypervisor => vmm::hypervisor::HypervisorPreference::CloudHypervisor,
    };
    let (driver, _choice) = vmm::hypervisor::driver(pref, qemu).context("starting the hypervisor driver")?;
    Ok(driver)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = load_config(&args)?;
    // Fail closed before touching anything: an open node off loopback, a bad token file, a
    // half TLS pair or targets over the budget stop the start.
    cfg.check_exposure()?;
    let tls = cfg.tls()?;
    let opts = NodeOptions::from_config(&cfg, load_catalog(&cfg))?;
    match &opts.api_token {
        None => {
            tracing::warn!(listen = %cfg.listen, "no api_token_file configured: node routes are open on loopback (development)")
        }
        Some(_) if tls.is_none() && !cfg.listen.ip().is_loopback() => tracing::warn!(
            listen = %cfg.listen,
            "tokens travel in clear text: set tls_cert_file and tls_key_file to serve TLS"
        ),
        Some(_) => {}
    }
    match httpd::raise_nofile_limit() {
        Ok((soft, hard)) => tracing::debug!(soft, hard, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "raising the open-file limit failed"),
    }
    let budget = opts.limits.budget;
    let driver = driver(&cfg)?;
    tracing::info!(backend = %driver.backend(), accel = %driver.accel(), "VM driver ready");
    let node = Node::start(driver, opts).await.context("starting the node")?;
    let bind = |addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))
    };
    let listener = bind(cfg.listen).await?;
    let local = match cfg.local_listen {
        Some(addr) => Some((addr, bind(addr).await?)),
        None => None,
    };
    let preview = match cfg.preview_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    tracing::info!(
        listen = %cfg.listen,
        tls = tls.is_some(),
        local_listen = ?cfg.local_listen,
        preview_listen = ?cfg.preview_listen,
        max_vms = budget.max_vms,
        max_memory_mib = budget.max_memory_mib,
        max_disk_mib = budget.max_disk_mib,
        data_dir = %cfg.data_dir.display(),
        "sandboxd listening"
    );
    let stop = tokio_util::sync::CancellationToken::new();
    if let Some((addr, l)) = local {
        let (n, s) = (Arc::clone(&node), stop.clone());
        let owner = Some(addr.to_string());
        tokio::spawn(async move { sandboxd::http::serve_as(l, n, None, owner, s.cancelled_owned()).await });
    }
    if let Some(l) = preview {
        let (n, s) = (Arc::clone(&node), stop.clone());
        tokio::spawn(async move { sandboxd::http::serve_previews(l, n, s.cancelled_owned()).await });
    }
    sandboxd::http::serve(listener, Arc::clone(&node), tls, shutdown_signal()).await;
    stop.cancel();
    tracing::info!("shutting down; VMs keep running");
    node.shutdown();
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

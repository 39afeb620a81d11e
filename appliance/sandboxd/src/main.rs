//! `sandboxd`: flags → config → [`sandboxd::Node`] → HTTP server. Everything else is the library.

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
/// Without `api_token_file` in the config, node routes (claim, list, info, drain, pools) are
/// open to anyone who can reach the port; sandbox routes always need the sandbox's token.
#[derive(Debug, Parser)]
#[command(name = "sandboxd", version)]
struct Args {
    /// JSON config file. A missing default file means built-in defaults (no pools).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Listen address, overriding the config's `listen` (default 0.0.0.0:7777).
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
    let state_dir = c.vm_state_dir();
    std::fs::create_dir_all(&state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let mut qemu = vmm::qemu::QemuConfig::from_env();
    qemu.state_dir = state_dir;
    Ok(Arc::new(vmm::qemu::QemuDriver::new(qemu)))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = load_config(&args)?;
    let catalog = load_catalog(&cfg);
    let driver = driver(&cfg)?;
    tracing::info!(backend = %driver.backend(), accel = %driver.accel(), "VM driver ready");
    let opts = NodeOptions::from_config(&cfg, catalog)?;
    if opts.api_token.is_none() {
        tracing::warn!("no api_token_file configured: node routes are open");
    }
    let node = Node::start(driver, opts).await.context("starting the node")?;
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    tracing::info!(listen = %cfg.listen, data_dir = %cfg.data_dir.display(), "sandboxd listening");
    let app = sandboxd::http::app(Arc::clone(&node));
    sandboxd::http::serve(listener, app, shutdown_signal()).await?;
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

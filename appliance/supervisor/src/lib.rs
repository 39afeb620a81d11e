//! The Chrysalis appliance supervisor: the one long-running process beside init (a systemd
//! `Type=notify` service with a watchdog) that runs sandboxd, vk-sandbox and vk-cocoon.
//!
//! # Start-up order ([`run`])
//! 1. **Config** ([`config`]): the four layers are read, merged and validated. A broken
//!    configuration starts no service; the supervisor logs every problem (key, source, fix),
//!    shows them in `chrysalis status` and stays up so the box can be inspected (with
//!    [`RunOptions::exit_on_config_error`] it exits instead).
//! 2. **Secrets** ([`secrets`]): sandboxd's root token and, when a TCP surface serves TLS, the
//!    box certificate, minted on first boot in the state directory (0600 in 0700 directories)
//!    and reused after. A failure here is reported like a configuration error: no service
//!    starts without its token.
//! 3. **Subreaper**, stale services of a previous supervisor stopped ([`supervise`]).
//! 4. **API** ([`api`]) bound on the Unix socket (and TCP / metrics listeners when configured,
//!    through [`httpd::serve`]: connection caps, header timeouts, TLS beyond loopback).
//! 5. **Services** ([`services`]) started in order: sandboxd, vk-sandbox, vk-cocoon.
//! 6. **Main loop** (one task, a closed set of events: `SIGCHLD`, `SIGTERM`/`SIGINT`, a 250 ms
//!    tick, the watchdog tick, API commands): reaps, restarts with backoff, publishes state,
//!    sends `READY=1` once every enabled service has run for 1 s and sandboxd answers `/healthz`,
//!    `STATUS=` on changes and `WATCHDOG=1` ([`notify`]).
//! 7. **Health task** (`health_task`, over the probes of [`health`]): sandboxd, pools and
//!    virtual nodes every few seconds; each snapshot goes to [`UpdateControl::on_health`] (the
//!    A/B commit gate).
//!
//! `SIGTERM`/`SIGINT` stop the services (their process groups; VMs live on) and exit 0.
//!
//! # Logs
//! [`init_logging`]: JSON lines on stderr when stderr is not a terminal (journald, the serial
//! console, log shippers), human-readable text on a terminal; `CHRYSALIS_LOG_FORMAT=json|text`
//! overrides, `RUST_LOG` filters (default `info`). Service output is re-emitted with a
//! `service` field (target `chrysalis::service`), see [`logs`].
//!
//! # Architecture invariants
//! * The supervisor never signals a process that is not one of its services' process groups:
//!   VMs (daemonized QEMU, re-parented to us) are only ever reaped once dead.
//! * Only the main loop starts, stops or reaps processes.

#![forbid(unsafe_code)]

pub mod ab;
pub mod api;
pub mod client;
pub mod config;
pub mod health;
mod health_task;
pub mod http;
pub mod layout;
pub mod logs;
pub mod metrics;
pub mod notify;
pub mod secrets;
pub mod services;
pub mod state;
pub mod supervise;
pub mod update;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

pub use health::Health;
pub use update::{BundleStream, GateVerdict, NoUpdates, UpdateControl, UpdateError, UpdateOutcome, UpdateStatus};

use crate::config::{Issue, Settings, SourcePaths, ValidateEnv};
use crate::services::{Layout, ServiceName};
use crate::state::Shared;
use crate::supervise::{Backoff, RunState, Supervisor};

/// Default runtime directory (generated configs, pid files).
pub const RUN_DIR: &str = "/run/chrysalis";
/// Default binaries directory.
pub const BIN_DIR: &str = "/usr/bin";
/// Test hook: milliseconds after start at which the main loop blocks, as a deadlock would
/// (the supervise suite checks that the watchdog pings stop). Never set on a box.
pub const FAULT_STALL_ENV: &str = "CHRYSALIS_FAULT_STALL_AFTER_MS";
/// Default API socket.
pub const API_SOCKET: &str = "/run/chrysalis/api.sock";

pub use vmm::error_chain;

/// Installs the tracing subscriber described in the crate doc (JSON unless stderr is a TTY).
pub fn init_logging() {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = match std::env::var("CHRYSALIS_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        b.json().flatten_event(true).with_current_span(false).try_init()
    } else {
        b.with_ansi(std::io::stderr().is_terminal()).try_init()
    };
}

/// Why the supervisor could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is invalid (only with [`RunOptions::exit_on_config_error`]).
    #[error("invalid configuration")]
    Config(#[source] config::ConfigError),
    /// A directory, socket or listener could not be set up.
    #[error("{what} {}", .path.display())]
    Setup {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Supervision could not be set up.
    #[error("setting up supervision")]
    Supervise(#[from] supervise::SuperviseError),
    /// The secrets could not be prepared (only with [`RunOptions::exit_on_config_error`]), or a
    /// listener's TLS configuration failed.
    #[error("preparing the box's secrets")]
    Secrets(#[source] secrets::SecretsError),
}

/// Everything [`run`] can be told; [`RunOptions::new`] gives the appliance's defaults.
#[derive(Clone)]
pub struct RunOptions {
    /// The config layers.
    pub sources: SourcePaths,
    /// Overrides `supervisor.state_dir`.
    pub state_dir: Option<PathBuf>,
    /// Overrides `supervisor.api_socket`.
    pub api_socket: Option<PathBuf>,
    /// Runtime files.
    pub run_dir: PathBuf,
    /// Service binaries.
    pub bin_dir: PathBuf,
    /// Guest catalog when `sandboxd.catalog` is unset.
    pub catalog: PathBuf,
    /// Restart delays.
    pub backoff: Backoff,
    /// How long services get to stop.
    pub shutdown_timeout: Duration,
    /// Full health probe period.
    pub health_interval: Duration,
    /// The reboot command; `None`: `systemctl reboot` when running under systemd
    /// (`NOTIFY_SOCKET` set), else reboots are refused.
    pub reboot_command: Option<Vec<String>>,
    /// Exit with [`RunError::Config`] on a bad configuration instead of staying up.
    pub exit_on_config_error: bool,
    /// Overrides the hostname used for default node names.
    pub hostname: Option<String>,
    /// The update side.
    pub update: Arc<dyn UpdateControl>,
}

impl RunOptions {
    /// The appliance's defaults with `update` as the update side.
    pub fn new(update: Arc<dyn UpdateControl>) -> Self {
        RunOptions {
            sources: SourcePaths::default(),
            state_dir: None,
            api_socket: None,
            run_dir: RUN_DIR.into(),
            bin_dir: BIN_DIR.into(),
            catalog: config::DEFAULT_CATALOG.into(),
            backoff: Backoff::default(),
            shutdown_timeout: Duration::from_secs(20),
            health_interval: Duration::from_secs(5),
            reboot_command: None,
            exit_on_config_error: false,
            hostname: None,
            update,
        }
    }
}

/// How [`run`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Stopped by a signal.
    Signal(&'static str),
    /// The reboot command was run.
    Reboot,
}

fn setup_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RunError + 'a {
    move |source| RunError::Setup { what, path: path.to_path_buf(), source }
}

/// Loads and validates the configuration as `run` does (for `chrysalis config check`).
pub fn load_settings(sources: &SourcePaths, hostname: Option<&str>) -> Result<Settings, config::ConfigError> {
    let env =
        ValidateEnv { hostname: hostname.map(str::to_string).unwrap_or_else(config::hostname), check_files: true };
    config::load(sources)?.validate(&env)
}

/// `{"config", "sources"}` for `GET /v1/config`.
fn config_view(s: Option<&Settings>) -> serde_json::Value {
    match s {
        Some(s) => serde_json::json!({"config": s.config, "sources": s.sources}),
        None => serde_json::json!({"config": null, "sources": []}),
    }
}

fn status_line(sup: &Supervisor, ready: bool, sandboxd: Option<bool>, errors: &[Issue]) -> String {
    if let Some(first) = errors.first() {
        let more = if errors.len() > 1 { format!(" (+{} more)", errors.len() - 1) } else { String::new() };
        return format!("configuration error: {first}{more}");
    }
    let parts: Vec<String> = sup
        .statuses()
        .iter()
        .map(|s| {
            let st = match s.state {
                RunState::Starting => "starting",
                RunState::Running => "running",
                RunState::Backoff => "restarting",
                RunState::Stopping => "stopping",
                RunState::Stopped => "stopped",
            };
            format!("{} {st}", s.name)
        })
        .collect();
    let services = if parts.is_empty() { "no services".to_string() } else { parts.join(", ") };
    match (ready, sandboxd) {
        (true, _) => format!("ready: {services}"),
        (false, Some(false)) => format!("starting: {services}; sandboxd not answering yet"),
        (false, _) => format!("starting: {services}"),
    }
}

/// Binds the Unix socket API (replacing a stale socket), mode 0600.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, RunError> {
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(setup_err("creating", d))?;
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        }
    }
    let l = tokio::net::UnixListener::bind(path).map_err(setup_err("binding the API socket", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(setup_err("chmod", path))?;
    Ok(l)
}

async fn bind_tcp(addr: std::net::SocketAddr, what: &'static str) -> Result<tokio::net::TcpListener, RunError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| RunError::Setup {
        what,
        path: PathBuf::from(addr.to_string()),
        source,
    })
}

fn read_secret(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// The whole supervisor (see the crate doc). Returns when stopped by a signal or rebooting.
pub async fn run(opts: RunOptions) -> Result<Exit, RunError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut notifier = notify::Notifier::from_env();
    // Children inherit it: sandboxd's connection cap and relays need thousands of descriptors.
    match httpd::raise_nofile_limit() {
        Ok((soft, hard)) => tracing::debug!(soft, hard, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
    }

    // 1. Config.
    let (settings, mut config_errors) = match load_settings(&opts.sources, opts.hostname.as_deref()) {
        Ok(s) => (Some(s), Vec::new()),
        Err(e) => {
            let issues = e.to_issues();
            for i in &issues {
                tracing::error!(key = %i.key, source = %i.source, problem = %i.problem, fix = %i.fix, "configuration error");
            }
            if opts.exit_on_config_error {
                return Err(RunError::Config(e));
            }
            tracing::error!(
                "no service is started until the configuration is fixed; `chrysalis config check` explains each error"
            );
            (None, issues)
        }
    };
    let cfg = settings.as_ref().map(|s| s.config.clone()).unwrap_or_default();
    opts.update.configure(&cfg.update);
    let layout = Layout {
        state_dir: opts.state_dir.clone().unwrap_or(cfg.supervisor.state_dir.clone()),
        run_dir: opts.run_dir.clone(),
        bin_dir: opts.bin_dir.clone(),
        default_catalog: opts.catalog.clone(),
    };
    let api_socket = opts.api_socket.clone().unwrap_or(cfg.supervisor.api_socket.clone());
    std::fs::create_dir_all(&layout.run_dir).map_err(setup_err("creating", &layout.run_dir))?;
    foundation::private_dir(&layout.logs_dir()).map_err(setup_err("creating", &layout.logs_dir()))?;

    // 2. Secrets.
    let hostname = opts.hostname.clone().unwrap_or_else(config::hostname);
    let secrets = match &settings {
        None => None,
        Some(s) => match secrets::prepare(s, &layout, &hostname) {
            Ok(sec) => Some(sec),
            Err(e) => {
                let (key, fix) = e.key_and_fix();
                let issue = Issue {
                    key: key.into(),
                    source: config::Source::Default,
                    problem: error_chain(&e),
                    fix: fix.into(),
                };
                tracing::error!(key = %issue.key, problem = %issue.problem, fix = %issue.fix, "secrets unavailable; no service is started");
                if opts.exit_on_config_error {
                    return Err(RunError::Secrets(e));
                }
                config_errors.push(issue);
                None
            }
        },
    };

    // 3. Subreaper; the services and their logs.
    supervise::become_subreaper()?;
    let specs = match (&settings, &secrets) {
        (Some(s), Some(sec)) => services::plan(s, &layout, sec),
        _ => Vec::new(),
    };
    let mut logs: HashMap<ServiceName, Arc<logs::ServiceLog>> = HashMap::new();
    for s in &specs {
        let log = logs::ServiceLog::open(s.name.as_str(), Some(&layout.logs_dir())).unwrap_or_else(|e| {
            tracing::warn!(service = %s.name, error = %error_chain(&e), "service log file unavailable; keeping logs in memory");
            logs::ServiceLog::memory(s.name.as_str())
        });
        logs.insert(s.name, Arc::new(log));
    }
    let by_name: BTreeMap<String, Arc<logs::ServiceLog>> =
        logs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let served = match (&settings, &secrets) {
        (Some(s), Some(sec)) => sec.served(s.api_listen.is_some(), s.metrics_listen.is_some()),
        _ => Vec::new(),
    };
    let shared = Arc::new(
        Shared::new(
            by_name,
            config_view(settings.as_ref()),
            config_errors.clone(),
            layout.state_dir.display().to_string(),
        )
        .with_secrets(secrets.as_ref().map(|s| s.sandboxd_token_file.clone()), served),
    );
    let sandboxd_enabled = specs.iter().any(|s| s.name == ServiceName::Sandboxd);

    // 4. API.
    let (cmd_tx, mut cmd_rx) = mpsc::channel::<api::Command>(8);
    let api_state = api::ApiState {
        shared: shared.clone(),
        update: opts.update.clone(),
        commands: cmd_tx.clone(),
        upload: api::UploadLimits::default(),
    };
    let mut tasks = tokio::task::JoinSet::new();
    let unix = bind_unix(&api_socket)?;
    tracing::info!(socket = %api_socket.display(), "API listening");
    let router = api::app(api_state.clone());
    tasks.spawn(async move {
        if let Err(e) = axum::serve(unix, router).await {
            tracing::error!(error = %e, "the API socket server stopped");
        }
    });
    if let (Some(s), Some(sec)) = (&settings, &secrets) {
        let tls = match &sec.api_tls {
            Some(c) => Some(httpd::tls::server_config_from_files(&c.cert, &c.key, httpd::tls::ALPN_HTTP1).map_err(
                |source| RunError::Secrets(secrets::SecretsError::Tls { surfaces: "the API".into(), source }),
            )?),
            None => None,
        };
        if let (Some(addr), Some(tf)) = (s.api_listen, &s.config.supervisor.api_token_file) {
            let token = read_secret(tf).unwrap_or_default();
            if token.is_empty() {
                tracing::error!(file = %tf.display(), "supervisor.api_token_file is empty or unreadable: the remote API refuses every request");
            }
            let l = bind_tcp(addr, "binding supervisor.api_listen").await?;
            tracing::info!(listen = %addr, tls = tls.is_some(), "remote API listening (bearer token)");
            let router = api::with_token(api::app(api_state.clone()), token);
            let opts = httpd::ServeOptions {
                name: "supervisor api",
                limits: api::API_LIMITS,
                protocol: httpd::Protocol::Http1,
                tls: tls.clone(),
            };
            tasks.spawn(httpd::serve(l, router, opts, Arc::default(), std::future::pending()));
        }
        if let Some(addr) = s.metrics_listen {
            let l = bind_tcp(addr, "binding supervisor.metrics_listen").await?;
            let token = s.config.supervisor.metrics_token_file.as_deref().map(|f| read_secret(f).unwrap_or_default());
            tracing::info!(listen = %addr, tls = tls.is_some(), bearer = token.is_some(), "metrics listening");
            let router = match token {
                Some(t) => api::with_token(api::metrics_app(api_state.clone()), t),
                None => api::metrics_app(api_state.clone()),
            };
            let opts = httpd::ServeOptions {
                name: "supervisor metrics",
                limits: api::METRICS_LIMITS,
                protocol: httpd::Protocol::Http1,
                tls,
            };
            tasks.spawn(httpd::serve(l, router, opts, Arc::default(), std::future::pending()));
        }
    }

    // 5. Services.
    let mut sup = Supervisor::new(specs, &logs, opts.backoff, layout.clone());
    sup.stop_stale(opts.shutdown_timeout).await;
    sup.start_due();

    // 7. Health task.
    let prober = Arc::new(health_task::prober(settings.as_ref(), secrets.as_ref(), &layout, sandboxd_enabled));
    tasks.spawn(health_task::run(shared.clone(), prober, opts.update.clone(), cmd_tx.clone(), opts.health_interval));

    // 5. Main loop.
    let sig = |k: SignalKind| signal(k).map_err(setup_err("installing a signal handler", Path::new("-")));
    let (mut sigchld, mut sigterm, mut sigint) =
        (sig(SignalKind::child())?, sig(SignalKind::terminate())?, sig(SignalKind::interrupt())?);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watchdog = tokio::time::interval(notifier.watchdog_interval().unwrap_or(Duration::from_secs(3600)));
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if let Some(w) = notifier.watchdog_interval() {
        tracing::info!(every = ?w, "systemd watchdog enabled");
    }
    let reboot_cmd: Option<Vec<String>> = match (&opts.reboot_command, notifier.active()) {
        (Some(c), _) => Some(c.clone()),
        (None, true) => Some(vec!["systemctl".into(), "reboot".into()]),
        (None, false) => None,
    };
    let stall_at = std::env::var(FAULT_STALL_ENV)
        .ok()
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(|ms| std::time::Instant::now() + Duration::from_millis(ms));
    let exit = loop {
        tokio::select! {
            _ = sigchld.recv() => sup.reap(),
            _ = sigterm.recv() => break Exit::Signal("SIGTERM"),
            _ = sigint.recv() => break Exit::Signal("SIGINT"),
            _ = tick.tick() => {
                sup.reap();
                sup.start_due();
            }
            _ = watchdog.tick() => notifier.watchdog(),
            Some(cmd) = cmd_rx.recv() => match cmd {
                api::Command::Reboot { reason, reply } => {
                    let Some(argv) = reboot_cmd.clone() else {
                        let _ = reply.send(Err("not running as the appliance's service (no NOTIFY_SOCKET); `chrysalis run --reboot-command …` enables reboots".into()));
                        continue;
                    };
                    let _ = reply.send(Ok(()));
                    tracing::warn!(reason, "rebooting");
                    notifier.status(&format!("rebooting: {reason}"));
                    tokio::time::sleep(Duration::from_millis(300)).await; // let the API answer
                    sup.shutdown(opts.shutdown_timeout).await;
                    if reboot(&argv).await {
                        break Exit::Reboot;
                    }
                    sup.resume();
                }
            },
        }
        shared.tick();
        if stall_at.is_some_and(|at| std::time::Instant::now() >= at) {
            tracing::error!("{FAULT_STALL_ENV}: stalling the main loop (test hook)");
            std::thread::sleep(Duration::from_secs(24 * 3600));
        }
        let statuses = sup.statuses();
        let answers = shared.health().sandboxd_answers;
        let ready = settings.is_some()
            && secrets.is_some()
            && sup.all_running_for(supervise::STABLE_AFTER)
            && (!sandboxd_enabled || answers == Some(true));
        shared.set_services(statuses, ready);
        let line = status_line(&sup, ready, answers, &config_errors);
        if !notifier.is_ready() && (ready || !config_errors.is_empty()) {
            tracing::info!(status = %line, "ready");
            notifier.ready(&line);
        } else {
            notifier.status(&line);
        }
    };

    // Shutdown (the reboot path already stopped the services).
    tracing::info!(?exit, "stopping");
    notifier.stopping("stopping services; VMs keep running");
    if exit != Exit::Reboot {
        sup.shutdown(opts.shutdown_timeout).await;
    }
    tasks.abort_all();
    let _ = std::fs::remove_file(&api_socket);
    Ok(exit)
}

/// Runs the reboot command; true when it succeeded.
async fn reboot(argv: &[String]) -> bool {
    let Some((prog, args)) = argv.split_first() else { return false };
    let (prog, args) = (prog.clone(), args.to_vec());
    let r = tokio::task::spawn_blocking(move || std::process::Command::new(&prog).args(&args).status()).await;
    match r {
        Ok(Ok(s)) if s.success() => true,
        Ok(Ok(s)) => {
            tracing::error!(command = ?argv, status = %s, "the reboot command failed; restarting the services");
            false
        }
        Ok(Err(e)) => {
            tracing::error!(command = ?argv, error = %e, "the reboot command could not run; restarting the services");
            false
        }
        Err(e) => {
            tracing::error!(error = %e, "the reboot task failed");
            false
        }
    }
}

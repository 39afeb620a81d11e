//! What the main loop, the health task and the API share: service logs, the latest
//! [`Health`], readiness, the effective configuration and its errors.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::Issue;
use crate::health::Health;
use crate::logs::ServiceLog;
use crate::secrets::TlsCert;
use crate::supervise::ServiceStatus;
use crate::update::UpdateStatus;

/// The supervisor itself, in `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SupervisorInfo {
    /// Crate version.
    pub version: String,
    /// Its pid.
    pub pid: u32,
    /// Seconds since start.
    pub uptime_secs: u64,
    /// The state directory.
    pub state_dir: String,
    /// Its resident memory (`VmRSS`, KiB).
    #[serde(default)]
    pub rss_kib: Option<u64>,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// The supervisor.
    pub supervisor: SupervisorInfo,
    /// Configuration errors (the supervisor then runs no services).
    #[serde(default)]
    pub config_errors: Vec<Issue>,
    /// Services, nodes, pools.
    pub health: Health,
    /// Slot and update state.
    pub update: UpdateStatus,
    /// The certificates the box's TCP surfaces serve (empty: plain HTTP on loopback only).
    #[serde(default)]
    pub tls: Vec<TlsCert>,
}

/// Shared state (cheap locks, short critical sections).
#[derive(Debug)]
pub struct Shared {
    started: Instant,
    last_tick_ms: AtomicU64,
    health: RwLock<Health>,
    /// Per-service logs, by service name.
    pub logs: BTreeMap<String, Arc<ServiceLog>>,
    /// The effective configuration (`GET /v1/config`).
    pub config_view: serde_json::Value,
    /// Configuration errors, when the configuration is invalid.
    pub config_errors: Vec<Issue>,
    /// The state directory.
    pub state_dir: String,
    /// sandboxd's root token file (`GET /v1/tokens/sandboxd`).
    pub sandboxd_token_file: Option<std::path::PathBuf>,
    /// The certificates served.
    pub tls: Vec<TlsCert>,
}

impl Shared {
    /// New shared state.
    pub fn new(
        logs: BTreeMap<String, Arc<ServiceLog>>,
        config_view: serde_json::Value,
        config_errors: Vec<Issue>,
        state_dir: String,
    ) -> Self {
        Shared {
            started: Instant::now(),
            last_tick_ms: AtomicU64::new(0),
            health: RwLock::new(Health::default()),
            logs,
            config_view,
            config_errors,
            state_dir,
            sandboxd_token_file: None,
            tls: Vec::new(),
        }
    }

    /// With sandboxd's token file and the served certificates.
    pub fn with_secrets(mut self, sandboxd_token_file: Option<std::path::PathBuf>, tls: Vec<TlsCert>) -> Self {
        self.sandboxd_token_file = sandboxd_token_file;
        self.tls = tls;
        self
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// The main loop calls this on every turn.
    pub fn tick(&self) {
        self.last_tick_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the main loop last turned.
    pub fn since_tick(&self) -> Duration {
        let last = Duration::from_millis(self.last_tick_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }

    /// A copy of the latest health.
    pub fn health(&self) -> Health {
        self.health.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Changes the health in place (services and readiness from the main loop, probes from
    /// the health task).
    pub fn update_health(&self, f: impl FnOnce(&mut Health)) {
        f(&mut self.health.write().unwrap_or_else(|p| p.into_inner()));
    }

    /// Sets the services and readiness.
    pub fn set_services(&self, services: Vec<ServiceStatus>, ready: bool) {
        self.update_health(|h| {
            h.services = services;
            h.ready = ready;
        });
    }

    /// The status document.
    pub fn status(&self, update: UpdateStatus) -> Status {
        Status {
            supervisor: SupervisorInfo {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: std::process::id(),
                uptime_secs: self.uptime().as_secs(),
                state_dir: self.state_dir.clone(),
                rss_kib: crate::supervise::rss_kib(std::process::id()),
            },
            config_errors: self.config_errors.clone(),
            health: self.health(),
            update,
            tls: self.tls.clone(),
        }
    }
}

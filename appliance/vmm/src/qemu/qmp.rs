//! QMP client on the [`qapi`] crate (typed commands generated from QEMU's schema, tokio 1).
//!
//! One short-lived connection per operation: QEMU's QMP socket serves one client at a time,
//! and reconnecting per call makes re-attaching after our own restart trivial.

use std::path::{Path, PathBuf};
use std::time::Duration;

use qapi::futures::{QapiService, QmpStreamTokio};
use qapi::qmp;
use tokio::io::WriteHalf;
use tokio::net::UnixStream;

/// Errors talking QMP.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Connecting or negotiating capabilities failed.
    #[error("connecting to QMP at {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU answered a command with an error.
    #[error("QMP {command}: {message}")]
    Command {
        /// The command.
        command: &'static str,
        /// QEMU's error description.
        message: String,
    },
    /// The connection broke during a command.
    #[error("QMP {command}: connection")]
    Io {
        /// The command.
        command: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("QMP {0}: timed out")]
    Timeout(&'static str),
}

type Service = QapiService<QmpStreamTokio<WriteHalf<UnixStream>>>;

/// A negotiated QMP connection.
pub struct Qmp {
    svc: Service,
    task: tokio::task::JoinHandle<()>,
}

/// Per-command timeout.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Qmp {
    /// Connects and negotiates capabilities, within `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let connect = async {
            let s = QmpStreamTokio::open_uds(path).await?;
            let s = s.negotiate().await?;
            Ok::<_, std::io::Error>(s.spawn_tokio())
        };
        let (svc, task) = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| QmpError::Connect { path: path.to_path_buf(), source: std::io::ErrorKind::TimedOut.into() })?
            .map_err(|source| QmpError::Connect { path: path.to_path_buf(), source })?;
        Ok(Qmp { svc, task })
    }

    async fn run<C>(&self, name: &'static str, c: C) -> Result<C::Ok, QmpError>
    where
        C: qapi::Command + qmp::QmpCommand,
    {
        match tokio::time::timeout(COMMAND_TIMEOUT, self.svc.execute(c)).await {
            Err(_) => Err(QmpError::Timeout(name)),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(qapi::ExecuteError::Qapi(e))) => Err(QmpError::Command { command: name, message: e.desc }),
            Ok(Err(qapi::ExecuteError::Io(source))) => Err(QmpError::Io { command: name, source }),
        }
    }

    /// `query-status`.
    pub async fn status(&self) -> Result<qmp::StatusInfo, QmpError> {
        self.run("query-status", qmp::query_status {}).await
    }

    /// `stop` (pause vCPUs).
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.run("stop", qmp::stop {}).await.map(drop)
    }

    /// `cont` (resume vCPUs).
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.run("cont", qmp::cont {}).await.map(drop)
    }

    /// `system_powerdown` (ACPI power button).
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.run("system_powerdown", qmp::system_powerdown {}).await.map(drop)
    }

    /// `quit`.
    pub async fn quit(&self) -> Result<(), QmpError> {
        self.run("quit", qmp::quit {}).await.map(drop)
    }

    /// `migrate-set-capabilities` for one capability.
    pub async fn set_capability(&self, cap: qmp::MigrationCapability, on: bool) -> Result<(), QmpError> {
        let c = qmp::migrate_set_capabilities {
            capabilities: vec![qmp::MigrationCapabilityStatus { capability: cap, state: on }],
        };
        self.run("migrate-set-capabilities", c).await.map(drop)
    }

    /// `migrate` to `uri` (returns at once; poll [`Qmp::migration`]).
    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        let c = qmp::migrate { uri: Some(uri.to_string()), channels: None, detach: None, resume: None };
        self.run("migrate", c).await.map(drop)
    }

    /// `migrate-incoming` from `uri` (QEMU started with `-incoming defer`).
    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        let c = qmp::migrate_incoming { uri: Some(uri.to_string()), channels: None, exit_on_error: None };
        self.run("migrate-incoming", c).await.map(drop)
    }

    /// `query-migrate`: `(status, error description)`.
    pub async fn migration(&self) -> Result<(Option<qmp::MigrationStatus>, Option<String>), QmpError> {
        let i = self.run("query-migrate", qmp::query_migrate {}).await?;
        Ok((i.status, i.error_desc))
    }
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

//! Where silkd listens: AF_VSOCK (production, cloud-hypervisor), the virtio-serial agent
//! mux (QEMU), and a Unix socket (host-side tests). Every accepted stream is served by the
//! same connection engine ([`crate::conn::serve`]). The vsock and mux listeners also serve
//! the control port ([`wire::CONTROL_PORT`], [`crate::control`]).
//!
//! Spec syntax (`--listen`, repeatable): `vsock:<port>`, `unix:<path>`, `mux:auto` (find
//! the virtio port named [`AGENT_PORT_NAME`]) or `mux:<device path>`.

use crate::agent::Agent;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

pub use agent_mux::AGENT_PORT_NAME;

/// silkd's port: `$SILKD_PORT`, default 2048 (on vsock, and inside the agent mux).
pub fn silkd_port() -> u32 {
    std::env::var("SILKD_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(wire::SILKD_PORT)
}

/// One listening endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Vsock(u32),
    Unix(PathBuf),
    /// `None` = find the port by name under `/sys/class/virtio-ports`.
    Mux(Option<PathBuf>),
}

pub use crate::error::ListenError;

impl FromStr for Listen {
    type Err = ListenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ListenError::BadSpec(s.to_string());
        let (scheme, rest) = s.split_once(':').ok_or_else(bad)?;
        match scheme {
            "vsock" => rest.parse().map(Listen::Vsock).map_err(|_| bad()),
            "unix" if !rest.is_empty() => Ok(Listen::Unix(PathBuf::from(rest))),
            "mux" if rest == "auto" => Ok(Listen::Mux(None)),
            "mux" if !rest.is_empty() => Ok(Listen::Mux(Some(PathBuf::from(rest)))),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Vsock(port) => write!(f, "vsock:{port}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
            Listen::Mux(None) => write!(f, "mux:auto"),
            Listen::Mux(Some(dev)) => write!(f, "mux:{}", dev.display()),
        }
    }
}

/// The guest defaults: vsock on `$SILKD_PORT` (2048) when `/dev/vsock` exists, and the
/// agent mux when its virtio port exists.
pub fn guest_defaults() -> Vec<Listen> {
    let mut out = Vec::new();
    if Path::new("/dev/vsock").exists() {
        out.push(Listen::Vsock(silkd_port()));
    }
    if agent_mux::port::find(AGENT_PORT_NAME).is_ok() {
        out.push(Listen::Mux(None));
    }
    out
}

/// Serves `listen` until it fails.
pub async fn run(listen: Listen, agent: Arc<Agent>) -> Result<(), ListenError> {
    match listen {
        Listen::Vsock(port) => {
            if port != wire::CONTROL_PORT {
                tokio::spawn(async {
                    if let Err(err) = run_vsock_control(wire::CONTROL_PORT).await {
                        tracing::error!(%err, "vsock control port unavailable");
                    }
                });
            }
            run_vsock(port, agent).await
        }
        Listen::Unix(path) => {
            let listener = bind_unix(&path)?;
            serve_unix(listener, agent).await
        }
        Listen::Mux(dev) => {
            let dev = match dev {
                Some(dev) => dev,
                None => agent_mux::port::find(AGENT_PORT_NAME).map_err(|_| ListenError::NoMuxPort)?,
            };
            crate::mux::serve(&dev, silkd_port(), agent).await
        }
    }
}

/// Binds a Unix socket, replacing a stale socket file.
pub fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, ListenError> {
    let _ = std::fs::remove_file(path);
    tokio::net::UnixListener::bind(path)
        .map_err(|source| ListenError::Bind { what: format!("unix:{}", path.display()), source })
}

/// Accepts connections on a bound Unix listener forever.
pub async fn serve_unix(listener: tokio::net::UnixListener, agent: Arc<Agent>) -> Result<(), ListenError> {
    tracing::info!(addr = ?listener.local_addr().ok(), "listening on unix socket");
    loop {
        let (stream, _) =
            listener.accept().await.map_err(|source| ListenError::Accept { what: "unix".into(), source })?;
        let agent = Arc::clone(&agent);
        tokio::spawn(async move {
            let _ = crate::conn::serve(stream, agent, "unix").await;
        });
    }
}

async fn run_vsock(port: u32, agent: Arc<Agent>) -> Result<(), ListenError> {
    use tokio_vsock::{VsockAddr, VsockListener, VMADDR_CID_ANY};
    let what = format!("vsock:{port}");
    let listener = VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, port))
        .map_err(|source| ListenError::Bind { what: what.clone(), source })?;
    tracing::info!(port, "listening on vsock");
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tracing::debug!(cid = peer.cid(), "vsock connection");
                let agent = Arc::clone(&agent);
                tokio::spawn(async move {
                    let _ = crate::conn::serve(stream, agent, "vsock").await;
                });
            }
            // A failed accept (e.g. EMFILE) must not end the listener: back off and retry.
            Err(source) => {
                tracing::warn!(%source, "vsock accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves the control port on vsock forever (each stream: [`crate::control::handle`]).
async fn run_vsock_control(port: u32) -> Result<(), ListenError> {
    use tokio_vsock::{VsockAddr, VsockListener, VMADDR_CID_ANY};
    let listener = VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, port))
        .map_err(|source| ListenError::Bind { what: format!("vsock:{port} (control)"), source })?;
    tracing::info!(port, "control port listening on vsock");
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tracing::debug!(cid = peer.cid(), "vsock control connection");
                tokio::spawn(crate::control::handle(stream, "vsock"));
            }
            Err(source) => {
                tracing::warn!(%source, "vsock control accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print() {
        for s in ["vsock:2048", "unix:/tmp/x.sock", "mux:auto", "mux:/dev/vport1p1"] {
            let l: Listen = s.parse().expect("valid spec");
            assert_eq!(l.to_string(), s);
        }
        assert!("vsock:x".parse::<Listen>().is_err());
        assert!("tcp:1".parse::<Listen>().is_err());
        assert!("unix:".parse::<Listen>().is_err());
    }
}

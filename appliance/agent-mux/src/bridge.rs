//! Host-side hybrid-vsock bridge: a Unix socket (`<vmdir>/vsock.sock`) that accepts
//! cloud-hypervisor's `CONNECT <port>\n` convention and splices each connection into a mux
//! stream to the guest, so QEMU and cloud-hypervisor VMs are dialled the same way.
//!
//! The mux session to QEMU's chardev socket is made lazily on the first client and remade when
//! it ended (guest reboot, restore). Half-close is forwarded both ways; buffering is bounded by
//! the splice buffers and the mux flow-control windows.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::connect_line;
use crate::host::{Session, SessionError};

/// Time a client has to send its `CONNECT` line.
pub const CLIENT_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors starting the bridge.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// Binding the listening socket failed.
    #[error("binding {0}")]
    Bind(PathBuf, #[source] std::io::Error),
}

/// A running bridge; stops (and removes its socket) when dropped.
#[derive(Debug)]
pub struct Bridge {
    listen: PathBuf,
    task: JoinHandle<()>,
}

struct Shared {
    chardev: PathBuf,
    hello_timeout: Duration,
    session: Mutex<Option<Session>>,
}

impl Bridge {
    /// Binds `listen` (replacing a stale socket file) and serves it, bridging to the QEMU
    /// chardev socket at `chardev`. Must run inside a tokio runtime.
    pub fn spawn(listen: &Path, chardev: &Path, hello_timeout: Duration) -> Result<Bridge, BridgeError> {
        let _ = std::fs::remove_file(listen);
        let l = UnixListener::bind(listen).map_err(|e| BridgeError::Bind(listen.to_path_buf(), e))?;
        let shared = Arc::new(Shared { chardev: chardev.to_path_buf(), hello_timeout, session: Mutex::new(None) });
        let span = tracing::info_span!("vsock_bridge", listen = %listen.display());
        let task = tokio::spawn(tracing::Instrument::instrument(accept_loop(l, shared), span));
        Ok(Bridge { listen: listen.to_path_buf(), task })
    }

    /// The listening socket.
    pub fn path(&self) -> &Path {
        &self.listen
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.listen);
    }
}

async fn accept_loop(l: UnixListener, shared: Arc<Shared>) {
    let mut clients = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            r = l.accept() => match r {
                Ok((s, _)) => {
                    clients.spawn(client(s, shared.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    }
}

async fn session(shared: &Shared) -> Result<Session, SessionError> {
    let mut g = shared.session.lock().await;
    if let Some(s) = g.as_ref().filter(|s| !s.is_closed()) {
        return Ok(s.clone());
    }
    // Drop the dead session first: QEMU serves one chardev client at a time.
    *g = None;
    let s = Session::connect_with_timeout(&shared.chardev, shared.hello_timeout).await?;
    *g = Some(s.clone());
    Ok(s)
}

async fn client(mut c: UnixStream, shared: Arc<Shared>) {
    let port = match tokio::time::timeout(CLIENT_LINE_TIMEOUT, connect_line::read_line(&mut c)).await {
        Ok(Ok(line)) => match connect_line::parse_connect(&line) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "bad client line");
                return;
            }
        },
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "bad client line");
            return;
        }
        Err(_) => return,
    };
    let mut tries = 0;
    let mut m = loop {
        tries += 1;
        let r = match session(&shared).await {
            Ok(s) => s.open(port).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(m) => break m,
            Err(SessionError::Refused(p)) => {
                tracing::debug!(port = p, "guest refused port");
                return;
            }
            Err(e) if tries < 2 && matches!(e, SessionError::Closed | SessionError::Open(_)) => {
                tracing::debug!(error = %e, "mux session gone; reconnecting");
                let mut g = shared.session.lock().await;
                if g.as_ref().is_some_and(|s| s.is_closed()) {
                    *g = None;
                }
            }
            Err(e) => {
                tracing::warn!(port, error = %e, "bridging to guest failed");
                return;
            }
        }
    };
    if c.write_all(connect_line::ok(port).as_bytes()).await.is_err() {
        return;
    }
    if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut m).await {
        tracing::debug!(port, error = %e, "bridged stream ended with an error");
    }
}

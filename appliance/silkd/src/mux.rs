//! The virtio-serial agent mux, guest end: every mux stream the host opens starts with
//! `CONNECT <port>\n`; streams for silkd's port are served by the connection engine.
//!
//! ADAPTER PENDING: the `agent-mux` crate's guest API is being written in parallel. Until
//! it lands, [`serve`] reports [`ListenError::Mux`] so the other listeners keep running and
//! the console says why. Wiring it is: open the session on `dev` with
//! `agent_mux::guest`, and for each `(port, stream)` it yields with `port ==
//! $SILKD_PORT`, `tokio::spawn(crate::conn::serve(stream, agent, "mux"))`; re-open the
//! session whenever the host side disconnects.

use crate::agent::Agent;
use crate::listen::ListenError;
use std::path::Path;
use std::sync::Arc;

/// Serves silkd's port over the agent mux on `dev`.
pub async fn serve(dev: &Path, agent: Arc<Agent>) -> Result<(), ListenError> {
    let _ = agent;
    Err(ListenError::Mux(dev.to_path_buf(), "the agent-mux guest API is not wired into silkd yet".into()))
}

//! The virtio-serial agent mux, guest end (QEMU): `agent_mux::guest::run` serves mux
//! sessions on the port device and reconnects whenever the host side goes away; every mux
//! stream opens with `CONNECT <port>\n`, and streams for silkd's port (`$SILKD_PORT`, 2048)
//! are served by the same connection engine as vsock; streams for the control port
//! ([`wire::CONTROL_PORT`]) by [`crate::control`]. Other ports are refused (the mux closes
//! the stream). When a mux session ends its stream tasks are aborted, which drops
//! the engine: foreground ops see the client gone; sessions and detached processes live on.

use crate::agent::Agent;
use crate::error::ListenError;
use agent_mux::guest::{Handler, HandlerFuture};
use agent_mux::port::PortDevice;
use agent_mux::MuxStream;
use std::path::Path;
use std::sync::Arc;

struct SilkdPort {
    agent: Arc<Agent>,
    port: u32,
}

impl Handler for SilkdPort {
    fn accepts(&self, port: u32) -> bool {
        port == self.port || port == wire::CONTROL_PORT
    }

    fn handle(&self, port: u32, stream: MuxStream) -> HandlerFuture {
        if port == wire::CONTROL_PORT && port != self.port {
            return Box::pin(crate::control::handle(stream, "mux"));
        }
        let agent = Arc::clone(&self.agent);
        Box::pin(async move {
            let _ = crate::conn::serve(stream, agent, "mux").await;
        })
    }
}

/// The mux handler serving silkd's `port` and the control port (also for host-side tests
/// over a socket pair).
pub fn handler(agent: Arc<Agent>, port: u32) -> Arc<dyn Handler> {
    Arc::new(SilkdPort { agent, port })
}

/// Serves silkd's port over the agent mux on `dev`, forever.
pub async fn serve(dev: &Path, port: u32, agent: Arc<Agent>) -> Result<(), ListenError> {
    let device = PortDevice::open(dev).map_err(|e| ListenError::Mux(dev.to_path_buf(), e.to_string()))?;
    tracing::info!(dev = %dev.display(), port, "serving the agent mux");
    agent_mux::guest::run(device, handler(agent, port))
        .await
        .map_err(|e| ListenError::Mux(dev.to_path_buf(), e.to_string()))
}

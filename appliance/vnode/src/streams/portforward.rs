//! `/portForward/{ns}/{pod}`: WebSocket with the subprotocol `SPDY/3.1+portforward.k8s.io`,
//! whose binary messages carry SPDY/3.1 as one byte stream (message boundaries mean nothing;
//! client side: client-go's `tools/portforward/tunneling_connection.go`). The stream is served
//! by `kstream::portforward`, each requested port dialled through the Pod's agent.

use super::checks::{running_pod, RouteError};
use super::upgrade::{accept, Upgrade};
use super::Streaming;
use crate::provider::PodKey;
use axum::extract::ws::{Message, WebSocket};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::{SinkExt as _, StreamExt as _};
use kstream::portforward::{serve, Limits};
use silkd_client::port_stream;
use silkd_client::AgentConn;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

/// The one subprotocol of port-forward over WebSocket.
pub(super) const PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// The bytes in flight between the WebSocket and the SPDY session, each way.
const BRIDGE_BUFFER: usize = 64 * 1024;

pub(super) async fn port_forward(
    State(s): State<Streaming>,
    Path((ns, pod)): Path<(String, String)>,
    headers: HeaderMap,
    ws: Upgrade,
) -> Result<Response, RouteError> {
    let key = PodKey::new(ns, pod);
    running_pod(&s, &key)?;
    let offers = |o: &str| o.split(',').map(str::trim).any(|p| p == PROTOCOL).then_some(());
    // The slot first, as in exec: kubectl's SPDY fallback after a 429 is answered 429 too.
    let guard = s.sessions.open(&key)?;
    let (ws, ()) = accept(ws, &headers, "portForward", PROTOCOL, offers, |()| PROTOCOL, s.sessions.limits())?;
    let streams = s.streams.clone();
    Ok(ws.on_upgrade(move |socket| async move {
        let _guard = guard;
        let (spdy, theirs) = tokio::io::duplex(BRIDGE_BUFFER);
        let dial = move |port: u16| {
            let (streams, key) = (streams.clone(), key.clone());
            async move {
                let io = streams.dial_agent(&key).await.map_err(|e| e.to_string())?;
                port_stream(AgentConn::new(io), port)
                    .await
                    .map_err(|e| format!("port {port} of pod {key}: {}", foundation::error_chain(&e)))
            }
        };
        tokio::select! {
            () = bridge(socket, theirs) => {}
            served = serve(spdy, Limits::default(), dial) => if let Err(e) = served {
                tracing::debug!(error = %foundation::error_chain(&e), "port-forward session ended");
            },
        }
    }))
}

/// Copies the WebSocket's binary messages into `io` and `io`'s bytes out as binary messages,
/// until either side ends.
async fn bridge(socket: WebSocket, io: DuplexStream) {
    let (mut tx, mut rx) = socket.split();
    let (mut rd, mut wr) = tokio::io::split(io);
    let inbound = async {
        while let Some(Ok(msg)) = rx.next().await {
            match msg {
                Message::Binary(data) => {
                    if wr.write_all(&data).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                Message::Text(_) | Message::Ping(_) | Message::Pong(_) => {}
            }
        }
        let _ = wr.shutdown().await;
    };
    let outbound = async {
        let mut buf = vec![0u8; BRIDGE_BUFFER];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(Message::Binary(bytes::Bytes::copy_from_slice(&buf[..n]))).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = tx.close().await;
    };
    tokio::select! {
        () = inbound => {}
        () = outbound => {}
    }
}

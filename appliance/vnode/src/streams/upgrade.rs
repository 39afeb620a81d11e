//! The WebSocket handshake of the streaming routes: a request that is no upgrade (a SPDY
//! client) or offers no subprotocol we speak is answered 400 naming what we speak; the chosen
//! subprotocol is echoed; the client's messages are capped ([`StreamLimits::max_message`]).

use super::checks::RouteError;
use super::sessions::StreamLimits;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::http::header::SEC_WEBSOCKET_PROTOCOL;
use axum::http::{HeaderMap, HeaderValue};

/// The least write buffer cap (above tungstenite's 128 KiB write buffer, which it must exceed).
const MIN_WRITE_BUFFER: usize = 1 << 20;

/// The upgrade extractor as a handler takes it (a refusal is ours to word).
pub(super) type Upgrade = Result<WebSocketUpgrade, WebSocketUpgradeRejection>;

/// Every `Sec-WebSocket-Protocol` value the client offered, comma-joined.
fn offered(headers: &HeaderMap) -> String {
    let values: Vec<&str> = headers.get_all(SEC_WEBSOCKET_PROTOCOL).iter().filter_map(|v| v.to_str().ok()).collect();
    values.join(",")
}

/// `ws` with the subprotocol `choose` picks among the offered ones (`name` spells it; `speaks`
/// names all we speak, for a refusal) and the caps of `limits`.
pub(super) fn accept<P: Copy>(
    ws: Upgrade,
    headers: &HeaderMap,
    route: &'static str,
    speaks: &'static str,
    choose: impl FnOnce(&str) -> Option<P>,
    name: impl FnOnce(P) -> &'static str,
    limits: StreamLimits,
) -> Result<(WebSocketUpgrade, P), RouteError> {
    let ws = ws.map_err(|_| RouteError::NotWebSocket { route, speaks })?;
    let offered = offered(headers);
    let chosen = choose(&offered).ok_or(RouteError::NoSubprotocol { offered, speaks })?;
    let mut ws = ws
        .max_message_size(limits.max_message)
        .max_frame_size(limits.max_message)
        .max_write_buffer_size(limits.max_message.saturating_mul(4).max(MIN_WRITE_BUFFER));
    ws.set_selected_protocol(HeaderValue::from_static(name(chosen)));
    Ok((ws, chosen))
}

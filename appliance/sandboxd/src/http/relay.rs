//! Upgrade relays (`docs/sandboxd.md` §6, §7): `GET …/agent` (`Upgrade: silkd`, a raw splice to silkd) and
//! `GET …/ports/{port}` (`Upgrade: tcp`, raw bytes ↔ silkd `port_forward` frames).
//!
//! Rules kept here:
//! - the guest is dialled before the `101`; unreachable → `502` (with `Content-Length`);
//! - the `101` is exactly `HTTP/1.1 101 Switching Protocols\r\nUpgrade: silkd\r\nConnection: Upgrade\r\n\r\n`
//!   (the server writes title-case headers and no `Date`);
//! - bytes the client pipelined behind the request head are forwarded first: hyper hands them
//!   over inside the `Upgraded` stream, ahead of anything read later;
//! - half-close: guest EOF shuts the client's write side, then the client has the drain
//!   window to finish; client EOF shuts the guest's write side (`data_end` for ports);
//! - nothing is ever written to an idle relay except guest bytes;
//! - a claim has at most `max_agent_relays_per_claim` / `max_port_relays_per_claim` relays open
//!   (`429` past it); the slot is held by the relay task and freed when the relay ends;
//! - a relay that moves no byte either way for `relay_idle_timeout_secs` is closed (bytes in
//!   either direction reset the clock, so a busy guest or client keeps it open).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tracing::Instrument as _;
use vmm::{AgentStream, AGENT_PORT};
use wire::codec::{decode_response, encode_request, FrameSplitter};
use wire::{Bytes64, ErrorKind, Request as Frame, Response as Reply};

use super::auth;
use super::error::ApiError;
use crate::metrics::inc;
use crate::node::Node;
use crate::slots::{Activity, SlotGuard, Use};

/// Largest raw chunk turned into one `data` frame.
const PORT_CHUNK: usize = 256 * 1024;

fn wants_upgrade(headers: &HeaderMap, proto: &str) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|p| p.trim().eq_ignore_ascii_case(proto)))
}

fn switching(proto: &'static str) -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    r.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(proto));
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    r
}

/// A reader that records activity on every byte it yields.
struct Touch<R> {
    inner: R,
    activity: Arc<Activity>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Touch<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

/// Runs `relay` until it ends or goes idle for `idle`; counts and logs an idle close.
async fn until_idle(node: &Node, activity: &Activity, relay: impl std::future::Future<Output = ()>) {
    let idle = node.limits().http.relay_idle;
    tokio::select! {
        () = relay => {}
        () = activity.idle(idle) => {
            inc(&node.metrics.relays_idle_closed);
            tracing::info!(idle_secs = idle.as_secs_f64(), "relay idle; closing it (relay_idle_timeout_secs)");
        }
    }
}

/// Authenticates, takes a per-claim slot and dials silkd in the sandbox's VM.
async fn dial(node: &Node, headers: &HeaderMap, id: &str, use_: Use) -> Result<(AgentStream, SlotGuard), ApiError> {
    let claim = auth::sandbox_route(node, headers, id)?;
    let slot = node.acquire_slot(id, use_).inspect_err(|_| {
        inc(match use_ {
            Use::Agent => &node.metrics.agent_relays_refused,
            Use::Port => &node.metrics.port_relays_refused,
            Use::Exec => &node.metrics.execs_refused,
        })
    })?;
    // A guest call wakes a hibernated sandbox (the relay routes are reached only with the
    // upgrade header; a plain request never gets here).
    let vm = node.vm_waking(&claim).await?;
    let stream = node
        .driver()
        .connect(&vm, AGENT_PORT)
        .await
        .map_err(|e| ApiError::BadGateway(format!("sandbox unreachable: {}", vmm::error_chain(&e))))?;
    Ok((stream, slot))
}

pub(super) async fn agent(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    mut req: Request,
) -> Result<Response, ApiError> {
    if !wants_upgrade(req.headers(), "silkd") {
        return Err(ApiError::UpgradeRequired("silkd"));
    }
    let (guest, slot) = dial(&node, req.headers(), &id, Use::Agent).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let drain = node.timing.relay_drain;
    inc(&node.metrics.agent_relays);
    let span = tracing::info_span!("agent_relay", claim = %id);
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(up) => {
                    let activity = slot.activity();
                    until_idle(&node, &activity, splice(TokioIo::new(up), guest, drain, &activity)).await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade did not complete"),
            }
            drop(slot);
        }
        .instrument(span),
    );
    Ok(switching("silkd"))
}

/// Runs both directions of a relay to their ends: after the guest→client side ends cleanly the
/// client has `drain` to finish its side; after the client→guest side ends cleanly we wait for
/// the guest. An error on either side ends both (the streams are dropped by the caller).
async fn join_halves<U, D, A, B, E>(up: U, down: D, drain: Duration)
where
    U: std::future::Future<Output = Result<A, E>>,
    D: std::future::Future<Output = Result<B, E>>,
{
    tokio::pin!(up, down);
    tokio::select! {
        r = &mut down => {
            if r.is_ok() && tokio::time::timeout(drain, &mut up).await.is_err() {
                tracing::debug!("client did not finish within the drain window");
            }
        }
        r = &mut up => {
            if r.is_ok() {
                let _ = (&mut down).await;
            }
        }
    }
}

/// Copies both ways with half-close; a copy error closes both sides. Every byte read from
/// either side touches `activity`.
pub(crate) async fn splice<C, G>(client: C, guest: G, drain: Duration, activity: &Arc<Activity>)
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    let (cr, mut cw) = tokio::io::split(client);
    let (gr, mut gw) = tokio::io::split(guest);
    let mut cr = Touch { inner: cr, activity: Arc::clone(activity) };
    let mut gr = Touch { inner: gr, activity: Arc::clone(activity) };
    let up = async {
        let r = tokio::io::copy(&mut cr, &mut gw).await;
        if r.is_ok() {
            let _ = gw.shutdown().await;
        }
        r
    };
    let down = async {
        let r = tokio::io::copy(&mut gr, &mut cw).await;
        if r.is_ok() {
            let _ = cw.shutdown().await;
        }
        r
    };
    join_halves(up, down, drain).await;
}

pub(super) async fn ports(
    State(node): State<Arc<Node>>,
    Path((id, port)): Path<(String, String)>,
    mut req: Request,
) -> Result<Response, ApiError> {
    if !wants_upgrade(req.headers(), "tcp") {
        return Err(ApiError::UpgradeRequired("tcp"));
    }
    auth::sandbox_route(&node, req.headers(), &id)?;
    let port: u16 = match port.parse::<u32>() {
        Ok(p @ 1..=65535) => u16::try_from(p).map_err(|_| ApiError::BadRequest(format!("invalid port {p}")))?,
        _ => return Err(ApiError::BadRequest(format!("invalid port {port:?} (want 1-65535)"))),
    };
    let (mut guest, slot) = dial(&node, req.headers(), &id, Use::Port).await?;
    let mut split = FrameSplitter::new();
    open_port(&mut guest, &mut split, port).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let drain = node.timing.relay_drain;
    inc(&node.metrics.port_relays);
    let span = tracing::info_span!("port_relay", claim = %id, port);
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(up) => {
                    let activity = slot.activity();
                    until_idle(&node, &activity, port_splice(TokioIo::new(up), guest, split, drain, &activity)).await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade did not complete"),
            }
            drop(slot);
        }
        .instrument(span),
    );
    Ok(switching("tcp"))
}

async fn read_reply<R: AsyncRead + Unpin>(
    r: &mut R,
    split: &mut FrameSplitter,
    buf: &mut [u8],
) -> std::io::Result<Option<Reply>> {
    loop {
        if let Some(f) = split.next_frame() {
            let line = f.map_err(std::io::Error::other)?;
            return decode_response(&line).map(Some).map_err(std::io::Error::other);
        }
        let n = r.read(buf).await?;
        if n == 0 {
            return Ok(None);
        }
        split.push(&buf[..n]);
    }
}

async fn open_port(guest: &mut AgentStream, split: &mut FrameSplitter, port: u16) -> Result<(), ApiError> {
    let gone = |e: String| ApiError::BadGateway(format!("guest port {port}: {e}"));
    let req = encode_request(&Frame::PortForward { port }).map_err(|e| gone(e.to_string()))?;
    guest.write_all(&req).await.map_err(|e| gone(e.to_string()))?;
    let mut buf = vec![0u8; 16 * 1024];
    match read_reply(guest, split, &mut buf).await {
        Ok(Some(Reply::Ready)) => Ok(()),
        Ok(Some(Reply::Error { kind: ErrorKind::NotFound, message })) => Err(gone(format!("no listener ({message})"))),
        Ok(Some(Reply::Error { kind: ErrorKind::BadRequest, message })) => Err(ApiError::BadRequest(message)),
        Ok(Some(other)) => Err(gone(format!("unexpected {} frame", other.type_name()))),
        Ok(None) => Err(gone("agent closed the connection".into())),
        Err(e) => Err(gone(e.to_string())),
    }
}

/// Raw client bytes ↔ `data` frames; client EOF → `data_end`; guest `done` → client EOF.
async fn port_splice<C>(
    client: C,
    guest: AgentStream,
    mut split: FrameSplitter,
    drain: Duration,
    activity: &Arc<Activity>,
) where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let (cr, mut cw) = tokio::io::split(client);
    let (gr, mut gw) = tokio::io::split(guest);
    let mut cr = Touch { inner: cr, activity: Arc::clone(activity) };
    let mut gr = Touch { inner: gr, activity: Arc::clone(activity) };
    let up = async {
        let mut buf = vec![0u8; PORT_CHUNK];
        loop {
            let n = cr.read(&mut buf).await?;
            let frame = if n == 0 { Frame::DataEnd } else { Frame::Data { data: Bytes64(buf[..n].to_vec()) } };
            let bytes = encode_request(&frame).map_err(std::io::Error::other)?;
            gw.write_all(&bytes).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match read_reply(&mut gr, &mut split, &mut buf).await? {
                Some(Reply::Data { data }) => cw.write_all(&data.0).await?,
                Some(Reply::Done | Reply::Exit { .. }) => {
                    let _ = cw.shutdown().await;
                    return Ok::<(), std::io::Error>(());
                }
                Some(Reply::Error { message, .. }) => return Err(std::io::Error::other(message)),
                Some(_) => {}
                None => return Err(std::io::Error::other("agent closed the connection")),
            }
        }
    };
    join_halves(up, down, drain).await;
}

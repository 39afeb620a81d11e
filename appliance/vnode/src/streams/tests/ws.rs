use super::*;
use crate::streams::exec::ATTACH_OUTPUT_ONLY;
use crate::streams::portforward::PROTOCOL as PORT_FORWARD;
use futures::SinkExt as _;
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::WebSocketStream;

type Ws = WebSocketStream<tokio::net::TcpStream>;

/// A WebSocket upgrade of `path` offering `protocols`: the socket and the chosen subprotocol,
/// or the refusal's status and body.
async fn upgrade(addr: SocketAddr, path: &str, protocols: &str) -> Result<(Ws, String), (u16, String)> {
    let mut req = format!("ws://{addr}{path}").into_client_request().expect("request");
    req.headers_mut().insert("sec-websocket-protocol", protocols.parse().expect("header"));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    match tokio_tungstenite::client_async(req, tcp).await {
        Ok((ws, resp)) => {
            let chosen = resp.headers().get("sec-websocket-protocol").and_then(|v| v.to_str().ok()).unwrap_or("");
            Ok((ws, chosen.to_string()))
        }
        Err(tungstenite::Error::Http(resp)) => {
            let body = String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned();
            Err((resp.status().as_u16(), body))
        }
        Err(e) => panic!("upgrade of {path}: {e}"),
    }
}

/// The next binary message as (channel, text); `None` once the server closed.
async fn next(ws: &mut Ws) -> Option<(u8, String)> {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("a message in time");
        match msg {
            Some(Ok(Message::Binary(b))) => {
                let (ch, rest) = b.split_first().expect("a channel byte");
                return Some((*ch, String::from_utf8_lossy(rest).into_owned()));
            }
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return None,
            Some(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn exec_speaks_websocket_with_a_channel_protocol_only() {
    let srv = Server::start(pods(), FakeStreams::default(), StreamLimits::default()).await;
    let path = "/exec/ns/vm/main?command=ls&stdout=true";
    for method in ["GET", "POST"] {
        let (status, _, body) = request(srv.addr, method, path).await;
        assert_eq!(status, 400, "{method}: {body}");
        assert!(body.contains("WebSocket") && body.contains("v5.channel.k8s.io or v4.channel.k8s.io"), "{body}");
    }
    let (status, body) = upgrade(srv.addr, path, "v3.channel.k8s.io, channel.k8s.io").await.expect_err("refused");
    assert_eq!(status, 400);
    assert!(body.contains("no WebSocket subprotocol") && body.contains("v5.channel.k8s.io"), "{body}");
    for (offered, chosen) in [
        ("v4.channel.k8s.io", "v4.channel.k8s.io"),
        ("v4.channel.k8s.io, v5.channel.k8s.io", "v5.channel.k8s.io"),
        ("v5.channel.k8s.io,v4.channel.k8s.io,v3.channel.k8s.io", "v5.channel.k8s.io"),
    ] {
        let (_ws, got) = upgrade(srv.addr, path, offered).await.expect("upgraded");
        assert_eq!(got, chosen, "{offered}");
    }
    for (path, says) in [
        ("/exec/ns/vm/main?command=ls", "at least one of stdin, stdout and stderr"),
        ("/exec/ns/vm/main?stdout=1", "exec needs a command"),
        ("/exec/ns/booting/main?command=ls&stdout=1", "Pending, not Running"),
        ("/exec/ns/vm/nope?command=ls&stdout=1", "has no container"),
    ] {
        let (status, body) = upgrade(srv.addr, path, "v5.channel.k8s.io").await.expect_err("refused");
        assert!(status == 400 || status == 404, "{path}: {status}");
        assert!(body.contains(says), "{path}: {body}");
    }
}

#[tokio::test]
async fn exec_on_a_vm_that_does_not_answer_ends_with_an_error_status() {
    let srv = Server::start(pods(), FakeStreams::default(), StreamLimits::default()).await;
    let (mut ws, _) = upgrade(srv.addr, "/exec/ns/vm/main?command=ls&stdout=1", "v5.channel.k8s.io").await.expect("up");
    let (ch, status) = next(&mut ws).await.expect("the error channel");
    assert_eq!(ch, 3);
    let status: serde_json::Value = serde_json::from_str(&status).expect("a Status");
    assert_eq!(status["status"], "Failure");
    assert!(status["message"].as_str().unwrap_or_default().contains("does not answer"), "{status}");
    assert_eq!(next(&mut ws).await, None, "closed after the status");
}

#[tokio::test]
async fn attach_streams_the_live_console_and_ends_when_the_vm_goes() {
    let streams = FakeStreams::default();
    streams.logs.lock().expect("lock").push(vec!["login: "]);
    let srv = Server::start(pods(), streams, StreamLimits::default()).await;
    let (mut ws, _) = upgrade(srv.addr, "/attach/ns/vm/main?stdout=1&tty=1", "v5.channel.k8s.io").await.expect("up");
    assert_eq!(next(&mut ws).await, Some((1, "login: ".into())));
    let q = srv.streams.queries.lock().expect("lock")[0].clone();
    assert_eq!((q.follow, q.tail_lines), (true, Some(0)), "the live console, nothing before");
    let tx = srv.streams.held.lock().expect("lock").pop().expect("held");
    tx.send(Bytes::from_static(b"root\n")).await.expect("send");
    assert_eq!(next(&mut ws).await, Some((1, "root\n".into())));
    drop(tx);
    let (ch, status) = next(&mut ws).await.expect("the error channel");
    assert_eq!(ch, 3);
    assert!(status.contains("Failure") && status.contains("its VM is gone"), "{status}");
    assert_eq!(next(&mut ws).await, None);
}

#[tokio::test]
async fn attach_with_stdin_says_to_use_exec() {
    let srv = Server::start(pods(), FakeStreams::default(), StreamLimits::default()).await;
    let (mut ws, _) =
        upgrade(srv.addr, "/attach/ns/vm/main?stdin=1&stdout=1&tty=1", "v4.channel.k8s.io").await.expect("up");
    let (ch, status) = next(&mut ws).await.expect("the error channel");
    assert_eq!(ch, 3);
    assert!(status.contains(ATTACH_OUTPUT_ONLY), "{status}");
    assert!(srv.streams.queries.lock().expect("lock").is_empty(), "no console was opened");
}

#[tokio::test]
async fn a_message_over_the_cap_ends_the_session_and_frees_its_slot() {
    let limits = StreamLimits { per_pod: 1, max_message: 1024, ..StreamLimits::default() };
    let srv = Server::start(pods(), FakeStreams::default(), limits).await;
    let path = "/attach/ns/vm/main?stdout=1";
    let (mut ws, _) = upgrade(srv.addr, path, "v5.channel.k8s.io").await.expect("up");
    let (status, body) = upgrade(srv.addr, path, "v5.channel.k8s.io").await.expect_err("the one slot is taken");
    assert_eq!(status, 429, "{body}");
    // kubectl's SPDY fallback after the 429 (a POST, no WebSocket) is told the same.
    let (status, _, body) = request(srv.addr, "POST", "/exec/ns/vm/main?command=true&stdout=1").await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("already has 1 open streaming sessions"), "{body}");
    ws.send(Message::Binary(vec![0u8; 4096].into())).await.expect("sent");
    assert_eq!(next(&mut ws).await, None, "the server ended the session");
    let mut freed = false;
    for _ in 0..200 {
        if upgrade(srv.addr, path, "v5.channel.k8s.io").await.is_ok() {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(freed, "the slot came back");
}

#[tokio::test]
async fn port_forward_is_spdy_tunnelled_in_websocket() {
    let srv = Server::start(pods(), FakeStreams::default(), StreamLimits::default()).await;
    let (status, _, body) = request(srv.addr, "POST", "/portForward/ns/vm").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains(PORT_FORWARD) && body.contains("does not serve SPDY"), "{body}");
    let (status, body) = upgrade(srv.addr, "/portForward/ns/vm", "v5.channel.k8s.io").await.expect_err("refused");
    assert_eq!(status, 400);
    assert!(body.contains(PORT_FORWARD), "{body}");
    assert_eq!(upgrade(srv.addr, "/portForward/ns/gone", PORT_FORWARD).await.expect_err("no pod").0, 404);
    let (_ws, chosen) = upgrade(srv.addr, "/portForward/ns/vm", PORT_FORWARD).await.expect("upgraded");
    assert_eq!(chosen, PORT_FORWARD);
}

/// An echo server on every agent connection (`port_stream` hands the connection's bytes to the
/// port: the stand-in until silkd-client's lands).
/// The real guest agent (silkd, served in-process) behind every `dial_agent`, and a TCP echo
/// server on the host for it to forward to; returns the echo server's port.
async fn silkd_agent(streams: &FakeStreams) -> u16 {
    let (tx, mut rx) = mpsc::unbounded_channel::<tokio::io::DuplexStream>();
    *streams.agent.lock().expect("lock") = Some(tx);
    let agent = silkd::Agent::new();
    tokio::spawn(async move {
        while let Some(conn) = rx.recv().await {
            tokio::spawn(silkd::conn::serve(conn, Arc::clone(&agent), "test"));
        }
    });
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = echo.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((conn, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    port
}

#[tokio::test]
async fn port_forward_serves_a_request_through_the_agent() {
    use bytes::BytesMut;
    use kstream::spdy::{Frame, FrameDecoder, FrameEncoder, Headers, Limits};
    use tokio_util::codec::{Decoder as _, Encoder as _};

    let streams = FakeStreams::default();
    let port = silkd_agent(&streams).await.to_string();
    let srv = Server::start(pods(), streams, StreamLimits::default()).await;
    let (mut ws, _) = upgrade(srv.addr, "/portForward/ns/vm", PORT_FORWARD).await.expect("upgraded");
    let mut enc = FrameEncoder::new().expect("encoder");
    let mut dec = FrameDecoder::new(&Limits::default());
    let open = |id: u32, kind: &str, fin: bool| {
        let mut headers = Headers::new();
        headers.insert("streamtype", kind);
        headers.insert("port", port.as_str());
        headers.insert("requestid", "0");
        Frame::SynStream { stream_id: id, associated_to: 0, priority: 0, slot: 0, fin, unidirectional: false, headers }
    };
    // The error stream (half-closed at once, as client-go does), the data stream, then bytes;
    // one WebSocket message carries them all: boundaries mean nothing.
    let mut out = BytesMut::new();
    for frame in [open(1, "error", true), open(3, "data", false)] {
        enc.encode(frame, &mut out).expect("encode");
    }
    enc.encode(Frame::Data { stream_id: 3, fin: false, data: Bytes::from_static(b"ping") }, &mut out).expect("encode");
    ws.send(Message::Binary(out.freeze())).await.expect("send");
    let mut inbound = BytesMut::new();
    let echoed = loop {
        if let Some(frame) = dec.decode(&mut inbound).expect("a frame") {
            match frame {
                Frame::Data { stream_id: 3, data, .. } if !data.is_empty() => break data,
                Frame::RstStream { stream_id, status } => panic!("stream {stream_id} reset ({status})"),
                _ => continue,
            }
        }
        let msg = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("in time");
        match msg {
            Some(Ok(Message::Binary(b))) => inbound.extend_from_slice(&b),
            Some(Ok(_)) => {}
            other => panic!("the tunnel ended: {other:?}"),
        }
    };
    assert_eq!(&echoed[..], b"ping");
}

#[tokio::test]
async fn exec_runs_in_the_guest_agent_with_stdin_and_reports_the_exit_code() {
    let streams = FakeStreams::default();
    silkd_agent(&streams).await;
    let srv = Server::start(pods(), streams, StreamLimits::default()).await;
    let path = "/exec/ns/vm/main?command=sh&command=-c&command=cat%3B%20echo%20err%20%3E%262%3B%20exit%203&stdin=1&stdout=1&stderr=1";
    let (mut ws, _) = upgrade(srv.addr, path, "v5.channel.k8s.io").await.expect("up");
    ws.send(Message::Binary(kstream::channel::frame(0, b"hello\n").into())).await.expect("stdin");
    ws.send(Message::Binary(vec![255, 0].into())).await.expect("stdin closed");
    let mut stdout = String::new();
    let mut stderr = String::new();
    let status = loop {
        match next(&mut ws).await.expect("a message before the status") {
            (1, d) => stdout.push_str(&d),
            (2, d) => stderr.push_str(&d),
            (3, s) => break s,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!((stdout.as_str(), stderr.as_str()), ("hello\n", "err\n"));
    let status: serde_json::Value = serde_json::from_str(&status).expect("a Status");
    assert_eq!(status["reason"], "NonZeroExitCode", "{status}");
    assert_eq!(status["details"]["causes"][0]["message"], "3", "{status}");
}

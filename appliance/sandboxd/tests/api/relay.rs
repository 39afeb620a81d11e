//! Relays over a real loopback socket: `/agent` (pipelined bytes, exact 101, half-close,
//! no unsolicited bytes) and `/ports` (byte ↔ frame translation).

use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{start, wait_warm, H};

pub(super) const SWITCHING: &[u8] =
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: silkd\r\nConnection: Upgrade\r\n\r\n";

pub(super) async fn serve(h: &H) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(sandboxd::http::serve(l, h.node.clone(), None, std::future::pending()));
    addr
}

async fn claimed(pools: &[(&str, usize)]) -> (H, std::net::SocketAddr, String, String) {
    let h = start(pools, None).await;
    wait_warm(&h.node, "base", 1).await;
    let c = h.claim(json!({"template": "base"})).await;
    let addr = serve(&h).await;
    let (id, token) = (c["id"].as_str().expect("id").to_string(), c["token"].as_str().expect("token").to_string());
    (h, addr, id, token)
}

pub(super) fn head(path: &str, upgrade: Option<&str>, token: &str) -> String {
    let mut s = format!("GET {path} HTTP/1.1\r\nHost: x\r\n");
    if let Some(u) = upgrade {
        s.push_str(&format!("Connection: Upgrade\r\nUpgrade: {u}\r\n"));
    }
    s.push_str(&format!("Authorization: Bearer {token}\r\n\r\n"));
    s
}

/// Reads a non-101 reply: status, and the JSON body read by Content-Length (as the SDK does).
pub(super) async fn read_error<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> (u16, Value) {
    let mut line = String::new();
    r.read_line(&mut line).await.expect("status");
    let code: u16 = line.split(' ').nth(1).expect("code").parse().expect("num");
    let mut len = None;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).await.expect("header");
        if h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = Some(v.trim().parse::<usize>().expect("len"));
            }
        }
    }
    let len = len.expect("non-101 replies carry Content-Length");
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.expect("body");
    (code, serde_json::from_slice(&body).expect("json body"))
}

pub(super) async fn frame<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> Value {
    let mut line = String::new();
    tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut line)).await.expect("frame in time").expect("read");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad frame {line:?}: {e}"))
}

#[tokio::test]
async fn agent_relay_forwards_pipelined_bytes_and_half_closes() {
    let (_h, addr, id, token) = claimed(&[("base", 1)]).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    // Like the SDK on plain HTTP: head + info + first op in one write, before reading the 101.
    let mut req = head(&format!("/v1/sandboxes/{id}/agent"), Some("silkd"), &token).into_bytes();
    req.extend_from_slice(b"{\"v\":1,\"op\":\"info\"}\n{\"v\":1,\"op\":\"exec\",\"argv\":[\"echo\",\"piped\"]}\n{\"v\":1,\"op\":\"stdin_close\"}\n");
    s.write_all(&req).await.expect("write");
    let mut got = vec![0u8; SWITCHING.len()];
    s.read_exact(&mut got).await.expect("101");
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(SWITCHING));
    let mut r = BufReader::new(s);
    assert_eq!(frame(&mut r).await["type"], "info");
    assert_eq!(frame(&mut r).await["type"], "started");
    let out = frame(&mut r).await;
    assert_eq!(out, json!({"type": "stdout", "data": "cGlwZWQK"}));
    assert_eq!(frame(&mut r).await, json!({"type": "exit", "code": 0}));
    // Proto 2: the next RPC on the same connection.
    r.get_mut().write_all(b"{\"v\":1,\"op\":\"info\"}\n").await.expect("write");
    assert_eq!(frame(&mut r).await["proto"], 2);
    // Idle relay: no unsolicited bytes.
    let mut b = [0u8; 1];
    assert!(tokio::time::timeout(Duration::from_millis(200), r.read(&mut b)).await.is_err(), "idle relay spoke");
    // Client half-close: the guest sees EOF, answers what it has, closes; we see EOF.
    r.get_mut().write_all(b"{\"v\":1,\"op\":\"info\"}\n").await.expect("write");
    r.get_mut().shutdown().await.expect("shutdown");
    assert_eq!(frame(&mut r).await["type"], "info");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut rest)).await.expect("eof in time").expect("read");
    assert!(rest.is_empty(), "{rest:?}");
}

#[tokio::test]
async fn agent_relay_refusals_carry_content_length() {
    let (h, addr, id, token) = claimed(&[("base", 1)]).await;
    let path = format!("/v1/sandboxes/{id}/agent");
    let cases = [
        (head(&path, None, &token), 426),
        (head(&path, Some("silkd"), "wrong"), 404),
        (head("/v1/sandboxes/sb_0000000000000000/agent", Some("silkd"), &token), 404),
    ];
    for (req, want) in cases {
        let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
        r.get_mut().write_all(req.as_bytes()).await.expect("write");
        let (code, body) = read_error(&mut r).await;
        assert_eq!(code, want, "{req}: {body}");
        assert!(body["error"].is_string());
    }
    h.driver.set_fail(|f| f.connect = true);
    let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    r.get_mut().write_all(head(&path, Some("silkd"), &token).as_bytes()).await.expect("write");
    let (code, body) = read_error(&mut r).await;
    assert_eq!(code, 502, "{body}");
    assert!(body["error"].as_str().expect("msg").starts_with("sandbox unreachable"));
}

#[tokio::test]
async fn ports_relay_translates_bytes_and_frames() {
    let (_h, addr, id, token) = claimed(&[("base", 1)]).await;
    // Port 7 echoes; our EOF becomes data_end, the guest's done becomes our EOF.
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(head(&format!("/v1/sandboxes/{id}/ports/7"), Some("tcp"), &token).as_bytes()).await.expect("write");
    let want = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: tcp\r\nConnection: Upgrade\r\n\r\n";
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).await.expect("101");
    assert_eq!(got, want);
    s.write_all(b"ping").await.expect("write");
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await.expect("echo");
    assert_eq!(&buf, b"ping");
    s.write_all(b"pong").await.expect("write");
    s.shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("eof").expect("read");
    assert_eq!(rest, b"pong");

    // Port 9 talks first and closes: we read it, then EOF.
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(head(&format!("/v1/sandboxes/{id}/ports/9"), Some("tcp"), &token).as_bytes()).await.expect("write");
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).await.expect("101");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("eof").expect("read");
    assert_eq!(rest, b"hello");

    for (path, upgrade, code) in [
        (format!("/v1/sandboxes/{id}/ports/8"), Some("tcp"), 502),
        (format!("/v1/sandboxes/{id}/ports/0"), Some("tcp"), 400),
        (format!("/v1/sandboxes/{id}/ports/70000"), Some("tcp"), 400),
        (format!("/v1/sandboxes/{id}/ports/7"), None, 426),
    ] {
        let mut r = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
        r.get_mut().write_all(head(&path, upgrade, &token).as_bytes()).await.expect("write");
        let (got, body) = read_error(&mut r).await;
        assert_eq!(got, code, "{path}: {body}");
    }
}

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::*;
use crate::spdy::test_client::Client;
use crate::spdy::Frame;

const ECHO_PORT: u16 = 8080;

/// A TCP echo server; each connection's end (EOF from us) is reported on the channel.
async fn echo_server() -> std::io::Result<(SocketAddr, mpsc::UnboundedReceiver<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (closed_tx, closed) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let closed_tx = closed_tx.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = closed_tx.send(());
            });
        }
    });
    Ok((addr, closed))
}

/// `serve` on one end of a duplex, dialling the echo server for [`ECHO_PORT`] only.
fn start(echo: SocketAddr, limits: Limits) -> (Client, tokio::task::JoinHandle<Result<(), PortForwardError>>) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let served = tokio::spawn(serve(server, limits, move |port| async move {
        if port != ECHO_PORT {
            return Err(format!("nothing listens on port {port}"));
        }
        TcpStream::connect(echo).await.map_err(|e| e.to_string())
    }));
    (Client::new(client), served)
}

/// Opens a request's error and data streams the way client-go does.
async fn open_pair(client: &mut Client, error: u32, request: &str, port: u16) -> Result<(), SpdyError> {
    let port = port.to_string();
    let mut headers = vec![("streamType", "error"), ("port", &port), ("requestID", request)];
    client.open(error, &headers).await?;
    client.expect_reply(error).await;
    client.data(error, b"", true).await?;
    headers[0].1 = "data";
    client.open(error + 2, &headers).await?;
    client.expect_reply(error + 2).await;
    Ok(())
}

async fn expect_echo(client: &mut Client, data: u32, bytes: &[u8]) -> Result<(), SpdyError> {
    client.data(data, bytes, false).await?;
    let mut got = Vec::new();
    while got.len() < bytes.len() {
        let (chunk, fin) = client.expect_data(data).await;
        assert!(!fin, "data stream ended early");
        got.extend_from_slice(&chunk);
    }
    assert_eq!(got, bytes);
    Ok(())
}

async fn closed(rx: &mut mpsc::UnboundedReceiver<()>) {
    let wait = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    assert!(matches!(wait, Ok(Some(()))), "dialled connection never closed");
}

#[tokio::test]
async fn two_requests_round_trip_and_a_dial_failure_is_reported() -> Result<(), SpdyError> {
    let (echo, mut echo_closed) = echo_server().await?;
    let (mut client, served) = start(echo, Limits::default());

    open_pair(&mut client, 1, "0", ECHO_PORT).await?;
    open_pair(&mut client, 5, "1", ECHO_PORT).await?;
    expect_echo(&mut client, 3, b"hello").await?;
    expect_echo(&mut client, 7, b"world").await?;
    let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
    expect_echo(&mut client, 7, &big).await?;

    // Request 0 ends as client-go ends it: FIN, our FIN back, RST, then the error stream ends.
    client.data(3, b"", true).await?;
    assert_eq!(client.read_to_fin(3).await, b"");
    client.send(Frame::RstStream { stream_id: 3, status: rst::CANCEL }).await?;
    assert_eq!(client.read_to_fin(1).await, b"");
    closed(&mut echo_closed).await;

    // A port nobody listens on: the message on the error stream, the data stream ended.
    open_pair(&mut client, 9, "2", 9999).await?;
    assert_eq!(client.read_to_fin(9).await, b"nothing listens on port 9999".to_vec());
    assert_eq!(client.read_to_fin(11).await, b"");

    // Request 1 is still open when the peer goes: its connection is closed, serve returns.
    drop(client);
    let result = tokio::time::timeout(Duration::from_secs(5), served).await;
    assert!(matches!(result, Ok(Ok(Ok(())))), "{result:?}");
    closed(&mut echo_closed).await;
    Ok(())
}

#[tokio::test]
async fn bad_streams_are_reset_and_lone_streams_time_out() -> Result<(), SpdyError> {
    let (echo, _echo_closed) = echo_server().await?;
    let limits = Limits { pair_timeout: Duration::from_millis(100), ..Limits::default() };
    let (mut client, _served) = start(echo, limits);
    client.open(1, &[("streamType", "data")]).await?;
    assert_eq!(client.expect_rst(1).await, rst::PROTOCOL_ERROR);
    client.open(3, &[("streamType", "other"), ("port", "80")]).await?;
    assert_eq!(client.expect_rst(3).await, rst::PROTOCOL_ERROR);
    client.open(5, &[("streamType", "error"), ("port", "0")]).await?;
    assert_eq!(client.expect_rst(5).await, rst::PROTOCOL_ERROR);

    // An error stream whose data stream never comes is told so.
    let port = ECHO_PORT.to_string();
    client.open(7, &[("streamType", "error"), ("port", &port), ("requestID", "7")]).await?;
    client.expect_reply(7).await;
    let message = client.read_to_fin(7).await;
    assert!(String::from_utf8_lossy(&message).contains("timed out"));
    Ok(())
}

#[tokio::test]
async fn requests_without_ids_pair_by_stream_id() -> Result<(), SpdyError> {
    let (echo, _echo_closed) = echo_server().await?;
    let (mut client, _served) = start(echo, Limits::default());
    let port = ECHO_PORT.to_string();
    client.open(1, &[("streamType", "error"), ("port", &port)]).await?;
    client.expect_reply(1).await;
    client.open(3, &[("streamType", "data"), ("port", &port)]).await?;
    client.expect_reply(3).await;
    expect_echo(&mut client, 3, b"legacy").await
}

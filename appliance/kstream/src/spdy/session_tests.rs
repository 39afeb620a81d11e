use std::time::Duration;

use tokio::io::DuplexStream;

use super::*;
use crate::spdy::test_client::Client;

/// A session on one end of a duplex; its accepted streams come out of the channel.
fn start(limits: Limits) -> (Client, mpsc::UnboundedReceiver<Result<Stream, SpdyError>>) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut session = Session::<DuplexStream>::new(server, limits)?;
        loop {
            match session.accept().await {
                Ok(Some(stream)) => {
                    let _ = tx.send(Ok(stream));
                }
                Ok(None) => return Ok::<_, SpdyError>(()),
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return Ok(());
                }
            }
        }
    });
    (Client::new(client), rx)
}

async fn accepted(rx: &mut mpsc::UnboundedReceiver<Result<Stream, SpdyError>>) -> Stream {
    match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
        Ok(Some(Ok(stream))) => stream,
        other => panic!("no stream accepted: {:?}", other.map(|o| o.map(|r| r.err()))),
    }
}

#[tokio::test]
async fn streams_carry_bytes_and_fin_both_ways() -> Result<(), SpdyError> {
    let (mut client, mut rx) = start(Limits::default());
    client.open(1, &[("streamtype", "data")]).await?;
    let stream = accepted(&mut rx).await;
    assert_eq!(stream.headers().get("streamtype"), Some("data"));
    stream.reply().await?;
    client.expect_reply(1).await;
    let (mut reader, writer) = stream.split();
    client.data(1, b"ping", true).await?;
    assert_eq!(reader.read().await?.as_deref(), Some(&b"ping"[..]));
    assert_eq!(reader.read().await?, None);
    writer.write(b"pong").await?;
    writer.close().await?;
    assert_eq!(client.expect_data(1).await, (Bytes::from_static(b"pong"), false));
    assert_eq!(client.expect_data(1).await, (Bytes::new(), true));
    Ok(())
}

#[tokio::test]
async fn pings_are_echoed_and_peer_resets_reach_the_reader() -> Result<(), SpdyError> {
    let (mut client, mut rx) = start(Limits::default());
    client.send(Frame::Ping { id: 7 }).await?;
    client.expect(|f| *f == Frame::Ping { id: 7 }).await;
    client.open(1, &[]).await?;
    let (mut reader, writer) = accepted(&mut rx).await.split();
    client.send(Frame::RstStream { stream_id: 1, status: rst::CANCEL }).await?;
    assert!(matches!(reader.read().await, Err(SpdyError::Reset(rst::CANCEL))));
    assert!(matches!(writer.write(b"x").await, Err(SpdyError::StreamGone)));
    Ok(())
}

#[tokio::test]
async fn dropping_an_unfinished_stream_resets_it() -> Result<(), SpdyError> {
    let (mut client, mut rx) = start(Limits::default());
    client.open(1, &[]).await?;
    drop(accepted(&mut rx).await);
    client.expect_rst(1).await;
    Ok(())
}

#[tokio::test]
async fn streams_over_the_cap_are_refused() -> Result<(), SpdyError> {
    let limits = Limits { max_streams: 1, ..Limits::default() };
    let (mut client, mut rx) = start(limits);
    client.open(1, &[]).await?;
    let _first = accepted(&mut rx).await;
    client.open(3, &[]).await?;
    assert_eq!(client.expect_rst(3).await, rst::REFUSED_STREAM);
    Ok(())
}

#[tokio::test]
async fn a_slow_reader_stops_the_session_at_its_budget() -> Result<(), SpdyError> {
    let limits = Limits { max_pending_bytes: 8, max_frame_size: 8, ..Limits::default() };
    let (mut client, mut rx) = start(limits);
    client.open(1, &[]).await?;
    let (mut reader, _writer) = accepted(&mut rx).await.split();
    client.data(1, b"12345678", false).await?;
    client.data(1, b"abcdefgh", false).await?;
    client.send(Frame::Ping { id: 1 }).await?;
    // The second frame waits for room, so the PING behind it is not read yet.
    assert!(client.try_expect(Duration::from_millis(200)).await.is_none());
    assert_eq!(reader.read().await?.as_deref(), Some(&b"12345678"[..]));
    client.expect(|f| *f == Frame::Ping { id: 1 }).await;
    assert_eq!(reader.read().await?.as_deref(), Some(&b"abcdefgh"[..]));
    Ok(())
}

#[tokio::test]
async fn bad_stream_ids_end_the_session() -> Result<(), SpdyError> {
    let (mut client, mut rx) = start(Limits::default());
    client.open(2, &[]).await?;
    assert!(matches!(rx.recv().await, Some(Err(SpdyError::Protocol(_)))));
    client.expect(|f| matches!(f, Frame::GoAway { status: goaway::PROTOCOL_ERROR, .. })).await;
    Ok(())
}

#[tokio::test]
async fn an_idle_session_goes_away() -> Result<(), SpdyError> {
    let limits = Limits { idle_timeout: Duration::from_millis(100), ..Limits::default() };
    let (mut client, mut rx) = start(limits);
    client.open(1, &[]).await?;
    let (mut reader, _writer) = accepted(&mut rx).await.split();
    client.expect(|f| matches!(f, Frame::GoAway { status: goaway::OK, .. })).await;
    assert!(matches!(reader.read().await, Err(SpdyError::SessionClosed)));
    Ok(())
}

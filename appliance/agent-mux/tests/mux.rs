//! Both ends of the mux over in-memory pipes: many streams, 10 MiB each way, half-close,
//! refused ports, bounded buffering, fresh sessions after the host reconnects.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use agent_mux::guest::{self, Handler, HandlerFuture, HostPort};
use agent_mux::host::{Session, SessionError};
use agent_mux::MuxStream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::mpsc;

const ECHO: u32 = 2048;
const COUNT: u32 = 3000;
const SINK: u32 = 3001;
const HOLD: u32 = 3002;

#[derive(Default)]
struct TestHandler {
    held_dropped: AtomicUsize,
}

struct DropCount(Arc<TestHandler>);
impl Drop for DropCount {
    fn drop(&mut self) {
        self.0.held_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

struct Shared(Arc<TestHandler>);

impl Handler for Shared {
    fn accepts(&self, port: u32) -> bool {
        matches!(port, ECHO | COUNT | SINK | HOLD)
    }
    fn handle(&self, port: u32, s: MuxStream) -> HandlerFuture {
        let me = self.0.clone();
        Box::pin(async move {
            match port {
                ECHO => {
                    let (mut r, mut w) = tokio::io::split(s);
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                    // Keep the stream until the host closes its side too.
                    let mut b = [0u8; 1];
                    let _ = r.read(&mut b).await;
                }
                COUNT => {
                    // Half-close: read to EOF, then still answer.
                    let mut s = s;
                    let mut n = 0usize;
                    let mut buf = vec![0u8; 65536];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => n += k,
                        }
                    }
                    let _ = s.write_all(format!("{n}\n").as_bytes()).await;
                    let _ = s.shutdown().await;
                }
                SINK | HOLD => {
                    // Never reads; only dropped when the session ends.
                    let _guard = DropCount(me);
                    let _s = s;
                    std::future::pending::<()>().await;
                }
                _ => {}
            }
        })
    }
}

/// A host port that is always connected (the guest never sees EOF: a stale session).
struct AlwaysUp(DuplexStream);
impl HostPort for AlwaysUp {
    async fn wait_host(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A host port where every wait_host takes the next host connection (the EOF path).
struct Reconnecting {
    cur: Option<DuplexStream>,
    next: mpsc::Receiver<DuplexStream>,
}
impl HostPort for Reconnecting {
    async fn wait_host(&mut self) -> std::io::Result<()> {
        self.cur = self.next.recv().await;
        self.cur.as_ref().map(|_| ()).ok_or(std::io::ErrorKind::BrokenPipe.into())
    }
}
impl AsyncRead for Reconnecting {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.cur.as_mut() {
            Some(c) => Pin::new(c).poll_read(cx, buf),
            None => Poll::Ready(Ok(())),
        }
    }
}
impl AsyncWrite for Reconnecting {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.cur.as_mut() {
            Some(c) => Pin::new(c).poll_write(cx, b),
            None => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.cur.as_mut() {
            Some(c) => Pin::new(c).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.cur.as_mut() {
            Some(c) => Pin::new(c).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}
impl AsyncRead for AlwaysUp {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}
impl AsyncWrite for AlwaysUp {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, b)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Writes `data` then half-closes, while reading everything back; returns what was read.
async fn echo_round_trip(s: MuxStream, data: Vec<u8>) -> Vec<u8> {
    let (mut r, mut w) = tokio::io::split(s);
    let writer = tokio::spawn(async move {
        for c in data.chunks(100_000) {
            w.write_all(c).await.expect("write");
        }
        w.shutdown().await.expect("half-close");
        w
    });
    let mut got = Vec::new();
    r.read_to_end(&mut got).await.expect("read echo");
    drop(writer.await.expect("writer"));
    got
}

fn start_guest() -> (DuplexStream, Arc<TestHandler>) {
    let (host_end, guest_end) = tokio::io::duplex(64 * 1024);
    let h = Arc::new(TestHandler::default());
    let handler: Arc<dyn Handler> = Arc::new(Shared(h.clone()));
    tokio::spawn(guest::run(AlwaysUp(guest_end), handler));
    (host_end, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_mib_each_way_on_concurrent_streams() {
    let (host_end, _h) = start_guest();
    let s = Session::over(host_end, Duration::from_secs(5)).await.expect("session");
    let mut tasks = Vec::new();
    let streams: u8 = std::env::var("MUX_TEST_STREAMS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    for i in 0..streams {
        let st = s.open(ECHO).await.expect("open echo");
        let data = pattern(i, 10 * 1024 * 1024);
        tasks.push(tokio::spawn(async move {
            let got = echo_round_trip(st, data.clone()).await;
            assert_eq!(got.len(), data.len(), "stream {i}");
            assert!(got == data, "stream {i} corrupted");
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_small_concurrent_streams() {
    let (host_end, _h) = start_guest();
    let s = Session::over(host_end, Duration::from_secs(5)).await.expect("session");
    let mut tasks = Vec::new();
    for i in 0..64u8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let st = s.open(ECHO).await.expect("open echo");
            let data = pattern(i, 64 * 1024 + i as usize);
            assert_eq!(echo_round_trip(st, data.clone()).await, data);
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
}

#[tokio::test]
async fn half_close_and_refused_port() {
    let (host_end, _h) = start_guest();
    let s = Session::over(host_end, Duration::from_secs(5)).await.expect("session");
    let mut st = s.open(COUNT).await.expect("open count");
    st.write_all(&[7u8; 12345]).await.expect("write");
    st.shutdown().await.expect("half-close");
    let mut reply = String::new();
    st.read_to_string(&mut reply).await.expect("guest writes after our half-close");
    assert_eq!(reply, "12345\n");

    match s.open(7).await {
        Err(SessionError::Refused(7)) => {}
        other => panic!("expected Refused(7), got {other:?}"),
    }
    // The session survives a refused port.
    assert!(s.open(COUNT).await.is_ok());
}

#[tokio::test]
async fn unread_stream_applies_back_pressure() {
    let (host_end, _h) = start_guest();
    let s = Session::over(host_end, Duration::from_secs(5)).await.expect("session");
    let mut st = s.open(SINK).await.expect("open sink");
    let chunk = vec![1u8; 16 * 1024];
    let mut written = 0usize;
    while let Ok(r) = tokio::time::timeout(Duration::from_millis(300), st.write_all(&chunk)).await {
        r.expect("write");
        written += chunk.len();
        assert!(written <= 4 * 1024 * 1024, "no back-pressure: {written} bytes accepted");
    }
    assert!(written >= 128 * 1024, "window too small: {written}");
    // Other streams still flow while one is blocked.
    let other = s.open(ECHO).await.expect("open echo");
    assert_eq!(echo_round_trip(other, pattern(9, 1000)).await, pattern(9, 1000));
}

#[tokio::test]
async fn host_reconnect_after_eof_starts_fresh_session() {
    let (tx, rx) = mpsc::channel(4);
    let h = Arc::new(TestHandler::default());
    let handler: Arc<dyn Handler> = Arc::new(Shared(h.clone()));
    tokio::spawn(guest::run(Reconnecting { cur: None, next: rx }, handler));

    let (h1, g1) = tokio::io::duplex(64 * 1024);
    tx.send(g1).await.expect("send conn");
    let s1 = Session::over(h1, Duration::from_secs(5)).await.expect("session 1");
    let held = s1.open(HOLD).await.expect("hold");
    drop(held);
    drop(s1); // closes host connection 1: the guest reads EOF
    wait_until(|| h.held_dropped.load(Ordering::SeqCst) == 1).await;

    let (h2, g2) = tokio::io::duplex(64 * 1024);
    tx.send(g2).await.expect("send conn");
    let s2 = Session::over(h2, Duration::from_secs(5)).await.expect("session 2");
    assert_eq!(echo_round_trip(s2.open(ECHO).await.expect("echo"), pattern(1, 5000)).await, pattern(1, 5000));
}

#[tokio::test]
async fn new_host_breaks_a_stale_guest_session() {
    // The guest end never sees EOF (like a restored clone whose host reconnected at once).
    let (gp, guest_end) = tokio::io::duplex(64 * 1024);
    let h = Arc::new(TestHandler::default());
    let handler: Arc<dyn Handler> = Arc::new(Shared(h.clone()));
    tokio::spawn(guest::run(AlwaysUp(guest_end), handler));
    let (conn_tx, mut conn_rx) = mpsc::channel::<DuplexStream>(2);
    let (ack_tx, mut ack_rx) = mpsc::channel::<()>(2);
    // Relay: pumps between the guest pipe and the current host connection; a host leaving
    // does not close the guest pipe.
    tokio::spawn(async move {
        let mut gp = gp;
        let mut cur = conn_rx.recv().await;
        while let Some(mut r) = cur.take() {
            let _ = ack_tx.send(()).await;
            let mut a = vec![0u8; 16384];
            let mut b = vec![0u8; 16384];
            loop {
                tokio::select! {
                    next = conn_rx.recv() => { cur = next; break }
                    n = gp.read(&mut a) => match n { Ok(0) | Err(_) => return, Ok(n) => if r.write_all(&a[..n]).await.is_err() { break } },
                    n = r.read(&mut b) => match n { Ok(0) | Err(_) => break, Ok(n) => if gp.write_all(&b[..n]).await.is_err() { return } },
                }
            }
            if cur.is_none() {
                cur = conn_rx.recv().await;
            }
        }
    });

    let (h1, r1) = tokio::io::duplex(64 * 1024);
    conn_tx.send(r1).await.expect("conn 1");
    ack_rx.recv().await.expect("relay on conn 1");
    let s1 = Session::over(h1, Duration::from_secs(5)).await.expect("session 1");
    let held = s1.open(HOLD).await.expect("hold");
    let e1 = s1.open(ECHO).await.expect("echo 1");
    assert_eq!(echo_round_trip(e1, pattern(2, 3000)).await, pattern(2, 3000));
    // Host 1 vanishes without a word: the relay switches to host 2.
    let (h2, r2) = tokio::io::duplex(64 * 1024);
    conn_tx.send(r2).await.expect("conn 2");
    ack_rx.recv().await.expect("relay switched to conn 2");
    drop(held);
    drop(s1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.held_dropped.load(Ordering::SeqCst), 0, "guest must not notice yet (no EOF)");
    let s2 = Session::over(h2, Duration::from_secs(5)).await.expect("session 2 over a stale guest session");
    wait_until(|| h.held_dropped.load(Ordering::SeqCst) == 1).await;
    for i in 0..3u8 {
        let e = s2.open(ECHO).await.expect("echo 2");
        assert_eq!(echo_round_trip(e, pattern(i, 70_000)).await, pattern(i, 70_000));
    }
}

async fn wait_until(f: impl Fn() -> bool) {
    for _ in 0..250 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("condition not reached in 5 s");
}

#[tokio::test]
async fn bridge_speaks_hybrid_vsock_and_reconnects() {
    let dir = tempfile::tempdir().expect("tempdir");
    let chardev = dir.path().join("agent-serial.sock");
    let vsock = dir.path().join("vsock.sock");
    // Fake QEMU chardev server: one client at a time, each connection a fresh guest session.
    let l = tokio::net::UnixListener::bind(&chardev).expect("bind chardev");
    let h = Arc::new(TestHandler::default());
    let handler: Arc<dyn Handler> = Arc::new(Shared(h.clone()));
    let (kill_tx, mut kill_rx) = mpsc::channel::<()>(1);
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.expect("accept");
            tokio::select! {
                _ = guest::serve(s, handler.clone()) => {}
                _ = kill_rx.recv() => {} // drops the connection: the host sees EOF
            }
        }
    });
    let bridge = agent_mux::bridge::Bridge::spawn(&vsock, &chardev, Duration::from_secs(5)).expect("bridge");

    async fn dial(vsock: &std::path::Path, port: u32) -> std::io::Result<(tokio::net::UnixStream, String)> {
        let mut c = tokio::net::UnixStream::connect(vsock).await?;
        c.write_all(format!("CONNECT {port}\n").as_bytes()).await?;
        let line =
            agent_mux::connect_line::read_line(&mut c).await.map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok((c, line))
    }

    let (mut c, line) = dial(&vsock, COUNT).await.expect("dial count");
    assert_eq!(line, "OK 3000");
    c.write_all(&[0u8; 100_000]).await.expect("write");
    c.shutdown().await.expect("half-close through the bridge");
    let mut reply = String::new();
    c.read_to_string(&mut reply).await.expect("reply");
    assert_eq!(reply, "100000\n");

    assert!(dial(&vsock, 7).await.is_err(), "refused port closes the client connection");

    // The chardev connection breaks (guest reboot / restore): the next client gets a new session.
    kill_tx.send(()).await.expect("kill");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (c, line) = dial(&vsock, ECHO).await.expect("dial after reconnect");
    assert_eq!(line, "OK 2048");
    let (mut r, mut w) = c.into_split();
    w.write_all(b"hello").await.expect("w");
    w.shutdown().await.expect("sd");
    let mut got = Vec::new();
    r.read_to_end(&mut got).await.expect("r");
    assert_eq!(got, b"hello");
    drop(bridge);
    assert!(!vsock.exists(), "bridge removes its socket when dropped");
}

#[tokio::test]
async fn a_wedged_first_connection_is_dialled_again() {
    // The first connection swallows every byte and never answers (a READY lost while the VM was
    // paused and the previous host died); the host hangs up after FIRST_ATTEMPT and the second
    // connection gets a session.
    let dir = tempfile::tempdir().expect("tempdir");
    let chardev = dir.path().join("agent-serial.sock");
    let l = tokio::net::UnixListener::bind(&chardev).expect("bind chardev");
    let h = Arc::new(TestHandler::default());
    let handler: Arc<dyn Handler> = Arc::new(Shared(h.clone()));
    let accepted = Arc::new(AtomicUsize::new(0));
    let n = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.expect("accept");
            if n.fetch_add(1, Ordering::SeqCst) == 0 {
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await; // until the host hangs up
                continue;
            }
            let _ = guest::serve(s, handler.clone()).await;
        }
    });
    let t0 = std::time::Instant::now();
    let session = Session::connect_with_timeout(&chardev, Duration::from_secs(30)).await.expect("second dial");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert!(t0.elapsed() >= agent_mux::host::FIRST_ATTEMPT);
    let s = session.open(ECHO).await.expect("open");
    assert_eq!(echo_round_trip(s, b"after a redial".to_vec()).await, b"after a redial");

    // No guest at all: the whole budget is spent, then a timeout naming it.
    let dead = dir.path().join("dead.sock");
    let l2 = tokio::net::UnixListener::bind(&dead).expect("bind");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l2.accept().await {
            held.push(s);
        }
    });
    let r = Session::connect_with_timeout(&dead, Duration::from_millis(300)).await;
    assert!(
        matches!(r, Err(SessionError::Preamble(agent_mux::preamble::PreambleError::Timeout(t))) if t == Duration::from_millis(300)),
        "{r:?}"
    );
}

//! The streaming calls ([`start_session`], [`AgentConn::pty_resize`], [`port_stream`])
//! against the real silkd, served in-process on the host over a tokio duplex.

use silkd_client::{
    port_stream, start_session, AgentConn, ClientError, ErrorKind, SessionEvent, SessionSpec, TermSize,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

/// How long any one test step may take.
const STEP: Duration = Duration::from_secs(20);

/// A fresh connection to `agent`, served by silkd's own connection engine.
fn connect(agent: &Arc<silkd::Agent>) -> AgentConn<DuplexStream> {
    let (client, server) = tokio::io::duplex(256 * 1024);
    tokio::spawn(silkd::conn::serve(server, Arc::clone(agent), "test"));
    AgentConn::new(client)
}

fn argv(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Output of a session up to its exit: (stdout, stderr, code).
async fn drain(output: &mut silkd_client::SessionOutput) -> (Vec<u8>, Vec<u8>, i32) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(STEP, output.next()).await.expect("output in time").expect("output") {
            Some(SessionEvent::Stdout(d)) => out.extend(d),
            Some(SessionEvent::Stderr(d)) => err.extend(d),
            Some(SessionEvent::Exit(code)) => {
                assert!(output.next().await.expect("after exit").is_none(), "exit is the last event");
                return (out, err, code);
            }
            None => panic!("output ended without an exit"),
        }
    }
}

#[tokio::test]
async fn exec_session_streams_stdin_from_another_task_and_keeps_stderr_apart() {
    let agent = silkd::Agent::new();
    let spec =
        SessionSpec { argv: argv(&["sh", "-c", "cat; echo oops >&2; exit 3"]), stdin: true, ..SessionSpec::default() };
    let (pid, mut input, mut output) = start_session(connect(&agent), spec).await.expect("started");
    assert!(pid > 0);
    // 1 MiB: several stdin frames, fed while the output is read.
    let payload: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    let sent = payload.clone();
    let feeder = tokio::spawn(async move {
        input.write(&sent).await.expect("write");
        input.close().await.expect("close");
        input.close().await.expect("a second close is a no-op");
        assert!(input.write(b"late").await.is_err(), "a write after close fails");
    });
    let (out, err, code) = drain(&mut output).await;
    feeder.await.expect("feeder");
    assert_eq!(out.len(), payload.len());
    assert!(out == payload, "stdout is stdin, in order");
    assert_eq!((err.as_slice(), code), (&b"oops\n"[..], 3));
}

#[tokio::test]
async fn exec_session_without_stdin_sees_end_of_input() {
    let agent = silkd::Agent::new();
    let spec = SessionSpec { argv: argv(&["sh", "-c", "cat; echo end"]), ..SessionSpec::default() };
    let (_, mut input, mut output) = start_session(connect(&agent), spec).await.expect("started");
    assert!(input.write(b"x").await.is_err(), "no stdin was asked for");
    assert_eq!(drain(&mut output).await, (b"end\n".to_vec(), Vec::new(), 0));
}

#[tokio::test]
async fn exec_session_refusals_are_agent_errors() {
    let agent = silkd::Agent::new();
    let got = start_session(connect(&agent), SessionSpec::default()).await.map(|(pid, ..)| pid);
    assert!(matches!(got, Err(ClientError::Agent { kind: ErrorKind::BadRequest, .. })), "{got:?}");
    let spec = SessionSpec { argv: argv(&["/no/such/program"]), ..SessionSpec::default() };
    let got = start_session(connect(&agent), spec).await.map(|(pid, ..)| pid);
    assert!(matches!(got, Err(ClientError::Agent { kind: ErrorKind::NotFound, .. })), "{got:?}");
}

/// Reads a tty session's output until it contains `needle`; everything read so far.
async fn read_until(output: &mut silkd_client::SessionOutput, seen: &mut Vec<u8>, needle: &str) {
    while !String::from_utf8_lossy(seen).contains(needle) {
        match tokio::time::timeout(STEP, output.next()).await.expect("output in time").expect("output") {
            Some(SessionEvent::Stdout(d)) => seen.extend(d),
            other => panic!("{other:?} while waiting for {needle:?} in {:?}", String::from_utf8_lossy(seen)),
        }
    }
}

#[tokio::test]
async fn tty_session_runs_argv_at_the_given_size_and_follows_a_resize() {
    let agent = silkd::Agent::new();
    let spec = SessionSpec {
        argv: argv(&["sh", "-c", "stty size; echo oops >&2; read go; stty size; echo got-$go; exit 4"]),
        tty: Some(TermSize { cols: 100, rows: 30 }),
        stdin: true,
        ..SessionSpec::default()
    };
    let (pid, mut input, mut output) = start_session(connect(&agent), spec).await.expect("started");
    let mut seen = Vec::new();
    read_until(&mut output, &mut seen, "oops").await;
    assert!(String::from_utf8_lossy(&seen).contains("30 100"), "{:?}", String::from_utf8_lossy(&seen));
    connect(&agent).pty_resize(pid, 120, 50).await.expect("resize on a second connection");
    input.write(b"go\n").await.expect("write");
    let (out, err, code) = drain(&mut output).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("50 120"), "{text:?}");
    assert!(text.contains("got-go"), "{text:?}");
    assert_eq!((err.len(), code), (0, 4), "a pty merges stderr into stdout");
    let gone = connect(&agent).pty_resize(pid, 1, 1).await;
    assert!(matches!(gone, Err(ClientError::Agent { kind: ErrorKind::NotFound, .. })), "{gone:?}");
}

#[tokio::test]
async fn port_stream_round_trips_to_a_local_tcp_server_with_eof_both_ways() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        sock.read_to_end(&mut got).await.expect("read to the client's half-close");
        sock.write_all(format!("got {} bytes", got.len()).as_bytes()).await.expect("reply");
        got
    });
    let agent = silkd::Agent::new();
    let stream = port_stream(connect(&agent), port).await.expect("ready");
    let (mut rd, mut wr) = tokio::io::split(stream);
    let payload: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 253) as u8).collect();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&sent).await.expect("write");
        wr.shutdown().await.expect("half-close");
        wr
    });
    let mut back = Vec::new();
    tokio::time::timeout(STEP, rd.read_to_end(&mut back)).await.expect("in time").expect("clean end of file");
    assert_eq!(String::from_utf8_lossy(&back), format!("got {} bytes", payload.len()));
    assert!(server.await.expect("server") == payload, "the guest socket got every byte, in order");
    drop(writer.await.expect("writer"));
}

#[tokio::test]
async fn port_stream_to_a_closed_port_is_not_found() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let agent = silkd::Agent::new();
    let got = port_stream(connect(&agent), port).await.map(|_| ());
    assert!(matches!(got, Err(ClientError::Agent { kind: ErrorKind::NotFound, .. })), "{got:?}");
}

//! The proto 2 connection model (`docs/sandboxd.md` §9.3) over a Unix socket.

mod common;

use common::{collect, data, ty, Server};
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn info_reports_proto_2_and_version() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let info = c.call("info", json!({})).await;
    assert_eq!(ty(&info), "info");
    assert_eq!(info["proto"], 2);
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    assert!(info["uptime_secs"].is_u64());
    assert!(info["procs"].is_u64() && info["sessions"].is_u64());
}

#[tokio::test]
async fn stdin_after_exit_is_dropped_and_connection_stays_usable() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    for round in 0..3 {
        c.send("exec", json!({"argv": ["sh", "-c", format!("echo round{round}")]})).await;
        let frames = c.recv_until(&["exit"]).await;
        let (out, _, code) = collect(&frames);
        assert_eq!((out, code), (format!("round{round}\n").into_bytes(), 0));
        // The SDK's stdin_close (and late stdin) lands after exit: silently dropped.
        c.send("stdin", json!({"data": common::b64(b"late")})).await;
        c.send("stdin_close", json!({})).await;
    }
    let procs = c.call("ps", json!({})).await;
    assert_eq!(ty(&procs), "procs", "a dropped continuation must not produce a reply: {procs}");
}

#[tokio::test]
async fn stray_continuation_opening_a_connection_is_refused() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let err = c.call("data", json!({"data": common::b64(b"x")})).await;
    assert_eq!(err, json!({"type": "error", "kind": "bad_request", "message": "stray data/stdin frame"}));
    // More continuations are dropped; the connection serves requests.
    c.send("data_end", json!({})).await;
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn info_and_first_op_pipelined_in_one_write() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let burst = concat!(
        r#"{"v":1,"op":"info"}"#,
        "\n",
        r#"{"v":1,"op":"exec","argv":["sh","-c","echo piped"],"detach":false}"#,
        "\n",
        r#"{"v":1,"op":"stdin_close"}"#,
        "\n"
    );
    c.send_raw(burst.as_bytes()).await;
    assert_eq!(ty(&c.recv().await), "info");
    let frames = c.recv_until(&["exit"]).await;
    assert_eq!(ty(&frames[0]), "started");
    let (out, _, code) = collect(&frames);
    assert_eq!((out.as_slice(), code), (&b"piped\n"[..], 0));
}

#[tokio::test]
async fn request_mid_stream_ends_input_and_is_served_after() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    c.send("exec", json!({"argv": ["cat"]})).await;
    c.send("stdin", json!({"data": common::b64(b"abc")})).await;
    // No stdin_close: the next request ends cat's input.
    c.send("ps", json!({})).await;
    let frames = c.recv_until(&["exit"]).await;
    let (out, _, code) = collect(&frames);
    assert_eq!((out.as_slice(), code), (&b"abc"[..], 0));
    assert_eq!(ty(&c.recv().await), "procs");
}

#[tokio::test]
async fn garbage_and_unknown_ops_are_answered_and_the_connection_continues() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    c.send_raw(b"this is not json\n").await;
    let err = c.recv().await;
    assert_eq!((ty(&err), err["kind"].as_str()), ("error", Some("bad_request")));
    assert!(err["message"].as_str().unwrap_or("").starts_with("parse: "), "{err}");
    let err = c.call("teleport", json!({})).await;
    assert_eq!(err["kind"], "unimplemented");
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn frame_over_8_mib_is_refused_and_the_connection_continues() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let mut big = br#"{"v":1,"op":"data","data":""#.to_vec();
    big.extend(std::iter::repeat_n(b'A', 9 * 1024 * 1024));
    big.extend_from_slice(b"\"}\n");
    let writer = tokio::spawn(async move {
        c.send_raw(&big).await;
        c
    });
    let mut c = writer.await.expect("writer");
    let err = c.recv().await;
    assert_eq!(err["type"], "error");
    assert_eq!(err["kind"], "bad_request");
    assert!(err["message"].as_str().unwrap_or("").contains("8388608"), "{err}");
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn dropped_client_kills_the_foreground_child_on_its_next_write() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    c.send("exec", json!({"argv": ["sh", "-c", "while true; do echo tick; sleep 0.05; done"]})).await;
    let started = c.recv().await;
    let pid = started["pid"].as_u64().expect("pid");
    assert!(common::alive(pid));
    assert_eq!(ty(&c.recv().await), "stdout");
    drop(c);
    assert!(common::eventually(|| !common::alive(pid)).await, "foreground child {pid} survived its client");
    let mut c = server.connect().await;
    let kill = c.call("kill", json!({"pid": pid})).await;
    // The record is gone once the child was reaped; before that, killing it is a no-op.
    assert!(matches!(ty(&kill), "done" | "error"), "{kill}");
}

#[tokio::test]
async fn output_is_back_pressured_not_buffered() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    // 64 MiB of output; the client reads nothing for a while, then everything.
    c.send("exec", json!({"argv": ["sh", "-c", "head -c 67108864 /dev/zero"]})).await;
    c.send("stdin_close", json!({})).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut total = 0usize;
    loop {
        let f = c.recv().await;
        match ty(&f) {
            "stdout" => {
                let chunk = data(&f).len();
                assert!(chunk <= 256 * 1024, "chunk of {chunk} bytes");
                total += chunk;
            }
            "exit" => break,
            _ => {}
        }
    }
    assert_eq!(total, 64 << 20);
}

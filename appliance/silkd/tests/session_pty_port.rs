//! Shell sessions, the pty, and port forwarding over a Unix socket.

mod common;

use common::{collect, data, ty, Server};
use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn session_state_persists_across_execs() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let created = c.call("session_create", json!({"id": "s1", "env": {"GREETING": "hello"}})).await;
    assert_eq!(created, json!({"type": "session_created", "id": "s1"}));
    let dup = c.call("session_create", json!({"id": "s1"})).await;
    assert_eq!(dup["kind"], "bad_request");

    let (_, _, code) = c.run(json!({"argv": ["cd", "/tmp"], "session": "s1"})).await;
    assert_eq!(code, 0);
    let (_, _, code) = c.run(json!({"argv": ["export", "FOO=bar baz"], "session": "s1"})).await;
    assert_eq!(code, 0);
    let (out, _, _) = c.run(json!({"argv": ["pwd"], "session": "s1"})).await;
    assert_eq!(out, b"/tmp\n");
    let (out, _, _) = c.run(json!({"argv": ["sh", "-c", "echo \"$FOO|$GREETING\""], "session": "s1"})).await;
    assert_eq!(out, b"bar baz|hello\n");

    // No started frame; stderr merged into stdout; the exit code is the command's.
    c.send("exec", json!({"argv": ["sh", "-c", "printf no-newline; echo oops >&2; exit 3"], "session": "s1"})).await;
    c.send("stdin_close", json!({})).await;
    let frames = c.recv_until(&["exit"]).await;
    assert!(frames.iter().all(|f| ty(f) == "stdout" || ty(f) == "exit"), "{frames:?}");
    let (out, _, code) = collect(&frames);
    assert_eq!((out.as_slice(), code), (&b"no-newlineoops\n"[..], 3));

    // A command reading stdin gets /dev/null, not the marker stream.
    let (out, _, code) = c.run(json!({"argv": ["cat"], "session": "s1"})).await;
    assert_eq!((out.len(), code), (0, 0));
    // Output that mimics a marker does not confuse the framing.
    let (out, _, _) = c.run(json!({"argv": ["echo", "__silkd_end_0000 5"], "session": "s1"})).await;
    assert_eq!(out, b"__silkd_end_0000 5\n");

    let listed = c.call("session_list", json!({})).await;
    assert_eq!(listed, json!({"type": "sessions", "sessions": ["s1"]}));
    assert_eq!(c.call("info", json!({})).await["sessions"], 1);
    assert_eq!(c.call("session_rm", json!({"id": "s1"})).await, json!({"type": "done"}));
    let gone = c.call("session_rm", json!({"id": "s1"})).await;
    assert_eq!(gone, json!({"type": "error", "kind": "not_found", "message": "no such session"}));
    let gone = c.call("exec", json!({"argv": ["pwd"], "session": "s1"})).await;
    assert_eq!(gone["kind"], "not_found");
}

#[tokio::test]
async fn session_survives_its_connection_and_exit_ends_it() {
    let server = Server::start().await;
    let mut a = server.connect().await;
    let created = a.call("session_create", json!({"cwd": "/"})).await;
    let id = created["id"].as_str().expect("generated id").to_string();
    assert!(id.starts_with("sess-"));
    let (_, _, code) = a.run(json!({"argv": ["cd", "/usr"], "session": id})).await;
    assert_eq!(code, 0);
    drop(a);
    let mut b = server.connect().await;
    let (out, _, _) = b.run(json!({"argv": ["pwd"], "session": id})).await;
    assert_eq!(out, b"/usr\n");
    let (_, _, code) = b.run(json!({"argv": ["exit", "4"], "session": id})).await;
    assert_eq!(code, 4);
    let listed = b.call("session_list", json!({})).await;
    assert_eq!(listed["sessions"], json!([]));
}

#[tokio::test]
async fn idle_sessions_are_reaped() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let id = c.call("session_create", json!({})).await["id"].as_str().expect("id").to_string();
    assert_eq!(server.agent.sessions.reap_idle(Duration::from_secs(60)), 0, "fresh session is not idle");
    assert_eq!(server.agent.sessions.reap_idle(Duration::ZERO), 1);
    let e = c.call("exec", json!({"argv": ["true"], "session": id})).await;
    assert_eq!(e["kind"], "not_found");
}

async fn pty_read_until(c: &mut common::Client, needle: &str) -> String {
    let mut seen = Vec::new();
    loop {
        let f = c.recv().await;
        match ty(&f) {
            "stdout" => seen.extend(data(&f)),
            other => panic!("unexpected {other} frame while waiting for {needle:?}: {f}"),
        }
        let text = String::from_utf8_lossy(&seen).into_owned();
        if text.contains(needle) {
            return text;
        }
    }
}

#[tokio::test]
async fn pty_round_trip_resize_and_exit() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    c.send("pty_open", json!({"cols": 80, "rows": 24, "cwd": "/tmp", "env": {"PS1": "$ "}})).await;
    let started = c.recv().await;
    assert_eq!(ty(&started), "started");
    let pid = started["pid"].as_u64().expect("pid");
    c.send("stdin", json!({"data": common::b64(b"echo hi-$((6*7)); tty; stty size\n")})).await;
    let text = pty_read_until(&mut c, "24 80").await;
    assert!(text.contains("hi-42"), "{text:?}");
    assert!(text.contains("/dev/pts/"), "not a real tty: {text:?}");

    let mut other = server.connect().await;
    assert_eq!(other.call("pty_resize", json!({"pid": pid, "cols": 100, "rows": 40})).await, json!({"type": "done"}));
    let e = other.call("pty_resize", json!({"pid": 999_999_999u64, "cols": 1, "rows": 1})).await;
    assert_eq!(e["kind"], "not_found");
    c.send("stdin", json!({"data": common::b64(b"stty size; exit 5\n")})).await;
    let mut seen = Vec::new();
    let code = loop {
        let f = c.recv().await;
        match ty(&f) {
            "stdout" => seen.extend(data(&f)),
            "exit" => break f["code"].as_i64().expect("code"),
            other => panic!("unexpected {other}: {f}"),
        }
    };
    assert!(String::from_utf8_lossy(&seen).contains("40 100"), "{:?}", String::from_utf8_lossy(&seen));
    assert_eq!(code, 5);
    // Connection still serves requests.
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

/// Opens a pty shell with a known prompt and waits until the shell has printed it (so it is
/// idle, waiting for input, when the test goes on); returns the client and the shell's pid.
async fn idle_pty_shell(server: &Server) -> (common::Client, u64) {
    let mut c = server.connect().await;
    c.send("pty_open", json!({"cols": 80, "rows": 24, "env": {"PS1": "ready$ "}})).await;
    let pid = c.recv().await["pid"].as_u64().expect("pid");
    c.send("stdin", json!({"data": common::b64(b"echo up-$((6*7))\n")})).await;
    pty_read_until(&mut c, "up-42").await;
    assert!(common::alive(pid));
    (c, pid)
}

#[tokio::test]
async fn pty_shell_gets_hangup_when_the_client_leaves() {
    let server = Server::start().await;
    // Right after the start (the shell may still be starting up)…
    let mut c = server.connect().await;
    c.send("pty_open", json!({"cols": 80, "rows": 24})).await;
    let early = c.recv().await["pid"].as_u64().expect("pid");
    drop(c);
    // …and once it is idle at its prompt, with nothing left to print.
    let (c, idle) = idle_pty_shell(&server).await;
    drop(c);
    for pid in [early, idle] {
        assert!(common::eventually(|| !common::alive(pid)).await, "pty shell {pid} survived its client");
    }
}

#[tokio::test]
async fn pty_shell_that_ignores_the_hangup_is_killed_when_the_client_leaves() {
    let server = Server::start().await;
    let (mut c, pid) = idle_pty_shell(&server).await;
    c.send("stdin", json!({"data": common::b64(b"trap '' HUP; echo trapped-$((6*7))\n")})).await;
    pty_read_until(&mut c, "trapped-42").await;
    drop(c);
    assert!(common::eventually(|| !common::alive(pid)).await, "pty shell {pid} ignoring SIGHUP survived its client");
}

#[tokio::test]
async fn port_forward_relays_both_ways_with_half_close() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let guest = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        sock.read_to_end(&mut got).await.expect("read to the client's half-close");
        let reply = format!("got {} bytes", got.len());
        sock.write_all(reply.as_bytes()).await.expect("write");
        got
    });
    let server = Server::start().await;
    let mut c = server.connect().await;
    assert_eq!(c.call("port_forward", json!({"port": port})).await, json!({"type": "ready"}));
    let payload = vec![7u8; 3 * 1024 * 1024];
    for chunk in payload.chunks(1 << 20) {
        c.send("data", json!({"data": common::b64(chunk)})).await;
    }
    c.send("data_end", json!({})).await;
    let frames = c.recv_until(&["done"]).await;
    let back: Vec<u8> = frames.iter().filter(|f| ty(f) == "data").flat_map(data).collect();
    assert_eq!(back, format!("got {} bytes", payload.len()).into_bytes());
    assert_eq!(guest.await.expect("guest"), payload);
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn port_forward_without_listener_is_not_found() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let server = Server::start().await;
    let mut c = server.connect().await;
    let e = c.call("port_forward", json!({"port": port})).await;
    assert_eq!(e["kind"], "not_found", "{e}");
    // A late data_end after the error is dropped.
    c.send("data_end", json!({})).await;
    assert!(c.try_recv(Duration::from_millis(200)).await.is_none());
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn pty_open_with_argv_runs_that_command_on_the_terminal() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let argv = json!(["sh", "-c", "stty size; tty; read line; echo \"got $line\"; exit 7"]);
    c.send("pty_open", json!({"argv": argv, "cols": 100, "rows": 30})).await;
    let started = c.recv().await;
    assert_eq!(ty(&started), "started", "{started}");
    let text = pty_read_until(&mut c, "30 100").await;
    assert!(!text.contains("$ "), "a login shell ran instead of the command: {text:?}");
    c.send("stdin", json!({"data": common::b64(b"hello\n")})).await;
    let frames = c.recv_until(&["exit"]).await;
    let (out, _, code) = collect(&frames);
    let text = format!("{text}{}", String::from_utf8_lossy(&out));
    assert!(text.contains("/dev/pts/"), "not a real tty: {text:?}");
    assert!(text.contains("got hello"), "{text:?}");
    assert_eq!(code, 7);

    let empty = c.call("pty_open", json!({"argv": []})).await;
    assert_eq!(empty["kind"], "bad_request", "{empty}");
    let missing = c.call("pty_open", json!({"argv": ["/no/such/program"]})).await;
    assert_eq!(missing["kind"], "not_found", "{missing}");
}

//! `exec` (foreground, detached), `ps`, `kill`, `logs`, `attach` over a Unix socket.

mod common;

use common::{collect, data, ty, Server};
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn exec_streams_stdout_stderr_and_exit_code() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let (out, err, code) = c.run(json!({"argv": ["sh", "-c", "echo out; echo err >&2; exit 7"]})).await;
    assert_eq!((out.as_slice(), err.as_slice(), code), (&b"out\n"[..], &b"err\n"[..], 7));
}

#[tokio::test]
async fn exec_env_is_cleared_and_cwd_applied() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    std::env::set_var("SILKD_TEST_LEAK", "1");
    let (out, _, code) = c.run(json!({"argv": ["sh", "-c", "env; pwd"], "cwd": "/tmp", "env": {"FOO": "bar"}})).await;
    assert_eq!(code, 0);
    let out = String::from_utf8(out).expect("utf8");
    let keys: Vec<&str> = out.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
    assert!(out.contains("FOO=bar\n"));
    assert!(out.contains("PATH=/usr/local/sbin:"));
    assert!(out.contains("TERM="));
    assert!(!keys.contains(&"HOME") && !keys.contains(&"USER") && !keys.contains(&"SILKD_TEST_LEAK"), "{out}");
    assert!(out.ends_with("/tmp\n"), "{out}");
}

#[tokio::test]
async fn exec_errors_are_typed() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let e = c.call("exec", json!({"argv": []})).await;
    assert_eq!(e, json!({"type": "error", "kind": "bad_request", "message": "argv must not be empty"}));
    let e = c.call("exec", json!({"argv": ["true"], "detach": true, "session": "s"})).await;
    assert_eq!(e, json!({"type": "error", "kind": "bad_request", "message": "detach is not supported with session"}));
    let e = c.call("exec", json!({"argv": ["true"], "session": "nope"})).await;
    assert_eq!(e, json!({"type": "error", "kind": "not_found", "message": "no such session"}));
    let e = c.call("exec", json!({"argv": ["/definitely/not/here"]})).await;
    assert_eq!(e["kind"], "not_found", "{e}");
    let e = c.call("exec", json!({"argv": ["true"], "cwd": "/definitely/not/here"})).await;
    assert_eq!(e["kind"], "not_found", "{e}");
    let e = c.call("exec", json!({"argv": ["true"], "user": "no-such-user-xyz"})).await;
    assert_eq!(e["kind"], "bad_request", "{e}");
    // Still usable after errors.
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}

#[tokio::test]
async fn signal_death_reports_128_plus_signal() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let (_, _, code) = c.run(json!({"argv": ["sh", "-c", "kill -9 $$"]})).await;
    assert_eq!(code, 137);
}

#[tokio::test]
async fn exec_stdin_round_trips_3_mib_of_random_bytes_through_cat() {
    let server = Server::start().await;
    let c = server.connect().await;
    let common::Client { mut rd, mut wr } = c;
    let input: Vec<u8> = (0..3 * 1024 * 1024).map(|_| rand::random::<u8>()).collect();
    let payload = input.clone();
    // Write and read concurrently, as the SDK's stdin pump does.
    let writer = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        wr.write_all(b"{\"v\":1,\"op\":\"exec\",\"argv\":[\"cat\"]}\n").await.expect("write");
        for chunk in payload.chunks(256 * 1024) {
            let line = format!("{{\"v\":1,\"op\":\"stdin\",\"data\":\"{}\"}}\n", common::b64(chunk));
            wr.write_all(line.as_bytes()).await.expect("write");
        }
        wr.write_all(b"{\"v\":1,\"op\":\"stdin_close\"}\n").await.expect("write");
        wr
    });
    let mut frames = Vec::new();
    loop {
        let f = common::read_frame(&mut rd).await;
        let end = ty(&f) == "exit";
        frames.push(f);
        if end {
            break;
        }
    }
    let _wr = writer.await.expect("writer");
    assert_eq!(ty(&frames[0]), "started");
    let (out, _, code) = collect(&frames);
    assert_eq!(code, 0);
    assert_eq!(out.len(), input.len());
    assert!(out == input, "cat echoed different bytes");
}

#[tokio::test]
async fn detached_process_logs_attach_kill() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let started =
        c.call("exec", json!({"argv": ["sh", "-c", "echo begin; echo warn >&2; exec sleep 30"], "detach": true})).await;
    assert_eq!(ty(&started), "started");
    let pid = started["pid"].as_u64().expect("pid");
    // The detached RPC ended at started: the connection takes the next request at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let procs = c.call("ps", json!({})).await;
    let row = procs["procs"].as_array().expect("rows").iter().find(|r| r["pid"] == pid).cloned().expect("row");
    assert_eq!(row["detached"], true);
    assert_eq!(row["state"], "running");
    assert!(row.get("exit_code").is_none());

    // The shell's first writes may take a moment under load: poll logs until both landed.
    let mut frames = Vec::new();
    for _ in 0..100 {
        c.send("logs", json!({"pid": pid})).await;
        frames = c.recv_until(&["done"]).await;
        if frames.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out: Vec<u8> = frames.iter().filter(|f| ty(f) == "stdout").flat_map(data).collect();
    let err: Vec<u8> = frames.iter().filter(|f| ty(f) == "stderr").flat_map(data).collect();
    assert_eq!((out.as_slice(), err.as_slice()), (&b"begin\n"[..], &b"warn\n"[..]));
    assert!(!frames.iter().any(|f| ty(f) == "exit"), "still running: {frames:?}");

    let mut follower = server.connect().await;
    follower.send("attach", json!({"pid": pid})).await;
    // Replay: both chunks (stdout and stderr pipes are read independently, in either order).
    let mut replay = [follower.recv().await, follower.recv().await];
    replay.sort_by(|a, b| ty(a).cmp(ty(b)));
    assert_eq!((ty(&replay[0]), data(&replay[0])), ("stderr", b"warn\n".to_vec()));
    assert_eq!((ty(&replay[1]), data(&replay[1])), ("stdout", b"begin\n".to_vec()));

    assert_eq!(c.call("kill", json!({"pid": pid, "signal": 15})).await, json!({"type": "done"}));
    let rest = follower.recv_until(&["exit", "done"]).await;
    assert_eq!(rest.last().expect("frames")["code"], 128 + 15);

    c.send("logs", json!({"pid": pid})).await;
    let frames = c.recv_until(&["done"]).await;
    let exit = frames.iter().find(|f| ty(f) == "exit").expect("exit replayed");
    assert_eq!(exit["code"], 143);
    assert_eq!(ty(frames.last().expect("frames")), "done");

    // Killing an exited process is a no-op; an unknown pid is not_found.
    assert_eq!(c.call("kill", json!({"pid": pid})).await, json!({"type": "done"}));
    let e = c.call("kill", json!({"pid": 999_999_999u64})).await;
    assert_eq!(e, json!({"type": "error", "kind": "not_found", "message": "no such pid"}));
    let e = c.call("logs", json!({"pid": 999_999_999u64})).await;
    assert_eq!(e["kind"], "not_found");
    let procs = c.call("ps", json!({})).await;
    let row = procs["procs"].as_array().expect("rows").iter().find(|r| r["pid"] == pid).cloned().expect("kept 5 min");
    assert_eq!((row["state"].as_str(), row["exit_code"].as_i64()), (Some("exited"), Some(143)));
}

#[tokio::test]
async fn detached_ring_keeps_the_last_256_kib() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let started = c
        .call(
            "exec",
            json!({"argv": ["sh", "-c", "head -c 1048576 /dev/zero | tr '\\0' a; printf END"], "detach": true}),
        )
        .await;
    let pid = started["pid"].as_u64().expect("pid");
    let mut follower = server.connect().await;
    follower.send("attach", json!({"pid": pid})).await;
    let frames = follower.recv_until(&["exit", "done"]).await;
    assert_eq!(frames.last().expect("frames")["code"], 0);
    c.send("logs", json!({"pid": pid})).await;
    let frames = c.recv_until(&["done"]).await;
    let out: Vec<u8> = frames.iter().filter(|f| ty(f) == "stdout").flat_map(data).collect();
    assert_eq!(out.len(), 256 * 1024);
    assert!(out.ends_with(b"aaaEND"));
}

#[tokio::test]
async fn ps_is_sorted_and_lists_foreground_processes() {
    let server = Server::start().await;
    let mut a = server.connect().await;
    let mut pids = Vec::new();
    for _ in 0..3 {
        let s = a.call("exec", json!({"argv": ["sleep", "5"], "detach": true})).await;
        pids.push(s["pid"].as_u64().expect("pid"));
    }
    let mut fg = server.connect().await;
    fg.send("exec", json!({"argv": ["sleep", "5"]})).await;
    let fg_pid = fg.recv().await["pid"].as_u64().expect("pid");
    let procs = a.call("ps", json!({})).await;
    let rows = procs["procs"].as_array().expect("rows");
    let listed: Vec<u64> = rows.iter().map(|r| r["pid"].as_u64().expect("pid")).collect();
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    assert_eq!(listed, sorted);
    let fg_row = rows.iter().find(|r| r["pid"] == fg_pid).expect("foreground row");
    assert_eq!(fg_row["detached"], false);
    for pid in pids.iter().chain([&fg_pid]) {
        assert_eq!(a.call("kill", json!({"pid": pid})).await, json!({"type": "done"}));
    }
    let frames = fg.recv_until(&["exit"]).await;
    assert_eq!(frames.last().expect("exit")["code"], 137);
}

#[tokio::test]
async fn user_switching_sets_ids_home_and_user() {
    // `cargo xtask test` runs as root (it installs packages and makes network namespaces).
    assert!(nix::unistd::Uid::effective().is_root(), "switching users needs root: run the suite as root");
    let server = Server::start().await;
    let mut c = server.connect().await;
    let (out, _, code) = c
        .run(json!({"argv": ["sh", "-c", "id -u; id -g; echo $HOME; echo $USER"], "user": "nobody", "cwd": "/"}))
        .await;
    assert_eq!(code, 0);
    let out = String::from_utf8(out).expect("utf8");
    let lines: Vec<&str> = out.lines().collect();
    let pw = nix::unistd::User::from_name("nobody").expect("passwd").expect("nobody exists");
    assert_eq!(lines[0], pw.uid.to_string());
    assert_eq!(lines[1], pw.gid.to_string());
    assert_eq!(lines[2], pw.dir.to_string_lossy());
    assert_eq!(lines[3], "nobody");
}

#[tokio::test]
async fn lsp_is_unimplemented() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    for (op, fields) in [("lsp_start", json!({"language": "rust"})), ("lsp_stop", json!({"server_id": "x"}))] {
        let e = c.call(op, fields).await;
        assert_eq!(e["kind"], "unimplemented", "{e}");
        assert!(e["message"].as_str().unwrap_or("").starts_with(op));
    }
}

#[tokio::test]
async fn exit_is_sent_after_a_bounded_drain_when_a_grandchild_holds_the_pipe() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let t0 = std::time::Instant::now();
    // The backgrounded sleep keeps stdout open after sh exits.
    let (out, _, code) = c.run(json!({"argv": ["sh", "-c", "sleep 6 & echo hi"]})).await;
    let took = t0.elapsed();
    assert_eq!((out.as_slice(), code), (&b"hi\n"[..], 0));
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(5), "drain took {took:?}");
}

#[tokio::test]
async fn nul_bytes_in_argv_are_a_bad_request() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let e = c.call("exec", json!({"argv": ["echo", "a\u{0}b"]})).await;
    assert_eq!(e["kind"], "bad_request", "{e}");
}

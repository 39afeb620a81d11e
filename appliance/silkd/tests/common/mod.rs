//! A silkd served on a Unix socket in a temp dir, and a raw NDJSON client for it.

#![allow(dead_code)]

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// How long any single frame may take to arrive.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Server {
    pub path: PathBuf,
    pub agent: Arc<silkd::Agent>,
    _dir: tempfile::TempDir,
}

impl Server {
    pub async fn start() -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("silkd.sock");
        let agent = silkd::Agent::new();
        let listener = silkd::listen::bind_unix(&path).expect("bind");
        tokio::spawn(silkd::listen::serve_unix(listener, Arc::clone(&agent)));
        Server { path, agent, _dir: dir }
    }

    pub async fn connect(&self) -> Client {
        let stream = UnixStream::connect(&self.path).await.expect("connect");
        let (rd, wr) = stream.into_split();
        Client { rd: BufReader::new(rd), wr }
    }
}

pub struct Client {
    pub rd: BufReader<OwnedReadHalf>,
    pub wr: OwnedWriteHalf,
}

pub fn b64(data: &[u8]) -> String {
    STANDARD.encode(data)
}

/// The decoded `data` of a chunk frame.
pub fn data(frame: &Value) -> Vec<u8> {
    STANDARD.decode(frame["data"].as_str().expect("data string")).expect("base64")
}

pub fn ty(frame: &Value) -> &str {
    frame["type"].as_str().unwrap_or("")
}

impl Client {
    /// Sends `{"v":1,"op":op,…fields}`.
    pub async fn send(&mut self, op: &str, fields: Value) {
        let mut frame = json!({"v": 1, "op": op});
        if let (Some(obj), Value::Object(extra)) = (frame.as_object_mut(), fields) {
            obj.extend(extra);
        }
        let mut line = serde_json::to_vec(&frame).expect("json");
        line.push(b'\n');
        self.wr.write_all(&line).await.expect("write");
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.expect("write");
    }

    /// The next frame; panics on timeout or EOF.
    pub async fn recv(&mut self) -> Value {
        read_frame(&mut self.rd).await
    }

    /// `Some(frame)` if one arrives within `wait`, `None` on timeout or EOF.
    pub async fn try_recv(&mut self, wait: Duration) -> Option<Value> {
        let mut line = String::new();
        match tokio::time::timeout(wait, self.rd.read_line(&mut line)).await {
            Ok(Ok(n)) if n > 0 => Some(serde_json::from_str(&line).expect("frame is JSON")),
            _ => None,
        }
    }

    /// Frames up to and including the first whose type is in `terminal`.
    pub async fn recv_until(&mut self, terminal: &[&str]) -> Vec<Value> {
        let mut frames = Vec::new();
        loop {
            let f = self.recv().await;
            let done = terminal.contains(&ty(&f));
            frames.push(f);
            if done {
                return frames;
            }
        }
    }

    /// One request answered by one frame.
    pub async fn call(&mut self, op: &str, fields: Value) -> Value {
        self.send(op, fields).await;
        self.recv().await
    }

    /// Runs a foreground exec to completion: (stdout, stderr, code).
    pub async fn run(&mut self, fields: Value) -> (Vec<u8>, Vec<u8>, i64) {
        self.send("exec", fields).await;
        self.send("stdin_close", json!({})).await;
        let frames = self.recv_until(&["exit", "error"]).await;
        collect(&frames)
    }
}

/// The next frame from a read half; panics on timeout or EOF.
pub async fn read_frame(rd: &mut BufReader<OwnedReadHalf>) -> Value {
    let mut line = String::new();
    let n = tokio::time::timeout(FRAME_TIMEOUT, rd.read_line(&mut line)).await.expect("frame timed out").expect("read");
    assert!(n > 0, "connection closed");
    serde_json::from_str(&line).expect("frame is JSON")
}

/// (stdout, stderr, exit code) of a frame list; panics on an error frame.
pub fn collect(frames: &[Value]) -> (Vec<u8>, Vec<u8>, i64) {
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    for f in frames {
        match ty(f) {
            "stdout" => out.extend(data(f)),
            "stderr" => err.extend(data(f)),
            "exit" => code = f["code"].as_i64(),
            "error" => panic!("unexpected error frame {f}"),
            _ => {}
        }
    }
    (out, err, code.expect("an exit frame"))
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// Polls `cond` for up to 10 s.
pub async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

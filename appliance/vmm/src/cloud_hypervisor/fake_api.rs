//! A fake cloud-hypervisor API server for tests: a tiny HTTP/1.1 responder on a Unix socket
//! that records every request and answers with the recorded response shapes in `fixtures/`.
//!
//! Every `PUT` answers `204 No Content` unless a canned failure is set with
//! [`FakeApi::respond`]; `GET /vmm.ping` and `GET /vm.info` answer the fixtures.
//! `PUT /vmm.shutdown` also creates [`FakeApi::exit_file`], which the fake cloud-hypervisor
//! script ([`FakeApi::write_fake_binary`]) waits for before exiting, like the real VMM does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// The fixtures directory.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cloud_hypervisor/fixtures")
}

/// Reads a fixture file as a string.
pub fn fixture(name: &str) -> String {
    let p = fixtures_dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {}: {e}", p.display()))
}

/// One request the fake received.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// `GET` or `PUT`.
    pub method: String,
    /// Path without the `/api/v1` prefix, e.g. `/vm.create`.
    pub path: String,
    /// The JSON body, if there was one.
    pub body: Option<serde_json::Value>,
}

impl Recorded {
    /// `"PUT /vm.boot"`.
    pub fn line(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

#[derive(Debug, Clone)]
struct Canned {
    status: u16,
    body: String,
}

#[derive(Debug, Default)]
struct State {
    requests: Vec<Recorded>,
    canned: HashMap<String, Canned>,
}

/// A running fake API server; stops when dropped.
#[derive(Debug)]
pub struct FakeApi {
    socket: PathBuf,
    exit_file: PathBuf,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.task.abort();
        // Lets every fake cloud-hypervisor of this test exit.
        let _ = std::fs::write(&self.exit_file, b"");
    }
}

impl FakeApi {
    /// Listens on `<dir>/fake-api.sock`.
    pub fn start(dir: &Path) -> Self {
        let socket = dir.join("fake-api.sock");
        let exit_file = dir.join("fake-vmm-exit");
        let listener = UnixListener::bind(&socket).expect("bind fake api socket");
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let exit = exit_file.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let st = st.clone();
                let exit = exit.clone();
                tokio::spawn(async move {
                    let _ = serve(conn, st, exit).await;
                });
            }
        });
        FakeApi { socket, exit_file, state, task }
    }

    /// The socket the fake listens on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The file created on `PUT /vmm.shutdown`.
    pub fn exit_file(&self) -> &Path {
        &self.exit_file
    }

    /// Answers `method path` (e.g. `"PUT /vm.boot"`) with `status` and `body` from now on.
    pub fn respond(&self, line: &str, status: u16, body: &str) {
        let mut st = self.state.lock().expect("fake state lock");
        st.canned.insert(line.to_string(), Canned { status, body: body.to_string() });
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().expect("fake state lock").requests.clone()
    }

    /// Every request so far except `GET /vmm.ping` (readiness polling).
    pub fn calls(&self) -> Vec<Recorded> {
        self.requests().into_iter().filter(|r| r.line() != "GET /vmm.ping").collect()
    }

    /// Forgets the recorded requests.
    pub fn clear(&self) {
        self.state.lock().expect("fake state lock").requests.clear();
    }

    /// Writes an executable fake `cloud-hypervisor` into `dir`: it checks its arguments are
    /// `--api-socket <path>`, makes `<path>` a symlink to this fake's socket, and exits 0 once
    /// `PUT /vmm.shutdown` was received, the fake is dropped, or the socket link is gone (so a
    /// test that panics half-way leaves no process behind).
    pub fn write_fake_binary(&self, dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("cloud-hypervisor");
        let script = format!(
            "#!/bin/sh\n\
             [ \"$1\" = --api-socket ] && [ -n \"$2\" ] || {{ echo \"usage: $0 --api-socket PATH\" >&2; exit 2; }}\n\
             echo \"fake cloud-hypervisor listening on $2\"\n\
             ln -s '{sock}' \"$2\" || exit 3\n\
             while [ ! -e '{exit}' ] && [ -e \"$2\" ]; do sleep 0.02; done\n\
             exit 0\n",
            sock = self.socket.display(),
            exit = self.exit_file.display(),
        );
        std::fs::write(&p, script).expect("write fake binary");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Internal Server Error",
    }
}

/// Serves HTTP/1.1 requests on one connection until the peer closes it.
async fn serve(mut conn: UnixStream, st: Arc<Mutex<State>>, exit: PathBuf) -> std::io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or_default().split(' ');
        let method = first.next().unwrap_or_default().to_string();
        let target = first.next().unwrap_or_default();
        let path = target.strip_prefix("/api/v1").unwrap_or(target).to_string();
        let len: usize = lines
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let body_bytes: Vec<u8> = buf[head_end..head_end + len].to_vec();
        buf.drain(..head_end + len);
        let body = (!body_bytes.is_empty()).then(|| {
            serde_json::from_slice(&body_bytes)
                .unwrap_or_else(|e| serde_json::Value::String(format!("<not json: {e}>")))
        });
        let rec = Recorded { method, path, body };
        let line = rec.line();
        let canned = {
            let mut s = st.lock().expect("fake state lock");
            s.requests.push(rec);
            s.canned.get(&line).cloned()
        };
        let (status, body) = match canned {
            Some(c) => (c.status, c.body),
            None => match line.as_str() {
                "GET /vmm.ping" => (200, fixture("vmm.ping.response.json")),
                "GET /vm.info" => (200, fixture("vm.info.running.response.json")),
                l if l.starts_with("PUT ") => (204, String::new()),
                _ => (404, r#"["Not Found"]"#.to_string()),
            },
        };
        if line == "PUT /vmm.shutdown" && status == 204 {
            std::fs::write(&exit, b"")?;
        }
        let mut resp = format!(
            "HTTP/1.1 {status} {}\r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n",
            reason(status)
        );
        if status != 204 {
            resp.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
        }
        resp.push_str("\r\n");
        resp.push_str(&body);
        conn.write_all(resp.as_bytes()).await?;
    }
}

//! A fake cloud-hypervisor API server for tests: a tiny HTTP/1.1 responder on a Unix socket
//! that records every request and answers with the recorded response shapes in `fixtures/`.
//!
//! Every `PUT` answers `204 No Content` unless a canned failure is set with
//! [`FakeApi::respond`]; `GET /vmm.ping` and `GET /vm.info` answer the fixtures.
//! `PUT /vmm.shutdown` also creates [`FakeApi::exit_file`], which the fake cloud-hypervisor
//! script ([`FakeApi::write_fake_binary`]) waits for before exiting, like the real VMM does.
//!
//! The fake cloud-hypervisor serves its `--api-socket` itself: the script `exec`s a small Perl
//! relay ([`RELAY`]; Perl is essential on Debian) that binds that path and forwards every
//! connection to this server. The driver checks who answers a VM's socket (`SO_PEERCRED`, see
//! [`crate::peer`]): the pid that called `listen` must be the one it spawned, running as the
//! VM user in a jail — as with the real VMM, with no test-only exception in the driver. The
//! requests are still recorded and answered here, in the test process.
//! A successful `PUT /vm.snapshot` writes `config.json`, `state.json` and `memory-ranges` into
//! its destination, owned by the destination's owner (as a jailed cloud-hypervisor would), and
//! records who owned the destination then ([`FakeApi::snapshot_dirs`]).

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
    snapshot_dirs: Vec<SnapshotDir>,
}

/// A destination of `PUT /vm.snapshot` as the fake found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotDir {
    /// The directory.
    pub dir: PathBuf,
    /// Its owner uid and gid.
    pub owner: (u32, u32),
    /// Its mode (permission bits).
    pub mode: u32,
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
        // The jailed fake (the VM user) connects to it through its relay.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).expect("chmod fake api socket");
        }
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

    /// The destinations of the successful `PUT /vm.snapshot`s so far.
    pub fn snapshot_dirs(&self) -> Vec<SnapshotDir> {
        self.state.lock().expect("fake state lock").snapshot_dirs.clone()
    }

    /// Forgets the recorded requests.
    pub fn clear(&self) {
        self.state.lock().expect("fake state lock").requests.clear();
    }

    /// Writes an executable fake `cloud-hypervisor` into `dir`: it checks its arguments are
    /// `--api-socket <path> --seccomp true` (its seccomp filters are never turned off), then
    /// becomes (`exec`, same pid) the [`RELAY`] listening on `<path>` (forwarded to this
    /// fake's socket) and, next to it, on `console.sock` and `vsock.sock` (forwarded to
    /// [`SERIAL_UPSTREAM`] and [`VSOCK_UPSTREAM`] in the same directory, where a test plays the
    /// guest), and exits 0 once `PUT /vmm.shutdown` was received, the fake is dropped, or
    /// `<path>` is gone (so a test that panics half-way leaves no process behind).
    pub fn write_fake_binary(&self, dir: &Path) -> PathBuf {
        self.write_fake_binary_with(dir, "")
    }

    /// [`FakeApi::write_fake_binary`] that first runs `prelude` (shell), e.g. to flood its
    /// output. Makes `dir` searchable by everyone (the jailed fake runs as the VM user).
    pub fn write_fake_binary_with(&self, dir: &Path, prelude: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("cloud-hypervisor");
        let relay = dir.join("fake-ch-relay.pl");
        std::fs::write(&relay, RELAY).expect("write relay");
        std::fs::set_permissions(&relay, std::fs::Permissions::from_mode(0o644)).expect("chmod relay");
        let script = format!(
            "#!/bin/sh\n\
             [ \"$1\" = --api-socket ] && [ -n \"$2\" ] && [ \"$3 $4\" = \"--seccomp true\" ] || {{ echo \"usage: $0 --api-socket PATH --seccomp true\" >&2; exit 2; }}\n\
             {prelude}\n\
             echo \"fake cloud-hypervisor listening on $2\"\n\
             d=$(dirname \"$2\")\n\
             exec /usr/bin/perl '{relay}' '{exit}' \"$2\" '{sock}' \\\n\
               \"$d/{console}\" \"$d/{SERIAL_UPSTREAM}\" \"$d/{vsock}\" \"$d/{VSOCK_UPSTREAM}\"\n",
            console = super::CONSOLE_SOCKET,
            vsock = super::VSOCK_SOCKET,
            relay = relay.display(),
            sock = self.socket.display(),
            exit = self.exit_file.display(),
        );
        // The jailed fake must reach the socket and the exit file too.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
        std::fs::write(&p, script).expect("write fake binary");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }
}

/// Where the fake cloud-hypervisor relays its serial socket (`console.sock`) to: a test
/// listening here, in the VM's `jail/`, plays the guest's serial port.
pub const SERIAL_UPSTREAM: &str = "serial-upstream.sock";
/// Where the fake cloud-hypervisor relays its hybrid-vsock socket (`vsock.sock`) to.
pub const VSOCK_UPSTREAM: &str = "vsock-upstream.sock";

/// Binds `name` in the directory of `vm`'s sockets for the fake cloud-hypervisor to relay to,
/// reachable by the VM user (the jailed fake).
pub fn bind_upstream(vm: &crate::driver::Vm, name: &str) -> UnixListener {
    use std::os::unix::fs::PermissionsExt;
    let path = vm.control_socket.with_file_name(name);
    let l = UnixListener::bind(&path).expect("bind upstream");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).expect("chmod upstream");
    l
}

/// The fake cloud-hypervisor's sockets: `perl RELAY <exit-file> (<listen> <upstream>)…` binds
/// every `<listen>` and relays each connection to its `<upstream>` (a connection is closed at
/// once when its upstream does not answer), until `<exit-file>` exists or the first `<listen>`
/// is gone; exits 3 if it cannot listen.
pub const RELAY: &str = r#"use strict;
use warnings;
use IO::Select;
use IO::Socket::UNIX;
use Socket qw(SOCK_STREAM);
$SIG{PIPE} = 'IGNORE';
my ($exit, @pairs) = @ARGV;
my $path = $pairs[0];
my $sel = IO::Select->new();
my %upstream_of;
while (my ($listen, $upstream) = splice(@pairs, 0, 2)) {
    my $l = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Local => $listen, Listen => 16)
        or do { print STDERR "listen $listen: $!\n"; exit 3 };
    $upstream_of{$l} = $upstream;
    $sel->add($l);
}
my %other;
sub hang_up {
    my ($s) = @_;
    my $o = delete $other{$s};
    $sel->remove($s);
    close $s;
    if ($o) { delete $other{$o}; $sel->remove($o); close $o; }
}
while (!-e $exit && -e $path) {
    for my $s ($sel->can_read(0.02)) {
        if (my $upstream = $upstream_of{$s}) {
            my $c = $s->accept or next;
            my $u = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => $upstream);
            if (!$u) { close $c; next; }
            $other{$c} = $u;
            $other{$u} = $c;
            $sel->add($c, $u);
            next;
        }
        my $o = $other{$s} or next;
        my $n = sysread($s, my $buf, 65536);
        if (!$n) { hang_up($s); next; }
        my $off = 0;
        while ($off < $n) {
            my $w = syswrite($o, $buf, $n - $off, $off);
            if (!defined $w) { hang_up($s); last; }
            $off += $w;
        }
    }
}
exit 0;
"#;

/// Writes the files cloud-hypervisor writes into a snapshot destination, as its owner.
fn write_snapshot(dir: &Path) -> std::io::Result<SnapshotDir> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir)?;
    for (name, body) in [
        ("config.json", fixture("snapshot/config.json").into_bytes()),
        ("state.json", b"{}".to_vec()),
        ("memory-ranges", b"guest memory".to_vec()),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, body)?;
        std::os::unix::fs::chown(&p, Some(m.uid()), Some(m.gid()))?;
    }
    Ok(SnapshotDir { dir: dir.to_path_buf(), owner: (m.uid(), m.gid()), mode: m.mode() & 0o7777 })
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
        if line == "PUT /vm.snapshot" && status == 204 {
            let dest = {
                let s = st.lock().expect("fake state lock");
                s.requests.last().and_then(|r| {
                    r.body.as_ref()?.get("destination_url")?.as_str()?.strip_prefix("file://").map(PathBuf::from)
                })
            };
            if let Some(dir) = dest {
                let written = write_snapshot(&dir)?;
                st.lock().expect("fake state lock").snapshot_dirs.push(written);
            }
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

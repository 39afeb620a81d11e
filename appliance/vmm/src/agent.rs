//! Dialling a guest port with cloud-hypervisor's hybrid-vsock convention, shared by every driver:
//! connect to the VM's vsock Unix socket, write `CONNECT <port>\n`, read one line (≤ 64 bytes)
//! that must start with `OK `; the rest of the stream belongs to the guest service.
//!
//! Also the one place that speaks silkd's protocol from the host side today: [`info`], and the
//! control port's ([`CONTROL_PORT`]): [`request_poweroff`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::peer::{ConnectError, PeerCheck};
use serde::{Deserialize, Serialize};

pub use wire::CONTROL_PORT;

/// Longest accepted handshake reply line, newline included.
pub const MAX_HANDSHAKE_LINE: usize = 64;
/// Longest accepted silkd reply frame (`docs/sandboxd.md` §9.2).
pub const MAX_FRAME: usize = 8 * 1024 * 1024;

/// Errors dialling a guest port or talking to silkd.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The vsock Unix socket refused or is missing.
    #[error("connecting to {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The vsock socket is not served by the VM's hypervisor (a link, or another process's
    /// socket in its place): nothing was sent.
    #[error("refusing the vsock socket")]
    Peer(#[source] crate::peer::PeerError),
    /// Reading or writing the stream failed.
    #[error("i/o on the agent stream")]
    Io(#[from] std::io::Error),
    /// The stream closed before a full line arrived (e.g. nothing listens on the port).
    #[error("stream closed during {0}")]
    Closed(&'static str),
    /// The handshake reply did not start with `OK ` or was too long.
    #[error("bad handshake reply {0:?}")]
    BadHandshake(String),
    /// A silkd reply was not what we asked for.
    #[error("bad agent reply: {0}")]
    BadReply(String),
    /// The exchange did not finish in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Connects to `uds` and performs the `CONNECT <port>` handshake (no peer check: QEMU's
/// socket, served by the driver's own bridge; see [`dial_checked`]).
pub async fn dial(uds: &Path, port: u32) -> Result<UnixStream, DialError> {
    dial_checked(uds, port, None).await
}

/// [`dial`], with `check`: a symbolic link at `uds` or a peer other than the VM's hypervisor
/// is [`DialError::Peer`] ([`crate::peer::connect`]), before anything is written.
pub async fn dial_checked(uds: &Path, port: u32, check: Option<&PeerCheck>) -> Result<UnixStream, DialError> {
    let mut s = crate::peer::connect(uds, check).await.map_err(|e| match e {
        ConnectError::Io { socket, source } => DialError::Connect { path: socket, source },
        ConnectError::Peer(p) => DialError::Peer(p),
    })?;
    handshake(&mut s, port).await?;
    Ok(s)
}

/// Performs the client side of the handshake on an open stream. Reads byte by byte so that
/// nothing past the `OK` line is consumed.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, port: u32) -> Result<String, DialError> {
    s.write_all(format!("CONNECT {port}\n").as_bytes()).await?;
    s.flush().await?;
    let line = read_line_capped(s, MAX_HANDSHAKE_LINE, "handshake").await?;
    if !line.starts_with("OK ") {
        return Err(DialError::BadHandshake(line));
    }
    Ok(line)
}

/// Reads one `\n`-terminated line of at most `cap` bytes (newline included), one byte at a time.
pub async fn read_line_capped<S: AsyncRead + Unpin>(
    s: &mut S,
    cap: usize,
    during: &'static str,
) -> Result<String, DialError> {
    let mut buf = Vec::with_capacity(cap);
    loop {
        let mut b = [0u8; 1];
        if s.read(&mut b).await? == 0 {
            return Err(DialError::Closed(during));
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        buf.push(b[0]);
        if buf.len() >= cap {
            return Err(DialError::BadHandshake(String::from_utf8_lossy(&buf).into_owned()));
        }
    }
}

/// Longest the control-port exchange (`POWEROFF` → `OK`) may take during a shutdown.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// The share of a shutdown `timeout` the control exchange may use: half, at most
/// [`CONTROL_TIMEOUT`], so the fallback always keeps time of its own.
pub fn control_budget(timeout: Duration) -> Duration {
    (timeout / 2).min(CONTROL_TIMEOUT)
}

/// Asks the guest to power off over its control port: dial [`CONTROL_PORT`] on `uds`, send
/// `POWEROFF\n`, expect `OK\n`. `Ok` means the guest acknowledged; the caller then waits for the
/// hypervisor to exit. The whole exchange is bounded by `within`; the stream is closed on
/// return, which tells silkd the `OK` arrived. `check` as for [`dial_checked`].
pub async fn request_poweroff(uds: &Path, within: Duration, check: Option<&PeerCheck>) -> Result<(), DialError> {
    let exchange = async {
        let mut s = dial_checked(uds, CONTROL_PORT, check).await?;
        poweroff_exchange(&mut s).await
    };
    tokio::time::timeout(within, exchange).await.map_err(|_| DialError::Timeout(within))?
}

/// The `POWEROFF` → `OK` exchange on an open control stream.
pub async fn poweroff_exchange<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> Result<(), DialError> {
    s.write_all(b"POWEROFF\n").await?;
    s.flush().await?;
    let line = read_line_capped(s, MAX_HANDSHAKE_LINE, "control reply").await?;
    if line != "OK" {
        return Err(DialError::BadReply(format!("control port answered {line:?}")));
    }
    Ok(())
}

/// Sends silkd `info` and parses the `info` reply. The single place to switch to `wire` types.
pub async fn info<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> Result<AgentInfo, DialError> {
    s.write_all(b"{\"v\":1,\"op\":\"info\"}\n").await?;
    s.flush().await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let line_end = loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            break i;
        }
        if buf.len() > MAX_FRAME {
            return Err(DialError::BadReply("reply frame exceeds 8 MiB".into()));
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(DialError::Closed("info reply"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    parse_info(&buf[..line_end])
}

fn parse_info(line: &[u8]) -> Result<AgentInfo, DialError> {
    #[derive(serde::Deserialize)]
    struct Reply {
        #[serde(rename = "type")]
        kind: String,
        #[serde(flatten)]
        rest: serde_json::Value,
    }
    let r: Reply = serde_json::from_slice(line).map_err(|e| DialError::BadReply(format!("parse: {e}")))?;
    if r.kind != "info" {
        return Err(DialError::BadReply(format!("expected info, got {:?}: {}", r.kind, r.rest)));
    }
    serde_json::from_value(r.rest).map_err(|e| DialError::BadReply(format!("info fields: {e}")))
}

/// silkd's `info` reply, as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// silkd version string.
    pub version: String,
    /// Connection-model version (2 = RPCs back to back on one connection).
    pub proto: u32,
    /// Guest uptime in seconds.
    pub uptime_secs: u64,
    /// Processes tracked by silkd.
    #[serde(default)]
    pub procs: u64,
    /// Persistent shell sessions.
    #[serde(default)]
    pub sessions: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncBufReadExt;

    #[tokio::test]
    async fn dial_handshake_and_info() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("v.sock");
        let l = tokio::net::UnixListener::bind(&sock).expect("bind");
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accept");
            let mut r = tokio::io::BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).await.expect("connect line");
            assert_eq!(line, "CONNECT 2048\n");
            r.get_mut().write_all(b"OK 1073741824\n").await.expect("ok");
            line.clear();
            r.read_line(&mut line).await.expect("req");
            assert_eq!(line, "{\"v\":1,\"op\":\"info\"}\n");
            r.get_mut()
                .write_all(b"{\"type\":\"info\",\"version\":\"0.1.0\",\"proto\":2,\"uptime_secs\":12,\"procs\":1,\"sessions\":0}\n")
                .await
                .expect("reply");
        });
        let mut s = dial(&sock, 2048).await.expect("dial");
        let i = info(&mut s).await.expect("info");
        assert_eq!(i.proto, 2);
        assert_eq!(i.version, "0.1.0");
        assert_eq!(i.uptime_secs, 12);
        server.await.expect("server");
    }

    #[tokio::test]
    async fn refused_and_bad_replies() {
        let (mut a, mut b) = tokio::io::duplex(256);
        let t = tokio::spawn(async move {
            let mut buf = [0u8; 32];
            let _ = b.read(&mut buf).await;
            drop(b);
        });
        assert!(matches!(handshake(&mut a, 9).await, Err(DialError::Closed(_))));
        t.await.expect("peer");

        let (mut a, mut b) = tokio::io::duplex(256);
        b.write_all(b"NO\n").await.expect("w");
        assert!(matches!(handshake(&mut a, 9).await, Err(DialError::BadHandshake(_))));

        let (mut a, mut b) = tokio::io::duplex(256);
        b.write_all(&[b'O'; 100]).await.expect("w");
        assert!(matches!(handshake(&mut a, 9).await, Err(DialError::BadHandshake(_))));

        assert!(matches!(
            parse_info(br#"{"type":"error","kind":"internal","message":"x"}"#),
            Err(DialError::BadReply(_))
        ));
        assert!(dial(Path::new("/nonexistent/v.sock"), 1).await.is_err());
    }

    #[tokio::test]
    async fn poweroff_over_the_control_port() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("v.sock");
        let l = tokio::net::UnixListener::bind(&sock).expect("bind");
        let server = tokio::spawn(async move {
            for reply in ["OK\n", "ERR unknown command\n"] {
                let (s, _) = l.accept().await.expect("accept");
                let mut r = tokio::io::BufReader::new(s);
                let mut line = String::new();
                r.read_line(&mut line).await.expect("connect line");
                assert_eq!(line, format!("CONNECT {CONTROL_PORT}\n"));
                r.get_mut().write_all(b"OK 1\n").await.expect("ok");
                line.clear();
                r.read_line(&mut line).await.expect("command");
                assert_eq!(line, "POWEROFF\n");
                r.get_mut().write_all(reply.as_bytes()).await.expect("reply");
                // The host closes once it has the reply.
                let mut rest = Vec::new();
                r.read_to_end(&mut rest).await.expect("eof");
                assert!(rest.is_empty());
            }
        });
        request_poweroff(&sock, Duration::from_secs(5), None).await.expect("acknowledged");
        assert!(matches!(request_poweroff(&sock, Duration::from_secs(5), None).await, Err(DialError::BadReply(_))));
        server.await.expect("server");

        // Missing socket: fails at once. Silent guest: bounded by the timeout.
        let t0 = std::time::Instant::now();
        assert!(matches!(
            request_poweroff(&dir.path().join("none.sock"), Duration::from_secs(5), None).await,
            Err(DialError::Connect { .. })
        ));
        assert!(t0.elapsed() < Duration::from_secs(1));
        let silent = dir.path().join("silent.sock");
        let _l = tokio::net::UnixListener::bind(&silent).expect("bind");
        assert!(matches!(
            request_poweroff(&silent, Duration::from_millis(200), None).await,
            Err(DialError::Timeout(_))
        ));
    }
}

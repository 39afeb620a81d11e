//! The guest control port ([`wire::CONTROL_PORT`]): how the host powers a guest off cleanly
//! without ACPI (our guests have no userspace ACPI handler).
//!
//! Protocol, one command per stream: the host writes one line (at most [`MAX_LINE`] bytes,
//! newline included). `POWEROFF` → silkd answers `OK\n`, half-closes, waits up to
//! [`ACK_LINGER`] for the host to close its end (so the `OK` has really left the guest before
//! guest-init starts killing processes), then sends SIGTERM to PID 1; guest-init syncs and
//! powers off, and the hypervisor exits. Anything else → `ERR unknown command\n` and close.
//!
//! The "signal PID 1" step is injected ([`serve`]'s `signal_init`) so tests kill nothing real.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Longest accepted command line, newline included.
pub const MAX_LINE: usize = 64;
/// Time the host has to send its command line.
pub const LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait, after `OK`, for the host to close the stream before signalling PID 1.
pub const ACK_LINGER: Duration = Duration::from_secs(1);

/// The power-off command.
pub const POWEROFF: &str = "POWEROFF";
/// The reply to an accepted command.
pub const REPLY_OK: &[u8] = b"OK\n";
/// The reply to anything else.
pub const REPLY_UNKNOWN: &[u8] = b"ERR unknown command\n";

/// Why a control stream did not lead to a power-off.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Reading or writing the stream failed.
    #[error("control stream i/o")]
    Io(#[source] std::io::Error),
    /// No full command line arrived in time.
    #[error("no command line within {0:?}")]
    Timeout(Duration),
    /// The line was not a known command (overlong lines and lines cut by EOF included).
    #[error("unknown control command {0:?}")]
    Unknown(String),
    /// Signalling PID 1 failed (the host already got `OK`).
    #[error("signalling PID 1")]
    Signal(#[source] std::io::Error),
}

/// What a served control stream did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `POWEROFF` was acknowledged and PID 1 signalled.
    PowerOff,
}

/// Sends SIGTERM to PID 1 (guest-init), which powers the guest off.
pub fn sigterm_init() -> std::io::Result<()> {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    kill(Pid::from_raw(1), Signal::SIGTERM).map_err(std::io::Error::from)
}

/// Serves one control stream; `signal_init` is called after `POWEROFF` was acknowledged.
pub async fn serve<S, F>(mut stream: S, signal_init: F) -> Result<Outcome, ControlError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce() -> std::io::Result<()>,
{
    let line = match tokio::time::timeout(LINE_TIMEOUT, read_line(&mut stream)).await {
        Ok(r) => r.map_err(ControlError::Io)?,
        Err(_) => return Err(ControlError::Timeout(LINE_TIMEOUT)),
    };
    if line.as_deref() != Some(POWEROFF) {
        // Best effort: the peer may already be gone.
        let _ = stream.write_all(REPLY_UNKNOWN).await;
        let _ = stream.shutdown().await;
        return Err(ControlError::Unknown(line.unwrap_or_default()));
    }
    tracing::info!("power-off requested by the host");
    stream.write_all(REPLY_OK).await.map_err(ControlError::Io)?;
    stream.shutdown().await.map_err(ControlError::Io)?;
    // Wait for the host to close its end (or the linger to pass): once it has, our OK is out.
    let _ = tokio::time::timeout(ACK_LINGER, async {
        let mut sink = [0u8; 64];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    drop(stream);
    signal_init().map_err(ControlError::Signal)?;
    Ok(Outcome::PowerOff)
}

/// Serves a control stream with the real [`sigterm_init`], logging the outcome.
pub async fn handle<S>(stream: S, transport: &'static str)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match serve(stream, sigterm_init).await {
        Ok(Outcome::PowerOff) => tracing::info!(transport, "signalled PID 1 to power off"),
        Err(e @ ControlError::Signal(_)) => {
            tracing::error!(transport, error = %foundation::error_chain(&e), "power-off failed")
        }
        Err(e) => tracing::warn!(transport, error = %foundation::error_chain(&e), "control stream rejected"),
    }
}

/// Reads one `\n`-terminated line of at most [`MAX_LINE`] bytes, one byte at a time.
/// `None` = no valid line (overlong, cut by EOF, not UTF-8).
async fn read_line<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(MAX_LINE);
    loop {
        let mut b = [0u8; 1];
        if s.read(&mut b).await? == 0 {
            return Ok(None);
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8(buf).ok());
        }
        buf.push(b[0]);
        if buf.len() >= MAX_LINE {
            return Ok(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn counter() -> (Arc<AtomicUsize>, impl FnOnce() -> std::io::Result<()>) {
        let n = Arc::new(AtomicUsize::new(0));
        let c = n.clone();
        (n, move || {
            c.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    async fn read_all(s: &mut tokio::io::DuplexStream) -> String {
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("read reply");
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn poweroff_answers_ok_then_signals_once_the_host_closed() {
        let (mut host, guest) = tokio::io::duplex(256);
        let (signalled, signal) = counter();
        let server = tokio::spawn(serve(guest, signal));
        host.write_all(b"POWEROFF\n").await.expect("write");
        assert_eq!(read_all(&mut host).await, "OK\n");
        // The guest half-closed after OK but waits for us before signalling.
        assert_eq!(signalled.load(Ordering::SeqCst), 0);
        drop(host);
        let outcome = tokio::time::timeout(Duration::from_millis(500), server)
            .await
            .expect("signals promptly after the host closes")
            .expect("task");
        assert_eq!(outcome.expect("power off"), Outcome::PowerOff);
        assert_eq!(signalled.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn poweroff_signals_after_the_linger_if_the_host_stays() {
        let (mut host, guest) = tokio::io::duplex(256);
        let (signalled, signal) = counter();
        let server = tokio::spawn(serve(guest, signal));
        host.write_all(b"POWEROFF\n").await.expect("write");
        assert_eq!(read_all(&mut host).await, "OK\n");
        let outcome = tokio::time::timeout(ACK_LINGER * 3, server).await.expect("linger bounded").expect("task");
        assert!(matches!(outcome, Ok(Outcome::PowerOff)));
        assert_eq!(signalled.load(Ordering::SeqCst), 1);
        drop(host);
    }

    #[tokio::test]
    async fn anything_else_is_refused_without_signalling() {
        let long = format!("{}\n", "P".repeat(MAX_LINE + 10));
        for input in ["poweroff\n", "POWEROFF \n", "REBOOT\n", "POWEROFF", "", long.as_str()] {
            let (mut host, guest) = tokio::io::duplex(256);
            let (signalled, signal) = counter();
            let server = tokio::spawn(serve(guest, signal));
            host.write_all(input.as_bytes()).await.expect("write");
            host.shutdown().await.expect("half-close");
            assert_eq!(read_all(&mut host).await, "ERR unknown command\n", "input {input:?}");
            let outcome = server.await.expect("task");
            assert!(matches!(outcome, Err(ControlError::Unknown(_))), "input {input:?}: {outcome:?}");
            assert_eq!(signalled.load(Ordering::SeqCst), 0, "input {input:?}");
        }
    }

    #[tokio::test]
    async fn a_failed_signal_is_reported() {
        let (mut host, guest) = tokio::io::duplex(256);
        let server = tokio::spawn(serve(guest, || Err(std::io::Error::from_raw_os_error(libc::EPERM))));
        host.write_all(b"POWEROFF\n").await.expect("write");
        assert_eq!(read_all(&mut host).await, "OK\n");
        drop(host);
        assert!(matches!(server.await.expect("task"), Err(ControlError::Signal(_))));
    }
}

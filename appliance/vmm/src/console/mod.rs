//! The guest's serial console, bounded: what a guest writes to `ttyS0` lands in a size-capped
//! log on the host, and readers take its tail by seeking, never the whole file.
//!
//! # Why
//!
//! The console is guest-controlled: a guest that writes endlessly to its serial port must
//! not fill the state partition, nor make a host process read gigabytes into memory.
//!
//! # How
//!
//! The hypervisor never writes a file. Its serial port is a Unix stream socket in the VM's
//! socket directory (`console.sock`), drained by a task of the driver process that owns the VM
//! ([`ConsoleDrain`]) into a [`CappedLog`]:
//!
//! - **QEMU** is the socket's *client* (`-chardev socket,server=off,reconnect=1`): the driver
//!   listens ([`ConsoleDrain::listen`]) before QEMU starts, so boot output is kept from the
//!   first byte. When the driver process restarts, [`crate::Driver::attach`] listens again
//!   and QEMU reconnects within a second. While no one listens QEMU drops the output, so
//!   nothing grows and the guest never blocks on a dead host.
//! - **cloud-hypervisor** is the socket's *server* (serial `mode: Socket`); the driver dials it
//!   ([`ConsoleDrain::dial`]) and dials again after the connection ends. cloud-hypervisor
//!   keeps what the guest wrote before the first connection in its own bounded buffer.
//!
//! A slow drain slows only the guest's serial port (the hypervisor stops taking bytes from the
//! UART when the socket is full).
//!
//! [`CappedLog`] keeps at most `cap` bytes on disk, newest last, in two files:
//! `console.log` (being written) and `console.log.1` (the previous segment), each at most
//! `cap / 2`. When `console.log` is full it becomes `console.log.1` (replacing the older one)
//! and a new `console.log` starts. Every line is stamped with the host's time when its first
//! byte arrived ([`record`]: `2006-01-02T15:04:05.000000000Z text`), so the console can serve
//! as a Pod's container log with the kubelet's options. Nobody reads the files directly:
//! [`tail`], [`tail_text`] and [`tail_string`] give the text without stamps from a bounded
//! window at the end (error messages, diagnostics, tests), and [`read_log`] gives the lines a
//! [`kstream::logs::ValidLogQuery`] asks for, following the log if asked.
//!
//! Modules, lowest first: [`segments`] (the two files), [`record`] (the stamp format),
//! [`capped`] (the writer), [`tail`] (the text at the end), [`follow`] (container-log reads);
//! this file drains the hypervisor's socket into the writer.

pub mod capped;
pub mod follow;
pub mod record;
pub mod segments;
pub mod tail;

pub use capped::{CappedLog, MIN_CONSOLE_CAP};
pub use follow::{read_log, read_log_while};
pub use segments::{rotated_path, ROTATED_SUFFIX};
pub use tail::{tail, tail_string, tail_text, TAIL_TEXT_MAX};

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

use crate::peer::{ConnectError, PeerCheck};

/// Default cap on a VM's retained console, in bytes (both files together): 1 MiB — a full
/// boot log many times over, and at most 1 GiB on a node running a thousand VMs.
pub const DEFAULT_CONSOLE_CAP: u64 = 1 << 20;

/// The smallest console cap an operator setting may ask for: 16 KiB, room for a boot log's
/// tail (the log itself accepts down to [`MIN_CONSOLE_CAP`]).
pub const MIN_CONSOLE_SETTING: u64 = 16 << 10;

/// File name of the console socket in a VM's socket directory.
pub const CONSOLE_SOCKET: &str = "console.sock";

/// How much one read from the console socket takes.
const CHUNK: usize = 64 * 1024;

/// How long [`ConsoleDrain::dial`] waits between attempts.
const REDIAL: Duration = Duration::from_millis(500);

/// How long [`ConsoleDrain::dial`] waits after refusing a socket served by someone else (each
/// refusal is logged).
pub const REFUSED_REDIAL: Duration = Duration::from_secs(5);

/// A task draining one VM's console socket into its [`CappedLog`]. Dropping it stops the task
/// (and, for [`ConsoleDrain::listen`], closes the listener).
#[derive(Debug)]
pub struct ConsoleDrain {
    task: JoinHandle<()>,
}

impl Drop for ConsoleDrain {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConsoleDrain {
    /// Listens on `socket` (a stale socket file is replaced) and drains whoever connects —
    /// QEMU — into the log at `log`; a new connection replaces the previous one. Must run
    /// inside a tokio runtime.
    pub fn listen(socket: &Path, log: &Path, cap: u64) -> io::Result<Self> {
        let log = CappedLog::open(log, cap)?;
        match std::fs::remove_file(socket) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(socket)?;
        Ok(ConsoleDrain { task: tokio::spawn(serve(listener, log)) })
    }

    /// Dials `socket` — cloud-hypervisor's console socket — and drains it into the log at
    /// `log`, dialling again whenever the connection ends or cannot be made, until dropped.
    /// With `check`, every connection refuses a symbolic link and a peer other than the VM's
    /// hypervisor ([`crate::peer::connect`], which logs it); a refused socket is dialled
    /// again only after [`REFUSED_REDIAL`]. Must run inside a tokio runtime.
    pub fn dial(socket: &Path, log: &Path, cap: u64, check: Option<PeerCheck>) -> io::Result<Self> {
        let log = CappedLog::open(log, cap)?;
        Ok(ConsoleDrain { task: tokio::spawn(redial(socket.to_path_buf(), log, check)) })
    }
}

/// Writes a chunk to the log; a failing disk is reported once and the output dropped (the
/// guest must never block on it).
fn sink(log: &mut CappedLog, chunk: &[u8], failed: &mut bool) {
    match log.write(chunk) {
        Ok(()) => *failed = false,
        Err(e) if !*failed => {
            *failed = true;
            tracing::warn!(log = %log.path().display(), error = %e, "console log write failed; dropping console output");
        }
        Err(_) => {}
    }
}

async fn read_some(conn: &mut Option<UnixStream>, buf: &mut [u8]) -> io::Result<usize> {
    match conn {
        Some(c) => c.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn serve(listener: UnixListener, mut log: CappedLog) {
    let mut conn: Option<UnixStream> = None;
    let mut buf = vec![0u8; CHUNK];
    let mut failed = false;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => conn = Some(s),
                Err(e) => {
                    tracing::warn!(log = %log.path().display(), error = %e, "console socket accept failed");
                    tokio::time::sleep(REDIAL).await;
                }
            },
            read = read_some(&mut conn, &mut buf) => match read {
                Ok(0) | Err(_) => conn = None,
                Ok(n) => sink(&mut log, &buf[..n], &mut failed),
            },
        }
    }
}

async fn redial(socket: PathBuf, mut log: CappedLog, check: Option<PeerCheck>) {
    let mut buf = vec![0u8; CHUNK];
    let mut failed = false;
    loop {
        match crate::peer::connect(&socket, check.as_ref()).await {
            Ok(mut s) => {
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    sink(&mut log, &buf[..n], &mut failed);
                }
            }
            Err(ConnectError::Peer(_)) => {
                tokio::time::sleep(REFUSED_REDIAL).await;
                continue;
            }
            Err(ConnectError::Io { .. }) => {}
        }
        tokio::time::sleep(REDIAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn on_disk(path: &Path) -> u64 {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        size(path) + size(&rotated_path(path))
    }

    async fn wait_for(path: &Path, pred: impl Fn(&[u8]) -> bool) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = tail(path, 1 << 20).expect("tail");
            if pred(&got) {
                return got;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out; log holds {} bytes", got.len());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_guest_flooding_the_listened_console_is_held_to_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sock, path) = (dir.path().join(CONSOLE_SOCKET), dir.path().join("console.log"));
        let cap = 64 * 1024;
        let drain = ConsoleDrain::listen(&sock, &path, cap).expect("listen");
        // The fake QEMU: 8 MiB, far past the cap, then a marker.
        let mut qemu = UnixStream::connect(&sock).await.expect("connect");
        let block = vec![b'x'; 256 * 1024];
        for _ in 0..32 {
            qemu.write_all(&block).await.expect("write");
            assert!(on_disk(&path) <= cap);
        }
        qemu.write_all(b"\nthe end\n").await.expect("marker");
        wait_for(&path, |b| b.ends_with(b"\nthe end\n")).await;
        assert!(on_disk(&path) <= cap, "{} bytes on disk", on_disk(&path));
        // A restart of the host side: a new drain takes the socket over; the client (QEMU
        // reconnecting) is drained into the same, still capped, log.
        drop(qemu);
        drop(drain);
        let _drain = ConsoleDrain::listen(&sock, &path, cap).expect("listen again");
        let mut qemu = UnixStream::connect(&sock).await.expect("reconnect");
        qemu.write_all(b"after restart\n").await.expect("write");
        let got = wait_for(&path, |b| b.ends_with(b"after restart\n")).await;
        assert!(got.ends_with(b"\nthe end\nafter restart\n"), "the log continues across restarts");
        assert!(on_disk(&path) <= cap);
    }

    #[tokio::test]
    async fn a_new_connection_replaces_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sock, path) = (dir.path().join(CONSOLE_SOCKET), dir.path().join("console.log"));
        let _drain = ConsoleDrain::listen(&sock, &path, 4096).expect("listen");
        let mut first = UnixStream::connect(&sock).await.expect("connect");
        first.write_all(b"first\n").await.expect("write");
        wait_for(&path, |b| b.ends_with(b"first\n")).await;
        let mut second = UnixStream::connect(&sock).await.expect("connect");
        second.write_all(b"second\n").await.expect("write");
        wait_for(&path, |b| b.ends_with(b"first\nsecond\n")).await;
    }

    #[tokio::test]
    async fn the_dialling_drain_is_capped_and_redials() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sock, path) = (dir.path().join(CONSOLE_SOCKET), dir.path().join("console.log"));
        let cap = 32 * 1024;
        // The drain starts before the fake cloud-hypervisor listens: it keeps dialling.
        let _drain = ConsoleDrain::dial(&sock, &path, cap, None).expect("dial");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let listener = UnixListener::bind(&sock).expect("bind");
        let (mut ch, _) = listener.accept().await.expect("accept");
        let block = vec![b'y'; 64 * 1024];
        for _ in 0..64 {
            ch.write_all(&block).await.expect("write");
        }
        ch.write_all(b"\nfirst session\n").await.expect("marker");
        wait_for(&path, |b| b.ends_with(b"\nfirst session\n")).await;
        assert!(on_disk(&path) <= cap, "{}", on_disk(&path));
        drop(ch);
        let (mut ch, _) = listener.accept().await.expect("the drain dials again");
        ch.write_all(b"second session\n").await.expect("write");
        wait_for(&path, |b| b.ends_with(b"first session\nsecond session\n")).await;
        assert!(on_disk(&path) <= cap);
    }
}

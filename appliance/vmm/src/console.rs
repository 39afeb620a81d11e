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
//! and a new `console.log` starts. `cat console.log.1 console.log` is the retained console.
//! [`tail`] and [`tail_text`] are the one way to read it: they seek to the end of the two
//! files and read at most what they were asked for.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

use crate::peer::{ConnectError, PeerCheck};

/// Default cap on a VM's retained console, in bytes (both files together): 1 MiB — a full
/// boot log many times over, and at most 1 GiB on a node running a thousand VMs.
pub const DEFAULT_CONSOLE_CAP: u64 = 1 << 20;

/// The smallest cap [`CappedLog`] accepts (two segments of at least one byte).
pub const MIN_CONSOLE_CAP: u64 = 2;

/// File name of the console socket in a VM's socket directory.
pub const CONSOLE_SOCKET: &str = "console.sock";

/// Suffix of the previous segment: `console.log` → `console.log.1`.
pub const ROTATED_SUFFIX: &str = ".1";

/// How many bytes [`tail_text`] reads at most.
pub const TAIL_TEXT_MAX: usize = 64 * 1024;

/// How much one read from the console socket takes.
const CHUNK: usize = 64 * 1024;

/// How long [`ConsoleDrain::dial`] waits between attempts.
const REDIAL: Duration = Duration::from_millis(500);

/// How long [`ConsoleDrain::dial`] waits after refusing a socket served by someone else (each
/// refusal is logged).
pub const REFUSED_REDIAL: Duration = Duration::from_secs(5);

/// The previous segment of the log at `path`: `<path>.1`.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(ROTATED_SUFFIX);
    PathBuf::from(s)
}

/// A log of at most `cap` bytes on disk in two files (see the module docs). Reopening an
/// existing log continues it (and trims files left larger than a segment).
#[derive(Debug)]
pub struct CappedLog {
    path: PathBuf,
    file: File,
    len: u64,
    segment: u64,
    cap: u64,
}

impl CappedLog {
    /// Opens (or creates) the log at `path` keeping at most `cap` bytes (at least
    /// [`MIN_CONSOLE_CAP`]; a smaller cap is raised to it).
    pub fn open(path: &Path, cap: u64) -> io::Result<Self> {
        let cap = cap.max(MIN_CONSOLE_CAP);
        let segment = cap / 2;
        let old = rotated_path(path);
        keep_tail(&old, segment)?;
        let file = append(path)?;
        let len = file.metadata()?.len();
        let mut log = CappedLog { path: path.to_path_buf(), file, len, segment, cap };
        if len > segment {
            log.rotate()?;
            keep_tail(&old, segment)?;
        }
        Ok(log)
    }

    /// Appends `buf`, rotating as needed; of a `buf` longer than the cap only its newest
    /// `cap` bytes are written (the rest would be rotated away at once).
    pub fn write(&mut self, buf: &[u8]) -> io::Result<()> {
        let cap = usize::try_from(self.cap).unwrap_or(usize::MAX);
        let mut buf = &buf[buf.len().saturating_sub(cap)..];
        while !buf.is_empty() {
            if self.len >= self.segment {
                self.rotate()?;
            }
            let room = usize::try_from(self.segment - self.len).unwrap_or(usize::MAX);
            let (now, rest) = buf.split_at(room.min(buf.len()));
            self.file.write_all(now)?;
            self.len += now.len() as u64;
            buf = rest;
        }
        Ok(())
    }

    /// The log's path (the current segment).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cap, in bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    fn rotate(&mut self) -> io::Result<()> {
        std::fs::rename(&self.path, rotated_path(&self.path))?;
        self.file = append(&self.path)?;
        self.len = 0;
        Ok(())
    }
}

/// Opens `path` for appending, creating it 0600 (the guest's output is nobody else's to read;
/// the VM user may search a cloud-hypervisor VM's directory).
fn append(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new().create(true).append(true).mode(0o600).open(path)
}

/// Shrinks the file at `path` (if any) to its last `max` bytes.
fn keep_tail(path: &Path, max: u64) -> io::Result<()> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if len <= max {
        return Ok(());
    }
    let tail = read_tail(path, usize::try_from(max).unwrap_or(usize::MAX))?;
    foundation::write_atomic(path, &tail, foundation::SECRET_FILE)
}

/// The last `max` bytes of one file (fewer if it is shorter; empty if it is missing).
fn read_tail(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let want = len.min(max as u64);
    f.seek(SeekFrom::Start(len - want))?;
    let mut out = Vec::with_capacity(want as usize);
    f.take(want).read_to_end(&mut out)?;
    Ok(out)
}

/// The newest `max` bytes of the console log at `path` (both segments), reading only them.
/// A missing log is empty.
pub fn tail(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let newest = read_tail(path, max)?;
    if newest.len() >= max {
        return Ok(newest);
    }
    let mut out = read_tail(&rotated_path(path), max - newest.len())?;
    out.extend_from_slice(&newest);
    Ok(out)
}

/// The last `lines` lines of the console log at `path` as text (lossy UTF-8), from at most its
/// last [`TAIL_TEXT_MAX`] bytes; empty when the log cannot be read. For error messages.
pub fn tail_text(path: &Path, lines: usize) -> String {
    let bytes = tail(path, TAIL_TEXT_MAX).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes);
    let last: Vec<&str> = text.lines().rev().take(lines).collect();
    last.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// The newest `max` bytes of the console log at `path` as text (lossy UTF-8); empty when the
/// log cannot be read. For tests and tools that search the retained console.
pub fn tail_string(path: &Path, max: usize) -> String {
    String::from_utf8_lossy(&tail(path, max).unwrap_or_default()).into_owned()
}

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

    /// A deterministic byte stream: byte `i` is `i % 251`.
    fn stream(from: usize, len: usize) -> Vec<u8> {
        (from..from + len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn a_log_fed_past_its_cap_stays_under_it_and_keeps_the_newest_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let cap = 1000;
        let mut log = CappedLog::open(&path, cap).expect("open");
        let mut written = 0;
        for size in [1, 7, 300, 499, 500, 501, 999, 1000, 1001, 5000, 3, 64 * 1024] {
            log.write(&stream(written, size)).expect("write");
            written += size;
            assert!(on_disk(&path) <= cap, "{} bytes on disk after {written} written", on_disk(&path));
            assert!(std::fs::metadata(&path).expect("current").len() <= cap / 2);
        }
        // The newest half-cap at least is always retained, in order.
        let kept = tail(&path, cap as usize).expect("tail");
        assert!(kept.len() as u64 >= cap / 2, "kept {}", kept.len());
        assert_eq!(kept, stream(written - kept.len(), kept.len()), "the newest bytes, in order");
        assert_eq!(tail(&path, 10).expect("tail 10"), stream(written - 10, 10));
    }

    #[test]
    fn reopening_continues_the_log_and_trims_oversized_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        // Files left by an unbounded writer (an older version): far over the cap.
        std::fs::write(&path, stream(0, 10_000)).expect("seed");
        std::fs::write(rotated_path(&path), vec![b'o'; 20_000]).expect("seed old");
        let mut log = CappedLog::open(&path, 1000).expect("open");
        assert!(on_disk(&path) <= 1000, "{}", on_disk(&path));
        assert_eq!(tail(&path, 500).expect("tail"), stream(9_500, 500), "the newest bytes survive the trim");
        log.write(b"more").expect("write");
        drop(log);
        let mut log = CappedLog::open(&path, 1000).expect("reopen");
        log.write(b"!").expect("write");
        assert!(tail(&path, 1000).expect("tail").ends_with(b"more!"));
        assert!(on_disk(&path) <= 1000);
    }

    #[test]
    fn tail_reads_across_both_segments_and_a_missing_log_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        assert_eq!(tail(&path, 100).expect("missing"), b"");
        assert_eq!(tail_text(&path, 5), "");
        std::fs::write(rotated_path(&path), b"one\ntwo\n").expect("old");
        std::fs::write(&path, b"three\nfour\n").expect("new");
        assert_eq!(tail(&path, 100).expect("tail"), b"one\ntwo\nthree\nfour\n");
        assert_eq!(tail(&path, 8).expect("tail"), b"ee\nfour\n");
        assert_eq!(tail(&path, 13).expect("tail"), b"o\nthree\nfour\n");
        assert_eq!(tail_text(&path, 3), "two\nthree\nfour");
        assert_eq!(tail_string(&path, 9), "ree\nfour\n");
        std::fs::write(&path, [0xff, b'\n', b'x']).expect("binary");
        assert_eq!(tail_text(&path, 1), "x");
    }

    #[test]
    fn tail_text_reads_at_most_its_window() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut big = vec![b'a'; 3 * TAIL_TEXT_MAX];
        big.extend_from_slice(b"\nlast line");
        std::fs::write(&path, &big).expect("write");
        let t = tail_text(&path, 1_000_000);
        assert!(t.len() <= TAIL_TEXT_MAX && t.ends_with("\nlast line"), "{}", t.len());
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

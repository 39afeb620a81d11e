//! Per-service logs: every line a child writes to stdout or stderr (and every supervisor event
//! about it) goes to three places:
//! 1. a ring buffer of the last [`RING_LINES`] lines (`chrysalis logs <svc>`, `GET /v1/logs/…`),
//! 2. `<state>/logs/<svc>.log` (0600 in a 0700 directory: service output is for the operator),
//!    rotated to `<svc>.log.1` at [`FILE_CAP`] bytes (two files kept),
//! 3. the supervisor's own `tracing` output with a `service` field (so journald / the serial
//!    console see the whole appliance in one structured stream).
//!
//! Lines longer than [`MAX_LINE`] bytes are split; invalid UTF-8 is replaced.

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt as _};

/// Lines kept in memory per service.
pub const RING_LINES: usize = 2000;
/// A log file is rotated when it grows past this many bytes.
pub const FILE_CAP: u64 = 8 << 20;
/// Longer lines are split.
pub const MAX_LINE: usize = 16 << 10;

/// Why a log file could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LogsError {
    /// The log directory or file could not be created.
    #[error("opening the log file {}", .path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Where a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    /// The child's stdout.
    Stdout,
    /// The child's stderr.
    Stderr,
    /// The supervisor (started, exited, restarting).
    Supervisor,
}

impl Stream {
    /// `stdout`, `stderr`, `supervisor`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
            Stream::Supervisor => "supervisor",
        }
    }
}

/// One line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// Unix time in milliseconds.
    pub ts_ms: u64,
    /// Source stream.
    pub stream: Stream,
    /// The text (no newline).
    pub line: String,
}

struct RotatingFile {
    path: PathBuf,
    cap: u64,
    size: u64,
    file: Option<std::fs::File>,
}

/// Opens `path` for appending, created 0600 (service output is for the operator only); an
/// existing file is tightened to 0600.
fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let f = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

impl RotatingFile {
    fn open(path: &Path, cap: u64) -> Result<Self, LogsError> {
        let err = |source| LogsError::Open { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent() {
            foundation::private_dir(dir).map_err(err)?;
        }
        let file = open_private(path).map_err(err)?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(RotatingFile { path: path.to_path_buf(), cap, size, file: Some(file) })
    }

    fn write(&mut self, text: &str) {
        if self.size >= self.cap {
            self.rotate();
        }
        if let Some(f) = &mut self.file {
            // A full disk must not stop the service; the ring buffer and tracing still get it.
            if f.write_all(text.as_bytes()).is_ok() {
                self.size += text.len() as u64;
            }
        }
    }

    fn rotate(&mut self) {
        self.file = None;
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let _ = std::fs::rename(&self.path, &old);
        self.file = open_private(&self.path).ok();
        self.size = 0;
    }
}

/// One service's log.
pub struct ServiceLog {
    service: String,
    ring: Mutex<VecDeque<LogLine>>,
    file: Option<Mutex<RotatingFile>>,
}

impl std::fmt::Debug for ServiceLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceLog").field("service", &self.service).finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl ServiceLog {
    /// A log for `service` written to `<dir>/<service>.log` (`dir = None`: memory only).
    pub fn open(service: &str, dir: Option<&Path>) -> Result<Self, LogsError> {
        Self::open_with_cap(service, dir, FILE_CAP)
    }

    /// A memory-only log (no file).
    pub fn memory(service: &str) -> Self {
        ServiceLog { service: service.to_string(), ring: Mutex::new(VecDeque::new()), file: None }
    }

    /// [`ServiceLog::open`] with another rotation size (tests).
    pub fn open_with_cap(service: &str, dir: Option<&Path>, cap: u64) -> Result<Self, LogsError> {
        let file = match dir {
            Some(d) => Some(Mutex::new(RotatingFile::open(&d.join(format!("{service}.log")), cap)?)),
            None => None,
        };
        Ok(ServiceLog { service: service.to_string(), ring: Mutex::new(VecDeque::new()), file })
    }

    /// The service name.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// Records a line (ring + file); child lines are also re-emitted through `tracing`.
    pub fn push(&self, stream: Stream, line: &str) {
        let entry = LogLine { ts_ms: now_ms(), stream, line: line.to_string() };
        if stream != Stream::Supervisor {
            tracing::info!(target: "chrysalis::service", service = %self.service, stream = stream.as_str(), "{line}");
        }
        if let Some(f) = &self.file {
            let ts = humantime::format_rfc3339_millis(UNIX_EPOCH + std::time::Duration::from_millis(entry.ts_ms));
            // A poisoned lock only means a panic mid-write elsewhere; the file handle is still usable.
            f.lock().unwrap_or_else(|p| p.into_inner()).write(&format!("{ts} {} {line}\n", stream.as_str()));
        }
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() >= RING_LINES {
            ring.pop_front();
        }
        ring.push_back(entry);
    }

    /// The last `n` lines (all when `n` is larger), oldest first.
    pub fn tail(&self, n: usize) -> Vec<LogLine> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.iter().skip(ring.len().saturating_sub(n)).cloned().collect()
    }
}

/// Reads `reader` to EOF, recording each line.
pub async fn capture(mut reader: impl AsyncRead + Unpin, stream: Stream, log: std::sync::Arc<ServiceLog>) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        loop {
            let window = &pending[..pending.len().min(MAX_LINE + 1)];
            if let Some(pos) = window.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=pos).collect();
                emit(&log, stream, &line[..line.len() - 1]);
            } else if pending.len() >= MAX_LINE {
                let chunk: Vec<u8> = pending.drain(..MAX_LINE).collect();
                emit(&log, stream, &chunk);
            } else {
                break;
            }
        }
    }
    if !pending.is_empty() {
        emit(&log, stream, &pending);
    }
}

fn emit(log: &ServiceLog, stream: Stream, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    log.push(stream, text.trim_end_matches('\r'));
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn lines_are_split_capped_and_kept_in_order() {
        let log = Arc::new(ServiceLog::open("svc", None).unwrap());
        let long = "x".repeat(MAX_LINE + 10);
        let input = format!("one\ntwo\r\n{long}\nlast-without-newline");
        capture(input.as_bytes(), Stream::Stderr, log.clone()).await;
        let lines: Vec<String> = log.tail(100).into_iter().map(|l| l.line).collect();
        assert_eq!(lines.len(), 5);
        assert_eq!(&lines[..2], ["one", "two"]);
        assert_eq!(lines[2].len(), MAX_LINE);
        assert_eq!(lines[3], "x".repeat(10));
        assert_eq!(lines[4], "last-without-newline");
        assert_eq!(log.tail(1)[0].stream, Stream::Stderr);
    }

    #[test]
    fn the_ring_keeps_the_last_lines() {
        let log = ServiceLog::open("svc", None).unwrap();
        for i in 0..RING_LINES + 5 {
            log.push(Stream::Stdout, &format!("{i}"));
        }
        let all = log.tail(usize::MAX);
        assert_eq!(all.len(), RING_LINES);
        assert_eq!(all[0].line, "5");
        assert_eq!(log.tail(2).iter().map(|l| l.line.as_str()).collect::<Vec<_>>(), ["2003", "2004"]);
        assert!(log.tail(0).is_empty());
    }

    #[test]
    fn files_rotate_at_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let log = ServiceLog::open_with_cap("svc", Some(dir.path()), 200).unwrap();
        for i in 0..20 {
            log.push(Stream::Stdout, &format!("line {i:02} with some padding"));
        }
        let cur = std::fs::read_to_string(dir.path().join("svc.log")).unwrap();
        let old = std::fs::read_to_string(dir.path().join("svc.log.1")).unwrap();
        assert!(cur.len() <= 200 + 80, "{}", cur.len());
        assert!(cur.contains("line 19"), "{cur}");
        assert!(old.contains(" stdout line "), "{old}");
        assert!(!dir.path().join("svc.log.2").exists());
    }
}

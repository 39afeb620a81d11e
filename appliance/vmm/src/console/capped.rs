//! [`CappedLog`]: a log of at most `cap` bytes on disk in two segments, each line stamped with
//! the time its first byte arrived ([`super::record`]).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::record::{prefix, LINE_MAX, PREFIX_LEN, RECORD_MAX};
use super::segments::{read_window, rotated_path};

/// The smallest cap [`CappedLog`] accepts: two segments that each hold a record's prefix, a
/// byte of text and a newline.
pub const MIN_CONSOLE_CAP: u64 = 2 * (PREFIX_LEN as u64 + 2);

/// A log of at most `cap` bytes on disk in two files (see the module docs of
/// [`crate::console`]), every line stamped. Reopening an existing log continues it (and trims
/// files left larger than a segment).
#[derive(Debug)]
pub struct CappedLog {
    path: PathBuf,
    file: File,
    len: u64,
    segment: u64,
    cap: u64,
    /// The line being written (its time and how much text its record holds), if the last byte
    /// written is not a newline.
    line: Option<OpenLine>,
}

#[derive(Debug, Clone, Copy)]
struct OpenLine {
    stamp: SystemTime,
    len: usize,
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
        let mut log = CappedLog { path: path.to_path_buf(), file, len, segment, cap, line: None };
        if len > segment {
            log.rotate()?;
            keep_tail(&old, segment)?;
        }
        // A line cut short by a restart goes on where it stopped.
        if read_window(path, 1)?.bytes.last().is_some_and(|&b| b != b'\n') {
            log.line = Some(OpenLine { stamp: SystemTime::now(), len: 0 });
        }
        Ok(log)
    }

    /// Appends `buf`, arrived now ([`CappedLog::write_at`]).
    pub fn write(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_at(SystemTime::now(), buf)
    }

    /// Appends `buf`, arrived at `at`: each line that starts in it is stamped `at` (a line
    /// already open keeps its time), a segment that starts inside a line repeats the line's
    /// time, a line is ended after [`LINE_MAX`] bytes. Of a `buf` longer than the cap only its
    /// newest `cap` bytes are written (the rest would be rotated away at once).
    pub fn write_at(&mut self, at: SystemTime, buf: &[u8]) -> io::Result<()> {
        let cap = usize::try_from(self.cap).unwrap_or(usize::MAX);
        let mut buf = &buf[buf.len().saturating_sub(cap)..];
        while !buf.is_empty() {
            let mut line = match self.line {
                None => {
                    // Room for the prefix, a byte of text and a newline of ours.
                    if self.len + PREFIX_LEN as u64 + 2 > self.segment {
                        self.rotate()?;
                    }
                    self.put(&prefix(at))?;
                    OpenLine { stamp: at, len: 0 }
                }
                Some(line) if self.len + 2 > self.segment => {
                    self.rotate()?;
                    self.put(&prefix(line.stamp))?;
                    line
                }
                Some(line) => line,
            };
            // At least 1: the checks above leave room for a byte and a newline.
            let room = usize::try_from(self.segment - self.len - 1).unwrap_or(usize::MAX).min(LINE_MAX - line.len);
            let window = &buf[..room.min(buf.len())];
            let end = window.iter().position(|&b| b == b'\n').map_or(window.len(), |i| i + 1);
            let (now, rest) = buf.split_at(end);
            self.put(now)?;
            line.len += end;
            self.line = Some(line);
            if now.ends_with(b"\n") {
                self.line = None;
            } else if line.len >= LINE_MAX {
                self.put(b"\n")?;
                self.line = None;
            }
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

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(())
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

/// Shrinks the file at `path` (if any) to its last `max` bytes, from the first record that
/// starts in them when one does within a record's length.
fn keep_tail(path: &Path, max: u64) -> io::Result<()> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if len <= max {
        return Ok(());
    }
    let tail = read_window(path, usize::try_from(max).unwrap_or(usize::MAX))?.bytes;
    let start = tail[..tail.len().min(RECORD_MAX)].iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
    foundation::write_atomic(path, &tail[start..], foundation::SECRET_FILE)
}

#[cfg(test)]
mod tests {
    use super::super::record::strip;
    use super::*;
    use std::time::Duration;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    }

    fn on_disk(path: &Path) -> u64 {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        size(path) + size(&rotated_path(path))
    }

    fn text_bytes(path: &Path) -> Vec<u8> {
        let old = std::fs::read(rotated_path(path)).unwrap_or_default();
        let cur = std::fs::read(path).unwrap_or_default();
        let mut all = strip(&old);
        all.extend(strip(&cur));
        all
    }

    fn text(path: &Path) -> String {
        String::from_utf8_lossy(&text_bytes(path)).into_owned()
    }

    fn raw(path: &Path) -> String {
        String::from_utf8_lossy(&std::fs::read(path).expect("read")).into_owned()
    }

    /// A deterministic byte stream: byte `i` is `i % 251`.
    fn stream(from: usize, len: usize) -> Vec<u8> {
        (from..from + len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn each_line_is_stamped_with_the_arrival_of_its_first_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 1 << 20).expect("open");
        log.write_at(t(1), b"boot: one\nboot: tw").expect("write");
        log.write_at(t(2), b"o\nthree\n").expect("write");
        assert_eq!(
            raw(&path),
            "1970-01-01T00:00:01.000000000Z boot: one\n1970-01-01T00:00:01.000000000Z boot: two\n\
             1970-01-01T00:00:02.000000000Z three\n"
        );
        // A restart in the middle of a line: the line goes on, unstamped again.
        log.write_at(t(3), b"prompt$ ").expect("write");
        drop(log);
        let mut log = CappedLog::open(&path, 1 << 20).expect("reopen");
        log.write_at(t(4), b"ls\n").expect("write");
        assert!(raw(&path).ends_with("1970-01-01T00:00:03.000000000Z prompt$ ls\n"), "{}", raw(&path));
        assert_eq!(text(&path), "boot: one\nboot: two\nthree\nprompt$ ls\n");
    }

    #[test]
    fn a_segment_starting_inside_a_line_repeats_the_lines_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 200).expect("open");
        log.write_at(t(1), &[b'a'; 60]).expect("write");
        log.write_at(t(2), &[b'b'; 60]).expect("write");
        log.write_at(t(3), b"\n").expect("write");
        let (old, cur) = (raw(&rotated_path(&path)), raw(&path));
        assert!(old.starts_with("1970-01-01T00:00:01.000000000Z aaa") && !old.ends_with('\n'), "{old}");
        assert!(cur.starts_with("1970-01-01T00:00:01.000000000Z "), "the line's own time: {cur}");
        assert!(cur.ends_with("b\n"), "{cur}");
        assert!(std::fs::metadata(&path).expect("cur").len() <= 100);
        assert_eq!(text(&path), format!("{}{}\n", "a".repeat(60), "b".repeat(60)));
    }

    #[test]
    fn a_line_longer_than_line_max_is_split() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 1 << 20).expect("open");
        log.write_at(t(1), &vec![b'x'; LINE_MAX + 10]).expect("write");
        log.write_at(t(2), b"y\n").expect("write");
        let got = text(&path);
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len(), 2, "one line of LINE_MAX, then the rest");
        assert_eq!(lines[0].len(), LINE_MAX);
        assert_eq!(lines[1], format!("{}y", "x".repeat(10)));
        assert!(
            raw(&path).contains("\n1970-01-01T00:00:01.000000000Z xxxxxxxxxxy\n"),
            "the rest keeps the chunk's time"
        );
    }

    #[test]
    fn a_log_fed_past_its_cap_stays_under_it_and_keeps_the_newest_text() {
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
        // What is kept is the newest text, in order: well over a quarter of the cap here (lines
        // of 251 bytes: a prefix each, and one for a segment that starts inside a line).
        let kept = text_bytes(&path);
        assert!(kept.len() as u64 >= cap / 4, "kept {}", kept.len());
        assert!(kept == stream(written - kept.len(), kept.len()), "the newest bytes, in order");
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
        log.write(b"more").expect("write");
        drop(log);
        let mut log = CappedLog::open(&path, 1000).expect("reopen");
        log.write(b"!").expect("write");
        assert!(text(&path).ends_with("more!"));
        assert!(on_disk(&path) <= 1000);
    }

    #[test]
    fn the_smallest_cap_still_holds_a_record_per_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 2).expect("open");
        assert_eq!(log.cap(), MIN_CONSOLE_CAP);
        log.write(b"abc\ndef\n").expect("write");
        assert!(on_disk(&path) <= MIN_CONSOLE_CAP);
        assert!(text(&path).ends_with("f\n"), "{}", text(&path));
    }
}

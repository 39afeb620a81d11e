//! The console's text without its stamps, from its end: [`tail`], [`tail_text`] and
//! [`tail_string`] seek to the end of the two segments and read a bounded window.

use std::io;
use std::path::Path;

use super::record::{strip, RECORD_MAX};
use super::segments::{read_window, rotated_path, Window};

/// How many bytes [`tail_text`] reads at most.
pub const TAIL_TEXT_MAX: usize = 64 * 1024;

/// The text of a window: from its first whole record (a window that starts inside a file
/// starts inside a record, which ends within [`RECORD_MAX`] bytes unless the log was written
/// unstamped; then the window is text as it is).
fn text(w: &Window) -> Vec<u8> {
    let head = &w.bytes[..w.bytes.len().min(RECORD_MAX)];
    let from = match w.whole {
        true => 0,
        false => head.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1),
    };
    strip(&w.bytes[from..])
}

/// The newest text of the console log at `path` (both segments, stamps removed): at most
/// `max` bytes, read from at most the newest `max` + one record's bytes on disk. A missing log
/// is empty.
pub fn tail(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let reach = max.saturating_add(RECORD_MAX);
    let newest = read_window(path, reach)?;
    let mut out = Vec::new();
    if newest.whole && newest.bytes.len() < reach {
        out = text(&read_window(&rotated_path(path), reach - newest.bytes.len())?);
    }
    out.extend(text(&newest));
    let cut = out.len().saturating_sub(max);
    out.drain(..cut);
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

/// The newest `max` bytes of the console log's text at `path` (lossy UTF-8); empty when the
/// log cannot be read. For tests and tools that search the retained console.
pub fn tail_string(path: &Path, max: usize) -> String {
    String::from_utf8_lossy(&tail(path, max).unwrap_or_default()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::super::capped::CappedLog;
    use super::*;
    use std::time::{Duration, SystemTime};

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    }

    #[test]
    fn tail_reads_across_both_segments_and_a_missing_log_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        assert_eq!(tail(&path, 100).expect("missing"), b"");
        assert_eq!(tail_text(&path, 5), "");
        // Unstamped files (written before lines were stamped) read as they are.
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
    fn the_readers_give_the_text_unchanged_by_stamps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        // Small segments: the text crosses a rotation in the middle of a line.
        let mut log = CappedLog::open(&path, 300).expect("open");
        log.write_at(t(1), b"[    0.1] Linux version\n[    0.2] guest-in").expect("write");
        log.write_at(t(2), b"it: silkd up\nlogin: ").expect("write");
        assert!(std::fs::metadata(rotated_path(&path)).is_ok(), "rotated");
        let all = "[    0.1] Linux version\n[    0.2] guest-init: silkd up\nlogin: ";
        assert!(all.ends_with(&tail_string(&path, 1000)), "{:?}", tail_string(&path, 1000));
        assert_eq!(tail_text(&path, 2), "[    0.2] guest-init: silkd up\nlogin: ");
        assert_eq!(tail(&path, 7).expect("tail"), b"login: ");
        assert_eq!(tail_string(&path, 19), "t: silkd up\nlogin: ");
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
}

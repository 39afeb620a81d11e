//! How a console log stamps lines: each record is `<time> <text>`, where `<time>` is the host's
//! clock when the line's first byte arrived, written as [`kstream::logs::format_timestamp`]
//! does (UTC, RFC 3339, nine fractional digits) and `<text>` runs through the guest's newline.
//!
//! A record's text ends in `\n` except the last record of a segment, which may be open: the
//! line goes on in the next segment, whose first record repeats the line's time. A line longer
//! than [`LINE_MAX`] is ended there with a `\n` of ours. [`Records`] turns bytes of a segment
//! back into pieces of text with their times; text without a prefix (a log written before
//! lines were stamped) passes through with the last time seen.

use std::time::SystemTime;

use kstream::logs::{format_timestamp, parse_timestamp, TIMESTAMP_LEN};

/// Bytes of a record's prefix: the time and a space.
pub const PREFIX_LEN: usize = TIMESTAMP_LEN + 1;

/// The longest text a record holds; a longer line is split into several.
pub const LINE_MAX: usize = 16 * 1024;

/// The longest record on disk: prefix, [`LINE_MAX`] bytes of text, the newline.
pub const RECORD_MAX: usize = PREFIX_LEN + LINE_MAX + 1;

/// The prefix of a record stamped `at`.
pub fn prefix(at: SystemTime) -> Vec<u8> {
    let mut p = format_timestamp(at).into_bytes();
    p.push(b' ');
    p
}

/// The time of a prefix, if `bytes` is one.
fn parse_prefix(bytes: &[u8]) -> Option<SystemTime> {
    let (&space, stamp) = bytes.split_last()?;
    if space != b' ' || stamp.len() != TIMESTAMP_LEN {
        return None;
    }
    parse_timestamp(std::str::from_utf8(stamp).ok()?)
}

/// Splits a segment's bytes, fed in any chunks, into pieces of text (prefixes removed), each
/// with its line's time. Holds at most [`PREFIX_LEN`] bytes between calls.
#[derive(Debug, Clone)]
pub struct Records {
    at_start: bool,
    pending: Vec<u8>,
    stamp: SystemTime,
}

impl Default for Records {
    fn default() -> Self {
        Records { at_start: true, pending: Vec::with_capacity(PREFIX_LEN), stamp: SystemTime::UNIX_EPOCH }
    }
}

impl Records {
    /// The next bytes begin a segment (whose first byte begins a record). A partial prefix
    /// left over is dropped.
    pub fn new_segment(&mut self) {
        self.at_start = true;
        self.pending.clear();
    }

    /// Feeds `raw`, calling `piece(time, text)` for each run of text (a run ends at a newline
    /// or at the end of `raw`).
    pub fn feed(&mut self, mut raw: &[u8], piece: &mut dyn FnMut(SystemTime, &[u8])) {
        while !raw.is_empty() {
            if self.at_start {
                let want = PREFIX_LEN - self.pending.len();
                let window = &raw[..want.min(raw.len())];
                if let Some(nl) = window.iter().position(|&b| b == b'\n') {
                    // A line too short to carry a prefix: text as it is.
                    self.pending.extend_from_slice(&window[..=nl]);
                    piece(self.stamp, &self.pending);
                    self.pending.clear();
                    raw = &raw[nl + 1..];
                    continue;
                }
                self.pending.extend_from_slice(window);
                raw = &raw[window.len()..];
                if self.pending.len() < PREFIX_LEN {
                    return;
                }
                self.at_start = false;
                match parse_prefix(&self.pending) {
                    Some(at) => self.stamp = at,
                    None => piece(self.stamp, &self.pending),
                }
                self.pending.clear();
                continue;
            }
            let end = raw.iter().position(|&b| b == b'\n').map_or(raw.len(), |i| i + 1);
            piece(self.stamp, &raw[..end]);
            self.at_start = raw[end - 1] == b'\n';
            raw = &raw[end..];
        }
    }

    /// The end of the input: bytes held as a possible prefix are text after all.
    pub fn finish(&mut self, piece: &mut dyn FnMut(SystemTime, &[u8])) {
        if !self.pending.is_empty() {
            piece(self.stamp, &self.pending);
            self.pending.clear();
        }
    }
}

/// The text of `raw` (one segment's bytes from a record start), prefixes removed.
pub fn strip(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut r = Records::default();
    let mut push = |_: SystemTime, text: &[u8]| out.extend_from_slice(text);
    r.feed(raw, &mut push);
    r.finish(&mut push);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    }

    fn pieces(chunks: &[&[u8]]) -> Vec<(u64, String)> {
        let mut r = Records::default();
        let mut got = Vec::new();
        let mut push = |at: SystemTime, text: &[u8]| {
            let secs = at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            got.push((secs, String::from_utf8_lossy(text).into_owned()));
        };
        for c in chunks {
            r.feed(c, &mut push);
        }
        r.finish(&mut push);
        got
    }

    #[test]
    fn records_give_back_text_and_times_in_any_chunking() {
        let mut raw = prefix(t(5));
        raw.extend_from_slice(b"hello\n");
        raw.extend(prefix(t(7)));
        raw.extend_from_slice(b"world\n");
        assert_eq!(prefix(t(5)).len(), PREFIX_LEN);
        let whole = pieces(&[&raw]);
        assert_eq!(whole, [(5, "hello\n".into()), (7, "world\n".into())]);
        for cut in 1..raw.len() {
            let (a, b) = raw.split_at(cut);
            let got = pieces(&[a, b]);
            let mut text = String::new();
            for (at, s) in &got {
                assert_eq!(*at, if text.len() < "hello\n".len() { 5 } else { 7 }, "cut at {cut}: {got:?}");
                text.push_str(s);
            }
            assert_eq!(text, "hello\nworld\n", "cut at {cut}");
        }
        assert_eq!(strip(&raw), b"hello\nworld\n");
    }

    #[test]
    fn unstamped_text_passes_through_with_the_last_time() {
        assert_eq!(
            pieces(&[b"old\nformat line that is long enough\n"]),
            [(0, "old\n".into()), (0, "format line that is long enough".into()), (0, "\n".into())]
        );
        assert_eq!(strip(b"short"), b"short", "a short unterminated tail is text at the end");
        let mut raw = prefix(t(9));
        raw.extend_from_slice(b"x\nno prefix here\n");
        assert_eq!(pieces(&[&raw]), [(9, "x\n".into()), (9, "no prefix here\n".into())]);
    }
}

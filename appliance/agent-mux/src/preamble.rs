//! Session start: HELLO / READY / GO lines that make every host connection a fresh mux session.
//!
//! Host: repeats `\nCHRYSALIS-MUX/1 HELLO <nonce>\n` (backing off from 50 ms to 1 s) until it
//! reads `\nCHRYSALIS-MUX/1 READY <nonce>\n` (skipping anything before it: a stale guest session
//! may still emit yamux frames), then writes `\nCHRYSALIS-MUX/1 GO <nonce>\n` and starts yamux.
//! Guest: skips bytes until a HELLO, answers READY once per nonce, and starts yamux right after
//! the GO of the nonce it answered. A leading `\n` can never be a yamux header (version 0), so a
//! HELLO arriving at a stale guest session fails that session quickly.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const PREFIX: &[u8] = b"\nCHRYSALIS-MUX/1 ";
/// Longest `VERB nonce` part after the prefix.
const MAX_TAIL: usize = 48;
/// How much unmatched input is kept while scanning.
const KEEP: usize = PREFIX.len() + MAX_TAIL;

/// Errors of the session preamble.
#[derive(Debug, thiserror::Error)]
pub enum PreambleError {
    /// Reading or writing the port failed.
    #[error("i/o during the session preamble")]
    Io(#[from] std::io::Error),
    /// The other end closed the byte stream.
    #[error("port closed during the session preamble")]
    Closed,
    /// The guest did not answer in time.
    #[error("no READY from the guest within {0:?}")]
    Timeout(Duration),
}

#[derive(Debug, PartialEq, Eq)]
enum Verb {
    Hello,
    Ready,
    Go,
}

#[derive(Debug, PartialEq, Eq)]
struct Marker {
    verb: Verb,
    nonce: String,
    /// Index just past the marker's newline.
    end: usize,
}

fn marker(verb: &str, nonce: &str) -> Vec<u8> {
    let mut v = PREFIX.to_vec();
    v.extend_from_slice(format!("{verb} {nonce}\n").as_bytes());
    v
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Finds the first complete, well-formed marker in `buf`. Returns `Err(keep_from)` when none is
/// complete: the caller may drop `buf[..keep_from]`.
fn next_marker(buf: &[u8]) -> Result<Marker, usize> {
    let mut from = 0;
    loop {
        let Some(rel) = find(&buf[from..], PREFIX) else {
            // No prefix: only a partial prefix at the end can matter.
            return Err(buf.len().saturating_sub(PREFIX.len() - 1).max(from));
        };
        let start = from + rel;
        let tail_start = start + PREFIX.len();
        let tail = &buf[tail_start..buf.len().min(tail_start + MAX_TAIL)];
        match tail.iter().position(|&b| b == b'\n') {
            None if tail.len() < MAX_TAIL => return Err(start),
            None => from = tail_start - 1,
            Some(nl) => {
                let end = tail_start + nl + 1;
                let parsed = std::str::from_utf8(&tail[..nl]).ok().and_then(|t| {
                    let (verb, nonce) = t.split_once(' ')?;
                    let verb = match verb {
                        "HELLO" => Verb::Hello,
                        "READY" => Verb::Ready,
                        "GO" => Verb::Go,
                        _ => return None,
                    };
                    let ok = !nonce.is_empty() && nonce.len() <= 32 && nonce.bytes().all(|b| b.is_ascii_hexdigit());
                    ok.then(|| (verb, nonce.to_string()))
                });
                match parsed {
                    Some((verb, nonce)) => return Ok(Marker { verb, nonce, end }),
                    // The newline may itself start the next prefix.
                    None => from = end - 1,
                }
            }
        }
    }
}

/// Host side. Returns the bytes read past the READY line (to be fed to yamux first).
pub async fn host<T: AsyncRead + AsyncWrite + Unpin>(io: &mut T, timeout: Duration) -> Result<Vec<u8>, PreambleError> {
    let nonce = format!("{:016x}", rand::random::<u64>());
    let hello = marker("HELLO", &nonce);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut interval = Duration::from_millis(50);
    let mut next_hello = tokio::time::Instant::now();
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if tokio::time::Instant::now() >= next_hello {
            io.write_all(&hello).await?;
            io.flush().await?;
            next_hello = tokio::time::Instant::now() + interval;
            interval = (interval * 2).min(Duration::from_secs(1));
        }
        let wake = next_hello.min(deadline);
        let n = tokio::select! {
            r = io.read(&mut chunk) => r?,
            _ = tokio::time::sleep_until(wake) => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(PreambleError::Timeout(timeout));
                }
                continue;
            }
        };
        if n == 0 {
            return Err(PreambleError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        loop {
            match next_marker(&buf) {
                Ok(m) if m.verb == Verb::Ready && m.nonce == nonce => {
                    let rest = buf.split_off(m.end);
                    io.write_all(&marker("GO", &nonce)).await?;
                    io.flush().await?;
                    return Ok(rest);
                }
                Ok(m) => {
                    buf.drain(..m.end - 1);
                }
                Err(keep_from) => {
                    let keep_from = keep_from.max(buf.len().saturating_sub(4 * KEEP));
                    buf.drain(..keep_from.min(buf.len()));
                    break;
                }
            }
        }
    }
}

/// Guest side. Waits for a HELLO, answers READY, waits for the matching GO. Returns the bytes read
/// past the GO line (to be fed to yamux first).
pub async fn guest<T: AsyncRead + AsyncWrite + Unpin>(io: &mut T) -> Result<Vec<u8>, PreambleError> {
    let mut answered: Option<String> = None;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        loop {
            match next_marker(&buf) {
                Ok(m) => {
                    match m.verb {
                        Verb::Hello if answered.as_deref() != Some(m.nonce.as_str()) => {
                            io.write_all(&marker("READY", &m.nonce)).await?;
                            io.flush().await?;
                            answered = Some(m.nonce);
                        }
                        Verb::Go if answered.as_deref() == Some(m.nonce.as_str()) => {
                            return Ok(buf.split_off(m.end));
                        }
                        _ => {}
                    }
                    buf.drain(..m.end - 1);
                }
                Err(keep_from) => {
                    let keep_from = keep_from.max(buf.len().saturating_sub(4 * KEEP));
                    buf.drain(..keep_from.min(buf.len()));
                    break;
                }
            }
        }
        let n = io.read(&mut chunk).await?;
        if n == 0 {
            return Err(PreambleError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scanner_skips_garbage_and_partials() {
        let mut b = b"garbage\0\x01".to_vec();
        b.extend(marker("HELLO", "abc"));
        let m = next_marker(&b).expect("complete");
        assert_eq!((m.verb, m.nonce.as_str(), m.end), (Verb::Hello, "abc", b.len()));
        assert_eq!(next_marker(&b[..b.len() - 1]), Err(9), "partial keeps from its prefix");
        assert!(next_marker(b"\nCHRYSALIS-MUX/1 NOPE 12\n").is_err());
        let mut two = marker("BOGUS", "zz");
        two.extend(marker("GO", "ff"));
        assert_eq!(next_marker(&two).map(|m| m.verb), Ok(Verb::Go));
        let junk = vec![b'x'; 1000];
        assert_eq!(next_marker(&junk), Err(1000 - PREFIX.len() + 1));
    }

    #[tokio::test]
    async fn handshake_over_noise() {
        let (mut h, mut g) = tokio::io::duplex(1024);
        // Stale bytes from an old guest session on the way to the host.
        g.write_all(b"\0\0\0\x01stale yamux").await.expect("w");
        let guest = tokio::spawn(async move {
            let rest = guest(&mut g).await.expect("guest preamble");
            (rest, g)
        });
        let rest = host(&mut h, Duration::from_secs(5)).await.expect("host preamble");
        assert!(rest.is_empty());
        h.write_all(b"yamux!").await.expect("w");
        let (mut rest, mut g) = guest.await.expect("join");
        let mut more = [0u8; 6];
        if rest.len() < 6 {
            let need = 6 - rest.len();
            g.read_exact(&mut more[..need]).await.expect("read");
            rest.extend_from_slice(&more[..need]);
        }
        assert_eq!(rest, b"yamux!");
    }

    #[tokio::test]
    async fn host_times_out_without_guest() {
        let (mut h, _g) = tokio::io::duplex(1 << 16);
        let r = host(&mut h, Duration::from_millis(200)).await;
        assert!(matches!(r, Err(PreambleError::Timeout(_))), "{r:?}");
    }
}

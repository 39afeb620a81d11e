//! The hybrid-vsock stream handshake: `CONNECT <port>\n` → `OK <port>\n` (≤ 64 bytes a line).

use tokio::io::{AsyncRead, AsyncReadExt};

/// Longest accepted handshake line, newline included.
pub const MAX_LINE: usize = 64;

/// Errors reading or parsing a handshake line.
#[derive(Debug, thiserror::Error)]
pub enum ConnectLineError {
    /// Reading failed.
    #[error("reading the handshake line")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream before a full line (a refused port on the host side).
    #[error("stream closed before the handshake line")]
    Closed,
    /// The line is longer than [`MAX_LINE`].
    #[error("handshake line longer than {MAX_LINE} bytes")]
    TooLong,
    /// The line is not of the expected form.
    #[error("malformed handshake line {0:?}")]
    Malformed(String),
}

/// `CONNECT <port>\n`.
pub fn connect(port: u32) -> String {
    format!("CONNECT {port}\n")
}

/// `OK <port>\n`.
pub fn ok(port: u32) -> String {
    format!("OK {port}\n")
}

/// Reads one `\n`-terminated line (without the newline) of at most [`MAX_LINE`] bytes, one byte
/// at a time so that nothing after it is consumed.
pub async fn read_line<S: AsyncRead + Unpin>(s: &mut S) -> Result<String, ConnectLineError> {
    let mut buf = Vec::with_capacity(MAX_LINE);
    loop {
        let mut b = [0u8; 1];
        if s.read(&mut b).await? == 0 {
            return Err(ConnectLineError::Closed);
        }
        if b[0] == b'\n' {
            return String::from_utf8(buf)
                .map_err(|e| ConnectLineError::Malformed(String::from_utf8_lossy(e.as_bytes()).into_owned()));
        }
        buf.push(b[0]);
        if buf.len() >= MAX_LINE {
            return Err(ConnectLineError::TooLong);
        }
    }
}

/// Parses `CONNECT <port>` (no newline).
pub fn parse_connect(line: &str) -> Result<u32, ConnectLineError> {
    line.strip_prefix("CONNECT ")
        .and_then(|p| p.trim_end_matches('\r').parse().ok())
        .ok_or_else(|| ConnectLineError::Malformed(line.to_string()))
}

/// Checks an `OK …` reply line (no newline).
pub fn check_ok(line: &str) -> Result<(), ConnectLineError> {
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(ConnectLineError::Malformed(line.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        assert_eq!(parse_connect("CONNECT 2048").expect("valid"), 2048);
        assert!(parse_connect("CONNECT").is_err());
        assert!(parse_connect("CONNECT -1").is_err());
        assert!(parse_connect("connect 1").is_err());
        assert!(check_ok("OK 2048").is_ok());
        assert!(check_ok("ERR").is_err());
    }

    #[tokio::test]
    async fn read_line_is_capped_and_exact() {
        let mut r: &[u8] = b"CONNECT 5\nrest";
        assert_eq!(read_line(&mut r).await.expect("line"), "CONNECT 5");
        assert_eq!(r, b"rest");
        let long = [b'x'; 100];
        assert!(matches!(read_line(&mut &long[..]).await, Err(ConnectLineError::TooLong)));
        assert!(matches!(read_line(&mut &b"abc"[..]).await, Err(ConnectLineError::Closed)));
    }
}

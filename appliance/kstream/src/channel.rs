//! The WebSocket channel protocol of `exec` and `attach` (`v5.channel.k8s.io`,
//! `v4.channel.k8s.io`): every binary message starts with one channel byte (stdin, stdout,
//! stderr, error, resize) followed by that channel's bytes.
//!
//! What the client sends and how it reads our replies follows
//! `k8s.io/client-go@v0.37.2/tools/remotecommand/websocket.go` (the message framing and v5's
//! close signal) and `v4.go` (`errorDecoderV4`: how the error channel's `metav1.Status` becomes
//! `kubectl`'s exit code).

use serde::{Deserialize, Serialize};

/// A channel protocol we speak, as negotiated through `Sec-WebSocket-Protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `v5.channel.k8s.io`: v4 plus the close signal (`[255, channel]`), which lets the client
    /// half-close stdin.
    V5,
    /// `v4.channel.k8s.io`: the error channel carries a JSON `metav1.Status`.
    V4,
}

impl Protocol {
    /// Picks the best protocol we speak among a `Sec-WebSocket-Protocol` header's values
    /// (comma-separated; several headers may be joined with ',').
    pub fn negotiate(offered: &str) -> Option<Protocol> {
        let offers = || offered.split(',').map(str::trim);
        [Protocol::V5, Protocol::V4].into_iter().find(|protocol| offers().any(|offer| offer == protocol.name()))
    }

    /// The subprotocol's name, as echoed in the upgrade response.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V5 => "v5.channel.k8s.io",
            Protocol::V4 => "v4.channel.k8s.io",
        }
    }
}

/// The client's stdin.
pub const STDIN: u8 = 0;
/// The command's stdout.
pub const STDOUT: u8 = 1;
/// The command's stderr.
pub const STDERR: u8 = 2;
/// The outcome of the command: one `metav1.Status` ([`status_success`], [`status_exit`],
/// [`status_error`]), then the connection closes.
pub const ERROR: u8 = 3;
/// The client's terminal sizes (JSON [`TermSize`]).
pub const RESIZE: u8 = 4;
/// v5's close signal: `[CLOSE, channel]` says the client will send nothing more on `channel`.
pub const CLOSE: u8 = 255;

/// The largest resize message we accept (a `{"Width":65535,"Height":65535}` is 31 bytes; the
/// rest is room for whitespace).
pub const MAX_RESIZE_BYTES: usize = 256;

/// One outbound binary message: `channel` followed by `data`.
pub fn frame(channel: u8, data: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(data.len() + 1);
    message.push(channel);
    message.extend_from_slice(data);
    message
}

/// What an inbound message means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inbound {
    /// Bytes for the command's stdin (never empty).
    Stdin(Vec<u8>),
    /// The client closed stdin (v5 only).
    StdinClosed,
    /// The client's terminal was resized.
    Resize(TermSize),
    /// Nothing for us: an empty stdin message, a channel the client does not write, a close of
    /// another channel.
    Ignored,
}

/// A terminal size, as the resize channel carries it (`remotecommand.TerminalSize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermSize {
    /// Columns.
    #[serde(rename = "Width")]
    pub width: u16,
    /// Rows.
    #[serde(rename = "Height")]
    pub height: u16,
}

/// Why an inbound message was refused.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// An empty message has no channel byte.
    #[error("empty message: every message of the channel protocol starts with a channel byte")]
    Empty,
    /// A resize message over [`MAX_RESIZE_BYTES`].
    #[error("resize message of {0} bytes refused (at most {MAX_RESIZE_BYTES})")]
    ResizeTooLarge(usize),
    /// A resize message that is not `{"Width":..,"Height":..}`.
    #[error("resize message is not a terminal size")]
    BadResize(#[source] serde_json::Error),
    /// A v5 close signal that does not name exactly one channel.
    #[error("close signal of {0} bytes (expected 2: [255, channel])")]
    BadClose(usize),
}

/// Reads one inbound binary message under `protocol`.
pub fn parse(protocol: Protocol, msg: &[u8]) -> Result<Inbound, ChannelError> {
    let (&channel, data) = msg.split_first().ok_or(ChannelError::Empty)?;
    match channel {
        STDIN if data.is_empty() => Ok(Inbound::Ignored),
        STDIN => Ok(Inbound::Stdin(data.to_vec())),
        RESIZE => {
            if data.len() > MAX_RESIZE_BYTES {
                return Err(ChannelError::ResizeTooLarge(data.len()));
            }
            serde_json::from_slice(data).map(Inbound::Resize).map_err(ChannelError::BadResize)
        }
        CLOSE if protocol == Protocol::V5 => match data {
            [STDIN] => Ok(Inbound::StdinClosed),
            [_] => Ok(Inbound::Ignored),
            _ => Err(ChannelError::BadClose(msg.len())),
        },
        _ => Ok(Inbound::Ignored),
    }
}

/// `metav1.Status` as the error channel carries it; only the fields `errorDecoderV4` reads.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Status {
    /// Always empty; Go's encoder writes it, so do we.
    metadata: Metadata,
    status: StatusOutcome,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<StatusReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    details: Option<StatusDetails>,
}

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Metadata {}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum StatusOutcome {
    Success,
    Failure,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum StatusReason {
    /// `remotecommand.NonZeroExitCodeReason`.
    NonZeroExitCode,
    InternalError,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct StatusDetails {
    causes: Vec<StatusCause>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct StatusCause {
    /// `metav1.StatusCause.Type`, which is `reason` in JSON.
    reason: CauseType,
    message: String,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum CauseType {
    /// `remotecommand.ExitCodeCauseType`.
    ExitCode,
}

fn encode(status: &Status) -> Vec<u8> {
    // Serialising these plain structs cannot fail: no maps with non-string keys, no floats.
    serde_json::to_vec(status).unwrap_or_default()
}

/// The error channel's message when the command succeeded.
pub fn status_success() -> Vec<u8> {
    encode(&Status {
        metadata: Metadata {},
        status: StatusOutcome::Success,
        message: String::new(),
        reason: None,
        details: None,
    })
}

/// The error channel's message when the command exited with `code`; `kubectl` exits with the
/// same code. 0 is success. The client parses the code as a `uint8`, so a code outside
/// 1..=255 (a runtime's negative or oversized status) is reported as 255.
pub fn status_exit(code: i32) -> Vec<u8> {
    if code == 0 {
        return status_success();
    }
    let code = u8::try_from(code).unwrap_or(u8::MAX);
    encode(&Status {
        metadata: Metadata {},
        status: StatusOutcome::Failure,
        message: format!("command terminated with non-zero exit code {code}"),
        reason: Some(StatusReason::NonZeroExitCode),
        details: Some(StatusDetails {
            causes: vec![StatusCause { reason: CauseType::ExitCode, message: code.to_string() }],
        }),
    })
}

/// The error channel's message when the command could not run or the session broke;
/// `kubectl` prints `message`.
pub fn status_error(message: &str) -> Vec<u8> {
    encode(&Status {
        metadata: Metadata {},
        status: StatusOutcome::Failure,
        message: message.to_owned(),
        reason: Some(StatusReason::InternalError),
        details: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_prefers_v5_and_ignores_unknown_protocols() {
        let offered = "v5.channel.k8s.io, v4.channel.k8s.io,v3.channel.k8s.io";
        assert_eq!(Protocol::negotiate(offered), Some(Protocol::V5));
        assert_eq!(Protocol::negotiate("v3.channel.k8s.io , v4.channel.k8s.io"), Some(Protocol::V4));
        assert_eq!(Protocol::negotiate("channel.k8s.io, base64.channel.k8s.io"), None);
        assert_eq!(Protocol::negotiate(""), None);
        assert_eq!(Protocol::V5.name(), "v5.channel.k8s.io");
    }

    #[test]
    fn frames_prefix_the_channel() {
        assert_eq!(frame(STDOUT, b"hi"), vec![1, b'h', b'i']);
        assert_eq!(frame(ERROR, b""), vec![3]);
    }

    #[test]
    fn parses_stdin_close_and_resize() -> Result<(), ChannelError> {
        assert_eq!(parse(Protocol::V5, &[0, 7, 8])?, Inbound::Stdin(vec![7, 8]));
        assert_eq!(parse(Protocol::V5, &[0])?, Inbound::Ignored);
        assert_eq!(parse(Protocol::V5, &[CLOSE, STDIN])?, Inbound::StdinClosed);
        assert_eq!(parse(Protocol::V5, &[CLOSE, RESIZE])?, Inbound::Ignored);
        assert_eq!(parse(Protocol::V4, &[CLOSE, STDIN])?, Inbound::Ignored);
        assert_eq!(parse(Protocol::V4, &[STDOUT, 1])?, Inbound::Ignored);
        let resize = frame(RESIZE, br#"{"Width":80,"Height":24}"#);
        assert_eq!(parse(Protocol::V4, &resize)?, Inbound::Resize(TermSize { width: 80, height: 24 }));
        Ok(())
    }

    #[test]
    fn refuses_malformed_messages() {
        assert!(matches!(parse(Protocol::V5, &[]), Err(ChannelError::Empty)));
        assert!(matches!(parse(Protocol::V5, &[CLOSE]), Err(ChannelError::BadClose(1))));
        assert!(matches!(parse(Protocol::V5, &frame(RESIZE, b"{\"Width\":-1}")), Err(ChannelError::BadResize(_))));
    }

    #[test]
    fn resize_over_the_cap_is_refused() {
        let mut json = br#"{"Width":80,"Height":24}"#.to_vec();
        json.resize(MAX_RESIZE_BYTES + 1, b' ');
        assert!(matches!(
            parse(Protocol::V5, &frame(RESIZE, &json)),
            Err(ChannelError::ResizeTooLarge(n)) if n == MAX_RESIZE_BYTES + 1
        ));
        json.truncate(MAX_RESIZE_BYTES);
        assert!(parse(Protocol::V5, &frame(RESIZE, &json)).is_ok());
    }

    fn json(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap_or_default()
    }

    #[test]
    fn statuses_have_the_shapes_client_go_decodes() {
        assert_eq!(json(&status_success()), serde_json::json!({"metadata": {}, "status": "Success"}));
        assert_eq!(status_exit(0), status_success());
        assert_eq!(
            json(&status_exit(3)),
            serde_json::json!({
                "metadata": {},
                "status": "Failure",
                "message": "command terminated with non-zero exit code 3",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": "3"}]},
            })
        );
        assert_eq!(json(&status_exit(-9))["details"]["causes"][0]["message"], "255");
        assert_eq!(
            json(&status_error("no such container")),
            serde_json::json!({
                "metadata": {},
                "status": "Failure",
                "message": "no such container",
                "reason": "InternalError",
            })
        );
    }
}

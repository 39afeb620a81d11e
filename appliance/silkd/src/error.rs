//! The typed failure of an op, rendered as one `error{kind, message}` frame.

use std::path::PathBuf;

use agent_mux::AGENT_PORT_NAME;

use wire::ErrorKind;

/// Why an op failed. `Display` is the `message` of the `error` frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    pub kind: ErrorKind,
    pub message: String,
}

impl OpError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unimplemented, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// io `NotFound` → `not_found`, any other io error → `internal`, both `"<op>: <err>"`.
    pub fn io(op: &str, err: &std::io::Error) -> Self {
        let kind = if err.kind() == std::io::ErrorKind::NotFound { ErrorKind::NotFound } else { ErrorKind::Internal };
        Self::new(kind, format!("{op}: {err}"))
    }

    /// The wire frame for this error.
    pub fn to_frame(&self) -> wire::Response {
        wire::Response::error(self.kind, self.message.clone())
    }
}

impl From<crate::rpc::RpcClosed> for OpError {
    fn from(_: crate::rpc::RpcClosed) -> Self {
        Self::internal("client connection closed")
    }
}

/// Why a listener could not run.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("bad listen spec {0:?}: expected vsock:<port>, unix:<path> or mux:auto|<device>")]
    BadSpec(String),
    #[error("bind {what}: {source}")]
    Bind {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("accept on {what}: {source}")]
    Accept {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no virtio port named {AGENT_PORT_NAME} under /sys/class/virtio-ports")]
    NoMuxPort,
    #[error("agent mux on {0}: {1}")]
    Mux(PathBuf, String),
}

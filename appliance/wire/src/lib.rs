//! The silkd guest-agent wire format: every request op and reply type of the protocol,
//! and a newline-delimited JSON codec with the 8 MiB frame cap.
//!
//! This crate does no IO (like `kube-core`): it owns the types that cross the host↔guest
//! boundary and the rules for turning them into bytes and back.
//!
//! - [`Request`]: `{"v":1,"op":"<op>",…}`. `v` and unknown fields are ignored; optional
//!   fields may be absent or `null`.
//! - [`Response`]: `{"type":"<type>",…}` with `type` first; optional fields are omitted
//!   when absent (`exit_code`, `truncated` only when true).
//! - [`Bytes64`]: binary payloads, standard padded base64, only ever under `data`.
//! - [`codec`]: frame splitting, decoding and encoding under [`codec::MAX_FRAME`].

#![forbid(unsafe_code)]

pub mod codec;
mod request;
mod response;
mod types;

pub use codec::{DecodeError, EncodeError, FrameSplitter, MAX_FRAME};
pub use request::{Request, RESEED_MAX_BYTES, SET_CLOCK_MIN_UNIX_SECS};
pub use response::Response;
pub use types::{
    Bytes64, DirEntry, ErrorKind, EventKind, FileInfo, FileKind, GitBranchAction, GitFileStatus, ProcInfo, ProcState,
};

/// The `info.proto` this implementation speaks: RPCs back to back on one connection.
pub const PROTO_KEEP_ALIVE: u32 = 2;

/// The guest vsock port silkd listens on (`SILKD_PORT` overrides it in the guest).
pub const SILKD_PORT: u32 = 2048;

/// The reserved guest control port silkd serves next to [`SILKD_PORT`] (on vsock and inside
/// the agent mux). Protocol: the host writes one line `POWEROFF\n`; silkd answers `OK\n` and
/// has PID 1 power the guest off. Anything else gets `ERR unknown command\n`.
pub const CONTROL_PORT: u32 = 1;

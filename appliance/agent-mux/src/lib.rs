//! Many hybrid-vsock style byte streams over one virtio-serial port.
//!
//! Under QEMU there is no vhost-vsock, so the guest agent is reached through one virtio-serial
//! port (`org.chrysalis.agent.0`). This crate multiplexes many streams over that single byte
//! stream with [yamux](https://docs.rs/yamux) (host = client, guest = server; per-stream flow
//! control windows bound buffering).
//!
//! Protocol on the port, per host connection ("session"):
//! 1. [`preamble`]: the host repeats `\nCHRYSALIS-MUX/1 HELLO <nonce>\n` until the guest answers
//!    `\nCHRYSALIS-MUX/1 READY <nonce>\n`; the host then sends `\nCHRYSALIS-MUX/1 GO <nonce>\n` and
//!    both start a fresh yamux session. The guest skips any bytes before a HELLO, so a stale
//!    guest session (e.g. a restored clone that never saw the old host leave) breaks on the
//!    first HELLO, and the next HELLO starts a clean session.
//! 2. Every mux stream opens with hybrid-vsock's `CONNECT <port>\n`; the guest answers
//!    `OK <port>\n` when something listens on that port and closes the stream otherwise
//!    ([`connect_line`]).
//!
//! - [`host`]: [`host::Session`] (connect to QEMU's chardev socket, open streams) and
//!   [`bridge`]: a Unix socket speaking cloud-hypervisor's hybrid-vsock convention, each accepted
//!   connection spliced into a mux stream.
//! - [`guest`]: [`guest::serve`] one session, [`guest::run`] the reconnect loop, [`port`]: locate
//!   and open the virtio-serial device.

pub mod bridge;
pub mod connect_line;
mod decouple;
pub mod guest;
pub mod host;
pub mod port;
pub mod preamble;
mod rewind;
mod stream;

pub use stream::MuxStream;

/// The virtio-serial port name the agent channel uses.
pub const AGENT_PORT_NAME: &str = "org.chrysalis.agent.0";

/// Most concurrent streams per session.
pub const MAX_STREAMS: usize = 128;
/// Total receive window of a session (each stream starts with yamux's 256 KiB).
pub const CONNECTION_WINDOW: usize = MAX_STREAMS * 256 * 1024;

/// yamux configuration used by both ends: at most [`MAX_STREAMS`] streams and
/// [`CONNECTION_WINDOW`] bytes of receive window, so buffering per session is bounded.
pub fn yamux_config() -> yamux::Config {
    let mut c = yamux::Config::default();
    // Order matters: both setters assert window >= 256 KiB * streams.
    c.set_max_num_streams(MAX_STREAMS);
    c.set_max_connection_receive_window(Some(CONNECTION_WINDOW));
    c.set_read_after_close(true);
    c
}

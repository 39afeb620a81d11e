//! silkd, the Chrysalis guest agent: serves the silkd protocol (see `wire`) inside each
//! microVM, on vsock port 2048 and on the virtio-serial agent mux, plus the control port
//! ([`wire::CONTROL_PORT`], [`control`]) the host powers the guest off through.
//!
//! - [`conn`]: the connection engine (`proto` 2) over any byte stream.
//! - [`ops`]: one module per op family, routed by [`ops::dispatch`].
//! - [`agent`]: state shared by connections (processes, sessions).
//! - [`listen`], [`mux`]: listeners; `main.rs` only parses flags and starts them.

pub mod agent;
pub mod conn;
pub mod control;
pub mod error;
pub mod listen;
pub mod mux;
pub mod ops;
pub mod procs;
pub mod rpc;
pub mod sessions;
pub mod sys;

pub use agent::Agent;
pub use error::OpError;
pub use rpc::{Input, Rpc, RpcClosed, RpcPeer, RpcSender};

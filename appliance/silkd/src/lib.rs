//! silkd, the Chrysalis guest agent: serves the silkd protocol (see `wire`) inside each
//! microVM, on vsock port 2048 and on the virtio-serial agent mux.

pub mod error;
pub mod ops;
pub mod rpc;

pub use error::OpError;
pub use rpc::{Input, Rpc, RpcClosed, RpcPeer};

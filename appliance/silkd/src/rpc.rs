//! The context one RPC runs in: where its reply frames go and where its continuation
//! frames come from.
//!
//! An op is an `async fn(&mut Rpc, …) -> Result<(), OpError>`. It sends its frames with
//! [`Rpc::send`] (back-pressured: it waits while the client is slow, so nothing is buffered
//! without bound) and reads its input with [`Rpc::input`]. On `Err` the connection engine
//! sends the `error` frame itself; an op never sends `error` frames directly. The op sends
//! its own terminal frame (`done`, `exit`, …) on success.

use tokio::sync::mpsc;
use wire::Response;

/// A continuation frame addressed to the RPC in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Stdin(Vec<u8>),
    StdinClose,
    Data(Vec<u8>),
    DataEnd,
}

/// The client is gone (or the connection is shutting down); stop producing output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("client connection closed")]
pub struct RpcClosed;

/// What one RPC may do with its connection.
pub struct Rpc {
    out: mpsc::Sender<Response>,
    input: mpsc::Receiver<Input>,
}

/// The other end of an [`Rpc`]: what the connection engine (or a test) holds.
pub struct RpcPeer {
    /// Frames the op sent, in order.
    pub out: mpsc::Receiver<Response>,
    /// Continuation frames for the op; dropping it ends the op's input
    /// ([`Rpc::input`] returns `None`).
    pub input: mpsc::Sender<Input>,
}

impl Rpc {
    /// A connected pair with `depth` frames of buffering each way.
    pub fn pair(depth: usize) -> (Rpc, RpcPeer) {
        let (out_tx, out_rx) = mpsc::channel(depth.max(1));
        let (in_tx, in_rx) = mpsc::channel(depth.max(1));
        (Rpc { out: out_tx, input: in_rx }, RpcPeer { out: out_rx, input: in_tx })
    }

    /// Sends one reply frame, waiting while the client is slow.
    pub async fn send(&mut self, frame: Response) -> Result<(), RpcClosed> {
        self.out.send(frame).await.map_err(|_| RpcClosed)
    }

    /// The next continuation frame of this RPC, or `None` once its input has ended (the
    /// client hung up, or sent its next request, which ends the running RPC's input).
    pub async fn input(&mut self) -> Option<Input> {
        self.input.recv().await
    }

    /// Resolves when the client is gone (no further frames can be delivered).
    pub async fn closed(&self) {
        self.out.closed().await
    }

    /// A cloneable handle that sends reply frames of this RPC, so an op can produce output
    /// from one future while another awaits [`Rpc::input`]. Every clone must be dropped
    /// before the op returns (the engine sees the RPC's reply stream end only then).
    pub fn sender(&self) -> RpcSender {
        RpcSender { out: self.out.clone() }
    }
}

/// Sends reply frames of one RPC; see [`Rpc::sender`].
#[derive(Clone)]
pub struct RpcSender {
    out: mpsc::Sender<Response>,
}

impl RpcSender {
    /// Sends one reply frame, waiting while the client is slow.
    pub async fn send(&self, frame: Response) -> Result<(), RpcClosed> {
        self.out.send(frame).await.map_err(|_| RpcClosed)
    }

    /// Resolves when the client is gone.
    pub async fn closed(&self) {
        self.out.closed().await
    }
}

//! `port_forward {port}`: a byte stream to `127.0.0.1:port` inside the guest.
//!
//! `ready`, then `data` both ways (≤ 256 KiB per frame from the guest); the client's
//! `data_end` (or the end of its input) half-closes the guest socket's write side; the
//! guest closing its side ends the RPC with `done`. No listener → `not_found`.

use super::pump::CHUNK;
use crate::error::OpError;
use crate::rpc::{Input, Rpc, RpcSender};
use std::convert::Infallible;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use wire::Response;

/// `port_forward`.
pub async fn port_forward(rpc: &mut Rpc, port: u16) -> Result<(), OpError> {
    if port == 0 {
        return Err(OpError::bad_request("port_forward: port must be 1-65535"));
    }
    let stream = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(OpError::not_found(format!("port_forward: nothing listens on 127.0.0.1:{port}")));
        }
        Err(e) => return Err(OpError::io("port_forward", &e)),
    };
    // Interactive streams: do not hold back small writes.
    let _ = stream.set_nodelay(true);
    rpc.send(Response::Ready).await?;
    let (rd, wr) = stream.into_split();
    let tx = rpc.sender();
    let result = {
        let down = guest_to_client(rd, &tx);
        let up = client_to_guest(rpc, wr);
        tokio::pin!(down, up);
        tokio::select! {
            r = &mut down => r,
            never = &mut up => match never {},
        }
    };
    drop(tx);
    result?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// Copies guest bytes to `data` frames until the guest closes its side.
async fn guest_to_client(mut rd: OwnedReadHalf, tx: &RpcSender) -> Result<(), OpError> {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = tokio::select! {
            r = rd.read(&mut buf) => r.map_err(|e| OpError::io("port_forward", &e))?,
            () = tx.closed() => return Err(crate::rpc::RpcClosed.into()),
        };
        if n == 0 {
            return Ok(());
        }
        tx.send(Response::Data { data: buf[..n].to_vec().into() }).await?;
    }
}

/// Copies client `data` frames to the guest; `data_end` or the end of input half-closes.
async fn client_to_guest(rpc: &mut Rpc, mut wr: OwnedWriteHalf) -> Infallible {
    let mut open = true;
    loop {
        match rpc.input().await {
            Some(Input::Data(data)) if open => {
                if wr.write_all(&data).await.is_err() {
                    open = false;
                }
            }
            Some(Input::DataEnd) | None if open => {
                open = false;
                let _ = wr.shutdown().await;
            }
            None => return std::future::pending().await,
            Some(_) => {}
        }
    }
}

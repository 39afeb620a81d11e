//! A fake silkd for unit tests: the agent end of a tokio duplex, speaking frames.

use crate::AgentConn;
use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use wire::codec::{decode_request, encode_response, FrameSplitter};
use wire::{Request, Response};

/// The agent side of a fake connection: reads request frames, writes reply frames.
pub struct FakeAgent {
    io: DuplexStream,
    splitter: FrameSplitter,
}

impl FakeAgent {
    /// A client connection and its fake agent, with `transport` bytes of buffer between.
    pub fn pair(transport: usize) -> (AgentConn<DuplexStream>, FakeAgent) {
        let (client, agent) = tokio::io::duplex(transport);
        (AgentConn::new(client), FakeAgent { io: agent, splitter: FrameSplitter::new() })
    }

    /// The next request, or `None` once the client hung up.
    pub async fn recv(&mut self) -> Option<Request> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if let Some(frame) = self.splitter.next_frame() {
                return Some(decode_request(&frame.expect("frame")).expect("request"));
            }
            match self.io.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.splitter.push(&buf[..n]),
            }
        }
    }

    /// Writes raw bytes (a malformed or oversized frame).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.io.write_all(bytes).await
    }

    pub async fn send(&mut self, resp: &Response) -> io::Result<()> {
        self.io.write_all(&encode_response(resp).expect("encode")).await
    }

    /// Answers the `port_forward` request with `ready`.
    pub async fn accept(&mut self, port: u16) {
        assert_eq!(self.recv().await, Some(Request::PortForward { port }));
        self.send(&Response::Ready).await.expect("ready");
    }
}

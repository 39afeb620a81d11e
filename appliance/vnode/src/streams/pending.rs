//! Stand-ins, with the signatures of `docs`' plan for issue #15, for what other parts of the
//! issue write (`kstream::{channel, logs, portforward}`, silkd-client's sessions) until they
//! land; removed when they do.
#![allow(dead_code)]

pub mod channel {
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Protocol {
        V5,
        V4,
    }
    impl Protocol {
        pub fn negotiate(offered: &str) -> Option<Protocol> {
            let names: Vec<&str> = offered.split(',').map(str::trim).collect();
            [Protocol::V5, Protocol::V4].into_iter().find(|p| names.contains(&p.name()))
        }
        pub fn name(self) -> &'static str {
            match self {
                Protocol::V5 => "v5.channel.k8s.io",
                Protocol::V4 => "v4.channel.k8s.io",
            }
        }
    }
    pub const STDIN: u8 = 0;
    pub const STDOUT: u8 = 1;
    pub const STDERR: u8 = 2;
    pub const ERROR: u8 = 3;
    pub const RESIZE: u8 = 4;
    pub const CLOSE: u8 = 255;
    pub fn frame(channel: u8, data: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(data.len() + 1);
        v.push(channel);
        v.extend_from_slice(data);
        v
    }
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct TermSize {
        pub width: u16,
        pub height: u16,
    }
    #[derive(Debug, PartialEq, Eq)]
    pub enum Inbound {
        Stdin(Vec<u8>),
        StdinClosed,
        Resize(TermSize),
        Ignored,
    }
    #[derive(Debug, thiserror::Error)]
    #[error("bad channel message")]
    pub struct ChannelError;
    pub fn parse(protocol: Protocol, msg: &[u8]) -> Result<Inbound, ChannelError> {
        match msg {
            [STDIN, rest @ ..] => Ok(Inbound::Stdin(rest.to_vec())),
            [CLOSE, STDIN] if protocol == Protocol::V5 => Ok(Inbound::StdinClosed),
            [RESIZE, rest @ ..] => {
                let v: serde_json::Value = serde_json::from_slice(rest).map_err(|_| ChannelError)?;
                let n = |k: &str| v[k].as_u64().and_then(|x| u16::try_from(x).ok()).ok_or(ChannelError);
                Ok(Inbound::Resize(TermSize { width: n("Width")?, height: n("Height")? }))
            }
            [] => Err(ChannelError),
            _ => Ok(Inbound::Ignored),
        }
    }
    pub fn status_success() -> Vec<u8> {
        br#"{"metadata":{},"status":"Success"}"#.to_vec()
    }
    pub fn status_exit(code: i32) -> Vec<u8> {
        serde_json::json!({"metadata":{},"status":"Failure","reason":"NonZeroExitCode",
            "details":{"causes":[{"reason":"ExitCode","message":code.to_string()}]}})
        .to_string()
        .into_bytes()
    }
    pub fn status_error(message: &str) -> Vec<u8> {
        serde_json::json!({"metadata":{},"status":"Failure","reason":"InternalError","message":message})
            .to_string()
            .into_bytes()
    }
}

pub mod logs {
    use serde::{Deserialize, Serialize};
    use std::time::SystemTime;

    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    pub struct LogQuery {
        pub follow: bool,
        pub previous: bool,
        pub timestamps: bool,
        pub tail_lines: Option<i64>,
        pub since_seconds: Option<i64>,
        pub since_time: Option<String>,
        pub limit_bytes: Option<i64>,
    }
    #[derive(Debug, thiserror::Error)]
    #[error("a negative count")]
    pub struct LogQueryError;
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct ValidLogQuery {
        pub follow: bool,
        pub timestamps: bool,
        pub tail_lines: Option<u64>,
        pub since: Option<SystemTime>,
        pub limit_bytes: Option<u64>,
    }
    impl LogQuery {
        pub fn validate(&self) -> Result<ValidLogQuery, LogQueryError> {
            let n = |v: Option<i64>| v.map(|x| u64::try_from(x).map_err(|_| LogQueryError)).transpose();
            Ok(ValidLogQuery {
                follow: self.follow,
                timestamps: self.timestamps,
                tail_lines: n(self.tail_lines)?,
                since: None,
                limit_bytes: n(self.limit_bytes)?,
            })
        }
    }
}

pub mod session {
    use super::channel::TermSize;
    use silkd_client::{AgentConn, ClientError};
    use tokio::io::{AsyncRead, AsyncWrite};

    #[derive(Debug, Default)]
    pub struct SessionSpec {
        pub argv: Vec<String>,
        pub tty: Option<TermSize>,
        pub stdin: bool,
        pub cwd: Option<String>,
        pub user: Option<String>,
    }
    pub enum SessionEvent {
        Stdout(Vec<u8>),
        Stderr(Vec<u8>),
        Exit(i32),
    }
    pub struct SessionInput;
    impl SessionInput {
        pub async fn write(&mut self, _: &[u8]) -> Result<(), ClientError> {
            Err(ClientError::Closed)
        }
        pub async fn close(&mut self) -> Result<(), ClientError> {
            Ok(())
        }
    }
    pub struct SessionOutput;
    impl SessionOutput {
        pub async fn next(&mut self) -> Result<Option<SessionEvent>, ClientError> {
            Ok(None)
        }
    }
    pub async fn start_session<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        _: AgentConn<S>,
        _: SessionSpec,
    ) -> Result<(u32, SessionInput, SessionOutput), ClientError> {
        Err(ClientError::Closed)
    }
    pub async fn pty_resize<S: AsyncRead + AsyncWrite + Unpin>(
        _: &mut AgentConn<S>,
        _: u32,
        _: u16,
        _: u16,
    ) -> Result<(), ClientError> {
        Ok(())
    }
    pub async fn port_stream<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        conn: AgentConn<S>,
        _: u16,
    ) -> Result<S, ClientError> {
        Ok(conn.into_inner())
    }
}

pub mod portforward {
    use std::future::Future;
    use tokio::io::{AsyncRead, AsyncWrite};

    #[derive(Debug, Default)]
    pub struct Limits;
    #[derive(Debug, thiserror::Error)]
    #[error("port-forward is not written yet")]
    pub struct PortForwardError;
    pub async fn serve<S, F, Fut, D>(_: S, _: Limits, _: F) -> Result<(), PortForwardError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
        F: Fn(u16) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<D, String>> + Send + 'static,
        D: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Err(PortForwardError)
    }
}

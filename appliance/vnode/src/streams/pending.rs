//! Stand-ins, with the signatures of `docs`' plan for issue #15, for what other parts of the
//! issue write (`kstream::logs`, silkd-client's sessions) until they
//! land; removed when they do.
#![allow(dead_code)]

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
    use kstream::channel::TermSize;
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

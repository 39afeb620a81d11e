//! Responses: `{"type":"<type>",…}` with `type` first and optional fields omitted.

use crate::types::{Bytes64, DirEntry, ErrorKind, EventKind, FileInfo, GitFileStatus, ProcInfo};
use serde::{Deserialize, Serialize};

fn is_false(b: &bool) -> bool {
    !*b
}

/// One silkd reply frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Info {
        version: String,
        proto: u32,
        uptime_secs: u64,
        procs: u64,
        sessions: u64,
    },
    Started {
        pid: u32,
    },
    Stdout {
        data: Bytes64,
    },
    Stderr {
        data: Bytes64,
    },
    Data {
        data: Bytes64,
    },
    Exit {
        code: i32,
    },
    Done,
    Error {
        /// The SDK reads a missing kind as `internal`.
        #[serde(default = "internal")]
        kind: ErrorKind,
        #[serde(default)]
        message: String,
    },
    Procs {
        procs: Vec<ProcInfo>,
    },
    SessionCreated {
        id: String,
    },
    Sessions {
        sessions: Vec<String>,
    },
    Entries {
        entries: Vec<DirEntry>,
    },
    Stat {
        info: FileInfo,
    },
    Match {
        file: String,
        line: u64,
        content: String,
    },
    Replaced {
        file: String,
        replacements: u64,
    },
    Ready,
    Event {
        kind: EventKind,
        path: String,
    },
    GitStatusResult {
        branch: String,
        ahead: u32,
        behind: u32,
        files: Vec<GitFileStatus>,
        #[serde(default, skip_serializing_if = "is_false")]
        truncated: bool,
    },
    GitCommitResult {
        hash: String,
    },
    GitBranches {
        current: String,
        branches: Vec<String>,
    },
    LspStarted {
        server_id: String,
    },
}

fn internal() -> ErrorKind {
    ErrorKind::Internal
}

impl Response {
    /// An `error` frame.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self::Error { kind, message: message.into() }
    }

    /// The type tag as it appears on the wire.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Info { .. } => "info",
            Self::Started { .. } => "started",
            Self::Stdout { .. } => "stdout",
            Self::Stderr { .. } => "stderr",
            Self::Data { .. } => "data",
            Self::Exit { .. } => "exit",
            Self::Done => "done",
            Self::Error { .. } => "error",
            Self::Procs { .. } => "procs",
            Self::SessionCreated { .. } => "session_created",
            Self::Sessions { .. } => "sessions",
            Self::Entries { .. } => "entries",
            Self::Stat { .. } => "stat",
            Self::Match { .. } => "match",
            Self::Replaced { .. } => "replaced",
            Self::Ready => "ready",
            Self::Event { .. } => "event",
            Self::GitStatusResult { .. } => "git_status_result",
            Self::GitCommitResult { .. } => "git_commit_result",
            Self::GitBranches { .. } => "git_branches",
            Self::LspStarted { .. } => "lsp_started",
        }
    }

    /// Does this frame end an RPC of the given op? (`done`/`error` always do, and `exit`
    /// does except for `logs`, whose `exit` is followed by `done`; the single-reply ops end
    /// at their reply; a detached exec ends at `started`.)
    pub fn ends_rpc(&self, op: &str, detached: bool) -> bool {
        match self {
            Self::Done | Self::Error { .. } => true,
            Self::Exit { .. } => op != "logs",
            Self::Started { .. } => op == "exec" && detached,
            Self::Info { .. }
            | Self::Procs { .. }
            | Self::Stat { .. }
            | Self::SessionCreated { .. }
            | Self::Sessions { .. }
            | Self::LspStarted { .. }
            | Self::GitStatusResult { .. }
            | Self::GitCommitResult { .. }
            | Self::GitBranches { .. } => true,
            _ => false,
        }
    }

    /// Every type name of the protocol, in declaration order.
    pub const TYPES: [&'static str; 21] = [
        "info",
        "started",
        "stdout",
        "stderr",
        "data",
        "exit",
        "done",
        "error",
        "procs",
        "session_created",
        "sessions",
        "entries",
        "stat",
        "match",
        "replaced",
        "ready",
        "event",
        "git_status_result",
        "git_commit_result",
        "git_branches",
        "lsp_started",
    ];
}

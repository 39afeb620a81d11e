//! Requests: `{"v":1,"op":"<op>",…}`, one variant per op of the protocol.
//!
//! Optional fields may be absent or `null`; `v` and unknown fields are ignored. Fields a
//! server must validate (an empty `argv`, say) default instead of failing the parse, so
//! the op can answer its own typed `bad_request`.

use crate::types::{Bytes64, GitBranchAction};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Environment variables of `exec`, `session_create` and `pty_open`.
pub type Env = BTreeMap<String, String>;

/// One silkd request frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// `info{version, proto, uptime_secs, procs, sessions}`.
    Info,
    /// Run a process: `started` → `stdout`/`stderr`… → `exit`.
    Exec {
        #[serde(default)]
        argv: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        env: Option<Env>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detach: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<String>,
    },
    /// Continuation: input for the running exec or pty.
    Stdin {
        #[serde(default)]
        data: Bytes64,
    },
    /// Continuation: end of input for the running exec or pty.
    StdinClose,
    /// Continuation: a chunk for `fs_write`, `fs_push` or `port_forward`.
    Data {
        #[serde(default)]
        data: Bytes64,
    },
    /// Continuation: end of the upload, or a half-close of a forwarded port.
    DataEnd,
    /// `procs{procs:[…]}`.
    Ps,
    Kill {
        pid: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
    },
    Logs {
        pid: u32,
    },
    Attach {
        pid: u32,
    },
    SessionCreate {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        env: Option<Env>,
    },
    SessionList,
    SessionRm {
        id: String,
    },
    FsWrite {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
    },
    FsRead {
        path: String,
    },
    FsList {
        path: String,
    },
    FsStat {
        path: String,
    },
    FsMkdir {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parents: Option<bool>,
    },
    FsRm {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        recursive: Option<bool>,
    },
    FsRename {
        from: String,
        to: String,
    },
    FsPush {
        dest: String,
    },
    FsPull {
        path: String,
    },
    FsFind {
        path: String,
        pattern: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        glob: Option<String>,
    },
    FsReplace {
        #[serde(default)]
        files: Vec<String>,
        pattern: String,
        replacement: String,
    },
    FsWatch {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        recursive: Option<bool>,
    },
    /// A pseudo-terminal: `started` → `stdout`… → `exit`; input `stdin`/`stdin_close`.
    PtyOpen {
        /// Chrysalis extension: the command to run under the pty instead of the user's login
        /// shell (absent: the login shell). `kubectl exec -t` runs its command this way.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        argv: Option<Vec<String>>,
        #[serde(default = "default_cols")]
        cols: u16,
        #[serde(default = "default_rows")]
        rows: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        env: Option<Env>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    PtyResize {
        pid: u32,
        cols: u16,
        rows: u16,
    },
    PortForward {
        port: u16,
    },
    GitClone {
        url: String,
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        branch: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        depth: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<String>,
    },
    GitAdd {
        path: String,
        #[serde(default)]
        files: Vec<String>,
    },
    GitPush {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<String>,
    },
    GitPull {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<String>,
    },
    GitStatus {
        path: String,
    },
    GitCommit {
        path: String,
        message: String,
        author: String,
    },
    GitBranch {
        path: String,
        action: GitBranchAction,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    LspStart {
        language: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<String>,
    },
    LspRequest {
        server_id: String,
    },
    LspStop {
        server_id: String,
    },
    /// Chrysalis extension: mix `data` (host-provided randomness, at most
    /// [`RESEED_MAX_BYTES`]) into the guest kernel's entropy pool and force a CRNG reseed.
    /// The host sends it to every clone of a snapshot before handing it out, so clones never
    /// share RNG state. `done`, or `error` (`bad_request` when `data` is empty or too long).
    Reseed {
        #[serde(default)]
        data: Bytes64,
    },
    /// Chrysalis extension: set the guest's realtime clock to the host's, `unix_ns`
    /// nanoseconds since the epoch. A VM restored from a snapshot, or resumed after waiting
    /// paused, starts with the clock it had when it stopped; the host sends this before the
    /// guest is used. `done`, or `error` (`bad_request` for a time before
    /// [`SET_CLOCK_MIN_UNIX_SECS`]).
    SetClock {
        unix_ns: u64,
    },
    /// Chrysalis extension: the host hot-plugged volume `name` as SCSI target `target`
    /// (LUN 0). silkd waits for its disk, links `/dev/volumes/<name>` to it and, when `mount`
    /// is set, mounts it there (read-only unless `read_only` is false). `done`, or `error`
    /// (`not_found` when no disk appears in time).
    VolumeMount {
        name: String,
        target: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mount: Option<String>,
        #[serde(default = "default_read_only")]
        read_only: bool,
    },
    /// Chrysalis extension: before the host unplugs volume `name` (SCSI target `target`),
    /// silkd unmounts it (lazily, if busy), removes its link and detaches the disk. `done`;
    /// a volume that is not there is already done.
    VolumeUnmount {
        name: String,
        target: u16,
    },
}

fn default_read_only() -> bool {
    true
}

/// The most bytes one `reseed` carries (the kernel's pool is 256 bytes).
pub const RESEED_MAX_BYTES: usize = 256;

/// The earliest time `set_clock` accepts (2024-01-01T00:00:00Z): an earlier one is a host
/// whose own clock is wrong, and the guest keeps its own.
pub const SET_CLOCK_MIN_UNIX_SECS: u64 = 1_704_067_200;

fn default_cols() -> u16 {
    80
}

fn default_rows() -> u16 {
    24
}

impl Request {
    /// The op name as it appears on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Exec { .. } => "exec",
            Self::Stdin { .. } => "stdin",
            Self::StdinClose => "stdin_close",
            Self::Data { .. } => "data",
            Self::DataEnd => "data_end",
            Self::Ps => "ps",
            Self::Kill { .. } => "kill",
            Self::Logs { .. } => "logs",
            Self::Attach { .. } => "attach",
            Self::SessionCreate { .. } => "session_create",
            Self::SessionList => "session_list",
            Self::SessionRm { .. } => "session_rm",
            Self::FsWrite { .. } => "fs_write",
            Self::FsRead { .. } => "fs_read",
            Self::FsList { .. } => "fs_list",
            Self::FsStat { .. } => "fs_stat",
            Self::FsMkdir { .. } => "fs_mkdir",
            Self::FsRm { .. } => "fs_rm",
            Self::FsRename { .. } => "fs_rename",
            Self::FsPush { .. } => "fs_push",
            Self::FsPull { .. } => "fs_pull",
            Self::FsFind { .. } => "fs_find",
            Self::FsReplace { .. } => "fs_replace",
            Self::FsWatch { .. } => "fs_watch",
            Self::PtyOpen { .. } => "pty_open",
            Self::PtyResize { .. } => "pty_resize",
            Self::PortForward { .. } => "port_forward",
            Self::GitClone { .. } => "git_clone",
            Self::GitAdd { .. } => "git_add",
            Self::GitPush { .. } => "git_push",
            Self::GitPull { .. } => "git_pull",
            Self::GitStatus { .. } => "git_status",
            Self::GitCommit { .. } => "git_commit",
            Self::GitBranch { .. } => "git_branch",
            Self::LspStart { .. } => "lsp_start",
            Self::LspRequest { .. } => "lsp_request",
            Self::LspStop { .. } => "lsp_stop",
            Self::Reseed { .. } => "reseed",
            Self::SetClock { .. } => "set_clock",
            Self::VolumeMount { .. } => "volume_mount",
            Self::VolumeUnmount { .. } => "volume_unmount",
        }
    }

    /// Continuation frames (`stdin`, `stdin_close`, `data`, `data_end`) feed the RPC in
    /// flight; they never open one.
    pub fn is_continuation(&self) -> bool {
        matches!(self, Self::Stdin { .. } | Self::StdinClose | Self::Data { .. } | Self::DataEnd)
    }

    /// Every op name of the protocol, in declaration order.
    pub const OPS: [&'static str; 42] = [
        "info",
        "exec",
        "stdin",
        "stdin_close",
        "data",
        "data_end",
        "ps",
        "kill",
        "logs",
        "attach",
        "session_create",
        "session_list",
        "session_rm",
        "fs_write",
        "fs_read",
        "fs_list",
        "fs_stat",
        "fs_mkdir",
        "fs_rm",
        "fs_rename",
        "fs_push",
        "fs_pull",
        "fs_find",
        "fs_replace",
        "fs_watch",
        "pty_open",
        "pty_resize",
        "port_forward",
        "git_clone",
        "git_add",
        "git_push",
        "git_pull",
        "git_status",
        "git_commit",
        "git_branch",
        "lsp_start",
        "lsp_request",
        "lsp_stop",
        "reseed",
        "set_clock",
        "volume_mount",
        "volume_unmount",
    ];
}

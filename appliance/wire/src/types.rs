//! Shared value types of the silkd protocol: payload bytes, enums, table rows.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Binary payload carried as standard padded base64 in a `data` field.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Bytes64(pub Vec<u8>);

impl std::fmt::Debug for Bytes64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes64({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Bytes64 {
    fn from(v: Vec<u8>) -> Self {
        Self(v)
    }
}

impl From<&[u8]> for Bytes64 {
    fn from(v: &[u8]) -> Self {
        Self(v.to_vec())
    }
}

impl Serialize for Bytes64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Bytes64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Bytes64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a standard base64 string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Bytes64, E> {
                STANDARD.decode(v).map(Bytes64).map_err(|e| E::custom(format!("invalid base64: {e}")))
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// The four error kinds of an `error` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    BadRequest,
    NotFound,
    Unimplemented,
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 4] = [Self::BadRequest, Self::NotFound, Self::Unimplemented, Self::Internal];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::NotFound => "not_found",
            Self::Unimplemented => "unimplemented",
            Self::Internal => "internal",
        }
    }
}

/// What `fs_watch` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Created,
    Modified,
    Deleted,
    Renamed,
}

impl EventKind {
    pub const ALL: [EventKind; 4] = [Self::Created, Self::Modified, Self::Deleted, Self::Renamed];
}

/// The kind of a filesystem entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl FileKind {
    pub const ALL: [FileKind; 4] = [Self::File, Self::Dir, Self::Symlink, Self::Other];
}

/// `git_branch.action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GitBranchAction {
    List,
    Create,
    Delete,
    Checkout,
}

impl GitBranchAction {
    pub const ALL: [GitBranchAction; 4] = [Self::List, Self::Create, Self::Delete, Self::Checkout];
}

/// A tracked process's state in `ps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcState {
    Running,
    Exited,
}

/// One row of `procs`. Running rows omit `exit_code`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    pub pid: u32,
    pub argv: Vec<String>,
    pub detached: bool,
    pub state: ProcState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub started_at_epoch_secs: u64,
}

/// One row of `entries`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
}

/// The `info` member of a `stat` reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_epoch_secs: i64,
}

/// One file of a `git_status_result`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitFileStatus {
    pub path: String,
    pub staged: String,
    pub unstaged: String,
}

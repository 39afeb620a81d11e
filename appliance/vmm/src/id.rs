//! [`VmId`]: the name of one VM everywhere (directory, cgroup leaf, records, logs).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A VM id: 1..=63 chars of `[a-z0-9-]`, starting with a letter or digit. Used as a directory name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VmId(String);

/// Why a string is not a [`VmId`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VmIdError {
    /// Empty or longer than 63 characters.
    #[error("vm id must be 1..=63 characters, got {0}")]
    Length(usize),
    /// A character outside `[a-z0-9-]`, or a leading `-`.
    #[error("vm id {0:?} may only hold [a-z0-9-] and must not start with '-'")]
    Charset(String),
}

impl VmId {
    /// Validates `s` as a VM id.
    pub fn new(s: impl Into<String>) -> Result<Self, VmIdError> {
        let s = s.into();
        if s.is_empty() || s.len() > 63 {
            return Err(VmIdError::Length(s.len()));
        }
        let ok = s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') && !s.starts_with('-');
        if !ok {
            return Err(VmIdError::Charset(s));
        }
        Ok(VmId(s))
    }

    /// A fresh id `<prefix>-<8 hex>`; `prefix` is sanitised to the id charset and shortened.
    pub fn generate(prefix: &str) -> Self {
        let mut p: String = prefix
            .chars()
            .map(|c| c.to_ascii_lowercase())
            .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
            .take(40)
            .collect();
        p = p.trim_matches('-').to_string();
        if p.is_empty() {
            p.push_str("vm");
        }
        let suffix: u32 = rand::random();
        VmId(format!("{p}-{suffix:08x}"))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for VmId {
    type Err = VmIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        VmId::new(s)
    }
}

impl TryFrom<String> for VmId {
    type Error = VmIdError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        VmId::new(s)
    }
}

impl From<VmId> for String {
    fn from(id: VmId) -> String {
        id.0
    }
}

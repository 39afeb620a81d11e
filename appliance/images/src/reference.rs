//! Names: [`Reference`] (`repo[:tag]`, a bare `repo` meaning `repo:latest`) and [`Digest`]
//! (`sha256:<64 lowercase hex>`), both validated on parse.
//!
//! A repository is one or more `/`-separated components of `[a-z0-9._-]`, each starting with
//! `[a-z0-9]`, at most 255 characters in all; a tag is `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
//! The tag is split off at the last `:` that is followed by no `/`. A string of the digest
//! form is never a reference (no repository may be called `sha256`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

/// A string that is not a valid `repo[:tag]` reference or `sha256:<hex>` digest (it becomes
/// [`crate::ImageError::BadRef`] where a store operation meets it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid reference {reference:?}: {reason}")]
pub struct BadRef {
    /// The string.
    pub reference: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The tag a bare `repo` means.
pub const DEFAULT_TAG: &str = "latest";
/// Longest repository name.
pub const MAX_REPO_LEN: usize = 255;
/// Longest tag.
pub const MAX_TAG_LEN: usize = 128;

/// A content digest: the SHA-256 of a blob, written `sha256:<64 lowercase hex>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    /// The algorithm prefix.
    pub const PREFIX: &'static str = "sha256:";

    /// Parses `sha256:<64 lowercase hex>`.
    pub fn parse(s: &str) -> Result<Self, BadRef> {
        let bad = |reason: &str| BadRef { reference: s.to_string(), reason: reason.to_string() };
        let hex = s.strip_prefix(Self::PREFIX).ok_or_else(|| bad("a digest starts with sha256:"))?;
        Self::from_hex(hex).ok_or_else(|| bad("a sha256 digest has 64 lowercase hex digits"))
    }

    /// A digest from its 64 lowercase hex digits (a blob file name).
    pub fn from_hex(hex: &str) -> Option<Self> {
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .then(|| Digest(hex.to_string()))
    }

    /// The digest of `bytes`.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::from_hasher(sha2::Sha256::new_with_prefix(bytes))
    }

    /// Finishes a running hash.
    pub(crate) fn from_hasher(h: sha2::Sha256) -> Self {
        Digest(hex::encode(h.finalize()))
    }

    /// The 64 hex digits (the blob's file name).
    pub fn hex(&self) -> &str {
        &self.0
    }

    /// Whether `s` has the digest form (and so is no reference).
    pub fn looks_like(s: &str) -> bool {
        s.starts_with(Self::PREFIX)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::PREFIX, self.0)
    }
}

impl FromStr for Digest {
    type Err = BadRef;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Digest::parse(s)
    }
}

impl TryFrom<String> for Digest {
    type Error = BadRef;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Digest::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.to_string()
    }
}

/// A name in the store: `repo:tag`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Reference {
    repo: String,
    tag: String,
}

fn component_ok(c: &str) -> bool {
    let mut b = c.bytes();
    matches!(b.next(), Some(x) if x.is_ascii_lowercase() || x.is_ascii_digit())
        && b.all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || matches!(x, b'.' | b'_' | b'-'))
}

fn tag_ok(t: &str) -> bool {
    let mut b = t.bytes();
    t.len() <= MAX_TAG_LEN
        && matches!(b.next(), Some(x) if x.is_ascii_alphanumeric() || x == b'_')
        && b.all(|x| x.is_ascii_alphanumeric() || matches!(x, b'.' | b'_' | b'-'))
}

impl Reference {
    /// Parses and validates `repo[:tag]`.
    pub fn parse(s: &str) -> Result<Self, BadRef> {
        let bad = |reason: &str| BadRef { reference: s.to_string(), reason: reason.to_string() };
        if Digest::looks_like(s) {
            return Err(bad("a digest is not a name"));
        }
        let (repo, tag) = match s.rfind(':') {
            Some(i) if !s[i + 1..].contains('/') => (&s[..i], &s[i + 1..]),
            _ => (s, DEFAULT_TAG),
        };
        if repo.is_empty() {
            return Err(bad("empty repository"));
        }
        if repo.len() > MAX_REPO_LEN {
            return Err(bad("repository longer than 255 characters"));
        }
        if !repo.split('/').all(component_ok) {
            return Err(bad(
                "a repository is /-separated components of [a-z0-9._-], each starting with a letter or digit",
            ));
        }
        if !tag_ok(tag) {
            return Err(bad("a tag is 1..=128 characters of [A-Za-z0-9._-], not starting with '.' or '-'"));
        }
        Ok(Reference { repo: repo.to_string(), tag: tag.to_string() })
    }

    /// The repository.
    pub fn repo(&self) -> &str {
        &self.repo
    }

    /// The tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.repo, self.tag)
    }
}

impl FromStr for Reference {
    type Err = BadRef;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Reference::parse(s)
    }
}

impl TryFrom<String> for Reference {
    type Error = BadRef;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Reference::parse(&s)
    }
}

impl From<Reference> for String {
    fn from(r: Reference) -> String {
        r.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_with_latest_default() {
        let r = Reference::parse("ubuntu-dev-base").expect("bare repo");
        assert_eq!((r.repo(), r.tag()), ("ubuntu-dev-base", "latest"));
        assert_eq!(r.to_string(), "ubuntu-dev-base:latest");
        let r = Reference::parse("ghcr.io/cocoonstack/sandbox/rt:24.04").expect("registry path");
        assert_eq!((r.repo(), r.tag()), ("ghcr.io/cocoonstack/sandbox/rt", "24.04"));
        let long = format!("vk-default-{}:hibernate", "x".repeat(80));
        assert!(Reference::parse(&long).is_ok(), "refs longer than 63 chars are fine");
        assert_eq!(Reference::parse("a:B_1.x-y").expect("tag charset").tag(), "B_1.x-y");
    }

    #[test]
    fn bad_references_are_refused() {
        for s in [
            "",
            ":tag",
            "Upper",
            "a//b",
            "/a",
            "a/",
            "a:",
            "a:-x",
            "a:.x",
            "a b",
            "a:b:c",
            "localhost:5000/x",
            "../x",
            "a/../b",
            "-a",
            "é",
            "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        ] {
            assert!(matches!(Reference::parse(s), Err(BadRef { .. })), "{s:?} must be refused");
        }
        assert!(Reference::parse(&format!("a:{}", "t".repeat(129))).is_err());
        assert!(Reference::parse(&format!("a:{}", "t".repeat(128))).is_ok());
        assert!(Reference::parse(&"r".repeat(256)).is_err());
    }

    #[test]
    fn digests() {
        let d = Digest::of_bytes(b"");
        assert_eq!(d.to_string(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(Digest::parse(&d.to_string()).expect("round trip"), d);
        assert!(Digest::parse("sha256:E3B0").is_err());
        assert!(Digest::parse("md5:00").is_err());
        assert!(Digest::parse(&format!("sha256:{}", "g".repeat(64))).is_err());
        let json = serde_json::to_string(&d).expect("ser");
        assert_eq!(serde_json::from_str::<Digest>(&json).expect("de"), d);
        assert!(serde_json::from_str::<Digest>("\"sha256:12\"").is_err());
    }
}

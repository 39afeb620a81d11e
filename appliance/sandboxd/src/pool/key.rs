//! Pool keys: `(template, net, size)` with validation, and the key hash that names golden dirs.
//!
//! - template: `^[a-zA-Z0-9][a-zA-Z0-9._:/-]{0,62}$` (a template name or an OCI-style image ref);
//! - net: `none` (default) or `egress`;
//! - size: one of the five size classes (default `small`).
//!
//! The key hash is the first 16 bytes of SHA-256 of `template|net|size`, as 32 lowercase hex chars.

use std::fmt;
use std::str::FromStr;

use sandboxd_api::Key;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vmm::SizeClass;

/// Why a pool key is malformed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    /// The template name is empty or breaks the name rule.
    #[error("invalid template {0:?} (want ^[a-zA-Z0-9][a-zA-Z0-9._:/-]{{0,62}}$)")]
    Template(String),
    /// `net` is not `none` or `egress`.
    #[error("invalid net {0:?} (want none or egress)")]
    Net(String),
    /// `size` is not a size class.
    #[error("invalid size {0:?} (want small, medium, large, xlarge or 2xlarge)")]
    Size(String),
}

/// The network lane of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Net {
    /// No NIC.
    #[default]
    None,
    /// A NIC with egress.
    Egress,
}

impl Net {
    /// The lane name as used in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Net::None => "none",
            Net::Egress => "egress",
        }
    }
}

impl FromStr for Net {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" | "none" => Ok(Net::None),
            "egress" => Ok(Net::Egress),
            other => Err(KeyError::Net(other.to_string())),
        }
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

pub use vmm::catalog::valid_template;

/// A pool key. Serialises as `{"template","net","size"}` (the API's `key` object,
/// [`sandboxd_api::Key`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Key", into = "Key")]
pub struct PoolKey {
    template: String,
    net: Net,
    size: SizeClass,
}

impl PoolKey {
    /// Validates the three axes; empty `net` / `size` mean `none` / `small`.
    pub fn parse(template: &str, net: Option<&str>, size: Option<&str>) -> Result<Self, KeyError> {
        if !valid_template(template) {
            return Err(KeyError::Template(template.to_string()));
        }
        let net = net.unwrap_or("").parse::<Net>()?;
        let size = match size.unwrap_or("") {
            "" => SizeClass::Small,
            s => s.parse::<SizeClass>().map_err(|_| KeyError::Size(s.to_string()))?,
        };
        Ok(PoolKey { template: template.to_string(), net, size })
    }

    /// A key from already-typed parts (the template is still validated).
    pub fn new(template: &str, net: Net, size: SizeClass) -> Result<Self, KeyError> {
        Self::parse(template, Some(net.as_str()), Some(size.as_str()))
    }

    /// The template name.
    pub fn template(&self) -> &str {
        &self.template
    }

    /// The network lane.
    pub fn net(&self) -> Net {
        self.net
    }

    /// The size class.
    pub fn size(&self) -> SizeClass {
        self.size
    }

    /// First 16 bytes of SHA-256 of `template|net|size`, lowercase hex (32 chars).
    pub fn hash(&self) -> String {
        let digest = Sha256::digest(self.to_string().as_bytes());
        hex::encode(&digest[..16])
    }
}

impl Ord for PoolKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (&self.template, self.net, self.size.as_str()).cmp(&(&other.template, other.net, other.size.as_str()))
    }
}

impl PartialOrd for PoolKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for PoolKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}|{}|{}", self.template, self.net, self.size)
    }
}

/// Validates a wire key (empty `net` and `size` take their defaults).
impl TryFrom<Key> for PoolKey {
    type Error = KeyError;
    fn try_from(k: Key) -> Result<Self, Self::Error> {
        PoolKey::parse(&k.template, Some(&k.net), Some(&k.size))
    }
}

/// The wire key, every axis written out.
impl From<PoolKey> for Key {
    fn from(k: PoolKey) -> Key {
        Key { template: k.template, net: k.net.as_str().to_string(), size: k.size.as_str().to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_rule() {
        for ok in ["base", "rt", "ghcr.io/cocoonstack/sandbox/rt:24.04", "a", "A_b-c.d:e/f", &"a".repeat(63)] {
            assert!(valid_template(ok), "{ok}");
        }
        for bad in ["", "-x", ".x", "a b", "a\n", &"a".repeat(64), "é", "a?b"] {
            assert!(!valid_template(bad), "{bad:?}");
        }
    }

    #[test]
    fn defaults_and_errors() {
        let k = PoolKey::parse("base", None, Some("")).expect("defaults");
        assert_eq!((k.net(), k.size()), (Net::None, SizeClass::Small));
        assert_eq!(k.to_string(), "base|none|small");
        assert_eq!(PoolKey::parse("base", Some("wifi"), None), Err(KeyError::Net("wifi".into())));
        assert_eq!(PoolKey::parse("base", None, Some("huge")), Err(KeyError::Size("huge".into())));
        assert!(matches!(PoolKey::parse("", None, None), Err(KeyError::Template(_))));
    }

    #[test]
    fn hash_is_sha256_prefix_of_pipe_joined_axes() {
        let k = PoolKey::parse("base", Some("none"), Some("small")).expect("key");
        let full = hex::encode(Sha256::digest(b"base|none|small"));
        assert_eq!(k.hash(), full[..32]);
        assert_eq!(k.hash().len(), 32);
        let other = PoolKey::parse("base", Some("none"), Some("medium")).expect("key");
        assert_ne!(k.hash(), other.hash());
    }

    #[test]
    fn serde_shape() {
        let k: PoolKey = serde_json::from_str(r#"{"template":"rt","size":"large"}"#).expect("parse");
        assert_eq!(
            serde_json::to_value(&k).expect("ser"),
            serde_json::json!({"template":"rt","net":"none","size":"large"})
        );
        assert!(serde_json::from_str::<PoolKey>(r#"{"template":"-x"}"#).is_err());
    }
}

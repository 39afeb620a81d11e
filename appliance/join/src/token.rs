//! The bootstrap token (`<id>.<secret>`) and the CA public-key pin (`sha256:<hex>`).

use std::fmt;
use std::str::FromStr;

/// Why a token or a CA hash does not parse.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Not `[a-z0-9]{6}.[a-z0-9]{16}` (the secret is never echoed).
    #[error("bootstrap token is not of the form [a-z0-9]{{6}}.[a-z0-9]{{16}}")]
    BadToken,
    /// Not `sha256:<64 hex>`.
    #[error("CA hash {0:?} is not of the form sha256:<64 hex digits>")]
    BadCaHash(String),
}

fn is_token_part(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A kubeadm bootstrap token. Debug and Display show only the id: the secret is a credential.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken {
    id: String,
    secret: String,
}

impl BootstrapToken {
    /// The public token id (authenticates as `system:bootstrap:<id>`).
    pub fn id(&self) -> &str {
        &self.id
    }
    /// The secret half: the JWS key.
    pub fn secret(&self) -> &str {
        &self.secret
    }
    /// `<id>.<secret>`, the Bearer credential.
    pub fn bearer(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }
}

impl FromStr for BootstrapToken {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, TokenError> {
        let (id, secret) = s.trim().split_once('.').ok_or(TokenError::BadToken)?;
        if !is_token_part(id, 6) || !is_token_part(secret, 16) {
            return Err(TokenError::BadToken);
        }
        Ok(BootstrapToken { id: id.to_owned(), secret: secret.to_owned() })
    }
}

impl fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootstrapToken({}.<redacted>)", self.id)
    }
}

impl fmt::Display for BootstrapToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.<redacted>", self.id)
    }
}

/// `sha256:<hex>` of a CA certificate's SubjectPublicKeyInfo (`--discovery-token-ca-cert-hash`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CaHash(String);

impl CaHash {
    /// The pin of the DER SubjectPublicKeyInfo `spki`.
    pub fn of_spki(spki: &[u8]) -> CaHash {
        use sha2::Digest;
        CaHash(format!("sha256:{}", hex::encode(sha2::Sha256::digest(spki))))
    }
    /// The canonical `sha256:<lowercase hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for CaHash {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, TokenError> {
        let hex = s.trim().strip_prefix("sha256:").ok_or_else(|| TokenError::BadCaHash(s.to_owned()))?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TokenError::BadCaHash(s.to_owned()));
        }
        Ok(CaHash(format!("sha256:{}", hex.to_ascii_lowercase())))
    }
}

impl fmt::Display for CaHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn token_parses_and_never_prints_the_secret() {
        let t: BootstrapToken = "abcdef.0123456789abcdef".parse().unwrap();
        assert_eq!(t.id(), "abcdef");
        assert_eq!(t.secret(), "0123456789abcdef");
        assert_eq!(t.bearer(), "abcdef.0123456789abcdef");
        for shown in [format!("{t}"), format!("{t:?}")] {
            assert!(!shown.contains("0123456789abcdef"), "{shown}");
            assert!(shown.contains("abcdef"));
        }
    }

    #[test]
    fn bad_tokens_are_refused() {
        for bad in [
            "",
            "abcdef",
            "abcde.0123456789abcdef",
            "ABCDEF.0123456789abcdef",
            "abcdef.0123456789abcde",
            "abcdef.0123456789abcdefg",
            "abcdef:0123456789abcdef",
            "abcdef.0123456789abcde-",
        ] {
            assert!(bad.parse::<BootstrapToken>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ca_hash_parses_and_normalizes() {
        let h: CaHash = format!("sha256:{}", "AB".repeat(32)).parse().unwrap();
        assert_eq!(h.as_str(), format!("sha256:{}", "ab".repeat(32)));
        for bad in [
            "",
            "ab".repeat(32).as_str(),
            &format!("sha1:{}", "ab".repeat(32)),
            &format!("sha256:{}", "ab".repeat(31)),
            &format!("sha256:{}zz", "ab".repeat(31)),
        ] {
            assert!(bad.parse::<CaHash>().is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            CaHash::of_spki(b"abc").as_str(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

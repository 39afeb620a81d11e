//! Preview URLs (`docs/sandboxd.md` §5.2): a URL on `preview_listen` that proxies HTTP (and
//! WebSocket) to one port of one sandbox until it expires, authorised by the token in its
//! path, `/p/<token>/…`.
//!
//! The token is `<payload>.<mac>`, both base64url without padding: the payload is
//! `<sandbox id>:<port>:<expiry, Unix seconds>`, the MAC its HMAC-SHA256 under the node's
//! preview key (32 random bytes in `<data_dir>/preview.key`, 0600, made on first use, so that
//! URLs outlive a restart). Verification compares in constant time and refuses an expired or
//! malformed token alike; the sandbox must still be claimed (the proxy checks).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use rand::RngCore as _;
use sha2::Sha256;

/// The preview key file under the data dir.
pub const KEY_FILE: &str = "preview.key";
/// Default lifetime of a preview URL.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Longest lifetime of a preview URL.
pub const MAX_TTL: Duration = Duration::from_secs(86_400);

/// Why a preview token was refused (all answered alike, `404`: nothing leaks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token this node could have made.
    #[error("invalid preview token")]
    Invalid,
    /// Past its expiry.
    #[error("preview token expired")]
    Expired,
}

/// What a valid token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The sandbox.
    pub sandbox: String,
    /// Its guest port.
    pub port: u16,
    /// Expiry, Unix seconds.
    pub expires: u64,
}

/// The node's preview key and where previews are served.
#[derive(Clone)]
pub struct Previews {
    key: [u8; 32],
    /// The origin clients reach `preview_listen` at (`http://host:port`).
    pub base_url: String,
}

impl std::fmt::Debug for Previews {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Previews").field("base_url", &self.base_url).finish_non_exhaustive()
    }
}

impl Previews {
    /// Loads `<data_dir>/preview.key`, or makes it (0600) when absent.
    pub fn open(data_dir: &Path, base_url: String) -> std::io::Result<Self> {
        let path = data_dir.join(KEY_FILE);
        let key = match std::fs::read(&path) {
            Ok(bytes) if bytes.len() == 32 => bytes,
            Ok(_) => return Err(std::io::Error::other(format!("{} is not a 32-byte key", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut k = vec![0u8; 32];
                rand::rng().fill_bytes(&mut k);
                foundation::private_dir(data_dir)?;
                foundation::write_secret(&path, &k)?;
                k
            }
            Err(e) => return Err(e),
        };
        let mut arr = [0u8; 32];
        arr.copy_from_slice(&key);
        Ok(Self { key: arr, base_url: base_url.trim_end_matches('/').to_string() })
    }

    /// A key for tests.
    pub fn with_key(key: [u8; 32], base_url: &str) -> Self {
        Self { key, base_url: base_url.trim_end_matches('/').to_string() }
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length: this cannot fail.
        Hmac::<Sha256>::new_from_slice(&self.key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"))
    }

    /// The URL of `port` of `sandbox`, valid for `ttl` from `now`.
    pub fn url(&self, sandbox: &str, port: u16, ttl: Duration, now: SystemTime) -> String {
        let expires = unix(now).saturating_add(ttl.min(MAX_TTL).as_secs());
        let payload = format!("{sandbox}:{port}:{expires}");
        let mut mac = self.mac();
        mac.update(payload.as_bytes());
        let tag = mac.finalize().into_bytes();
        format!("{}/p/{}.{}/", self.base_url, URL_SAFE_NO_PAD.encode(payload), URL_SAFE_NO_PAD.encode(tag))
    }

    /// Checks a token at `now`.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Grant, TokenError> {
        let (payload, tag) = token.split_once('.').ok_or(TokenError::Invalid)?;
        let payload = URL_SAFE_NO_PAD.decode(payload).map_err(|_| TokenError::Invalid)?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| TokenError::Invalid)?;
        let mut mac = self.mac();
        mac.update(&payload);
        mac.verify_slice(&tag).map_err(|_| TokenError::Invalid)?;
        let text = String::from_utf8(payload).map_err(|_| TokenError::Invalid)?;
        let mut parts = text.split(':');
        let (Some(sandbox), Some(port), Some(expires), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::Invalid);
        };
        let port: u16 = port.parse().map_err(|_| TokenError::Invalid)?;
        let expires: u64 = expires.parse().map_err(|_| TokenError::Invalid)?;
        if unix(now) >= expires {
            return Err(TokenError::Expired);
        }
        Ok(Grant { sandbox: sandbox.to_string(), port, expires })
    }
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token_of(url: &str) -> &str {
        url.split("/p/").nth(1).and_then(|t| t.strip_suffix('/')).expect("token")
    }

    #[test]
    fn tokens_verify_expire_and_resist_tampering() {
        let p = Previews::with_key([7; 32], "http://127.0.0.1:8080/");
        let now = SystemTime::now();
        let url = p.url("sb_0123456789abcdef", 8000, Duration::from_secs(60), now);
        assert!(url.starts_with("http://127.0.0.1:8080/p/") && url.ends_with('/'), "{url}");
        let t = token_of(&url);
        let g = p.verify(t, now).expect("valid");
        assert_eq!((g.sandbox.as_str(), g.port), ("sb_0123456789abcdef", 8000));
        assert_eq!(p.verify(t, now + Duration::from_secs(61)), Err(TokenError::Expired));
        // Another key, a changed payload, a cut or garbled token: all invalid.
        let other = Previews::with_key([8; 32], "http://x");
        assert_eq!(other.verify(t, now), Err(TokenError::Invalid));
        let (payload, tag) = t.split_once('.').expect("dot");
        let forged = URL_SAFE_NO_PAD.encode("sb_0123456789abcdef:22:99999999999");
        for bad in [format!("{forged}.{tag}"), payload.to_string(), format!("{payload}."), "..".into(), "%%.%%".into()]
        {
            assert_eq!(p.verify(&bad, now), Err(TokenError::Invalid), "{bad}");
        }
        // The lifetime is capped.
        let long = p.url("sb_x", 1, Duration::from_secs(10 * 86_400), now);
        assert!(p.verify(token_of(&long), now + MAX_TTL + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn the_key_is_made_once_private_and_reused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Previews::open(dir.path(), "http://h".into()).expect("make");
        let mode = std::fs::metadata(dir.path().join(KEY_FILE)).expect("key").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let b = Previews::open(dir.path(), "http://h".into()).expect("reuse");
        let now = SystemTime::now();
        let url = a.url("sb_1", 80, DEFAULT_TTL, now);
        assert!(b.verify(token_of(&url), now).is_ok(), "a restart keeps URLs valid");
        std::fs::write(dir.path().join(KEY_FILE), b"short").expect("write");
        assert!(Previews::open(dir.path(), "http://h".into()).is_err());
    }
}

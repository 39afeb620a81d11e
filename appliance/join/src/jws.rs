//! The detached JWS the `bootstrapsigner` controller writes into `cluster-info`
//! (`jws-kubeconfig-<tokenid>`): compact JWS with an empty payload, HS256 keyed with the
//! token secret, `kid` = token id (as `k8s.io/cluster-bootstrap/token/jws`).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use crate::token::BootstrapToken;

/// Why a detached signature does not verify.
#[derive(Debug, thiserror::Error)]
pub enum JwsError {
    /// Not `<header>..<signature>`.
    #[error("not a detached compact JWS (<header>..<signature>)")]
    Malformed,
    /// The header is not base64url JSON.
    #[error("JWS header is not base64url JSON")]
    Header(#[source] serde_json::Error),
    /// The header names another algorithm.
    #[error("JWS alg is {0:?}, want HS256")]
    Alg(String),
    /// The header's `kid` is missing or another token's.
    #[error("JWS kid is {actual:?}, want {expected:?}")]
    Kid { expected: String, actual: Option<String> },
    /// The MAC does not match.
    #[error("JWS signature does not match")]
    Signature,
}

#[derive(serde::Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
}

/// Computes the detached JWS over `payload` (as the bootstrap signer does).
pub fn sign_detached(payload: &[u8], token: &BootstrapToken) -> String {
    let header = URL_SAFE_NO_PAD.encode(serde_json::json!({"alg": "HS256", "kid": token.id()}).to_string());
    let input = format!("{header}.{}", URL_SAFE_NO_PAD.encode(payload));
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.secret().as_bytes());
    let sig = ring::hmac::sign(&key, input.as_bytes());
    format!("{header}..{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
}

/// Verifies the detached JWS `jws` over `payload` for `token`.
pub fn verify_detached(jws: &str, payload: &[u8], token: &BootstrapToken) -> Result<(), JwsError> {
    let mut parts = jws.trim().split('.');
    let (Some(header_b64), Some(""), Some(sig_b64), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwsError::Malformed);
    };
    let header_json = URL_SAFE_NO_PAD.decode(header_b64).map_err(|_| JwsError::Malformed)?;
    let header: Header = serde_json::from_slice(&header_json).map_err(JwsError::Header)?;
    if header.alg != "HS256" {
        return Err(JwsError::Alg(header.alg));
    }
    if header.kid.as_deref() != Some(token.id()) {
        return Err(JwsError::Kid { expected: token.id().to_owned(), actual: header.kid });
    }
    let sig = URL_SAFE_NO_PAD.decode(sig_b64).map_err(|_| JwsError::Malformed)?;
    let input = format!("{header_b64}.{}", URL_SAFE_NO_PAD.encode(payload));
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.secret().as_bytes());
    // Constant-time comparison inside ring.
    ring::hmac::verify(&key, input.as_bytes(), &sig).map_err(|_| JwsError::Signature)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn token() -> BootstrapToken {
        "abcdef.0123456789abcdef".parse().unwrap()
    }

    #[test]
    fn a_signature_verifies_and_is_keyed_with_the_secret_only() {
        let t = token();
        let jws = sign_detached(b"kubeconfig", &t);
        verify_detached(&jws, b"kubeconfig", &t).unwrap();
        // HS256 with key = secret, computed independently of sign_detached.
        let (header, sig) = jws.split_once("..").unwrap();
        let input = format!("{header}.{}", URL_SAFE_NO_PAD.encode(b"kubeconfig"));
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"0123456789abcdef");
        assert_eq!(URL_SAFE_NO_PAD.encode(ring::hmac::sign(&key, input.as_bytes()).as_ref()), sig);
    }

    #[test]
    fn tampered_payload_wrong_key_and_bad_headers_fail() {
        let t = token();
        let jws = sign_detached(b"kubeconfig", &t);
        assert!(matches!(verify_detached(&jws, b"kubeconfiG", &t), Err(JwsError::Signature)));
        let other: BootstrapToken = "abcdef.0123456789abcdee".parse().unwrap();
        assert!(matches!(verify_detached(&jws, b"kubeconfig", &other), Err(JwsError::Signature)));
        let other_id: BootstrapToken = "abcdeg.0123456789abcdef".parse().unwrap();
        assert!(matches!(verify_detached(&jws, b"kubeconfig", &other_id), Err(JwsError::Kid { .. })));
        for bad in ["", "x", "a.b.c", "a..b..c", &jws.replacen("..", ".", 1)] {
            assert!(verify_detached(bad, b"kubeconfig", &t).is_err(), "{bad:?} verified");
        }
        let none = URL_SAFE_NO_PAD.encode(r#"{"alg":"none","kid":"abcdef"}"#);
        let forged = format!("{none}..{}", jws.split_once("..").unwrap().1);
        assert!(matches!(verify_detached(&forged, b"kubeconfig", &t), Err(JwsError::Alg(_))));
        let no_kid = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256"}"#);
        let forged = format!("{no_kid}..{}", jws.split_once("..").unwrap().1);
        assert!(matches!(verify_detached(&forged, b"kubeconfig", &t), Err(JwsError::Kid { actual: None, .. })));
    }
}

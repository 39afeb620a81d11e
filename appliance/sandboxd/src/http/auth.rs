//! Authentication (spec §3): the root token from the config's token file, and per-sandbox
//! bearer tokens. All comparisons are constant-time; sandbox routes look up by id, then
//! compare, and answer `404` for both an unknown id and a wrong token.

use axum::http::{header, HeaderMap};
use subtle::ConstantTimeEq as _;

use super::error::ApiError;
use crate::claims::Claim;
use crate::node::Node;

/// Constant-time string equality (length is not secret).
pub fn ct_eq(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Whether the request presents the root token (false when none is configured).
pub fn is_root(node: &Node, headers: &HeaderMap) -> bool {
    match (node.api_token(), bearer(headers)) {
        (Some(root), Some(t)) => ct_eq(t, root),
        _ => false,
    }
}

/// A node (or root) route: open when no root token is configured.
pub fn node_route(node: &Node, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(root) = node.api_token() else {
        return Ok(());
    };
    match bearer(headers) {
        None => Err(ApiError::MissingToken),
        Some(t) if ct_eq(t, root) => Ok(()),
        Some(_) => Err(ApiError::InvalidToken),
    }
}

/// A sandbox route: the sandbox's own token or the root token.
pub fn sandbox_route(node: &Node, headers: &HeaderMap, id: &str) -> Result<Claim, ApiError> {
    let token = bearer(headers).ok_or(ApiError::MissingToken)?;
    let claim = node.sandbox(id);
    let root = node.api_token().is_some_and(|r| ct_eq(token, r));
    match claim {
        Some(c) if root || ct_eq(token, &c.rec.token) => Ok(c),
        _ => Err(ApiError::no_sandbox()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().expect("hv"));
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().expect("hv"));
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().expect("hv"));
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer ".parse().expect("hv"));
        assert_eq!(bearer(&h), None);
        assert!(ct_eq("abc", "abc") && !ct_eq("abc", "abd") && !ct_eq("abc", "ab"));
    }
}

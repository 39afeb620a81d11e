//! Authentication (`docs/sandboxd.md` §3): the root token from the config's token file, and per-sandbox
//! bearer tokens. All comparisons are constant-time; sandbox routes look up by id, then
//! compare, and answer `404` for both an unknown id and a wrong token.
//!
//! | route kind | token configured | no token (loopback development) |
//! |---|---|---|
//! | node ([`node_route`]): claim, list, per-id read, stats, info, drain, `GET /v1/pools`, peers, metrics, checkpoints (list, claim, delete), `DELETE /v1/templates` | root, else `401` | open |
//! | node + body token: fork, checkpoint, promote, preview | root in the header, else `401`; the sandbox's token in the body, else `404` | the sandbox's token in the body |
//! | root-only ([`root_only`]): `PUT /v1/pools` (persisted, outlives the session) | root, else `401` | `403` |
//! | sandbox ([`sandbox_route`]): release, renew, owner, agent, ports, exec, console, hibernate, wake | the sandbox's token or root, else `404` (`401` without a header) | the sandbox's token |

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

fn refused(node: &Node, e: ApiError) -> ApiError {
    crate::metrics::inc(&node.metrics.auth_failures);
    e
}

/// A node (or root) route: open when no root token is configured.
pub fn node_route(node: &Node, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(root) = node.api_token() else {
        return Ok(());
    };
    match bearer(headers) {
        None => Err(refused(node, ApiError::MissingToken)),
        Some(t) if ct_eq(t, root) => Ok(()),
        Some(_) => Err(refused(node, ApiError::InvalidToken)),
    }
}

/// A root-only route that changes what outlives the session (`PUT /v1/pools`): the root
/// token, and refused outright (`403`) on a node that has none.
pub fn root_only(node: &Node, headers: &HeaderMap, what: &str) -> Result<(), ApiError> {
    if node.api_token().is_none() {
        return Err(ApiError::Forbidden(format!(
            "{what} needs the root token and this node has none: set api_token_file in sandboxd's config"
        )));
    }
    node_route(node, headers)
}

/// A sandbox route: the sandbox's own token or the root token.
pub fn sandbox_route(node: &Node, headers: &HeaderMap, id: &str) -> Result<Claim, ApiError> {
    let token = bearer(headers).ok_or_else(|| refused(node, ApiError::MissingToken))?;
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

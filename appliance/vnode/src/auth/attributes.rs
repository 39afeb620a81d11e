//! What a request to the kubelet port asks for, in the API's terms (the kubelet's
//! `nodeAuthorizerAttributesGetter`): resource `nodes`, name = this node, API version `v1`, a
//! subresource from the path and a verb from the method.
//!
//! | path | subresource |
//! |---|---|
//! | `/stats`, `/stats/…` | `stats` |
//! | `/metrics`, `/metrics/…` | `metrics` |
//! | `/logs`, `/logs/…` | `log` |
//! | anything else (`/pods`, `/exec/…`, `/healthz`, …) | `proxy` |
//!
//! | method | verb |
//! |---|---|
//! | GET, HEAD | `get` |
//! | POST | `create` |
//! | PUT | `update` |
//! | PATCH | `patch` |
//! | DELETE | `delete` |
//! | anything else | none: refused (403) without asking the API server |
//!
//! The verb is the method's whatever the route: the WebSocket upgrades of exec, attach and
//! port-forward, which the API server sends as `GET`, are authorized as `get` on `proxy`, as
//! the 1.37 kubelet does (`pkg/kubelet/server/auth.go`, `GetRequestAttributes`); the SPDY
//! clients' `POST` would be `create`.
//!
//! The path is the raw request path, the very string the router matches, so what is authorized
//! is what is served (`/stats/../pods` is authorized as `stats` and routed to nothing).

use axum::http::Method;

/// The `resourceAttributes` of one request's `SubjectAccessReview`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attributes {
    /// `get`, `create`, `update`, `patch` or `delete`.
    pub verb: &'static str,
    /// `proxy`, `stats`, `metrics` or `log`.
    pub subresource: &'static str,
    /// This node's name.
    pub node: String,
}

impl Attributes {
    /// The resource every kubelet request is about.
    pub const RESOURCE: &'static str = "nodes";
    /// Its API version (core group).
    pub const VERSION: &'static str = "v1";

    /// The attributes of `method path` on `node`; `None` when the method has no API verb.
    pub fn of(method: &Method, path: &str, node: &str) -> Option<Attributes> {
        Some(Attributes { verb: verb(method)?, subresource: subresource(path), node: node.to_owned() })
    }
}

/// The API verb of an HTTP method (HEAD is a GET without a body).
pub fn verb(method: &Method) -> Option<&'static str> {
    match *method {
        Method::GET | Method::HEAD => Some("get"),
        Method::POST => Some("create"),
        Method::PUT => Some("update"),
        Method::PATCH => Some("patch"),
        Method::DELETE => Some("delete"),
        _ => None,
    }
}

/// `path` is `prefix` itself or lies under it (`/stats`, `/stats/`, `/stats/summary`; not
/// `/statsfoo`).
fn is_under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The `nodes` subresource a request path is authorized as.
pub fn subresource(path: &str) -> &'static str {
    if is_under(path, "/stats") {
        "stats"
    } else if is_under(path, "/metrics") {
        "metrics"
    } else if is_under(path, "/logs") {
        "log"
    } else {
        "proxy"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_the_kubelets_subresources() {
        for (path, want) in [
            ("/stats", "stats"),
            ("/stats/", "stats"),
            ("/stats/summary", "stats"),
            ("/stats/../pods", "stats"),
            ("/statsfoo", "proxy"),
            ("/metrics", "metrics"),
            ("/metrics/resource", "metrics"),
            ("/metrics/cadvisor", "metrics"),
            ("/metricsx", "proxy"),
            ("/logs", "log"),
            ("/logs/", "log"),
            ("/logs/syslog", "log"),
            ("/logsx", "proxy"),
            ("/containerLogs/ns/pod/c", "proxy"),
            ("/pods", "proxy"),
            ("/runningpods/", "proxy"),
            ("/exec/ns/pod/c", "proxy"),
            ("/attach/ns/pod/c", "proxy"),
            ("/portForward/ns/pod", "proxy"),
            ("/healthz", "proxy"),
            ("/", "proxy"),
            ("", "proxy"),
            ("/STATS/summary", "proxy"),
        ] {
            assert_eq!(subresource(path), want, "{path:?}");
        }
    }

    #[test]
    fn methods_map_to_api_verbs() {
        for (method, want) in [
            (Method::GET, Some("get")),
            (Method::HEAD, Some("get")),
            (Method::POST, Some("create")),
            (Method::PUT, Some("update")),
            (Method::PATCH, Some("patch")),
            (Method::DELETE, Some("delete")),
            (Method::OPTIONS, None),
            (Method::CONNECT, None),
            (Method::TRACE, None),
            (Method::from_bytes(b"PROPFIND").expect("method"), None),
        ] {
            assert_eq!(verb(&method), want, "{method}");
        }
        let a = Attributes::of(&Method::POST, "/exec/ns/p/c", "vk-1").expect("mapped");
        assert_eq!(a, Attributes { verb: "create", subresource: "proxy", node: "vk-1".into() });
        assert!(Attributes::of(&Method::OPTIONS, "/pods", "vk-1").is_none());
        // The API server's WebSocket upgrades are GETs: `get` on `proxy`, as the kubelet.
        for path in ["/exec/ns/p/c", "/attach/ns/p/c", "/portForward/ns/p", "/containerLogs/ns/p/c"] {
            let a = Attributes::of(&Method::GET, path, "vk-1").expect("mapped");
            assert_eq!((a.verb, a.subresource), ("get", "proxy"), "{path}");
        }
    }
}

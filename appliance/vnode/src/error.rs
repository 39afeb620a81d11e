//! [`VnodeError`]: why [`crate::run`] could not start, plus small helpers that classify
//! API errors (NotFound, Conflict, transient).

use std::net::SocketAddr;

/// A fatal start-up error. Anything that can heal on its own (the API server away, a refused
/// Lease renewal, a failing provider call) is logged and retried instead.
#[derive(Debug, thiserror::Error)]
pub enum VnodeError {
    #[error("invalid node configuration: {0}")]
    Config(String),
    #[error("the kubelet endpoint cannot listen on {addr}; free the port or pick another listen address")]
    KubeletListen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the kubelet endpoint's TLS setup failed")]
    KubeletTls(#[source] crate::tls::TlsError),
    #[error(
        "the client CA of the kubelet endpoint is unusable; fix --client-ca-file or the cluster CA in the kubeconfig"
    )]
    ClientCa(#[source] crate::auth::x509::ClientCaError),
    #[error(
        "the API server refused to register Node {node:?} (403 Forbidden: {message}). Under the Node \
         authorizer and NodeRestriction the client must be system:node:{node} (a node may only write its \
         own Node) and may not set labels under kubernetes.io/ or k8s.io/ other than the allowed ones \
         (kubernetes.io/hostname, kubernetes.io/os, kubernetes.io/arch, node.kubernetes.io/…, \
         kubelet.kubernetes.io/…, topology/instance-type)"
    )]
    NodeForbidden { node: String, message: String },
    #[error("the API server rejected Node {node:?} ({code}): {message}")]
    NodeRejected { node: String, code: u16, message: String },
}

/// The HTTP status of an API error response, if `e` is one.
pub(crate) fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

pub(crate) fn is_not_found(e: &kube::Error) -> bool {
    api_code(e) == Some(404)
}

pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    api_code(e) == Some(409)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn chain_appends_causes_once() {
        let e = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(foundation::error_chain(&e), "outer: disk on fire");
        let p = crate::ProviderError::new(std::io::Error::other("no capacity"));
        assert_eq!(foundation::error_chain(&p), "no capacity", "the wrapper's own text already is its cause");
    }

    #[test]
    fn api_codes_are_classified() {
        let status = kube::core::Status::failure("gone", "NotFound").with_code(404);
        let e = kube::Error::Api(Box::new(status));
        assert!(is_not_found(&e) && !is_conflict(&e));
        let status = kube::core::Status::failure("changed", "Conflict").with_code(409);
        assert!(is_conflict(&kube::Error::Api(Box::new(status))));
    }
}

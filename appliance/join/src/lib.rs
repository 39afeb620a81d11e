//! Joining a Kubernetes cluster as a virtual node, the kubeadm way: token discovery of the
//! cluster CA (`discovery`), then the kubelet TLS bootstrap of a `system:node:<name>` client
//! certificate (`bootstrap`). Both talk to the apiserver through `kube::Client`s that `api`
//! builds for each step (no trust, a pinned CA; anonymous, the bootstrap token, the node's
//! certificate). See `docs/appliance.md` §2.1–§2.3.

#![forbid(unsafe_code)]

mod api;
pub mod bootstrap;
pub mod discovery;
pub mod jws;
pub mod kubeconfig;
#[cfg(any(test, feature = "test-utils"))]
pub mod tls;
pub mod token;

use std::path::PathBuf;
use std::time::Duration;

pub use bootstrap::{bootstrap, renew, renew_if_due, rotation_deadline, NodeCredentials};
pub use discovery::{ca_hash_of_pem, discover, ClusterInfo};
pub use token::{BootstrapToken, CaHash, TokenError};

/// Why a join step failed. Every variant fails closed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("no CA hash pinned for {endpoint}: refusing to trust an unpinned cluster-info")]
    NoPins { endpoint: String },
    #[error("endpoint {endpoint:?} is not https://host[:port]")]
    Endpoint { endpoint: String },
    #[error("{endpoint}: building the API client")]
    Client {
        endpoint: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("{endpoint}: {what}")]
    Api {
        endpoint: String,
        what: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("{endpoint}: {what}: no answer within {timeout:?}")]
    Timeout { endpoint: String, what: String, timeout: Duration },
    #[error("{endpoint}: cluster-info: {what}")]
    ClusterInfo { endpoint: String, what: String },
    #[error("{endpoint}: cluster-info is not signed for token {token_id} (no jws-kubeconfig-{token_id}): wrong token, or the bootstrap signer has not run")]
    Unsigned { endpoint: String, token_id: String },
    #[error("{endpoint}: cluster-info signature for token {token_id} does not verify")]
    BadSignature {
        endpoint: String,
        token_id: String,
        #[source]
        source: jws::JwsError,
    },
    #[error("{endpoint}: discovery kubeconfig")]
    Kubeconfig {
        endpoint: String,
        #[source]
        source: kubeconfig::KubeconfigError,
    },
    #[error("{endpoint}: cluster CA public-key hash is {actual}, expected one of [{}]", .expected.iter().map(CaHash::as_str).collect::<Vec<_>>().join(", "))]
    CaHashMismatch { endpoint: String, expected: Vec<CaHash>, actual: CaHash },
    #[error("cluster CA: {0}")]
    BadCa(String),
    #[error("node certificate: {0}")]
    BadCert(String),
    #[error("building the CSR: {0}")]
    Csr(String),
    #[error("CSR {csr}: {what}")]
    CsrState { csr: String, what: String },
    #[error("CSR {csr}: watching for its certificate")]
    CsrWait {
        csr: String,
        #[source]
        source: kube::runtime::wait::Error,
    },
    #[error("CSR {csr} was not issued within {timeout:?} (is the csrapproving/csrsigning controller running?)")]
    CsrTimeout { csr: String, timeout: Duration },
    #[error("{}: writing the node kubeconfig", .path.display())]
    NodeKubeconfig {
        path: PathBuf,
        #[source]
        source: kubeconfig::KubeconfigError,
    },
    #[error("{}: {what}", .path.display())]
    State {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

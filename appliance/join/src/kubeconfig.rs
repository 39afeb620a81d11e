//! The two kubeconfigs of a join: the discovery one inside `cluster-info` (a cluster and
//! nothing else) and the node's own, written for the `system:node:<name>` identity.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use std::path::Path;

/// Why a kubeconfig cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("kubeconfig is not YAML")]
    Yaml(#[source] serde_yaml::Error),
    #[error("kubeconfig has no cluster")]
    NoCluster,
    #[error("kubeconfig cluster has no certificate-authority-data")]
    NoCa,
    #[error("certificate-authority-data is not base64")]
    CaBase64(#[source] base64::DecodeError),
}

#[derive(Deserialize)]
struct Config {
    #[serde(default)]
    clusters: Option<Vec<NamedCluster>>,
}

#[derive(Deserialize)]
struct NamedCluster {
    cluster: ClusterEntry,
}

#[derive(Deserialize)]
struct ClusterEntry {
    server: String,
    #[serde(rename = "certificate-authority-data")]
    ca_data: Option<String>,
}

/// The first cluster of a discovery kubeconfig: (CA PEM, server URL).
pub fn parse_discovery(yaml: &str) -> Result<(String, String), KubeconfigError> {
    let config: Config = serde_yaml::from_str(yaml).map_err(KubeconfigError::Yaml)?;
    let first = config.clusters.unwrap_or_default().into_iter().next().ok_or(KubeconfigError::NoCluster)?;
    let data = first.cluster.ca_data.ok_or(KubeconfigError::NoCa)?;
    let pem = STANDARD.decode(data.trim()).map_err(KubeconfigError::CaBase64)?;
    Ok((String::from_utf8_lossy(&pem).into_owned(), first.cluster.server))
}

/// A kubeconfig for `user` on `server`, its client identity in the combined PEM `pem_path`
/// (re-read on every use, so renewals need no rewrite).
pub fn node_kubeconfig(server: &str, ca_pem: &str, user: &str, pem_path: &Path) -> String {
    let pem = serde_json::to_string(&pem_path.to_string_lossy()).unwrap_or_default();
    let server = serde_json::to_string(server).unwrap_or_default();
    let user = serde_json::to_string(user).unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: default-cluster\n  cluster:\n    certificate-authority-data: {ca}\n    server: {server}\ncontexts:\n- name: default-context\n  context:\n    cluster: default-cluster\n    user: default-auth\n    namespace: default\ncurrent-context: default-context\nusers:\n- name: default-auth\n  user:\n    client-certificate: {pem}\n    client-key: {pem}\n# identity: {user}\n",
        ca = STANDARD.encode(ca_pem),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn discovery_kubeconfig_parses_and_node_kubeconfig_round_trips() {
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    certificate-authority-data: {}\n    server: https://127.0.0.1:1\ncontexts: null\ncurrent-context: \"\"\nusers: null\n",
            STANDARD.encode("PEM")
        );
        assert_eq!(parse_discovery(&yaml).unwrap(), ("PEM".to_owned(), "https://127.0.0.1:1".to_owned()));
        let node = node_kubeconfig("https://127.0.0.1:1", "PEM", "system:node:n", Path::new("/s/client.pem"));
        assert_eq!(parse_discovery(&node).unwrap(), ("PEM".to_owned(), "https://127.0.0.1:1".to_owned()));
        assert!(node.contains("client-key: \"/s/client.pem\""));
        assert!(matches!(parse_discovery("clusters: []"), Err(KubeconfigError::NoCluster)));
        assert!(matches!(parse_discovery("clusters:\n- cluster:\n    server: x\n"), Err(KubeconfigError::NoCa)));
    }
}

//! The two kubeconfigs of a join, as kube's own `Kubeconfig` model: the discovery one inside
//! `cluster-info` (a cluster and nothing else), read with kube's parser, and the node's own,
//! written for the `system:node:<name>` identity as YAML by `serde-saphyr` (the YAML crate
//! kube itself reads kubeconfigs with; kube has no writer).

use std::path::Path;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use kube::config::{AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};

/// Why a kubeconfig cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("kubeconfig does not parse")]
    Parse(#[source] kube::config::KubeconfigError),
    #[error("kubeconfig has no cluster")]
    NoCluster,
    #[error("kubeconfig cluster has no server")]
    NoServer,
    #[error("kubeconfig cluster has no certificate-authority-data")]
    NoCa,
    #[error("certificate-authority-data is not base64")]
    CaBase64(#[source] base64::DecodeError),
    #[error("kubeconfig cannot be written as YAML")]
    Write(#[source] serde_saphyr::SerializeError),
}

/// The first cluster of a discovery kubeconfig: (CA PEM, server URL).
pub fn parse_discovery(yaml: &str) -> Result<(String, String), KubeconfigError> {
    let config = Kubeconfig::from_yaml(yaml).map_err(KubeconfigError::Parse)?;
    let cluster = config.clusters.into_iter().next().and_then(|c| c.cluster).ok_or(KubeconfigError::NoCluster)?;
    let server = cluster.server.ok_or(KubeconfigError::NoServer)?;
    let data = cluster.certificate_authority_data.ok_or(KubeconfigError::NoCa)?;
    let pem = STANDARD.decode(data.trim()).map_err(KubeconfigError::CaBase64)?;
    Ok((String::from_utf8_lossy(&pem).into_owned(), server))
}

/// A kubeconfig (YAML) for `user` on `server`, its client identity in the combined PEM
/// `pem_path` (re-read on every use, so renewals need no rewrite). The user entry is named
/// after the identity (`system:node:<name>`).
pub fn node_kubeconfig(server: &str, ca_pem: &str, user: &str, pem_path: &Path) -> Result<String, KubeconfigError> {
    const CLUSTER: &str = "default-cluster";
    const CONTEXT: &str = "default-context";
    let pem = pem_path.to_string_lossy().into_owned();
    let config = Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        clusters: vec![NamedCluster {
            name: CLUSTER.into(),
            cluster: Some(Cluster {
                server: Some(server.into()),
                certificate_authority_data: Some(STANDARD.encode(ca_pem)),
                ..Cluster::default()
            }),
            ..NamedCluster::default()
        }],
        contexts: vec![NamedContext {
            name: CONTEXT.into(),
            context: Some(Context {
                cluster: CLUSTER.into(),
                user: Some(user.into()),
                namespace: Some("default".into()),
                ..Context::default()
            }),
            ..NamedContext::default()
        }],
        current_context: Some(CONTEXT.into()),
        auth_infos: vec![NamedAuthInfo {
            name: user.into(),
            auth_info: Some(AuthInfo {
                client_certificate: Some(pem.clone()),
                client_key: Some(pem),
                ..AuthInfo::default()
            }),
            ..NamedAuthInfo::default()
        }],
        ..Kubeconfig::default()
    };
    serde_saphyr::to_string(&config).map_err(KubeconfigError::Write)
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
        let node =
            node_kubeconfig("https://127.0.0.1:1", "PEM", "system:node:n", Path::new("/s/client: x.pem")).unwrap();
        assert_eq!(parse_discovery(&node).unwrap(), ("PEM".to_owned(), "https://127.0.0.1:1".to_owned()));
        let read = Kubeconfig::from_yaml(&node).unwrap();
        assert_eq!(read.current_context.as_deref(), Some("default-context"));
        let context = read.contexts[0].context.as_ref().unwrap();
        assert_eq!((context.cluster.as_str(), context.user.as_deref()), ("default-cluster", Some("system:node:n")));
        assert_eq!(read.auth_infos[0].name, "system:node:n");
        let user = read.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.client_certificate.as_deref(), Some("/s/client: x.pem"));
        assert_eq!(user.client_key.as_deref(), Some("/s/client: x.pem"));
        assert!(matches!(parse_discovery("clusters: []"), Err(KubeconfigError::NoCluster)));
        assert!(matches!(
            parse_discovery("clusters:\n- name: c\n  cluster:\n    server: x\n"),
            Err(KubeconfigError::NoCa)
        ));
        assert!(matches!(
            parse_discovery("clusters:\n- name: c\n  cluster:\n    certificate-authority-data: UEVN\n"),
            Err(KubeconfigError::NoServer)
        ));
        assert!(matches!(parse_discovery("clusters: [unclosed"), Err(KubeconfigError::Parse(_))));
    }
}

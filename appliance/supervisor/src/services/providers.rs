//! What the supervisor hands the two virtual-node providers, typed: [`VkSandboxFlags`] (flags),
//! [`VkCocoonEnv`] (environment) and the [`JoinFlags`] both take. Each flag or variable name is
//! written once, in the one function that renders the set.

use std::path::{Path, PathBuf};

use crate::config::ClusterConfig;

/// The join flags of both providers (`vnode::session`): the cluster to join, when the box has
/// one, and where the node's credentials live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinFlags<'a> {
    /// `[cluster]`: `--join-server` and `--join-api-server` (its endpoint), `--join-token-file`,
    /// one `--join-ca-hash` per pinned hash.
    pub cluster: Option<&'a ClusterConfig>,
    /// `--credentials-dir`.
    pub credentials_dir: PathBuf,
}

impl JoinFlags<'_> {
    /// `--flag value` pairs.
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(cl) = self.cluster {
            a.extend(["--join-server".into(), cl.endpoint.clone(), "--join-api-server".into(), cl.endpoint.clone()]);
            a.extend(["--join-token-file".into(), cl.bootstrap_token_file.display().to_string()]);
            for h in &cl.ca_cert_hashes {
                a.extend(["--join-ca-hash".into(), h.clone()]);
            }
        }
        a.extend(["--credentials-dir".into(), self.credentials_dir.display().to_string()]);
        a
    }
}

/// vk-sandbox's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VkSandboxFlags<'a> {
    /// `--node-name`.
    pub node_name: &'a str,
    /// `--sandboxd-url`.
    pub sandboxd_url: String,
    /// `--state-path`: its claims state.
    pub state_path: PathBuf,
    /// `--sandboxd-token-file`: the root token, also what lets vk-sandbox take over a claim
    /// granted just before a crash.
    pub sandboxd_token_file: &'a Path,
    /// `--sandboxd-ca-file`: sandboxd's certificate, when it serves TLS.
    pub sandboxd_ca_file: Option<&'a Path>,
    /// The join flags.
    pub join: JoinFlags<'a>,
}

impl VkSandboxFlags<'_> {
    /// `--flag value` pairs.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "--node-name".to_string(),
            self.node_name.to_string(),
            "--sandboxd-url".into(),
            self.sandboxd_url.clone(),
            "--state-path".into(),
            self.state_path.display().to_string(),
            "--sandboxd-token-file".into(),
            self.sandboxd_token_file.display().to_string(),
        ];
        if let Some(ca) = self.sandboxd_ca_file {
            a.extend(["--sandboxd-ca-file".into(), ca.display().to_string()]);
        }
        a.extend(self.join.args());
        a
    }
}

/// vk-cocoon's environment (it takes its join flags as flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VkCocoonEnv<'a> {
    /// `VK_NODE_NAME`.
    pub node_name: &'a str,
    /// `VK_NODE_POOL`.
    pub node_pool: &'a str,
    /// `COCOON_ROOT_DIR`: its VM records.
    pub root_dir: PathBuf,
    /// `CHRYSALIS_IMAGES`: the image library.
    pub images: PathBuf,
    /// `VK_SHARED_NAMESPACES`, already rendered (`a,b;c,d`).
    pub shared_namespaces: Option<String>,
    /// `VK_LEGACY_NAMESPACE`.
    pub legacy_namespace: Option<&'a str>,
    /// `VK_NET_HOST_ALLOW` (comma-joined; absent when empty).
    pub host_allow: &'a [String],
    /// `VK_NET_UPLINK`.
    pub uplink: Option<&'a str>,
    /// `VK_NET_REFUSE` (comma-joined; absent when empty).
    pub refuse: &'a [String],
}

impl VkCocoonEnv<'_> {
    /// `(name, value)` pairs; unset options are left out (vk-cocoon's defaults apply).
    pub fn vars(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("VK_NODE_NAME".to_string(), self.node_name.to_string()),
            ("VK_NODE_POOL".to_string(), self.node_pool.to_string()),
            ("COCOON_ROOT_DIR".to_string(), self.root_dir.display().to_string()),
            ("CHRYSALIS_IMAGES".to_string(), self.images.display().to_string()),
        ];
        let optional = [
            ("VK_SHARED_NAMESPACES", self.shared_namespaces.clone()),
            ("VK_LEGACY_NAMESPACE", self.legacy_namespace.map(str::to_string)),
            ("VK_NET_HOST_ALLOW", Some(self.host_allow.join(",")).filter(|v| !v.is_empty())),
            ("VK_NET_UPLINK", self.uplink.map(str::to_string)),
            ("VK_NET_REFUSE", Some(self.refuse.join(",")).filter(|v| !v.is_empty())),
        ];
        env.extend(optional.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_string(), v))));
        env
    }
}

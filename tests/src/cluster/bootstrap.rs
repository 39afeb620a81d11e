//! What `up` applies once the apiserver answers, the way kubeadm's bootstrap-token phases
//! do: the TLS-bootstrap and cluster-info RBAC, the `cluster-info` ConfigMap, a bootstrap
//! token Secret, and the agent-sandbox CRDs. Everything goes through the pinned `kubectl`.

use super::ClusterError;
use rand::Rng as _;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The extra group every Chrysalis bootstrap token authenticates with.
pub const TOKEN_EXTRA_GROUP: &str = "system:bootstrappers:chrysalis";

/// The pinned kubectl with the admin kubeconfig.
#[derive(Debug, Clone)]
pub struct Kubectl {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    /// A `kubectl` command using the admin kubeconfig.
    ///
    /// Its discovery cache lives beside the kubeconfig, in the cluster's state: kubectl's
    /// default (`~/.kube/cache`) is keyed by `host:port` and kept for hours, so a fresh cluster
    /// on a port an earlier one used would see the old one's API groups (`kubectl top` then
    /// says "Metrics API not available" although metrics-server serves).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.env("KUBECONFIG", &self.kubeconfig).env("KUBECACHEDIR", self.cache_dir()).stdin(Stdio::null());
        cmd
    }

    /// `kubectl-cache/` beside the kubeconfig.
    pub fn cache_dir(&self) -> PathBuf {
        self.kubeconfig.with_file_name("kubectl-cache")
    }

    /// Runs `kubectl args`, failing with its stderr when it exits non-zero.
    pub fn run(&self, args: &[&str]) -> Result<Output, ClusterError> {
        let out = self
            .command()
            .args(args)
            .output()
            .map_err(|source| ClusterError::Io { what: format!("running {}", self.bin.display()), source })?;
        if !out.status.success() {
            return Err(ClusterError::Kubectl {
                args: args.join(" "),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(out)
    }

    /// `kubectl get --raw /readyz` answers `ok`.
    pub fn ready(&self) -> bool {
        self.command()
            .args(["get", "--raw", "/readyz", "--request-timeout=5s"])
            .stderr(Stdio::null())
            .output()
            .map(|o| o.status.success() && o.stdout.trim_ascii() == b"ok")
            .unwrap_or(false)
    }

    /// Server-side applies `file` (idempotent; CRDs are too large for client-side apply).
    pub fn apply(&self, file: &Path) -> Result<(), ClusterError> {
        let file = file.to_string_lossy();
        self.run(&["apply", "--server-side", "--force-conflicts", "--field-manager=chrysalis-cluster", "-f", &file])
            .map(|_| ())
    }
}

/// A bootstrap token `<id>.<secret>`, `[a-z0-9]{6}.[a-z0-9]{16}`.
#[derive(Debug, Clone)]
pub struct Token {
    pub id: String,
    pub secret: String,
}

impl Token {
    pub fn generate() -> Token {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let mut rng = rand::rng();
        let mut pick =
            |n: usize| -> String { (0..n).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect() };
        Token { id: pick(6), secret: pick(16) }
    }

    pub fn full(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }
}

/// Applies every bootstrap object into `manifests` (written there for inspection).
pub fn apply_all(
    kubectl: &Kubectl,
    manifests: &Path,
    rbac: &Path,
    discovery_kubeconfig: &str,
    token: &Token,
    crd_dir: &Path,
) -> Result<(), ClusterError> {
    kubectl.apply(rbac)?;
    let objects = [
        (
            "cluster-info.json",
            json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cluster-info", "namespace": "kube-public"},
                "data": {"kubeconfig": discovery_kubeconfig},
            }),
        ),
        (
            "bootstrap-token.json",
            json!({
                "apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
                "metadata": {"name": format!("bootstrap-token-{}", token.id), "namespace": "kube-system"},
                "stringData": {
                    "description": "Chrysalis test cluster (cargo xtask cluster up)",
                    "token-id": token.id, "token-secret": token.secret,
                    "usage-bootstrap-authentication": "true", "usage-bootstrap-signing": "true",
                    "auth-extra-groups": TOKEN_EXTRA_GROUP,
                },
            }),
        ),
        (
            "agent-sandbox-namespace.json",
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "agent-sandbox-system"}}),
        ),
    ];
    for (name, object) in objects {
        let path = manifests.join(name);
        super::pki::write_secret(&path, &object.to_string())?;
        kubectl.apply(&path)?;
    }
    let mut crds: Vec<PathBuf> = std::fs::read_dir(crd_dir)
        .map_err(|source| ClusterError::Io { what: format!("listing {}", crd_dir.display()), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    crds.sort();
    if crds.is_empty() {
        return Err(ClusterError::Bootstrap(format!("no CRDs in {}", crd_dir.display())));
    }
    for crd in &crds {
        kubectl.apply(crd)?;
    }
    let crd_files: Vec<String> = crds.iter().map(|p| format!("-f={}", p.display())).collect();
    let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
    args.extend(crd_files.iter().map(String::as_str));
    kubectl.run(&args)?;
    // What our providers' node identities need beyond the Node authorizer (an admin applies
    // the same files on a real cluster; the READMEs say so).
    for extra in provider_manifests() {
        kubectl.apply(&extra)?;
    }
    Ok(())
}

/// The cluster-wide objects our providers ship (`appliance/*/manifests/*.yaml`), sorted.
pub fn provider_manifests() -> Vec<PathBuf> {
    let appliance = super::lock::cluster_src_dir().join("../../appliance");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&appliance)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|crate_dir| std::fs::read_dir(crate_dir.path().join("manifests")).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    out.sort();
    out
}

/// The placeholder of a per-node RBAC template (`appliance/<provider>/manifests/node-rbac.yaml.in`).
pub const NODE_NAME_PLACEHOLDER: &str = "${NODE_NAME}";

/// The per-node RBAC template of `provider` (`vk-sandbox`, `vk-cocoon`).
pub fn node_rbac_template(provider: &str) -> PathBuf {
    super::lock::cluster_src_dir().join("../../appliance").join(provider).join("manifests/node-rbac.yaml.in")
}

/// `template` for node `node`: every `${NODE_NAME}` replaced. The name must be a DNS subdomain
/// (what a Node name is), so nothing but a name lands in the YAML.
pub fn render_node_rbac(template: &str, node: &str) -> Result<String, ClusterError> {
    let valid = !node.is_empty()
        && node.len() <= 253
        && node.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !valid {
        return Err(ClusterError::Bootstrap(format!("{node:?} is not a node name (a lower-case DNS subdomain)")));
    }
    if !template.contains(NODE_NAME_PLACEHOLDER) {
        return Err(ClusterError::Bootstrap(format!("the node RBAC template has no {NODE_NAME_PLACEHOLDER}")));
    }
    Ok(template.replace(NODE_NAME_PLACEHOLDER, node))
}

/// Binds what a `provider` node needs to `system:node:<node>` alone, as an admin does once per
/// node on a real cluster (the template's header says how). The rendered file is kept in
/// `manifests` for inspection.
pub fn bind_node(kubectl: &Kubectl, manifests: &Path, provider: &str, node: &str) -> Result<PathBuf, ClusterError> {
    let template_path = node_rbac_template(provider);
    let template = std::fs::read_to_string(&template_path)
        .map_err(|source| ClusterError::Io { what: format!("reading {}", template_path.display()), source })?;
    let rendered = render_node_rbac(&template, node)?;
    std::fs::create_dir_all(manifests)
        .map_err(|source| ClusterError::Io { what: format!("creating {}", manifests.display()), source })?;
    let path = manifests.join(format!("node-rbac-{provider}-{node}.yaml"));
    super::pki::write(&path, &rendered)?;
    kubectl.apply(&path)?;
    Ok(path)
}

/// Waits until the bootstrap signer has signed `cluster-info` for `token`
/// (key `jws-kubeconfig-<id>`), returning the detached JWS.
pub fn wait_signed(kubectl: &Kubectl, token: &Token, timeout: Duration) -> Result<String, ClusterError> {
    let key = format!("jws-kubeconfig-{}", token.id);
    let deadline = Instant::now() + timeout;
    loop {
        let out = kubectl.run(&["-n", "kube-public", "get", "configmap", "cluster-info", "-o", "json"])?;
        let cm: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| ClusterError::Bootstrap(format!("cluster-info is not JSON: {e}")))?;
        if let Some(jws) = cm["data"][&key].as_str() {
            return Ok(jws.to_owned());
        }
        if Instant::now() >= deadline {
            return Err(ClusterError::Bootstrap(format!(
                "the bootstrap signer did not add {key} to kube-public/cluster-info within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn node_rbac_templates_bind_one_node_user() {
        for provider in ["vk-sandbox", "vk-cocoon"] {
            let template = std::fs::read_to_string(node_rbac_template(provider)).unwrap();
            let out = render_node_rbac(&template, "box-1.edge").unwrap();
            assert!(!out.contains("${"), "{provider}: a placeholder is left:\n{out}");
            assert!(out.contains("name: system:node:box-1.edge"), "{provider}:\n{out}");
            assert!(out.contains("kind: User") && !out.contains("kind: Group"), "{provider}: bound to a group:\n{out}");
            assert!(out.contains("name: system:auth-delegator"), "{provider}: no review grant:\n{out}");
        }
        let template = std::fs::read_to_string(node_rbac_template("vk-sandbox")).unwrap();
        assert!(render_node_rbac(&template, "a").unwrap().contains("name: chrysalis:vk-sandbox\n"));
        for bad in ["", "Box", "a b", "a\nkind: Group", "-a", "a..b", "x}"] {
            assert!(render_node_rbac(&template, bad).is_err(), "{bad:?} was accepted");
        }
        assert!(render_node_rbac("no placeholder", "a").is_err());
        // Nothing cluster-wide binds a provider role to the node group any more.
        for m in provider_manifests() {
            let text = std::fs::read_to_string(&m).unwrap();
            assert!(!text.contains("name: system:nodes"), "{} binds system:nodes", m.display());
        }
    }

    #[test]
    fn tokens_have_the_bootstrap_format() {
        let re = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        let a = Token::generate();
        let b = Token::generate();
        assert!(re(&a.id, 6) && re(&a.secret, 16), "{}", a.full());
        assert_eq!(a.full().len(), 23);
        assert_ne!(a.full(), b.full());
    }
}

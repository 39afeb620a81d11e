//! metrics-server beside the apiserver, when [`super::Options::metrics_server`] asks for it:
//! what `kubectl top pod|node` reads, through the aggregation layer (`v1beta1.metrics.k8s.io`).
//!
//! The apiserver reaches an aggregated API through its Service's EndpointSlices
//! (`--enable-aggregator-routing`; k8s.io/apiserver/pkg/util/proxy/proxy.go `ResolveEndpoint`),
//! and an EndpointSlice may not name a loopback address. So `up` gives metrics-server an
//! address of its own, `10.254.<port's two bytes>/32`, on a link it creates: a bridge with no ports (the
//! kernel may lack the `dummy` module), so the address is local to this machine and no
//! packet can leave through it. metrics-server stays in the root network namespace, where the
//! virtual nodes' kubelet ports (127.0.0.1, the InternalIP they publish) are. `down` deletes
//! the link.

use super::bootstrap::Kubectl;
use super::pki::{self, Pki};
use super::ClusterError;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The APIService metrics-server serves.
pub const API_SERVICE: &str = "v1beta1.metrics.k8s.io";
/// What `kubectl top node` lists.
pub const NODES_PATH: &str = "/apis/metrics.k8s.io/v1beta1/nodes";
/// Seconds between scrapes: metrics-server refuses less than 10 s
/// (cmd/metrics-server/app/options/options.go, `validate`).
pub const RESOLUTION_SECS: u64 = 10;

/// Where metrics-server of one cluster listens, recorded in `cluster.json` so `down` can
/// delete the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsServer {
    /// The link `up` created for it (`chms<apiserver port>`).
    pub link: String,
    /// Its address on that link, which the EndpointSlice names.
    pub address: Ipv4Addr,
    /// Its secure port: the apiserver's port + 7.
    pub port: u16,
}

impl MetricsServer {
    /// The link, address and port for the cluster whose apiserver listens on `apiserver_port`:
    /// distinct per port, so clusters on other ports do not collide.
    pub fn for_port(apiserver_port: u16) -> MetricsServer {
        // One /32 per port (the port's two bytes), so no two ports share an address.
        let [hi, lo] = apiserver_port.to_be_bytes();
        MetricsServer {
            link: format!("chms{apiserver_port}"),
            address: Ipv4Addr::new(10, 254, hi, lo),
            port: apiserver_port.wrapping_add(7),
        }
    }

    /// `address:port`.
    pub fn endpoint(&self) -> SocketAddr {
        SocketAddr::from((self.address, self.port))
    }

    /// Creates the link with the address (a stale link of the same name, left by a crashed run,
    /// is replaced). Fails when another interface already holds the address.
    pub fn add_link(&self) -> Result<(), ClusterError> {
        self.remove_link()?;
        let holder = ip_output(&["-o", "addr", "show", "to", &format!("{}/32", self.address)])?;
        if !holder.trim().is_empty() {
            return Err(ClusterError::Process {
                name: "metrics-server".into(),
                detail: format!("{} is already on another interface: {holder}", self.address),
            });
        }
        let result = (|| {
            ip(&["link", "add", &self.link, "type", "bridge"])?;
            ip(&["addr", "add", &format!("{}/32", self.address), "dev", &self.link])?;
            ip(&["link", "set", &self.link, "up"])
        })();
        if result.is_err() {
            let _ = self.remove_link();
        }
        result
    }

    /// Deletes the link (idempotent).
    pub fn remove_link(&self) -> Result<(), ClusterError> {
        if !Path::new("/sys/class/net").join(&self.link).exists() {
            return Ok(());
        }
        ip(&["link", "del", &self.link])
    }

    /// metrics-server's command line, as `kubeconfig`'s user (the harness's
    /// `chrysalis:metrics-server`, whose client certificate it also shows kubelet ports).
    pub fn args(&self, kubeconfig: &Path, pki: &Pki) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        vec![
            format!("--kubeconfig={}", s(kubeconfig)),
            format!("--authentication-kubeconfig={}", s(kubeconfig)),
            format!("--authorization-kubeconfig={}", s(kubeconfig)),
            format!("--bind-address={}", self.address),
            format!("--secure-port={}", self.port),
            // Signed by the cluster CA for metrics-server.kube-system.svc: the APIService
            // carries the CA, so the apiserver verifies it (no insecureSkipTLSVerify).
            format!("--tls-cert-file={}", s(&pki.metrics_server_cert)),
            format!("--tls-private-key-file={}", s(&pki.metrics_server_key)),
            // Virtual nodes serve their kubelet port with a self-signed certificate.
            "--kubelet-insecure-tls".into(),
            // They publish 127.0.0.1 as InternalIP and their own port in daemonEndpoints
            // (several nodes share the address); their Hostname does not resolve.
            "--kubelet-preferred-address-types=InternalIP".into(),
            "--kubelet-use-node-status-port".into(),
            format!("--metric-resolution={RESOLUTION_SECS}s"),
            // At most 90% of the resolution (options.go, `validate`); a loopback port answers fast.
            "--kubelet-request-timeout=5s".into(),
            "--profiling=false".into(),
        ]
    }

    /// The objects that depend on this run: the EndpointSlice behind the selector-less Service
    /// of `tests/cluster/manifests/metrics-server.yaml` and the APIService with `ca_pem`.
    pub fn objects(&self, ca_pem: &str) -> [(&'static str, Value); 2] {
        let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
        [
            (
                "metrics-server-endpointslice.json",
                json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {
                        "name": "metrics-server-host", "namespace": "kube-system",
                        "labels": {
                            "kubernetes.io/service-name": "metrics-server",
                            // Not the EndpointSlice controller's: it leaves this one alone.
                            "endpointslice.kubernetes.io/managed-by": "chrysalis-cluster",
                        },
                    },
                    "addressType": "IPv4",
                    "ports": [{"name": "https", "port": self.port, "protocol": "TCP", "appProtocol": "https"}],
                    "endpoints": [{"addresses": [self.address.to_string()], "conditions": {"ready": true}}],
                }),
            ),
            (
                "metrics-server-apiservice.json",
                json!({
                    "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
                    "metadata": {"name": API_SERVICE},
                    "spec": {
                        "service": {"name": "metrics-server", "namespace": "kube-system", "port": 443},
                        "group": "metrics.k8s.io", "version": "v1beta1",
                        "caBundle": ca,
                        "groupPriorityMinimum": 100, "versionPriority": 100,
                    },
                }),
            ),
        ]
    }

    /// Applies the static manifest and [`Self::objects`] (written into `manifests`).
    pub fn apply(&self, kubectl: &Kubectl, manifests: &Path, ca_pem: &str) -> Result<(), ClusterError> {
        kubectl.apply(&manifest())?;
        for (name, object) in self.objects(ca_pem) {
            let path = manifests.join(name);
            pki::write(&path, &object.to_string())?;
            kubectl.apply(&path)?;
        }
        Ok(())
    }
}

/// `tests/cluster/manifests/metrics-server.yaml`: RBAC and the Service.
pub fn manifest() -> PathBuf {
    super::lock::cluster_src_dir().join("manifests").join("metrics-server.yaml")
}

/// `kubectl get --raw /apis/metrics.k8s.io/v1beta1/nodes` succeeds: the aggregator reaches
/// metrics-server and it answers.
pub fn api_answers(kubectl: &Kubectl) -> bool {
    kubectl
        .command()
        .args(["get", "--raw", NODES_PATH, "--request-timeout=5s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ip(args: &[&str]) -> Result<(), ClusterError> {
    ip_output(args).map(|_| ())
}

fn ip_output(args: &[&str]) -> Result<String, ClusterError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| ClusterError::Io { what: "running ip (iproute2)".into(), source })?;
    if !out.status.success() {
        return Err(ClusterError::Process {
            name: "metrics-server".into(),
            detail: format!(
                "ip {}: {} (creating its link needs CAP_NET_ADMIN)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn addresses_are_private_non_loopback_and_per_port() {
        let a = MetricsServer::for_port(16443);
        let b = MetricsServer::for_port(25443);
        assert_ne!((&a.link, a.address, a.port), (&b.link, b.address, b.port));
        // Every suite's port (29443 and 30443 once shared an address).
        let suites = [16443, 25443, 26443, 27443, 28443, 29443, 30443, 31443].map(MetricsServer::for_port);
        for (i, ms) in suites.iter().chain([&MetricsServer::for_port(u16::MAX)]).enumerate() {
            let o = ms.address.octets();
            assert_eq!(o[..2], [10, 254], "{}", ms.address);
            assert!(ms.link.len() <= 15, "{} is longer than IFNAMSIZ allows", ms.link);
            assert!(suites.iter().take(i).all(|other| other.address != ms.address), "{} repeats", ms.address);
        }
        assert_eq!(a.port, 16450);
        assert_eq!(a.endpoint().to_string(), format!("{}:16450", a.address));
    }

    #[test]
    fn endpoint_slice_and_apiservice_match_the_service() {
        let ms = MetricsServer::for_port(25443);
        let [(_, slice), (_, api)] = ms.objects("-----BEGIN CERTIFICATE-----\n");
        // The Service's port name must match the slice's, or the aggregator finds no endpoint.
        let service = std::fs::read_to_string(manifest()).unwrap();
        assert!(service.contains("kind: Service\n") && service.contains("- name: https\n      port: 443\n"));
        assert_eq!(slice["metadata"]["labels"]["kubernetes.io/service-name"], "metrics-server");
        assert_eq!(slice["ports"][0]["name"], "https");
        assert_eq!(slice["ports"][0]["port"], ms.port);
        assert_eq!(slice["endpoints"][0]["addresses"][0], ms.address.to_string());
        assert_eq!(api["metadata"]["name"], API_SERVICE);
        assert_eq!(api["spec"]["service"]["port"], 443);
        assert!(api["spec"]["caBundle"].as_str().is_some_and(|c| !c.is_empty()));
        assert!(api["spec"].get("insecureSkipTLSVerify").is_none());
        // The manifest binds the user the PKI makes.
        assert!(service.contains(&format!("name: {}\n", pki::METRICS_SERVER_USER)));
    }
}

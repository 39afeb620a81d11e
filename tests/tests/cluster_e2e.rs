//! The test control plane itself, end to end: `Cluster::up` on its own port and state
//! directory, then what the join and the vk-sandbox provider rely on — ready apiserver,
//! agent-sandbox CRDs, a bootstrap-signed `cluster-info`, anonymous discovery, per-node RBAC
//! (one node's grants reach no other node; the apiserver's kubelet client may use kubelet
//! ports), the upstream controller turning the seed's Sandbox into a Pod — and `down` leaving
//! nothing running.
//!
//! Enabled by `--features cluster` (the first run builds Kubernetes from source: tens of minutes).
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::path::PathBuf;
use std::time::{Duration, Instant};
use test_infra::cluster::{Cluster, Options};

fn kubectl_ok(c: &Cluster, args: &[&str]) -> String {
    let out = c.kubectl().args(args).output().expect("running kubectl");
    assert!(out.status.success(), "kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn seed_example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("seed/examples/sandboxd-example.yaml")
}

#[test]
fn cluster_up_serves_bootstrap_and_agent_sandbox_then_down_leaves_nothing() {
    let state = tempfile::tempdir().unwrap();
    let opts = Options { state_dir: state.path().join("state"), port: 26443, ..Options::default() };
    let cluster = Cluster::up_with(&opts).expect("cluster up");
    assert!(cluster.started);
    let again = Cluster::up_with(&opts).expect("second up");
    assert!(!again.started, "a second up finds the cluster running");
    assert_eq!((&again.token, &again.ca_hash), (&cluster.token, &cluster.ca_hash));

    let result = std::panic::catch_unwind(|| {
        assert_eq!(kubectl_ok(&cluster, &["get", "--raw", "/readyz"]).trim(), "ok");
        let crds = kubectl_ok(&cluster, &["get", "crd", "-o", "name"]);
        for crd in ["sandboxes.agents.x-k8s.io", "sandboxwarmpools.extensions.agents.x-k8s.io"] {
            assert!(crds.contains(crd), "{crd} missing from {crds}");
        }

        // Anonymous discovery: cluster-info is readable without credentials and signed for our token.
        // (kubectl cannot make a credential-less request: it prompts for a password, so this
        // is a plain HTTPS GET pinned to the CA, as the joiner's second read is.)
        let url = format!("{}/api/v1/namespaces/kube-public/configmaps/cluster-info", cluster.endpoint);
        let out = std::process::Command::new("python3")
            .args(["-c", "import ssl,sys,urllib.request as u; c=ssl.create_default_context(cafile=sys.argv[2]); sys.stdout.write(u.urlopen(sys.argv[1], context=c).read().decode())"])
            .arg(&url)
            .arg(&cluster.ca_cert)
            .output()
            .expect("python3 (the suites' SDK tests need it too)");
        assert!(out.status.success(), "anonymous read of cluster-info: {}", String::from_utf8_lossy(&out.stderr));
        let cm: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let key = format!("jws-kubeconfig-{}", cluster.token_id());
        assert!(cm["data"][&key].as_str().is_some_and(|j| j.contains("..")), "no detached JWS {key}: {cm}");

        // RBAC: a node's grants are bound to that node's user only; the apiserver's kubelet
        // client may use every kubelet port (nodes/proxy, log, stats, metrics).
        cluster.bind_node("vk-sandbox", "vk-a").expect("binding vk-a");
        let can = |args: &[&str]| {
            let out = cluster.kubectl().args(["auth", "can-i"]).args(args).output().expect("kubectl auth can-i");
            String::from_utf8_lossy(&out.stdout).trim() == "yes"
        };
        let node = |n: &str| format!("--as=system:node:{n}");
        for verb in ["get", "list", "watch"] {
            assert!(can(&[verb, "sandboxes.agents.x-k8s.io", &node("vk-a"), "--as-group=system:nodes"]), "vk-a {verb}");
            assert!(
                !can(&[verb, "sandboxes.agents.x-k8s.io", &node("vk-other"), "--as-group=system:nodes"]),
                "another node may {verb} Sandboxes"
            );
        }
        assert!(!can(&["list", "sandboxes.agents.x-k8s.io", "--as=someone", "--as-group=system:nodes"]));
        // Reviews through the binding alone (no system:nodes group, so not the Node authorizer).
        for review in ["tokenreviews.authentication.k8s.io", "subjectaccessreviews.authorization.k8s.io"] {
            assert!(can(&["create", review, &node("vk-a")]), "vk-a may not create {review}");
            assert!(!can(&["create", review, &node("vk-other")]), "an unbound user may create {review}");
        }
        for sub in ["proxy", "log", "stats", "metrics"] {
            let subresource = format!("--subresource={sub}");
            for verb in ["get", "create"] {
                assert!(
                    can(&[verb, "nodes", &subresource, "--as=kube-apiserver-kubelet-client"]),
                    "the kubelet client may not {verb} nodes/{sub}"
                );
                assert!(!can(&[verb, "nodes", &subresource, "--as=someone"]), "anyone may {verb} nodes/{sub}");
            }
        }

        // The seed's Sandbox, verbatim: the upstream controller creates its Pod, which stays
        // Pending (no node yet) and carries the Sandbox as controller owner.
        let example = seed_example();
        kubectl_ok(&cluster, &["apply", "-f", &example.to_string_lossy()]);
        let deadline = Instant::now() + Duration::from_secs(60);
        let pod = loop {
            let out = cluster.kubectl().args(["get", "pod", "sandboxd-example", "-o", "json"]).output().unwrap();
            if out.status.success() {
                break serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
            }
            assert!(Instant::now() < deadline, "the controller never created pod sandboxd-example");
            std::thread::sleep(Duration::from_millis(250));
        };
        assert_eq!(pod["status"]["phase"], "Pending");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "Sandbox");
        assert_eq!(
            pod["metadata"]["annotations"]["sandbox.cocoonstack.io/template"],
            "ghcr.io/cocoonstack/sandbox/rt:24.04"
        );
    });

    let stopped = Cluster::down_with(&opts).expect("cluster down");
    assert_eq!(stopped.len(), cluster.daemons.len(), "down stopped every daemon");
    for d in &cluster.daemons {
        assert!(!d.is_ours(), "{} (pid {}) still runs after down", d.name, d.pid);
    }
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// metrics-server on (`Options::metrics_server`): the aggregated metrics API is Available,
/// `kubectl top node` reaches it (no node reports metrics yet, which it may say, but it must
/// not fail to connect), and `down` stops it and deletes its link.
#[test]
fn metrics_server_serves_the_metrics_api_then_down_removes_it() {
    use test_infra::cluster::metrics::{MetricsServer, API_SERVICE};
    let state = tempfile::tempdir().unwrap();
    let opts =
        Options { state_dir: state.path().join("state"), port: 25443, metrics_server: true, ..Options::default() };
    let cluster = Cluster::up_with(&opts).expect("cluster up with metrics-server");
    let ms = cluster.metrics_server.clone().expect("metrics-server recorded");
    assert_eq!(ms, MetricsServer::for_port(25443));

    let result = std::panic::catch_unwind(|| {
        cluster.wait_metrics_api(Duration::from_secs(60)).expect("metrics API");
        let api: serde_json::Value =
            serde_json::from_str(&kubectl_ok(&cluster, &["get", "apiservice", API_SERVICE, "-o", "json"])).unwrap();
        let available = api["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Available")
            .cloned()
            .unwrap_or_default();
        assert_eq!(available["status"], "True", "{API_SERVICE} is not Available: {available}");

        let nodes: serde_json::Value =
            serde_json::from_str(&kubectl_ok(&cluster, &["get", "--raw", "/apis/metrics.k8s.io/v1beta1/nodes"]))
                .unwrap();
        assert_eq!(nodes["kind"], "NodeMetricsList", "{nodes}");

        for top in [&["top", "node"][..], &["top", "pod", "-A"]] {
            let out = cluster.kubectl().args(top).output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            let cmd = top.join(" ");
            eprintln!("kubectl {cmd}: {}", text.trim());
            // With no node: "error: metrics not available yet" (or an empty table); never a
            // failure to reach the metrics API.
            assert!(out.status.success() || text.contains("metrics not available yet"), "kubectl {cmd}: {text}");
            for unreachable in ["Metrics API not available", "connection refused", "ServiceUnavailable", "no endpoints"]
            {
                assert!(!text.contains(unreachable), "kubectl {cmd}: {text}");
            }
        }
        if let Some(d) = cluster.daemons.iter().find(|d| d.name == "metrics-server") {
            eprintln!("metrics-server log tail:\n{}", d.log_tail(15));
        }
    });

    Cluster::down_with(&opts).expect("cluster down");
    for d in &cluster.daemons {
        assert!(!d.is_ours(), "{} (pid {}) still runs after down", d.name, d.pid);
    }
    assert!(!std::path::Path::new("/sys/class/net").join(&ms.link).exists(), "{} left behind", ms.link);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

//! The join against the real test control plane (`test_infra::cluster`, own port and state):
//! token discovery with the right pin, refusals (wrong CA hash, unsigned for another token,
//! wrong secret), the TLS bootstrap to a `system:node:<name>` identity that may register its
//! Node, reuse of the stored identity, and renewal authenticated with the current certificate.
//!
//! Enabled by `--features cluster` (the first run builds Kubernetes from source).
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use join::{BootstrapToken, CaHash, JoinError};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use test_infra::cluster::{Cluster, Options};

fn kubectl_as(c: &Cluster, kubeconfig: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(&c.kubectl).env("KUBECONFIG", kubeconfig).args(args).output().expect("running kubectl")
}

fn ok(out: std::process::Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn scenario(cluster: &Cluster, state: &std::path::Path) {
    let token: BootstrapToken = cluster.token.parse().unwrap();
    let pin: CaHash = cluster.ca_hash.parse().unwrap();
    let wrong: CaHash = format!("sha256:{}", "0".repeat(64)).parse().unwrap();

    // Discovery with the right pin (among others) yields the CA the cluster uses.
    let info = join::discover(&cluster.endpoint, &token, &[wrong.clone(), pin.clone()]).await.unwrap();
    assert_eq!(info.ca_pem.trim(), std::fs::read_to_string(&cluster.ca_cert).unwrap().trim());
    assert_eq!(join::ca_hash_of_pem(&info.ca_pem).unwrap(), pin);

    // A wrong CA hash fails closed, naming both hashes.
    match join::discover(&cluster.endpoint, &token, std::slice::from_ref(&wrong)).await {
        Err(e @ JoinError::CaHashMismatch { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(pin.as_str()) && msg.contains(wrong.as_str()), "{msg}");
        }
        other => panic!("a wrong CA hash was not refused: {other:?}"),
    }
    // No signature for this token id (as an unsigned ConfigMap): fails closed.
    let unknown: BootstrapToken = "zzzzzz.0123456789abcdef".parse().unwrap();
    assert!(
        matches!(
            join::discover(&cluster.endpoint, &unknown, std::slice::from_ref(&pin)).await,
            Err(JoinError::Unsigned { .. })
        ),
        "cluster-info without a signature for the token was accepted"
    );
    // The right id with a wrong secret: the signature does not verify.
    let forged: BootstrapToken = format!("{}.{}", token.id(), "a".repeat(16)).parse().unwrap();
    assert!(
        matches!(
            join::discover(&cluster.endpoint, &forged, std::slice::from_ref(&pin)).await,
            Err(JoinError::BadSignature { .. })
        ),
        "a wrong token secret verified"
    );

    // TLS bootstrap: a system:node:<name> identity, stored 0600 in a 0700 directory.
    let node = "vk-join-e2e";
    let node_dir = state.join("nodes").join(node);
    let creds = join::bootstrap(&info, &token, node, &node_dir).await.unwrap();
    assert_eq!(std::fs::metadata(&node_dir).unwrap().permissions().mode() & 0o777, 0o700);
    for entry in std::fs::read_dir(&node_dir).unwrap() {
        let entry = entry.unwrap();
        assert_eq!(entry.metadata().unwrap().permissions().mode() & 0o777, 0o600, "{:?}", entry.path());
    }
    let whoami = ok(kubectl_as(cluster, &creds.kubeconfig_path, &["auth", "whoami", "-o", "json"]), "auth whoami");
    let who: serde_json::Value = serde_json::from_str(&whoami).unwrap();
    assert_eq!(who["status"]["userInfo"]["username"], format!("system:node:{node}"), "{whoami}");
    assert!(who["status"]["userInfo"]["groups"].as_array().unwrap().iter().any(|g| g == "system:nodes"), "{whoami}");
    // Under NodeRestriction that identity may register its own Node (and not another's).
    let node_obj = |name: &str| {
        let f = state.join(format!("{name}.json"));
        std::fs::write(
            &f,
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}).to_string(),
        )
        .unwrap();
        f
    };
    let own = node_obj(node);
    ok(kubectl_as(cluster, &creds.kubeconfig_path, &["create", "-f", &own.to_string_lossy()]), "create own Node");
    let other = node_obj("someone-else");
    assert!(
        !kubectl_as(cluster, &creds.kubeconfig_path, &["create", "-f", &other.to_string_lossy()]).status.success(),
        "the node identity created another node's Node"
    );

    // A second bootstrap (a restart) reuses the stored identity.
    let again = join::bootstrap(&info, &token, node, &node_dir).await.unwrap();
    assert_eq!(again.cert_pem, creds.cert_pem);
    assert_eq!(again.key_pem, creds.key_pem);

    // Renewal: a new key and certificate, obtained with the current client certificate.
    let renewed = join::renew(&info, &creds, node, &node_dir).await.unwrap();
    assert_ne!(renewed.key_pem, creds.key_pem);
    assert_ne!(renewed.cert_pem, creds.cert_pem);
    let reloaded = join::bootstrap(&info, &token, node, &node_dir).await.unwrap();
    assert_eq!(reloaded.cert_pem, renewed.cert_pem, "the renewed identity was not stored");
    let whoami =
        ok(kubectl_as(cluster, &renewed.kubeconfig_path, &["auth", "whoami", "-o", "json"]), "whoami after renew");
    assert!(whoami.contains(&format!("system:node:{node}")), "{whoami}");
    // Not due yet: renew_if_due leaves it alone.
    let deadline = join::rotation_deadline(&renewed);
    assert!(join::renew_if_due(&info, &renewed, deadline, node, &node_dir).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_pins_the_ca_and_bootstrap_mints_a_reusable_node_identity() {
    let state = tempfile::tempdir().unwrap();
    let opts = Options { state_dir: state.path().join("cluster"), port: 27443, ..Options::default() };
    let cluster = Cluster::up_with(&opts).expect("cluster up");
    let result = {
        use futures::FutureExt;
        std::panic::AssertUnwindSafe(scenario(&cluster, state.path())).catch_unwind().await
    };
    Cluster::down_with(&opts).expect("cluster down");
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

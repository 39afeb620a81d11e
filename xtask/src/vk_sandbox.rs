//! `cargo xtask vk-sandbox`: the local demo of issue #4. With the test cluster up, run sandboxd
//! (the same pools as `cargo xtask sandboxd`) and the vk-sandbox provider joined to the cluster
//! the kubeadm way (bootstrap token + pinned CA hash), both as children of this command. The
//! node's credentials and claims state live under `$CHRYSALIS_CACHE/vk-sandbox/<node>/`, so a
//! second run reuses its identity and re-adopts its claims.

use crate::flags::{VkSandboxArgs, VmImageArgs};
use anyhow::{bail, Context, Result};
use std::process::{Child, Command};
use std::time::Duration;
use test_infra::cluster::{Cluster, Options};

/// Builds the vk-sandbox binary (release) and returns its path.
pub fn build_provider() -> Result<std::path::PathBuf> {
    let status = Command::new("cargo")
        .args(["build", "--release", "-p", "vk-sandbox", "--bin", "vk-sandbox"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building vk-sandbox failed");
    }
    Ok(crate::paths::target_dir().join("release/vk-sandbox"))
}

/// Kills the children when this command ends, however it ends.
struct Children(Vec<(&'static str, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (name, child) in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                // SIGTERM: both stop cleanly and keep claims and VMs for the next start.
                let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
                let _ = child.wait();
                eprintln!("xtask: stopped {name}");
            }
        }
    }
}

pub fn run(args: &VkSandboxArgs) -> Result<()> {
    let status = Cluster::status_with(&Options { port: args.port, ..Options::default() })?;
    let Some(cluster) = status.cluster.filter(|_| status.apiserver_ready) else {
        bail!("the test cluster is not running: start it with `cargo xtask cluster up` first");
    };
    crate::prereqs::ensure_all()?;
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })?;
    let sandboxd = crate::sandboxd::build_binary()?;
    let provider = build_provider()?;

    let home = crate::paths::cache_dir().join("vk-sandbox").join(&args.node_name);
    std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
    let token_file = home.join("bootstrap-token");
    std::fs::write(&token_file, &cluster.token).with_context(|| format!("writing {}", token_file.display()))?;

    let mut children = Children(Vec::new());
    eprintln!("xtask: sandboxd on {} (config {})", args.sandboxd_listen, crate::sandboxd::SAMPLE_CONFIG);
    children.0.push((
        "sandboxd",
        Command::new(&sandboxd)
            .args(["--config", crate::sandboxd::SAMPLE_CONFIG, "--listen", &args.sandboxd_listen])
            .arg("--data-dir")
            .arg(crate::paths::cache_dir().join("sandboxd"))
            .env("CHRYSALIS_CACHE", crate::paths::cache_dir())
            .spawn()
            .with_context(|| format!("running {}", sandboxd.display()))?,
    ));
    let binding = cluster.bind_node("vk-sandbox", &args.node_name)?;
    eprintln!("xtask: bound the node's RBAC to system:node:{} ({})", args.node_name, binding.display());
    eprintln!("xtask: vk-sandbox node {} joining {}", args.node_name, cluster.endpoint);
    children.0.push((
        "vk-sandbox",
        Command::new(&provider)
            .args(["--node-name", &args.node_name])
            .args(["--listen-addr", &format!("0.0.0.0:{}", args.kubelet_port)])
            .args(["--sandboxd-url", &format!("http://{}", args.sandboxd_listen)])
            .arg("--state-path")
            .arg(home.join("claims.json"))
            .args(["--join-server", &cluster.endpoint])
            .arg("--join-token-file")
            .arg(&token_file)
            .args(["--join-ca-hash", &cluster.ca_hash])
            .arg("--credentials-dir")
            .arg(home.join("pki"))
            .spawn()
            .with_context(|| format!("running {}", provider.display()))?,
    ));
    eprintln!(
        "xtask: try   KUBECONFIG={} {} get nodes   (Ctrl-C stops both)",
        cluster.kubeconfig.display(),
        cluster.kubectl.display()
    );
    // Until either child exits (Ctrl-C reaches both through the terminal's process group).
    loop {
        for (name, child) in &mut children.0 {
            if let Some(st) = child.try_wait()? {
                if st.success() {
                    return Ok(());
                }
                bail!("{name} exited with {st}");
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

//! `cargo xtask vk-cocoon`: the local demo of issue #5. With the test cluster up, import the
//! built guest images into the node's image library (`rt` as the seed's `ubuntu-dev-base`, and
//! `base`), then run vk-cocoon joined to the cluster the kubeadm way. Everything the node keeps
//! (VMs, image library, leases, credentials) lives under `$CHRYSALIS_CACHE/vk-cocoon/<node>/`.

use crate::flags::{VkCocoonArgs, VmImageArgs};
use anyhow::{bail, Context, Result};
use std::process::Command;
use test_infra::cluster::{Cluster, Options};

/// Builds the vk-cocoon binary (release) and returns its path.
pub fn build_provider() -> Result<std::path::PathBuf> {
    let status = Command::new("cargo")
        .args(["build", "--release", "-p", "vk-cocoon", "--bin", "vk-cocoon"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building vk-cocoon failed");
    }
    Ok(crate::paths::target_dir().join("release/vk-cocoon"))
}

pub fn run(args: &VkCocoonArgs) -> Result<()> {
    let status = Cluster::status_with(&Options { port: args.port, ..Options::default() })?;
    let Some(cluster) = status.cluster.filter(|_| status.apiserver_ready) else {
        bail!("the test cluster is not running: start it with `cargo xtask cluster up` first");
    };
    crate::prereqs::ensure_all()?;
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })?;
    let provider = build_provider()?;

    let root = crate::paths::cache_dir().join("vk-cocoon").join(&args.node_name);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    // The seed's image name is our locally built `rt` (not the upstream Ubuntu image).
    let catalog = vmm::Catalog::load_default().context("the built-image catalog")?;
    let store = images::Store::open(root.join("images")).context("opening the image library")?;
    for (name, template) in [("ubuntu-dev-base", "rt"), ("base", "base")] {
        let (_, t) = catalog.resolve(template)?;
        let digest =
            store.import_catalog_template(name, t).with_context(|| format!("importing {template} as {name}"))?;
        eprintln!("xtask: image {name} = our {template} ({digest})");
    }
    let token_file = root.join("bootstrap-token");
    std::fs::write(&token_file, &cluster.token).with_context(|| format!("writing {}", token_file.display()))?;
    let binding = cluster.bind_node("vk-cocoon", &args.node_name)?;
    eprintln!("xtask: bound the node's RBAC to system:node:{} ({})", args.node_name, binding.display());
    eprintln!("xtask: vk-cocoon node {} joining {}", args.node_name, cluster.endpoint);
    eprintln!(
        "xtask: try   cargo xtask cluster kubectl -- apply -f tests/seed/examples/cocoon-example.yaml   (Ctrl-C stops the node)"
    );
    let st = Command::new(&provider)
        .args(["--join-server", &cluster.endpoint])
        .arg("--join-token-file")
        .arg(&token_file)
        .args(["--join-ca-hash", &cluster.ca_hash])
        .arg("--credentials-dir")
        .arg(root.join("pki"))
        .env("VK_NODE_NAME", &args.node_name)
        .env("VK_NODE_IP", "127.0.0.1")
        .env("VK_KUBELET_PORT", args.kubelet_port.to_string())
        .env("COCOON_ROOT_DIR", &root)
        .env("CHRYSALIS_CACHE", crate::paths::cache_dir())
        .status()
        .with_context(|| format!("running {}", provider.display()))?;
    if !st.success() {
        bail!("vk-cocoon exited with {st}");
    }
    Ok(())
}

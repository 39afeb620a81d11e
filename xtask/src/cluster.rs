//! `cargo xtask cluster up|down|status`: the test control plane. The logic lives in
//! `test_infra::cluster` so test suites start the very same cluster; this only prints.

use crate::flags::{ClusterArgs, ClusterCmd};
use anyhow::Context as _;
use anyhow::Result;
use test_infra::cluster::{Cluster, Options};

pub fn run(cmd: &ClusterCmd) -> Result<()> {
    match cmd {
        ClusterCmd::Up(args) => {
            let cluster = Cluster::up_with(&options(args))?;
            let how = if cluster.started { "started" } else { "already running" };
            println!("cluster {how}");
            print_facts(&cluster);
            println!(
                "\ntry:   KUBECONFIG={} {} get --raw /readyz",
                cluster.kubeconfig.display(),
                cluster.kubectl.display()
            );
            Ok(())
        }
        ClusterCmd::Down(args) => {
            let stopped = Cluster::down_with(&options(args))?;
            if stopped.is_empty() {
                println!("cluster: nothing was running");
            }
            for d in stopped {
                println!("stopped {:<26} pid {}", d.name, d.pid);
            }
            Ok(())
        }
        ClusterCmd::Kubectl(k) => {
            let status = Cluster::status_with(&options(&k.cluster))?;
            let Some(cluster) = status.cluster else {
                anyhow::bail!("the cluster is not running: `cargo xtask cluster up` starts it");
            };
            let st = cluster.kubectl().args(&k.args).status().context("running kubectl")?;
            anyhow::ensure!(st.success(), "kubectl exited with {st}");
            Ok(())
        }
        ClusterCmd::Status(args) => {
            let status = Cluster::status_with(&options(args))?;
            let Some(cluster) = &status.cluster else {
                println!("cluster: not running (no state; `cargo xtask cluster up` starts it)");
                return Ok(());
            };
            let ready = if status.apiserver_ready { "ready" } else { "NOT ready" };
            println!("cluster: apiserver {ready}");
            print_facts(cluster);
            for d in &status.daemons {
                let state = if d.running { "running" } else { "GONE" };
                println!("  {:<26} pid {:<8} {state:<8} log {}", d.daemon.name, d.daemon.pid, d.daemon.log.display());
            }
            let all_up = status.apiserver_ready && status.daemons.iter().all(|d| d.running);
            anyhow::ensure!(all_up, "the cluster is unhealthy: `cargo xtask cluster up` restarts it");
            Ok(())
        }
    }
}

fn options(args: &ClusterArgs) -> Options {
    Options { port: args.port, ..Options::default() }
}

fn print_facts(c: &Cluster) {
    println!("  endpoint:      {}", c.endpoint);
    println!("  kubeconfig:    {}", c.kubeconfig.display());
    println!("  token:         {}", c.token);
    println!("  ca-cert-hash:  {}", c.ca_hash);
    println!("  ca-cert:       {}", c.ca_cert.display());
    println!("  kubectl:       {}", c.kubectl.display());
    println!("  state:         {}", c.state_dir.join("cluster.json").display());
    let versions: Vec<String> = c.versions.iter().map(|(m, v)| format!("{m}@{v}")).collect();
    println!("  versions:      {}", versions.join(", "));
}

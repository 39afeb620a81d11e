//! `cargo xtask bench vnode`: a Sandbox created → its Pod Running, through the real control
//! plane (apiserver, the upstream agent-sandbox controller, the scheduler) and our vk-sandbox
//! node claiming from a real sandboxd warm pool (`test_infra::vk_sandbox::NodeEnv`).
//!
//! Timing is taken on the client: `t0` just before the Sandbox is POSTed, `t1` when a pod
//! watch (opened beforehand) first delivers the Pod with phase Running. Both figures include
//! every hop: controller reconcile + Pod create, scheduling and binding, the provider's
//! claim and status push, and the watch delivery back to us.

use crate::bench::{ms, percentile, Figure};
use anyhow::{anyhow, Context, Result};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{watcher, WatchStreamExt as _};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use test_infra::vk_sandbox::{NodeEnv, NodeSpec};
use tokio::sync::mpsc;

const PORT: u16 = 30443;
const NS: &str = "bench";
/// Resident memory one idle `base` VM takes under TCG (measured by `bench vm`), rounded up.
const VM_RSS_MIB: u64 = 220;

fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

fn sandbox(name: &str) -> DynamicObject {
    let value = serde_json::json!({
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"podTemplate": {
            "metadata": {"annotations": {"sandbox.cocoonstack.io/template": "base"}},
            "spec": {
                "nodeSelector": {"sandbox.cocoonstack.io/runtime": "sandboxd"},
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "agent", "image": "base"}],
            },
        }},
    });
    // The literal above is a valid object: this cannot fail.
    serde_json::from_value(value).unwrap_or_else(|_| DynamicObject::new(name, &sandbox_resource()))
}

fn sandbox_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("agents.x-k8s.io", "v1beta1", "Sandbox"), "sandboxes")
}

/// When the pod watch first saw each Pod exist and first saw it bound (for the per-hop split).
type Sightings = std::sync::Arc<std::sync::Mutex<HashMap<String, (Instant, Option<Instant>)>>>;

/// Watches the namespace's Pods and reports each Pod's first Running sighting. The watch backs
/// off on errors (without it, a watch of a stopped cluster spins a core); the handle stops it.
fn running_feed(
    client: kube::Client,
    sightings: Sightings,
) -> (mpsc::UnboundedReceiver<(String, Instant)>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let pods: Api<Pod> = Api::namespaced(client, NS);
        let mut seen = std::collections::HashSet::new();
        let mut stream = watcher(pods, watcher::Config::default()).default_backoff().boxed();
        while let Some(ev) = stream.next().await {
            let now = Instant::now();
            let objs: Vec<Pod> = match ev {
                Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p)) => vec![p],
                _ => continue,
            };
            for p in objs {
                if let Ok(mut s) = sightings.lock() {
                    let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
                    let e = s.entry(p.metadata.name.clone().unwrap_or_default()).or_insert((now, None));
                    if bound && e.1.is_none() {
                        e.1 = Some(now);
                    }
                }
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                let name = p.metadata.name.clone().unwrap_or_default();
                if running && seen.insert(name.clone()) && tx.send((name, now)).is_err() {
                    return;
                }
            }
        }
    });
    (rx, task)
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn wait_running(
    feed: &mut mpsc::UnboundedReceiver<(String, Instant)>,
    seen: &mut HashMap<String, Instant>,
    want: &[String],
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    while !want.iter().all(|n| seen.contains_key(n)) {
        match tokio::time::timeout_at(deadline, feed.recv()).await {
            Ok(Some((name, at))) => {
                seen.insert(name, at);
            }
            Ok(None) => return Err(anyhow!("the pod watch ended")),
            Err(_) => {
                let missing: Vec<&String> = want.iter().filter(|n| !seen.contains_key(*n)).collect();
                return Err(anyhow!("{} pods not Running after {timeout:?}: {missing:?}", missing.len()));
            }
        }
    }
    Ok(())
}

pub fn run(
    rt: &tokio::runtime::Runtime,
    figures: &mut Vec<Figure>,
    samples: usize,
    burst: usize,
    execs: usize,
) -> Result<()> {
    let sandboxd_bin = crate::sandboxd::build_binary()?;
    let provider_bin = crate::vk_sandbox::build_provider()?;
    // Keep 4 GiB for the control plane and the rest of the machine.
    let fits = (mem_available_mib().saturating_sub(4096) / VM_RSS_MIB) as usize;
    let burst_n = burst.min(fits).max(1);
    if burst_n < burst {
        eprintln!("bench vnode: memory for {fits} idle VMs only: the burst is {burst_n} Sandboxes, not {burst}");
    }
    let warm = burst_n.max(samples.min(burst_n));
    eprintln!("bench vnode: starting the cluster, sandboxd (base pool of {warm}) and vk-sandbox; filling takes a while under TCG");
    let env = NodeEnv::up(NodeSpec {
        port: PORT,
        node_name: "vk-bench",
        pools: vec![sandboxd_api::PoolConfig::warm("base", warm)],
        sandboxd_bin,
        provider_bin,
        extra_args: Vec::new(),
        metrics_server: false,
        sandboxd_config: |_| {},
    })
    .map_err(|e| anyhow!("bringing the node up: {e}"))?;
    let result = rt.block_on(measure(&env, figures, samples, burst_n, execs));
    env.down();
    result
}

async fn measure(env: &NodeEnv, figures: &mut Vec<Figure>, samples: usize, burst: usize, execs: usize) -> Result<()> {
    let kubeconfig = kube::config::Kubeconfig::read_from(&env.cluster.kubeconfig).context("admin kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let client = kube::Client::try_from(config)?;
    env.kubectl_ok(&["create", "namespace", NS]).map_err(|e| anyhow!(e))?;
    let sandboxes: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &sandbox_resource());
    let sightings = Sightings::default();
    let (mut feed, watch) = running_feed(client.clone(), sightings.clone());
    // Stops the watch on every way out (a watch of a stopped cluster would keep retrying).
    let _stop = AbortOnDrop(watch);
    let mut seen = HashMap::new();

    // 1. One at a time: Sandbox created → Pod Running.
    let mut lat = Vec::with_capacity(samples);
    let (mut to_pod, mut to_bound, mut to_running) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..samples {
        let name = format!("lat-{i}");
        let t0 = Instant::now();
        sandboxes.create(&PostParams::default(), &sandbox(&name)).await.context("creating a Sandbox")?;
        wait_running(&mut feed, &mut seen, std::slice::from_ref(&name), Duration::from_secs(60)).await?;
        let running = seen[&name];
        lat.push(running - t0);
        if let Some((created, Some(bound))) = sightings.lock().ok().and_then(|s| s.get(&name).copied()) {
            to_pod.push(created.saturating_duration_since(t0));
            to_bound.push(bound.saturating_duration_since(created));
            to_running.push(running.saturating_duration_since(bound));
        }
    }
    lat.sort();
    for v in [&mut to_pod, &mut to_bound, &mut to_running] {
        v.sort();
    }
    figures.push(Figure {
        name: format!("Sandbox → Pod Running, warm pool (n={samples}) p50"),
        value: ms(percentile(&lat, 0.5)),
        target: "≤ 15 ms (anchors: sandbox-operator warm claim 33 ms; virtual-kubelet 28–80 ms at 200 qps)",
    });
    figures.push(Figure {
        name: format!("Sandbox → Pod Running, warm pool (n={samples}) p99"),
        value: ms(percentile(&lat, 0.99)),
        target: "(no target; the VM is pre-booted, so the accelerator does not enter)",
    });
    for (hop, v) in [
        ("  of which Sandbox → Pod exists (agent-sandbox controller) p50", &to_pod),
        ("  of which Pod → bound (kube-scheduler) p50", &to_bound),
        ("  of which bound → Running (vk-sandbox: claim + status push) p50", &to_running),
    ] {
        figures.push(Figure {
            name: hop.to_string(),
            value: ms(percentile(v, 0.5)),
            target: "(split as seen by one pod watch)",
        });
    }

    // Give the claims back and let the pool refill before the burst.
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", NS, "--wait=true", "--timeout=120s"])
        .map_err(|e| anyhow!(e))?;
    let sandboxd = &env.sandboxd;
    tokio::task::block_in_place(|| sandboxd.wait_full("base"));

    // 2. kubectl on one Running sandbox Pod (a quiet machine: the pool is full).
    let name = "kubectl-bench".to_string();
    sandboxes.create(&PostParams::default(), &sandbox(&name)).await.context("creating a Sandbox")?;
    wait_running(&mut feed, &mut seen, std::slice::from_ref(&name), Duration::from_secs(60)).await?;
    if let Err(e) = tokio::task::block_in_place(|| crate::bench_kubectl::measure(env, figures, NS, &name, execs)) {
        // The other figures still count: say what failed in the table, and what the node saw.
        eprintln!("bench vnode: the kubectl part failed; vk-sandbox's log ends:\n{}", env.provider.log_tail(40));
        figures.push(Figure {
            name: "kubectl exec / port-forward".into(),
            value: format!("failed: {e:#}"),
            target: "",
        });
    }
    env.kubectl_ok(&["delete", "sandbox", &name, "-n", NS, "--wait=true", "--timeout=120s"]).map_err(|e| anyhow!(e))?;
    tokio::task::block_in_place(|| sandboxd.wait_full("base"));

    // 3. A burst: every Sandbox created at once; the figure is until the last Pod runs.
    let names: Vec<String> = (0..burst).map(|i| format!("burst-{i}")).collect();
    let t0 = Instant::now();
    let creates = names.iter().map(|n| {
        let api = sandboxes.clone();
        let obj = sandbox(n);
        async move { api.create(&PostParams::default(), &obj).await }
    });
    for r in futures::future::join_all(creates).await {
        r.context("creating a burst Sandbox")?;
    }
    let created = t0.elapsed();
    wait_running(&mut feed, &mut seen, &names, Duration::from_secs(300)).await?;
    let last = names.iter().map(|n| seen[n]).max().map(|t| t - t0).unwrap_or_default();
    figures.push(Figure {
        name: format!("burst of {burst} Sandboxes → all Pods Running"),
        value: format!("{:.3} s (creates sent in {})", last.as_secs_f64(), ms(created)),
        target: "≤ 1 s for 100 (virtual-kubelet's default 10 qps: ≥ 10 s)",
    });
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", NS, "--wait=false"]).map_err(|e| anyhow!(e))?;
    Ok(())
}

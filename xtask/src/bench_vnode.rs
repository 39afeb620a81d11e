//! `cargo xtask bench vnode`: a Sandbox created → its Pod Running, through the real control
//! plane (apiserver, the upstream agent-sandbox controller, the scheduler) and our vk-sandbox
//! node claiming from a real sandboxd warm pool (`test_infra::vk_sandbox::NodeEnv`).
//!
//! Timing is taken on the client: `t0` just before the Sandbox is POSTed, `t1` when a pod
//! watch (opened beforehand) first delivers the Pod with phase Running. Both figures include
//! every hop: controller reconcile + Pod create, scheduling and binding, the provider's
//! claim and status push, and the watch delivery back to us. Our own hop (bound → Running) is
//! split further by the node's `/metrics` (read on its kubelet port before and after the
//! samples): the sync queue's wait, the create's phases (`settle`, `claim`, `record`),
//! the status queue's wait and the `pods/status` write, each the mean over the samples.
//! Last, the first box empty (issue #19): a second box holds the only warm VMs of a pool, and
//! Sandboxes asking for that pool's warm capacity are placed there by the scheduler.

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
/// Resident memory one idle warm `base` clone takes under TCG beside its golden (`bench density`
/// measured 57 MiB RSS, 27 MiB PSS), rounded up.
const VM_RSS_MIB: u64 = 64;
/// The pool's golden RAM, held once (`bench density`), rounded up.
const GOLDEN_MIB: u64 = 1024;

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
    sandbox_of(name, "small", None)
}

/// A `base` Sandbox of `size`, asking for one unit of `warm` (a box's warm capacity) if given.
fn sandbox_of(name: &str, size: &str, warm: Option<&str>) -> DynamicObject {
    let mut agent = serde_json::json!({"name": "agent", "image": "base"});
    if let Some(r) = warm {
        agent["resources"] = serde_json::json!({"requests": {r: "1"}, "limits": {r: "1"}});
    }
    let value = serde_json::json!({
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"podTemplate": {
            "metadata": {"annotations": {"sandbox.cocoonstack.io/template": "base", "sandbox.cocoonstack.io/size": size}},
            "spec": {
                "nodeSelector": {"sandbox.cocoonstack.io/runtime": "sandboxd"},
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [agent],
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

/// `name{labels} value` lines of a Prometheus text page → value by `name{labels}`.
pub(crate) fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The node's `/metrics` (read on its kubelet port as the API server's kubelet client) and
/// sandboxd's, merged; what cannot be read is left out, and said so.
async fn node_metrics(env: &NodeEnv) -> HashMap<String, f64> {
    let mut all = match env.kubelet_get("/metrics") {
        Ok((200, body)) => samples(&body),
        other => {
            eprintln!("bench vnode: the node's /metrics cannot be read: {other:?}");
            HashMap::new()
        }
    };
    match crate::bench_density::metrics_text(&env.sandboxd.addr, Some(test_infra::sandboxd::TOKEN)).await {
        Ok(text) => all.extend(samples(&text)),
        Err(e) => eprintln!("bench vnode: sandboxd's /metrics cannot be read: {e:#}"),
    }
    all
}

/// The mean of histogram `family{labels}` over what happened between the two scrapes.
pub(crate) fn mean_between(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    family: &str,
    labels: &str,
) -> Option<f64> {
    let delta = |suffix: &str| {
        let k = if labels.is_empty() { format!("{family}_{suffix}") } else { format!("{family}_{suffix}{{{labels}}}") };
        Some(after.get(&k)? - before.get(&k).copied().unwrap_or(0.0))
    };
    let (sum, count) = (delta("sum")?, delta("count")?);
    (count > 0.0).then(|| sum / count)
}

/// vk-sandbox's hop, step by step, from the node's own histograms.
fn hop_split(figures: &mut Vec<Figure>, indent: &str, before: &HashMap<String, f64>, after: &HashMap<String, f64>) {
    for (step, family, labels) in [
        ("sync queue wait", "vnode_pod_queue_wait_seconds", "queue=\"syncPodsFromKubernetes\""),
        (
            "settle (checks; a listing only when a claim may be lost)",
            "vk_sandbox_create_phase_seconds",
            "phase=\"settle\"",
        ),
        ("claim (sandboxd over HTTP)", "vk_sandbox_create_phase_seconds", "phase=\"claim\""),
        ("  of which sandboxd's claim handling", "sandboxd_claim_duration_seconds", ""),
        ("    of which the paused VM's resume", "sandboxd_claim_resume_seconds", ""),
        ("record (claims-state write, flushed off the path)", "vk_sandbox_create_phase_seconds", "phase=\"record\""),
        ("status queue wait", "vnode_pod_queue_wait_seconds", "queue=\"syncPodStatusFromProvider\""),
        ("status push (pods/status write)", "vnode_pod_queue_work_seconds", "queue=\"syncPodStatusFromProvider\""),
    ] {
        figures.push(Figure {
            name: format!("{indent}{step}, mean"),
            value: mean_between(before, after, family, labels)
                .map(|s| format!("{:.2} ms", s * 1000.0))
                .unwrap_or_else(|| "not measured".into()),
            target: "(the node's and sandboxd's /metrics)",
        });
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
    let fits = (mem_available_mib().saturating_sub(4096 + GOLDEN_MIB) / VM_RSS_MIB) as usize;
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
    let before = node_metrics(env).await;
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
    ] {
        figures.push(Figure {
            name: hop.to_string(),
            value: ms(percentile(v, 0.5)),
            target: "(split as seen by one pod watch; upstream's, reported)",
        });
    }
    figures.push(Figure {
        name: "  of which bound → Running (vk-sandbox's hop) p50".into(),
        value: ms(percentile(&to_running, 0.5)),
        target: "≤ 5 ms (the claim's VM resume included)",
    });
    hop_split(figures, "    ", &before, &node_metrics(env).await);

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
    let before = node_metrics(env).await;
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
        target: "≤ 3 s for 100 on this 2-core machine; ≤ 1 s on 8 cores with KVM (not measurable here)",
    });
    // Where the burst's time went: the last Pod made (controller), the last bound (scheduler),
    // and each Pod's own bound → Running (ours).
    let seen_at: Vec<(Instant, Instant, Instant)> = {
        let s = sightings.lock().map_err(|_| anyhow!("the sightings lock is poisoned"))?;
        names.iter().filter_map(|n| Some((s.get(n)?.0, s.get(n)?.1?, seen[n]))).collect()
    };
    if !seen_at.is_empty() {
        let last_made = seen_at.iter().map(|t| t.0).max().map(|t| t - t0).unwrap_or_default();
        let last_bound = seen_at.iter().map(|t| t.1).max().map(|t| t - t0).unwrap_or_default();
        let mut ours: Vec<Duration> = seen_at.iter().map(|t| t.2.saturating_duration_since(t.1)).collect();
        ours.sort();
        figures.push(Figure {
            name: "  of which the last Pod made / the last Pod bound".into(),
            value: format!("{:.3} s / {:.3} s", last_made.as_secs_f64(), last_bound.as_secs_f64()),
            target: "(agent-sandbox controller / kube-scheduler, each at its own API rate; upstream's, reported)",
        });
        figures.push(Figure {
            name: "  of which bound → Running per Pod (vk-sandbox), p50 / max".into(),
            value: format!("{} / {}", ms(percentile(&ours, 0.5)), ms(percentile(&ours, 1.0))),
            target: "(ours: claims run --pod-sync-workers at a time)",
        });
    }
    hop_split(figures, "    burst: ", &before, &node_metrics(env).await);
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", NS, "--wait=true", "--timeout=120s"])
        .map_err(|e| anyhow!(e))?;

    // 4. The first box empty (issue #19): the pool `base/none/medium` is warm only on a second
    //    box; each Sandbox asks for that warm capacity and the unmodified scheduler places it.
    let far = fleet(env, &sandboxes, &mut feed, &mut seen, samples).await?;
    figures.push(Figure {
        name: format!("Sandbox → Pod Running, first box empty, warm on a second (n={}) p50", far.len()),
        value: format!("{} (warm local claim p50 {})", ms(percentile(&far, 0.5)), ms(percentile(&lat, 0.5))),
        target: "no worse than a warm local claim plus one API round trip",
    });
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", NS, "--wait=false"]).map_err(|e| anyhow!(e))?;
    Ok(())
}

/// Step 4 of [`measure`]: a second box whose `base/none/medium` pool holds `samples` warm VMs
/// (this box has none), then one Sandbox at a time asking for that pool's warm capacity;
/// returns Sandbox created → Pod Running for each, sorted.
async fn fleet(
    env: &NodeEnv,
    sandboxes: &Api<DynamicObject>,
    feed: &mut mpsc::UnboundedReceiver<(String, Instant)>,
    seen: &mut HashMap<String, Instant>,
    samples: usize,
) -> Result<Vec<Duration>> {
    const B: &str = "vk-bench-b";
    const WARM: &str = "sandbox.cocoonstack.io/warm-base-none-medium";
    let n = samples.clamp(1, 10);
    let pools =
        vec![sandboxd_api::PoolConfig { size: Some("medium".into()), ..sandboxd_api::PoolConfig::warm("base", n) }];
    let b = tokio::task::block_in_place(|| env.add_box(B, pools, Vec::new())).map_err(|e| anyhow!(e))?;
    let advertised = tokio::task::block_in_place(|| {
        test_infra::suite::poll("the second box advertises its warm VMs", Duration::from_secs(120), || {
            let node = env.get(&["node", B])?.ok_or("no node")?;
            let have: usize = node["status"]["allocatable"][WARM].as_str().and_then(|q| q.parse().ok()).unwrap_or(0);
            Ok((have >= n).then_some(()))
        })
    });
    let mut lat = Vec::with_capacity(n);
    let result = async {
        advertised.map_err(|e| anyhow!(e))?;
        for i in 0..n {
            let name = format!("far-{i}");
            let t0 = Instant::now();
            sandboxes.create(&PostParams::default(), &sandbox_of(&name, "medium", Some(WARM))).await?;
            wait_running(feed, seen, std::slice::from_ref(&name), Duration::from_secs(60)).await?;
            lat.push(seen[&name] - t0);
        }
        anyhow::Ok(())
    }
    .await;
    let _ = env.kubectl(&["delete", "sandboxes", "--all", "-n", NS, "--wait=true", "--timeout=120s"]);
    drop(b);
    let _ = env.kubectl(&["delete", "node", B, "--wait=false"]);
    result?;
    lat.sort();
    Ok(lat)
}

//! The scenarios and the one environment they share (see the suite's doc).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use sandboxd_api::PoolConfig;
use serde_json::{json, Value};
use test_infra::ensure;
use test_infra::kubelet_streams::{self, Target};
use test_infra::sandboxd::free_port;
use test_infra::suite::{annotation, condition, merged, poll, sibling_bin, toleration, Outcome, Suite, SuiteSpec};
use test_infra::vk_sandbox::{NodeEnv, NodeSpec, RUNNING};

/// The apiserver port of this suite's cluster (others: 16443 xtask, 26443 cluster_e2e, 27443 join, 28443 vnode).
const PORT: u16 = 29443;
const NODE: &str = "vk-e2e";
/// The pool every scenario but the seed's claims from.
const BASE: &str = "base";
const RT: &str = "ghcr.io/cocoonstack/sandbox/rt:24.04";
const BASE_WARM: usize = 6;
/// The node's per-Pod cap on streaming sessions (`--max-streams-per-pod`).
const STREAMS_PER_POD: &str = "3";

type Env = NodeEnv;

#[path = "fleet.rs"]
mod fleet;

/// The suite (`vk_sandbox_e2e.rs` runs it). Deleting a scenario's objects gives their claims
/// back (best effort; the next scenario's pool wait catches a leak).
pub static SUITE: Suite<Env> = Suite::new(SuiteSpec {
    name: "vk_sandbox_e2e",
    needs: "the real control plane and QEMU",
    up: env_up,
    down,
    cleanup: "sandboxclaims,sandboxwarmpools,sandboxes,pods",
    scenarios: &[
        ("node_registers_ready_with_taint_labels_and_lease", |env, _| node_registers(env)),
        ("seed_sandboxd_example_runs_and_releases_on_sandbox_delete", seed_example),
        ("mutator_row_selector_matching_no_node_stays_unschedulable", selector_matching_no_node),
        ("mutator_row_missing_toleration_stays_unschedulable", missing_toleration),
        ("mutator_row_node_name_pinned_bypasses_the_scheduler", node_name_pinned),
        ("mutator_row_missing_template_is_pending_with_event", |env, ns| missing_template(env, ns, false)),
        ("mutator_row_missing_template_under_restart_never_is_failed", |env, ns| missing_template(env, ns, true)),
        ("mutator_row_wrong_runtime_is_refused", wrong_runtime),
        ("ttl_seconds_rules", ttl_rules),
        ("pod_deleted_while_sandbox_lives_keeps_the_vm_and_the_new_pod_adopts_it", pod_delete_adoption),
        ("template_warm_pool_and_claim_flow", warm_pool_flow),
        ("lease_expiry_fails_the_pod_with_sandbox_lease_expired", lease_expiry),
        ("provider_kill9_mid_burst_converges_without_duplicates_or_leaks", kill9_mid_burst),
        ("join_with_a_wrong_ca_hash_is_refused", |env, _| wrong_ca_hash(env)),
        ("kubelet_port_authenticates_and_authorizes_like_a_kubelet", kubelet_port),
        ("kubectl_logs_exec_attach_port_forward_and_top_on_a_sandbox_pod", kubectl_streams),
        ("kubectl_bad_inputs_fail_closed_on_a_sandbox_pod", kubectl_bad_inputs),
        (
            "a_fleet_of_two_boxes_publishes_inventory_places_by_warm_capacity_redirects_and_forgets_a_dead_box",
            fleet::fleet,
        ),
    ],
});

fn env_up() -> Result<Env, String> {
    NodeEnv::up(NodeSpec {
        port: PORT,
        node_name: NODE,
        pools: vec![
            PoolConfig { net: Some("none".into()), size: Some("small".into()), ..PoolConfig::warm(RT, 1) },
            PoolConfig::warm(BASE, BASE_WARM),
        ],
        sandboxd_bin: sibling_bin("sandboxd")?,
        provider_bin: sibling_bin("vk-sandbox")?,
        // Low, so that the per-Pod cap on streams is reached with a few execs under TCG; and the
        // fleet's inventory and peers (`fleet.rs`).
        extra_args: [vec!["--max-streams-per-pod".into(), STREAMS_PER_POD.into()], fleet::fleet_args()].concat(),
        metrics_server: true,
        sandboxd_config: |c| c.console_log_kib = kubelet_streams::SUITE_CONSOLE_KIB,
    })
}

/// Stops everything the scenarios started (what survives is printed, not failed on).
fn down(env: Env) -> Outcome {
    env.down();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Objects

/// A Sandbox whose pod template follows the seed's shape, with what a scenario changes (a null
/// removes a field).
fn sandbox(name: &str, annotations: Value, spec_extra: Value) -> Value {
    let spec = json!({
        "nodeSelector": {"sandbox.cocoonstack.io/runtime": "sandboxd"},
        "tolerations": [toleration()],
        "containers": [{"name": "agent", "image": BASE}],
    });
    let spec = merged(spec, &spec_extra);
    json!({
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"podTemplate": {"metadata": {"annotations": annotations}, "spec": spec}},
    })
}

fn base_annotations() -> Value {
    json!({"sandbox.cocoonstack.io/template": BASE})
}

fn epoch_secs() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Seconds from now until an RFC 3339 deadline (parsed with `date`, which every box has).
fn secs_until(rfc3339: &str) -> Result<i64, String> {
    let out = Command::new("date").args(["-d", rfc3339, "+%s"]).output().map_err(|e| e.to_string())?;
    let t: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| format!("bad deadline {rfc3339}"))?;
    Ok(t - epoch_secs() as i64)
}

// ---------------------------------------------------------------------------------------------
// Scenarios

fn node_registers(env: &mut Env) -> Outcome {
    let node = env.wait_node_ready()?;
    let labels = &node["metadata"]["labels"];
    ensure!(labels["sandbox.cocoonstack.io/runtime"] == "sandboxd", "labels: {labels}");
    ensure!(labels["type"] == "virtual-kubelet", "labels: {labels}");
    let taints = node["spec"]["taints"].as_array().cloned().unwrap_or_default();
    ensure!(
        taints.iter().any(|t| t["key"] == "virtual-kubelet.io/provider"
            && t["value"] == "sandboxd"
            && t["effect"] == "NoSchedule"),
        "taints: {taints:?}"
    );
    // The API server canonicalises quantities: 2000 pods reads back as "2k".
    let pods = &node["status"]["capacity"]["pods"];
    ensure!(pods == "2000" || pods == "2k", "capacity: {}", node["status"]["capacity"]);
    ensure!(node["status"]["allocatable"] == node["status"]["capacity"], "allocatable != capacity");
    ensure!(node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64().is_some_and(|p| p > 0), "no port");
    // The Lease is held by the node and renewed (every 10 s).
    let lease = poll("the node lease", RUNNING, || env.get(&["lease", NODE, "-n", "kube-node-lease"]))?;
    ensure!(lease["spec"]["holderIdentity"] == NODE, "lease: {lease}");
    ensure!(lease["spec"]["leaseDurationSeconds"] == 40, "lease: {lease}");
    let first = lease["spec"]["renewTime"].clone();
    poll("the lease to be renewed", Duration::from_secs(30), || {
        let l = env.get(&["lease", NODE, "-n", "kube-node-lease"])?;
        Ok(l.filter(|l| l["spec"]["renewTime"] != first))
    })?;
    // `kubectl get nodes` as a new user sees it.
    let table = env.kubectl_ok(&["get", "nodes"])?;
    ensure!(table.lines().any(|l| l.starts_with(NODE) && l.contains(" Ready")), "kubectl get nodes:\n{table}");
    Ok(())
}

fn seed_example(env: &mut Env, ns: &str) -> Outcome {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("seed/examples/sandboxd-example.yaml");
    env.kubectl_ok(&["apply", "-n", ns, "-f", &seed.display().to_string()])?;
    let pod = env.wait_running(ns, "sandboxd-example")?;
    ensure!(pod["spec"]["nodeName"] == NODE, "bound to {}", pod["spec"]["nodeName"]);
    let id = annotation(&pod, "sandbox.cocoonstack.io/claim-id").ok_or("no claim-id annotation")?.to_string();
    ensure!(pod["status"]["podIP"] == "127.0.0.1", "podIP {}", pod["status"]["podIP"]);
    ensure!(condition(&pod, "Ready").is_some_and(|c| c["status"] == "True"), "pod not Ready: {}", pod["status"]);
    let claims = env.claims_in(ns);
    let key = format!("{ns}/sandboxd-example");
    let rows = claims.get(&key).ok_or(format!("sandboxd has no claim with claim_ref {key}: {claims:?}"))?;
    ensure!(rows.len() == 1 && rows[0].id == id, "claims for {key}: {rows:?}, pod says {id}");
    ensure!(rows[0].key.template == RT, "claimed from the wrong pool: {:?}", rows[0]);
    // The node's /metrics splits the way to Running.
    let (code, metrics) = env.kubelet_get("/metrics")?;
    ensure!(code == 200, "GET /metrics: {code} {metrics}");
    for want in [
        "vnode_pod_queue_wait_seconds_count{queue=\"syncPodsFromKubernetes\"}",
        "vk_sandbox_create_phase_seconds_count{phase=\"claim\"}",
        "vk_sandbox_create_phase_seconds_count{phase=\"record\"}",
        "vnode_pod_queue_work_seconds_count{queue=\"syncPodStatusFromProvider\"}",
        "vk_sandbox_state_flush_failures_total 0",
    ] {
        ensure!(metrics.contains(want), "the node's /metrics lacks {want}:\n{metrics}");
    }
    // The Sandbox becomes Ready once the provider pushed Running.
    poll("Sandbox Ready", RUNNING, || {
        let s = env.get(&["sandbox", "sandboxd-example", "-n", ns])?;
        Ok(s.filter(|s| condition(s, "Ready").is_some_and(|c| c["status"] == "True")))
    })?;
    // Deleting the Sandbox releases the VM; the pool refills.
    env.kubectl_ok(&["delete", "sandbox", "sandboxd-example", "-n", ns, "--wait=true", "--timeout=60s"])?;
    poll("the claim to be released", RUNNING, || Ok(env.claims_in(ns).is_empty().then_some(())))?;
    env.wait_pool_full(RT);
    Ok(())
}

/// The pod stays Pending, unscheduled, with reason Unschedulable, and sandboxd sees nothing.
fn assert_unschedulable(env: &Env, ns: &str, name: &str) -> Outcome {
    let pod = env.wait_pod(ns, name, "PodScheduled=False Unschedulable", RUNNING, |p| {
        condition(p, "PodScheduled").is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable")
    })?;
    ensure!(pod["status"]["phase"] == "Pending", "phase {}", pod["status"]["phase"]);
    ensure!(pod["spec"]["nodeName"].is_null(), "bound to {}", pod["spec"]["nodeName"]);
    std::thread::sleep(Duration::from_secs(2));
    ensure!(env.claims_in(ns).is_empty(), "an unscheduled pod got a claim");
    Ok(())
}

fn selector_matching_no_node(env: &mut Env, ns: &str) -> Outcome {
    let s = sandbox("nosel", base_annotations(), json!({"nodeSelector": {"sandbox.cocoonstack.io/runtime": "nosuch"}}));
    env.apply(ns, &s)?;
    assert_unschedulable(env, ns, "nosel")
}

fn missing_toleration(env: &mut Env, ns: &str) -> Outcome {
    let s = sandbox("notol", base_annotations(), json!({"tolerations": null}));
    env.apply(ns, &s)?;
    assert_unschedulable(env, ns, "notol")?;
    let pod = env.pod(ns, "notol")?.ok_or("pod gone")?;
    let msg = condition(&pod, "PodScheduled").map(|c| c["message"].to_string()).unwrap_or_default();
    ensure!(msg.contains("taint") || msg.contains("untolerated"), "scheduler message does not name the taint: {msg}");
    Ok(())
}

fn node_name_pinned(env: &mut Env, ns: &str) -> Outcome {
    // No selector and no toleration: nodeName skips the scheduler; the annotations decide.
    let s = sandbox("pinned", base_annotations(), json!({"nodeSelector": null, "tolerations": null, "nodeName": NODE}));
    env.apply(ns, &s)?;
    let pod = env.wait_running(ns, "pinned")?;
    ensure!(annotation(&pod, "sandbox.cocoonstack.io/claim-id").is_some(), "no claim-id");
    ensure!(env.claims_in(ns).len() == 1, "claims: {:?}", env.claims_in(ns));
    Ok(())
}

/// ProviderFailed on the pod's status and a Warning event carrying the provider's message, and
/// no claim left behind.
fn assert_provider_failed(env: &Env, ns: &str, name: &str, phase: &str, needle: &str) -> Outcome {
    env.wait_provider_failed(ns, name, phase, RUNNING, &[needle])?;
    let key = format!("{ns}/{name}");
    ensure!(!env.claims_in(ns).contains_key(&key), "a failed create left a claim for {key}: {:?}", env.claims_in(ns));
    Ok(())
}

fn missing_template(env: &mut Env, ns: &str, never: bool) -> Outcome {
    let extra = if never { json!({"restartPolicy": "Never"}) } else { json!({}) };
    let s = sandbox("notemplate", json!({"sandbox.cocoonstack.io/runtime": "sandboxd"}), extra);
    env.apply(ns, &s)?;
    if never {
        assert_provider_failed(env, ns, "notemplate", "Failed", "template")?;
        // Failed is terminal: it stays Failed.
        std::thread::sleep(Duration::from_secs(3));
        let pod = env.pod(ns, "notemplate")?.ok_or("pod gone")?;
        ensure!(pod["status"]["phase"] == "Failed", "a Failed pod changed: {}", pod["status"]);
    } else {
        assert_provider_failed(env, ns, "notemplate", "Pending", "template")?;
    }
    Ok(())
}

fn wrong_runtime(env: &mut Env, ns: &str) -> Outcome {
    let s = sandbox(
        "wrongrt",
        json!({"sandbox.cocoonstack.io/runtime": "kata", "sandbox.cocoonstack.io/template": BASE}),
        json!({}),
    );
    env.apply(ns, &s)?;
    assert_provider_failed(env, ns, "wrongrt", "Pending", "sandboxd")
}

fn ttl_rules(env: &mut Env, ns: &str) -> Outcome {
    let with_ttl = |ttl: Option<&str>| {
        let mut a = base_annotations();
        if let Some(t) = ttl {
            a["sandbox.cocoonstack.io/ttl-seconds"] = json!(t);
        }
        a
    };
    env.apply(ns, &sandbox("ttl-absent", with_ttl(None), json!({})))?;
    env.apply(ns, &sandbox("ttl-zero", with_ttl(Some("0")), json!({})))?;
    env.apply(ns, &sandbox("ttl-600", with_ttl(Some("600")), json!({})))?;
    env.apply(ns, &sandbox("ttl-negative", with_ttl(Some("-5")), json!({})))?;
    env.apply(ns, &sandbox("ttl-word", with_ttl(Some("ten")), json!({})))?;
    for name in ["ttl-absent", "ttl-zero", "ttl-600"] {
        env.wait_running(ns, name)?;
    }
    let claims = env.claims_in(ns);
    let left = |name: &str| -> Result<i64, String> {
        let rows = claims.get(&format!("{ns}/{name}")).ok_or(format!("no claim for {name}: {claims:?}"))?;
        secs_until(&rows[0].deadline)
    };
    let (absent, zero, six) = (left("ttl-absent")?, left("ttl-zero")?, left("ttl-600")?);
    ensure!((86_000..=86_400).contains(&absent), "absent ttl → {absent}s left, want ≈ 86400");
    ensure!((200..=300).contains(&zero), "ttl 0 → {zero}s left, want sandboxd's 300");
    ensure!((500..=600).contains(&six), "ttl 600 → {six}s left");
    assert_provider_failed(env, ns, "ttl-negative", "Pending", "ttl-seconds")?;
    assert_provider_failed(env, ns, "ttl-word", "Pending", "ttl-seconds")?;
    Ok(())
}

fn pod_delete_adoption(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &sandbox("keeper", base_annotations(), json!({})))?;
    let pod = env.wait_running(ns, "keeper")?;
    let id = annotation(&pod, "sandbox.cocoonstack.io/claim-id").ok_or("no claim-id")?.to_string();
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_string();
    env.kubectl_ok(&["delete", "pod", "keeper", "-n", ns, "--wait=true", "--timeout=60s"])?;
    // The controller recreates the Pod (same name, new UID); it adopts the same claim.
    let again = env.wait_pod(ns, "keeper", "recreated and Running", RUNNING, |p| {
        p["metadata"]["uid"] != uid.as_str() && p["status"]["phase"] == "Running"
    })?;
    let id2 = annotation(&again, "sandbox.cocoonstack.io/claim-id").ok_or("no claim-id on the new pod")?;
    ensure!(id2 == id, "the recreated pod got claim {id2}, not the preserved {id}");
    let claims = env.claims_in(ns);
    ensure!(claims.len() == 1 && claims.values().all(|r| r.len() == 1), "claims after adoption: {claims:?}");
    // And the Sandbox's deletion releases it.
    env.kubectl_ok(&["delete", "sandbox", "keeper", "-n", ns, "--wait=true", "--timeout=60s"])?;
    poll("the claim to be released", RUNNING, || Ok(env.claims_in(ns).is_empty().then_some(())))?;
    Ok(())
}

fn warm_pool_flow(env: &mut Env, ns: &str) -> Outcome {
    let template = json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxTemplate",
        "metadata": {"name": "base-tmpl"},
        "spec": {
            "podTemplate": sandbox("x", base_annotations(), json!({}))["spec"]["podTemplate"].clone(),
            "networkPolicyManagement": "Unmanaged",
        },
    });
    env.apply(ns, &template)?;
    env.apply(
        ns,
        &json!({
            "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
            "kind": "SandboxWarmPool",
            "metadata": {"name": "warm"},
            "spec": {"replicas": 2, "sandboxTemplateRef": {"name": "base-tmpl"}},
        }),
    )?;
    // Two warm Sandboxes, each Pod Running on a claim of its own.
    let warm = poll("two warm pods Running with claims", RUNNING, || {
        let pods = env.get(&["pods", "-n", ns])?.unwrap_or_default();
        let running: Vec<Value> = pods["items"]
            .as_array()
            .map(|i| {
                i.iter()
                    .filter(|p| {
                        p["status"]["phase"] == "Running" && annotation(p, "sandbox.cocoonstack.io/claim-id").is_some()
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Ok((running.len() == 2).then_some(running))
    })?;
    let warm_ids: BTreeSet<String> =
        warm.iter().filter_map(|p| annotation(p, "sandbox.cocoonstack.io/claim-id").map(str::to_string)).collect();
    ensure!(warm_ids.len() == 2, "warm pods share a claim: {warm_ids:?}");
    // A SandboxClaim adopts one of them: its Pod (and sandboxd claim) is kept, not recreated.
    env.apply(
        ns,
        &json!({
            "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
            "kind": "SandboxClaim",
            "metadata": {"name": "mine"},
            "spec": {"warmPoolRef": {"name": "warm"}},
        }),
    )?;
    let claim = poll("SandboxClaim Ready", RUNNING, || {
        let c = env.get(&["sandboxclaim", "mine", "-n", ns])?;
        Ok(c.filter(|c| condition(c, "Ready").is_some_and(|r| r["status"] == "True")))
    })?;
    let sbx = claim["status"]["sandbox"]["name"]
        .as_str()
        .or_else(|| annotation(&claim, "agents.x-k8s.io/sandbox-name"))
        .ok_or(format!("claim names no sandbox: {claim}"))?
        .to_string();
    let sandbox_obj = env.get(&["sandbox", &sbx, "-n", ns])?.ok_or("claimed sandbox gone")?;
    let pod_name = annotation(&sandbox_obj, "agents.x-k8s.io/pod-name").unwrap_or(&sbx).to_string();
    let pod = env.wait_running(ns, &pod_name)?;
    let id = annotation(&pod, "sandbox.cocoonstack.io/claim-id").ok_or("adopted pod lost its claim-id")?;
    ensure!(warm_ids.contains(id), "the claimed sandbox's pod has claim {id}, not one of the warm {warm_ids:?}");
    // The pool replenishes to 2 warm members; every claim in sandboxd belongs to a live pod.
    poll("the warm pool to replenish", RUNNING, || {
        let claims = env.claims_in(ns);
        Ok((claims.len() == 3).then_some(()))
    })?;
    Ok(())
}

fn lease_expiry(env: &mut Env, ns: &str) -> Outcome {
    let mut a = base_annotations();
    a["sandbox.cocoonstack.io/ttl-seconds"] = json!("3");
    env.apply(ns, &sandbox("short", a, json!({})))?;
    env.wait_running(ns, "short")?;
    // sandboxd reaps the claim after 3 s; the provider's lease watch (30 s) confirms it gone.
    let pod = poll("Failed SandboxLeaseExpired", Duration::from_secs(120), || {
        let p = env.pod(ns, "short")?;
        Ok(p.filter(|p| p["status"]["phase"] == "Failed"))
    })?;
    ensure!(pod["status"]["reason"] == "SandboxLeaseExpired", "reason {}", pod["status"]["reason"]);
    let cs = &pod["status"]["containerStatuses"][0]["state"]["terminated"];
    ensure!(cs["exitCode"] == 1, "container state: {}", pod["status"]["containerStatuses"]);
    Ok(())
}

fn kill9_mid_burst(env: &mut Env, ns: &str) -> Outcome {
    env.wait_pool_full(BASE);
    const N: usize = 6;
    let names: Vec<String> = (0..N).map(|i| format!("burst-{i}")).collect();
    let list = json!({
        "apiVersion": "v1", "kind": "List",
        "items": names.iter().map(|n| sandbox(n, base_annotations(), json!({}))).collect::<Vec<_>>(),
    });
    env.apply(ns, &list)?;
    // Kill the provider as soon as the first claim lands in sandboxd (mid-burst).
    poll("a first claim", RUNNING, || Ok((!env.claims_in(ns).is_empty()).then_some(())))?;
    env.provider.kill9();
    let at_kill = env.claims_in(ns).len();
    env.provider.ensure_running()?;
    for n in &names {
        env.wait_running(ns, n)?;
    }
    // Converged: one claim per pod, each pod names its own, nothing else with this namespace.
    let claims = poll("exactly one claim per pod", RUNNING, || {
        let c = env.claims_in(ns);
        Ok((c.len() == N && c.values().all(|r| r.len() == 1)).then_some(c))
    })?;
    let mut seen = BTreeSet::new();
    for n in &names {
        let pod = env.pod(ns, n)?.ok_or("pod gone")?;
        let id = annotation(&pod, "sandbox.cocoonstack.io/claim-id").ok_or(format!("{n} has no claim-id"))?;
        let rows = &claims[&format!("{ns}/{n}")];
        ensure!(rows[0].id == id, "{n}: pod says {id}, sandboxd says {}", rows[0].id);
        ensure!(seen.insert(id.to_string()), "claim {id} backs two pods");
    }
    eprintln!("kill -9 after {at_kill} of {N} claims; converged to {N} claims, no duplicates");
    // Deleting them releases every claim (nothing leaked).
    env.kubectl_ok(&["delete", "sandboxes", "--all", "-n", ns, "--wait=true", "--timeout=90s"])?;
    poll("every claim released", RUNNING, || Ok(env.claims_in(ns).is_empty().then_some(())))?;
    env.wait_pool_full(BASE);
    Ok(())
}

fn wrong_ca_hash(env: &mut Env) -> Outcome {
    let mut args = env.provider.args.clone();
    let bad = format!("sha256:{}", "0".repeat(64));
    let i = args.iter().position(|a| a == "--join-ca-hash").ok_or("no --join-ca-hash")? + 1;
    args[i] = bad;
    let j = args.iter().position(|a| a == "--node-name").ok_or("no --node-name")? + 1;
    args[j] = "vk-wrong-ca".into();
    let k = args.iter().position(|a| a == "--credentials-dir").ok_or("no --credentials-dir")? + 1;
    args[k] = env.dir.join("wrong-ca-pki").display().to_string();
    let l = args.iter().position(|a| a == "--listen-addr").ok_or("no --listen-addr")? + 1;
    args[l] = format!("127.0.0.1:{}", free_port());
    let m = args.iter().position(|a| a == "--state-path").ok_or("no --state-path")? + 1;
    args[m] = env.dir.join("wrong-ca/claims.json").display().to_string();
    let out = Command::new(&env.provider.bin)
        .args(&args)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "vk-sandbox joined with a wrong CA hash:\n{stderr}");
    ensure!(stderr.to_lowercase().contains("hash"), "the error does not name the CA hash:\n{stderr}");
    ensure!(env.get(&["node", "vk-wrong-ca"])?.is_none(), "a Node was registered despite the refusal");
    ensure!(
        !env.dir.join("wrong-ca-pki").join(join_identity_file()).exists(),
        "credentials were minted despite the refusal"
    );
    Ok(())
}

fn join_identity_file() -> &'static str {
    "kubelet-client-current.pem"
}

/// The real vk-sandbox binary's kubelet port (its client CA comes from the join): anonymous and
/// bad-token requests get 401, the API server's kubelet-client certificate is served, a service
/// account without `nodes/proxy` gets 403; the node's Sandbox RBAC is bound to it alone.
fn kubelet_port(env: &mut Env, ns: &str) -> Outcome {
    let l = env.provider.args.iter().position(|a| a == "--listen-addr").ok_or("no --listen-addr")? + 1;
    let addr = env.provider.args[l].clone();
    let pki = env.cluster.state_dir.join("pki");
    let (cert, key) = (pki.join("apiserver-kubelet-client.crt"), pki.join("apiserver-kubelet-client.key"));
    // curl -k: the endpoint's certificate is self-signed (the API server does not verify it either).
    let status = |extra: &[&str], path: &str| -> Result<u16, String> {
        let out = Command::new("curl")
            .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10"])
            .args(extra)
            .arg(format!("https://{addr}{path}"))
            .output()
            .map_err(|e| format!("curl: {e}"))?;
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|e| format!("curl printed no status: {e}"))
    };
    for path in ["/pods", "/healthz", "/stats/summary"] {
        let got = status(&[], path)?;
        ensure!(got == 401, "anonymous GET {path}: {got}, want 401");
    }
    let got = status(&["-H", "Authorization: Bearer abcdef.0123456789abcdef"], "/pods")?;
    ensure!(got == 401, "a bad token: {got}, want 401");
    let as_apiserver = ["--cert", &cert.display().to_string(), "--key", &key.display().to_string()].map(String::from);
    let as_apiserver: Vec<&str> = as_apiserver.iter().map(String::as_str).collect();
    let got = status(&as_apiserver, "/pods")?;
    ensure!(got == 200, "the API server's kubelet client: {got}, want 200");
    env.kubectl_ok(&["create", "serviceaccount", "nobody", "-n", ns])?;
    let token = env.kubectl_ok(&["create", "token", "nobody", "-n", ns])?;
    let bearer = format!("Authorization: Bearer {}", token.trim());
    let got = status(&["-H", &bearer], "/pods")?;
    ensure!(got == 403, "a service account without nodes/proxy: {got}, want 403");

    let can = |user: &str| -> Result<bool, String> {
        let out = env
            .kubectl(&[
                "auth",
                "can-i",
                "list",
                "sandboxes.agents.x-k8s.io",
                &format!("--as={user}"),
                "--as-group=system:nodes",
            ])
            .map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
    };
    ensure!(can(&format!("system:node:{NODE}"))?, "the node may not list Sandboxes");
    ensure!(!can("system:node:vk-someone-else")?, "another node identity may list Sandboxes");
    Ok(())
}

/// Issue #15: what a user's first commands on a sandbox Pod do, through the real API server
/// (`test_infra::kubelet_streams`); `kubectl logs -f` ends when the Pod goes.
fn kubectl_streams(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &sandbox("streams", base_annotations(), json!({})))?;
    env.wait_running(ns, "streams")?;
    let target = Target { ns, pod: "streams", container: "agent" };
    kubelet_streams::all_checks(env, &target)?;
    let (follow, _lines) = kubelet_streams::follow_start(env, &target)?;
    env.kubectl_ok(&["delete", "sandbox", "streams", "-n", ns, "--wait=true", "--timeout=60s"])?;
    kubelet_streams::follow_ends(follow)
}

/// Issue #15, bad input: an unknown Pod or container (404 on the kubelet port), a Pod whose VM
/// cannot be made (exec and logs fail at once), the per-Pod stream cap (429), a log far over the
/// console cap, and a VM that dies under an exec and a `logs -f` (both end, no stream leaks).
fn kubectl_bad_inputs(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &sandbox("bad-target", base_annotations(), json!({})))?;
    env.apply(ns, &sandbox("bad-pending", json!({"sandbox.cocoonstack.io/runtime": "sandboxd"}), json!({})))?;
    let pod = env.wait_running(ns, "bad-target")?;
    env.wait_provider_failed(ns, "bad-pending", "Pending", RUNNING, &["template"])?;
    let claim = annotation(&pod, "sandbox.cocoonstack.io/claim-id").ok_or("no claim-id")?.to_string();
    let data = env.sandboxd.dir.path().join("data");
    let kill_vm = || -> Outcome {
        // The claim's VM, from sandboxd's journal (the snapshot, then the log's lines).
        let mut journal = std::fs::read_to_string(data.join("claims.json")).unwrap_or_default();
        journal.push('\n');
        journal.push_str(&std::fs::read_to_string(data.join("claims.log")).unwrap_or_default());
        let vm = journal
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find_map(|v| vm_of_claim(&v, &claim))
            .ok_or(format!("claim {claim} is not in sandboxd's journal: {journal}"))?;
        let vm = vm.as_str();
        let pids = test_infra::sandboxd::qemu_pids(&data.join("vms").join("vms").join(vm).display().to_string());
        ensure!(pids.len() == 1, "VM {vm} of claim {claim}: QEMU processes {pids:?}");
        let out = Command::new("kill").args(["-9", &pids[0].to_string()]).output().map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "kill -9 {}: {}", pids[0], String::from_utf8_lossy(&out.stderr));
        Ok(())
    };
    let target = Target { ns, pod: "bad-target", container: "agent" };
    kubelet_streams::bad_input_checks(
        env,
        &kubelet_streams::BadInputs { target, pending: "bad-pending", kill_vm: &kill_vm },
    )
}

/// The `vm` of the record with `id == claim` anywhere in `v` (a journal line or snapshot).
fn vm_of_claim(v: &Value, claim: &str) -> Option<String> {
    match v {
        Value::Object(m) if m.get("id").and_then(Value::as_str) == Some(claim) => {
            m.get("vm").and_then(Value::as_str).map(str::to_owned)
        }
        Value::Object(m) => m.values().find_map(|x| vm_of_claim(x, claim)),
        Value::Array(a) => a.iter().find_map(|x| vm_of_claim(x, claim)),
        _ => None,
    }
}

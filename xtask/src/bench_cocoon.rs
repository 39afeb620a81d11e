//! `cargo xtask bench cocoon`: a Pod bound to the vk-cocoon node → Running, for `mode: run`
//! (boot the image) and `mode: clone` (restore a snapshot saved by deleting a `run` Pod),
//! through the real control plane, the joined vk-cocoon binary and QEMU, with VM networking in
//! a network namespace the harness creates (`test_infra::vk_cocoon::CocoonEnv`).
//!
//! Pods are created with `spec.nodeName` set (bound at creation), so the figure is the node's
//! share: informer → VM boot or clone (+ network fixup) → agent probe → status push. Timing is
//! taken around `kubectl create` and `kubectl wait --for=jsonpath={.status.phase}=Running`, so
//! it carries about 0.1 s of kubectl start-up.

use crate::bench::{percentile, Figure};
use anyhow::{anyhow, Result};
use serde_json::json;
use std::time::{Duration, Instant};
use test_infra::vk_cocoon::{CocoonEnv, CocoonSpec};

const PORT: u16 = 32443;
const NODE: &str = "vk-cocoon-bench";
const NS: &str = "bench";

fn pod(name: &str, vm: &str, mode: &str, image: &str, policy: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": {
            "vm.cocoonstack.io/name": vm,
            "cocoonset.cocoonstack.io/managed": "true",
            "cocoonset.cocoonstack.io/mode": mode,
            "cocoonset.cocoonstack.io/image": image,
            "cocoonset.cocoonstack.io/snapshot-policy": policy,
        }},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "agent", "image": image}],
        },
    })
}

fn time_to_running(env: &CocoonEnv, name: &str, object: &serde_json::Value) -> Result<Duration> {
    let t0 = Instant::now();
    env.apply(NS, object).map_err(|e| anyhow!(e))?;
    env.kubectl_ok(&[
        "wait",
        "-n",
        NS,
        &format!("pod/{name}"),
        "--for=jsonpath={.status.phase}=Running",
        "--timeout=300s",
    ])
    .map_err(|e| anyhow!(e))?;
    Ok(t0.elapsed())
}

fn delete(env: &CocoonEnv, name: &str) -> Result<()> {
    env.kubectl_ok(&["delete", "pod", name, "-n", NS, "--wait=true", "--timeout=300s"]).map_err(|e| anyhow!(e))?;
    Ok(())
}

pub fn run(figures: &mut Vec<Figure>, samples: usize) -> Result<()> {
    let provider_bin = crate::vk_cocoon::build_provider()?;
    eprintln!("bench cocoon: starting the cluster, a test netns and vk-cocoon");
    let env = CocoonEnv::up(CocoonSpec { port: PORT, node_name: NODE, provider_bin })
        .map_err(|e| anyhow!("bringing the node up: {e}"))?;
    let result = (|| -> Result<()> {
        env.kubectl_ok(&["create", "namespace", NS]).map_err(|e| anyhow!(e))?;
        let accel = vmm::accel::probe();
        let mut run = Vec::new();
        for i in 0..samples {
            let name = format!("run-{i}");
            run.push(time_to_running(&env, &name, &pod(&name, &format!("bench-run-{i}"), "run", "base", "never"))?);
            delete(&env, &name)?;
        }
        // A snapshot to clone from: deleting a `run` Pod under policy `always` saves it.
        time_to_running(&env, "src", &pod("src", "bench-src", "run", "base", "always"))?;
        delete(&env, "src")?;
        let mut clone = Vec::new();
        for i in 0..samples {
            let name = format!("clone-{i}");
            clone.push(time_to_running(
                &env,
                &name,
                &pod(&name, &format!("bench-clone-{i}"), "clone", "bench-src", "never"),
            )?);
            delete(&env, &name)?;
        }
        run.sort();
        clone.sort();
        let s = |d: Duration| format!("{:.2} s", d.as_secs_f64());
        figures.push(Figure {
            name: format!("cocoon Pod bound → Running, mode run `base` ({accel}, n={samples}) p50"),
            value: s(percentile(&run, 0.5)),
            target: "anchor: cocoon cold boot 215–400 ms on KVM",
        });
        figures.push(Figure {
            name: format!("cocoon Pod bound → Running, mode clone ({accel}, n={samples}) p50"),
            value: s(percentile(&clone, 0.5)),
            target: "anchor: cocoon clone 26–44 ms on KVM",
        });
        Ok(())
    })();
    let left = env.down();
    if !left.is_empty() {
        eprintln!("bench cocoon: left behind: {left:?}");
    }
    result
}

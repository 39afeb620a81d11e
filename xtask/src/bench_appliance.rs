//! `cargo xtask bench appliance`: the host image's size; power-on → supervisor ready → both
//! virtual nodes Ready → healthy (the update gate's commit condition: pools at target too),
//! with the accelerator named; and the idle RSS of the supervisor and its services (target
//! ≤ 40 MiB together).
//!
//! The box is the `qemu-x86_64` image booted by OVMF in the QEMU appliance machine
//! ([`test_infra::appliance_vm`]), joined to the test control plane on loopback (reached from
//! the box as `10.0.2.100`), with one warm `base` VM. RSS is what the supervisor reports in
//! `GET /v1/status` (`VmRSS` of itself and of each service's main process; the microVMs' QEMU
//! processes are the pools' cost, not the services').

use crate::bench::Figure;
use anyhow::{anyhow, Context, Result};
use std::time::{Duration, Instant};
use supervisor::client::Client;
use test_infra::appliance_vm::{ApplianceVm, JoinedBox, Options};
use test_infra::cluster::{Cluster, Options as ClusterOptions, APPLIANCE_API_ADDR};
use test_infra::suite::poll;

/// The apiserver port of the bench's cluster (the test suites use 16443–31449).
const PORT: u16 = 22443;
const SANDBOX_NODE: &str = "bench-sandbox";
const COCOON_NODE: &str = "bench-cocoon";
const API_TOKEN: &str = "bench-appliance-api-token";
/// Limits on each phase (TCG: the box boots in tens of seconds, its pool VM in minutes).
const BOOT: Duration = Duration::from_secs(600);
const HEALTHY: Duration = Duration::from_secs(1200);
/// The idle RSS target of the supervisor and its services together.
const RSS_TARGET_MIB: f64 = 40.0;

pub fn run(figures: &mut Vec<Figure>, board: &str, idle: Duration) -> Result<()> {
    crate::prereqs::ensure_apt(&["qemu-system-x86", "qemu-utils", "ovmf", "dosfstools", "mtools", "socat"])?;
    let built = crate::image::build(&crate::image::BuildOptions::dev(board))?;
    let m = &built.manifest;
    let allocated = crate::image::allocated_bytes(&built.disk);
    figures.push(Figure {
        name: format!("appliance image ({board}): root.img (erofs + dm-verity)"),
        value: mib(m.root.size),
        target: "reported (one root slot's payload; a bundle's bulk)",
    });
    figures.push(Figure {
        name: format!("appliance image ({board}): kernel"),
        value: mib(m.kernel.size),
        target: "reported",
    });
    figures.push(Figure {
        name: format!("appliance image ({board}): disk.raw"),
        value: format!("{} ({} allocated)", mib(m.disk.size), mib(allocated)),
        target: "reported (sparse: ESP, 2 root slots, state)",
    });

    let work = tempfile::Builder::new().prefix("bench-appl").tempdir_in("/tmp")?;
    let cluster_opts =
        ClusterOptions { state_dir: work.path().join("cluster"), port: PORT, ..ClusterOptions::default() };
    eprintln!("bench appliance: starting the test control plane on 127.0.0.1:{PORT}");
    let cluster = Cluster::up_with(&cluster_opts).map_err(|e| anyhow!("cluster up: {e}"))?;
    let result = boot_and_measure(figures, &built.disk, work.path(), &cluster, idle);
    if let Err(e) = Cluster::down_with(&cluster_opts) {
        eprintln!("bench appliance: stopping the cluster: {e}");
    }
    result
}

fn boot_and_measure(
    figures: &mut Vec<Figure>,
    disk: &std::path::Path,
    work: &std::path::Path,
    cluster: &Cluster,
    idle: Duration,
) -> Result<()> {
    let mut opts = Options::new(disk, work.join("box"));
    let joined = JoinedBox {
        endpoint: format!("https://{APPLIANCE_API_ADDR}:{PORT}"),
        ca_hash: &cluster.ca_hash,
        bootstrap_token: &cluster.token,
        sandbox_node: SANDBOX_NODE,
        cocoon_node: COCOON_NODE,
        api_token: API_TOKEN,
        health_deadline_secs: 1800,
    };
    joined.bind_nodes(cluster)?;
    opts.config_files = Some(joined.config_files());
    opts.guest_forward_port = Some(PORT);
    let rt = tokio::runtime::Runtime::new()?;
    let power_on = Instant::now();
    let mut vm = ApplianceVm::start(&opts)?;
    let accel = match vm.accel {
        vmm::Accel::Kvm => "KVM",
        vmm::Accel::Tcg => "TCG",
    };
    eprintln!("bench appliance: the box runs under {accel}; console {}", vm.console.display());
    // The remote API serves TLS with the certificate the box mints: pin the fingerprint its
    // console prints.
    let fingerprint = vm.wait_for_fingerprint(BOOT)?;
    let tls = httpd::tls::client_config(&httpd::tls::Trust::Fingerprint(fingerprint), httpd::tls::ALPN_HTTP1)?;
    let client = Client::new(
        format!("https://127.0.0.1:{}", vm.api_port).parse().map_err(|e| anyhow!("API endpoint: {e}"))?,
        Some(API_TOKEN.to_string()),
    )
    .with_tls(tls);
    let status = || rt.block_on(client.status()).ok();
    let failed =
        |e: String| anyhow!("{e}\n---- box console (last lines) ----\n{}", test_infra::tail(&vm.console_text(), 40));

    let api = poll("the supervisor API", BOOT, || Ok(status().map(|_| power_on.elapsed()))).map_err(failed)?;
    let ready =
        poll("the supervisor ready", BOOT, || Ok(status().filter(|s| s.health.ready).map(|_| power_on.elapsed())))
            .map_err(failed)?;
    let nodes = poll("both virtual nodes Ready in the cluster", HEALTHY, || {
        Ok(nodes_ready(cluster).then(|| power_on.elapsed()))
    })
    .map_err(failed)?;
    let healthy = poll("healthy (nodes Ready, pool at target)", HEALTHY, || {
        Ok(status().filter(|s| s.health.healthy()).map(|_| power_on.elapsed()))
    })
    .map_err(failed)?;
    let at = |what: &str| format!("power-on → {what} ({accel}, box under OVMF)");
    let anchor = if vm.accel == vmm::Accel::Tcg {
        "reported (TCG: software emulation; the box's pool VM runs under nested emulation)"
    } else {
        "reported"
    };
    figures.push(Figure { name: at("supervisor API answering"), value: secs(api), target: anchor });
    figures.push(Figure { name: at("supervisor ready"), value: secs(ready), target: anchor });
    figures.push(Figure { name: at("both virtual nodes Ready"), value: secs(nodes), target: anchor });
    figures.push(Figure { name: at("healthy: pool of 1 at target"), value: secs(healthy), target: anchor });

    eprintln!("bench appliance: healthy; idling {idle:?} before reading RSS");
    std::thread::sleep(idle);
    let s = status().context("the supervisor API stopped answering")?;
    let mut parts = vec![("supervisor".to_string(), s.supervisor.rss_kib)];
    parts.extend(s.health.services.iter().map(|svc| (svc.name.clone(), svc.rss_kib)));
    let missing: Vec<&str> = parts.iter().filter(|(_, r)| r.is_none()).map(|(n, _)| n.as_str()).collect();
    anyhow::ensure!(missing.is_empty(), "no RSS reported for {missing:?}");
    let total_kib: u64 = parts.iter().filter_map(|(_, r)| *r).sum();
    let breakdown: Vec<String> =
        parts.iter().map(|(n, r)| format!("{n} {:.1}", r.unwrap_or(0) as f64 / 1024.0)).collect();
    let total_mib = total_kib as f64 / 1024.0;
    figures.push(Figure {
        name: format!("idle RSS, supervisor + services ({})", breakdown.join(", ")),
        value: format!("{total_mib:.1} MiB{}", if total_mib <= RSS_TARGET_MIB { "" } else { " (over)" }),
        target: "≤ 40 MiB together",
    });
    Ok(())
}

fn nodes_ready(cluster: &Cluster) -> bool {
    [SANDBOX_NODE, COCOON_NODE].iter().all(|node| {
        let out = cluster
            .kubectl()
            .args(["get", "node", node, "-o", r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#])
            .output();
        out.is_ok_and(|o| o.status.success() && o.stdout == b"True")
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

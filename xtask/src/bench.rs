//! `cargo xtask bench`: speed and memory figures, each printed beside its target or anchor.
//!
//! Benchmarks measure; they do not pass or fail. Timed assertions live nowhere else.
//! Figures taken under TCG (software emulation) name it: the anchors are KVM figures.

use crate::flags::{BenchArgs, BenchWhat, VmImageArgs};
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm::{AfterSnapshot, Driver, SizeClass, Vm, VmId};
use wire::{Request, Response};

/// One printed figure.
pub struct Figure {
    pub name: String,
    pub value: String,
    pub target: &'static str,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    crate::prereqs::ensure_all()?;
    if matches!(args.what, BenchWhat::Appliance) {
        // The host image's figures need neither the guest images on this host nor the others.
        let mut figures = Vec::new();
        crate::bench_appliance::run(&mut figures, &args.board, Duration::from_secs(args.idle_secs))?;
        print_table(&figures);
        return Ok(());
    }
    crate::vm_image::run(&VmImageArgs { template: None, all: true, force: false })?;
    let want_vm = matches!(args.what, BenchWhat::All | BenchWhat::Vm);
    let want_sandboxd = matches!(args.what, BenchWhat::All | BenchWhat::Sandboxd);
    let want_branch = matches!(args.what, BenchWhat::All | BenchWhat::Branch);
    let want_vnode = matches!(args.what, BenchWhat::All | BenchWhat::Vnode);
    let want_cocoon = matches!(args.what, BenchWhat::All | BenchWhat::Cocoon);
    let want_density = matches!(args.what, BenchWhat::All | BenchWhat::Density);
    let bin = if want_sandboxd || want_branch || want_density { Some(crate::sandboxd::build_binary()?) } else { None };
    let rt = tokio::runtime::Runtime::new()?;
    let mut figures = Vec::new();
    if want_vm {
        figures.extend(rt.block_on(run_async(args))?);
    }
    if let Some(bin) = &bin {
        if want_sandboxd {
            crate::bench_sandboxd::claim_latency(&mut figures)?;
            rt.block_on(crate::bench_sandboxd::real_node(&mut figures, bin, args.rss_claims))?;
        }
        if want_branch {
            rt.block_on(crate::bench_branch::run(&mut figures, bin, args.branch_runs))?;
        }
        if want_density {
            rt.block_on(crate::bench_density::run(&mut figures, bin, args.density_vms, args.density_claims))?;
        }
    }
    if want_vnode {
        crate::bench_vnode::run(&rt, &mut figures, args.sandboxes, args.burst, args.execs)?;
    }
    if want_cocoon {
        crate::bench_cocoon::run(&mut figures, args.cocoon_pods)?;
    }
    if matches!(args.what, BenchWhat::All) {
        crate::bench_appliance::run(&mut figures, &args.board, Duration::from_secs(args.idle_secs))?;
    }
    print_table(&figures);
    Ok(())
}

fn print_table(figures: &[Figure]) {
    let w0 = figures.iter().map(|f| f.name.len()).max().unwrap_or(0);
    let w1 = figures.iter().map(|f| f.value.len()).max().unwrap_or(0);
    println!("\n{:<w0$}  {:<w1$}  target / anchor", "figure", "measured");
    println!("{}", "-".repeat(w0 + w1 + 40));
    for f in figures {
        println!("{:<w0$}  {:<w1$}  {}", f.name, f.value, f.target);
    }
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

pub fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// A process's `VmRSS` in KiB: the supervisor's reader, so the benches and `chrysalis status`
/// measure alike.
pub use supervisor::supervise::rss_kib;

async fn run_async(args: &BenchArgs) -> Result<Vec<Figure>> {
    let state_dir = crate::paths::cache_dir().join("bench-state").join(std::process::id().to_string());
    std::fs::create_dir_all(&state_dir)?;
    let driver = test_infra::qemu(&state_dir)?;
    let catalog = test_infra::catalog()?;
    let mut figures = Vec::new();
    let mut result = measure(&driver, &catalog, args, &state_dir, &mut figures).await;
    if result.is_ok() {
        // Issue #13: what the jail costs (boot and clone with it on and off; a cgroup leaf).
        result = crate::bench_jail::jail_overhead(&mut figures, &state_dir, args.boots).await;
        if let Err(e) = crate::bench_jail::cgroup_memory(&mut figures) {
            eprintln!("bench: no cgroup memory figure: {e:#}");
        }
    }
    for vm in driver.list().await.unwrap_or_default() {
        let _ = driver.kill(&vm).await;
    }
    let _ = std::fs::remove_dir_all(&state_dir);
    result.map(|()| figures)
}

async fn measure(
    driver: &Arc<dyn Driver>,
    catalog: &vmm::Catalog,
    args: &BenchArgs,
    state_dir: &std::path::Path,
    figures: &mut Vec<Figure>,
) -> Result<()> {
    // Boot → agent ready, per template.
    let mut base_vm: Option<Vm> = None;
    for template in ["base", "rt"] {
        let mut times = Vec::new();
        let mut accel = None;
        for _ in 0..args.boots {
            let booted = test_infra::boot(driver, catalog, template, SizeClass::Small).await?;
            times.push(booted.ready_after);
            accel = Some(booted.vm.accel);
            if template == "base" && base_vm.is_none() {
                base_vm = Some(booted.vm);
            } else {
                driver.kill(&booted.vm).await?;
            }
        }
        times.sort();
        figures.push(Figure {
            name: format!("boot → agent ready ({template}, {}, p50 of {})", accel.context("no boot")?, times.len()),
            value: ms(percentile(&times, 0.5)),
            target: "anchor: cocoon cold boot 215–400 ms on KVM",
        });
    }
    let vm = base_vm.context("no base VM")?;

    // Agent RPC round trip on a kept connection.
    let mut conn = test_infra::agent(driver, &vm).await?;
    let mut rtts = Vec::with_capacity(args.rpcs);
    for _ in 0..args.rpcs {
        let t = Instant::now();
        conn.info().await?;
        rtts.push(t.elapsed());
    }
    rtts.sort();
    figures.push(Figure {
        name: format!("agent RPC round trip (info, kept conn, {}) p50/p99", vm.accel),
        value: format!("{} / {}", ms(percentile(&rtts, 0.5)), ms(percentile(&rtts, 0.99))),
        target: "anchor: 0.10 ms on KVM",
    });

    // fs_pull throughput.
    let mib = args.pull_mib;
    let out = conn
        .exec(
            &["dd", "if=/dev/zero", "of=/tmp/pull.bin", "bs=1048576", &format!("count={mib}")],
            Default::default(),
            b"",
        )
        .await?;
    anyhow::ensure!(out.code == 0, "dd failed: {}", String::from_utf8_lossy(&out.stderr));
    let t = Instant::now();
    // The tar of one `mib` MiB file, plus headroom for its headers.
    let mut conn = conn.with_output_cap((mib as usize + 1) * 1048576);
    let tar = conn.download(&Request::FsPull { path: "/tmp/pull.bin".into() }).await?;
    let secs = t.elapsed().as_secs_f64();
    figures.push(Figure {
        name: format!("fs_pull throughput ({mib} MiB file, {})", vm.accel),
        value: format!("{:.1} MiB/s", (tar.len() as f64 / 1048576.0) / secs),
        target: "anchor: ~600 MiB/s on KVM",
    });
    drop(conn);

    // QEMU RSS of an idle VM.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = rss_kib(vm.pid).context("reading VmRSS")?;
    figures.push(Figure {
        name: format!("QEMU RSS per idle VM (base, small, {})", vm.accel),
        value: format!("{:.1} MiB", rss as f64 / 1024.0),
        target: "lower is better; guest RAM is 512 MiB and touched lazily",
    });

    // Clone → agent ready.
    let snap = driver.snapshot(&vm, &state_dir.join("bench-snap"), AfterSnapshot::Resumed).await?;
    let mut times = Vec::new();
    for i in 0..args.boots {
        let t = Instant::now();
        let clone = driver.restore(&snap, &VmId::generate(&format!("bench-clone-{i}"))).await?;
        driver.wait_agent(&clone, test_infra::BOOT_TIMEOUT).await?;
        let mut c = test_infra::agent(driver, &clone).await?;
        match c.info().await? {
            Response::Info { .. } => {}
            other => anyhow::bail!("clone answered {}", other.type_name()),
        }
        times.push(t.elapsed());
        driver.kill(&clone).await?;
    }
    times.sort();
    figures.push(Figure {
        name: format!("clone → agent ready (base, {}, p50 of {})", vm.accel, times.len()),
        value: ms(percentile(&times, 0.5)),
        target: "anchor: cocoon clone 26–44 ms on KVM",
    });
    driver.kill(&vm).await?;
    Ok(())
}

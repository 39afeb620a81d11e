//! Issue #13's figures: what the jail costs. Boot → agent ready and clone → agent ready of the
//! `base` template with the jail on (the VM user, no capabilities, the seccomp sandbox, a cgroup
//! leaf) and off (`CHRYSALIS_JAIL=0`: the sandbox and the descriptors stay, the user and the cgroup
//! go), taken alternately (and in alternating order) so drift on a busy machine hits both; and the kernel memory an empty
//! per-VM cgroup leaf takes (slab + per-CPU counters, over many leaves).

use crate::bench::{ms, percentile, Figure};
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm::jail::JailSettings;
use vmm::{AfterSnapshot, Driver, SizeClass, VmId};

/// Leaves created to measure one leaf's kernel memory.
const LEAVES: usize = 64;

fn driver(state_dir: &std::path::Path, jailed: bool) -> Arc<dyn Driver> {
    let mut cfg = vmm::qemu::QemuConfig::from_env();
    cfg.state_dir = state_dir.to_path_buf();
    cfg.jail = JailSettings::from_env();
    cfg.jail.enabled = Some(jailed);
    Arc::new(vmm::qemu::QemuDriver::new(cfg))
}

/// Boot and clone times with the jail on and off, and the overhead.
pub async fn jail_overhead(figures: &mut Vec<Figure>, state_dir: &std::path::Path, rounds: usize) -> Result<()> {
    let on = driver(&state_dir.join("jail-on"), true);
    let off = driver(&state_dir.join("jail-off"), false);
    let result = measure(figures, state_dir, rounds, &on, &off).await;
    for d in [&on, &off] {
        for vm in d.list().await.unwrap_or_default() {
            let _ = d.kill(&vm).await;
        }
    }
    result
}

async fn measure(
    figures: &mut Vec<Figure>,
    state_dir: &std::path::Path,
    rounds: usize,
    on: &Arc<dyn Driver>,
    off: &Arc<dyn Driver>,
) -> Result<()> {
    let catalog = test_infra::catalog()?;
    let (mut boot_on, mut boot_off, mut clone_on, mut clone_off) = (vec![], vec![], vec![], vec![]);
    let mut accel = None;
    for i in 0..rounds.max(1) {
        // Which goes first alternates by round, so neither always follows the other's teardown.
        let mut order = [(on, &mut boot_on, &mut clone_on), (off, &mut boot_off, &mut clone_off)];
        if i % 2 == 1 {
            order.reverse();
        }
        for (d, boots, clones) in order {
            let booted = test_infra::boot(d, &catalog, "base", SizeClass::Small).await?;
            boots.push(booted.ready_after);
            accel = Some(booted.vm.accel);
            let snap_dir = state_dir.join(format!("jail-snap-{i}-{}", boots.len()));
            let snap = d.snapshot(&booted.vm, &snap_dir, AfterSnapshot::Paused).await?;
            // Only the clone runs while it is timed: the source is gone and the snapshot just
            // written (its RAM image) is flushed, or its writeback and the source's last work
            // land in some restores and not others, whichever side they are on.
            d.kill(&booted.vm).await?;
            nix::unistd::sync();
            let t = Instant::now();
            let clone = d.restore(&snap, &VmId::generate(&format!("bench-jail-{i}"))).await?;
            let restored = t.elapsed();
            d.wait_agent(&clone, test_infra::BOOT_TIMEOUT).await?;
            clones.push((t.elapsed(), restored));
            d.kill(&clone).await?;
            let _ = std::fs::remove_dir_all(&snap_dir);
        }
    }
    let accel = accel.context("no boot")?;
    // Where a clone's time goes: the restore call, then the agent's first answer.
    let restore_part = |v: &[(Duration, Duration)]| {
        let mut r: Vec<Duration> = v.iter().map(|x| x.1).collect();
        r.sort();
        percentile(&r, 0.5)
    };
    figures.push(Figure {
        name: format!("clone: restore call returns (base, {accel}), jail on / off, p50"),
        value: format!("{} / {}", ms(restore_part(&clone_on)), ms(restore_part(&clone_off))),
        target: "where the clone overhead goes (the rest is waiting for the agent)",
    });
    let mut clone_on: Vec<Duration> = clone_on.iter().map(|x| x.0).collect();
    let mut clone_off: Vec<Duration> = clone_off.iter().map(|x| x.0).collect();
    for (what, on, off) in
        [("boot → agent ready", &mut boot_on, &mut boot_off), ("clone → agent ready", &mut clone_on, &mut clone_off)]
    {
        on.sort();
        off.sort();
        let (p_on, p_off) = (percentile(on, 0.5), percentile(off, 0.5));
        let overhead = (p_on.as_secs_f64() / p_off.as_secs_f64().max(1e-9) - 1.0) * 100.0;
        figures.push(Figure {
            name: format!("{what} (base, {accel}), jail on / off, p50 of {}", on.len()),
            value: format!("{} / {} ({overhead:+.1} %)", ms(p_on), ms(p_off)),
            target: "overhead ≤ 10 % under TCG",
        });
    }
    Ok(())
}

fn meminfo_kib(keys: &[&str]) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut sum = 0;
    for k in keys {
        let line = text.lines().find(|l| l.starts_with(&format!("{k}:")))?;
        sum += line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    }
    Some(sum)
}

/// The kernel memory of one per-VM cgroup leaf: `LEAVES` leaves with a small VM's limits,
/// (Slab + Percpu after − before) / `LEAVES`.
pub fn cgroup_memory(figures: &mut Vec<Figure>) -> Result<()> {
    let mut settings = JailSettings::from_env();
    settings.enabled = Some(true);
    let Some(jail) = settings.resolve()? else {
        anyhow::bail!("the jail is off here (not root?): no cgroup figure");
    };
    let keys = ["Slab", "Percpu"];
    std::thread::sleep(Duration::from_millis(200));
    let before = meminfo_kib(&keys).context("reading /proc/meminfo")?;
    let mut leaves = Vec::with_capacity(LEAVES);
    for i in 0..LEAVES {
        let name = format!("bench-cgroup-{}-{i}", std::process::id());
        leaves.push(jail.leaf(&name, SizeClass::Small, vmm::Accel::Kvm)?);
    }
    let after = meminfo_kib(&keys).context("reading /proc/meminfo")?;
    for leaf in &leaves {
        leaf.remove();
    }
    let per = after.saturating_sub(before) as f64 / LEAVES as f64;
    figures.push(Figure {
        name: format!("kernel memory per VM cgroup leaf (Slab + Percpu, over {LEAVES} leaves)"),
        value: format!("{per:.0} KiB"),
        target: "lower is better; a small VM's memory.max is 768 MiB",
    });
    Ok(())
}

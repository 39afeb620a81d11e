//! Reading a running hypervisor's jail from the host (`/proc/<pid>/status`, its cgroups): what
//! the tests check and what an operator can verify on a box.

use std::path::{Path, PathBuf};

use super::cgroup::{parse_proc_cgroup, CpuWeight, Limits, CGROUP_ROOT, CPU_PERIOD_US};

/// The jail of one process as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessJail {
    /// Real, effective, saved and filesystem uid (`Uid:`).
    pub uids: [u32; 4],
    /// `CapEff:` (hex).
    pub cap_eff: u64,
    /// `CapPrm:` (hex).
    pub cap_prm: u64,
    /// `CapBnd:` (hex).
    pub cap_bnd: u64,
    /// `Seccomp:` (2 = filter).
    pub seccomp: u32,
    /// `NoNewPrivs:`.
    pub no_new_privs: bool,
    /// The limits of its cgroup(s), where every one of them is set.
    pub limits: Option<Limits>,
    /// Its cgroup directories (one in v2; memory, cpu, pids in v1).
    pub cgroups: Vec<PathBuf>,
    /// Its CPU weight, when it is one of ours ([`CpuWeight`]).
    pub cpu_weight: Option<CpuWeight>,
}

/// The [`CpuWeight`] the CPU controller among `dirs` holds (`cpu.weight` or `cpu.shares`).
pub fn cpu_weight_of(dirs: &[PathBuf]) -> Option<CpuWeight> {
    dirs.iter().find_map(|d| {
        let (v2, v1) = (read_u64(&d.join("cpu.weight")), read_u64(&d.join("cpu.shares")));
        [CpuWeight::Normal, CpuWeight::Background]
            .into_iter()
            .find(|w| v2 == Some(u64::from(w.v2())) || v1 == Some(u64::from(w.v1())))
    })
}

/// Parses the fields of `/proc/<pid>/status` we care about.
pub fn parse_status(text: &str) -> Option<([u32; 4], u64, u64, u64, u32, bool)> {
    let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name).map(str::trim));
    let hex = |name: &str| field(name).and_then(|v| u64::from_str_radix(v, 16).ok());
    let mut uids = [0u32; 4];
    let mut it = field("Uid:")?.split_whitespace();
    for u in &mut uids {
        *u = it.next()?.parse().ok()?;
    }
    Some((
        uids,
        hex("CapEff:")?,
        hex("CapPrm:")?,
        hex("CapBnd:")?,
        field("Seccomp:")?.parse().ok()?,
        field("NoNewPrivs:")? == "1",
    ))
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reads the jail of `pid`; `None` if the process is gone.
pub fn process_jail(pid: u32) -> Option<ProcessJail> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let (uids, cap_eff, cap_prm, cap_bnd, seccomp, no_new_privs) = parse_status(&status)?;
    let own = parse_proc_cgroup(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?);
    let root = Path::new(CGROUP_ROOT);
    let join = |base: PathBuf, cg: &str| base.join(cg.trim_start_matches('/'));
    let (cgroups, limits) = if root.join("cgroup.controllers").is_file() {
        let dir = own.iter().find(|(id, _, _)| id == "0").map(|(_, _, p)| join(root.to_path_buf(), p));
        let limits = dir.as_ref().and_then(|d| {
            let mem = read_u64(&d.join("memory.max"))?;
            let cpu = std::fs::read_to_string(d.join("cpu.max")).ok()?;
            let mut cpu = cpu.split_whitespace();
            let quota: u64 = cpu.next()?.parse().ok()?;
            let period: u64 = cpu.next()?.parse().ok()?;
            Some(Limits {
                memory_bytes: mem,
                cpu_quota_us: quota * CPU_PERIOD_US / period,
                pids: read_u64(&d.join("pids.max"))?,
            })
        });
        (dir.into_iter().collect(), limits)
    } else {
        let dir_of = |c: &str| {
            own.iter().find(|(_, cs, _)| cs.iter().any(|x| x == c)).map(|(_, cs, p)| join(root.join(cs.join(",")), p))
        };
        let dirs: Vec<PathBuf> = ["memory", "cpu", "pids"].iter().filter_map(|c| dir_of(c)).collect();
        let limits = (|| {
            let mem = read_u64(&dir_of("memory")?.join("memory.limit_in_bytes"))?;
            let cpu = dir_of("cpu")?;
            let quota = read_u64(&cpu.join("cpu.cfs_quota_us"))?;
            let period = read_u64(&cpu.join("cpu.cfs_period_us"))?;
            let pids = read_u64(&dir_of("pids")?.join("pids.max"))?;
            Some(Limits { memory_bytes: mem, cpu_quota_us: quota * CPU_PERIOD_US / period, pids })
        })();
        (dirs, limits)
    };
    let cpu_weight = cpu_weight_of(&cgroups);
    Some(ProcessJail { uids, cap_eff, cap_prm, cap_bnd, seccomp, no_new_privs, limits, cgroups, cpu_weight })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields() {
        let s = "Name:\tqemu\nUid:\t990\t990\t990\t990\nGid:\t990\t990\t990\t990\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n";
        assert_eq!(parse_status(s), Some(([990; 4], 0, 0, 0, 2, true)));
        let me = process_jail(std::process::id()).expect("own status");
        assert!(!me.cgroups.is_empty() || !Path::new(CGROUP_ROOT).exists());
    }
}

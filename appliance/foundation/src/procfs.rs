//! CPU time and memory from `/proc`, for `kubectl top`: the node's totals (`/proc/stat`,
//! `/proc/meminfo`) and one process's (`/proc/<pid>/stat`, `/proc/<pid>/status`).
//!
//! The parsers take the files' text, so tests feed them fakes; [`Procfs`] reads them under a
//! root (`/proc` in production). Every figure is cumulative CPU time in nanoseconds or bytes.
//!
//! The node's figures follow what the kubelet reports for its root cgroup (cAdvisor): CPU is
//! every tick not spent idle or waiting for I/O; memory usage is `MemTotal - MemFree`, the
//! working set that minus `Inactive(file)` (page cache the kernel may drop at once), and
//! available is `MemAvailable`.

use std::path::{Path, PathBuf};

/// Clock ticks per second in `/proc` files (`USER_HZ`): the kernel's ABI fixes it at 100 on
/// every architecture Linux exports `/proc/<pid>/stat` from, whatever `CONFIG_HZ` is.
pub const USER_HZ: u64 = 100;
const NANOS_PER_TICK: u64 = 1_000_000_000 / USER_HZ;

/// A `/proc` file that could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum ProcfsError {
    /// The file could not be read (for a process: it is gone).
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file did not have the expected shape.
    #[error("{path}: {what}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was missing or malformed.
        what: String,
    },
}

/// The node's CPU and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeUsage {
    /// CPU time used since boot by all CPUs, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// `MemTotal - MemFree`, bytes.
    pub memory_usage_bytes: u64,
    /// The usage minus `Inactive(file)`, bytes.
    pub memory_working_set_bytes: u64,
    /// `MemAvailable`, bytes.
    pub memory_available_bytes: u64,
    /// `MemTotal`, bytes.
    pub memory_total_bytes: u64,
    /// When the node booted (`/proc/stat`'s `btime`), seconds since the Unix epoch; 0 when unknown.
    pub boot_time_secs: u64,
}

/// One process's CPU and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessUsage {
    /// `utime + stime`, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// `VmRSS`, bytes.
    pub rss_bytes: u64,
    /// When it started (field 22 of its `stat`), clock ticks since boot: with the pid, names
    /// one process even after its pid is reused.
    pub start_ticks: u64,
}

/// Busy CPU time from `/proc/stat`'s aggregate `cpu` line (every field but `idle` and
/// `iowait`; `guest` time is already inside `user`), nanoseconds.
pub fn parse_stat_cpu(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split_whitespace().next() == Some("cpu"))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map(str::parse).collect::<Result<_, _>>().ok()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]
    if ticks.len() < 4 {
        return None;
    }
    let busy: u64 = ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| *t).sum();
    Some(busy.saturating_mul(NANOS_PER_TICK))
}

/// `btime` of `/proc/stat`: when the node booted, seconds since the Unix epoch.
pub fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

/// `/proc/meminfo`'s `key:  <n> kB` in bytes.
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        match it.next() {
            Some("kB") => Some(n.saturating_mul(1024)),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// The memory figures of [`NodeUsage`] from `/proc/meminfo` (`cpu_usage_nanos` left 0);
/// `Err` names the missing key.
pub fn parse_meminfo(text: &str) -> Result<NodeUsage, &'static str> {
    let get = |k: &'static str| meminfo_field(text, k).ok_or(k);
    let total = get("MemTotal")?;
    let free = get("MemFree")?;
    let available = get("MemAvailable")?;
    let inactive_file = get("Inactive(file)")?;
    let usage = total.saturating_sub(free);
    Ok(NodeUsage {
        cpu_usage_nanos: 0,
        memory_usage_bytes: usage,
        memory_working_set_bytes: usage.saturating_sub(inactive_file),
        memory_available_bytes: available,
        memory_total_bytes: total,
        boot_time_secs: 0,
    })
}

/// `utime + stime` (fields 14 and 15) of `/proc/<pid>/stat`, nanoseconds. The command name
/// (field 2) may hold spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_pid_stat_cpu(text: &str) -> Option<u64> {
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): utime is field 14 → index 11.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime.saturating_add(stime).saturating_mul(NANOS_PER_TICK))
}

/// Field 22 (`starttime`) of `/proc/<pid>/stat`, clock ticks since boot.
pub fn parse_pid_start_time(text: &str) -> Option<u64> {
    text[text.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()
}

/// `VmRSS` of `/proc/<pid>/status`, bytes (`None` for a kernel thread or a zombie, which have none).
pub fn parse_status_rss(text: &str) -> Option<u64> {
    meminfo_field(text, "VmRSS")
}

/// Reads the files under a `/proc` root.
#[derive(Debug, Clone)]
pub struct Procfs {
    root: PathBuf,
}

impl Default for Procfs {
    fn default() -> Self {
        Procfs { root: PathBuf::from("/proc") }
    }
}

impl Procfs {
    /// `/proc`-shaped files under `root` (tests).
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Procfs { root: root.into() }
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn read(&self, rel: &str) -> Result<(PathBuf, String), ProcfsError> {
        let path = self.root.join(rel);
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok((path, text)),
            Err(source) => Err(ProcfsError::Read { path, source }),
        }
    }

    /// The node's CPU and memory.
    pub fn node(&self) -> Result<NodeUsage, ProcfsError> {
        let (stat_path, stat) = self.read("stat")?;
        let cpu = parse_stat_cpu(&stat)
            .ok_or_else(|| ProcfsError::Parse { path: stat_path, what: "no aggregate `cpu` line".into() })?;
        let (mem_path, mem) = self.read("meminfo")?;
        let usage =
            parse_meminfo(&mem).map_err(|key| ProcfsError::Parse { path: mem_path, what: format!("no `{key}`") })?;
        Ok(NodeUsage { cpu_usage_nanos: cpu, boot_time_secs: parse_boot_time(&stat).unwrap_or(0), ..usage })
    }

    /// The CPU and memory of process `pid`.
    pub fn process(&self, pid: u32) -> Result<ProcessUsage, ProcfsError> {
        let (stat_path, stat) = self.read(&format!("{pid}/stat"))?;
        let cpu = parse_pid_stat_cpu(&stat)
            .ok_or_else(|| ProcfsError::Parse { path: stat_path.clone(), what: "no utime/stime".into() })?;
        let start_ticks = parse_pid_start_time(&stat)
            .ok_or_else(|| ProcfsError::Parse { path: stat_path.clone(), what: "no starttime".into() })?;
        let (status_path, status) = self.read(&format!("{pid}/status"))?;
        let rss = parse_status_rss(&status)
            .ok_or_else(|| ProcfsError::Parse { path: status_path, what: "no `VmRSS`".into() })?;
        Ok(ProcessUsage { cpu_usage_nanos: cpu, rss_bytes: rss, start_ticks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 5 50 1000 20 3 2 1 7 0\ncpu0 50 2 25 500 10 1 1 0 0 0\nintr 1 2 3\nbtime 1700000000\n";
    const MEMINFO: &str = "MemTotal:       16000000 kB\nMemFree:         4000000 kB\nMemAvailable:    9000000 kB\nBuffers:          100 kB\nInactive(file):  3000000 kB\n";

    #[test]
    fn node_cpu_is_every_tick_but_idle_and_iowait() {
        // 100 + 5 + 50 + 3 + 2 + 1 = 161 ticks of 10 ms; guest (7) is inside user.
        assert_eq!(parse_stat_cpu(STAT), Some(161 * 10_000_000));
        assert_eq!(parse_stat_cpu("cpu0 1 2 3 4\n"), None, "no aggregate line");
        assert_eq!(parse_stat_cpu("cpu 1 x 3 4\n"), None);
        assert_eq!(parse_stat_cpu("cpu 1 2\n"), None);
    }

    #[test]
    fn node_memory_follows_the_kubelets_root_cgroup_figures() {
        let m = parse_meminfo(MEMINFO).expect("meminfo");
        assert_eq!(m.memory_total_bytes, 16_000_000 * 1024);
        assert_eq!(m.memory_usage_bytes, 12_000_000 * 1024);
        assert_eq!(m.memory_working_set_bytes, 9_000_000 * 1024);
        assert_eq!(m.memory_available_bytes, 9_000_000 * 1024);
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), Err("MemFree"));
    }

    #[test]
    fn a_process_with_a_strange_name() {
        let stat = "4242 (qemu (vm) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 5 0 12345 0 0\n";
        assert_eq!(parse_pid_stat_cpu(stat), Some(400 * 10_000_000));
        assert_eq!(parse_pid_start_time(stat), Some(12345));
        assert_eq!(parse_pid_stat_cpu("4242 (qemu) S 1 2"), None, "truncated");
        assert_eq!(parse_status_rss("Name:\tqemu\nVmRSS:\t  2048 kB\n"), Some(2 << 20));
        assert_eq!(parse_status_rss("Name:\tkworker\n"), None);
    }

    #[test]
    fn files_under_a_fake_root() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let fs = Procfs::at(tmp.path());
        assert!(matches!(fs.node(), Err(ProcfsError::Read { .. })));
        std::fs::write(tmp.path().join("stat"), STAT).expect("stat");
        std::fs::write(tmp.path().join("meminfo"), "MemTotal: 1 kB\n").expect("meminfo");
        let e = fs.node().expect_err("incomplete meminfo");
        assert!(e.to_string().contains("MemFree"), "{e}");
        std::fs::write(tmp.path().join("meminfo"), MEMINFO).expect("meminfo");
        let n = fs.node().expect("node");
        assert_eq!(n.cpu_usage_nanos, 1_610_000_000);
        assert_eq!(n.boot_time_secs, 1_700_000_000);
        assert_eq!(n.memory_working_set_bytes, 9_000_000 * 1024);

        std::fs::create_dir(tmp.path().join("7")).expect("pid dir");
        std::fs::write(tmp.path().join("7/stat"), "7 (ch) S 1 7 7 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0 99 0 0\n")
            .expect("stat");
        std::fs::write(tmp.path().join("7/status"), "VmRSS:\t10 kB\n").expect("status");
        assert_eq!(
            fs.process(7).expect("pid"),
            ProcessUsage { cpu_usage_nanos: 70_000_000, rss_bytes: 10240, start_ticks: 99 }
        );
        assert!(matches!(fs.process(8), Err(ProcfsError::Read { .. })));
    }

    #[test]
    fn the_host_can_be_read() {
        let n = Procfs::default().node().expect("this host's /proc");
        assert!(n.cpu_usage_nanos > 0 && n.memory_total_bytes > 0);
        let me = Procfs::default().process(std::process::id()).expect("own process");
        assert!(me.rss_bytes > 0);
    }
}

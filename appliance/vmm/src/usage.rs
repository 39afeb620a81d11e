//! What a VM uses: cumulative CPU time and memory working set, for `kubectl top` and
//! sandboxd's `…/stats`.
//!
//! A jailed VM is measured on its cgroup leaf (`jail::cgroup`), which holds the hypervisor and
//! every thread it starts. The leaf is found through `/proc/<pid>/cgroup` of the VM's
//! hypervisor process and used only when its last component is the VM's id, so an unjailed
//! VM (`CHRYSALIS_JAIL=0`) is never charged with the whole cgroup its driver runs in:
//!
//! - cgroup v2: `cpu.stat`'s `usage_usec`; `memory.current` minus `memory.stat`'s
//!   `inactive_file`;
//! - cgroup v1: `cpuacct.usage` (ns); `memory.usage_in_bytes` minus `memory.stat`'s
//!   `total_inactive_file`.
//!
//! The working set leaves out page cache the kernel can drop at once, as the kubelet's does
//! (cAdvisor's `workingSet`). Without a leaf (or when it cannot be read) the hypervisor process
//! itself is measured: `utime + stime` and `VmRSS`. The hypervisor's pid is checked against
//! its recorded start time first, so a reused pid is never measured.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use foundation::procfs::{NodeUsage, Procfs, ProcfsError};

use crate::driver::Vm;
use crate::jail::cgroup::{parse_proc_cgroup, CGROUP_ROOT};

/// Why a VM could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The hypervisor process is gone (or its pid now names another process).
    #[error("vm {vm}: its hypervisor process {pid} is gone")]
    Gone {
        /// The VM.
        vm: String,
        /// Its recorded hypervisor pid.
        pid: u32,
    },
    /// `/proc` could not be read.
    #[error("vm {vm}")]
    Procfs {
        /// The VM.
        vm: String,
        /// The cause.
        #[source]
        source: ProcfsError,
    },
}

/// Where a [`VmUsage`] was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// The VM's cgroup leaf.
    Cgroup,
    /// Its hypervisor process.
    Process,
}

/// One measurement of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUsage {
    /// CPU time used since the VM started, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// Memory working set, bytes.
    pub memory_working_set_bytes: u64,
    /// Where it was read.
    pub source: UsageSource,
    /// When.
    pub measured_at: SystemTime,
}

/// Reads VM and node usage under a `/proc` and a cgroup root (the host's by default).
#[derive(Debug, Clone)]
pub struct UsageReader {
    procfs: Procfs,
    cgroup_root: PathBuf,
}

impl Default for UsageReader {
    fn default() -> Self {
        UsageReader { procfs: Procfs::default(), cgroup_root: PathBuf::from(CGROUP_ROOT) }
    }
}

impl UsageReader {
    /// Fake roots (tests).
    pub fn at(proc_root: impl Into<PathBuf>, cgroup_root: impl Into<PathBuf>) -> Self {
        UsageReader { procfs: Procfs::at(proc_root), cgroup_root: cgroup_root.into() }
    }

    /// The node's totals.
    pub fn node(&self) -> Result<NodeUsage, ProcfsError> {
        self.procfs.node()
    }

    /// What `vm` uses now.
    pub fn vm(&self, vm: &Vm) -> Result<VmUsage, UsageError> {
        self.measure(vm.id.as_str(), vm.pid, vm.pid_start_time)
    }

    /// What the VM `id`, whose hypervisor is `pid` started at `start_ticks`, uses now.
    pub fn measure(&self, id: &str, pid: u32, start_ticks: u64) -> Result<VmUsage, UsageError> {
        let gone = || UsageError::Gone { vm: id.to_owned(), pid };
        let process = match self.procfs.process(pid) {
            Ok(p) => p,
            Err(ProcfsError::Read { .. }) => return Err(gone()),
            Err(source) => return Err(UsageError::Procfs { vm: id.to_owned(), source }),
        };
        if pid == 0 || process.start_ticks != start_ticks {
            return Err(gone());
        }
        let measured_at = SystemTime::now();
        if let Some((cpu, memory)) = self.leaf_usage(id, pid) {
            return Ok(VmUsage {
                cpu_usage_nanos: cpu,
                memory_working_set_bytes: memory,
                source: UsageSource::Cgroup,
                measured_at,
            });
        }
        Ok(VmUsage {
            cpu_usage_nanos: process.cpu_usage_nanos,
            memory_working_set_bytes: process.rss_bytes,
            source: UsageSource::Process,
            measured_at,
        })
    }

    /// CPU nanoseconds and working-set bytes from the VM's own leaf, if it has one we can read.
    fn leaf_usage(&self, id: &str, pid: u32) -> Option<(u64, u64)> {
        let text = std::fs::read_to_string(self.procfs.root().join(format!("{pid}/cgroup"))).ok()?;
        let lines = parse_proc_cgroup(&text);
        let ours = |path: &str| path.rsplit('/').next() == Some(id);
        let under = |mount: &str, path: &str| -> PathBuf {
            let mut p = self.cgroup_root.join(mount);
            p.extend(path.split('/').filter(|s| !s.is_empty() && *s != "." && *s != ".."));
            p
        };
        let has = |ctrls: &[String], c: &str| ctrls.iter().any(|x| x == c);
        // cgroup v2: the one `0::<path>` line, on a unified hierarchy.
        let unified = self.cgroup_root.join("cgroup.controllers").is_file();
        if let Some((_, _, path)) = lines.iter().find(|(hid, c, p)| unified && hid == "0" && c.is_empty() && ours(p)) {
            let dir = under("", path);
            let cpu = stat_field(&read(&dir.join("cpu.stat"))?, "usage_usec")?.saturating_mul(1000);
            let current = read_u64(&dir.join("memory.current"))?;
            let inactive = stat_field(&read(&dir.join("memory.stat"))?, "inactive_file").unwrap_or(0);
            return Some((cpu, current.saturating_sub(inactive)));
        }
        // cgroup v1: `cpuacct` (mounted alone or as `cpu,cpuacct`) and `memory`.
        let (_, cpu_ctrls, cpu_path) = lines.iter().find(|(_, c, p)| has(c, "cpuacct") && ours(p))?;
        let (_, _, mem_path) = lines.iter().find(|(_, c, p)| has(c, "memory") && ours(p))?;
        let cpu_mount = [cpu_ctrls.join(","), "cpuacct".to_owned(), "cpu,cpuacct".to_owned()]
            .into_iter()
            .map(|m| under(&m, cpu_path))
            .find(|d| d.is_dir())?;
        let cpu = read_u64(&cpu_mount.join("cpuacct.usage"))?;
        let mem_dir = under("memory", mem_path);
        let usage = read_u64(&mem_dir.join("memory.usage_in_bytes"))?;
        let inactive = stat_field(&read(&mem_dir.join("memory.stat"))?, "total_inactive_file").unwrap_or(0);
        Some((cpu, usage.saturating_sub(inactive)))
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn read_u64(path: &Path) -> Option<u64> {
    read(path)?.trim().parse().ok()
}

/// The value of `key` in a flat-keyed cgroup file (`cpu.stat`, `memory.stat`: `key value` lines).
pub fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        _tmp: tempfile::TempDir,
        proc_root: PathBuf,
        cg: PathBuf,
    }

    fn fake(pid: u32, start: u64, cgroup: &str) -> Fake {
        let tmp = tempfile::tempdir().expect("tempdir");
        let proc_root = tmp.path().join("proc");
        let cg = tmp.path().join("cg");
        let dir = proc_root.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("pid dir");
        std::fs::create_dir_all(&cg).expect("cg");
        let stat = format!("{pid} (qemu-system-x86) S 1 1 1 0 -1 0 0 0 0 0 30 20 0 0 20 0 4 0 {start} 0 0\n");
        std::fs::write(dir.join("stat"), stat).expect("stat");
        std::fs::write(dir.join("status"), "Name:\tqemu\nVmRSS:\t  4096 kB\n").expect("status");
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        Fake { _tmp: tmp, proc_root, cg }
    }

    fn write(path: PathBuf, text: &str) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }

    #[test]
    fn a_v2_leaf_gives_cpu_and_the_working_set() {
        let f = fake(42, 777, "0::/chrysalis-vms/sbx-1\n");
        write(f.cg.join("cgroup.controllers"), "cpu memory pids\n");
        let leaf = f.cg.join("chrysalis-vms/sbx-1");
        write(leaf.join("cpu.stat"), "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n");
        write(leaf.join("memory.current"), "600000000\n");
        write(leaf.join("memory.stat"), "anon 500000000\nfile 100000000\ninactive_file 80000000\n");
        let u = UsageReader::at(&f.proc_root, &f.cg).measure("sbx-1", 42, 777).expect("usage");
        assert_eq!(u.source, UsageSource::Cgroup);
        assert_eq!(u.cpu_usage_nanos, 2_500_000_000);
        assert_eq!(u.memory_working_set_bytes, 520_000_000);
    }

    #[test]
    fn a_v1_leaf_with_cpu_and_cpuacct_mounted_together() {
        let f = fake(
            42,
            777,
            "12:pids:/x/chrysalis-vms/vk-a\n4:memory:/x/chrysalis-vms/vk-a\n2:cpu,cpuacct:/x/chrysalis-vms/vk-a\n0::/u\n",
        );
        write(f.cg.join("cpu,cpuacct/x/chrysalis-vms/vk-a/cpuacct.usage"), "123456789\n");
        write(f.cg.join("memory/x/chrysalis-vms/vk-a/memory.usage_in_bytes"), "1000\n");
        write(f.cg.join("memory/x/chrysalis-vms/vk-a/memory.stat"), "cache 10\ntotal_inactive_file 300\n");
        let u = UsageReader::at(&f.proc_root, &f.cg).measure("vk-a", 42, 777).expect("usage");
        assert_eq!((u.source, u.cpu_usage_nanos, u.memory_working_set_bytes), (UsageSource::Cgroup, 123_456_789, 700));
    }

    #[test]
    fn without_its_own_leaf_the_process_is_measured() {
        // The driver's cgroup (an unjailed VM) is not the VM's: its last component is not the id.
        let f = fake(42, 777, "0::/user.slice/session-1.scope\n");
        write(f.cg.join("cgroup.controllers"), "cpu memory\n");
        write(f.cg.join("user.slice/session-1.scope/cpu.stat"), "usage_usec 999999999\n");
        let u = UsageReader::at(&f.proc_root, &f.cg).measure("sbx-1", 42, 777).expect("usage");
        assert_eq!(u.source, UsageSource::Process);
        assert_eq!((u.cpu_usage_nanos, u.memory_working_set_bytes), (500_000_000, 4 << 20));
        // A leaf named for the VM but unreadable falls back too.
        let f = fake(42, 777, "0::/chrysalis-vms/sbx-1\n");
        write(f.cg.join("cgroup.controllers"), "cpu memory\n");
        let u = UsageReader::at(&f.proc_root, &f.cg).measure("sbx-1", 42, 777).expect("usage");
        assert_eq!(u.source, UsageSource::Process);
    }

    #[test]
    fn a_gone_or_reused_pid_is_not_measured() {
        let f = fake(42, 777, "0::/chrysalis-vms/sbx-1\n");
        let r = UsageReader::at(&f.proc_root, &f.cg);
        assert!(matches!(r.measure("sbx-1", 42, 778), Err(UsageError::Gone { pid: 42, .. })), "reused pid");
        assert!(matches!(r.measure("sbx-1", 43, 777), Err(UsageError::Gone { .. })), "no such pid");
        std::fs::write(f.proc_root.join("42/status"), "Name:\tzombie\n").expect("status");
        let e = r.measure("sbx-1", 42, 777).expect_err("no VmRSS");
        assert!(matches!(e, UsageError::Procfs { .. }), "{e}");
    }

    #[test]
    fn flat_keyed_fields() {
        assert_eq!(stat_field("a 1\nab 2\n", "ab"), Some(2));
        assert_eq!(stat_field("a x\n", "a"), None);
        assert_eq!(stat_field("", "a"), None);
    }
}

//! One cgroup leaf per VM, with limits from its size class.
//!
//! - **cgroup v2** (the appliance: `/sys/fs/cgroup` is `cgroup2`): the leaves live under
//!   `/sys/fs/cgroup/<parent>/<vm id>`, `<parent>` being `$CHRYSALIS_VM_CGROUP` (default
//!   `chrysalis-vms`) taken from the hierarchy's root: v2 lets no cgroup hold both processes and
//!   controller-enabled children, so the parent cannot sit under the driver's own cgroup. The
//!   driver enables `+memory +cpu +pids` in the root's and the parent's `cgroup.subtree_control`.
//! - **cgroup v1** (a hybrid development host): the `memory`, `cpu` and `pids` hierarchies each
//!   get `<driver's own cgroup>/<parent>/<vm id>` (v1 has no such rule, so the VMs stay inside
//!   whatever the driver is accounted in); an absolute `$CHRYSALIS_VM_CGROUP` (`/x`) is taken
//!   from the hierarchy's root instead, in both versions.
//!
//! Limits ([`Limits::for_vm`]): memory = RAM + 256 MiB (+ 256 MiB more under TCG, for its
//! translation cache), CPU = vCPUs + ½ CPU, pids = 96 + vCPUs (QEMU's threads: main, RCU,
//! vCPUs, its I/O thread pool of up to 64).
//!
//! A leaf is written before the hypervisor starts (a failure there fails the boot, naming the
//! file) and removed when the VM is destroyed; a removal that fails (the kernel still tearing
//! the process down, a re-attached VM) is logged and counted ([`cleanup_failures`]), never
//! fatal, and never a reason to kill a VM.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::accel::Accel;
use crate::size::SizeClass;

/// Environment variable naming the parent of the VM leaves.
pub const PARENT_ENV: &str = "CHRYSALIS_VM_CGROUP";
/// The default parent.
pub const DEFAULT_PARENT: &str = "chrysalis-vms";
/// Where cgroup hierarchies are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The CFS period used for `cpu.max` / `cpu.cfs_period_us`.
pub const CPU_PERIOD_US: u64 = 100_000;

const MIB: u64 = 1 << 20;

static CLEANUP_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many leaf removals (or other best-effort cgroup writes after a VM started) failed in
/// this process.
pub fn cleanup_failures() -> u64 {
    CLEANUP_FAILURES.load(Ordering::Relaxed)
}

/// Errors setting up a VM's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable cgroup hierarchy with the controllers we need.
    #[error("no cgroup hierarchy with the {controller} controller under {CGROUP_ROOT} ({detail}): mount cgroup2 on {CGROUP_ROOT} (or the v1 memory, cpu and pids controllers), or set CHRYSALIS_JAIL=0 on a development machine")]
    NoHierarchy {
        /// The missing controller.
        controller: &'static str,
        /// What we found.
        detail: String,
    },
    /// Reading `/proc/self/cgroup` failed.
    #[error("reading /proc/self/cgroup")]
    Own(#[source] std::io::Error),
    /// Creating or writing a cgroup file failed.
    #[error("{what} {path}: check that the driver runs as root and that the controllers are enabled in the parent's cgroup.subtree_control (cgroup v2), or choose another parent with {PARENT_ENV}")]
    Write {
        /// The operation.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A VM id that cannot name a directory.
    #[error("vm id {0:?} cannot name a cgroup")]
    BadName(String),
}

/// The limits of one VM's leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `memory.max` / `memory.limit_in_bytes`, bytes.
    pub memory_bytes: u64,
    /// CPU quota per [`CPU_PERIOD_US`], µs.
    pub cpu_quota_us: u64,
    /// `pids.max`.
    pub pids: u64,
}

impl Limits {
    /// The limits for a VM of `size` under `accel` (see the module docs).
    pub fn for_vm(size: SizeClass, accel: Accel) -> Self {
        let tcg = if accel == Accel::Tcg { 256 } else { 0 };
        let vcpus = u64::from(size.vcpus());
        Limits {
            memory_bytes: (size.memory_mib() + 256 + tcg) * MIB,
            cpu_quota_us: vcpus * CPU_PERIOD_US + CPU_PERIOD_US / 2,
            pids: 96 + vcpus,
        }
    }

    /// `(file, value)` pairs for cgroup v2.
    pub fn v2_files(&self) -> [(&'static str, String); 3] {
        [
            ("memory.max", self.memory_bytes.to_string()),
            ("cpu.max", format!("{} {CPU_PERIOD_US}", self.cpu_quota_us)),
            ("pids.max", self.pids.to_string()),
        ]
    }

    /// `(controller, file, value)` triples for cgroup v1.
    pub fn v1_files(&self) -> [(&'static str, &'static str, String); 4] {
        [
            ("memory", "memory.limit_in_bytes", self.memory_bytes.to_string()),
            ("cpu", "cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
            ("cpu", "cpu.cfs_quota_us", self.cpu_quota_us.to_string()),
            ("pids", "pids.max", self.pids.to_string()),
        ]
    }
}

/// A VM leaf's CPU weight against the other VMs' leaves: a VM being made for a pool runs at
/// `Background`, so that under contention the VMs users hold get the CPU first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuWeight {
    /// The kernel's default weight.
    Normal,
    /// A tenth of it.
    Background,
}

impl CpuWeight {
    /// `cpu.weight` (cgroup v2, default 100).
    pub fn v2(self) -> u32 {
        match self {
            CpuWeight::Normal => 100,
            CpuWeight::Background => 10,
        }
    }

    /// `cpu.shares` (cgroup v1, default 1024).
    pub fn v1(self) -> u32 {
        match self {
            CpuWeight::Normal => 1024,
            CpuWeight::Background => 102,
        }
    }
}

/// The controllers a leaf uses.
pub const CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// Where VM leaves go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupLayout {
    /// cgroup v2: the hierarchy root and the parent directory (absolute).
    V2 {
        /// `/sys/fs/cgroup`.
        root: PathBuf,
        /// `<root>/<parent>`.
        parent: PathBuf,
    },
    /// cgroup v1: the parent directory in each controller's hierarchy, in [`CONTROLLERS`] order.
    V1 {
        /// `(controller, <mount>/<own cgroup>/<parent>)`.
        parents: Vec<(&'static str, PathBuf)>,
    },
}

/// Parses `/proc/self/cgroup`: `(hierarchy id, controllers, path)` lines.
pub fn parse_proc_cgroup(text: &str) -> Vec<(String, Vec<String>, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let id = it.next()?.to_string();
            let ctrls = it.next()?.split(',').filter(|c| !c.is_empty()).map(String::from).collect();
            Some((id, ctrls, it.next()?.to_string()))
        })
        .collect()
}

/// Joins a cgroup path (`/a/b`) onto a directory.
fn under(base: &Path, cg: &str) -> PathBuf {
    let mut p = base.to_path_buf();
    p.extend(cg.split('/').filter(|s| !s.is_empty() && *s != "." && *s != ".."));
    p
}

impl CgroupLayout {
    /// Detects the hierarchy at [`CGROUP_ROOT`] for the parent `parent` (default
    /// [`DEFAULT_PARENT`]).
    pub fn detect(parent: Option<&str>) -> Result<Self, CgroupError> {
        let root = Path::new(CGROUP_ROOT);
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(CgroupError::Own)?;
        let v2 = root.join("cgroup.controllers").is_file();
        Ok(Self::plan(root, v2, &parse_proc_cgroup(&own), parent))
    }

    /// The layout for a hierarchy at `root` (v2 when `v2`) and our own `/proc/self/cgroup`.
    pub fn plan(root: &Path, v2: bool, own: &[(String, Vec<String>, String)], parent: Option<&str>) -> Self {
        let parent = parent.unwrap_or(DEFAULT_PARENT);
        let absolute = parent.starts_with('/');
        if v2 {
            return CgroupLayout::V2 { root: root.to_path_buf(), parent: under(root, parent) };
        }
        let parents = CONTROLLERS
            .iter()
            .map(|&c| {
                let mount = v1_mount(root, c);
                let base = match (absolute, own.iter().find(|(_, cs, _)| cs.iter().any(|x| x == c))) {
                    (false, Some((_, _, path))) => under(&mount, path),
                    _ => mount,
                };
                (c, under(&base, parent))
            })
            .collect();
        CgroupLayout::V1 { parents }
    }

    /// Creates (or reuses) the leaf of `vm` and writes `limits` into it.
    pub fn create_leaf(&self, vm: &str, limits: &Limits) -> Result<Leaf, CgroupError> {
        if vm.is_empty() || vm.contains('/') || vm.starts_with('.') {
            return Err(CgroupError::BadName(vm.into()));
        }
        let write = |path: PathBuf, value: &str, what| {
            std::fs::write(&path, value).map_err(|source| CgroupError::Write { what, path, source })
        };
        let mkdir = |path: &Path| match std::fs::create_dir_all(path) {
            Ok(()) => Ok(()),
            Err(source) => Err(CgroupError::Write { what: "creating", path: path.to_path_buf(), source }),
        };
        match self {
            CgroupLayout::V2 { root, parent } => {
                let enable = "+memory +cpu +pids";
                // Each level from the root down to the parent must delegate the controllers.
                let mut level = root.clone();
                for part in parent.strip_prefix(root).unwrap_or(Path::new("")).components() {
                    write(level.join("cgroup.subtree_control"), enable, "enabling controllers in")?;
                    level.push(part);
                    mkdir(&level)?;
                }
                write(parent.join("cgroup.subtree_control"), enable, "enabling controllers in")?;
                let dir = parent.join(vm);
                mkdir(&dir)?;
                let leaf = Leaf { dirs: vec![dir.clone()] };
                for (file, value) in limits.v2_files() {
                    if let Err(e) = write(dir.join(file), &value, "writing") {
                        leaf.remove();
                        return Err(e);
                    }
                }
                Ok(leaf)
            }
            CgroupLayout::V1 { parents } => {
                let leaf = Leaf { dirs: parents.iter().map(|(_, p)| p.join(vm)).collect() };
                let result = (|| {
                    for dir in &leaf.dirs {
                        mkdir(dir)?;
                    }
                    for (controller, file, value) in limits.v1_files() {
                        let dir = parents
                            .iter()
                            .zip(&leaf.dirs)
                            .find(|((c, _), _)| *c == controller)
                            .map(|(_, d)| d)
                            .ok_or(CgroupError::NoHierarchy { controller, detail: "not planned".into() })?;
                        write(dir.join(file), &value, "writing")?;
                    }
                    Ok(())
                })();
                if let Err(e) = result {
                    leaf.remove();
                    return Err(e);
                }
                Ok(leaf)
            }
        }
    }

    /// Removes every leaf under the parent that holds no process and is older than `grace`
    /// (a VM that died or was killed outside its driver leaves one behind; a leaf just made for
    /// a VM still starting is younger than `grace`). Returns how many went. Leaves of other
    /// drivers sharing the parent qualify too: an empty leaf is nobody's VM.
    pub fn sweep_empty(&self, grace: Duration) -> usize {
        let parents: Vec<&Path> = match self {
            CgroupLayout::V2 { parent, .. } => vec![parent.as_path()],
            CgroupLayout::V1 { parents } => parents.iter().map(|(_, p)| p.as_path()).collect(),
        };
        let mut removed = 0;
        for parent in parents {
            let Ok(entries) = std::fs::read_dir(parent) else { continue };
            for dir in entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_dir()) {
                let empty = std::fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|p| p.trim().is_empty());
                let old = std::fs::metadata(&dir)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age >= grace));
                if empty && old && std::fs::remove_dir(&dir).is_ok() {
                    tracing::info!(cgroup = %dir.display(), "removed the empty cgroup leaf of a VM that is gone");
                    removed += 1;
                }
            }
        }
        removed
    }

    /// The leaf of `vm` (for removal after a restart), whether or not it exists.
    pub fn leaf_of(&self, vm: &str) -> Leaf {
        match self {
            CgroupLayout::V2 { parent, .. } => Leaf { dirs: vec![parent.join(vm)] },
            CgroupLayout::V1 { parents } => Leaf { dirs: parents.iter().map(|(_, p)| p.join(vm)).collect() },
        }
    }
}

/// The v1 mount point of `controller` (`cpu` may be mounted as `cpu,cpuacct`).
fn v1_mount(root: &Path, controller: &str) -> PathBuf {
    let direct = root.join(controller);
    if direct.is_dir() || controller != "cpu" {
        return direct;
    }
    root.join("cpu,cpuacct")
}

/// A VM's cgroup leaf (one directory in v2, one per controller in v1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    dirs: Vec<PathBuf>,
}

impl Leaf {
    /// Its directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Writes `weight` into the leaf's CPU controller (`cpu.weight` in v2, `cpu.shares` in v1).
    pub fn set_cpu_weight(&self, weight: CpuWeight) -> Result<(), CgroupError> {
        for dir in &self.dirs {
            let (file, value) = if dir.join("cpu.weight").exists() {
                ("cpu.weight", weight.v2())
            } else if dir.join("cpu.shares").exists() {
                ("cpu.shares", weight.v1())
            } else {
                continue;
            };
            let path = dir.join(file);
            std::fs::write(&path, value.to_string()).map_err(|source| CgroupError::Write {
                what: "writing",
                path,
                source,
            })?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process writes itself into.
    pub fn procs_files(&self) -> Vec<CString> {
        self.dirs
            .iter()
            .filter_map(|d| CString::new(d.join("cgroup.procs").into_os_string().into_encoded_bytes()).ok())
            .collect()
    }

    /// The pids in the leaf (in any of its directories; none if it does not exist): the VM's
    /// hypervisor from the moment its spawned child wrote itself in, before its exec.
    pub fn processes(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .dirs
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|text| text.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Removes the leaf, retrying briefly while the kernel finishes tearing the VM's process
    /// down; a leaf still busy after that (or any other failure) is logged and counted.
    pub fn remove(&self) {
        for dir in &self.dirs {
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 50 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => {
                        CLEANUP_FAILURES.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(cgroup = %dir.display(), error = %e, "could not remove a VM's cgroup leaf");
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_removes_empty_leaves_past_the_grace_and_keeps_young_ones() {
        // Needs a real cgroup hierarchy we may write (root); elsewhere it says why and returns.
        let Ok(layout) = CgroupLayout::detect(Some(&format!("chrysalis-sweep-test-{}", std::process::id()))) else {
            foundation::testing::skip("no cgroup hierarchy here");
            return;
        };
        let Ok(leaf) = layout.create_leaf("gone-vm", &Limits::for_vm(SizeClass::Small, Accel::Kvm)) else {
            foundation::testing::skip("cannot create cgroups here (not root?)");
            return;
        };
        assert_eq!(layout.sweep_empty(Duration::from_secs(3600)), 0, "a young leaf stays");
        assert!(leaf.dirs().iter().all(|d| d.is_dir()));
        assert_eq!(layout.sweep_empty(Duration::ZERO), leaf.dirs().len());
        assert!(leaf.dirs().iter().all(|d| !d.exists()));
        let parents: Vec<PathBuf> = leaf.dirs().iter().filter_map(|d| d.parent().map(Path::to_path_buf)).collect();
        for p in parents {
            let _ = std::fs::remove_dir(p);
        }
    }

    #[test]
    fn limits_follow_the_size_class() {
        let l = Limits::for_vm(SizeClass::Small, Accel::Kvm);
        assert_eq!(l, Limits { memory_bytes: 768 * MIB, cpu_quota_us: 150_000, pids: 97 });
        let l = Limits::for_vm(SizeClass::Small, Accel::Tcg);
        assert_eq!(l.memory_bytes, 1024 * MIB, "TCG adds 256 MiB for its translation cache");
        let l = Limits::for_vm(SizeClass::Medium, Accel::Kvm);
        assert_eq!(l, Limits { memory_bytes: 1280 * MIB, cpu_quota_us: 250_000, pids: 98 });
        let l = Limits::for_vm(SizeClass::X2Large, Accel::Tcg);
        assert_eq!(l, Limits { memory_bytes: (16384 + 512) * MIB, cpu_quota_us: 850_000, pids: 104 });
        for c in SizeClass::ALL {
            let l = Limits::for_vm(c, Accel::Kvm);
            assert!(l.memory_bytes > c.memory_mib() * MIB);
            assert!(l.cpu_quota_us > u64::from(c.vcpus()) * CPU_PERIOD_US);
        }
        let v2 = Limits::for_vm(SizeClass::Medium, Accel::Kvm).v2_files();
        assert_eq!(v2[0], ("memory.max", (1280 * MIB).to_string()));
        assert_eq!(v2[1], ("cpu.max", "250000 100000".to_string()));
        assert_eq!(v2[2], ("pids.max", "98".to_string()));
        let v1 = Limits::for_vm(SizeClass::Medium, Accel::Kvm).v1_files();
        assert_eq!(v1[2], ("cpu", "cpu.cfs_quota_us", "250000".to_string()));
    }

    #[test]
    fn layouts() {
        let own = parse_proc_cgroup("12:pids:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/user.slice\n");
        assert_eq!(own[1], ("4".into(), vec!["memory".into()], "/process_api/abc".into()));
        let root = Path::new("/nonexistent/cg");
        let v1 = CgroupLayout::plan(root, false, &own, None);
        let CgroupLayout::V1 { parents } = &v1 else { panic!("v1 expected") };
        assert_eq!(parents[0], ("memory", PathBuf::from("/nonexistent/cg/memory/process_api/abc/chrysalis-vms")));
        assert_eq!(parents[2], ("pids", PathBuf::from("/nonexistent/cg/pids/chrysalis-vms")));
        let abs = CgroupLayout::plan(root, false, &own, Some("/vms"));
        let CgroupLayout::V1 { parents } = &abs else { panic!("v1 expected") };
        assert_eq!(parents[0].1, PathBuf::from("/nonexistent/cg/memory/vms"));
        let v2 = CgroupLayout::plan(root, true, &own, None);
        assert_eq!(v2, CgroupLayout::V2 { root: root.into(), parent: PathBuf::from("/nonexistent/cg/chrysalis-vms") });
        assert_eq!(v2.leaf_of("sbx-1").dirs(), [PathBuf::from("/nonexistent/cg/chrysalis-vms/sbx-1")]);
        let procs = v2.leaf_of("sbx-1").procs_files();
        assert_eq!(procs[0].to_str().expect("utf8"), "/nonexistent/cg/chrysalis-vms/sbx-1/cgroup.procs");
    }

    #[test]
    fn leaves_on_a_fake_v2_tree() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        let layout = CgroupLayout::plan(root, true, &[], Some("a/vms"));
        let leaf = layout.create_leaf("sbx-1", &Limits::for_vm(SizeClass::Small, Accel::Kvm)).expect("leaf");
        let dir = root.join("a/vms/sbx-1");
        assert_eq!(leaf.dirs(), std::slice::from_ref(&dir));
        assert_eq!(std::fs::read_to_string(dir.join("pids.max")).expect("pids"), "97");
        assert_eq!(std::fs::read_to_string(dir.join("cpu.max")).expect("cpu"), "150000 100000");
        for level in [root.to_path_buf(), root.join("a"), root.join("a/vms")] {
            assert_eq!(
                std::fs::read_to_string(level.join("cgroup.subtree_control")).expect("subtree"),
                "+memory +cpu +pids"
            );
        }
        assert!(matches!(
            layout.create_leaf("../x", &Limits::for_vm(SizeClass::Small, Accel::Kvm)),
            Err(CgroupError::BadName(_))
        ));
        // A failing write names the file and leaves nothing behind.
        let blocked = CgroupLayout::V2 { root: root.join("nope-file"), parent: root.join("nope-file/vms") };
        std::fs::write(root.join("nope-file"), "").expect("file");
        let e = blocked.create_leaf("sbx-2", &Limits::for_vm(SizeClass::Small, Accel::Kvm)).expect_err("blocked");
        assert!(e.to_string().contains("nope-file"), "{e}");
    }

    #[test]
    fn cpu_weight_goes_to_the_cpu_controller_of_either_version() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (v2, mem, cpu) = (tmp.path().join("v2"), tmp.path().join("memory"), tmp.path().join("cpu"));
        for d in [&v2, &mem, &cpu] {
            std::fs::create_dir_all(d).expect("dir");
        }
        // A real leaf has the files already; these stand in for them.
        std::fs::write(v2.join("cpu.weight"), "100").expect("weight");
        std::fs::write(cpu.join("cpu.shares"), "1024").expect("shares");
        let read = |p: PathBuf| std::fs::read_to_string(p).expect("read");
        Leaf { dirs: vec![v2.clone()] }.set_cpu_weight(CpuWeight::Background).expect("v2");
        assert_eq!(read(v2.join("cpu.weight")), "10");
        let v1 = Leaf { dirs: vec![mem.clone(), cpu.clone()] };
        v1.set_cpu_weight(CpuWeight::Background).expect("v1");
        assert_eq!(read(cpu.join("cpu.shares")), "102");
        assert!(!mem.join("cpu.shares").exists(), "the memory hierarchy is left alone");
        v1.set_cpu_weight(CpuWeight::Normal).expect("back");
        assert_eq!(read(cpu.join("cpu.shares")), "1024");
    }
}

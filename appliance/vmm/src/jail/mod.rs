//! The jail every hypervisor process runs in (issue 13, item 1).
//!
//! The privileged driver prepares everything, then the hypervisor runs with no privilege:
//!
//! - **user**: one unprivileged system user, `chrysalis-vm` (`$CHRYSALIS_VM_USER`), with no
//!   supplementary groups; the switch (`setgroups([])`, `setresgid`, `setresuid`) happens between
//!   fork and exec, after which the process holds no capability (`CapEff`/`CapPrm` 0, bounding
//!   set emptied too) and cannot gain any (`PR_SET_NO_NEW_PRIVS`);
//! - **cgroup**: one leaf per VM with `memory`, `cpu` and `pids` limits from its size class
//!   ([`cgroup`]); the child moves itself in before exec, so no hypervisor instruction runs
//!   outside it;
//! - **session**: its own session (`setsid`), so no signal to the driver's process group or
//!   session (a `kill -9` of sandboxd, vk-cocoon or the supervisor) reaches it;
//! - **descriptors**: QEMU opens no path the driver owns; disks, sockets, the TAP and
//!   migration streams are opened by the driver and inherited ([`SpawnPlan::inherit`]).
//!   cloud-hypervisor still opens its files by path: the driver lays them out for the VM user
//!   (its own 0700 directory, handed over with [`Jail::hand_over`] once the driver wrote
//!   there; snapshot directories taken back with [`Jail::take_back_dir`]; read-only inputs
//!   checked with [`Jail::check_reach`]; the TAP handed over with [`set_owner`]) and keeps its
//!   own files where the VM user cannot replace them (see [`crate::cloud_hypervisor`]'s
//!   "Jail"); the sockets it binds there are dialled with their peer checked
//!   ([`crate::peer`]);
//! - **output**: the hypervisor's stdout and stderr go through a pipe into a size-capped log
//!   ([`output`]).
//!
//! `CHRYSALIS_JAIL=0` turns the user switch and the cgroup off (development only); by default
//! the jail is on when the driver runs as root, and a missing user is [`JailError::UserMissing`]
//! naming the fix. Unprivileged drivers (tests as a normal user) cannot switch users and run the
//! hypervisor as themselves.

pub mod cgroup;
pub mod inspect;
pub mod output;
pub mod tap;

use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::accel::Accel;
use crate::size::SizeClass;
pub use cgroup::{CgroupError, CgroupLayout, CpuWeight, Leaf, Limits};
pub use tap::{open_tap, set_owner, TapError};

/// Environment switch: `0` turns the jail off (development), `1` insists on it.
pub const JAIL_ENV: &str = "CHRYSALIS_JAIL";
/// Environment variable naming the unprivileged user.
pub const USER_ENV: &str = "CHRYSALIS_VM_USER";
/// The default unprivileged user.
pub const DEFAULT_USER: &str = "chrysalis-vm";

/// Errors preparing a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The jail is on and its user does not exist.
    #[error(
        "the VM user {user:?} does not exist: create it (`useradd --system --no-create-home --shell /usr/sbin/nologin {user}`, or `cargo xtask prereqs`), or set {JAIL_ENV}=0 on a development machine"
    )]
    UserMissing {
        /// The user looked up.
        user: String,
    },
    /// Looking the user up failed.
    #[error("looking up the VM user {user:?} in the user database")]
    Lookup {
        /// The user looked up.
        user: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The jail was asked for by a driver that cannot switch users.
    #[error("{JAIL_ENV}=1 but this process is not root and cannot switch to the VM user: run the driver as root or unset {JAIL_ENV}")]
    NotRoot,
    /// The VM user is root: no jail at all.
    #[error("the VM user {user:?} has uid 0: {USER_ENV} must name an unprivileged user")]
    RootUser {
        /// The user.
        user: String,
    },
    /// The VM's cgroup could not be set up.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The VM's TAP could not be opened.
    #[error(transparent)]
    Tap(#[from] TapError),
    /// A path the hypervisor opens itself is out of the VM user's reach.
    #[error("{path} is not {wanted} by the VM user {user:?} (uid {uid}, gid {gid}): {why}")]
    Unreachable {
        /// The user.
        user: String,
        /// Its uid.
        uid: u32,
        /// Its gid.
        gid: u32,
        /// The path the hypervisor opens.
        path: PathBuf,
        /// `"readable"` or `"readable and writable"`.
        wanted: &'static str,
        /// The first directory it cannot search, or the file's mode.
        why: String,
    },
    /// A directory the VM user wrote into holds something it must not (a symbolic link, a
    /// directory, a hard link, another user's file); it is left as it is.
    #[error("{path}: {why}; refusing to take it back from the VM user")]
    Unexpected {
        /// The entry.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// Handing a file or directory to the VM user (or taking it back) failed.
    #[error("{what} {path}")]
    Handover {
        /// The step.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What the environment asks for; resolved by [`JailSettings::resolve`] (once: a jail found
/// is kept for the settings' lifetime, a failure is retried on the next call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailSettings {
    /// `Some(false)`: off; `Some(true)`: required; `None`: on when running as root.
    pub enabled: Option<bool>,
    /// The unprivileged user.
    pub user: String,
    /// The cgroup parent of the VM leaves (`$CHRYSALIS_VM_CGROUP`, see [`cgroup`]).
    pub cgroup_parent: Option<String>,
    resolved: Resolved,
}

/// The jail [`JailSettings::resolve`] found, shared by the settings' clones (a user lookup and
/// a `/proc/self/cgroup` parse per claim would sit on the claim path). Not part of equality.
#[derive(Debug, Clone, Default)]
struct Resolved(std::sync::Arc<std::sync::OnceLock<Option<Jail>>>);

impl PartialEq for Resolved {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Resolved {}

impl Default for JailSettings {
    fn default() -> Self {
        JailSettings::new(None, DEFAULT_USER, None)
    }
}

impl JailSettings {
    /// `CHRYSALIS_JAIL`, `CHRYSALIS_VM_USER`, `CHRYSALIS_VM_CGROUP`.
    pub fn from_env() -> Self {
        let var = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
        JailSettings::new(
            var(JAIL_ENV).map(|v| !matches!(v.as_str(), "0" | "off" | "false" | "no")),
            &var(USER_ENV).unwrap_or_else(|| DEFAULT_USER.into()),
            var(cgroup::PARENT_ENV),
        )
    }

    /// Settings from their parts (see the fields).
    pub fn new(enabled: Option<bool>, user: &str, cgroup_parent: Option<String>) -> Self {
        JailSettings { enabled, user: user.into(), cgroup_parent, resolved: Resolved::default() }
    }

    /// Sets the CPU weight of VM `vm`'s leaf (nothing when the jail is off).
    pub fn set_cpu_weight(&self, vm: &str, weight: CpuWeight) -> Result<(), JailError> {
        match self.resolve()? {
            Some(jail) => Ok(jail.cgroups.leaf_of(vm).set_cpu_weight(weight)?),
            None => Ok(()),
        }
    }

    /// The jail for this process: `None` when off (asked, or not root and not required).
    pub fn resolve(&self) -> Result<Option<Jail>, JailError> {
        if let Some(found) = self.resolved.0.get() {
            return Ok(found.clone());
        }
        let found = self.resolve_now()?;
        Ok(self.resolved.0.get_or_init(|| found).clone())
    }

    /// The cgroups of the resolved jail (`None` when it is off or does not resolve): where
    /// [`crate::lifecycle::Finder`] looks for a VM's processes.
    pub fn cgroups(&self) -> Option<&CgroupLayout> {
        let _ = self.resolve();
        self.resolved.0.get().and_then(Option::as_ref).map(|j| &j.cgroups)
    }

    fn resolve_now(&self) -> Result<Option<Jail>, JailError> {
        let root = rustix::process::geteuid().is_root();
        match (self.enabled, root) {
            (Some(false), _) => return Ok(None),
            (Some(true), false) => return Err(JailError::NotRoot),
            (None, false) => return Ok(None),
            _ => {}
        }
        let (uid, gid) = lookup_user(&self.user)?;
        if uid == 0 {
            return Err(JailError::RootUser { user: self.user.clone() });
        }
        let layout = CgroupLayout::detect(self.cgroup_parent.as_deref())?;
        Ok(Some(Jail { user: self.user.clone(), uid, gid, cgroups: layout }))
    }
}

/// `(uid, gid)` of `user`.
pub fn lookup_user(user: &str) -> Result<(u32, u32), JailError> {
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok((u.uid.as_raw(), u.gid.as_raw())),
        Ok(None) => Err(JailError::UserMissing { user: user.into() }),
        Err(e) => Err(JailError::Lookup { user: user.into(), source: e.into() }),
    }
}

/// A resolved jail: who the hypervisor runs as and where its cgroups go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jail {
    /// The user's name.
    pub user: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    /// The cgroup hierarchy and the parent of the VM leaves.
    pub cgroups: CgroupLayout,
}

impl Jail {
    /// Creates the VM's cgroup leaf with the limits of its size class.
    pub fn leaf(&self, vm: &str, size: SizeClass, accel: Accel) -> Result<Leaf, JailError> {
        Ok(self.cgroups.create_leaf(vm, &Limits::for_vm(size, accel))?)
    }

    /// Checks that the VM user can open `path` (read-only, or read-write if `write`), by the
    /// mode bits of the file and of every directory above it (POSIX ACLs are not consulted), as
    /// the user with its primary group only (the jail drops supplementary groups). For the
    /// hypervisors that open files by path (cloud-hypervisor): a failure names the path and
    /// the first directory in the way before anything is spawned.
    pub fn check_reach(&self, path: &Path, write: bool) -> Result<(), JailError> {
        let wanted = if write { "readable and writable" } else { "readable" };
        let fail = |why: String| JailError::Unreachable {
            user: self.user.clone(),
            uid: self.uid,
            gid: self.gid,
            path: path.to_path_buf(),
            wanted,
            why,
        };
        let real = std::fs::canonicalize(path).map_err(|e| fail(format!("resolving it: {e}")))?;
        for dir in real.ancestors().skip(1) {
            let m = std::fs::metadata(dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
            if !self.may(&m, 0o1) {
                return Err(fail(format!("{} (mode {:o}) cannot be searched", dir.display(), m.mode() & 0o7777)));
            }
        }
        let m = std::fs::metadata(&real).map_err(|e| fail(e.to_string()))?;
        if !self.may(&m, if write { 0o6 } else { 0o4 }) {
            return Err(fail(format!(
                "{} has mode {:o}, owner {}:{}",
                real.display(),
                m.mode() & 0o7777,
                m.uid(),
                m.gid()
            )));
        }
        Ok(())
    }

    /// Whether the mode bits of `m` grant the VM user every bit of `want` (`rwx` = `0o7`).
    fn may(&self, m: &std::fs::Metadata, want: u32) -> bool {
        let mode = m.mode();
        let bits = if m.uid() == self.uid {
            mode >> 6
        } else if m.gid() == self.gid {
            mode >> 3
        } else {
            mode
        };
        bits & want == want
    }

    /// Makes `path` (a file or directory the driver just created, in a directory the VM user
    /// cannot write) the VM user's, with `mode`. The descriptor is opened with `O_NOFOLLOW`, so
    /// a symbolic link is refused rather than followed.
    pub fn hand_over(&self, path: &Path, mode: u32) -> Result<(), JailError> {
        set_owner_mode(path, self.uid, self.gid, mode)
    }

    /// Makes `path` root's again, group the VM user's group, with `mode` (read access for the
    /// hypervisors that open it by path, nothing more).
    pub fn take_back(&self, path: &Path, mode: u32) -> Result<(), JailError> {
        set_owner_mode(path, 0, self.gid, mode)
    }
}

impl Jail {
    /// Takes back a directory the VM user wrote into (a cloud-hypervisor snapshot): first the
    /// directory becomes root's, group the VM group, 0750 (so the VM user can no longer add,
    /// remove or rename entries), then each entry: a regular file with one link owned by the VM
    /// user becomes root's, group the VM group, 0640 (a root-owned one with one link is left
    /// as it is). Anything else (a symbolic link, a directory, a FIFO, a file with more than
    /// one link, another user's file) is [`JailError::Unexpected`] and is not touched: a
    /// compromised hypervisor must not get root to change the owner or mode of a file it links
    /// there.
    pub fn take_back_dir(&self, dir: &Path) -> Result<(), JailError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        self.take_back(dir, 0o750)?;
        let reading = |source| JailError::Handover { what: "reading", path: dir.to_path_buf(), source };
        for entry in std::fs::read_dir(dir).map_err(reading)? {
            let path = entry.map_err(reading)?.path();
            let fail = |what, source| JailError::Handover { what, path: path.clone(), source };
            let unexpected = |why: &str| JailError::Unexpected { path: path.clone(), why: why.into() };
            let f = match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(unexpected("a symbolic link")),
                Err(e) => return Err(fail("opening", e)),
            };
            let m = f.metadata().map_err(|e| fail("reading the metadata of", e))?;
            if !m.is_file() {
                return Err(unexpected("not a regular file"));
            }
            if m.nlink() != 1 {
                return Err(unexpected("a file with more than one link"));
            }
            match m.uid() {
                0 => continue,
                uid if uid == self.uid => {}
                _ => return Err(unexpected("owned by another user")),
            }
            std::os::unix::fs::fchown(&f, Some(0), Some(self.gid)).map_err(|e| fail("changing the owner of", e))?;
            f.set_permissions(std::fs::Permissions::from_mode(0o640)).map_err(|e| fail("changing the mode of", e))?;
        }
        Ok(())
    }
}

/// `fchown` + `fchmod` on `path` opened with `O_NOFOLLOW` (a symbolic link fails with `ELOOP`)
/// and `O_NONBLOCK` (a FIFO cannot hang the open).
fn set_owner_mode(path: &Path, uid: u32, gid: u32, mode: u32) -> Result<(), JailError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let fail = |what, source| JailError::Handover { what, path: path.to_path_buf(), source };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| fail("opening", e))?;
    std::os::unix::fs::fchown(&f, Some(uid), Some(gid)).map_err(|e| fail("changing the owner of", e))?;
    f.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| fail("changing the mode of", e))
}

/// What the child does between fork and exec, prepared (allocated) before the fork.
#[derive(Debug, Default)]
pub struct SpawnPlan {
    /// Descriptors the child keeps across exec (the parent's copies stay close-on-exec, so
    /// no other child inherits them).
    pub inherit: Vec<RawFd>,
    /// A network namespace file to join (`setns(CLONE_NEWNET)`).
    pub netns: Option<RawFd>,
    /// `cgroup.procs` files to write `0` (this process) into.
    pub cgroup_procs: Vec<CString>,
    /// Switch to this `(uid, gid)` and drop every capability.
    pub ids: Option<(u32, u32)>,
    /// The spawning process: the child execs only while it is still its parent. A spawner
    /// killed between the fork and the exec leaves no hypervisor that nobody recorded (the
    /// child is in the VM's cgroup leaf before the check, so one that passed it is found).
    pub parent: u32,
}

impl SpawnPlan {
    /// The plan for a VM in `jail` (if any) with `leaf` (if any).
    pub fn new(jail: Option<&Jail>, leaf: Option<&Leaf>) -> Self {
        SpawnPlan {
            inherit: Vec::new(),
            netns: None,
            cgroup_procs: leaf.map(Leaf::procs_files).unwrap_or_default(),
            ids: jail.map(|j| (j.uid, j.gid)),
            parent: std::process::id(),
        }
    }

    /// Installs the plan on `cmd` (see the module docs): new session, netns, cgroup, inherited
    /// descriptors, then the user switch, no capabilities and no new privileges.
    ///
    /// The descriptors in the plan must stay open until `cmd` has been spawned.
    pub fn install(self, cmd: &mut tokio::process::Command) {
        // SAFETY: the closure runs in the forked child before exec. It only makes raw system
        // calls (setsid, setns, open/write/close, fcntl, prctl, setgroups, setresgid, setresuid)
        // on data allocated before the fork, and allocates nothing itself.
        unsafe {
            cmd.pre_exec(move || self.in_child());
        }
    }

    fn in_child(&self) -> std::io::Result<()> {
        let check = |r: libc::c_int| if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
        // SAFETY (whole function): raw system calls on integers and on C strings owned by
        // `self`, which outlives the call; nothing is allocated.
        unsafe {
            check(libc::setsid())?;
            if let Some(fd) = self.netns {
                check(libc::setns(fd, libc::CLONE_NEWNET))?;
            }
            for path in &self.cgroup_procs {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                check(fd)?;
                let w = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if w != 1 {
                    return Err(err);
                }
            }
            for &fd in &self.inherit {
                check(libc::fcntl(fd, libc::F_SETFD, 0))?;
            }
            if let Some((uid, gid)) = self.ids {
                // The bounding set first (needs CAP_SETPCAP, gone after the switch); capability
                // numbers past the kernel's last one fail with EINVAL, which ends the loop.
                for cap in 0..64 {
                    if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 {
                        break;
                    }
                }
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                // Leaving uid 0 for good clears the permitted, effective and ambient sets.
                check(libc::setresuid(uid, uid, uid))?;
            }
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            // Last: the spawner may have been killed while this child ran the steps above.
            if self.parent != 0 && libc::getppid() as u32 != self.parent {
                return Err(std::io::Error::from_raw_os_error(libc::ECHILD));
            }
        }
        Ok(())
    }
}

impl JailSettings {
    /// After a driver pruned the VMs `pruned`: removes their cgroup leaves, and the empty
    /// leaves older than `grace` of VMs whose directories are gone too (killed and removed
    /// outside a driver). Nothing to do when the jail is off.
    pub fn release_leaves(&self, pruned: &[crate::id::VmId], grace: std::time::Duration) {
        let Some(jail) = self.resolve().ok().flatten() else { return };
        for id in pruned {
            jail.cgroups.leaf_of(id.as_str()).remove();
        }
        jail.cgroups.sweep_empty(grace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child whose spawner is no longer its parent by the time it would exec (here: a plan
    /// naming another parent) fails instead of exec'ing; with its real parent it execs.
    #[tokio::test]
    async fn a_child_execs_only_under_its_spawner() {
        let spawn = |parent| {
            let mut cmd = tokio::process::Command::new("true");
            SpawnPlan { parent, ..SpawnPlan::default() }.install(&mut cmd);
            cmd.spawn()
        };
        let err = spawn(std::process::id() + 1).expect_err("another parent");
        assert_eq!(err.raw_os_error(), Some(libc::ECHILD), "{err}");
        let status = spawn(std::process::id()).expect("spawned").wait().await.expect("wait");
        assert!(status.success());
    }

    #[test]
    fn off_means_no_jail_and_a_missing_user_names_the_fix() {
        let off = JailSettings::new(Some(false), DEFAULT_USER, None);
        assert_eq!(off.resolve().expect("off"), None);
        let e = lookup_user("chrysalis-no-such-user").expect_err("missing");
        assert!(matches!(e, JailError::UserMissing { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("useradd --system") && msg.contains("cargo xtask prereqs"), "{msg}");
        assert!(msg.contains("CHRYSALIS_JAIL=0"), "{msg}");
        let required = JailSettings::new(Some(true), "chrysalis-no-such-user", None);
        let e = required.resolve().expect_err("required");
        if rustix::process::geteuid().is_root() {
            assert!(matches!(e, JailError::UserMissing { .. }), "{e:?}");
        } else {
            assert!(matches!(e, JailError::NotRoot), "{e:?}");
        }
    }

    #[test]
    fn root_is_no_vm_user() {
        let s = JailSettings::new(Some(true), "root", None);
        if rustix::process::geteuid().is_root() {
            assert!(matches!(s.resolve(), Err(JailError::RootUser { .. })));
        }
    }

    #[test]
    fn env_parsing() {
        // Only the pure part: what a value means.
        let s = JailSettings::default();
        assert_eq!(s.user, DEFAULT_USER);
        assert_eq!(s.enabled, None);
    }
}

//! OS plumbing shared by the process ops: the child environment, user switching, exit
//! codes, signals and random tokens.
//!
//! - Environment: every child starts from a cleared environment plus `PATH`, `TERM` and,
//!   on a lane without a NIC of its own, the proxy variables silkd itself was started with;
//!   `HOME`/`USER` are set only when a `user` is requested; the request's `env` goes last.
//! - Users: resolved from `/etc/passwd` (and `/etc/group` for supplementary groups) in the
//!   parent; the child calls `setgroups`, `setgid`, `setuid` between fork and exec.
//! - Exit codes follow the shell (and Docker) convention: a child killed by signal N
//!   reports `128 + N` (SIGKILL → 137).
//! - Every child is the leader of its own session and process group, so signals go to the
//!   whole group (a `bash -c 'sleep 100 & wait'` dies entirely).

use crate::error::OpError;
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Pid, Uid};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::OnceLock;

/// The `env` map of `exec`, `session_create` and `pty_open`.
pub type Env = BTreeMap<String, String>;

/// `PATH` of every child unless the request's `env` overrides it.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// `TERM` of every child unless the request's `env` overrides it.
pub const DEFAULT_TERM: &str = "xterm-256color";

/// Proxy variables forwarded from silkd's environment on a lane without its own NIC.
const PROXY_VARS: [&str; 6] = ["http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"];

/// A resolved `user`: who the child runs as.
#[derive(Debug, Clone)]
pub struct UserSpec {
    pub name: String,
    pub uid: Uid,
    pub gid: Gid,
    pub groups: Vec<Gid>,
    pub home: String,
    pub shell: String,
}

/// Resolves a user name from the passwd database; unknown → `bad_request`.
pub fn lookup_user(name: &str) -> Result<UserSpec, OpError> {
    let user = nix::unistd::User::from_name(name)
        .map_err(|e| OpError::internal(format!("user {name:?}: {e}")))?
        .ok_or_else(|| OpError::bad_request(format!("unknown user {name:?}")))?;
    let cname = CString::new(name).map_err(|_| OpError::bad_request(format!("invalid user name {name:?}")))?;
    let groups = nix::unistd::getgrouplist(&cname, user.gid).unwrap_or_else(|_| vec![user.gid]);
    Ok(UserSpec {
        name: user.name,
        uid: user.uid,
        gid: user.gid,
        groups,
        home: user.dir.to_string_lossy().into_owned(),
        shell: user.shell.to_string_lossy().into_owned(),
    })
}

/// The passwd entry of silkd's own user, if any (the login shell of a `pty_open` without `user`).
pub fn current_user() -> Option<UserSpec> {
    let user = nix::unistd::User::from_uid(Uid::current()).ok()??;
    Some(UserSpec {
        groups: vec![user.gid],
        name: user.name,
        uid: user.uid,
        gid: user.gid,
        home: user.dir.to_string_lossy().into_owned(),
        shell: user.shell.to_string_lossy().into_owned(),
    })
}

/// Whether this guest has a NIC of its own (`SILKD_NET=none|egress` overrides): only an
/// interface with a `/sys/class/net/*/device` counts.
pub fn has_nic() -> bool {
    static NIC: OnceLock<bool> = OnceLock::new();
    *NIC.get_or_init(|| match std::env::var("SILKD_NET").as_deref() {
        Ok("none") => false,
        Ok("egress") => true,
        _ => std::fs::read_dir("/sys/class/net")
            .map(|dir| dir.flatten().any(|e| e.path().join("device").exists()))
            .unwrap_or(false),
    })
}

/// The environment a child starts from: `PATH`, `TERM`, proxy variables (no-NIC lane),
/// `HOME`/`USER` with a user, then the request's `env`.
pub fn child_env(user: Option<&UserSpec>, env: Option<&BTreeMap<String, String>>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    out.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    out.insert("TERM".to_string(), DEFAULT_TERM.to_string());
    if !has_nic() {
        for key in PROXY_VARS {
            if let Ok(v) = std::env::var(key) {
                if !v.is_empty() {
                    out.insert(key.to_string(), v);
                }
            }
        }
    }
    if let Some(user) = user {
        out.insert("HOME".to_string(), user.home.clone());
        out.insert("USER".to_string(), user.name.clone());
    }
    if let Some(env) = env {
        for (k, v) in env {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// Rejects environment entries `execve` cannot carry.
pub fn check_env(env: Option<&BTreeMap<String, String>>) -> Result<(), OpError> {
    for (k, v) in env.into_iter().flatten() {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(OpError::bad_request(format!("invalid env entry {k:?}")));
        }
    }
    Ok(())
}

/// How a child is set up between fork and exec.
#[derive(Debug, Clone, Default)]
pub struct ChildSetup {
    /// Switch to this user (needs root).
    pub user: Option<(Uid, Gid, Vec<Gid>)>,
    /// Make fd 0 (a pty slave) the controlling terminal.
    pub controlling_tty: bool,
}

/// Installs `setup` on `cmd`: the child becomes a session (and process group) leader,
/// optionally takes fd 0 as its controlling terminal, then drops to the user.
pub fn apply_setup(cmd: &mut tokio::process::Command, setup: ChildSetup) {
    // SAFETY: the closure runs in the forked child before exec and only makes raw
    // syscalls through rustix/nix (setsid, ioctl, setgroups, setgid, setuid) on data
    // prepared in the parent; it allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::setsid().map_err(std::io::Error::from)?;
            if setup.controlling_tty {
                // fd 0 is the pty slave std installed as the child's stdin.
                let stdin = std::os::fd::BorrowedFd::borrow_raw(0);
                rustix::process::ioctl_tiocsctty(stdin).map_err(std::io::Error::from)?;
            }
            if let Some((uid, gid, groups)) = &setup.user {
                nix::unistd::setgroups(groups).map_err(std::io::Error::from)?;
                nix::unistd::setgid(*gid).map_err(std::io::Error::from)?;
                nix::unistd::setuid(*uid).map_err(std::io::Error::from)?;
            }
            Ok(())
        });
    }
}

/// The exit code of a wait status: the code, or `128 + signal` for a signal death.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => -1,
    }
}

/// Parses a signal number of a `kill` request.
pub fn parse_signal(signal: Option<i32>) -> Result<Signal, OpError> {
    match signal {
        None | Some(0) => Ok(Signal::SIGKILL),
        Some(n) => Signal::try_from(n).map_err(|_| OpError::bad_request(format!("invalid signal {n}"))),
    }
}

/// Signals the process group led by `pid` (every child leads its own), falling back to the
/// process itself. Never signals silkd's own group (pid 0) or a negative pid.
pub fn signal_group(pid: u32, sig: Signal) -> Result<(), nix::Error> {
    let Ok(raw) = i32::try_from(pid) else { return Err(nix::Error::ESRCH) };
    if raw <= 1 {
        return Err(nix::Error::ESRCH);
    }
    match nix::sys::signal::killpg(Pid::from_raw(raw), sig) {
        Ok(()) => Ok(()),
        Err(_) => nix::sys::signal::kill(Pid::from_raw(raw), sig),
    }
}

/// 128 bits from the OS RNG, as hex: unguessable by the commands silkd runs.
pub fn random_token() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Seconds since the Unix epoch.
pub fn epoch_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The first existing shell of `candidates`, else `/bin/sh`.
pub fn pick_shell<'a>(candidates: impl IntoIterator<Item = &'a str>) -> String {
    candidates.into_iter().find(|p| !p.is_empty() && std::path::Path::new(p).is_file()).unwrap_or("/bin/sh").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_deaths_map_to_128_plus_signal() {
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
    }

    #[test]
    fn env_is_cleared_to_path_term_and_request() {
        let mut req = BTreeMap::new();
        req.insert("A".to_string(), "1".to_string());
        req.insert("TERM".to_string(), "dumb".to_string());
        let env = child_env(None, Some(&req));
        assert_eq!(env.get("PATH").map(String::as_str), Some(DEFAULT_PATH));
        assert_eq!(env.get("TERM").map(String::as_str), Some("dumb"));
        assert_eq!(env.get("A").map(String::as_str), Some("1"));
        assert!(!env.contains_key("HOME"));
        assert!(!env.contains_key("USER"));
    }

    #[test]
    fn signals_are_validated() {
        assert_eq!(parse_signal(None), Ok(Signal::SIGKILL));
        assert_eq!(parse_signal(Some(15)), Ok(Signal::SIGTERM));
        assert!(parse_signal(Some(999)).is_err());
    }

    #[test]
    fn tokens_are_unique_hex() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}

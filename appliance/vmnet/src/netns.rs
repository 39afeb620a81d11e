//! Running code inside a named network namespace.
//!
//! A network namespace is per thread: [`run_in`] opens `/run/netns/<name>`, starts a dedicated
//! thread that joins it (`setns(CLONE_NEWNET)`), runs the given future there on its own
//! current-thread tokio runtime, and hands the result back. Sockets (netlink, TCP) and TAP devices
//! created on that thread belong to the namespace; the caller's threads never change namespace.
//! `None` runs the same way in the caller's own namespace.

use std::fs::File;
use std::future::Future;
use std::path::PathBuf;

use nix::sched::CloneFlags;

use crate::VmnetError;

/// Where `ip netns` keeps named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// The file of the named namespace `name`.
pub fn netns_path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

fn open(name: &str) -> Result<File, VmnetError> {
    if !crate::config::valid_netns_name(name) {
        return Err(VmnetError::Config(format!("netns name {name:?} is not a plain name under {NETNS_DIR}")));
    }
    File::open(netns_path(name)).map_err(|source| VmnetError::Netns { name: name.into(), what: "opening", source })
}

/// Runs `f()` to completion on a fresh thread inside `netns` (or the caller's namespace for
/// `None`), with a current-thread tokio runtime, and returns its result.
pub async fn run_in<F, Fut, T>(netns: Option<&str>, f: F) -> Result<T, VmnetError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, VmnetError>>,
    T: Send + 'static,
{
    let ns = netns.map(|n| open(n).map(|f| (n.to_string(), f))).transpose()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("vmnet-netns".into())
        .spawn(move || {
            let _ = tx.send(run_here(ns, f));
        })
        .map_err(|e| VmnetError::Worker(format!("spawning a thread: {e}")))?;
    rx.await.map_err(|_| VmnetError::Worker("the namespace thread died (panicked?)".into()))?
}

/// [`run_in`] for synchronous callers (blocks the calling thread until done).
pub fn run_in_blocking<F, Fut, T>(netns: Option<&str>, f: F) -> Result<T, VmnetError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, VmnetError>>,
    T: Send + 'static,
{
    let ns = netns.map(|n| open(n).map(|f| (n.to_string(), f))).transpose()?;
    std::thread::Builder::new()
        .name("vmnet-netns".into())
        .spawn(move || run_here(ns, f))
        .map_err(|e| VmnetError::Worker(format!("spawning a thread: {e}")))?
        .join()
        .map_err(|_| VmnetError::Worker("the namespace thread panicked".into()))?
}

fn run_here<F, Fut, T>(ns: Option<(String, File)>, f: F) -> Result<T, VmnetError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, VmnetError>>,
{
    if let Some((name, file)) = ns {
        nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).map_err(|errno| VmnetError::Netns {
            name,
            what: "setns",
            source: errno.into(),
        })?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| VmnetError::Worker(format!("building a runtime: {e}")))?;
    rt.block_on(f())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_in_own_namespace_without_name() {
        let v = run_in(None, || async { Ok::<_, VmnetError>(41 + 1) }).await.expect("run");
        assert_eq!(v, 42);
        let e = run_in(None, || async { Err::<(), _>(VmnetError::Config("boom".into())) }).await;
        assert!(matches!(e, Err(VmnetError::Config(m)) if m == "boom"));
    }

    #[tokio::test]
    async fn bad_or_missing_namespace_names_fail() {
        assert!(matches!(run_in(Some("../x"), || async { Ok(()) }).await, Err(VmnetError::Config(_))));
        let missing = format!("vmnet-missing-{}", std::process::id());
        assert!(matches!(
            run_in(Some(&missing), || async { Ok(()) }).await,
            Err(VmnetError::Netns { what: "opening", .. })
        ));
        assert!(run_in_blocking(Some(&missing), || async { Ok(()) }).is_err());
    }
}

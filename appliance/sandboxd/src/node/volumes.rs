//! Volumes of a sandbox (`GET/PUT/PATCH …/volumes`, `volumes` in a claim): the desired set
//! is validated whole, then converged within the request — volumes leaving are unmounted by
//! the guest agent and unplugged, volumes arriving are hot-plugged and mounted — journaling
//! the held set after every step, so a crash never loses track of a plugged disk.
//!
//! Rules: a name must be in the catalog (`404`); at most [`vmm::MAX_VOLUMES`] per sandbox and
//! no name twice (`400`); `rw` is exclusive (another holder, either way, is a `409`); a
//! hibernated sandbox wakes first. A sandbox that holds volumes cannot be forked,
//! checkpointed, promoted or hibernated (its snapshot could not be restored without them).

use std::collections::{BTreeMap, HashSet};

use sandboxd_api::{SandboxVolumes, VolumeSpec, VolumeState};
use silkd_client::AgentConn;
use vmm::{Vm, VolumeAttach, MAX_VOLUMES};

use super::{HibernateError, Node};
use crate::journal::HeldVolume;
use crate::volumes::{valid_name, CatalogError};

/// Why a volume request was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// No such sandbox.
    #[error("sandbox not found")]
    NotFound,
    /// The request is malformed.
    #[error("{0}")]
    Invalid(String),
    /// A volume is not in the catalog.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// Another sandbox holds it in a conflicting mode.
    #[error("volume {name:?} is held {how} by sandbox {holder}; rw is exclusive")]
    Conflict {
        /// The volume.
        name: String,
        /// `rw` or `ro`.
        how: &'static str,
        /// The other sandbox.
        holder: String,
    },
    /// Waking the sandbox failed.
    #[error("waking the sandbox")]
    Wake(#[source] Box<HibernateError>),
    /// Plugging, mounting, unmounting or unplugging failed.
    #[error("volume {name:?}: {what}")]
    Apply {
        /// The volume.
        name: String,
        /// The step.
        what: String,
    },
    /// The held set could not be journaled.
    #[error("journaling the held volumes")]
    Journal(#[source] crate::journal::JournalError),
}

/// How long a release waits for the guest to unmount its volumes.
pub const RELEASE_UNMOUNT: std::time::Duration = std::time::Duration::from_secs(5);

/// The default guest mount point of `name`.
pub fn default_mount(name: &str) -> String {
    format!("/mnt/{name}")
}

/// What a request asks for, checked: `(name, mount or None for attach-only, rw)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Want {
    name: String,
    mount: Option<String>,
    rw: bool,
}

fn check(want: &[VolumeSpec], attach_only: bool) -> Result<Vec<Want>, VolumeError> {
    if want.len() > usize::from(MAX_VOLUMES) {
        return Err(VolumeError::Invalid(format!(
            "{} volumes asked for; a sandbox holds at most {MAX_VOLUMES}",
            want.len()
        )));
    }
    let mut seen = HashSet::new();
    want.iter()
        .map(|v| {
            if !valid_name(&v.name) {
                return Err(CatalogError::BadName(v.name.clone()).into());
            }
            if !seen.insert(v.name.as_str()) {
                return Err(VolumeError::Invalid(format!("volume {:?} is listed twice", v.name)));
            }
            let rw = match v.mode.as_deref() {
                None | Some("") | Some("ro") => false,
                Some("rw") => true,
                Some(m) => return Err(VolumeError::Invalid(format!("volume {:?}: mode {m:?}: want rw or ro", v.name))),
            };
            let mount = match (&v.mount, attach_only) {
                (Some(m), _) if !m.starts_with('/') || m == "/" || m.split('/').any(|c| c == "..") => {
                    return Err(VolumeError::Invalid(format!(
                        "volume {:?}: mount point {m:?} must be an absolute path below /, without ..",
                        v.name
                    )))
                }
                (Some(m), _) => Some(m.clone()),
                (None, true) => None,
                (None, false) => Some(default_mount(&v.name)),
            };
            Ok(Want { name: v.name.clone(), mount, rw })
        })
        .collect()
}

impl Node {
    /// The view of claim `id`'s volumes, `want` being what the last request asked for.
    pub fn volume_view(
        &self,
        id: &str,
        want: Option<&[VolumeSpec]>,
        failed: &BTreeMap<String, String>,
    ) -> SandboxVolumes {
        let held: Vec<HeldVolume> = self.sandbox(id).map(|c| c.rec.volumes).unwrap_or_default();
        let volumes: Vec<VolumeSpec> = held.iter().map(HeldVolume::spec).collect();
        let volumes_want = want.map(<[VolumeSpec]>::to_vec).unwrap_or_else(|| volumes.clone());
        let mut states: Vec<VolumeState> =
            held.iter().map(|h| VolumeState { name: h.name.clone(), state: "attached".into(), error: None }).collect();
        for w in &volumes_want {
            if !held.iter().any(|h| h.name == w.name) {
                states.push(VolumeState {
                    name: w.name.clone(),
                    state: "pending".into(),
                    error: failed.get(&w.name).cloned(),
                });
            }
        }
        SandboxVolumes { volumes_want, volumes, states, converging: false, error: None }
    }

    /// `PATCH`: the held set plus `add` (replacing same-named entries) minus `remove`.
    pub fn patched(&self, id: &str, add: Vec<VolumeSpec>, remove: Vec<String>) -> Result<Vec<VolumeSpec>, VolumeError> {
        let claim = self.sandbox(id).ok_or(VolumeError::NotFound)?;
        let mut set: Vec<VolumeSpec> = claim.rec.volumes.iter().map(HeldVolume::spec).collect();
        set.retain(|v| !remove.contains(&v.name) && !add.iter().any(|a| a.name == v.name));
        set.extend(add);
        Ok(set)
    }

    /// Checks a request without touching any sandbox: well-formed, every name in the catalog.
    /// A claim runs it before it takes a VM.
    pub fn check_volumes(&self, want: &[VolumeSpec], attach_only: bool) -> Result<(), VolumeError> {
        for w in check(want, attach_only)? {
            self.volume_catalog.path(&w.name)?;
        }
        Ok(())
    }

    /// Converges claim `id` to `want`. On an error, `failed` names the volumes that did not
    /// attach; what did is journaled either way.
    pub async fn set_volumes(
        &self,
        id: &str,
        want: &[VolumeSpec],
        attach_only: bool,
        failed: &mut BTreeMap<String, String>,
    ) -> Result<(), VolumeError> {
        let want = check(want, attach_only)?;
        let paths = want
            .iter()
            .map(|w| Ok((w.name.clone(), self.volume_catalog.path(&w.name)?)))
            .collect::<Result<BTreeMap<_, _>, VolumeError>>()?;
        // A hibernated sandbox wakes first (the wake takes the transition lock itself).
        if self.sandbox(id).ok_or(VolumeError::NotFound)?.rec.hibernate_snap.is_some() {
            self.wake(id).await.map_err(|e| VolumeError::Wake(Box::new(e)))?;
        }
        let lock = self.transition(id);
        let _t = lock.lock().await;
        // No snapshot of any sandbox runs while a disk comes or goes.
        let _s = self.snapshots.lock().await;
        let claim = self.sandbox(id).ok_or(VolumeError::NotFound)?;
        self.exclusive(id, &want)?;
        let same = |h: &HeldVolume, w: &Want| h.name == w.name && h.mount == w.mount && h.rw == w.rw;
        let leaving: Vec<HeldVolume> =
            claim.rec.volumes.iter().filter(|h| !want.iter().any(|w| same(h, w))).cloned().collect();
        let arriving: Vec<&Want> = want.iter().filter(|w| !claim.rec.volumes.iter().any(|h| same(h, w))).collect();
        if leaving.is_empty() && arriving.is_empty() {
            return Ok(());
        }
        let vm = self.vm_for(&claim).await.map_err(|e| apply_err("-", "finding the VM", &e))?;
        self.converge(id, &vm, &leaving, &arriving, &paths, failed).await
    }

    /// `rw` is exclusive: refuses `want` if another sandbox holds a wanted volume in a
    /// conflicting mode.
    fn exclusive(&self, id: &str, want: &[Want]) -> Result<(), VolumeError> {
        let table = self.store.lock();
        for c in table.iter().filter(|c| c.rec.id != id) {
            for h in &c.rec.volumes {
                if let Some(w) = want.iter().find(|w| w.name == h.name) {
                    if w.rw || h.rw {
                        let how = if h.rw { "rw" } else { "ro" };
                        return Err(VolumeError::Conflict { name: h.name.clone(), how, holder: c.rec.id.clone() });
                    }
                }
            }
        }
        Ok(())
    }

    async fn converge(
        &self,
        id: &str,
        vm: &Vm,
        leaving: &[HeldVolume],
        arriving: &[&Want],
        paths: &BTreeMap<String, std::path::PathBuf>,
        failed: &mut BTreeMap<String, String>,
    ) -> Result<(), VolumeError> {
        let span = tracing::info_span!("volumes", claim = %id, vm = %vm.id);
        let _e = span.enter();
        for h in leaving {
            // The guest lets go first; an unreachable guest does not keep the disk plugged.
            match self.agent(vm).await {
                Ok(mut a) => {
                    if let Err(e) = a.volume_unmount(&h.name, h.slot).await {
                        tracing::warn!(volume = %h.name, error = %vmm::error_chain(&e), "guest unmount failed; unplugging anyway");
                    }
                }
                Err(e) => {
                    tracing::warn!(volume = %h.name, error = %vmm::error_chain(&e), "guest agent unreachable; unplugging anyway")
                }
            }
            if let Err(e) = self.vms.driver.detach_volume(vm, h.slot).await {
                crate::metrics::inc(&self.metrics.volume_failures);
                return Err(apply_err(&h.name, "unplugging", &e));
            }
            self.journal_volumes(id, |held| held.retain(|x| x.slot != h.slot))?;
            crate::metrics::inc(&self.metrics.volume_detaches);
            tracing::info!(volume = %h.name, slot = h.slot, "volume detached");
        }
        let mut first_err = None;
        for w in arriving {
            let held = self.sandbox(id).map(|c| c.rec.volumes).unwrap_or_default();
            let Some(slot) = (1..=MAX_VOLUMES).find(|s| !held.iter().any(|h| h.slot == *s)) else {
                failed.insert(w.name.clone(), "no free slot".into());
                continue;
            };
            let attach = VolumeAttach { slot, path: paths[&w.name].clone(), read_only: !w.rw };
            let r = async {
                self.vms.driver.attach_volume(vm, &attach).await.map_err(|e| apply_err(&w.name, "plugging", &e))?;
                let mounted = async {
                    let mut a = self.agent(vm).await.map_err(|e| apply_err(&w.name, "reaching the guest agent", &e))?;
                    a.volume_mount(&w.name, slot, w.mount.as_deref(), !w.rw)
                        .await
                        .map_err(|e| apply_err(&w.name, "mounting in the guest", &e))
                }
                .await;
                if mounted.is_err() {
                    let _ = self.vms.driver.detach_volume(vm, slot).await;
                }
                mounted
            }
            .await;
            match r {
                Ok(()) => {
                    let h = HeldVolume { name: w.name.clone(), slot, mount: w.mount.clone(), rw: w.rw };
                    self.journal_volumes(id, |held| held.push(h))?;
                    crate::metrics::inc(&self.metrics.volume_attaches);
                    tracing::info!(volume = %w.name, slot, rw = w.rw, mount = ?w.mount, "volume attached");
                }
                Err(e) => {
                    tracing::warn!(error = %vmm::error_chain(&e), "volume not attached");
                    crate::metrics::inc(&self.metrics.volume_failures);
                    failed.insert(w.name.clone(), vmm::error_chain(&e));
                    first_err = first_err.or(Some(e));
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Before a sandbox's VM is destroyed: the guest unmounts its volumes, so a disk another
    /// sandbox mounts next is clean. Bounded by [`RELEASE_UNMOUNT`]; a guest that does not
    /// answer only leaves a journal the next holder replays.
    pub(crate) async fn unmount_all(&self, claim: &crate::claims::Claim) {
        let Some(vm) = claim.vm.as_ref().filter(|_| !claim.rec.volumes.is_empty()) else { return };
        let work = async {
            let mut a = self.agent(vm).await.map_err(|e| vmm::error_chain(&e))?;
            for h in &claim.rec.volumes {
                a.volume_unmount(&h.name, h.slot).await.map_err(|e| vmm::error_chain(&e))?;
            }
            Ok::<(), String>(())
        };
        match tokio::time::timeout(RELEASE_UNMOUNT, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(claim = %claim.rec.id, error = %e, "unmounting volumes before release failed"),
            Err(_) => tracing::warn!(claim = %claim.rec.id, "unmounting volumes before release timed out"),
        }
    }

    async fn agent(&self, vm: &Vm) -> Result<AgentConn<vmm::AgentStream>, vmm::DriverError> {
        Ok(AgentConn::new(self.vms.driver.connect(vm, vmm::AGENT_PORT).await?))
    }

    fn journal_volumes(&self, id: &str, change: impl FnOnce(&mut Vec<HeldVolume>)) -> Result<(), VolumeError> {
        let gen = self.store.lock().update(id, None, |r| change(&mut r.volumes)).ok_or(VolumeError::NotFound)?;
        self.store.commit(gen).map_err(VolumeError::Journal)
    }

    /// `GET /v1/volumes`: the catalog with who holds what.
    pub fn volume_catalog(&self) -> Result<sandboxd_api::VolumeCatalog, CatalogError> {
        let mut holders: BTreeMap<String, (u32, bool)> = BTreeMap::new();
        for c in self.store.lock().iter() {
            for h in &c.rec.volumes {
                let e = holders.entry(h.name.clone()).or_default();
                e.0 += 1;
                e.1 |= h.rw;
            }
        }
        let volumes = self
            .volume_catalog
            .list()?
            .into_iter()
            .map(|(name, size_bytes)| {
                let (holders, held_rw) = holders.get(&name).copied().unwrap_or_default();
                sandboxd_api::CatalogVolume { name, size_bytes, holders, held_rw }
            })
            .collect();
        Ok(sandboxd_api::VolumeCatalog { volumes })
    }
}

fn apply_err(name: &str, what: &str, e: &dyn std::error::Error) -> VolumeError {
    VolumeError::Apply { name: name.to_string(), what: format!("{what}: {}", vmm::error_chain(e)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, mount: Option<&str>, mode: Option<&str>) -> VolumeSpec {
        VolumeSpec { name: name.into(), mount: mount.map(Into::into), mode: mode.map(Into::into) }
    }

    #[test]
    fn requests_are_checked_whole() {
        let w = check(&[spec("a", None, None), spec("b", Some("/data"), Some("rw"))], false).expect("ok");
        assert_eq!(w[0], Want { name: "a".into(), mount: Some("/mnt/a".into()), rw: false });
        assert_eq!(w[1], Want { name: "b".into(), mount: Some("/data".into()), rw: true });
        let w = check(&[spec("a", None, Some("ro"))], true).expect("attach only");
        assert_eq!(w[0].mount, None);
        for (bad, why) in [
            (vec![spec("a", None, None), spec("a", None, None)], "twice"),
            (vec![spec("a", None, Some("wx"))], "mode"),
            (vec![spec("a", Some("rel"), None)], "absolute"),
            (vec![spec("a", Some("/x/../etc"), None)], "absolute"),
            (vec![spec("../a", None, None)], "name"),
        ] {
            let e = check(&bad, false).expect_err(why).to_string();
            assert!(e.contains(why) || e.contains("volume name"), "{why}: {e}");
        }
        let many: Vec<_> = (0..=MAX_VOLUMES).map(|i| spec(&format!("v{i}"), None, None)).collect();
        assert!(check(&many, false).expect_err("too many").to_string().contains("at most"));
    }
}

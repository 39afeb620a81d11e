//! The Pod contract's keys (cocoon-common, `docs/virtual-node.md` §3.3; `docs/runtime-backends.md`):
//! what a Pod asks vk-cocoon for, parsed into a typed [`VmSpec`], and the keys vk-cocoon writes
//! back. Parsing is pure; every refusal names the annotation and what to change.
//!
//! Rules: booleans are true only for the literal `"true"`; an empty value is the same as an
//! absent one. Keys this node cannot serve (other guest OSes, `static` mode, `clone-from-dir`)
//! are refused with [`AnnotationError::Unsupported`], naming what is missing, rather than
//! ignored, since ignoring them would boot something other than what the Pod asked for.
//! The VM name and a `fork-from` source must also be names the image library accepts for the
//! snapshots the VM gets (`<name>:hibernate`, `<name>:latest`, `fork-<name>:latest`, checked
//! with `images::Reference::parse`): lowercase `[a-z0-9._-]`, starting with a letter or digit, a
//! fork source at most 250 characters ([`AnnotationError::StoreName`]). [`vm_name`] alone stays
//! lenient, so that a delete still finds a VM named before this rule.
//! `force-pull`, `generation`, `hibernated-on-node`, `conn-type` and `no-direct-io` are
//! accepted and have no effect here. The VM sources `restore-from-hibernate` and `fork-from`,
//! and `hibernate`, are served by [`crate::provider`] (a Firecracker `backend` runs under the
//! node's hypervisor).

use std::collections::BTreeMap;
use std::net::IpAddr;

use foundation::quantity::{self, QuantityError};
use k8s_openapi::api::core::v1::Pod;

use crate::backend::{Hypervisor, SnapshotRef, SnapshotRefError};

// ---- cocoonset.cocoonstack.io/… (operator → provider)
/// `"true"`: vk-cocoon owns the VM's lifecycle.
pub const MANAGED: &str = "cocoonset.cocoonstack.io/managed";
/// `run` | `clone` (default).
pub const MODE: &str = "cocoonset.cocoonstack.io/mode";
/// `run`: the image; `clone`: the snapshot `repo[:tag]` (bare repo = `latest`).
pub const IMAGE: &str = "cocoonset.cocoonstack.io/image";
/// `linux` (default) | `windows` | `android` | `macos`.
pub const OS: &str = "cocoonset.cocoonstack.io/os";
/// Writable disk size, a quantity.
pub const STORAGE: &str = "cocoonset.cocoonstack.io/storage";
/// Network name: absent or `default` = no route out; `egress` = outbound through the node's
/// uplink (NAT, private and link-local destinations refused; the node needs `VK_NET_UPLINK`).
pub const NETWORK: &str = "cocoonset.cocoonstack.io/network";
/// `always` (default) | `main-only` | `never`.
pub const SNAPSHOT_POLICY: &str = "cocoonset.cocoonstack.io/snapshot-policy";
/// Accepted, no effect here (images are local).
pub const FORCE_PULL: &str = "cocoonset.cocoonstack.io/force-pull";
/// Label: `main` | `sub-agent` | `toolbox`.
pub const ROLE: &str = "cocoonset.cocoonstack.io/role";
/// The CocoonSet owner kind (role from the slot in the VM name when no role label).
pub const COCOONSET_KIND: &str = "CocoonSet";

// ---- vm.cocoonstack.io/…
/// **Required**: the VM's name on the node.
pub const VM_NAME: &str = "vm.cocoonstack.io/name";
/// The longest VM name: upstream's conventions (`vk-<ns>-<pod>`, `sandbox-<ns>-<name>`) pass 63
/// easily. 255 is the image library's repository limit (a delete saves `<vm-name>:latest`).
/// The VM's id, and so its directory and hypervisor names, is a short stable form of it
/// (`vmm_backend::vm_id_for`: a readable head and a hash); the record keeps the full name, and
/// two names of one id are refused (`NameInUse`), never mixed up.
pub const MAX_VM_NAME: usize = 255;
/// In (unmanaged, required) and out: the VM id.
pub const VM_ID: &str = "vm.cocoonstack.io/id";
/// In (unmanaged, required) and out: the VM IP.
pub const VM_IP: &str = "vm.cocoonstack.io/ip";
/// `cloud-hypervisor` | `firecracker` | `qemu` (default: the first the host runs); one the node
/// lacks is served by the node's own ([`RequestedBackend`]).
pub const BACKEND: &str = "vm.cocoonstack.io/backend";
/// TCP port the readiness probe dials; absent = a guest-agent round trip.
pub const PROBE_PORT: &str = "vm.cocoonstack.io/probe-port";
/// `"true"`: DeletePod leaves the VM's snapshots in the library.
pub const KEEP_SNAPSHOT_ON_DELETE: &str = "vm.cocoonstack.io/keep-snapshot-on-delete";
/// A shared network group: VMs of Pods of the same namespace carrying the same group may talk
/// to each other; without it a VM talks to no other VM. `[a-z0-9-]`, 1-63 characters.
pub const SHARED_NETWORK: &str = "vm.cocoonstack.io/shared-network";
/// `"true"`: hibernate the VM (saved as `<vm-name>:hibernate`, stopped, address kept); back
/// to anything else (or removed): wake it.
pub const HIBERNATE: &str = "vm.cocoonstack.io/hibernate";
/// VM sources: fork a running VM of this namespace by its name (served), a snapshot
/// directory on the host (refused), the VM's own hibernation snapshot (served).
pub const FORK_FROM: &str = "vm.cocoonstack.io/fork-from";
pub const CLONE_FROM_DIR: &str = "vm.cocoonstack.io/clone-from-dir";
pub const RESTORE_FROM_HIBERNATE: &str = "vm.cocoonstack.io/restore-from-hibernate";
/// Out: `creating` | `ready` | `hibernating` | `hibernated` | `failed`.
pub const LIFECYCLE_STATE: &str = "vm.cocoonstack.io/lifecycle-state";
/// Out: why the lifecycle state is what it is (removed when there is nothing to say).
pub const LIFECYCLE_MESSAGE: &str = "vm.cocoonstack.io/lifecycle-state-message";
/// Out: base64 of the guest command that applies the clone's network by hand.
pub const POST_CLONE_HINT: &str = "vm.cocoonstack.io/post-clone-hint";

// ---- node selector keys
/// The node's CPU class for snapshots (a Pod selecting another class is refused).
pub const CPU_CLASS_LABEL: &str = "cocoonstack.io/snapshot-cpu-class";
/// The node's pool.
pub const POOL_LABEL: &str = "cocoonstack.io/pool";

/// How a managed VM comes to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Boot `image` fresh.
    Run,
    /// Restore the snapshot `image` (the default).
    Clone,
}

/// Which deletions save a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotPolicy {
    Always,
    MainOnly,
    Never,
}

/// A pre-assigned VM of an unmanaged Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preassigned {
    pub id: String,
    pub ip: String,
}

/// Everything a Pod asks for, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    /// `vm.cocoonstack.io/name`.
    pub vm_name: String,
    /// `managed == "true"`.
    pub managed: bool,
    /// Unmanaged Pods: the VM someone else runs.
    pub preassigned: Option<Preassigned>,
    pub mode: Mode,
    /// Managed: the image (`run`) or the snapshot (`clone`) source, as written.
    pub image: Option<String>,
    /// `clone`: the parsed snapshot reference.
    pub snapshot: Option<SnapshotRef>,
    pub storage_bytes: Option<u64>,
    pub network: Option<String>,
    /// `vm.cocoonstack.io/shared-network` (scoped by the Pod's namespace by the provider).
    pub shared_network: Option<String>,
    pub snapshot_policy: SnapshotPolicy,
    pub probe_port: Option<u16>,
    /// `vm.cocoonstack.io/backend`; `None` = the host's default hypervisor.
    pub backend: Option<RequestedBackend>,
    pub keep_snapshot_on_delete: bool,
    pub hibernate: bool,
    /// `restore-from-hibernate: "true"`: boot from `<vm-name>:hibernate` (a wake at create).
    pub restore_from_hibernate: bool,
    /// `fork-from`: the VM name of a running VM of this namespace to fork (its snapshot
    /// `fork-<name>` is saved once and cloned).
    pub fork_from: Option<String>,
}

/// The hypervisor a Pod asks for in `vm.cocoonstack.io/backend`, spelled as cocoon-common
/// writes it: its `Backend` type knows `cloud-hypervisor` (what `Backend.Default()` puts into
/// every CocoonSet Pod) and `firecracker`; we add `qemu`. A node serves the one it runs when it
/// has it, else its own (the provider says so with a Normal `BackendSubstituted` event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestedBackend {
    CloudHypervisor,
    Firecracker,
    Qemu,
}

impl RequestedBackend {
    /// The annotation spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestedBackend::CloudHypervisor => "cloud-hypervisor",
            RequestedBackend::Firecracker => "firecracker",
            RequestedBackend::Qemu => "qemu",
        }
    }

    /// The hypervisor of ours that is this backend (none runs Firecracker).
    pub fn hypervisor(self) -> Option<Hypervisor> {
        match self {
            RequestedBackend::CloudHypervisor => Some(Hypervisor::CloudHypervisor),
            RequestedBackend::Firecracker => None,
            RequestedBackend::Qemu => Some(Hypervisor::Qemu),
        }
    }
}

/// Why a Pod's annotations cannot be served. The text becomes the Pod's `ProviderFailed`
/// message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    #[error("annotation {VM_NAME} is missing: name the VM this pod runs in (e.g. vk-<namespace>-<pod>)")]
    MissingVmName,
    #[error("annotation {VM_NAME}={0:?} is not a usable VM name (1-255 characters, no whitespace or '/')")]
    BadVmName(String),
    /// A name the image library would refuse for a snapshot the VM gets (`<vm-name>:hibernate`,
    /// `<vm-name>:latest`, `fork-<vm-name>:latest`): checked here, not at the first hibernate,
    /// delete or fork.
    #[error(
        "annotation {key}={name:?} cannot name the VM's snapshots ({snapshot}): the image library's rule is that a \
         repository is 1-255 characters of [a-z0-9._-] starting with a letter or digit (a fork adds 'fork-', so a \
         fork source is at most 250)",
        snapshot = .source.reference
    )]
    StoreName {
        key: &'static str,
        name: String,
        /// The refusal, naming the snapshot reference checked.
        #[source]
        source: Box<images::reference::BadRef>,
    },
    #[error(
        "an unmanaged pod ({MANAGED} is not \"true\") must carry the pre-assigned {VM_ID} and {VM_IP}; missing: {0}"
    )]
    UnmanagedWithoutVm(&'static str),
    #[error("annotation {VM_IP}={0:?} is not an IP address")]
    BadIp(String),
    #[error("annotation {MODE}={0:?}: expected run or clone")]
    BadMode(String),
    #[error("annotation {IMAGE} is missing: mode {0} needs an {1}")]
    MissingImage(&'static str, &'static str),
    #[error("annotation {IMAGE}")]
    BadSnapshot(#[source] SnapshotRefError),
    #[error("annotation {OS}={0:?}: expected linux, windows, android or macos")]
    BadOs(String),
    #[error("annotation {STORAGE}")]
    BadStorage(#[source] QuantityError),
    #[error("annotation {SNAPSHOT_POLICY}={0:?}: expected always, main-only or never")]
    BadSnapshotPolicy(String),
    #[error("annotation {PROBE_PORT}={0:?}: expected a TCP port 1-65535")]
    BadProbePort(String),
    #[error("annotation {SHARED_NETWORK}={0:?}: expected a group name of 1-63 characters a-z, 0-9 and '-'")]
    BadSharedNetwork(String),
    #[error("annotation {BACKEND}={0:?}: expected cloud-hypervisor, firecracker or qemu")]
    BadBackend(String),
    /// A valid request this node cannot serve.
    #[error("{what} is unsupported on this node")]
    Unsupported { what: String },
}

fn annotations(pod: &Pod) -> Option<&BTreeMap<String, String>> {
    pod.metadata.annotations.as_ref()
}

/// The trimmed value of `key`; empty counts as absent.
pub fn value<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    annotations(pod).and_then(|a| a.get(key)).map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// True only for the literal `"true"`.
pub fn flag(pod: &Pod, key: &str) -> bool {
    annotations(pod).and_then(|a| a.get(key)).is_some_and(|v| v == "true")
}

fn unsupported(what: impl Into<String>) -> AnnotationError {
    AnnotationError::Unsupported { what: what.into() }
}

/// `vm.cocoonstack.io/name`, required (CreatePod step 1).
pub fn vm_name(pod: &Pod) -> Result<String, AnnotationError> {
    let name = value(pod, VM_NAME).ok_or(AnnotationError::MissingVmName)?;
    if name.len() > MAX_VM_NAME || name.contains('/') || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(AnnotationError::BadVmName(name.to_owned()));
    }
    Ok(name.to_owned())
}

/// `name` (of annotation `key`) as the image library's reference rules see the snapshot
/// `snapshot` the VM gets (`images::Reference::parse`): a name it refuses would pass here and
/// fail every hibernate, delete snapshot or fork later.
fn check_store_name(key: &'static str, name: &str, snapshot: &str) -> Result<(), AnnotationError> {
    // A ':' or '/' in the name fails here too: neither is in a repository's characters.
    images::Reference::parse(snapshot).map(drop).map_err(|source| AnnotationError::StoreName {
        key,
        name: name.to_owned(),
        source: Box::new(source),
    })
}

/// The tag the snapshot checks of [`check_store_name`] use.
const LATEST_TAG: &str = "latest";

/// Parses and validates every key the provider acts on.
pub fn parse(pod: &Pod) -> Result<VmSpec, AnnotationError> {
    let vm_name = vm_name(pod)?;
    check_store_name(VM_NAME, &vm_name, &format!("{vm_name}:{LATEST_TAG}"))?;
    let managed = flag(pod, MANAGED);

    match value(pod, OS).unwrap_or("linux") {
        "linux" => {}
        os @ ("windows" | "android" | "macos") => return Err(unsupported(format!("guest OS {os} ({OS})"))),
        other => return Err(AnnotationError::BadOs(other.to_owned())),
    }
    let mode = match value(pod, MODE).unwrap_or("clone") {
        "clone" => Mode::Clone,
        "run" => Mode::Run,
        "static" => return Err(unsupported(format!("{MODE}=static"))),
        other => return Err(AnnotationError::BadMode(other.to_owned())),
    };
    let backend = match value(pod, BACKEND) {
        None => None,
        Some("cloud-hypervisor") => Some(RequestedBackend::CloudHypervisor),
        Some("firecracker") => Some(RequestedBackend::Firecracker),
        Some("qemu") => Some(RequestedBackend::Qemu),
        Some(other) => return Err(AnnotationError::BadBackend(other.to_owned())),
    };
    let snapshot_policy = match value(pod, SNAPSHOT_POLICY).unwrap_or("always") {
        "always" => SnapshotPolicy::Always,
        "main-only" => SnapshotPolicy::MainOnly,
        "never" => SnapshotPolicy::Never,
        other => return Err(AnnotationError::BadSnapshotPolicy(other.to_owned())),
    };
    let probe_port = match value(pod, PROBE_PORT) {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Some(n),
            _ => return Err(AnnotationError::BadProbePort(p.to_owned())),
        },
    };
    let shared_network = match value(pod, SHARED_NETWORK) {
        None => None,
        Some(g) if g.len() <= 63 && g.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') => {
            Some(g.to_owned())
        }
        Some(g) => return Err(AnnotationError::BadSharedNetwork(g.to_owned())),
    };
    let storage_bytes = match value(pod, STORAGE) {
        None => None,
        Some(s) => {
            let b = quantity::units_ceil(s).map_err(AnnotationError::BadStorage)?;
            Some(u64::try_from(b).map_err(|_| AnnotationError::BadStorage(QuantityError::Overflow(s.to_owned())))?)
        }
    };

    let restore_from_hibernate = managed && flag(pod, RESTORE_FROM_HIBERNATE);
    let fork_from = if managed { value(pod, FORK_FROM).map(str::to_owned) } else { None };
    if let Some(f) = &fork_from {
        if f.len() > MAX_VM_NAME || f.contains('/') || f.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(AnnotationError::BadVmName(f.clone()));
        }
        check_store_name(FORK_FROM, f, &format!("{f}:{LATEST_TAG}"))?;
        check_store_name(FORK_FROM, f, &format!("fork-{f}:{LATEST_TAG}"))?;
    }
    let preassigned = if managed {
        if value(pod, CLONE_FROM_DIR).is_some() {
            return Err(unsupported(format!(
                "the VM source {CLONE_FROM_DIR} (a host directory named by a Pod would let it pick host files for                  its VM; this node restores only snapshots of its image library: save or import the snapshot there                  and name it in {IMAGE})"
            )));
        }
        if fork_from.is_some() && mode == Mode::Run {
            return Err(unsupported(format!("{FORK_FROM} with {MODE}=run (a fork is a clone)")));
        }
        None
    } else {
        let (id, ip) = (value(pod, VM_ID), value(pod, VM_IP));
        let (id, ip) = match (id, ip) {
            (Some(id), Some(ip)) => (id, ip),
            (None, None) => return Err(AnnotationError::UnmanagedWithoutVm("both")),
            (None, _) => return Err(AnnotationError::UnmanagedWithoutVm(VM_ID)),
            (_, None) => return Err(AnnotationError::UnmanagedWithoutVm(VM_IP)),
        };
        if ip.parse::<IpAddr>().is_err() {
            return Err(AnnotationError::BadIp(ip.to_owned()));
        }
        Some(Preassigned { id: id.to_owned(), ip: ip.to_owned() })
    };

    let image = value(pod, IMAGE).map(str::to_owned);
    // A fork or a wake names its own source: the image is not needed (and not used).
    let own_source = fork_from.is_some() || restore_from_hibernate;
    let snapshot = match (managed, mode, &image) {
        (true, Mode::Clone, None) if own_source => None,
        (true, Mode::Run, None) => return Err(AnnotationError::MissingImage("run", "image to boot")),
        (true, Mode::Clone, None) => {
            return Err(AnnotationError::MissingImage("clone", "snapshot repo[:tag] to clone"))
        }
        (true, Mode::Clone, Some(i)) => Some(i.parse::<SnapshotRef>().map_err(AnnotationError::BadSnapshot)?),
        _ => None,
    };

    Ok(VmSpec {
        vm_name,
        managed,
        preassigned,
        mode,
        image,
        snapshot,
        storage_bytes,
        network: value(pod, NETWORK).map(str::to_owned),
        shared_network,
        snapshot_policy,
        probe_port,
        backend,
        keep_snapshot_on_delete: flag(pod, KEEP_SNAPSHOT_ON_DELETE),
        hibernate: flag(pod, HIBERNATE),
        restore_from_hibernate,
        fork_from,
    })
}

/// Whether the Pod is the main agent of its set: the `role` label when set; else, for a
/// CocoonSet member, slot 0 (the VM name's last `-<n>`); a Pod outside any CocoonSet is its
/// own main.
pub fn is_main(pod: &Pod, vm_name: &str) -> bool {
    if let Some(role) = pod.metadata.labels.as_ref().and_then(|l| l.get(ROLE)).map(|r| r.trim()) {
        if !role.is_empty() {
            return role == "main";
        }
    }
    let in_set =
        pod.metadata.owner_references.iter().flatten().any(|o| o.kind == COCOONSET_KIND && o.controller == Some(true));
    if !in_set {
        return true;
    }
    vm_name.rsplit_once('-').is_some_and(|(_, slot)| slot == "0")
}

/// cocoon-common's `ShouldSnapshotVM`: `never` → no; `main-only` → only the main agent;
/// `always` → yes.
pub fn should_snapshot(pod: &Pod, spec: &VmSpec) -> bool {
    match spec.snapshot_policy {
        SnapshotPolicy::Never => false,
        SnapshotPolicy::MainOnly => is_main(pod, &spec.vm_name),
        SnapshotPolicy::Always => true,
    }
}

/// What DeletePod does about snapshots, read leniently so that a Pod whose other annotations
/// no longer parse is still deleted: an unknown `snapshot-policy` counts as `always` (when in
/// doubt, keep the data). `vm_name` falls back to `fallback_name` (the tracked VM's name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletePolicy {
    /// The VM name the snapshot is saved under (`<vm_name>:latest`).
    pub vm_name: String,
    /// Save a snapshot before removing the VM (`ShouldSnapshotVM`).
    pub save: bool,
    /// `keep-snapshot-on-delete`.
    pub keep: bool,
}

/// The [`DeletePolicy`] of `pod`.
pub fn delete_policy(pod: &Pod, fallback_name: &str) -> DeletePolicy {
    let vm_name = vm_name(pod).unwrap_or_else(|_| fallback_name.to_owned());
    let policy = match value(pod, SNAPSHOT_POLICY) {
        Some("never") => SnapshotPolicy::Never,
        Some("main-only") => SnapshotPolicy::MainOnly,
        _ => SnapshotPolicy::Always,
    };
    let save = match policy {
        SnapshotPolicy::Never => false,
        SnapshotPolicy::MainOnly => is_main(pod, &vm_name),
        SnapshotPolicy::Always => true,
    };
    DeletePolicy { vm_name, save, keep: flag(pod, KEEP_SNAPSHOT_ON_DELETE) }
}

/// The `cocoonstack.io/snapshot-cpu-class` the Pod's nodeSelector asks for, if any.
pub fn selected_cpu_class(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_selector.as_ref()?.get(CPU_CLASS_LABEL).map(|s| s.trim())
}

/// Guest vCPUs and memory (MiB) for `mode: run`, summed over the Pod's containers: vCPUs =
/// the CPU limit rounded up, else the request, else 1; memory = the request, else the limit,
/// else 512 MiB. Unparseable quantities count as absent (the API server validated them).
pub fn run_resources(pod: &Pod) -> (u32, u64) {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    let sum = |pick: &dyn Fn(&k8s_openapi::api::core::v1::ResourceRequirements) -> Option<String>| -> Option<u128> {
        let mut total: Option<u128> = None;
        for c in containers {
            if let Some(q) = c.resources.as_ref().and_then(pick) {
                if let Ok(m) = quantity::milli(&q) {
                    total = Some(total.unwrap_or(0).saturating_add(m));
                }
            }
        }
        total
    };
    let get = |which: &'static str, key: &'static str| {
        move |r: &k8s_openapi::api::core::v1::ResourceRequirements| {
            let map = if which == "limits" { r.limits.as_ref() } else { r.requests.as_ref() };
            map.and_then(|m| m.get(key)).map(|q| q.0.clone())
        }
    };
    let cpu_milli = sum(&get("limits", "cpu")).or_else(|| sum(&get("requests", "cpu")));
    let vcpus = cpu_milli.map(|m| m.div_ceil(1000)).unwrap_or(1).clamp(1, u128::from(u32::MAX));
    let mem_milli = sum(&get("requests", "memory")).or_else(|| sum(&get("limits", "memory")));
    let mib = mem_milli.map(|m| m.div_ceil(1000).div_ceil(1 << 20)).unwrap_or(512).clamp(1, u128::from(u64::MAX));
    // Both clamped into range above.
    (u32::try_from(vcpus).unwrap_or(u32::MAX), u64::try_from(mib).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;

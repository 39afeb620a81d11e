//! The vk-cocoon provider (`docs/virtual-node.md` §3): every Pod bound to this virtual
//! node gets one microVM of its own, booted from an image (`mode: run`) or cloned from a
//! snapshot (`mode: clone`), on the `vnode` runtime.
//!
//! Code map: [`config`] (the §3.1 environment), [`node`] (the Node: labels, taint, measured
//! capacity, conditions), [`annotations`] (the Pod contract), [`backend`] (the [`VmBackend`]
//! trait every VM operation goes through), `shared` (the provider's state in one file: the
//! tables, the entry per Pod, pushes and events, on `vnode::kit`), [`provider`]
//! ([`CocoonProvider`]: `create`, `delete` and `loops` modules; the decisions on snapshots,
//! authority and state are documented there), `probe` (readiness), [`watcher`] (VMs that die
//! on their own), [`reconcile`] (start-up adoption and orphans), [`gc`] (the snapshot GC
//! timer), [`metrics`] (the `cocoon_vk_*` samples), [`namespaces`] (which Pods may
//! use which VMs and snapshots), [`status`] (pushed Pod status), [`events`], `test_utils`
//! (`FakeBackend`; `cfg(test)` or feature `test-utils`), [`vmm_backend`] (the production
//! backend: QEMU through `vmm`, the `images` library, `vmnet` networking; its environment and
//! VM-id scheme are documented there). Quantities are parsed by `foundation::quantity`.
//!
//! Architecture invariants: the provider never spawns a hypervisor or touches an image itself
//! (only through [`VmBackend`]); a failed VM listing is never read as empty; nothing is
//! persisted by the provider — a restart derives its state from the backend's VM list and the
//! Pods' annotations.

#![forbid(unsafe_code)]

pub mod annotations;
pub mod backend;
pub mod config;
pub mod events;
pub mod gc;
pub mod hibernation;
pub mod metrics;
pub mod namespaces;
pub mod node;
mod probe;
pub mod provider;
pub mod reconcile;
mod shared;
pub mod status;
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;
pub mod vmm_backend;
pub mod watcher;

pub use backend::{BackendError, Hypervisor, SnapshotInfo, SnapshotRef, VmBackend, VmInfo, VmState, VmUsage};
pub use provider::{BackgroundLoops, CocoonProvider, CocoonProviderError, ProviderConfig};

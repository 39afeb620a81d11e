//! One driver trait over the hypervisors Chrysalis runs microVMs with.
//!
//! - [`driver`]: the [`Driver`] trait and shared types ([`Vm`], [`BootSpec`], [`Snapshot`], …);
//! - [`qemu`]: QEMU `-M microvm` over QMP, guest agent over virtio-serial + `agent-mux`;
//! - [`cloud_hypervisor`]: cloud-hypervisor over its REST API, guest agent over hybrid vsock;
//! - [`agent`]: the one hybrid-vsock dialler every driver uses;
//! - [`peer`]: dialling a VM's socket by path, checking its peer's credentials (`SO_PEERCRED`);
//! - [`console`]: the serial console, drained into a size-capped log; tails read by seeking;
//! - [`catalog`], [`size`], [`accel`], [`record`]: templates, size classes, KVM/TCG probe, `vm.json`;
//! - [`jail`]: the unprivileged user, cgroup leaf, session and descriptors every hypervisor runs with;
//! - [`usage`]: a VM's CPU time and memory working set (its cgroup leaf, or its hypervisor process);
//! - [`lifecycle`]: the `creating` → `running` record that keeps every started hypervisor findable;
//! - [`owned`]: VM ownership for the services on top (prefix, per-VM records, adopt after a
//!   restart, the orphan sweep), once.

pub mod accel;
pub mod agent;
pub mod catalog;
pub mod cloud_hypervisor;
pub mod console;
pub mod disk;
pub mod driver;
pub mod hypervisor;
pub mod id;
pub mod jail;
pub mod lifecycle;
pub mod owned;
pub mod peer;
pub mod qemu;
pub mod record;
pub mod size;
pub mod sockdir;
#[cfg(test)]
mod test_utils;
pub mod usage;

pub use accel::{Accel, AccelPreference};
pub use agent::CONTROL_PORT;
pub use catalog::{Catalog, CatalogError};
pub use driver::{
    AfterSnapshot, AgentInfo, AgentStream, Backend, BootSpec, Driver, DriverError, NicSpec, Ram, RestoreOptions,
    Snapshot, Vm, VmId, VmState, VolumeAttach, AGENT_PORT, MAX_VOLUMES,
};
pub use size::SizeClass;

/// The workspace's one error-chain formatter (`a: b: c`), re-exported for the many callers
/// that name it `vmm::error_chain`.
pub use foundation::error_chain;

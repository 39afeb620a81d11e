//! One driver trait over the hypervisors Chrysalis runs microVMs with.
//!
//! - [`driver`]: the [`Driver`] trait and shared types ([`Vm`], [`BootSpec`], [`Snapshot`], …);
//! - [`qemu`]: QEMU `-M microvm` over QMP, guest agent over virtio-serial + `agent-mux`;
//! - [`cloud_hypervisor`]: cloud-hypervisor over its REST API, guest agent over hybrid vsock;
//! - [`agent`]: the one hybrid-vsock dialler every driver uses;
//! - [`console`]: the serial console, drained into a size-capped log; tails read by seeking;
//! - [`catalog`], [`size`], [`accel`], [`record`]: templates, size classes, KVM/TCG probe, `vm.json`;
//! - [`lifecycle`]: the `creating` → `running` record that keeps every started hypervisor findable;
//! - [`test_utils`]: an in-memory [`test_utils::FakeDriver`] with settable failures.

pub mod accel;
pub mod agent;
pub mod catalog;
pub mod cloud_hypervisor;
pub mod console;
pub mod disk;
pub mod driver;
pub mod lifecycle;
pub mod qemu;
pub mod record;
pub mod size;
pub mod sockdir;
pub mod test_utils;

pub use accel::{Accel, AccelPreference};
pub use agent::CONTROL_PORT;
pub use catalog::{Catalog, CatalogError};
pub use driver::{
    AfterSnapshot, AgentInfo, AgentStream, Backend, BootSpec, Driver, DriverError, NicSpec, RestoreOptions, Snapshot,
    Vm, VmId, VmState, AGENT_PORT,
};
pub use size::SizeClass;

/// Formats an error with its `source()` chain as `a: b: c` (a cause whose text the message
/// already ends with is not repeated). The workspace's one formatter above the providers
/// (`vnode` has its own: it links no VMM code).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.ends_with(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

//! Fixtures shared by the crate's unit tests.
#![allow(clippy::expect_used)] // fixtures take literal valid ids

use std::path::Path;

use crate::accel::{Accel, AccelPreference};
use crate::driver::{Backend, BootSpec, Vm, VmId, VmState};
use crate::size::SizeClass;

/// A small spec of template `name` (paths that need not exist).
pub(crate) fn boot_spec(name: &str) -> BootSpec {
    BootSpec {
        overlay_bytes: None,
        name: name.into(),
        kernel: "/k".into(),
        initrd: "/i".into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        size: SizeClass::Small,
        accel: AccelPreference::Auto,
        nic: None,
        rng: true,
        volumes: true,
        ram: crate::driver::Ram::Anonymous,
    }
}

/// The record of VM `id` in `<vms>/<id>/`, booted from `base`, pid 0, in `state`.
pub(crate) fn vm(vms: &Path, id: &str, state: VmState) -> Vm {
    let dir = vms.join(id);
    Vm {
        id: VmId::new(id).expect("id"),
        backend: Backend::Qemu,
        accel: Accel::Tcg,
        pid: 0,
        pid_start_time: 0,
        control_socket: dir.join("qmp.sock"),
        vsock_socket: dir.join("vsock.sock"),
        console_log: dir.join("console.log"),
        dir,
        spec: boot_spec("base"),
        restored_from: None,
        created_at_epoch_secs: 1,
        state,
    }
}

//! Volumes of a QEMU VM: raw disk images hot-plugged as `scsi-hd` disks on the VM's
//! virtio-scsi controller ([`cmdline::SCSI_CONTROLLER`]), one SCSI target per slot.
//!
//! QEMU is sandboxed and opens nothing by path: the driver opens the image (read-only or
//! read-write, as the volume is held) and passes the descriptor with `add-fd` into fd set
//! `FDSET_BASE + slot`; `blockdev-add` opens `/dev/fdset/<set>` and `device_add` plugs the
//! disk at `scsi-id=<slot>, lun=0`, where the guest agent looks for it. Unplugging deletes
//! the device, the block node and the fd set, each step tolerating one already gone.

use super::*;
use crate::driver::{VolumeAttach, MAX_VOLUMES};

/// Fd sets of volumes start here (the boot disks take the low numbers).
const FDSET_BASE: u32 = 1000;

fn node(slot: u16) -> String {
    format!("vol{slot}")
}

fn device(slot: u16) -> String {
    format!("vol{slot}-disk")
}

fn check_slot(slot: u16) -> Result<(), DriverError> {
    if (1..=MAX_VOLUMES).contains(&slot) {
        Ok(())
    } else {
        Err(DriverError::Invalid(format!("volume slot {slot}: want 1-{MAX_VOLUMES}")))
    }
}

/// The QMP commands that plug `v` after its descriptor went into fd set `set`.
fn plug_commands(v: &VolumeAttach, set: u32) -> Vec<(&'static str, String)> {
    let blockdev = serde_json::json!({"execute": "blockdev-add", "arguments": {
        "driver": "raw", "node-name": node(v.slot), "read-only": v.read_only,
        "file": {"driver": "file", "filename": format!("/dev/fdset/{set}")},
    }});
    let disk = serde_json::json!({"execute": "device_add", "arguments": {
        "driver": "scsi-hd", "id": device(v.slot), "bus": format!("{}.0", cmdline::SCSI_CONTROLLER),
        "drive": node(v.slot), "channel": 0, "scsi-id": v.slot, "lun": 0,
    }});
    vec![("blockdev-add", format!("{blockdev}\n")), ("device_add", format!("{disk}\n"))]
}

impl QemuDriver {
    pub(super) async fn plug_volume(&self, vm: &Vm, v: &VolumeAttach) -> Result<(), DriverError> {
        check_slot(v.slot)?;
        if !vm.spec.volumes {
            return Err(DriverError::Unsupported {
                backend: Backend::Qemu,
                what: format!("volumes on vm {} (started before volumes existed: no controller)", vm.id),
            });
        }
        let span = tracing::info_span!("volume_attach", vm = %vm.id, slot = v.slot, path = %v.path.display());
        async {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(!v.read_only)
                .open(&v.path)
                .map_err(|e| DriverError::io(format!("opening volume image {}", v.path.display()), e))?;
            // Whatever a failed earlier attempt left in the slot goes first.
            self.unplug_quietly(vm, v.slot).await;
            let set = FDSET_BASE + u32::from(v.slot);
            let add_fd = serde_json::json!({"execute": "add-fd", "arguments": {
                "fdset-id": set, "opaque": v.path.display().to_string(),
            }});
            let r = qmp::with_fd(
                &vm.control_socket,
                OwnedFd::from(file),
                ("add-fd", format!("{add_fd}\n")),
                plug_commands(v, set),
                QMP_CONNECT_TIMEOUT,
            )
            .await
            .map_err(control(&vm.id));
            if r.is_err() {
                self.unplug_quietly(vm, v.slot).await;
            }
            r?;
            tracing::info!(read_only = v.read_only, "volume plugged");
            Ok(())
        }
        .instrument(span)
        .await
    }

    pub(super) async fn unplug_volume(&self, vm: &Vm, slot: u16) -> Result<(), DriverError> {
        check_slot(slot)?;
        let q = self.qmp(vm).await?;
        if let Err(e) = q.device_del(&device(slot)).await {
            if !not_found(&e) {
                return Err(control(&vm.id)(e));
            }
        }
        // A SCSI disk is unrealized at once, but its node may take a moment to be released.
        let mut tries = 0;
        loop {
            match q.blockdev_del(&node(slot)).await {
                Ok(()) => break,
                Err(e) if not_found(&e) => break,
                Err(e) if tries < 20 => {
                    tries += 1;
                    tracing::debug!(vm = %vm.id, slot, error = %e, "block node still busy; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(control(&vm.id)(e)),
            }
        }
        let _ = q.remove_fdset(i64::from(FDSET_BASE + u32::from(slot))).await;
        tracing::info!(vm = %vm.id, slot, "volume unplugged");
        Ok(())
    }

    async fn unplug_quietly(&self, vm: &Vm, slot: u16) {
        if let Ok(q) = self.qmp(vm).await {
            let _ = q.device_del(&device(slot)).await;
            let _ = q.blockdev_del(&node(slot)).await;
            let _ = q.remove_fdset(i64::from(FDSET_BASE + u32::from(slot))).await;
        }
    }
}

/// QEMU's answer for a device, node or fd set that is not there.
fn not_found(e: &qmp::QmpError) -> bool {
    match e {
        qmp::QmpError::Command { message, .. } => {
            let m = message.to_ascii_lowercase();
            m.contains("not found") || m.contains("cannot find") || m.contains("does not exist")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn slots_are_bounded() {
        assert!(check_slot(0).is_err());
        assert!(check_slot(1).is_ok());
        assert!(check_slot(MAX_VOLUMES).is_ok());
        assert!(check_slot(MAX_VOLUMES + 1).is_err());
    }

    #[test]
    fn plug_commands_name_the_slot_and_mode() {
        let v = VolumeAttach { slot: 3, path: PathBuf::from("/v/data.img"), read_only: true };
        let cmds = plug_commands(&v, 1003);
        let b: serde_json::Value = serde_json::from_str(&cmds[0].1).expect("json");
        assert_eq!(b["arguments"]["read-only"], true);
        assert_eq!(b["arguments"]["file"]["filename"], "/dev/fdset/1003");
        let d: serde_json::Value = serde_json::from_str(&cmds[1].1).expect("json");
        assert_eq!(d["arguments"]["scsi-id"], 3);
        assert_eq!(d["arguments"]["bus"], "scsi0.0");
        assert_eq!(d["arguments"]["drive"], "vol3");
        assert!(cmds.iter().all(|(_, t)| t.ends_with('\n')));
    }
}

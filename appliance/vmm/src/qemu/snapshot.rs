//! Snapshots of a QEMU VM: QMP `stop`, the migration stream into `<dir>/state` (its
//! descriptor passed over QMP), a copy of the overlay, and the RAM file of a
//! [`Ram::SharedFile`] VM kept beside them ([`memory`]).

use super::*;

impl QemuDriver {
    /// [`Driver::snapshot`].
    pub(super) async fn snapshot_to(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        let span = tracing::info_span!("vm_snapshot", vm = %vm.id, dir = %dir.display());
        async {
            let t0 = Instant::now();
            let shared_ram = vm.spec.ram == Ram::SharedFile;
            if shared_ram && after == AfterSnapshot::Resumed {
                return Err(DriverError::Invalid(format!(
                    "vm {}: its RAM is the snapshot's file; it cannot run on after a snapshot (stop or pause it)",
                    vm.id
                )));
            }
            let q = self.qmp(vm).await?;
            let was_running = q.status().await.map_err(control(&vm.id))?.running;
            // The RAM of a shared-file VM stays in its file: the stream skips it.
            q.ignore_shared(shared_ram).await.map_err(control(&vm.id))?;
            q.stop().await.map_err(control(&vm.id))?;
            // QEMU serves one QMP client at a time: the descriptor goes over a connection of
            // its own, then the migration is watched on a fresh one.
            drop(q);
            let result = async {
                std::fs::create_dir_all(dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
                let state = dir.join(files::STATE);
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&state)
                    .map_err(|e| DriverError::io(format!("creating {}", state.display()), e))?;
                qmp::migrate_to_fd(&vm.control_socket, OwnedFd::from(file), QMP_CONNECT_TIMEOUT)
                    .await
                    .map_err(control(&vm.id))?;
                self.wait_migration(&vm.id, &self.qmp(vm).await?, "migration to file").await?;
                if shared_ram {
                    memory::keep_ram_file(&vm.dir.join(files::MEMORY), &dir.join(files::MEMORY))?;
                }
                let src_overlay = vm.dir.join(files::OVERLAY);
                let overlay = if src_overlay.exists() {
                    let dst = dir.join(files::OVERLAY);
                    std::fs::copy(&src_overlay, &dst).map_err(|e| {
                        DriverError::io(format!("copying {} to {}", src_overlay.display(), dst.display()), e)
                    })?;
                    Some(dst)
                } else {
                    None
                };
                let snap = Snapshot {
                    dir: dir.to_path_buf(),
                    backend: Backend::Qemu,
                    accel: vm.accel,
                    source: vm.id.clone(),
                    spec: vm.spec.clone(),
                    overlay,
                    created_at_epoch_secs: now_secs(),
                };
                record::write_json_atomic(&dir.join(Snapshot::FILE), &snap)?;
                Ok(snap)
            }
            .await;
            if after == AfterSnapshot::Resumed || (result.is_err() && was_running) {
                self.qmp(vm).await?.cont().await.map_err(control(&vm.id))?;
            }
            if result.is_ok() {
                tracing::info!(ms = t0.elapsed().as_millis() as u64, "snapshot written");
            }
            result
        }
        .instrument(span)
        .await
    }
}

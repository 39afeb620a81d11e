//! Boot, snapshot and restore of a cloud-hypervisor VM (the restore directory handed to the VM
//! user, the NIC's TAP).

use super::*;

impl CloudHypervisor {
    /// [`Self::start_process`] for a VM whose directory `dir` was made for it: the directory
    /// is removed when the process cannot start (boot and restore alike).
    async fn start_process_in(
        &self,
        rec: &mut VmRecord,
        jail: Option<&Jail>,
        dir: &Path,
    ) -> Result<VmmProcess, DriverError> {
        let started = self.start_process(rec, jail).await;
        if started.is_err() {
            let _ = self.remove_dir(dir);
        }
        started
    }

    /// For a VM with a NIC: hands its persistent TAP to the VM user (cloud-hypervisor attaches
    /// to it by name, [`crate::jail::set_owner`]) and opens the NIC's network namespace for the
    /// process to join, as QEMU's is.
    pub(super) fn prepare_nic(vm: &Vm, jail: Option<&Jail>) -> Result<Option<std::fs::File>, DriverError> {
        let Some(nic) = &vm.spec.nic else { return Ok(None) };
        nic.validate()?;
        let netns = nic.netns_path();
        if let Some(j) = jail {
            crate::jail::set_owner(&nic.tap, netns.as_deref(), j.uid, j.gid).map_err(JailError::from)?;
        }
        match netns {
            Some(path) => std::fs::File::open(&path)
                .map(Some)
                .map_err(|e| DriverError::io(format!("opening network namespace {}", path.display()), e)),
            None => Ok(None),
        }
    }

    /// Builds `<vmdir>/restore/` for a clone of `snapshot`; in a jail it is root's, group the
    /// VM group (0750, its `config.json` 0640), and every snapshot file it links to must be
    /// readable by the VM user.
    pub(super) fn prepare_restore_dir(
        snapshot: &Snapshot,
        vm: &Vm,
        overlay: Option<PathBuf>,
        jail: Option<&Jail>,
    ) -> Result<PathBuf, DriverError> {
        let rdir = vm.dir.join(RESTORE_DIR);
        std::fs::create_dir(&rdir).map_err(|e| DriverError::io(format!("creating {}", rdir.display()), e))?;
        let src_cfg = snapshot.dir.join(SNAPSHOT_CONFIG);
        let mut cfg: serde_json::Value = record::read_json(&src_cfg)?;
        config::rewrite_snapshot_config(
            &mut cfg,
            &CloneRewrite {
                vsock_socket: vm.vsock_socket.clone(),
                serial_socket: vm.control_socket.with_file_name(CONSOLE_SOCKET),
                overlay,
                tap: vm.spec.nic.as_ref().map(|n| n.tap.clone()),
            },
        )
        .map_err(|e| DriverError::Invalid(format!("{}: {e}", src_cfg.display())))?;
        record::write_json_atomic(&rdir.join(SNAPSHOT_CONFIG), &cfg)?;
        let entries = std::fs::read_dir(&snapshot.dir)
            .map_err(|e| DriverError::io(format!("reading {}", snapshot.dir.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| DriverError::io(format!("reading {}", snapshot.dir.display()), e))?;
            let name = entry.file_name();
            if name == SNAPSHOT_CONFIG || name == Snapshot::FILE || name == OVERLAY {
                continue;
            }
            let link = rdir.join(&name);
            std::os::unix::fs::symlink(entry.path(), &link)
                .map_err(|e| DriverError::io(format!("linking {}", link.display()), e))?;
            if let Some(j) = jail {
                j.check_reach(&entry.path(), false)?;
            }
        }
        if let Some(j) = jail {
            j.take_back(&rdir.join(SNAPSHOT_CONFIG), 0o640)?;
            j.take_back(&rdir, 0o750)?;
        }
        Ok(rdir)
    }

    pub(super) async fn boot_as(&self, spec: &BootSpec, id: VmId) -> Result<Vm, DriverError> {
        if let Some(nic) = &spec.nic {
            nic.validate()?;
        }
        let jail = self.cfg.jail.resolve()?;
        let mut rec = VmRecord::creating(self.skeleton(&id, &self.vm_dir(&id), spec)?);
        lifecycle::create_vm_dir(&rec)?;
        let dir = rec.vm.dir.clone();
        let overlay = match Self::prepare_dirs(&rec.vm, jail.as_ref(), spec.overlay_base.as_deref()) {
            Ok(o) => o,
            Err(e) => {
                let _ = self.remove_dir(&dir);
                return Err(e);
            }
        };
        let plan = VmPlan {
            kernel: spec.kernel.clone(),
            initramfs: spec.initrd.clone(),
            cmdline: config::kernel_cmdline(&spec.cmdline, spec.rootfs.is_some(), overlay.is_some()),
            vcpus: spec.size.vcpus(),
            memory_bytes: spec.size.memory_mib() << 20,
            shared_memory: self.cfg.shared_memory,
            rootfs: spec.rootfs.clone(),
            overlay,
            serial_socket: rec.vm.control_socket.with_file_name(CONSOLE_SOCKET),
            vsock_cid: vsock_cid(&id),
            vsock_socket: rec.vm.vsock_socket.clone(),
            rng: spec.rng,
            net: spec.nic.as_ref().map(|n| (n.tap.clone(), n.mac.clone())),
        };
        let proc = self.start_process_in(&mut rec, jail.as_ref(), &dir).await?;
        let api = self.api(&rec.vm);
        let steps = async {
            api.create(plan.to_vm_config()).await.map_err(|e| api_error(&id, e))?;
            api.boot().await.map_err(|e| api_error(&id, e))
        };
        let vm = self.finish_start(rec, proc, steps).await?;
        tracing::info!(pid = vm.pid, accel = %vm.accel, "vm booted");
        Ok(vm)
    }

    pub(super) async fn snapshot_to(&self, vm: &Vm, dir: &Path, after: AfterSnapshot) -> Result<Snapshot, DriverError> {
        self.check_owned(vm)?;
        let dir = std::path::absolute(dir).map_err(|e| DriverError::io(format!("resolving {}", dir.display()), e))?;
        std::fs::create_dir_all(&dir).map_err(|e| DriverError::io(format!("creating {}", dir.display()), e))?;
        let jail = self.cfg.jail.resolve()?;
        let api = self.api(vm);
        let state = api.info().await.map_err(|e| api_error(&vm.id, e))?.state;
        let was_paused = state == ChVmState::Paused;
        if !was_paused {
            api.pause().await.map_err(|e| api_error(&vm.id, e))?;
        }
        let saved = async {
            // cloud-hypervisor writes the snapshot as the VM user: the directory is its own for
            // the duration of `vm.snapshot` only, and taken back (whatever happened) before the
            // driver writes there or anyone reads it.
            let written = async {
                if let Some(j) = &jail {
                    j.hand_over(&dir, 0o700)?;
                    j.check_reach(&dir, true)?;
                }
                self.slow_api(vm).snapshot(&dir).await.map_err(|e| api_error(&vm.id, e))
            }
            .await;
            let taken_back = match &jail {
                Some(j) => j.take_back_dir(&dir).map_err(DriverError::from),
                None => Ok(()),
            };
            written?;
            taken_back?;
            let overlay = if vm.spec.overlay_base.is_some() {
                let to = dir.join(OVERLAY);
                // The running VM's overlay sits in the VM user's directory (older VMs: in
                // `<vmdir>`): never follow a link there.
                let jailed = vm.dir.join(JAIL_DIR).join(OVERLAY);
                let from = if jailed.symlink_metadata().is_ok() { jailed } else { vm.dir.join(OVERLAY) };
                let mut owners = vec![rustix::process::geteuid().as_raw()];
                owners.extend(jail.as_ref().map(|j| j.uid));
                disk::clone_file_nofollow(&from, &to, &owners).map_err(disk_error)?;
                Some(to)
            } else {
                None
            };
            let snap = Snapshot {
                dir: dir.clone(),
                backend: Backend::CloudHypervisor,
                accel: vm.accel,
                source: vm.id.clone(),
                spec: vm.spec.clone(),
                overlay,
                created_at_epoch_secs: now_epoch_secs(),
            };
            record::write_json_atomic(&dir.join(Snapshot::FILE), &snap)?;
            Ok::<_, DriverError>(snap)
        }
        .await;
        let resume = match (&saved, after) {
            (Ok(_), AfterSnapshot::Resumed) => true,
            (Ok(_), AfterSnapshot::Paused) => false,
            // A failed snapshot leaves the VM as it found it.
            (Err(_), _) => !was_paused,
        };
        if resume {
            let r = api.resume().await.map_err(|e| api_error(&vm.id, e));
            if let (Ok(_), Err(e)) = (&saved, r) {
                return Err(e);
            }
        }
        let snap = saved?;
        tracing::info!(?after, "snapshot written");
        Ok(snap)
    }

    pub(super) async fn restore_as(
        &self,
        snapshot: &Snapshot,
        id: &VmId,
        opts: &RestoreOptions,
    ) -> Result<Vm, DriverError> {
        if snapshot.backend != Backend::CloudHypervisor {
            return Err(DriverError::Invalid(format!(
                "snapshot {} was taken by {}, not cloud-hypervisor",
                snapshot.dir.display(),
                snapshot.backend
            )));
        }
        let jail = self.cfg.jail.resolve()?;
        let mut vm = self.skeleton(id, &self.vm_dir(id), &snapshot.spec)?;
        vm.accel = snapshot.accel;
        vm.restored_from = Some(snapshot.dir.clone());
        // The saved device set has the NIC: a clone has one iff its parent had, on its own TAP.
        opts.check_against(snapshot)?;
        vm.spec.nic = opts.nic.clone();
        let mut rec = VmRecord::creating(vm);
        lifecycle::create_vm_dir(&rec)?;
        let dir = rec.vm.dir.clone();
        let prepared = Self::prepare_dirs(&rec.vm, jail.as_ref(), snapshot.overlay.as_deref())
            .and_then(|overlay| Self::prepare_restore_dir(snapshot, &rec.vm, overlay, jail.as_ref()));
        let rdir = match prepared {
            Ok(r) => r,
            Err(e) => {
                let _ = self.remove_dir(&dir);
                return Err(e);
            }
        };
        let proc = self.start_process_in(&mut rec, jail.as_ref(), &dir).await?;
        let api = self.api(&rec.vm);
        let slow = self.slow_api(&rec.vm);
        let steps = async {
            slow.restore(&rdir).await.map_err(|e| api_error(id, e))?;
            api.resume().await.map_err(|e| api_error(id, e))
        };
        let vm = self.finish_start(rec, proc, steps).await?;
        tracing::info!(pid = vm.pid, "vm restored");
        Ok(vm)
    }
}

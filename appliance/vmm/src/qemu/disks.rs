//! The disks of a QEMU VM: its qcow2 overlay, the backing chain, and the descriptors opened
//! for the jailed QEMU.

use super::*;

/// The descriptors opened for a new QEMU ([`cmdline::Fds`]) and their owners, closed once it
/// has been spawned.
#[derive(Default)]
pub(super) struct OpenedFds {
    pub(super) fds: cmdline::Fds,
    pub(super) owned: Vec<OwnedFd>,
}

impl OpenedFds {
    pub(super) fn keep(&mut self, fd: OwnedFd) -> i32 {
        let raw = fd.as_raw_fd();
        self.owned.push(fd);
        raw
    }
}

/// What a new VM starts from.
#[derive(Clone, Copy)]
pub(super) enum Origin<'a> {
    /// A fresh boot.
    Boot(&'a BootSpec),
    /// A clone of a snapshot, with the clone's own NIC (if the snapshot's VM had one).
    Restore(&'a Snapshot, Option<&'a NicSpec>),
}

impl QemuDriver {
    /// A qcow2 overlay `<dir>/overlay.qcow2` on `backing` (of format `backing_fmt`).
    pub(super) async fn create_overlay(
        &self,
        dir: &Path,
        backing: &Path,
        backing_fmt: &str,
        size: Option<u64>,
    ) -> Result<PathBuf, DriverError> {
        let o = dir.join(files::OVERLAY);
        let args: Vec<String> = ["create", "-q", "-f", "qcow2", "-F", backing_fmt, "-b"]
            .into_iter()
            .map(String::from)
            .chain([backing.display().to_string(), o.display().to_string()])
            .chain(size.map(|b| b.to_string()))
            .collect();
        process::run(&self.cfg.qemu_img, &args).await?;
        Ok(o)
    }

    /// The layers under `overlay` (itself first), as `qemu-img info --backing-chain` reads them.
    pub(super) async fn backing_chain(&self, overlay: &Path) -> Result<Vec<(PathBuf, &'static str)>, DriverError> {
        let path = overlay.display().to_string();
        let out =
            process::run_output(&self.cfg.qemu_img, &["info", "-U", "--backing-chain", "--output=json", &path]).await?;
        let infos: Vec<serde_json::Value> = serde_json::from_slice(&out)
            .map_err(|e| DriverError::Invalid(format!("qemu-img info {path}: unreadable output: {e}")))?;
        infos
            .iter()
            .map(|i| {
                let file = i.get("filename").and_then(|f| f.as_str());
                let format = match i.get("format").and_then(|f| f.as_str()) {
                    Some("qcow2") => Some("qcow2"),
                    Some("raw") => Some("raw"),
                    _ => None,
                };
                match (file, format) {
                    (Some(f), Some(fmt)) => Ok((PathBuf::from(f), fmt)),
                    _ => {
                        Err(DriverError::Invalid(format!("qemu-img info {path}: a layer without file or format: {i}")))
                    }
                }
            })
            .collect()
    }

    /// Opens everything QEMU needs (it reaches none of our paths): listening sockets at their
    /// usual names, kernel and initrd, the disks and their backing chain, the TAP, the
    /// incoming migration stream.
    pub(super) async fn open_fds(
        &self,
        vm: &Vm,
        sock_dir: &Path,
        overlay: Option<&Path>,
        origin: Origin<'_>,
        owner: Option<(u32, u32)>,
    ) -> Result<OpenedFds, DriverError> {
        let mut o = OpenedFds::default();
        let listen = |name: &str| -> Result<OwnedFd, DriverError> {
            let path = sock_dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(DriverError::io(format!("removing {}", path.display()), e)),
            }
            let l = std::os::unix::net::UnixListener::bind(&path)
                .map_err(|e| DriverError::io(format!("vm {}: listening on {}", vm.id, path.display()), e))?;
            Ok(OwnedFd::from(l))
        };
        o.fds.qmp = o.keep(listen(files::QMP)?);
        o.fds.console = o.keep(listen(files::CONSOLE_SOCK)?);
        o.fds.agent = o.keep(listen(files::AGENT_SERIAL)?);
        let open = |path: &Path, write: bool| -> Result<OwnedFd, DriverError> {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(path)
                .map(OwnedFd::from)
                .map_err(|e| DriverError::io(format!("vm {}: opening {}", vm.id, path.display()), e))
        };
        if !self.cfg.firmware_only {
            o.fds.kernel = Some(o.keep(open(&vm.spec.kernel, false)?));
            o.fds.initrd = Some(o.keep(open(&vm.spec.initrd, false)?));
        }
        if let Some(rootfs) = &vm.spec.rootfs {
            let fd = o.keep(open(rootfs, false)?);
            o.fds.rootfs = Some(DiskLayer { fd, format: "raw", path: rootfs.clone() });
        }
        if let Some(top) = overlay {
            for (i, (path, format)) in self.backing_chain(top).await?.into_iter().enumerate() {
                let fd = o.keep(open(&path, i == 0)?);
                o.fds.overlay.push(DiskLayer { fd, format, path });
            }
        }
        if let Some(nic) = &vm.spec.nic {
            let tap = crate::jail::open_tap(&nic.tap, nic.netns_path().as_deref()).map_err(JailError::from)?;
            o.fds.tap = Some(o.keep(tap));
        }
        if let Origin::Restore(snap, _) = origin {
            // Non-blocking, so a FIFO without a writer cannot hang the open; QEMU sets the
            // descriptor's mode itself.
            let state = snap.dir.join(files::STATE);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&state)
                .map_err(|e| DriverError::io(format!("vm {}: opening {}", vm.id, state.display()), e))?;
            o.fds.incoming = Some(o.keep(OwnedFd::from(f)));
        }
        o.fds.memory = match origin {
            Origin::Boot(spec) if spec.ram == Ram::SharedFile => {
                let size = spec.size.memory_mib() << 20;
                Some(o.keep(memory::create_ram_file(&vm.dir.join(files::MEMORY), size, owner)?))
            }
            Origin::Restore(snap, _) if snap.spec.ram == Ram::SharedFile => {
                Some(o.keep(self.shared_ram.clone_fd(&snap.dir.join(files::MEMORY))?))
            }
            _ => None,
        };
        Ok(o)
    }
}

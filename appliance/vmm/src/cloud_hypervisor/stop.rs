//! Stopping a cloud-hypervisor VM: an ACPI power-off within a deadline, then the kill.

use super::*;

impl CloudHypervisor {
    pub(super) async fn shutdown_within(&self, vm: &Vm, timeout: Duration) -> Result<(), DriverError> {
        self.check_owned(vm)?;
        if vm.state == VmState::Creating {
            // No guest to ask yet.
            return self.kill_now(vm).await;
        }
        let mut proc = self.take_process(vm);
        let t0 = Instant::now();
        let deadline = t0 + timeout;
        if proc.is_running() {
            let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            // 1. The guest control port: silkd has guest-init power off, and cloud-hypervisor
            //    exits with the guest. A VM without a reachable guest fails the dial at once.
            let check = self.peer_check(vm);
            let budget = crate::agent::control_budget(timeout);
            let path = match crate::agent::request_poweroff(&vm.vsock_socket, budget, check.as_ref()).await {
                Ok(()) => "control",
                Err(e) => {
                    // 2. The REST API.
                    tracing::info!(
                        error = %crate::error_chain(&e),
                        "control channel failed; falling back to vm.shutdown"
                    );
                    let api = ApiClient::new(&vm.control_socket, left().min(self.cfg.api_timeout), check.clone());
                    if let Err(e) = api.shutdown_vm().await {
                        tracing::warn!(error = %crate::error_chain(&e), "vm.shutdown failed; stopping the VMM anyway");
                    }
                    let api = ApiClient::new(&vm.control_socket, left().min(self.cfg.api_timeout), check.clone());
                    if let Err(e) = api.shutdown_vmm().await {
                        tracing::warn!(error = %crate::error_chain(&e), "vmm.shutdown failed; will kill");
                    }
                    "vm.shutdown"
                }
            };
            if proc.wait_exit(left()).await {
                tracing::info!(path, ms = t0.elapsed().as_millis() as u64, "cloud-hypervisor exited");
            } else {
                // 3. SIGKILL, below.
                tracing::warn!(path, ?timeout, "cloud-hypervisor still running after shutdown; killing");
            }
        }
        if let Err(e) = proc.kill().await {
            // Keep our handle so a later kill() can retry.
            self.procs().insert(vm.id.clone(), proc);
            return Err(process_error(&vm.id, e));
        }
        self.consoles().remove(&vm.id);
        self.remove_dir(&vm.dir)?;
        tracing::info!("vm shut down");
        Ok(())
    }

    /// Where this driver's VM processes are found besides their records (cloud-hypervisor
    /// writes no pid file).
    pub(super) fn finder(&self) -> lifecycle::Finder<'_> {
        lifecycle::Finder { pidfile: None, cgroups: self.cfg.jail.cgroups() }
    }

    /// SIGKILLs the VM's process — for a `creating` VM also any process naming its directory
    /// (its pid may never have been recorded) — and removes the directory.
    pub(super) async fn kill_now(&self, vm: &Vm) -> Result<(), DriverError> {
        self.check_owned(vm)?;
        // The caller's copy may predate the pid being recorded.
        let vm = &lifecycle::freshest(vm);
        let mut proc = self.take_process(vm);
        if let Err(e) = proc.kill().await {
            self.procs().insert(vm.id.clone(), proc);
            return Err(process_error(&vm.id, e));
        }
        if vm.state == VmState::Creating || vm.pid == 0 {
            let rest = lifecycle::vm_processes(&vm.dir, None, &self.finder());
            if !lifecycle::kill_all(&rest, KILL_WAIT).await {
                return Err(DriverError::Timeout {
                    vm: vm.id.clone(),
                    what: format!("processes {rest:?} of a half-created vm to die after SIGKILL"),
                    after: KILL_WAIT,
                });
            }
        }
        self.consoles().remove(&vm.id);
        self.remove_dir(&vm.dir)?;
        tracing::info!(vm = %vm.id, pid = vm.pid, "vm killed");
        Ok(())
    }
}

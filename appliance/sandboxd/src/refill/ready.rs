//! Readying a VM restored from a snapshot before anyone uses it: silkd answers, an egress
//! clone gets its own address, the guest RNG is reseeded and the guest clock set (a snapshot
//! carries the RNG state and the time of the moment it was taken); and the clock of a warm VM
//! resumed by a claim.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument as _;
use vmm::jail::CpuWeight;
use vmm::{Driver, RestoreOptions, Snapshot, Vm, VmId};

use super::{inc, nic_for, prefix_for, probe, unstarted, Refill, RefillError, NET_CONFIG_OUTPUT_CAP};
use crate::pool::PoolKey;

/// How long setting a resumed guest's clock may take.
const SET_CLOCK_BUDGET: Duration = Duration::from_secs(5);

/// Restores a VM of `key` from `snap` and readies it like a pool clone: silkd answers, an
/// egress lane's VM gets its own NIC and address, the guest RNG is reseeded. A VM that fails a
/// step is destroyed. Pool clones come from the golden; a fork's children and claims from a
/// checkpoint come from their own snapshot.
pub async fn restore_ready(cx: &Refill, key: &PoolKey, snap: &Snapshot, weight: CpuWeight) -> Result<Vm, RefillError> {
    let id = VmId::generate(&prefix_for(&key.hash()));
    let nic = nic_for(cx, key.net(), &id).await?;
    let opts = RestoreOptions { nic: nic.as_ref().map(|(_, n)| n.clone()) };
    let vm = match cx.driver().restore_with(snap, &id, &opts).await {
        Ok(vm) => vm,
        Err(source) => {
            unstarted(cx, &id, nic.as_ref()).await;
            return Err(RefillError::Driver { what: "restoring from a snapshot", source });
        }
    };
    weigh(cx, &vm, weight).await;
    let vm = probe(cx, vm, cx.timing.clone_probe).await?;
    if let Some((lease, _)) = &nic {
        if let Err(e) = readdress(cx, &vm, lease).await {
            inc(&cx.metrics().network_failures);
            cx.vms.destroy(&vm).await;
            return Err(e);
        }
    }
    match reseed(cx, &vm).await {
        Ok(()) => Ok(vm),
        Err(e) => {
            inc(&cx.metrics().clone_reseed_failures);
            cx.vms.destroy(&vm).await;
            Err(e)
        }
    }
}

/// Re-addresses a clone's `eth0` to its own lease (the snapshot carries the golden's MAC and
/// address): `guest-init net-config` through silkd, within the clone probe's budget.
async fn readdress(cx: &Refill, vm: &Vm, lease: &vmnet::Lease) -> Result<(), RefillError> {
    let net = cx.vms.net.as_ref().ok_or(RefillError::NoNetwork)?;
    let argv = net.net_config_argv(lease);
    let shown = argv.join(" ");
    let args: Vec<&str> = argv.iter().map(String::as_str).collect();
    let work = async {
        agent(cx, vm, "dialling silkd to re-address the clone")
            .await?
            .with_output_cap(NET_CONFIG_OUTPUT_CAP)
            .exec(&args, silkd_client::ExecOptions::default(), b"")
            .await
            .map_err(|source| RefillError::NetConfig { argv: shown.clone(), source })
    };
    let out = match tokio::time::timeout(cx.timing.clone_probe, work).await {
        Ok(r) => r?,
        Err(_) => return Err(RefillError::NetConfig { argv: shown, source: no_answer() }),
    };
    if out.code != 0 {
        let stderr: String = String::from_utf8_lossy(&out.stderr).trim().chars().take(512).collect();
        return Err(RefillError::NetConfigExit { argv: shown, code: out.code, stderr });
    }
    tracing::debug!(vm = %vm.id, ip = %lease.ip, "clone re-addressed");
    Ok(())
}

/// A connection to silkd in `vm`; `what` names the step in the error.
async fn agent(
    cx: &Refill,
    vm: &Vm,
    what: &'static str,
) -> Result<silkd_client::AgentConn<vmm::AgentStream>, RefillError> {
    let stream =
        cx.driver().connect(vm, vmm::AGENT_PORT).await.map_err(|source| RefillError::Driver { what, source })?;
    Ok(silkd_client::AgentConn::new(stream))
}

/// What a silkd call that outlived its budget failed with.
fn no_answer() -> silkd_client::ClientError {
    silkd_client::ClientError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))
}

/// Gives a fresh clone its own RNG state (host randomness into the guest pool and a forced
/// CRNG reseed) and the host's time, within the clone probe's budget. The clock is best
/// effort: a guest that cannot take it is still a sound clone.
async fn reseed(cx: &Refill, vm: &Vm) -> Result<(), RefillError> {
    let work = async {
        let mut a = agent(cx, vm, "dialling silkd to reseed").await?;
        a.reseed_from_host().await.map_err(|source| RefillError::Reseed { source })?;
        if let Err(e) = a.set_clock_from_host().await {
            tracing::warn!(vm = %vm.id, error = %e, "the clone's clock was not set");
        }
        Ok(())
    };
    match tokio::time::timeout(cx.timing.clone_probe, work).await {
        Ok(r) => r,
        Err(_) => Err(RefillError::Reseed { source: no_answer() }),
    }
}

/// Puts a VM just made at `weight` (a VM made for the pool runs in the background; a VM's leaf
/// starts at the normal weight). Best effort: a VM that keeps its weight is still sound.
pub(super) async fn weigh(cx: &Refill, vm: &Vm, weight: CpuWeight) {
    if weight != CpuWeight::Normal {
        if let Err(e) = cx.driver().set_cpu_weight(vm, weight).await {
            tracing::warn!(vm = %vm.id, error = %vmm::error_chain(&e), "the VM's CPU weight was not set");
        }
    }
}

/// A warm VM a claim has just resumed becomes a user's: its guest clock, which stood still while
/// it waited, is set to the host's (the claim raised its CPU weight before the resume). On a
/// task of its own: the claim does not wait, and it is done well before a client's first
/// request reaches the guest.
pub fn handed_out(driver: Arc<dyn Driver>, vm: Vm) {
    let span = tracing::debug_span!("handed_out", vm = %vm.id);
    tokio::spawn(
        async move {
            let work = async {
                let stream = driver.connect(&vm, vmm::AGENT_PORT).await.map_err(|e| vmm::error_chain(&e))?;
                let mut a = silkd_client::AgentConn::new(stream);
                a.set_clock_from_host().await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(SET_CLOCK_BUDGET, work).await {
                Ok(Ok(())) => tracing::debug!("guest clock set"),
                Ok(Err(e)) => tracing::warn!(error = %e, "the resumed guest's clock was not set"),
                Err(_) => tracing::warn!("the resumed guest's clock was not set: no answer in 5 s"),
            }
        }
        .instrument(span),
    );
}

//! [`Network`]: the bridge, the lease table and the TAPs of one [`NetConfig`].
//!
//! Typical use by the provider, per VM: [`Network::allocate`] → [`Network::create_tap`] → boot
//! QEMU with the lease's TAP/MAC/IP (`vmm::NicSpec`) → pod IP = `lease.ip`; on delete
//! [`Network::delete_tap`] → [`Network::release`]. A clone gets its own lease and TAP, is restored
//! with them, and then runs [`Network::net_config_argv`] in the guest (the snapshot still carries
//! the parent's MAC and IP).
//!
//! Lease methods are synchronous (a small file under a `flock`); link methods are async and run
//! on a dedicated thread inside [`NetConfig::netns`].

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use tracing::Instrument;

use crate::config::{valid_ifname, NetConfig};
use crate::ipam::{Lease, LeaseStore, Mac};
use crate::{link, netns, tap, VmnetError, GUEST_INIT};

/// VM networking of one bridge and address range.
#[derive(Debug, Clone)]
pub struct Network {
    cfg: NetConfig,
    store: LeaseStore,
}

impl Network {
    /// Validates `cfg`; touches nothing.
    pub fn new(cfg: NetConfig) -> Result<Self, VmnetError> {
        cfg.validate()?;
        let store = LeaseStore::new(cfg.leases_path.clone());
        Ok(Network { cfg, store })
    }

    /// [`Network::new`] + creates the bridge if missing, with the gateway address, up (inside
    /// `cfg.netns` when set). Idempotent.
    pub async fn ensure(cfg: &NetConfig) -> Result<Self, VmnetError> {
        let net = Network::new(cfg.clone())?;
        let (bridge, gw, prefix) = (cfg.bridge.clone(), cfg.gateway(), cfg.prefix_len());
        let span = tracing::info_span!("vmnet_ensure", bridge = %bridge, netns = ?cfg.netns);
        netns::run_in(cfg.netns.as_deref(), move || async move {
            let h = link::connect()?;
            link::ensure_bridge(&h, &bridge, gw, prefix).await.map(drop)
        })
        .instrument(span)
        .await?;
        tracing::debug!(bridge = %cfg.bridge, gateway = %gw, "bridge ready");
        Ok(net)
    }

    /// The configuration.
    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// The gateway (the bridge's address).
    pub fn gateway(&self) -> Ipv4Addr {
        self.cfg.gateway()
    }

    /// The lease of `vm_id`, allocated (and persisted) if it has none. Idempotent.
    pub fn allocate(&self, vm_id: &str) -> Result<Lease, VmnetError> {
        let lease = self.store.update(|t| t.allocate(&self.cfg, vm_id))?;
        tracing::debug!(vm = vm_id, ip = %lease.ip, mac = %lease.mac, tap = %lease.tap, "lease");
        Ok(lease)
    }

    /// Drops the lease of `vm_id`; returns it (`None` if it had none).
    pub fn release(&self, vm_id: &str) -> Result<Option<Lease>, VmnetError> {
        let old = self.store.update(|t| {
            let old = t.release(vm_id);
            let dirty = old.is_some();
            Ok((old, dirty))
        })?;
        if let Some(l) = &old {
            tracing::debug!(vm = vm_id, ip = %l.ip, "lease released");
        }
        Ok(old)
    }

    /// The lease of `vm_id`, if any.
    pub fn lookup(&self, vm_id: &str) -> Result<Option<Lease>, VmnetError> {
        Ok(self.store.load()?.leases.remove(vm_id))
    }

    /// The VM id and lease holding `mac`, if any.
    pub fn lookup_by_mac(&self, mac: &Mac) -> Result<Option<(String, Lease)>, VmnetError> {
        Ok(self.store.load()?.leases.into_iter().find(|(_, l)| l.mac == *mac))
    }

    /// Every lease, by VM id.
    pub fn leases(&self) -> Result<BTreeMap<String, Lease>, VmnetError> {
        Ok(self.store.load()?.leases)
    }

    /// The guest's `ip/prefix` for `lease`, e.g. `10.88.0.5/24`.
    pub fn ip_cidr(&self, lease: &Lease) -> String {
        lease.ip_cidr(self.cfg.prefix_len())
    }

    /// The argv that re-addresses a clone's `eth0` through the agent:
    /// `[/.chrysalis/guest-init, net-config, <ip/prefix>, <gateway>, <mac>]`.
    pub fn net_config_argv(&self, lease: &Lease) -> Vec<String> {
        vec![
            GUEST_INIT.to_string(),
            "net-config".to_string(),
            self.ip_cidr(lease),
            self.gateway().to_string(),
            lease.mac.to_string(),
        ]
    }

    /// Creates the persistent TAP of `lease` (if missing), enslaves it to the bridge with learning
    /// off and the lease's MAC pinned to it ([`link::attach_pinned_up`]), and brings it up, inside
    /// the netns. The bridge must exist ([`Network::ensure`]). Idempotent while no QEMU holds it.
    pub async fn create_tap(&self, lease: &Lease) -> Result<(), VmnetError> {
        let (name, bridge, mac) = (lease.tap.clone(), self.cfg.bridge.clone(), lease.mac.0);
        if !valid_ifname(&name) {
            return Err(VmnetError::Config(format!("tap name {name:?} is not a valid interface name")));
        }
        netns::run_in(self.cfg.netns.as_deref(), move || async move {
            let h = link::connect()?;
            let br = link::get(&h, &bridge)
                .await?
                .filter(|l| l.kind.as_deref() == Some("bridge"))
                .ok_or_else(|| VmnetError::Config(format!("bridge {bridge} is missing: call Network::ensure first")))?;
            tap::create_persistent(&name)?;
            link::attach_pinned_up(&h, &name, br.index, mac).await
        })
        .await?;
        tracing::debug!(tap = %lease.tap, bridge = %self.cfg.bridge, "tap ready");
        Ok(())
    }

    /// Deletes TAP `name` (inside the netns); `Ok(false)` if it did not exist. Refuses to delete
    /// a link that is not a TUN/TAP device.
    pub async fn delete_tap(&self, name: &str) -> Result<bool, VmnetError> {
        if !valid_ifname(name) {
            return Err(VmnetError::Config(format!("tap name {name:?} is not a valid interface name")));
        }
        let n = name.to_string();
        let deleted = netns::run_in(self.cfg.netns.as_deref(), move || async move {
            let h = link::connect()?;
            link::delete(&h, &n, "tun").await
        })
        .await?;
        tracing::debug!(tap = name, deleted, "tap removed");
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_through_the_network_api() {
        let d = tempfile::tempdir().expect("tmp");
        let cfg = NetConfig::new("10.88.0.0/24".parse().expect("cidr"), d.path().join("leases.json"));
        let net = Network::new(cfg).expect("net");
        let a = net.allocate("vm-a").expect("a");
        assert_eq!(net.lookup("vm-a").expect("lookup"), Some(a.clone()));
        assert_eq!(net.lookup_by_mac(&a.mac).expect("by mac"), Some(("vm-a".to_string(), a.clone())));
        assert_eq!(net.leases().expect("all").len(), 1);
        assert_eq!(net.ip_cidr(&a), "10.88.0.2/24");
        assert_eq!(
            net.net_config_argv(&a),
            vec![
                "/.chrysalis/guest-init".to_string(),
                "net-config".into(),
                "10.88.0.2/24".into(),
                "10.88.0.1".into(),
                a.mac.to_string()
            ]
        );
        assert_eq!(net.release("vm-a").expect("release"), Some(a));
        assert_eq!(net.release("vm-a").expect("release"), None);
        assert_eq!(net.lookup("vm-a").expect("lookup"), None);
    }

    #[test]
    fn invalid_config_is_refused() {
        let cfg = NetConfig::new("10.88.0.0/31".parse().expect("cidr"), "/tmp/x.json");
        assert!(matches!(Network::new(cfg), Err(VmnetError::Config(_))));
    }
}

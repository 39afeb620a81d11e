//! [`Network`]: the bridge, the lease table and the TAPs of one [`NetConfig`].
//!
//! Typical use by the provider, per VM: [`Network::allocate`] → [`Network::create_tap`] → boot
//! QEMU with the lease's NIC ([`Network::nic_spec`]) → pod IP = `lease.ip`; on delete
//! [`Network::delete_tap`] → [`Network::release`]. A clone gets its own lease and TAP, is restored
//! with them, and then runs [`Network::net_config_argv`] in the guest (the snapshot still carries
//! the parent's MAC and IP).
//!
//! Lease methods are synchronous (a small file under a `flock`); link methods are async and run
//! on a dedicated thread inside [`NetConfig::netns`].
//!
//! The packet filter ([`crate::filter`]) follows the lease table: [`Network::ensure`] re-creates
//! both tables from it, and every change of a port or a lease ([`Network::attach_port`],
//! [`Network::create_tap`], [`Network::release`], [`Network::sync_filter`]) refills the sets
//! from it, under the lease file's lock, so concurrent writers never lose each other's entries.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use tracing::Instrument;

use crate::config::{valid_ifname, NetConfig};
use crate::filter::{self, FilterError};
use crate::ipam::{Lease, LeaseStore, Mac, VmPolicy};
use crate::{link, netns, tap, VmnetError, GUEST_INIT};

/// The bridge-netfilter switches that, when on, also run bridged IPv4/IPv6/ARP through the
/// `inet`/`arp` hooks (a kernel with `br_netfilter`; the appliance's has none).
const BR_NETFILTER_SYSCTLS: [&str; 3] = [
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "net/bridge/bridge-nf-call-arptables",
];

/// VM networking of one bridge and address range.
#[derive(Debug, Clone)]
pub struct Network {
    cfg: NetConfig,
    store: LeaseStore,
    /// The filter tables were installed by [`Network::ensure`]: lease and port changes refill
    /// their sets. A [`Network::new`] touches no filter (lease bookkeeping only).
    filtered: bool,
}

impl Network {
    /// Validates `cfg`; touches nothing.
    pub fn new(cfg: NetConfig) -> Result<Self, VmnetError> {
        cfg.validate()?;
        let store = LeaseStore::new(cfg.leases_path.clone());
        Ok(Network { cfg, store, filtered: false })
    }

    /// [`Network::new`] + creates the bridge if missing, with the gateway address, up, and
    /// re-creates the packet filter's two tables from the lease table in one transaction (inside
    /// `cfg.netns` when set). With an uplink, IPv4 forwarding is turned on. Idempotent.
    pub async fn ensure(cfg: &NetConfig) -> Result<Self, VmnetError> {
        let mut net = Network::new(cfg.clone())?;
        net.filtered = true;
        let (bridge, gw, prefix) = (cfg.bridge.clone(), cfg.gateway(), cfg.prefix_len());
        let span = tracing::info_span!("vmnet_ensure", bridge = %bridge, netns = ?cfg.netns);
        let (store, c) = (net.store.clone(), cfg.clone());
        netns::run_in(cfg.netns.as_deref(), move || async move {
            let h = link::connect()?;
            link::ensure_bridge(&h, &bridge, gw, prefix).await?;
            install_filter(&c, &store)
        })
        .instrument(span)
        .await?;
        tracing::info!(bridge = %cfg.bridge, gateway = %gw, host_allow = ?cfg.filter.host_allow, uplink = ?cfg.filter.uplink, "bridge and VM packet filter ready");
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

    /// The lease of `vm_id` (allocated if it has none) with `policy` (its shared group, its
    /// egress). Egress on a network without an uplink is refused. The filter follows at the next
    /// [`Network::create_tap`] / [`Network::attach_port`] / [`Network::sync_filter`].
    pub fn allocate_with(&self, vm_id: &str, policy: &VmPolicy) -> Result<Lease, VmnetError> {
        if policy.egress && self.cfg.filter.uplink.is_none() {
            return Err(FilterError::NoUplink { vm: vm_id.to_owned() }.into());
        }
        if let Some(g) = &policy.group {
            if !filter::valid_group(g) {
                return Err(FilterError::Group(g.clone()).into());
            }
        }
        let lease = self.store.update(|t| {
            let (_, allocated) = t.allocate(&self.cfg, vm_id)?;
            let changed = t.set_policy(vm_id, policy);
            let lease = t.leases.get(vm_id).cloned().ok_or_else(|| VmnetError::Worker("lease vanished".into()))?;
            Ok((lease, allocated || changed))
        })?;
        tracing::debug!(vm = vm_id, ip = %lease.ip, group = ?lease.group, egress = lease.egress, "lease");
        Ok(lease)
    }

    /// Drops the lease of `vm_id` and its filter entries; returns it (`None` if it had none).
    pub fn release(&self, vm_id: &str) -> Result<Option<Lease>, VmnetError> {
        let old = self.store.update(|t| {
            let old = t.release(vm_id);
            let dirty = old.is_some();
            Ok((old, dirty))
        })?;
        if let Some(l) = old.as_ref().filter(|_| self.filtered) {
            tracing::debug!(vm = vm_id, ip = %l.ip, "lease released");
            let (store, table) = (self.store.clone(), self.cfg.table.clone());
            netns::run_in_blocking(self.cfg.netns.as_deref(), move || async move { sync_elements(&store, &table) })?;
        }
        Ok(old)
    }

    /// Refills the filter's sets from the lease table (one transaction); nothing for a network
    /// made by [`Network::new`].
    pub async fn sync_filter(&self) -> Result<(), VmnetError> {
        if !self.filtered {
            return Ok(());
        }
        let (store, table) = (self.store.clone(), self.cfg.table.clone());
        netns::run_in(self.cfg.netns.as_deref(), move || async move { sync_elements(&store, &table) }).await
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

    /// The NIC a VM holding `lease` boots or is restored with: the lease's TAP and MAC, its
    /// address in this range, the gateway, and the network's netns.
    pub fn nic_spec(&self, lease: &Lease) -> vmm::NicSpec {
        vmm::NicSpec {
            tap: lease.tap.clone(),
            mac: lease.mac.to_string(),
            netns: self.cfg.netns.clone(),
            ip_cidr: self.ip_cidr(lease),
            gateway: self.gateway().to_string(),
        }
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

    /// Creates the persistent TAP of `lease` (if missing) and attaches it ([`Network::attach_port`]),
    /// inside the netns. The bridge must exist ([`Network::ensure`]). Idempotent while no QEMU
    /// holds it.
    pub async fn create_tap(&self, lease: &Lease) -> Result<(), VmnetError> {
        self.port_up(lease, true).await?;
        tracing::debug!(tap = %lease.tap, bridge = %self.cfg.bridge, "tap ready");
        Ok(())
    }

    /// Refills the filter's sets (so the port is bound to `lease`'s MAC and IP before it carries
    /// a frame), then enslaves the existing link named `lease.tap` to the bridge with learning
    /// off, the lease's MAC pinned to it, `isolated` unless the lease has a shared group
    /// ([`link::attach_pinned_up`]), and brings it up, inside the netns. The TAP of
    /// [`Network::create_tap`], or a veth standing in for one in tests.
    pub async fn attach_port(&self, lease: &Lease) -> Result<(), VmnetError> {
        self.port_up(lease, false).await
    }

    async fn port_up(&self, lease: &Lease, make_tap: bool) -> Result<(), VmnetError> {
        let (name, bridge, mac) = (lease.tap.clone(), self.cfg.bridge.clone(), lease.mac.0);
        if !valid_ifname(&name) {
            return Err(VmnetError::Config(format!("tap name {name:?} is not a valid interface name")));
        }
        let isolated = lease.group.is_none();
        let (store, filtered, table) = (self.store.clone(), self.filtered, self.cfg.table.clone());
        netns::run_in(self.cfg.netns.as_deref(), move || async move {
            let h = link::connect()?;
            let br = link::get(&h, &bridge)
                .await?
                .filter(|l| l.kind.as_deref() == Some("bridge"))
                .ok_or_else(|| VmnetError::Config(format!("bridge {bridge} is missing: call Network::ensure first")))?;
            if make_tap {
                tap::create_persistent(&name)?;
            }
            if filtered {
                sync_elements(&store, &table)?;
            }
            link::attach_pinned_up(&h, &name, br.index, mac, isolated).await
        })
        .await
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

/// Re-creates both filter tables from the lease table (under its lock), in the calling thread's
/// namespace. Turns IPv4 forwarding on when there is an uplink, and bridge netfilter off inside
/// a namespace of our own (warns about it in the host's: it would run bridged VM↔VM traffic
/// through the `inet` forward hook, where shared groups are not known).
fn install_filter(cfg: &NetConfig, store: &LeaseStore) -> Result<(), VmnetError> {
    for key in BR_NETFILTER_SYSCTLS {
        let path = format!("/proc/sys/{key}");
        match std::fs::read_to_string(&path).map(|v| v.trim() == "1") {
            Ok(true) if cfg.netns.is_some() => {
                filter::sysctl_set(key, "0");
            }
            Ok(true) => tracing::warn!(sysctl = key, "bridge netfilter is on: VMs of a shared group may not reach each other (the appliance kernel has no br_netfilter)"),
            _ => {}
        }
    }
    if cfg.filter.uplink.is_some() {
        if let Some(old) = filter::sysctl_set("net/ipv4/ip_forward", "1") {
            if old != "1" {
                tracing::info!("IPv4 forwarding turned on for VM egress");
            }
        }
    }
    store.update(|t| {
        let leases: Vec<&Lease> = t.leases.values().collect();
        let script = filter::render_tables(cfg, &leases);
        filter::apply("VM filter tables", &script)?;
        Ok(((), false))
    })
}

/// Refills the sets of the filter tables named `table` from the lease table, under its lock.
fn sync_elements(store: &LeaseStore, table: &str) -> Result<(), VmnetError> {
    store.update(|t| {
        let leases: Vec<&Lease> = t.leases.values().collect();
        filter::apply("VM filter sets", &filter::render_elements(table, &leases))?;
        Ok(((), false))
    })
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
        let nic = net.nic_spec(&a);
        assert_eq!(
            (nic.tap.as_str(), nic.mac.clone(), nic.ip_cidr.as_str(), nic.gateway.as_str(), nic.netns.as_deref()),
            (a.tap.as_str(), a.mac.to_string(), "10.88.0.2/24", "10.88.0.1", None)
        );
        assert!(nic.validate().is_ok(), "{nic:?}");
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

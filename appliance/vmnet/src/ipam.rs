//! IP address management: one [`Lease`] (`ip`, `mac`, `tap`) per VM id, persisted as JSON.
//!
//! File shape (`leases_path`, mode 0600, replaced atomically: temp file + fsync + rename + fsync
//! of the directory), guarded by an advisory `flock` on `<leases_path>.lock` so several
//! processes may share it:
//!
//! ```json
//! {"version": 1, "cidr": "10.88.0.0/24", "last": "10.88.0.7",
//!  "leases": {"vk-ns-pod": {"ip": "10.88.0.7", "mac": "02:3f:…", "tap": "ct-3fa9c01b22de"}}}
//! ```
//!
//! Allocation hands out the next free host after the most recently allocated one (wrapping), so a
//! released address is reused only after the rest of the range was used: stale neighbour entries
//! of a departed VM rarely meet its successor. The network address, the gateway (first host) and
//! the broadcast address are never leased. The MAC (`02:` + 5 bytes, locally administered,
//! unicast) and the TAP name (the network's `tap_prefix`, default `ct-`, + 12 hex ≤ 15 chars, the
//! Linux limit) derive from a SHA-256 of
//! the VM id; on a (astronomically unlikely) clash with another lease a counter is mixed in.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ipnet::Ipv4Net;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::NetConfig;
use crate::VmnetError;

pub use crate::config::TAP_PREFIX;

/// An Ethernet MAC address; text form `02:ab:cd:ef:01:23`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Mac(pub [u8; 6]);

impl Mac {
    /// Locally administered (bit 1 of the first octet) and unicast (bit 0 clear).
    pub fn is_local_unicast(&self) -> bool {
        self.0[0] & 0b11 == 0b10
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// A string that is not `xx:xx:xx:xx:xx:xx`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a MAC address (xx:xx:xx:xx:xx:xx)")]
pub struct MacParseError(pub String);

impl FromStr for Mac {
    type Err = MacParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for o in out.iter_mut() {
            let p = parts.next().ok_or_else(|| MacParseError(s.into()))?;
            if p.len() != 2 {
                return Err(MacParseError(s.into()));
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| MacParseError(s.into()))?;
        }
        if parts.next().is_some() {
            return Err(MacParseError(s.into()));
        }
        Ok(Mac(out))
    }
}

impl TryFrom<String> for Mac {
    type Error = MacParseError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Mac> for String {
    fn from(m: Mac) -> String {
        m.to_string()
    }
}

/// One VM's network identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// Its IPv4 address (the pod IP).
    pub ip: Ipv4Addr,
    /// Its NIC's MAC address.
    pub mac: Mac,
    /// The host TAP device QEMU opens (`ct-<12 hex>`).
    pub tap: String,
    /// The shared network group (e.g. `<namespace>/<group>`): VMs of one group may talk to each
    /// other; `None` (the default): this VM talks to no other VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Whether this VM may reach the outside through the node's uplink (default: no).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub egress: bool,
}

/// What a VM may reach beyond its own lease (see [`crate::filter`]). Default: nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmPolicy {
    /// The shared network group, if any.
    pub group: Option<String>,
    /// Outbound through the uplink.
    pub egress: bool,
}

impl Lease {
    /// `ip/prefix` for the guest, e.g. `10.88.0.5/24`.
    pub fn ip_cidr(&self, prefix_len: u8) -> String {
        format!("{}/{prefix_len}", self.ip)
    }
}

/// True for a usable VM id: 1..=128 printable ASCII characters, no whitespace.
pub fn valid_vm_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The MAC and TAP name (prefix [`TAP_PREFIX`]) of `vm_id` (`salt` 0 normally; > 0 only to
/// escape a clash).
pub fn derive(vm_id: &str, salt: u32) -> (Mac, String) {
    derive_with(TAP_PREFIX, vm_id, salt)
}

/// [`derive`] with the TAP name prefix of a network ([`NetConfig::tap_prefix`]).
pub fn derive_with(tap_prefix: &str, vm_id: &str, salt: u32) -> (Mac, String) {
    let mut h = Sha256::new();
    h.update(vm_id.as_bytes());
    if salt > 0 {
        h.update(b"#");
        h.update(salt.to_be_bytes());
    }
    let d = h.finalize();
    let mac = Mac([0x02, d[0], d[1], d[2], d[3], d[4]]);
    let tap = format!("{tap_prefix}{}", hex::encode(&d[5..11]));
    (mac, tap)
}

/// The persisted lease table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseTable {
    /// Format version (1).
    #[serde(default = "one")]
    pub version: u32,
    /// The range the leases were made from (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<Ipv4Net>,
    /// The most recently allocated address (allocation continues after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<Ipv4Addr>,
    /// Leases by VM id.
    #[serde(default)]
    pub leases: BTreeMap<String, Lease>,
}

fn one() -> u32 {
    1
}

/// The leasable hosts of `cidr`: after the gateway, before the broadcast address.
pub fn leasable(cidr: &Ipv4Net) -> std::ops::RangeInclusive<u32> {
    let net = u32::from(cidr.network());
    let bcast = u32::from(cidr.broadcast());
    net.saturating_add(2)..=bcast.saturating_sub(1)
}

impl LeaseTable {
    /// The lease of `vm_id`, allocating one from `cfg.cidr` if it has none (or one outside the
    /// range). Returns the lease and whether the table changed.
    pub fn allocate(&mut self, cfg: &NetConfig, vm_id: &str) -> Result<(Lease, bool), VmnetError> {
        if !valid_vm_id(vm_id) {
            return Err(VmnetError::Config(format!("vm id {vm_id:?} is not 1..=128 printable characters")));
        }
        let range = leasable(&cfg.cidr);
        if let Some(l) = self.leases.get(vm_id) {
            if range.contains(&u32::from(l.ip)) {
                return Ok((l.clone(), false));
            }
        }
        self.leases.remove(vm_id);
        let used: std::collections::HashSet<u32> = self.leases.values().map(|l| u32::from(l.ip)).collect();
        let (start, end) = (*range.start(), *range.end());
        let first = match self.last.map(u32::from) {
            Some(last) if (start..end).contains(&last) => last + 1,
            _ => start,
        };
        let ip = (first..=end)
            .chain(start..first)
            .find(|ip| !used.contains(ip))
            .ok_or(VmnetError::Exhausted { cidr: cfg.cidr, leased: self.leases.len() })?;
        let ip = Ipv4Addr::from(ip);
        let (mac, tap) = (0u32..)
            .map(|salt| derive_with(&cfg.tap_prefix, vm_id, salt))
            .find(|(mac, tap)| !self.leases.values().any(|l| l.mac == *mac || l.tap == *tap))
            // The leases are finitely many, so some salt is free.
            .unwrap_or_else(|| derive_with(&cfg.tap_prefix, vm_id, 0));
        let lease = Lease { ip, mac, tap, group: None, egress: false };
        self.leases.insert(vm_id.to_string(), lease.clone());
        self.last = Some(ip);
        self.cidr = Some(cfg.cidr);
        Ok((lease, true))
    }

    /// Sets the policy of `vm_id`'s lease; returns whether it changed (`false` without a lease).
    pub fn set_policy(&mut self, vm_id: &str, policy: &VmPolicy) -> bool {
        match self.leases.get_mut(vm_id) {
            Some(l) if l.group != policy.group || l.egress != policy.egress => {
                l.group = policy.group.clone();
                l.egress = policy.egress;
                true
            }
            _ => false,
        }
    }

    /// Removes the lease of `vm_id`, returning it.
    pub fn release(&mut self, vm_id: &str) -> Option<Lease> {
        self.leases.remove(vm_id)
    }
}

/// The lease file and its lock.
#[derive(Debug, Clone)]
pub struct LeaseStore {
    path: PathBuf,
}

impl LeaseStore {
    /// A store at `path` (nothing is touched yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        LeaseStore { path: path.into() }
    }

    /// The lease file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".lock");
        PathBuf::from(p)
    }

    fn lock(&self, exclusive: bool) -> Result<Flock<File>, VmnetError> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| VmnetError::io("creating", dir, e))?;
        }
        let lp = self.lock_path();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lp)
            .map_err(|e| VmnetError::io("opening", &lp, e))?;
        let arg = if exclusive { FlockArg::LockExclusive } else { FlockArg::LockShared };
        Flock::lock(f, arg).map_err(|(_, errno)| VmnetError::io("locking", &lp, errno.into()))
    }

    fn read(&self) -> Result<LeaseTable, VmnetError> {
        let mut f = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(LeaseTable { version: 1, ..Default::default() })
            }
            Err(e) => return Err(VmnetError::io("opening", &self.path, e)),
        };
        let mut s = String::new();
        f.read_to_string(&mut s).map_err(|e| VmnetError::io("reading", &self.path, e))?;
        serde_json::from_str(&s).map_err(|source| VmnetError::LeaseFile { path: self.path.clone(), source })
    }

    fn write(&self, table: &LeaseTable) -> Result<(), VmnetError> {
        let mut body = serde_json::to_vec_pretty(table)
            .map_err(|source| VmnetError::LeaseFile { path: self.path.clone(), source })?;
        body.push(b'\n');
        foundation::write_atomic(&self.path, &body, foundation::SECRET_FILE)
            .map_err(|e| VmnetError::io("writing", &self.path, e))
    }

    /// Reads the table under a shared lock.
    pub fn load(&self) -> Result<LeaseTable, VmnetError> {
        let _lock = self.lock(false)?;
        self.read()
    }

    /// Read-modify-write under an exclusive lock; `f` returns its result and whether the table
    /// changed (then it is written back).
    pub fn update<R>(&self, f: impl FnOnce(&mut LeaseTable) -> Result<(R, bool), VmnetError>) -> Result<R, VmnetError> {
        let _lock = self.lock(true)?;
        let mut table = self.read()?;
        let (r, dirty) = f(&mut table)?;
        if dirty {
            self.write(&table)?;
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn cfg(cidr: &str, dir: &Path) -> NetConfig {
        NetConfig::new(cidr.parse().expect("cidr"), dir.join("net/leases.json"))
    }

    fn alloc(store: &LeaseStore, cfg: &NetConfig, id: &str) -> Result<Lease, VmnetError> {
        store.update(|t| t.allocate(cfg, id))
    }

    #[test]
    fn mac_text_round_trip() {
        let m: Mac = "02:ab:cd:ef:01:23".parse().expect("mac");
        assert_eq!(m.0, [0x02, 0xab, 0xcd, 0xef, 0x01, 0x23]);
        assert_eq!(m.to_string(), "02:ab:cd:ef:01:23");
        assert!(m.is_local_unicast());
        for bad in ["", "02:ab:cd:ef:01", "02:ab:cd:ef:01:23:45", "02:ab:cd:ef:01:2g", "2:ab:cd:ef:01:233"] {
            assert!(bad.parse::<Mac>().is_err(), "{bad}");
        }
        assert_eq!(serde_json::to_string(&m).expect("ser"), "\"02:ab:cd:ef:01:23\"");
    }

    #[test]
    fn mac_and_tap_are_deterministic_local_and_short() {
        let (m1, t1) = derive("vk-default-web-0", 0);
        let (m2, t2) = derive("vk-default-web-0", 0);
        assert_eq!((m1, &t1), (m2, &t2));
        assert!(m1.is_local_unicast(), "{m1}");
        assert_eq!(t1.len(), 15, "{t1}");
        assert!(t1.len() < libc::IFNAMSIZ);
        assert!(t1.starts_with("ct-") && t1[3..].bytes().all(|b| b.is_ascii_hexdigit()));
        let (m3, t3) = derive("vk-default-web-1", 0);
        assert_ne!(m1, m3);
        assert_ne!(t1, t3);
        let (m4, t4) = derive("vk-default-web-0", 1);
        assert_ne!((m1, t1), (m4, t4), "salt changes both");
        for i in 0..200 {
            let (m, t) = derive(&format!("vm-{i}"), 0);
            assert!(m.is_local_unicast());
            assert!(crate::config::valid_ifname(&t), "{t}");
        }
    }

    #[test]
    fn allocation_skips_network_gateway_broadcast_and_is_idempotent() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/24", d.path());
        let s = LeaseStore::new(&c.leases_path);
        let a = alloc(&s, &c, "a").expect("a");
        assert_eq!(a.ip, Ipv4Addr::new(10, 88, 0, 2), "after the gateway .1");
        assert_eq!(alloc(&s, &c, "a").expect("again"), a, "same id → same lease");
        let b = alloc(&s, &c, "b").expect("b");
        assert_eq!(b.ip, Ipv4Addr::new(10, 88, 0, 3));
        assert_eq!((a.mac, a.tap.clone()), derive("a", 0));
        assert!(alloc(&s, &c, "").is_err());
        assert!(alloc(&s, &c, "has space").is_err());
    }

    #[test]
    fn persistence_across_reopen_and_file_mode() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/24", d.path());
        let a = alloc(&LeaseStore::new(&c.leases_path), &c, "vm-a").expect("a");
        let b = alloc(&LeaseStore::new(&c.leases_path), &c, "vm-b").expect("b");
        let reopened = LeaseStore::new(&c.leases_path).load().expect("load");
        assert_eq!(reopened.leases.get("vm-a"), Some(&a));
        assert_eq!(reopened.leases.get("vm-b"), Some(&b));
        assert_eq!(reopened.last, Some(b.ip));
        assert_eq!(reopened.cidr, Some(c.cidr));
        let mode = std::fs::metadata(&c.leases_path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&c.leases_path).expect("read")).expect("json");
        assert_eq!(raw["leases"]["vm-a"]["ip"], "10.88.0.2");
        assert_eq!(raw["leases"]["vm-a"]["tap"], a.tap.as_str());
        // No temp files are left next to it.
        let names: Vec<String> = std::fs::read_dir(c.leases_path.parent().expect("dir"))
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".tmp.")), "{names:?}");
    }

    #[test]
    fn release_reuse_and_exhaustion() {
        let d = tempfile::tempdir().expect("tmp");
        // /29: .0 network, .1 gateway, .2-.6 leasable, .7 broadcast.
        let c = cfg("10.88.0.0/29", d.path());
        let s = LeaseStore::new(&c.leases_path);
        let ips: Vec<Ipv4Addr> = (0..5).map(|i| alloc(&s, &c, &format!("vm-{i}")).expect("alloc").ip).collect();
        assert_eq!(ips, (2..=6).map(|h| Ipv4Addr::new(10, 88, 0, h)).collect::<Vec<_>>());
        match alloc(&s, &c, "vm-5") {
            Err(VmnetError::Exhausted { cidr, leased }) => {
                assert_eq!(cidr, c.cidr);
                assert_eq!(leased, 5);
            }
            other => panic!("expected exhaustion, got {other:?}"),
        }
        let released = s.update(|t| Ok((t.release("vm-2"), true))).expect("release");
        assert_eq!(released.map(|l| l.ip), Some(Ipv4Addr::new(10, 88, 0, 4)));
        assert_eq!(s.update(|t| Ok((t.release("vm-2"), false))).expect("again"), None);
        assert_eq!(alloc(&s, &c, "vm-5").expect("reuse").ip, Ipv4Addr::new(10, 88, 0, 4));
        assert!(matches!(alloc(&s, &c, "vm-6"), Err(VmnetError::Exhausted { .. })));
    }

    #[test]
    fn released_addresses_are_reused_only_after_the_rest() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/29", d.path());
        let s = LeaseStore::new(&c.leases_path);
        let a = alloc(&s, &c, "a").expect("a");
        s.update(|t| Ok((t.release("a"), true))).expect("release");
        assert_eq!(alloc(&s, &c, "b").expect("b").ip, Ipv4Addr::new(10, 88, 0, 3), "not {}", a.ip);
        for id in ["c", "d", "e"] {
            alloc(&s, &c, id).expect("alloc");
        }
        assert_eq!(alloc(&s, &c, "f").expect("wraps").ip, a.ip, "wraps around to the freed .2");
    }

    #[test]
    fn smallest_range_and_out_of_range_leases() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/30", d.path());
        let s = LeaseStore::new(&c.leases_path);
        assert_eq!(alloc(&s, &c, "a").expect("a").ip, Ipv4Addr::new(10, 88, 0, 2));
        assert!(matches!(alloc(&s, &c, "b"), Err(VmnetError::Exhausted { .. })));
        // The range moves: the old lease is replaced by one from the new range.
        let c2 = NetConfig { cidr: "10.99.0.0/24".parse().expect("cidr"), ..c };
        assert_eq!(alloc(&s, &c2, "a").expect("a").ip, Ipv4Addr::new(10, 99, 0, 2));
    }

    #[test]
    fn corrupt_file_is_an_error_not_an_empty_table() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/24", d.path());
        std::fs::create_dir_all(c.leases_path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&c.leases_path, "{not json").expect("write");
        assert!(matches!(LeaseStore::new(&c.leases_path).load(), Err(VmnetError::LeaseFile { .. })));
    }

    #[test]
    fn concurrent_allocations_from_many_threads_get_distinct_addresses() {
        let d = tempfile::tempdir().expect("tmp");
        let c = cfg("10.88.0.0/24", d.path());
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    let s = LeaseStore::new(&c.leases_path);
                    (0..5).map(|j| alloc(&s, &c, &format!("t{i}-{j}")).expect("alloc").ip).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<Ipv4Addr> = handles.into_iter().flat_map(|h| h.join().expect("thread")).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 40);
        assert_eq!(LeaseStore::new(&c.leases_path).load().expect("load").leases.len(), 40);
    }

    #[test]
    fn policy_is_kept_and_old_leases_read_as_isolated() {
        let d = tempfile::tempdir().expect("tmp");
        let (c, store) = (cfg("10.88.0.0/24", d.path()), LeaseStore::new(d.path().join("net/leases.json")));
        let a = alloc(&store, &c, "a").expect("a");
        assert_eq!((a.group.as_deref(), a.egress), (None, false));
        let p = VmPolicy { group: Some("ns/g".into()), egress: true };
        assert!(store.update(|t| Ok((t.set_policy("a", &p), true))).expect("set"));
        assert!(!store.update(|t| Ok((t.set_policy("a", &p), false))).expect("same"));
        assert!(!store.update(|t| Ok((t.set_policy("nobody", &p), false))).expect("none"));
        // A re-allocation keeps the policy.
        let again = alloc(&store, &c, "a").expect("again");
        assert_eq!((again.group.as_deref(), again.egress), (Some("ns/g"), true));
        let old: Lease =
            serde_json::from_str(r#"{"ip":"10.88.0.2","mac":"02:00:00:00:00:02","tap":"ct-000000000002"}"#)
                .expect("old");
        assert_eq!((old.group, old.egress), (None, false));
        let json = serde_json::to_string(&Lease { group: None, egress: false, ..again }).expect("ser");
        assert!(!json.contains("group") && !json.contains("egress"), "{json}");
    }
}

//! Root-only: the VM packet filter ([`vmnet::filter`]) on a real bridge, every packet inside
//! network namespaces the test creates itself (deleted on drop).
//!
//! The lab: a "host" netns holding the bridge (with `Network::ensure`, so the very tables and
//! ports production makes), an "internet" netns behind the host's uplink `up0`
//! (`198.51.100.1`, also holding a LAN address `192.168.50.1` and the metadata address
//! `169.254.169.254`, and no route back to the VM range, so only a masqueraded connection can
//! succeed), and one netns per VM whose `eth0` is the far end of a veth standing in for the VM's
//! TAP (the near end carries the lease's TAP name and is attached with `Network::attach_port`).
//! VMs `a` and `b` share the group `ns/g`, `c` has no group, `e` has egress.
//!
//! Run with `cargo test -p vmnet --features netns-tests --test filter` (as root, with `nft`);
//! without the feature these tests are reported as ignored, with the reason.

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use support::{ip_in, link_json, TestNetns};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmnet::{FilterPolicy, Lease, NetConfig, Network, VmPolicy};

const GW: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const INTERNET: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const LAN: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

struct VmNs {
    ns: TestNetns,
    lease: Lease,
}

struct Lab {
    // Dropped in reverse order: VMs, then the internet, then the host.
    host: TestNetns,
    _internet: TestNetns,
    net: Network,
    _dir: tempfile::TempDir,
    vms: Vec<(String, VmNs)>,
}

impl Lab {
    async fn new(tag: &str) -> Lab {
        let host = TestNetns::new(&format!("{tag}h"));
        let internet = TestNetns::new(&format!("{tag}i"));
        let dir = tempfile::tempdir().expect("tmp");
        // The uplink: host `up0` ↔ internet `wan0`.
        ip_in(&host.name, &["link", "add", "up0", "type", "veth", "peer", "name", "wan0", "netns", &internet.name]);
        ip_in(&host.name, &["addr", "add", "198.51.100.2/24", "dev", "up0"]);
        ip_in(&host.name, &["link", "set", "up0", "up"]);
        ip_in(&host.name, &["route", "add", "default", "via", "198.51.100.1"]);
        ip_in(&internet.name, &["addr", "add", "198.51.100.1/24", "dev", "wan0"]);
        ip_in(&internet.name, &["addr", "add", "192.168.50.1/32", "dev", "wan0"]);
        ip_in(&internet.name, &["addr", "add", "169.254.169.254/32", "dev", "wan0"]);
        ip_in(&internet.name, &["link", "set", "wan0", "up"]);
        for port in [8080u16] {
            for addr in [INTERNET, LAN, METADATA] {
                serve(&internet.name, SocketAddr::new(IpAddr::V4(addr), port));
            }
        }
        let cfg = NetConfig {
            bridge: "vmbr0".into(),
            netns: Some(host.name.clone()),
            filter: FilterPolicy::parse(Some("tcp/7000"), Some("up0"), Some("203.0.113.0/24")).expect("policy"),
            ..NetConfig::new("10.77.0.0/24".parse().expect("cidr"), dir.path().join("leases.json"))
        };
        let net = Network::ensure(&cfg).await.expect("ensure: bridge and filter");
        // The host's services: 7000 is on the allow-list, 7001 is not.
        serve(&host.name, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7000));
        serve(&host.name, SocketAddr::new(IpAddr::V4(GW), 7001));
        let mut lab = Lab { host, _internet: internet, net, _dir: dir, vms: Vec::new() };
        let g = Some("ns/g".to_string());
        lab.add_vm(tag, "a", VmPolicy { group: g.clone(), egress: false }).await;
        lab.add_vm(tag, "b", VmPolicy { group: g, egress: false }).await;
        lab.add_vm(tag, "c", VmPolicy::default()).await;
        lab.add_vm(tag, "e", VmPolicy { group: None, egress: true }).await;
        lab
    }

    async fn add_vm(&mut self, tag: &str, name: &str, policy: VmPolicy) {
        let ns = TestNetns::new(&format!("{tag}{name}"));
        let lease = self.net.allocate_with(&format!("vm-{name}"), &policy).expect("lease");
        ip_in(&self.host.name, &["link", "add", &lease.tap, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]);
        ip_in(&ns.name, &["link", "set", "eth0", "address", &lease.mac.to_string()]);
        ip_in(&ns.name, &["addr", "add", &format!("{}/24", lease.ip), "dev", "eth0"]);
        ip_in(&ns.name, &["link", "set", "eth0", "up"]);
        ip_in(&ns.name, &["route", "add", "default", "via", &GW.to_string()]);
        self.net.attach_port(&lease).await.expect("attach the port");
        // The VM's own service, answering with the peer's address.
        serve(&ns.name, SocketAddr::new(IpAddr::V4(lease.ip), 9000));
        self.vms.push((name.to_string(), VmNs { ns, lease }));
    }

    fn vm(&self, name: &str) -> &VmNs {
        &self.vms.iter().find(|(n, _)| n == name).expect("vm").1
    }
}

/// Serves `addr` inside `netns` on a thread of its own, forever: each connection gets
/// `peer=<its source address>\n`. Returns once the socket is bound.
fn serve(netns: &str, addr: SocketAddr) {
    let (tx, rx) = std::sync::mpsc::channel();
    let ns = netns.to_string();
    std::thread::spawn(move || {
        let _: Result<(), _> = vmnet::netns::run_in_blocking(Some(&ns), move || async move {
            let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
            let _ = tx.send(());
            loop {
                let (mut s, peer) = l.accept().await.map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
                let _ = s.write_all(format!("peer={}\n", peer.ip()).as_bytes()).await;
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("server bound");
}

/// Connects from inside `netns` (from `src` when given) to `dst`; the server's line, or why not.
async fn connect(netns: &str, dst: SocketAddr, src: Option<Ipv4Addr>) -> Result<String, String> {
    let ns = netns.to_string();
    vmnet::netns::run_in(Some(&ns), move || async move {
        let sock = tokio::net::TcpSocket::new_v4().map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
        if let Some(src) = src {
            sock.bind(SocketAddr::new(IpAddr::V4(src), 0)).map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
        }
        let r = async {
            let mut s = sock.connect(dst).await.map_err(|e| e.to_string())?;
            let mut buf = String::new();
            s.read_to_string(&mut buf).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(buf.trim().to_string())
        };
        Ok(tokio::time::timeout(Duration::from_secs(3), r).await.unwrap_or_else(|_| Err("timed out".into())))
    })
    .await
    .expect("run_in")
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

fn nft_list(netns: &str, family: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "nft", "list", "table", family, "chrysalis"])
        .output()
        .expect("nft");
    assert!(out.status.success(), "nft list: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ------------------------------------------------------------------------------- raw frames

fn raw_socket_on(ifname: &str) -> (OwnedFd, i32) {
    // SAFETY: plain socket(2); the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, (libc::ETH_P_ALL as u16).to_be() as i32) };
    assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(ifname).expect("name");
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
    assert!(index > 0, "no {ifname}");
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid start.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
    sll.sll_ifindex = index;
    // SAFETY: binding a valid socket to a properly sized sockaddr_ll.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
    (fd, index)
}

/// Sends `frames` out of `eth0` inside `netns`.
fn send_frames(netns: &str, frames: Vec<Vec<u8>>) {
    vmnet::netns::run_in_blocking(Some(netns), move || async move {
        let (fd, index) = raw_socket_on("eth0");
        for f in &frames {
            // SAFETY: sockaddr_ll is plain data.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_ifindex = index;
            sll.sll_halen = 6;
            sll.sll_addr[..6].copy_from_slice(&f[..6]);
            // SAFETY: sending a buffer we own through a valid socket and address.
            let n = unsafe {
                libc::sendto(
                    fd.as_raw_fd(),
                    f.as_ptr() as *const libc::c_void,
                    f.len(),
                    0,
                    &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(n, f.len() as isize, "sendto: {}", std::io::Error::last_os_error());
        }
        Ok(())
    })
    .expect("send");
}

/// Collects every frame `eth0` inside `netns` receives (not sends) for `for_`, on a thread.
fn capture(netns: &str, for_: Duration) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
    let ns = netns.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        vmnet::netns::run_in_blocking(Some(&ns), move || async move {
            let (fd, _) = raw_socket_on("eth0");
            let tv = libc::timeval { tv_sec: 0, tv_usec: 200_000 };
            // SAFETY: setting a receive timeout from a properly sized timeval.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    &tv as *const libc::timeval as *const libc::c_void,
                    std::mem::size_of::<libc::timeval>() as u32,
                )
            };
            let _ = tx.send(());
            let deadline = std::time::Instant::now() + for_;
            let mut got = Vec::new();
            while std::time::Instant::now() < deadline {
                let mut buf = [0u8; 2048];
                // SAFETY: sockaddr_ll is plain data.
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                // SAFETY: receiving into buffers we own, with their true sizes.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                        &mut sll as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                        &mut len,
                    )
                };
                if n > 0 && sll.sll_pkttype != libc::PACKET_OUTGOING {
                    got.push(buf[..n as usize].to_vec());
                }
            }
            Ok(got)
        })
        .expect("capture")
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("capture ready");
    h
}

fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

/// An IPv4 frame (protocol 253, "experimental") carrying `marker`.
fn ipv4_frame(dst: [u8; 6], src: [u8; 6], sip: Ipv4Addr, dip: Ipv4Addr, marker: &str) -> Vec<u8> {
    let mut f = eth(dst, src, 0x0800);
    let total = (20 + marker.len()) as u16;
    let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 253, 0, 0];
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&sip.octets());
    h.extend_from_slice(&dip.octets());
    let sum = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum::<u32>();
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(&h);
    f.extend_from_slice(marker.as_bytes());
    f
}

/// A broadcast ARP reply: `sha`/`sip` is at …, to everyone.
fn arp_frame(src: [u8; 6], sha: [u8; 6], sip: Ipv4Addr, tip: Ipv4Addr) -> Vec<u8> {
    let mut f = eth([0xff; 6], src, 0x0806);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 2]);
    f.extend_from_slice(&sha);
    f.extend_from_slice(&sip.octets());
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&tip.octets());
    f
}

fn has_marker(frames: &[Vec<u8>], marker: &str) -> bool {
    frames.iter().any(|f| f.windows(marker.len()).any(|w| w == marker.as_bytes()))
}

/// ARP frames whose sender IP is `sip`.
fn has_arp_from(frames: &[Vec<u8>], sip: Ipv4Addr) -> bool {
    frames.iter().any(|f| f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[28..32] == sip.octets())
}

// ------------------------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates netns and nft tables: cargo test -p vmnet --features netns-tests --test filter"
)]
async fn spoofed_frames_never_leave_their_port() {
    let lab = Lab::new("fs").await;
    let (a, b, c) = (lab.vm("a"), lab.vm("b"), lab.vm("c"));
    let (amac, bmac) = (a.lease.mac.0, b.lease.mac.0);
    let evil = [0x02, 0x66, 0x66, 0x66, 0x66, 0x66];
    // b shares a's group, c does not: b sees what a may send, c sees nothing of a.
    let (cap_b, cap_c) = (capture(&b.ns.name, Duration::from_secs(3)), capture(&c.ns.name, Duration::from_secs(3)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    send_frames(
        &a.ns.name,
        vec![
            ipv4_frame(bmac, amac, a.lease.ip, b.lease.ip, "mark-legit"),
            ipv4_frame(bmac, evil, a.lease.ip, b.lease.ip, "mark-spoofed-mac"),
            ipv4_frame(bmac, amac, Ipv4Addr::new(10, 77, 0, 99), b.lease.ip, "mark-spoofed-ip"),
            ipv4_frame(bmac, amac, c.lease.ip, b.lease.ip, "mark-neighbours-ip"),
            {
                let mut f = eth(bmac, amac, 0x86dd);
                f.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, 253, 64]);
                f.extend_from_slice(&[0u8; 32]);
                f.extend_from_slice(b"mark-ipv6");
                f
            },
            arp_frame(amac, amac, GW, GW),
            arp_frame(amac, amac, c.lease.ip, c.lease.ip),
            arp_frame(amac, evil, a.lease.ip, a.lease.ip),
            arp_frame(amac, amac, a.lease.ip, b.lease.ip),
        ],
    );
    let (got_b, got_c) = (cap_b.join().expect("capture b"), cap_c.join().expect("capture c"));
    assert!(has_marker(&got_b, "mark-legit"), "a's own frame reaches b (same group)");
    assert!(has_arp_from(&got_b, a.lease.ip), "a's own ARP reaches b");
    for m in ["mark-spoofed-mac", "mark-spoofed-ip", "mark-neighbours-ip", "mark-ipv6"] {
        assert!(!has_marker(&got_b, m), "{m} was bridged to b");
    }
    assert!(!has_arp_from(&got_b, GW), "a gratuitous ARP for the gateway from a VM was bridged");
    assert!(!has_arp_from(&got_b, c.lease.ip), "an ARP for a neighbour's address was bridged");
    assert!(
        !got_b.iter().any(|f| f.len() >= 42 && f[12..14] == [8, 6] && f[22..28] == evil),
        "an ARP with a foreign sender MAC was bridged"
    );
    assert!(
        !has_marker(&got_c, "mark-legit") && !has_arp_from(&got_c, a.lease.ip),
        "c (no shared group) received a's frames"
    );

    // The host sees the same: a spoofed source IP or MAC gets no answer from an allowed service.
    assert_eq!(connect(&a.ns.name, sa(GW, 7000), None).await, Ok(format!("peer={}", a.lease.ip)));
    ip_in(&a.ns.name, &["addr", "add", "10.77.0.50/32", "dev", "eth0"]);
    assert!(connect(&a.ns.name, sa(GW, 7000), Some(Ipv4Addr::new(10, 77, 0, 50))).await.is_err(), "spoofed IP");
    ip_in(&a.ns.name, &["link", "set", "eth0", "address", "02:66:66:66:66:66"]);
    assert!(connect(&a.ns.name, sa(GW, 7000), None).await.is_err(), "spoofed MAC");
    ip_in(&a.ns.name, &["link", "set", "eth0", "address", &a.lease.mac.to_string()]);
    assert_eq!(connect(&a.ns.name, sa(GW, 7000), None).await, Ok(format!("peer={}", a.lease.ip)), "own MAC again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates netns and nft tables: cargo test -p vmnet --features netns-tests --test filter"
)]
async fn vms_reach_only_their_group_and_the_allowed_host_services() {
    let lab = Lab::new("fg").await;
    let (a, b, c, e) = (lab.vm("a"), lab.vm("b"), lab.vm("c"), lab.vm("e"));
    // The kernel's view: ports without a group are isolated, group members are not.
    for (vm, isolated) in [(a, false), (b, false), (c, true), (e, true)] {
        let l = link_json(Some(&lab.host.name), &vm.lease.tap).expect("port");
        assert_eq!(l["linkinfo"]["info_slave_data"]["isolated"], isolated, "{l}");
    }
    let bridge = nft_list(&lab.host.name, "bridge");
    assert!(bridge.contains(&format!("\"{}\" . \"{}\"", a.lease.tap, b.lease.tap)), "{bridge}");
    assert!(link_json(None, &a.lease.tap).is_none(), "nothing leaked into the root netns");

    // VM → VM: the group only.
    assert_eq!(connect(&a.ns.name, sa(b.lease.ip, 9000), None).await, Ok(format!("peer={}", a.lease.ip)));
    assert_eq!(connect(&b.ns.name, sa(a.lease.ip, 9000), None).await, Ok(format!("peer={}", b.lease.ip)));
    assert!(connect(&a.ns.name, sa(c.lease.ip, 9000), None).await.is_err(), "a → c");
    assert!(connect(&c.ns.name, sa(a.lease.ip, 9000), None).await.is_err(), "c → a");
    assert!(connect(&c.ns.name, sa(e.lease.ip, 9000), None).await.is_err(), "c → e");
    assert!(connect(&e.ns.name, sa(c.lease.ip, 9000), None).await.is_err(), "e → c");

    // VM → host: the allow-list at the gateway, nothing else.
    assert_eq!(connect(&c.ns.name, sa(GW, 7000), None).await, Ok(format!("peer={}", c.lease.ip)));
    assert!(connect(&c.ns.name, sa(GW, 7001), None).await.is_err(), "a port not on the allow-list");
    assert!(connect(&e.ns.name, sa(UPLINK_ADDR, 7000), None).await.is_err(), "an allowed port, not at the gateway");

    // Re-creating the tables (a restart) keeps every port's entries.
    let again = Network::ensure(lab.net.config()).await.expect("ensure again");
    assert_eq!(connect(&a.ns.name, sa(b.lease.ip, 9000), None).await, Ok(format!("peer={}", a.lease.ip)));
    assert_eq!(connect(&c.ns.name, sa(GW, 7000), None).await, Ok(format!("peer={}", c.lease.ip)));
    assert!(connect(&a.ns.name, sa(c.lease.ip, 9000), None).await.is_err(), "a → c after the re-creation");

    // A released lease takes its entries along: the port is dead.
    again.release("vm-c").expect("release").expect("had a lease");
    assert!(!nft_list(&lab.host.name, "bridge").contains(&c.lease.tap), "c's entries are gone");
    assert!(connect(&c.ns.name, sa(GW, 7000), None).await.is_err(), "a port without a lease carries nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates netns and nft tables: cargo test -p vmnet --features netns-tests --test filter"
)]
async fn egress_is_opt_in_masqueraded_and_never_private() {
    let lab = Lab::new("fe").await;
    let (a, e) = (lab.vm("a"), lab.vm("e"));
    assert_eq!(
        connect(&e.ns.name, sa(INTERNET, 8080), None).await,
        Ok(format!("peer={UPLINK_ADDR}")),
        "an egress VM reaches the outside, masqueraded behind the uplink"
    );
    assert!(connect(&a.ns.name, sa(INTERNET, 8080), None).await.is_err(), "no egress without opting in");
    assert!(connect(&e.ns.name, sa(LAN, 8080), None).await.is_err(), "the LAN is refused");
    assert!(connect(&e.ns.name, sa(METADATA, 8080), None).await.is_err(), "the metadata address is refused");
    let inet = nft_list(&lab.host.name, "inet");
    for needle in ["169.254.0.0/16", "192.168.0.0/16", "203.0.113.0/24", "masquerade", &e.lease.ip.to_string()] {
        assert!(inet.contains(needle), "{needle} missing:\n{inet}");
    }
    // Egress needs an uplink: a network without one refuses it.
    let cfg = NetConfig { filter: FilterPolicy::default(), ..lab.net.config().clone() };
    let plain = Network::new(cfg).expect("net");
    assert!(matches!(
        plain.allocate_with("vm-x", &VmPolicy { group: None, egress: true }),
        Err(vmnet::VmnetError::Filter(vmnet::FilterError::NoUplink { .. }))
    ));
}

/// A VM netns on `net` (bridge in `host`), like [`Lab::add_vm`], for a second network.
async fn vm_on(net: &Network, host: &str, ns_name: &str, id: &str, policy: VmPolicy) -> VmNs {
    let ns = TestNetns::new(ns_name);
    let lease = net.allocate_with(id, &policy).expect("lease");
    let prefix = net.config().prefix_len();
    ip_in(host, &["link", "add", &lease.tap, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]);
    ip_in(&ns.name, &["link", "set", "eth0", "address", &lease.mac.to_string()]);
    ip_in(&ns.name, &["addr", "add", &format!("{}/{prefix}", lease.ip), "dev", "eth0"]);
    ip_in(&ns.name, &["link", "set", "eth0", "up"]);
    ip_in(&ns.name, &["route", "add", "default", "via", &net.gateway().to_string()]);
    net.attach_port(&lease).await.expect("attach the port");
    VmNs { ns, lease }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "netns-tests"),
    ignore = "root-only, creates netns and nft tables: cargo test -p vmnet --features netns-tests --test filter"
)]
async fn two_networks_in_one_netns_keep_filtering_their_own_vms() {
    let lab = Lab::new("fc").await;
    let (a, b, c) = (lab.vm("a"), lab.vm("b"), lab.vm("c"));
    // A second owner (sandboxd) in the same netns: its own bridge, range, tables and TAP prefix.
    let dir = tempfile::tempdir().expect("tmp");
    let cfg2 = NetConfig {
        bridge: "vmbr1".into(),
        netns: Some(lab.host.name.clone()),
        table: "chrysalis_sbx".into(),
        tap_prefix: "sb-".into(),
        filter: FilterPolicy::parse(None, Some("up0"), None).expect("policy"),
        ..NetConfig::new("10.78.0.0/24".parse().expect("cidr"), dir.path().join("leases.json"))
    };
    let net2 = Network::ensure(&cfg2).await.expect("ensure the second network");
    let x = vm_on(&net2, &lab.host.name, "fcx", "sbx-x", VmPolicy { group: None, egress: true }).await;
    let y = vm_on(&net2, &lab.host.name, "fcy", "sbx-y", VmPolicy::default()).await;
    assert!(x.lease.tap.starts_with("sb-"), "{}", x.lease.tap);

    let first_still_filters = || async {
        assert_eq!(connect(&a.ns.name, sa(b.lease.ip, 9000), None).await, Ok(format!("peer={}", a.lease.ip)));
        assert!(connect(&a.ns.name, sa(c.lease.ip, 9000), None).await.is_err(), "a → c");
        assert_eq!(connect(&c.ns.name, sa(GW, 7000), None).await, Ok(format!("peer={}", c.lease.ip)));
        assert!(connect(&c.ns.name, sa(GW, 7000), Some(Ipv4Addr::new(10, 77, 0, 51))).await.is_err(), "spoofed IP");
    };
    let second_filters = || async {
        assert_eq!(connect(&x.ns.name, sa(INTERNET, 8080), None).await, Ok(format!("peer={UPLINK_ADDR}")));
        assert!(connect(&y.ns.name, sa(INTERNET, 8080), None).await.is_err(), "no egress without opting in");
        assert!(connect(&x.ns.name, sa(LAN, 8080), None).await.is_err(), "the LAN is refused");
        assert!(connect(&x.ns.name, sa(a.lease.ip, 9000), None).await.is_err(), "the other network's VM");
        assert!(connect(&x.ns.name, sa(net2.gateway(), 7000), None).await.is_err(), "no host service");
        assert!(connect(&x.ns.name, sa(INTERNET, 8080), Some(Ipv4Addr::new(10, 78, 0, 50))).await.is_err(), "spoofed");
    };
    ip_in(&c.ns.name, &["addr", "add", "10.77.0.51/32", "dev", "eth0"]);
    ip_in(&x.ns.name, &["addr", "add", "10.78.0.50/32", "dev", "eth0"]);
    first_still_filters().await;
    second_filters().await;
    // Each owner re-creating its own tables (a restart) leaves the other's alone.
    let _first = Network::ensure(lab.net.config()).await.expect("ensure the first again");
    second_filters().await;
    first_still_filters().await;
    let _second = Network::ensure(&cfg2).await.expect("ensure the second again");
    first_still_filters().await;
    second_filters().await;
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &lab.host.name, "nft", "list", "tables"])
        .output()
        .expect("nft");
    let tables = String::from_utf8_lossy(&out.stdout);
    for t in ["bridge chrysalis\n", "inet chrysalis\n", "bridge chrysalis_sbx\n", "inet chrysalis_sbx\n"] {
        assert!(tables.contains(t), "{t:?} missing:\n{tables}");
    }
}

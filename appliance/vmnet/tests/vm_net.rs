//! Root-only, real QEMU: VM networking end to end, every packet inside a network namespace the
//! test creates itself (deleted on drop, with its bridge and TAPs).
//!
//! - `qemu_joins_the_netns_and_opens_the_taps`: firmware-only QEMU (no guest images) with a NIC:
//!   the QEMU process lives in the test netns, holds its TAP (carrier up), a clone is restored with
//!   its own TAP, and one TAP cannot serve two QEMUs.
//! - `base_vm_and_its_clone_serve_tcp_on_their_own_ips`: boots the `base` template with a NIC,
//!   serves TCP in the guest (busybox `nc -ll`), connects to it from inside the netns; snapshots,
//!   restores a clone with a new TAP, re-addresses it with `guest-init net-config` through the
//!   agent, and reaches both VMs on their own addresses; with the packet filter on (every
//!   `Network::ensure` installs it), the guests resolve their gateway but reach no host service
//!   and not each other.
//!
//! Run: `cargo xtask vm-image --all` once, then `cargo test -p vmnet --features vm-tests --test vm_net`
//! (as root). Without the feature these tests are reported as ignored, with the reason.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use silkd_client::{AgentConn, ExecOptions};
use support::{link_json, TestNetns};
use tokio::io::AsyncReadExt;
use vmm::qemu::{QemuConfig, QemuDriver};
use vmm::{
    AccelPreference, AfterSnapshot, AgentStream, BootSpec, Catalog, Driver, DriverError, NicSpec, RestoreOptions,
    SizeClass, Vm, VmId, AGENT_PORT,
};
use vmnet::{Lease, NetConfig, Network};

fn nic(net: &Network, lease: &Lease) -> NicSpec {
    NicSpec {
        tap: lease.tap.clone(),
        mac: lease.mac.to_string(),
        netns: net.config().netns.clone(),
        ip_cidr: net.ip_cidr(lease),
        gateway: net.gateway().to_string(),
    }
}

async fn network(ns: &TestNetns, dir: &Path, cidr: &str) -> Network {
    let cfg = NetConfig {
        netns: Some(ns.name.clone()),
        ..NetConfig::new(cidr.parse().expect("cidr"), dir.join("leases.json"))
    };
    Network::ensure(&cfg).await.expect("bridge")
}

/// The network namespace inode of `pid`, from `/proc/<pid>/ns/net` (`net:[<inode>]`).
fn netns_inode_of(pid: u32) -> u64 {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/net")).expect("ns link");
    let s = link.to_string_lossy();
    s.trim_start_matches("net:[").trim_end_matches(']').parse().expect("inode")
}

fn has_carrier(netns: &str, dev: &str) -> bool {
    link_json(Some(netns), dev)
        .and_then(|l| l["flags"].as_array().map(|f| f.iter().any(|x| x == "LOWER_UP")))
        .unwrap_or(false)
}

/// Pids of live QEMU processes whose command line mentions `dir`.
fn qemu_under(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            let cmd = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
                .into_owned();
            cmd.contains("qemu-system") && cmd.contains(&needle)
        })
        .collect()
}

/// SIGKILLs every QEMU under a state dir on drop, so a failing test leaves no VM (and no netns
/// kept alive by one) behind. Declared after the [`TestNetns`], so it runs first.
struct KillQemuOnDrop(std::path::PathBuf);

impl Drop for KillQemuOnDrop {
    fn drop(&mut self) {
        for pid in qemu_under(&self.0) {
            // SAFETY: kill(2) on a pid we just found running QEMU for this test's state dir.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "vm-tests"),
    ignore = "root-only, boots QEMU in a test netns: cargo test -p vmnet --features vm-tests"
)]
async fn qemu_joins_the_netns_and_opens_the_taps() {
    let ns = TestNetns::new("fw");
    let dir = tempfile::tempdir().expect("tmp");
    let net = network(&ns, dir.path(), "10.88.0.0/24").await;
    let (pl, cl) = (net.allocate("fw-parent").expect("lease"), net.allocate("fw-clone").expect("lease"));
    net.create_tap(&pl).await.expect("tap");
    net.create_tap(&cl).await.expect("tap");
    assert!(!has_carrier(&ns.name, &pl.tap), "no carrier before QEMU opens the TAP");

    let state = dir.path().join("state");
    let _reaper = KillQemuOnDrop(state.clone());
    let driver = QemuDriver::new(QemuConfig {
        state_dir: state.clone(),
        accel: AccelPreference::Tcg,
        tsc_khz: Some(2_000_000),
        start_paused: true,
        firmware_only: true,
        ..QemuConfig::from_env()
    });
    let spec = BootSpec {
        overlay_bytes: None,
        name: "fw".into(),
        kernel: "/nonexistent/vmlinux".into(),
        initrd: "/nonexistent/initrd".into(),
        rootfs: None,
        overlay_base: None,
        cmdline: String::new(),
        size: SizeClass::Small,
        accel: AccelPreference::Auto,
        nic: Some(nic(&net, &pl)),
        rng: true,
        volumes: true,
        ram: vmm::Ram::Anonymous,
    };
    let vm = driver.boot(&spec).await.expect("boot with a NIC");
    let ns_inode = std::fs::metadata(vmnet::netns::netns_path(&ns.name)).expect("netns file").ino();
    assert_eq!(netns_inode_of(vm.pid), ns_inode, "QEMU runs inside the test netns");
    assert_ne!(netns_inode_of(std::process::id()), ns_inode, "the test itself does not");
    assert!(has_carrier(&ns.name, &pl.tap), "QEMU holds the parent's TAP");
    assert_eq!(vm.spec.nic, spec.nic);

    let snap_dir = dir.path().join("snap");
    let snap = driver.snapshot(&vm, &snap_dir, AfterSnapshot::Paused).await.expect("snapshot");
    assert_eq!(snap.spec.nic, spec.nic, "the snapshot records the parent's NIC");
    let cid = VmId::new("fw-clone").expect("id");
    assert!(matches!(driver.restore(&snap, &cid).await, Err(DriverError::Invalid(_))), "a clone needs its own NIC");
    // The parent's TAP is busy: a second QEMU cannot open it, and nothing is left behind.
    let busy = RestoreOptions { nic: Some(nic(&net, &pl)) };
    assert!(driver.restore_with(&snap, &cid, &busy).await.is_err(), "one TAP serves one QEMU");
    assert_eq!(driver.list().await.expect("list").len(), 1, "the failed clone left no VM");

    let own = RestoreOptions { nic: Some(nic(&net, &cl)) };
    let clone = driver.restore_with(&snap, &cid, &own).await.expect("restore with the clone's own NIC");
    assert_eq!(clone.spec.nic, own.nic, "the clone records its own NIC");
    assert_eq!(netns_inode_of(clone.pid), ns_inode, "the clone's QEMU runs inside the test netns");
    assert!(has_carrier(&ns.name, &cl.tap), "the clone's QEMU holds its own TAP");

    driver.kill(&clone).await.expect("kill clone");
    driver.kill(&vm).await.expect("kill parent");
    assert!(qemu_under(&state).is_empty(), "no QEMU left");
    for l in [&pl, &cl] {
        assert!(net.delete_tap(&l.tap).await.expect("delete tap"));
    }
}

async fn agent(driver: &Arc<dyn Driver>, vm: &Vm) -> AgentConn<AgentStream> {
    AgentConn::new(driver.connect(vm, AGENT_PORT).await.expect("agent"))
}

async fn sh(driver: &Arc<dyn Driver>, vm: &Vm, script: &str) -> String {
    let out = agent(driver, vm).await.exec(&["sh", "-c", script], ExecOptions::default(), b"").await.expect("exec");
    assert_eq!(out.code, 0, "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Connects from inside `netns` to `ip:port` (retrying up to `within`), sends a line, returns
/// everything the server wrote before closing.
async fn tcp_from_netns(
    netns: &str,
    ip: std::net::Ipv4Addr,
    port: u16,
    within: Duration,
) -> Result<String, vmnet::VmnetError> {
    let netns = netns.to_string();
    vmnet::netns::run_in(Some(&netns), move || async move {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        while Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect((ip, port))).await {
                Ok(Ok(mut s)) => {
                    // Only read: a server that closes with unread input resets the connection
                    // and can lose its reply.
                    let mut buf = Vec::new();
                    match tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await {
                        Ok(Ok(_)) if !buf.is_empty() => return Ok(String::from_utf8_lossy(&buf).into_owned()),
                        other => last = format!("read: {other:?}"),
                    }
                }
                Ok(Err(e)) => last = format!("connect: {e}"),
                Err(_) => last = "connect timed out".into(),
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Err(vmnet::VmnetError::Worker(format!("no answer from {ip}:{port} within {within:?} ({last})")))
    })
    .await
}

/// Starts `argv` detached in the guest.
async fn spawn_detached(driver: &Arc<dyn Driver>, vm: &Vm, argv: &[&str]) {
    agent(driver, vm).await.exec_detached(argv, ExecOptions::default()).await.expect("detached exec");
}

/// A guest of a built template under QEMU with a NIC on its own lease, on a fresh bridge in a
/// test netns of its own, its agent answering. Bind the fields in this order (`let NetVm { ns,
/// dir, … } = …`) so that they drop in reverse: every QEMU killed before the netns goes.
struct NetVm {
    ns: TestNetns,
    dir: tempfile::TempDir,
    net: Network,
    _reaper: KillQemuOnDrop,
    state: PathBuf,
    lease: Lease,
    vm: Vm,
    driver: Arc<dyn Driver>,
}

/// Boots `template` (small) in netns `ns_name` on network `cidr`, with the lease of `vm_name`.
async fn boot_on_test_net(ns_name: &str, cidr: &str, template: &str, vm_name: &str) -> NetVm {
    let catalog = Catalog::load_default().expect("built images: run `cargo xtask vm-image --all` first");
    let ns = TestNetns::new(ns_name);
    let dir = tempfile::tempdir().expect("tmp");
    let net = network(&ns, dir.path(), cidr).await;
    let state = dir.path().join("state");
    let reaper = KillQemuOnDrop(state.clone());
    let driver: Arc<dyn Driver> =
        Arc::new(QemuDriver::new(QemuConfig { state_dir: state.clone(), ..QemuConfig::from_env() }));
    let lease = net.allocate(vm_name).expect("lease");
    net.create_tap(&lease).await.expect("tap");
    let mut spec = BootSpec::from_template(&catalog, template, SizeClass::Small).expect("template");
    spec.nic = Some(nic(&net, &lease));
    let t0 = Instant::now();
    let vm = driver.boot(&spec).await.expect("boot");
    if let Err(e) = driver.wait_agent(&vm, Duration::from_secs(180)).await {
        let console = vmm::console::tail_string(&vm.console_log, vmm::console::DEFAULT_CONSOLE_CAP as usize);
        let _ = driver.kill(&vm).await;
        panic!("agent never answered: {e}\n{console}");
    }
    eprintln!("{template} with a NIC ready after {:?}", t0.elapsed());
    NetVm { ns, dir, net, _reaper: reaper, state, lease, vm, driver }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "vm-tests"),
    ignore = "root-only, boots QEMU in a test netns: cargo test -p vmnet --features vm-tests"
)]
async fn base_vm_and_its_clone_serve_tcp_on_their_own_ips() {
    // Bound in this order so that they drop in reverse: QEMUs killed before the netns goes.
    let NetVm { ns, dir, net, _reaper, state, lease: pl, vm, driver } =
        boot_on_test_net("vm", "10.88.0.0/24", "base", "vm-parent").await;
    let console = vmm::console::tail_string(&vm.console_log, vmm::console::DEFAULT_CONSOLE_CAP as usize);
    assert!(console.contains("eth0 10.88.0.2/24 gw 10.88.0.1"), "guest-init configured eth0:\n{console}");
    assert_eq!(sh(&driver, &vm, "cat /sys/class/net/eth0/address").await.trim(), pl.mac.to_string());
    assert!(sh(&driver, &vm, "ip -4 addr show dev eth0").await.contains("10.88.0.2/24"));
    assert!(sh(&driver, &vm, "test -x /.chrysalis/guest-init && echo yes").await.contains("yes"));

    // A TCP service in the guest: every connection gets "hello-from-<contents of /tmp/who>".
    sh(
        &driver,
        &vm,
        "echo parent > /tmp/who && printf '#!/bin/sh\\necho hello-from-$(cat /tmp/who)\\n' > /tmp/reply.sh \
         && chmod +x /tmp/reply.sh",
    )
    .await;
    spawn_detached(&driver, &vm, &["nc", "-ll", "-p", "8080", "-e", "/tmp/reply.sh"]).await;
    let got = tcp_from_netns(&ns.name, pl.ip, 8080, Duration::from_secs(60)).await.expect("tcp from the netns");
    assert_eq!(got.trim(), "hello-from-parent");

    // Clone: restored with its own TAP; still the parent's MAC/IP inside until net-config.
    let snap = driver.snapshot(&vm, &dir.path().join("snap"), AfterSnapshot::Resumed).await.expect("snapshot");
    let cl = net.allocate("vm-clone").expect("lease");
    net.create_tap(&cl).await.expect("tap");
    let clone = driver
        .restore_with(&snap, &VmId::new("vm-clone").expect("id"), &RestoreOptions { nic: Some(nic(&net, &cl)) })
        .await
        .expect("restore");
    driver.wait_agent(&clone, Duration::from_secs(120)).await.expect("clone agent");
    let argv = net.net_config_argv(&cl);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let out = agent(&driver, &clone).await.exec(&argv, ExecOptions::default(), b"").await.expect("net-config");
    assert_eq!(out.code, 0, "net-config: {}", String::from_utf8_lossy(&out.stderr));
    sh(&driver, &clone, "echo clone > /tmp/who").await;
    assert_eq!(sh(&driver, &clone, "cat /sys/class/net/eth0/address").await.trim(), cl.mac.to_string());
    let route = sh(&driver, &clone, "ip route").await;
    assert!(route.contains("default via 10.88.0.1"), "clone's routes: {route}");

    let got = tcp_from_netns(&ns.name, cl.ip, 8080, Duration::from_secs(60)).await.expect("tcp from the netns");
    assert_eq!(got.trim(), "hello-from-clone", "the clone answers on its new address");
    let got = tcp_from_netns(&ns.name, pl.ip, 8080, Duration::from_secs(60)).await.expect("tcp from the netns");
    assert_eq!(got.trim(), "hello-from-parent", "the parent still answers on its own");
    // The gateway is the host: the filter lets ARP for it through (the guest learns its MAC)
    // but no host service by default, not even an ICMP echo.
    let ping = sh(&driver, &clone, "ping -c 1 -W 3 10.88.0.1 >/dev/null 2>&1 && echo reached || echo dropped").await;
    assert_eq!(ping.trim(), "dropped", "VM → host is closed by default");
    let arp = sh(&driver, &clone, "cat /proc/net/arp").await;
    assert!(
        arp.lines().any(|l| l.starts_with("10.88.0.1 ") && l.contains("0x2")),
        "the clone resolved its gateway: {arp}"
    );
    // The parent reaches neither the clone (no shared group) nor anything outside.
    let out = sh(&driver, &vm, &format!("nc -w 3 {} 8080 </dev/null || echo refused", cl.ip)).await;
    assert!(!out.contains("hello-from-clone"), "VM → VM is closed by default: {out}");

    driver.shutdown(&clone, Duration::from_secs(10)).await.expect("shutdown clone");
    driver.shutdown(&vm, Duration::from_secs(10)).await.expect("shutdown parent");
    assert!(driver.list().await.expect("list").is_empty());
    assert!(qemu_under(&state).is_empty(), "no QEMU left");
    for (id, l) in [("vm-parent", &pl), ("vm-clone", &cl)] {
        assert!(net.delete_tap(&l.tap).await.expect("delete tap"));
        assert!(net.release(id).expect("release").is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "vm-tests"),
    ignore = "root-only, boots QEMU in a test netns: cargo test -p vmnet --features vm-tests"
)]
async fn rt_vm_gets_its_address_and_has_guest_init_installed() {
    let NetVm { ns, dir: _dir, net, _reaper, state, lease, vm, driver } =
        boot_on_test_net("rt", "10.90.0.0/24", "rt", "rt-vm").await;
    // After the switch to the image root, guest-init is still reachable at the same path.
    let console = vmm::console::tail_string(&vm.console_log, vmm::console::DEFAULT_CONSOLE_CAP as usize);
    assert!(console.contains("eth0 10.90.0.2/24 gw 10.90.0.1"), "guest-init configured eth0:\n{console}");
    assert!(!console.contains("installing /.chrysalis/guest-init"), "guest-init installed itself:\n{console}");
    assert!(sh(&driver, &vm, "test -x /.chrysalis/guest-init && echo yes").await.contains("yes"));
    assert_eq!(sh(&driver, &vm, "cat /sys/class/net/eth0/address").await.trim(), lease.mac.to_string());
    // Default route via 10.90.0.1 (gateway column, little-endian hex) in /proc/net/route.
    let routes = sh(&driver, &vm, "cat /proc/net/route").await;
    assert!(routes.lines().any(|l| l.starts_with("eth0\t00000000\t01005A0A")), "routes:\n{routes}");
    // net-config refuses bad arguments with a usage error (exit 2) and changes nothing.
    let out = agent(&driver, &vm)
        .await
        .exec(&["/.chrysalis/guest-init", "net-config", "10.90.0.9"], ExecOptions::default(), b"")
        .await
        .expect("exec");
    assert_eq!(out.code, 2, "{}", String::from_utf8_lossy(&out.stderr));

    let server = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('0.0.0.0', 8080))\ns.listen()\nc, _ = s.accept()\nc.sendall(b'hello-from-rt\\n')\nc.close()\n";
    sh(&driver, &vm, &format!("cat > /tmp/srv.py <<'PY'\n{server}PY\n")).await;
    spawn_detached(&driver, &vm, &["sh", "-c", "exec python3 /tmp/srv.py > /tmp/srv.log 2>&1"]).await;
    match tcp_from_netns(&ns.name, lease.ip, 8080, Duration::from_secs(60)).await {
        Ok(got) => assert_eq!(got.trim(), "hello-from-rt"),
        Err(e) => panic!("{e}; server log: {}", sh(&driver, &vm, "cat /tmp/srv.log; ps -ef || ps").await),
    }

    driver.shutdown(&vm, Duration::from_secs(10)).await.expect("shutdown");
    assert!(qemu_under(&state).is_empty(), "no QEMU left");
    assert!(net.delete_tap(&lease.tap).await.expect("delete tap"));
}

#![cfg(feature = "e2e")]
//! A hostile guest, end to end (issue #13): the real `sandboxd` binary with a warm `rt` pool of
//! real QEMU VMs. One claimed VM (the attacker) runs each attack below through sandboxd's
//! `/exec`, while a second claimed VM (the neighbour) is asked to run `true` every second and
//! sandboxd is asked to claim and release a third. For every attack:
//!
//! - the attempt fails or is contained (the assertion says how);
//! - the neighbour keeps answering its agent, each time within [`NEIGHBOUR_LIMIT`];
//! - sandboxd keeps claiming;
//! - nothing the attacker writes on the host passes its cap: its console log (both segments)
//!   stays within `vmm::console::DEFAULT_CONSOLE_CAP`, its overlay within
//!   `vmm::disk::overlay_cap` of the template's overlay image, and sandboxd's resident memory
//!   within [`SANDBOXD_RSS_LIMIT`].
//!
//! First, right after the claims, the two VMs (clones of one golden snapshot) must read
//! different first bytes from `/dev/urandom` and `getrandom()`, through a virtio-rng device:
//! sandboxd reseeds every clone before pooling it.
//!
//! The attacks, in order (the fork bomb last: it leaves the attacker's guest useless):
//! (a) writing to the serial console as fast as the guest can; (b) endless stdout to the host
//! collector of `/exec`; (c) filling the writable disk; (d) allocating all memory; (e) reaching
//! the host's services (sandboxd's port, any address) from a VM that has no network; (f) a fork
//! bomb. Before them, (h): the attacker's QEMU seen from the host runs jailed (the VM user, no
//! capabilities, seccomp, `NoNewPrivs`, its cgroup leaf's limits; `test_infra::assert_jailed`).
//!
//! A second test, `egress_is_opt_in_private_nets_are_refused_and_a_spoofer_reaches_no_one`,
//! gives sandboxd a `network` section inside namespaces it creates (an uplink into a netns
//! playing the LAN and the internet) and an `egress` pool beside a `none` one: (g) an egress
//! sandbox reaches a public address, masqueraded behind the uplink, but not a LAN address,
//! `169.254.169.254`, the gateway's or the host's services; a `none` sandbox has only `lo` and
//! no route; (f) an egress sandbox announces the gateway's address and takes its neighbour's
//! address with a forged MAC and with the neighbour's MAC (gratuitous ARP through guest-init's
//! `net-config`): it reaches nothing, nobody learns the forged MACs, and the neighbour keeps its
//! agent and its egress.
//!
//! Needs the built-image catalog, `qemu-system-x86_64` and the `sandboxd` binary beside the
//! test binary; `cargo xtask test` provides all three.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use sandboxd_api::{ClaimRequest, ExecRequest, NetworkConfig, PoolConfig};
use serde_json::Value;
use test_infra::sandboxd::{wait_for, Harness};
use test_infra::suite::sibling_bin;

/// The neighbour's `true` must come back within this, whatever the attacker does (generous:
/// TCG on a 2-core machine that runs other suites beside this one).
const NEIGHBOUR_LIMIT: Duration = Duration::from_secs(15);
/// sandboxd's resident memory never passes this while a guest floods it.
const SANDBOXD_RSS_LIMIT: u64 = 256 << 20;

fn step(name: &str) {
    println!("== {name}");
}

/// What one sandbox is: its id and token.
#[derive(Clone)]
struct Sandbox {
    id: String,
    token: String,
}

/// `POST /exec` of `sh -c <script>` with a timeout; returns status and body.
fn sh(h: &Harness, sb: &Sandbox, script: &str, timeout_secs: u64) -> (u16, Value) {
    // The response may take the whole exec timeout (a loaded TCG guest filling its disk).
    h.call_waiting(
        "POST",
        &format!("/v1/sandboxes/{}/exec", sb.id),
        Some(&sb.token),
        Some(exec_body(&["sh", "-c", script], timeout_secs)),
        Duration::from_secs(timeout_secs + 60),
    )
}

/// An `/exec` body: `argv` with a timeout.
fn exec_body(argv: &[&str], timeout_secs: u64) -> Value {
    let req = ExecRequest { timeout_seconds: Some(timeout_secs as f64), ..ExecRequest::new(argv.iter().copied()) };
    serde_json::to_value(req).expect("exec body")
}

fn stdout(v: &Value) -> String {
    v["stdout"].as_str().unwrap_or_default().to_string()
}

/// Resident memory of `pid`, bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).map_or(0, |m| m.len())
}

/// The VM directory whose console log holds `marker`.
fn vm_dir_with_console(h: &Harness, marker: &str) -> PathBuf {
    let root = h.dir.path().join("data/vms/vms");
    wait_for(&format!("a console log holding {marker}"), Duration::from_secs(30), || {
        h.vm_dirs().into_iter().map(|d| root.join(d)).find(|d| {
            let log = d.join("console.log");
            vmm::console::tail_string(&log, vmm::console::DEFAULT_CONSOLE_CAP as usize).contains(marker)
        })
    })
}

/// The attacker's files on the host, against their caps.
struct Caps {
    vm_dir: PathBuf,
    overlay_cap: u64,
    /// The attacker's QEMU: whatever the guest does, its own cgroup never kills it.
    qemu_pid: u32,
}

impl Caps {
    fn check(&self, what: &str) {
        assert!(
            std::path::Path::new(&format!("/proc/{}", self.qemu_pid)).exists(),
            "{what}: the attacker's QEMU (pid {}) is gone: killed by its cgroup? (dmesg)",
            self.qemu_pid
        );
        let console = self.vm_dir.join("console.log");
        let on_disk = size(&console) + size(&vmm::console::rotated_path(&console));
        assert!(
            on_disk <= vmm::console::DEFAULT_CONSOLE_CAP,
            "{what}: the attacker's console log holds {on_disk} bytes, over the cap"
        );
        let overlay = size(&self.vm_dir.join("overlay.qcow2"));
        assert!(
            overlay <= self.overlay_cap,
            "{what}: the attacker's overlay is {overlay} bytes, over {}",
            self.overlay_cap
        );
    }
}

/// Runs `attack` on a thread while the neighbour is probed every second and sandboxd claims
/// and releases one VM; returns the attack's result once both are done.
fn contained<T: Send + 'static>(
    h: &Arc<Harness>,
    neighbour: &Sandbox,
    sandboxd_pid: u32,
    what: &str,
    attack: impl FnOnce(&Harness) -> T + Send + 'static,
) -> T {
    step(what);
    let done = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(Mutex::new(Duration::ZERO));
    let attacker = {
        let (h, done) = (Arc::clone(h), Arc::clone(&done));
        thread::spawn(move || {
            let r = attack(&h);
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    let mut probes = 0;
    let mut claimed_once = false;
    let mut most_rss = 0;
    while !done.load(Ordering::SeqCst) || probes == 0 {
        let t = Instant::now();
        let (s, v) = h.exec(&neighbour.id, &neighbour.token, &["true"]);
        let took = t.elapsed();
        assert_eq!(s, 200, "{what}: the neighbour's exec failed: {v}");
        assert_eq!(v["exit_code"], 0, "{what}: {v}");
        assert!(took <= NEIGHBOUR_LIMIT, "{what}: the neighbour answered in {took:?}");
        {
            let mut w = worst.lock().unwrap_or_else(|p| p.into_inner());
            *w = (*w).max(took);
        }
        probes += 1;
        most_rss = most_rss.max(rss(sandboxd_pid));
        if !claimed_once && h.pool("rt").warm > 0 {
            let (id, token) = h.claim(&ClaimRequest::new("rt"));
            let (s, v) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(&token), None);
            assert!(s == 200 || s == 204, "{what}: releasing a claim made during the attack: {s} {v}");
            claimed_once = true;
        }
        thread::sleep(Duration::from_secs(1));
    }
    let r = attacker.join().unwrap_or_else(|_| panic!("{what}: the attack thread panicked"));
    assert!(most_rss <= SANDBOXD_RSS_LIMIT, "{what}: sandboxd's RSS reached {most_rss} bytes");
    let worst = *worst.lock().unwrap_or_else(|p| p.into_inner());
    println!("   {probes} neighbour probes, slowest {worst:?}; sandboxd RSS at most {} MiB", most_rss >> 20);
    if !claimed_once {
        // The attack ended before the pool had a VM to spare: claim one now, still checking.
        wait_for("a warm rt VM", Duration::from_secs(240), || (h.pool("rt").warm > 0).then_some(()));
        let (id, token) = h.claim(&ClaimRequest::new("rt"));
        let (s, _) = h.call("POST", &format!("/v1/sandboxes/{id}/release"), Some(&token), None);
        assert!(s == 200 || s == 204, "{what}: release after the attack: {s}");
    }
    r
}

/// The two tests run one after the other: each measures how its neighbours keep answering,
/// which the other's VMs (a flood, a fork bomb, booting pools) must not disturb on two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_hostile_guest_reaches_nothing_and_starves_no_one() {
    let _alone = one_at_a_time();
    test_infra::init_tracing();
    let bin = sibling_bin("sandboxd").unwrap_or_else(|e| panic!("{e}"));
    let catalog = vmm::Catalog::load(&test_infra::sandboxd::catalog_path()).expect("catalog");
    let (_, rt) = catalog.resolve("rt").expect("the rt template");
    let overlay_cap =
        vmm::disk::overlay_cap(rt.overlay_base.as_deref().expect("rt has an overlay image")).expect("cap");

    let h = Arc::new(Harness::new(&bin, vec![PoolConfig::warm("rt", 3)]));
    h.wait_full("rt");
    let sandboxd_pid = h.pid().expect("sandboxd runs");
    let claim = || {
        let (id, token) = h.claim(&ClaimRequest::new("rt"));
        Sandbox { id, token }
    };
    let (attacker, neighbour) = (claim(), claim());

    // Fresh entropy: both are clones of one golden snapshot (sandboxd's metrics say so), yet
    // right after the claim their first /dev/urandom and getrandom() bytes differ, and their
    // kernels read a virtio-rng device.
    step("clones of one snapshot do not share RNG state");
    let metrics = h.root("GET", "/metrics", None);
    let clones =
        metrics.as_str().unwrap_or_default().lines().find(|l| l.starts_with("sandboxd_refills_total{tier=\"clone\"}"));
    assert!(clones.is_some_and(|l| !l.ends_with(" 0")), "the pool's VMs are clones: {clones:?}");
    let random = |sb: &Sandbox| {
        let (s, v) = sh(
            &h,
            sb,
            "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; \
             python3 -c 'import os; print(os.getrandom(32).hex())'; cat /sys/class/misc/hw_random/rng_current",
            30,
        );
        assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
        stdout(&v).lines().map(str::to_string).collect::<Vec<_>>()
    };
    let (a, n) = (random(&attacker), random(&neighbour));
    println!("attacker: {a:?}\nneighbour: {n:?}");
    assert_eq!(a.len(), 3, "{a:?}");
    assert_ne!(a[0], n[0], "two clones read the same first /dev/urandom bytes");
    assert_ne!(a[1], n[1], "two clones got the same first getrandom() bytes");
    assert!(a[2].starts_with("virtio_rng"), "the guest's hwrng is virtio-rng: {a:?}");
    let (s, v) = sh(&h, &attacker, "echo hostile-attacker-marker > /dev/ttyS0", 30);
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
    let vm_dir = vm_dir_with_console(&h, "hostile-attacker-marker");
    let rec = vmm::lifecycle::VmRecord::load(&vm_dir).expect("vm.json").expect("a record");
    let caps = Caps { vm_dir, overlay_cap, qemu_pid: rec.vm.pid };

    // (h) The attacker's QEMU, seen from the host: the VM user, no capabilities, seccomp,
    // NoNewPrivs, its own cgroup leaf with the limits of its size class (`vmm::jail`).
    step("(h) the attacker's QEMU is jailed");
    test_infra::assert_jailed(&rec.vm).unwrap_or_else(|e| panic!("{e:#}"));

    // (a) The serial console: the guest writes as fast as it can for 20 s.
    let a = attacker.clone();
    let (s, v) = contained(&h, &neighbour, sandboxd_pid, "(a) flooding the serial console", move |h| {
        sh(h, &a, "timeout 20 yes 'hostile console flood 0123456789abcdef' > /dev/ttyS0; exit 0", 60)
    });
    assert_eq!(s, 200, "{v}");
    let tail = vmm::console::tail_string(&caps.vm_dir.join("console.log"), 4096);
    assert!(tail.contains("hostile console flood"), "the flood never reached the console log: {tail:?}");
    caps.check("(a)");

    // (b) Endless stdout: the host keeps at most the exec output cap and says so.
    let a = attacker.clone();
    let (s, v) = contained(&h, &neighbour, sandboxd_pid, "(b) endless stdout to the host", move |h| {
        h.call(
            "POST",
            &format!("/v1/sandboxes/{}/exec", a.id),
            Some(&a.token),
            Some(exec_body(&["yes", "endless stdout endless stdout"], 300)),
        )
    });
    assert_eq!(s, 413, "{v}");
    assert!(v.to_string().contains("exceeds"), "{v}");
    caps.check("(b)");

    // (c) The writable disk: the guest fills it and gets ENOSPC; the host file stays capped.
    let a = attacker.clone();
    let (s, v) = contained(&h, &neighbour, sandboxd_pid, "(c) filling the writable disk", move |h| {
        sh(h, &a, "dd if=/dev/zero of=/root/fill bs=1M 2>&1 | grep -v records; sync; df -k / | tail -n 1", 900)
    });
    assert_eq!(s, 200, "{v}");
    let out = stdout(&v);
    assert!(out.contains("No space left on device"), "the guest never ran out of disk: {out}");
    caps.check("(c)");
    let (s, v) = sh(&h, &attacker, "rm -f /root/fill; sync; echo freed", 300);
    assert_eq!((s, stdout(&v).trim()), (200, "freed"), "{v}");

    // (d) Memory: the guest allocates until its kernel's OOM killer stops it.
    let a = attacker.clone();
    let (s, v) = contained(&h, &neighbour, sandboxd_pid, "(d) allocating all memory", move |h| {
        sh(h, &a, "python3 -c 'x=[]\nwhile True: x.append(b\"\\x01\" * (1<<20))'; echo exit=$?", 600)
    });
    // The allocator is killed (SIGKILL: 137) or the agent itself is, which the host sees as a
    // failed exec; either way the VM's memory is all it could take.
    assert!(s != 200 || stdout(&v).contains("exit=137"), "the allocator was not stopped: {s} {v}");
    caps.check("(d)");

    // (e) The host's services: a sandboxd VM has no network interface but loopback, so no
    // address of the host (sandboxd's port, the gateway of QEMU's user network, a LAN or the
    // metadata address) is reachable.
    let port = h.addr.rsplit(':').next().expect("port").to_string();
    let probe = format!(
        "ls /sys/class/net; for a in 10.0.2.2 10.88.0.1 192.168.1.1 169.254.169.254; do \
         python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(3)\ntry:\n s.connect((sys.argv[1], int(sys.argv[2]))); print(\"REACHED\", sys.argv[1])\nexcept OSError as e: print(\"refused\", sys.argv[1], e)' $a {port}; done"
    );
    let a = attacker.clone();
    let (s, v) =
        contained(&h, &neighbour, sandboxd_pid, "(e) reaching the host's services", move |h| sh(h, &a, &probe, 120));
    assert_eq!(s, 200, "{v}");
    let out = stdout(&v);
    let nics: Vec<&str> = out.lines().take_while(|l| !l.starts_with("refused") && !l.starts_with("REACHED")).collect();
    assert_eq!(nics, ["lo"], "a sandboxd VM without net has a NIC: {out}");
    assert!(!out.contains("REACHED") && out.matches("refused").count() == 4, "{out}");

    // (f) A fork bomb: the attacker's guest drowns in processes; nobody else notices.
    let a = attacker.clone();
    let (s, v) = contained(&h, &neighbour, sandboxd_pid, "(f) a fork bomb", move |h| {
        // The bomb runs on in the background; the neighbour is probed for the 20 s after it.
        sh(h, &a, "(b() { b | b & }; b) >/dev/null 2>&1 & sleep 20; echo survived", 60)
    });
    println!("   the fork bomb's exec ended with {s}: {}", v.to_string().chars().take(200).collect::<String>());
    caps.check("(f)");

    // The attacker is released like any sandbox: its VM is destroyed, its files are gone.
    let (s, v) = h.call("POST", &format!("/v1/sandboxes/{}/release", attacker.id), Some(&attacker.token), None);
    assert!(s == 200 || s == 204, "releasing the attacker: {s} {v}");
    wait_for("the attacker's VM dir to go", Duration::from_secs(60), || (!caps.vm_dir.exists()).then_some(()));
    let (s, v) = h.exec(&neighbour.id, &neighbour.token, &["true"]);
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");

    let h = Arc::try_unwrap(h).unwrap_or_else(|_| panic!("the harness is still shared"));
    h.finish();
}

// ------------------------------------------------------------------------------------------
// Egress (issue #13 item 2) and the network attacks (f) and (g): sandboxd's egress VMs inside a
// network namespace this test owns ("host", holding the bridge and the uplink `up0`), whose
// uplink leads into a second one playing the LAN and the internet (`wan0`: the uplink's peer
// 198.51.100.1, a LAN address, the metadata address and one public address, 8.8.8.8, that only
// ever exists inside these namespaces). Each of those serves TCP, answering `peer=<source>`.

/// The public address (not in vmnet's refused set; only inside the test's namespaces).
const PUBLIC: &str = "8.8.8.8";
/// A LAN address and the metadata address, both refused even with egress.
const LAN: &str = "192.168.77.1";
const METADATA: &str = "169.254.169.254";
/// The host's uplink address: what the LAN sees of a masqueraded VM.
const UPLINK_ADDR: &str = "198.51.100.2";
/// sandboxd's VM gateway (the default network range's first host).
const GATEWAY: &str = "10.89.0.1";

fn ip_in(ns: &str, args: &[&str]) {
    let out = std::process::Command::new("ip").args(["-n", ns]).args(args).output().expect("ip");
    assert!(out.status.success(), "ip -n {ns} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Serves `addr` inside `netns` forever, answering `peer=<source>`; every source is recorded.
fn serve(netns: &str, addr: std::net::SocketAddr, seen: Arc<Mutex<Vec<std::net::IpAddr>>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let ns = netns.to_string();
    thread::spawn(move || {
        let _: Result<(), _> = vmnet::netns::run_in_blocking(Some(&ns), move || async move {
            use tokio::io::AsyncWriteExt as _;
            let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
            let _ = tx.send(());
            loop {
                let (mut s, peer) = l.accept().await.map_err(|e| vmnet::VmnetError::Worker(e.to_string()))?;
                seen.lock().unwrap_or_else(|p| p.into_inner()).push(peer.ip());
                let _ = s.write_all(format!("peer={}\n", peer.ip()).as_bytes()).await;
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("server bound");
}

/// Tries each `addr:port` from inside the guest (3 s each): `REACHED <addr> <port> <answer>` or
/// `refused <addr> <port> <why>` per line.
const PROBE: &str = r#"
import socket, sys
for t in sys.argv[1:]:
    a, p = t.rsplit(':', 1)
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((a, int(p))); print('REACHED', a, p, s.recv(100).decode().strip())
    except OSError as e:
        print('refused', a, p, e)
"#;

/// The guest's eth0: `(ip, mac)`.
const ADDR: &str = r#"
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack('256s', b'eth0'))[20:24])
print(ip, open('/sys/class/net/eth0/address').read().strip())
"#;

fn probe(h: &Harness, sb: &Sandbox, targets: &[String]) -> String {
    let mut argv = vec!["python3", "-c", PROBE];
    argv.extend(targets.iter().map(String::as_str));
    let (s, v) = h.exec(&sb.id, &sb.token, &argv);
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
    stdout(&v)
}

fn reached(out: &str, target: &str) -> bool {
    let (a, p) = target.rsplit_once(':').expect("addr:port");
    out.lines().any(|l| l.starts_with(&format!("REACHED {a} {p} ")))
}

#[test]
fn egress_is_opt_in_private_nets_are_refused_and_a_spoofer_reaches_no_one() {
    let _alone = one_at_a_time();
    test_infra::init_tracing();
    let bin = sibling_bin("sandboxd").unwrap_or_else(|e| panic!("{e}"));
    let pid = std::process::id();
    let host = test_infra::netns::Netns::create(&format!("hgh{pid}")).expect("host netns");
    let lan = test_infra::netns::Netns::create(&format!("hgl{pid}")).expect("lan netns");
    ip_in(host.name(), &["link", "add", "up0", "type", "veth", "peer", "name", "wan0", "netns", lan.name()]);
    ip_in(host.name(), &["addr", "add", &format!("{UPLINK_ADDR}/24"), "dev", "up0"]);
    ip_in(host.name(), &["link", "set", "up0", "up"]);
    ip_in(host.name(), &["link", "set", "lo", "up"]);
    ip_in(host.name(), &["route", "add", "default", "via", "198.51.100.1"]);
    ip_in(lan.name(), &["addr", "add", "198.51.100.1/24", "dev", "wan0"]);
    for a in [PUBLIC, LAN, METADATA] {
        ip_in(lan.name(), &["addr", "add", &format!("{a}/32"), "dev", "wan0"]);
    }
    ip_in(lan.name(), &["link", "set", "wan0", "up"]);
    let seen = Arc::new(Mutex::new(Vec::new()));
    for a in [PUBLIC, LAN, METADATA] {
        serve(lan.name(), format!("{a}:8080").parse().expect("addr"), Arc::clone(&seen));
    }
    // A host service inside the VMs' namespace (any address, the gateway's included).
    serve(host.name(), "0.0.0.0:7001".parse().expect("addr"), Arc::new(Mutex::new(Vec::new())));

    let h = Harness::with_config(
        &bin,
        vec![PoolConfig { net: Some("egress".into()), ..PoolConfig::warm("rt", 2) }, PoolConfig::warm("base", 1)],
        |c| {
            c.network = Some(NetworkConfig {
                netns: Some(host.name().to_string()),
                uplink: Some("up0".into()),
                ..NetworkConfig::default()
            })
        },
    );
    h.wait_full("rt");
    h.wait_full("base");
    let claim = |req: ClaimRequest| {
        let (id, token) = h.claim(&req);
        Sandbox { id, token }
    };
    let egress_claim = ClaimRequest { net: Some("egress".into()), ..ClaimRequest::new("rt") };
    let (spoofer, victim) = (claim(egress_claim.clone()), claim(egress_claim));
    let plain = claim(ClaimRequest::new("base"));
    let port = h.addr.rsplit(':').next().expect("port").to_string();

    // (g) Egress: the public address answers, masqueraded behind the uplink; the LAN, the
    // metadata address, the gateway's and the host's services do not.
    step("(g) egress reaches the public address only");
    let t = |a: &str, p: &str| format!("{a}:{p}");
    let targets = vec![
        t(PUBLIC, "8080"),
        t(LAN, "8080"),
        t(METADATA, "8080"),
        t(GATEWAY, "7001"),
        t(GATEWAY, &port),
        t(UPLINK_ADDR, "7001"),
        t("127.0.0.1", &port),
    ];
    let out = probe(&h, &victim, &targets);
    println!("{out}");
    assert!(
        out.lines().any(|l| l == format!("REACHED {PUBLIC} 8080 peer={UPLINK_ADDR}")),
        "egress reaches the public address, masqueraded: {out}"
    );
    for target in &targets[1..] {
        assert!(!reached(&out, target), "{target} was reached with egress: {out}");
    }
    // (g) Without egress: no NIC but loopback, no route.
    step("(g) a sandbox without egress has no network");
    let (s, v) =
        h.exec(&plain.id, &plain.token, &["sh", "-c", "ls /sys/class/net; echo routes; tail -n +2 /proc/net/route"]);
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
    assert_eq!(stdout(&v).split_whitespace().collect::<Vec<_>>(), ["lo", "routes"], "{v}");

    // (f) The spoofer: gratuitous ARP replies for the gateway and the victim, then the victim's
    // IP with a forged MAC, then the victim's IP and MAC. The victim keeps its agent and its
    // egress; the spoofer's forged frames reach no one (the LAN sees no new connection).
    step("(f) spoofing the gateway's ARP, a neighbour's IP and MAC");
    let addr_of = |sb: &Sandbox| {
        let (s, v) = h.exec(&sb.id, &sb.token, &["python3", "-c", ADDR]);
        assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
        let o = stdout(&v);
        let mut w = o.split_whitespace();
        (w.next().expect("ip").to_string(), w.next().expect("mac").to_string())
    };
    let (vip, vmac) = addr_of(&victim);
    let (sip, smac) = addr_of(&spoofer);
    assert_ne!(vip, sip, "two sandboxes, two addresses");
    let public = vec![t(PUBLIC, "8080")];
    let victim_ok = |what: &str| {
        let (s, v) = h.exec(&victim.id, &victim.token, &["true"]);
        assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{what}: the victim's agent: {v}");
        let out = probe(&h, &victim, &public);
        assert!(reached(&out, &public[0]), "{what}: the victim lost its egress: {out}");
    };
    let tx = |sb: &Sandbox| {
        let (s, v) = h.exec(&sb.id, &sb.token, &["cat", "/sys/class/net/eth0/statistics/tx_packets"]);
        assert_eq!(s, 200, "{v}");
        stdout(&v).trim().parse::<u64>().unwrap_or(0)
    };
    let before = seen.lock().unwrap_or_else(|p| p.into_inner()).len();
    let tx_before = tx(&spoofer);
    // The guest has no AF_PACKET; guest-init's net-config turns arp_notify on, so each
    // re-addressing broadcasts gratuitous ARP for the new address: first the gateway's address
    // (with the victim as its "gateway"), then the victim's address with a forged MAC, then the
    // victim's address and MAC.
    let spoofs = [
        (GATEWAY, vip.as_str(), smac.as_str()),
        (vip.as_str(), GATEWAY, "02:66:66:66:66:66"),
        (vip.as_str(), GATEWAY, vmac.as_str()),
    ];
    for (addr, gw, mac) in spoofs {
        let (s, v) =
            h.exec(&spoofer.id, &spoofer.token, &[vmnet::GUEST_INIT, "net-config", &format!("{addr}/24"), gw, mac]);
        assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "re-addressing the spoofer as {addr} {mac}: {v}");
        let out = probe(&h, &spoofer, &public);
        assert!(!reached(&out, &public[0]), "the spoofer as {addr} {mac} reached the public address: {out}");
        victim_ok(&format!("while the spoofer claims {addr} {mac}"));
    }
    assert!(tx(&spoofer) > tx_before, "the spoofer's frames left its NIC");
    // Nobody believed it: the host's neighbour entry of the victim and the victim's entry of
    // the gateway name neither the spoofer's nor the forged MAC.
    let neigh = std::process::Command::new("ip").args(["-n", host.name(), "neigh"]).output().expect("ip neigh");
    let neigh = String::from_utf8_lossy(&neigh.stdout).to_string();
    println!("host neighbours:\n{neigh}");
    assert!(!neigh.contains(&smac) && !neigh.contains("02:66:66:66:66:66"), "the host learnt a forged MAC: {neigh}");
    let (s, v) = h.exec(&victim.id, &victim.token, &["cat", "/proc/net/arp"]);
    assert_eq!(s, 200, "{v}");
    let arp = stdout(&v);
    assert!(!arp.contains(&smac) && !arp.contains("02:66:66:66:66:66"), "the victim learnt a forged MAC: {arp}");
    let seen_now = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(
        seen_now.len() - before,
        spoofs.len(),
        "only the victim's probes (one per spoof) reached the LAN side: {seen_now:?}"
    );
    assert!(seen_now.iter().all(|a| a.to_string() == UPLINK_ADDR), "the LAN saw a forged source: {seen_now:?}");

    for sb in [&spoofer, &victim, &plain] {
        let (s, v) = h.call("POST", &format!("/v1/sandboxes/{}/release", sb.id), Some(&sb.token), None);
        assert!(s == 200 || s == 204, "release: {s} {v}");
    }
    h.finish();
    drop((lan, host));
}

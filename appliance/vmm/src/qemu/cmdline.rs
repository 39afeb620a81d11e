//! Building QEMU's command line and the guest kernel command line (pure functions, unit-tested).

use std::path::{Path, PathBuf};

use crate::accel::Accel;
use crate::driver::{BootSpec, Ram};

/// Per-VM file names inside `<state_dir>/vms/<id>/`.
pub mod files {
    /// QMP socket.
    pub const QMP: &str = "qmp.sock";
    /// QEMU chardev socket of the agent virtio-serial port.
    pub const AGENT_SERIAL: &str = "agent-serial.sock";
    /// Hybrid-vsock bridge socket.
    pub const VSOCK: &str = "vsock.sock";
    /// Serial console log, written by the driver's drain ([`crate::console`]), never by QEMU.
    pub const CONSOLE: &str = "console.log";
    /// The serial port's socket: QEMU connects to it, the driver listens and drains it.
    pub const CONSOLE_SOCK: &str = crate::console::CONSOLE_SOCKET;
    /// QEMU pid file (written by the driver: QEMU reaches none of our directories).
    pub const PID: &str = "qemu.pid";
    /// QEMU's stdout and stderr (its own messages, never the guest's console), capped at
    /// [`crate::jail::output::LOG_CAP`].
    pub const LOG: &str = "qemu.log";
    /// Per-VM writable overlay disk.
    pub const OVERLAY: &str = "overlay.qcow2";
    /// Snapshot: migration stream.
    pub const STATE: &str = "state";
    /// The RAM of a [`Ram::SharedFile`](crate::driver::Ram::SharedFile) VM (in its dir) and of
    /// its snapshot (in the snapshot's dir).
    pub const MEMORY: &str = "memory";
}

/// One layer of a disk: a descriptor the driver opened and passes in, its format, and the
/// path it was opened from (named in `-add-fd`'s `opaque` for whoever reads the command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskLayer {
    /// The inherited descriptor.
    pub fd: i32,
    /// `qcow2` or `raw`.
    pub format: &'static str,
    /// Where it was opened from.
    pub path: PathBuf,
}

/// The descriptors QEMU inherits instead of opening paths (it runs jailed and reaches none of
/// the driver's directories): listening sockets, kernel, disks, the TAP.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fds {
    /// The QMP socket, listening.
    pub qmp: i32,
    /// The serial console socket, listening (the driver dials it).
    pub console: i32,
    /// The agent virtio-serial port's socket, listening (the vsock bridge dials it).
    pub agent: i32,
    /// The guest kernel and initrd, read-only (opened by QEMU as `/proc/self/fd/N`).
    pub kernel: Option<i32>,
    /// The initrd.
    pub initrd: Option<i32>,
    /// The read-only root filesystem image.
    pub rootfs: Option<DiskLayer>,
    /// The writable overlay (first) and its backing chain, bottom last.
    pub overlay: Vec<DiskLayer>,
    /// The TAP, attached (`TUNSETIFF`) by the driver.
    pub tap: Option<i32>,
    /// The migration stream to restore from (`migrate-incoming fd:N`).
    pub incoming: Option<i32>,
    /// The file the guest's RAM maps (opened by QEMU as `/proc/self/fd/N`): the VM's own,
    /// read-write, for [`Ram::SharedFile`]; the golden's, sealed against writes, for a clone.
    pub memory: Option<i32>,
}

/// The translation-block cache of a TCG guest, MiB. QEMU's default (1 GiB) lets an idle
/// emulated guest hold hundreds of MiB of translated code; a bounded cache retranslates a
/// busy guest's hot code more often and keeps an idle one small.
pub const TCG_TB_SIZE_MIB: u32 = 64;

/// The id of the named RAM backend ([`Ram::SharedFile`], [`Ram::Private`]): the RAM block's
/// name in migration streams.
pub const RAM_BACKEND: &str = "ram0";

/// Everything the QEMU command line depends on.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    /// VM name (`-name`).
    pub name: &'a str,
    /// VM directory (named on the command line, so a VM's process is found by it).
    pub dir: &'a Path,
    /// The spec (kernel, disks, size).
    pub spec: &'a BootSpec,
    /// Accelerator.
    pub accel: Accel,
    /// Host TSC frequency in kHz (needed under TCG).
    pub tsc_khz: Option<u64>,
    /// The inherited descriptors.
    pub fds: &'a Fds,
    /// Start with `-incoming defer` (restore).
    pub incoming: bool,
    /// Start with vCPUs paused (`-S`).
    pub paused: bool,
    /// Omit `-kernel/-initrd/-append` (firmware only; tests of the process lifecycle).
    pub firmware_only: bool,
}

/// QEMU's seccomp sandbox: no obsolete syscalls, no set*id, no fork/exec, no scheduler or
/// resource changes.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// `/proc/self/fd/<fd>`: how QEMU names a file it only holds a descriptor of, for the options
/// that take no fd set (`-kernel`, `-initrd`).
pub fn proc_fd(fd: i32) -> String {
    format!("/proc/self/fd/{fd}")
}

/// The guest kernel command line: console, panic/reboot policy, TSC hint under TCG, template args.
pub fn kernel_cmdline(spec: &BootSpec, accel: Accel, tsc_khz: Option<u64>) -> String {
    let mut parts = vec!["console=ttyS0".to_string(), "reboot=t".into(), "panic=-1".into()];
    if accel == Accel::Tcg {
        if let Some(k) = tsc_khz {
            parts.push(format!("tsc_early_khz={k}"));
        }
    }
    let extra = spec.cmdline.trim();
    if !extra.is_empty() {
        parts.push(extra.to_string());
    }
    if let Some(nic) = &spec.nic {
        parts.push(nic.kernel_args());
    }
    parts.join(" ")
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// `-add-fd` + `-blockdev` for a disk's layers (top first), the top node named `node`;
/// `fdset` is the next free fd set id.
fn blockdevs(push: &mut dyn FnMut(&[&str]), node: &str, layers: &[DiskLayer], writable: bool, fdset: &mut u32) {
    let mut below: Option<String> = None;
    for (i, l) in layers.iter().enumerate().rev() {
        let set = *fdset;
        *fdset += 1;
        push(&["-add-fd", &format!("fd={},set={set},opaque={}", l.fd, p(&l.path))]);
        let name = if i == 0 { node.to_string() } else { format!("{node}-{i}") };
        let mut opts = format!("driver={},node-name={name},file.driver=file,file.filename=/dev/fdset/{set}", l.format);
        if i == 0 && writable {
            opts.push_str(",discard=unmap,file.discard=unmap");
        } else {
            opts.push_str(",read-only=on");
        }
        if l.format == "qcow2" {
            match &below {
                Some(b) => opts.push_str(&format!(",backing={b}")),
                None => opts.push_str(",backing=null"),
            }
        }
        push(&["-blockdev", &opts]);
        below = Some(name);
    }
}

/// The id of the virtio-scsi controller volumes plug onto.
pub const SCSI_CONTROLLER: &str = "scsi0";

/// QEMU's arguments (without the program name).
pub fn qemu_args(l: &Launch<'_>) -> Vec<String> {
    let f = l.fds;
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&["-name", l.name]);
    let machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on";
    match l.spec.ram {
        Ram::Anonymous => push(&["-M", machine]),
        Ram::SharedFile | Ram::Private => push(&["-M", &format!("{machine},memory-backend={RAM_BACKEND}")]),
    }
    match l.accel {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => push(&["-accel", &format!("tcg,tb-size={TCG_TB_SIZE_MIB}"), "-cpu", "max"]),
    }
    let smp = l.spec.size.vcpus().to_string();
    let mem = format!("{}M", l.spec.size.memory_mib());
    push(&["-smp", &smp, "-m", &mem]);
    if let Some(backend) = ram_backend(l.spec.ram, &mem, f.memory) {
        push(&["-object", &backend]);
    }
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-sandbox", SANDBOX]);
    // Names the VM directory on the command line (nothing opens it): how a VM's process is
    // found when its owner died before recording its pid (`lifecycle::processes_naming`).
    push(&["-object", &format!("secret,id=vm-dir,format=raw,data={}/", p(l.dir))]);
    push(&["-chardev", &format!("socket,id=qmp0,fd={},server=on,wait=off", f.qmp)]);
    push(&["-mon", "chardev=qmp0,mode=control"]);
    // The serial port serves on a socket the driver dials (dropping output while no one is
    // connected); the driver's drain keeps a capped log of it.
    push(&["-chardev", &format!("socket,id=serial0,fd={},server=on,wait=off", f.console)]);
    push(&["-serial", "chardev:serial0"]);
    if !l.firmware_only {
        if let (Some(k), Some(i)) = (f.kernel, f.initrd) {
            push(&["-kernel", &proc_fd(k), "-initrd", &proc_fd(i)]);
        }
        push(&["-append", &kernel_cmdline(l.spec, l.accel, l.tsc_khz)]);
    }
    let mut fdset = 1;
    if let Some(rootfs) = &f.rootfs {
        blockdevs(&mut push, "rootfs", std::slice::from_ref(rootfs), false, &mut fdset);
        push(&["-device", "virtio-blk-device,drive=rootfs"]);
    }
    if !f.overlay.is_empty() {
        blockdevs(&mut push, "overlay", &f.overlay, true, &mut fdset);
        push(&["-device", "virtio-blk-device,drive=overlay"]);
    }
    push(&["-device", "virtio-serial-device,max_ports=2"]);
    push(&["-chardev", &format!("socket,id=agent0,fd={},server=on,wait=off", f.agent)]);
    push(&["-device", &format!("virtserialport,chardev=agent0,name={}", agent_mux::AGENT_PORT_NAME)]);
    // After every other device, so VMs without a NIC keep their virtio-mmio layout (and
    // snapshots taken before NICs existed stay restorable).
    if let (Some(nic), Some(tap)) = (&l.spec.nic, f.tap) {
        push(&["-netdev", &format!("tap,id=net0,fd={tap}")]);
        push(&["-device", &format!("virtio-net-device,netdev=net0,mac={}", nic.mac)]);
    }
    // After the NIC for the same reason: a spec without it keeps its old layout. The backend
    // is QEMU's built-in getrandom() source (no file to open); the guest may draw at most
    // RNG_BYTES_PER_SEC.
    if l.spec.rng {
        push(&["-object", "rng-builtin,id=rng0"]);
        push(&[
            "-device",
            &format!("virtio-rng-device,rng=rng0,max-bytes={},period=1000", crate::driver::RNG_BYTES_PER_SEC),
        ]);
    }
    // Last, for the same reason: the controller volumes hot-plug onto (`scsi-hd` per slot).
    if l.spec.volumes {
        push(&["-device", &format!("virtio-scsi-device,id={SCSI_CONTROLLER},num_queues=1")]);
    }
    if l.paused {
        push(&["-S"]);
    }
    if l.incoming {
        push(&["-incoming", "defer"]);
    }
    a
}

/// The `-object` of the named RAM backend, if the spec has one: the VM's own file mapped
/// shared (the golden: a snapshot leaves RAM in it); a clone's private map of the golden's
/// file (the pages it has not written stay shared with every other clone); or anonymous memory
/// under the same name (a VM restored from a full snapshot of a clone).
fn ram_backend(ram: Ram, size: &str, memory: Option<i32>) -> Option<String> {
    let file = |fd: i32, share: &str| {
        format!("memory-backend-file,id={RAM_BACKEND},size={size},mem-path={},share={share}", proc_fd(fd))
    };
    match (ram, memory) {
        (Ram::Anonymous, _) => None,
        (Ram::SharedFile, Some(fd)) => Some(file(fd, "on")),
        (Ram::Private, Some(fd)) => Some(file(fd, "off")),
        (Ram::SharedFile | Ram::Private, None) => Some(format!("memory-backend-ram,id={RAM_BACKEND},size={size}")),
    }
}

/// Parses the TSC frequency from kernel log text (`tsc: Detected 2596.130 MHz processor` or
/// `tsc: Refined TSC clocksource calibration: 2596.131 MHz`), preferring the refined value.
pub fn tsc_khz_from_dmesg(text: &str) -> Option<u64> {
    let mut detected = None;
    let mut refined = None;
    for line in text.lines() {
        let mhz = |marker: &str| {
            let rest = &line[line.find(marker)? + marker.len()..];
            mhz_to_khz(rest.split_whitespace().next()?)
        };
        if let Some(k) = mhz("tsc: Refined TSC clocksource calibration:") {
            refined = Some(k);
        } else if let Some(k) = mhz("tsc: Detected") {
            detected = Some(k);
        }
    }
    refined.or(detected)
}

/// Parses `cpu MHz : 2596.130` from `/proc/cpuinfo` text.
pub fn tsc_khz_from_cpuinfo(text: &str) -> Option<u64> {
    text.lines().find(|l| l.starts_with("cpu MHz")).and_then(|l| l.split(':').nth(1)).and_then(|v| mhz_to_khz(v.trim()))
}

fn mhz_to_khz(s: &str) -> Option<u64> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let int: u64 = int.parse().ok()?;
    let mut frac3: String = frac.chars().take(3).collect();
    while frac3.len() < 3 {
        frac3.push('0');
    }
    let frac: u64 = frac3.parse().ok()?;
    Some(int * 1000 + frac)
}

/// The host TSC frequency: `CHRYSALIS_TSC_KHZ`, else the kernel log, else `/proc/cpuinfo`.
pub fn host_tsc_khz() -> Option<u64> {
    if let Some(k) = std::env::var("CHRYSALIS_TSC_KHZ").ok().and_then(|v| v.parse().ok()) {
        return Some(k);
    }
    let dmesg = std::process::Command::new("dmesg")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| tsc_khz_from_dmesg(&String::from_utf8_lossy(&o.stdout)));
    dmesg.or_else(|| tsc_khz_from_cpuinfo(&std::fs::read_to_string("/proc/cpuinfo").ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AccelPreference, SizeClass};

    fn spec(rootfs: bool) -> BootSpec {
        BootSpec {
            overlay_bytes: None,
            name: "rt".into(),
            kernel: "/k/vmlinux".into(),
            initrd: "/k/initrd".into(),
            rootfs: rootfs.then(|| "/k/rootfs.erofs".into()),
            overlay_base: rootfs.then(|| "/k/overlay.ext4".into()),
            cmdline: "chrysalis.rootfs=/dev/vda".into(),
            size: SizeClass::Medium,
            accel: AccelPreference::Auto,
            nic: None,
            rng: true,
            volumes: true,
            ram: crate::driver::Ram::Anonymous,
        }
    }

    fn after<'a>(a: &'a [String], flag: &str) -> Vec<&'a str> {
        a.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    fn fds(disks: bool) -> Fds {
        let layer = |fd, format, path: &str| DiskLayer { fd, format, path: path.into() };
        Fds {
            qmp: 3,
            console: 4,
            agent: 5,
            kernel: Some(6),
            initrd: Some(7),
            rootfs: disks.then(|| layer(8, "raw", "/k/rootfs.erofs")),
            overlay: if disks {
                vec![layer(9, "qcow2", "/s/vms/x/overlay.qcow2"), layer(10, "raw", "/k/overlay.ext4")]
            } else {
                Vec::new()
            },
            tap: None,
            incoming: None,
            memory: None,
        }
    }

    #[test]
    fn tcg_command_line() {
        let s = spec(true);
        let dir = Path::new("/s/vms/x");
        let f = fds(true);
        let a = qemu_args(&Launch {
            name: "x",
            dir,
            spec: &s,
            accel: Accel::Tcg,
            tsc_khz: Some(2596130),
            fds: &f,
            incoming: false,
            paused: false,
            firmware_only: false,
        });
        assert_eq!(after(&a, "-M"), ["microvm,x-option-roms=off,isa-serial=on,rtc=on"]);
        assert_eq!(after(&a, "-accel"), ["tcg,tb-size=64"]);
        assert_eq!(after(&a, "-cpu"), ["max"]);
        assert_eq!(after(&a, "-smp"), ["2"]);
        assert_eq!(after(&a, "-m"), ["1024M"]);
        assert_eq!(after(&a, "-sandbox"), ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]);
        assert_eq!(after(&a, "-mon"), ["chardev=qmp0,mode=control"]);
        assert_eq!(after(&a, "-serial"), ["chardev:serial0"]);
        assert_eq!(after(&a, "-kernel"), ["/proc/self/fd/6"]);
        assert_eq!(after(&a, "-initrd"), ["/proc/self/fd/7"]);
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=t panic=-1 tsc_early_khz=2596130 chrysalis.rootfs=/dev/vda"]
        );
        assert_eq!(
            after(&a, "-add-fd"),
            [
                "fd=8,set=1,opaque=/k/rootfs.erofs",
                "fd=10,set=2,opaque=/k/overlay.ext4",
                "fd=9,set=3,opaque=/s/vms/x/overlay.qcow2"
            ]
        );
        assert_eq!(
            after(&a, "-blockdev"),
            [
                "driver=raw,node-name=rootfs,file.driver=file,file.filename=/dev/fdset/1,read-only=on",
                "driver=raw,node-name=overlay-1,file.driver=file,file.filename=/dev/fdset/2,read-only=on",
                "driver=qcow2,node-name=overlay,file.driver=file,file.filename=/dev/fdset/3,discard=unmap,file.discard=unmap,backing=overlay-1",
            ]
        );
        let devs = after(&a, "-device");
        assert_eq!(devs[0], "virtio-blk-device,drive=rootfs", "rootfs must be the first disk (/dev/vda)");
        assert_eq!(devs[1], "virtio-blk-device,drive=overlay");
        assert!(devs.contains(&"virtserialport,chardev=agent0,name=org.chrysalis.agent.0"));
        assert_eq!(
            after(&a, "-chardev"),
            [
                "socket,id=qmp0,fd=3,server=on,wait=off",
                "socket,id=serial0,fd=4,server=on,wait=off",
                "socket,id=agent0,fd=5,server=on,wait=off"
            ]
        );
        assert_eq!(after(&a, "-object"), ["secret,id=vm-dir,format=raw,data=/s/vms/x/", "rng-builtin,id=rng0"]);
        // QEMU opens no path of ours: everything but the marker is a descriptor.
        let paths: Vec<&String> = a
            .iter()
            .filter(|x| x.contains("/s/vms/x") && !x.starts_with("secret,") && !x.contains("opaque="))
            .collect();
        assert!(paths.is_empty(), "{paths:?}");
        assert!(!a.iter().any(|x| x.starts_with("file:")), "QEMU writes no file the guest controls");
        for flag in ["-nodefaults", "-no-user-config", "-nographic"] {
            assert!(a.iter().any(|x| x == flag), "{flag}");
        }
        for flag in ["-daemonize", "-pidfile", "-qmp", "-drive", "-S", "-incoming"] {
            assert!(!a.iter().any(|x| x == flag), "{flag}");
        }
    }

    #[test]
    fn kvm_restore_command_line() {
        let s = spec(false);
        let f = fds(false);
        let a = qemu_args(&Launch {
            name: "y",
            dir: Path::new("/d"),
            spec: &s,
            accel: Accel::Kvm,
            tsc_khz: Some(1),
            fds: &f,
            incoming: true,
            paused: true,
            firmware_only: false,
        });
        assert_eq!(after(&a, "-accel"), ["kvm"]);
        assert_eq!(after(&a, "-cpu"), ["host"]);
        assert_eq!(after(&a, "-incoming"), ["defer"]);
        assert!(a.iter().any(|x| x == "-S"));
        assert!(after(&a, "-blockdev").is_empty());
        assert!(!after(&a, "-append")[0].contains("tsc_early_khz"), "only under TCG");
    }

    #[test]
    fn nic_adds_a_tap_netdev_a_virtio_net_device_and_kernel_args() {
        let mut s = spec(true);
        s.nic = Some(crate::driver::NicSpec {
            tap: "ct-0123456789ab".into(),
            mac: "02:11:22:33:44:55".into(),
            netns: Some("t1".into()),
            ip_cidr: "10.88.0.5/24".into(),
            gateway: "10.88.0.1".into(),
        });
        let launch = |spec, f: &Fds| {
            qemu_args(&Launch {
                name: "n",
                dir: Path::new("/d"),
                spec,
                accel: Accel::Tcg,
                tsc_khz: None,
                fds: f,
                incoming: false,
                paused: false,
                firmware_only: false,
            })
        };
        let f = Fds { tap: Some(11), ..fds(true) };
        let a = launch(&s, &f);
        assert_eq!(after(&a, "-netdev"), ["tap,id=net0,fd=11"]);
        let devs = after(&a, "-device");
        assert_eq!(
            devs[devs.len() - 3],
            "virtio-net-device,netdev=net0,mac=02:11:22:33:44:55",
            "the NIC comes after the disks and the serial"
        );
        assert_eq!(devs[devs.len() - 2], "virtio-rng-device,rng=rng0,max-bytes=65536,period=1000", "then the RNG");
        assert_eq!(devs.last(), Some(&"virtio-scsi-device,id=scsi0,num_queues=1"), "then the volume controller");
        assert_eq!(devs[0], "virtio-blk-device,drive=rootfs");
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=t panic=-1 chrysalis.rootfs=/dev/vda chrysalis.ip=10.88.0.5/24 chrysalis.gw=10.88.0.1 chrysalis.mac=02:11:22:33:44:55"]
        );
        // Without a NIC: no network device at all.
        let a = launch(&spec(true), &fds(true));
        assert!(after(&a, "-netdev").is_empty());
        assert!(!after(&a, "-device").iter().any(|d| d.starts_with("virtio-net")));
        assert!(!after(&a, "-append")[0].contains("chrysalis.ip"));
    }

    #[test]
    fn tsc_parsing() {
        let log = "[    0.000048] tsc: Detected 2596.130 MHz processor\n[ 1.2] tsc: Refined TSC clocksource calibration: 2596.1 MHz\n";
        assert_eq!(tsc_khz_from_dmesg(log), Some(2596100));
        assert_eq!(tsc_khz_from_dmesg("[0.1] tsc: Detected 2596.130 MHz processor"), Some(2596130));
        assert_eq!(tsc_khz_from_dmesg("nothing"), None);
        assert_eq!(tsc_khz_from_cpuinfo("processor\t: 0\ncpu MHz\t\t: 2596.130\n"), Some(2596130));
        assert_eq!(tsc_khz_from_cpuinfo("cpu MHz : 3000\n"), Some(3000000));
    }

    #[test]
    fn rng_is_a_rate_limited_builtin_source_after_every_other_device_and_only_when_asked() {
        let f = fds(true);
        let launch = |spec: &BootSpec| {
            qemu_args(&Launch {
                name: "n",
                dir: Path::new("/d"),
                spec,
                accel: Accel::Kvm,
                tsc_khz: None,
                fds: &f,
                incoming: false,
                paused: false,
                firmware_only: false,
            })
        };
        let a = launch(&spec(true));
        assert_eq!(after(&a, "-object").last(), Some(&"rng-builtin,id=rng0"));
        let devs = after(&a, "-device");
        assert_eq!(devs[devs.len() - 2], "virtio-rng-device,rng=rng0,max-bytes=65536,period=1000");
        // The volume controller is last, and only in specs recorded since volumes exist.
        assert_eq!(devs.last(), Some(&"virtio-scsi-device,id=scsi0,num_queues=1"));
        let mut before_volumes = spec(true);
        before_volumes.volumes = false;
        let a = launch(&before_volumes);
        assert!(!after(&a, "-device").iter().any(|d| d.starts_with("virtio-scsi")));
        assert_eq!(after(&a, "-device").last(), Some(&"virtio-rng-device,rng=rng0,max-bytes=65536,period=1000"));
        // A spec recorded before the device existed keeps the old layout (restorable snapshots).
        let mut old = spec(true);
        old.rng = false;
        let a = launch(&old);
        assert!(!after(&a, "-object").iter().any(|o| o.starts_with("rng-")));
        assert!(!after(&a, "-device").iter().any(|d| d.starts_with("virtio-rng")));
    }

    #[test]
    fn ram_lives_where_the_spec_says_and_tcg_bounds_its_translation_cache() {
        let launch = |ram: Ram, memory: Option<i32>, accel: Accel| {
            let mut s = spec(true);
            s.ram = ram;
            let f = Fds { memory, ..fds(true) };
            qemu_args(&Launch {
                name: "n",
                dir: Path::new("/d"),
                spec: &s,
                accel,
                tsc_khz: None,
                fds: &f,
                incoming: false,
                paused: false,
                firmware_only: false,
            })
        };
        // Anonymous: QEMU's default RAM block, as every VM before this field.
        let a = launch(Ram::Anonymous, None, Accel::Kvm);
        assert_eq!(after(&a, "-M"), ["microvm,x-option-roms=off,isa-serial=on,rtc=on"]);
        assert!(!after(&a, "-object").iter().any(|o| o.starts_with("memory-backend")));
        assert_eq!(after(&a, "-accel"), ["kvm"]);
        // The golden maps its own file shared; a clone maps the golden's privately.
        let a = launch(Ram::SharedFile, Some(11), Accel::Tcg);
        assert_eq!(after(&a, "-M"), ["microvm,x-option-roms=off,isa-serial=on,rtc=on,memory-backend=ram0"]);
        assert!(
            after(&a, "-object").contains(&"memory-backend-file,id=ram0,size=1024M,mem-path=/proc/self/fd/11,share=on")
        );
        assert_eq!(after(&a, "-accel"), ["tcg,tb-size=64"]);
        let a = launch(Ram::Private, Some(12), Accel::Tcg);
        assert!(after(&a, "-object")
            .contains(&"memory-backend-file,id=ram0,size=1024M,mem-path=/proc/self/fd/12,share=off"));
        // A restore of a clone's full snapshot: the same block name, anonymous memory.
        let a = launch(Ram::Private, None, Accel::Tcg);
        assert!(after(&a, "-object").contains(&"memory-backend-ram,id=ram0,size=1024M"));
    }
}

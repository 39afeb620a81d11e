//! Building QEMU's command line and the guest kernel command line (pure functions, unit-tested).

use std::path::{Path, PathBuf};

use crate::accel::Accel;
use crate::driver::BootSpec;

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
    /// QEMU pid file.
    pub const PID: &str = "qemu.pid";
    /// Per-VM writable overlay disk.
    pub const OVERLAY: &str = "overlay.qcow2";
    /// Snapshot: migration stream.
    pub const STATE: &str = "state";
}

/// Everything the QEMU command line depends on.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    /// VM name (`-name`).
    pub name: &'a str,
    /// VM directory.
    pub dir: &'a Path,
    /// Where the VM's sockets are addressed: `dir`, or a short link to it (see `sockdir`).
    pub sock_dir: &'a Path,
    /// The spec (kernel, disks, size).
    pub spec: &'a BootSpec,
    /// Accelerator.
    pub accel: Accel,
    /// Host TSC frequency in kHz (needed under TCG).
    pub tsc_khz: Option<u64>,
    /// Per-VM overlay path, if the spec has an overlay base.
    pub overlay: Option<PathBuf>,
    /// Start with `-incoming defer` (restore).
    pub incoming: bool,
    /// Start with vCPUs paused (`-S`).
    pub paused: bool,
    /// Omit `-kernel/-initrd/-append` (firmware only; tests of the process lifecycle).
    pub firmware_only: bool,
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

/// QEMU's arguments (without the program name).
pub fn qemu_args(l: &Launch<'_>) -> Vec<String> {
    let d = l.dir;
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&["-name", l.name]);
    push(&["-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on"]);
    match l.accel {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => push(&["-accel", "tcg", "-cpu", "max"]),
    }
    let smp = l.spec.size.vcpus().to_string();
    let mem = format!("{}M", l.spec.size.memory_mib());
    push(&["-smp", &smp, "-m", &mem]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-daemonize", "-pidfile", &p(&d.join(files::PID))]);
    push(&["-qmp", &format!("unix:{},server=on,wait=off", p(&l.sock_dir.join(files::QMP)))]);
    // The serial port is a socket QEMU dials (and re-dials every second while no one listens,
    // dropping the output meanwhile); the driver's drain keeps a capped log of it.
    push(&[
        "-chardev",
        &format!("socket,id=serial0,path={},server=off,reconnect=1", p(&l.sock_dir.join(files::CONSOLE_SOCK))),
    ]);
    push(&["-serial", "chardev:serial0"]);
    if !l.firmware_only {
        push(&["-kernel", &p(&l.spec.kernel), "-initrd", &p(&l.spec.initrd)]);
        push(&["-append", &kernel_cmdline(l.spec, l.accel, l.tsc_khz)]);
    }
    if let Some(rootfs) = &l.spec.rootfs {
        push(&["-drive", &format!("id=rootfs,file={},format=raw,if=none,readonly=on", p(rootfs))]);
        push(&["-device", "virtio-blk-device,drive=rootfs"]);
    }
    if let Some(overlay) = &l.overlay {
        push(&["-drive", &format!("id=overlay,file={},format=qcow2,if=none,discard=unmap", p(overlay))]);
        push(&["-device", "virtio-blk-device,drive=overlay"]);
    }
    push(&["-device", "virtio-serial-device,max_ports=2"]);
    push(&[
        "-chardev",
        &format!("socket,id=agent0,path={},server=on,wait=off", p(&l.sock_dir.join(files::AGENT_SERIAL))),
    ]);
    push(&["-device", &format!("virtserialport,chardev=agent0,name={}", agent_mux::AGENT_PORT_NAME)]);
    // After every other device, so VMs without a NIC keep their virtio-mmio layout (and
    // snapshots taken before NICs existed stay restorable).
    if let Some(nic) = &l.spec.nic {
        push(&["-netdev", &format!("tap,id=net0,ifname={},script=no,downscript=no", nic.tap)]);
        push(&["-device", &format!("virtio-net-device,netdev=net0,mac={}", nic.mac)]);
    }
    if l.paused {
        push(&["-S"]);
    }
    if l.incoming {
        push(&["-incoming", "defer"]);
    }
    a
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
            name: "rt".into(),
            kernel: "/k/vmlinux".into(),
            initrd: "/k/initrd".into(),
            rootfs: rootfs.then(|| "/k/rootfs.erofs".into()),
            overlay_base: rootfs.then(|| "/k/overlay.ext4".into()),
            cmdline: "chrysalis.rootfs=/dev/vda".into(),
            size: SizeClass::Medium,
            accel: AccelPreference::Auto,
            nic: None,
        }
    }

    fn after<'a>(a: &'a [String], flag: &str) -> Vec<&'a str> {
        a.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    #[test]
    fn tcg_command_line() {
        let s = spec(true);
        let dir = Path::new("/s/vms/x");
        let a = qemu_args(&Launch {
            name: "x",
            dir,
            sock_dir: dir,
            spec: &s,
            accel: Accel::Tcg,
            tsc_khz: Some(2596130),
            overlay: Some(dir.join(files::OVERLAY)),
            incoming: false,
            paused: false,
            firmware_only: false,
        });
        assert_eq!(after(&a, "-M"), ["microvm,x-option-roms=off,isa-serial=on,rtc=on"]);
        assert_eq!(after(&a, "-accel"), ["tcg"]);
        assert_eq!(after(&a, "-cpu"), ["max"]);
        assert_eq!(after(&a, "-smp"), ["2"]);
        assert_eq!(after(&a, "-m"), ["1024M"]);
        assert_eq!(after(&a, "-qmp"), ["unix:/s/vms/x/qmp.sock,server=on,wait=off"]);
        assert_eq!(after(&a, "-serial"), ["chardev:serial0"]);
        assert_eq!(after(&a, "-pidfile"), ["/s/vms/x/qemu.pid"]);
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=t panic=-1 tsc_early_khz=2596130 chrysalis.rootfs=/dev/vda"]
        );
        let drives = after(&a, "-drive");
        assert_eq!(drives.len(), 2);
        assert!(
            drives[0].starts_with("id=rootfs,file=/k/rootfs.erofs,format=raw") && drives[0].contains("readonly=on")
        );
        assert!(drives[1].starts_with("id=overlay,file=/s/vms/x/overlay.qcow2,format=qcow2"));
        let devs = after(&a, "-device");
        assert_eq!(devs[0], "virtio-blk-device,drive=rootfs", "rootfs must be the first disk (/dev/vda)");
        assert_eq!(devs[1], "virtio-blk-device,drive=overlay");
        assert!(devs.contains(&"virtserialport,chardev=agent0,name=org.chrysalis.agent.0"));
        assert_eq!(
            after(&a, "-chardev"),
            [
                "socket,id=serial0,path=/s/vms/x/console.sock,server=off,reconnect=1",
                "socket,id=agent0,path=/s/vms/x/agent-serial.sock,server=on,wait=off"
            ]
        );
        assert!(!a.iter().any(|x| x.starts_with("file:")), "QEMU writes no file the guest controls");
        for flag in ["-nodefaults", "-no-user-config", "-nographic", "-daemonize"] {
            assert!(a.iter().any(|x| x == flag), "{flag}");
        }
        assert!(!a.iter().any(|x| x == "-S" || x == "-incoming"));
    }

    #[test]
    fn kvm_restore_command_line() {
        let s = spec(false);
        let a = qemu_args(&Launch {
            name: "y",
            dir: Path::new("/d"),
            sock_dir: Path::new("/d"),
            spec: &s,
            accel: Accel::Kvm,
            tsc_khz: Some(1),
            overlay: None,
            incoming: true,
            paused: true,
            firmware_only: false,
        });
        assert_eq!(after(&a, "-accel"), ["kvm"]);
        assert_eq!(after(&a, "-cpu"), ["host"]);
        assert_eq!(after(&a, "-incoming"), ["defer"]);
        assert!(a.iter().any(|x| x == "-S"));
        assert!(after(&a, "-drive").is_empty());
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
        let launch = |spec| {
            qemu_args(&Launch {
                name: "n",
                dir: Path::new("/d"),
                sock_dir: Path::new("/d"),
                spec,
                accel: Accel::Tcg,
                tsc_khz: None,
                overlay: None,
                incoming: false,
                paused: false,
                firmware_only: false,
            })
        };
        let a = launch(&s);
        assert_eq!(after(&a, "-netdev"), ["tap,id=net0,ifname=ct-0123456789ab,script=no,downscript=no"]);
        let devs = after(&a, "-device");
        assert_eq!(devs.last(), Some(&"virtio-net-device,netdev=net0,mac=02:11:22:33:44:55"), "NIC is the last device");
        assert_eq!(devs[0], "virtio-blk-device,drive=rootfs");
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=t panic=-1 chrysalis.rootfs=/dev/vda chrysalis.ip=10.88.0.5/24 chrysalis.gw=10.88.0.1 chrysalis.mac=02:11:22:33:44:55"]
        );
        // Without a NIC: no network device at all.
        let a = launch(&spec(true));
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
}

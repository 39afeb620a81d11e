//! The `chrysalis.*` keys of the kernel command line.
//!
//! | key | meaning |
//! |---|---|
//! | `chrysalis.rootfs=/dev/vda` | erofs root image (read-only); without it the initramfs is the root |
//! | `chrysalis.overlay=/dev/vdb` or `tmpfs` | writable upper layer: an ext4 disk, or RAM (default `tmpfs`) |
//! | `chrysalis.hostname=NAME` | hostname (default `sandbox`) |
//! | `chrysalis.silkd=/path` | the agent binary to run (default `/.chrysalis/silkd`, else `/sbin/silkd`) |
//! | `chrysalis.env.NAME=VALUE` | extra environment variable for silkd |
//! | `chrysalis.debug_shell` | also run `/bin/sh` on the console (debugging only) |
//! | `chrysalis.ip=A.B.C.D/LEN` | configure `eth0` with this address (the VM's NIC) |
//! | `chrysalis.gw=A.B.C.D` | default route via this gateway (with `chrysalis.ip`) |
//! | `chrysalis.mac=xx:xx:xx:xx:xx:xx` | set this MAC on `eth0` first (with `chrysalis.ip`) |
//!
//! Parsing never fails: malformed values are reported as warnings and ignored.

use crate::net::{parse_ip_cidr, parse_mac, Ipv4Config};

/// Where the writable layer of an image root lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Overlay {
    /// RAM-backed upper layer (lost on reboot).
    Tmpfs,
    /// An ext4 block device holding `upper/` and `work/`.
    Disk(String),
}

/// What guest-init was asked to do by the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    /// Read-only erofs root image device; `None` = stay on the initramfs.
    pub rootfs: Option<String>,
    /// Writable layer for `rootfs`.
    pub overlay: Overlay,
    /// Hostname to set.
    pub hostname: String,
    /// Explicit agent path.
    pub silkd: Option<String>,
    /// Extra environment for silkd, in command-line order.
    pub env: Vec<(String, String)>,
    /// Run a shell on the console too.
    pub debug_shell: bool,
    /// Static configuration of `eth0` (`chrysalis.ip` / `gw` / `mac`).
    pub net: Option<Ipv4Config>,
    /// Problems found while parsing (printed on the console, otherwise ignored).
    pub warnings: Vec<String>,
}

impl Default for BootConfig {
    fn default() -> Self {
        BootConfig {
            rootfs: None,
            overlay: Overlay::Tmpfs,
            hostname: "sandbox".to_string(),
            silkd: None,
            env: Vec::new(),
            debug_shell: false,
            net: None,
            warnings: Vec::new(),
        }
    }
}

/// Splits a command line into parameters like the kernel does: whitespace separates, double
/// quotes group (and are removed).
pub fn split(cmdline: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_quotes = false;
    let mut have = false;
    for c in cmdline.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                have = true;
            }
            c if c.is_whitespace() && !in_quotes => {
                if have {
                    out.push(std::mem::take(&mut cur));
                    have = false;
                }
            }
            c => {
                cur.push(c);
                have = true;
            }
        }
    }
    if have {
        out.push(cur);
    }
    out
}

fn is_device(v: &str) -> bool {
    v.starts_with("/dev/") && v.len() > 5 && !v.contains("..")
}

fn is_hostname(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !v.starts_with('-')
}

fn is_env_name(v: &str) -> bool {
    !v.is_empty() && !v.as_bytes()[0].is_ascii_digit() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn flag(v: Option<&str>) -> Option<bool> {
    match v {
        None | Some("") | Some("1") | Some("y") | Some("yes") | Some("true") | Some("on") => Some(true),
        Some("0") | Some("n") | Some("no") | Some("false") | Some("off") => Some(false),
        Some(_) => None,
    }
}

/// Parses the full kernel command line (the contents of `/proc/cmdline`).
pub fn parse(cmdline: &str) -> BootConfig {
    let mut cfg = BootConfig::default();
    let mut overlay_given = false;
    let (mut ip, mut gw, mut mac) = (None, None, None);
    for param in split(cmdline) {
        let Some(rest) = param.strip_prefix("chrysalis.") else {
            continue;
        };
        let (key, value) = match rest.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (rest, None),
        };
        match (key, value) {
            ("rootfs", Some(v)) if is_device(v) => cfg.rootfs = Some(v.to_string()),
            ("overlay", Some("tmpfs")) => {
                cfg.overlay = Overlay::Tmpfs;
                overlay_given = true;
            }
            ("overlay", Some(v)) if is_device(v) => {
                cfg.overlay = Overlay::Disk(v.to_string());
                overlay_given = true;
            }
            ("hostname", Some(v)) if is_hostname(v) => cfg.hostname = v.to_string(),
            ("silkd", Some(v)) if v.starts_with('/') => cfg.silkd = Some(v.to_string()),
            ("debug_shell", v) if flag(v).is_some() => cfg.debug_shell = flag(v).unwrap_or(false),
            ("ip", Some(v)) if parse_ip_cidr(v).is_some() => ip = parse_ip_cidr(v),
            ("gw", Some(v)) if v.parse::<std::net::Ipv4Addr>().is_ok() => gw = v.parse().ok(),
            ("mac", Some(v)) if parse_mac(v).is_some() => mac = parse_mac(v),
            (k, Some(v)) if k.starts_with("env.") && is_env_name(&k[4..]) => {
                cfg.env.push((k[4..].to_string(), v.to_string()));
            }
            _ => cfg.warnings.push(format!("ignoring malformed or unknown parameter `{param}`")),
        }
    }
    match ip {
        Some((ip, prefix)) => cfg.net = Some(Ipv4Config { ip, prefix, gateway: gw, mac }),
        None if gw.is_some() || mac.is_some() => {
            cfg.warnings.push("chrysalis.gw / chrysalis.mac are ignored without chrysalis.ip".to_string())
        }
        None => {}
    }
    if overlay_given && cfg.rootfs.is_none() {
        cfg.warnings.push("chrysalis.overlay is ignored without chrysalis.rootfs".to_string());
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_chrysalis_keys() {
        let cfg = parse("console=ttyS0 tsc_early_khz=2596130 reboot=t panic=-1 quiet\n");
        assert_eq!(cfg, BootConfig::default());
        assert_eq!(cfg.hostname, "sandbox");
        assert!(cfg.rootfs.is_none());
    }

    #[test]
    fn rootfs_and_disk_overlay() {
        let cfg = parse("console=ttyS0 chrysalis.rootfs=/dev/vda chrysalis.overlay=/dev/vdb quiet");
        assert_eq!(cfg.rootfs.as_deref(), Some("/dev/vda"));
        assert_eq!(cfg.overlay, Overlay::Disk("/dev/vdb".into()));
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    }

    #[test]
    fn tmpfs_overlay_is_the_default_and_explicit() {
        assert_eq!(parse("chrysalis.rootfs=/dev/vda").overlay, Overlay::Tmpfs);
        let cfg = parse("chrysalis.rootfs=/dev/vda chrysalis.overlay=/dev/vdb chrysalis.overlay=tmpfs");
        assert_eq!(cfg.overlay, Overlay::Tmpfs);
    }

    #[test]
    fn malformed_values_are_warnings_not_errors() {
        let cfg = parse("chrysalis.rootfs=vda chrysalis.overlay=nope chrysalis.hostname=-bad chrysalis.what=1");
        assert!(cfg.rootfs.is_none());
        assert_eq!(cfg.overlay, Overlay::Tmpfs);
        assert_eq!(cfg.hostname, "sandbox");
        assert_eq!(cfg.warnings.len(), 4, "{:?}", cfg.warnings);
        let cfg = parse("chrysalis.rootfs=/dev/../etc/x");
        assert!(cfg.rootfs.is_none());
    }

    #[test]
    fn overlay_without_rootfs_warns() {
        let cfg = parse("chrysalis.overlay=/dev/vdb");
        assert_eq!(cfg.warnings.len(), 1);
    }

    #[test]
    fn hostname_env_silkd_and_debug_shell() {
        let cfg = parse(
            "chrysalis.hostname=box-1 chrysalis.env.SILKD_PORT=2049 chrysalis.env.RUST_LOG=debug \
             chrysalis.silkd=/opt/silkd chrysalis.debug_shell",
        );
        assert_eq!(cfg.hostname, "box-1");
        assert_eq!(
            cfg.env,
            vec![("SILKD_PORT".to_string(), "2049".to_string()), ("RUST_LOG".to_string(), "debug".to_string())]
        );
        assert_eq!(cfg.silkd.as_deref(), Some("/opt/silkd"));
        assert!(cfg.debug_shell);
        assert!(!parse("chrysalis.debug_shell=0").debug_shell);
        assert!(parse("chrysalis.debug_shell=1").debug_shell);
        assert!(!parse("chrysalis.env.1BAD=x").env.iter().any(|(k, _)| k == "1BAD"));
    }

    #[test]
    fn network_keys() {
        let cfg = parse("chrysalis.ip=10.88.0.5/24 chrysalis.gw=10.88.0.1 chrysalis.mac=02:aa:bb:cc:dd:ee");
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        let net = cfg.net.expect("net");
        assert_eq!(net.ip, std::net::Ipv4Addr::new(10, 88, 0, 5));
        assert_eq!(net.prefix, 24);
        assert_eq!(net.gateway, Some(std::net::Ipv4Addr::new(10, 88, 0, 1)));
        assert_eq!(net.mac, Some([2, 0xaa, 0xbb, 0xcc, 0xdd, 0xee]));
        let only_ip = parse("chrysalis.ip=10.0.0.2/8").net.expect("net");
        assert_eq!((only_ip.gateway, only_ip.mac), (None, None));
        let bad = parse("chrysalis.ip=10.0.0.2 chrysalis.gw=x chrysalis.mac=01:00:00:00:00:00");
        assert_eq!(bad.net, None);
        assert_eq!(bad.warnings.len(), 3, "{:?}", bad.warnings);
        let orphan = parse("chrysalis.gw=10.0.0.1");
        assert_eq!(orphan.net, None);
        assert_eq!(orphan.warnings.len(), 1);
    }

    #[test]
    fn quotes_group_and_are_removed() {
        assert_eq!(split(r#"a "b c" d="e f"  g"#), vec!["a", "b c", "d=e f", "g"]);
        let cfg = parse(r#"chrysalis.env.GREETING="hello world" quiet"#);
        assert_eq!(cfg.env, vec![("GREETING".to_string(), "hello world".to_string())]);
        assert_eq!(split("  \n"), Vec::<String>::new());
    }
}

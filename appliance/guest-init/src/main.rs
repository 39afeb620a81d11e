//! `guest-init`: PID 1 of every Chrysalis microVM.
//!
//! Boot sequence (one console line per step): mount /proc, /sys, /dev; read the `chrysalis.*`
//! command-line keys ([`cmdline`]); with `chrysalis.rootfs=` assemble erofs + overlay and move
//! into it ([`mounts`]); mount /dev/pts, /dev/shm, /tmp, /run; set the hostname; bring up `lo`
//! ([`net`]); then run silkd and reap zombies forever ([`supervisor`]).
//!
//! PID 1 must never exit (the kernel would panic): every error is printed and the process keeps
//! reaping and waiting for a shutdown signal; panics are caught.
//!
//! Multi-call: a copy of this binary is installed as `/.chrysalis/guest-init` (on every
//! template), and `guest-init net-config <ip/prefix> <gw> <mac>` run as any pid other than 1
//! re-addresses `eth0` and exits (0 = done): the network fixup of a clone, run through the agent.

mod cmdline;
mod console;
mod mounts;
mod net;
mod supervisor;

use console::say;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use supervisor::Service;

/// The silkd binary shipped in the initramfs.
const INITRAMFS_SILKD: &str = "/sbin/silkd";

/// Where guest-init installs a copy of itself in the final root (for `net-config`).
const INSTALLED_SELF: &str = "/.chrysalis/guest-init";

/// Copies the running binary to [`INSTALLED_SELF`] (through `/proc/self/exe`, which still
/// reaches the initramfs file after the switch to an image root).
fn install_self() -> std::io::Result<()> {
    std::fs::create_dir_all(mounts::CHRYSALIS_DIR)?;
    let exe = std::fs::read("/proc/self/exe")?;
    foundation::write_atomic(Path::new(INSTALLED_SELF), &exe, foundation::FileMode(0o755))
}

/// `guest-init net-config <ip/prefix> <gw> <mac>`: configures eth0; returns the exit code.
fn net_config(args: &[String]) -> i32 {
    // Only inside a Chrysalis guest (PID 1 installed this copy at boot): never re-address a host.
    if !Path::new(INSTALLED_SELF).is_file() {
        eprintln!("guest-init net-config: {INSTALLED_SELF} is missing: not a Chrysalis guest, refusing");
        return 2;
    }
    let cfg = match net::parse_net_config_args(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("guest-init net-config: {e}\nusage: guest-init net-config <ip/prefix> <gateway> <mac>");
            return 2;
        }
    };
    match net::configure(net::ETH0, &cfg) {
        Ok(()) => {
            println!("{}: {}/{} via {}", net::ETH0, cfg.ip, cfg.prefix, args[1]);
            0
        }
        Err(e) => {
            eprintln!("guest-init net-config: {}", foundation::error_chain(&e));
            1
        }
    }
}

/// Makes fds 0-2 the console if the kernel could not open it for us.
fn ensure_console() {
    // SAFETY: F_GETFD on a small integer only queries the descriptor table.
    let missing = (0..3).any(|fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0);
    if !missing {
        return;
    }
    if let Ok(console) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/console") {
        for fd in 0..3 {
            // SAFETY: dup2 onto fds 0-2 of our own process, from an open descriptor.
            unsafe { libc::dup2(console.as_raw_fd(), fd) };
        }
    }
}

/// Runs the boot sequence; returns the services to supervise.
fn setup() -> Vec<Service> {
    if let Err(e) = mounts::mount_early() {
        say!("ERROR: {}", foundation::error_chain(&e));
    }
    ensure_console();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_else(|e| {
        say!("ERROR: reading /proc/cmdline: {e}; using defaults");
        String::new()
    });
    let cfg = cmdline::parse(&cmdline);
    for w in &cfg.warnings {
        say!("warning: {w}");
    }
    let mut services = Vec::new();
    let debug_shell = || {
        let mut sh = Service::new("debug-shell", PathBuf::from("/bin/sh"));
        sh.console_stdin = true;
        sh
    };

    if let Some(rootfs) = &cfg.rootfs {
        let silkd = Path::new(INITRAMFS_SILKD);
        let silkd = silkd.is_file().then_some(silkd);
        if let Err(e) = mounts::switch_to_image_root(rootfs, &cfg.overlay, silkd) {
            say!("FATAL: cannot set up the image root: {}", foundation::error_chain(&e));
            if cfg.debug_shell {
                services.push(debug_shell());
            }
            return services;
        }
        say!("switched root to {rootfs}");
    }
    match mounts::mount_late() {
        Ok(()) => say!("mounted /dev/pts /dev/shm /tmp /run"),
        Err(e) => say!("ERROR: {}", foundation::error_chain(&e)),
    }
    mounts::ensure_dirs();
    match nix::unistd::sethostname(&cfg.hostname) {
        Ok(()) => say!("hostname {}", cfg.hostname),
        Err(e) => say!("ERROR: sethostname: {e}"),
    }
    match net::link_up("lo") {
        Ok(()) => say!("lo up"),
        Err(e) => say!("ERROR: {}", foundation::error_chain(&e)),
    }
    if let Some(netcfg) = &cfg.net {
        match net::configure(net::ETH0, netcfg) {
            Ok(()) => say!(
                "{} {}/{} gw {}",
                net::ETH0,
                netcfg.ip,
                netcfg.prefix,
                netcfg.gateway.map(|g| g.to_string()).unwrap_or_else(|| "none".into())
            ),
            Err(e) => say!("ERROR: {}", foundation::error_chain(&e)),
        }
    }
    if let Err(e) = install_self() {
        say!("ERROR: installing {INSTALLED_SELF}: {e}");
    }

    let candidates =
        [cfg.silkd.clone(), Some(format!("{}/silkd", mounts::CHRYSALIS_DIR)), Some(INITRAMFS_SILKD.into())];
    match candidates.into_iter().flatten().map(PathBuf::from).find(|p| p.is_file()) {
        Some(path) => {
            let mut silkd = Service::new("silkd", path);
            silkd.env = cfg.env.clone();
            services.push(silkd);
        }
        None => say!("FATAL: no silkd binary found"),
    }
    if cfg.debug_shell {
        services.push(debug_shell());
    }
    services
}

fn main() {
    if std::process::id() != 1 {
        let args: Vec<String> = std::env::args().collect();
        if args.get(1).map(String::as_str) == Some("net-config") {
            std::process::exit(net_config(&args[2..]));
        }
        eprintln!(
            "guest-init: must run as PID 1 inside a Chrysalis guest (refusing to touch this system); \
             the only other use is `guest-init net-config <ip/prefix> <gateway> <mac>` inside a guest"
        );
        std::process::exit(2);
    }
    std::panic::set_hook(Box::new(|info| say!("PANIC: {info}")));
    say!("starting");
    let set = loop {
        match supervisor::block_signals() {
            Ok(set) => break set,
            Err(e) => {
                say!("ERROR: {}; retrying", foundation::error_chain(&e));
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
    };
    let services = std::panic::catch_unwind(setup).unwrap_or_else(|_| {
        say!("FATAL: boot sequence panicked; only reaping from now on");
        Vec::new()
    });
    say!("boot sequence done");
    // `run` never returns; if it panics, keep PID 1 alive by only reaping.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| supervisor::run(&set, services)));
    loop {
        let _ = std::panic::catch_unwind(|| supervisor::run(&set, Vec::new()));
    }
}

//! `cargo xtask run [--board qemu-x86_64]`: builds the host image (cached) and boots it in the
//! QEMU appliance machine ([`test_infra::appliance_vm`]) in the foreground, with sandboxd on
//! 127.0.0.1:7777 and the supervisor API on 127.0.0.1:7780. The console streams to stdout
//! (and to a log file); Ctrl-C stops QEMU.
//!
//! The machine gets a config disk (vfat, label `CHRYSALIS`) holding `--config-dir`'s files, its
//! `config.toml` completed (unless it sets its own) with the supervisor's remote API on 7780 and a
//! token generated once in `$CHRYSALIS_CACHE/appliance-run/api-token`.

use crate::flags::RunArgs;
use crate::{image, paths, prereqs};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use test_infra::appliance_vm::{ApplianceVm, Options};

/// Console lines that mark progress worth a hint.
const STARTED_SUPERVISOR: &str = "Started chrysalis.service";

pub fn run(args: &RunArgs) -> Result<()> {
    prereqs::ensure_apt(&["qemu-system-x86", "qemu-utils", "ovmf", "dosfstools", "mtools", "socat"])?;
    // A development box: it trusts this machine's dev update keys (`--dev-keys`), so bundles
    // made with `cargo xtask bundle --dev-keys` install on it.
    let built = image::build(&image::BuildOptions::dev(&args.board))?;
    let work = paths::cache_dir().join("appliance-run").join(&args.board);
    fs::create_dir_all(&work)?;
    let token_file = paths::cache_dir().join("appliance-run/api-token");
    let config_files = config_files(args.config_dir.as_deref(), &token_file)?;
    let mut opts = Options::new(&built.disk, &work);
    opts.keep_disk = args.keep;
    opts.config_files = Some(config_files);
    opts.sandboxd_port = Some(args.sandboxd_port);
    opts.api_port = Some(args.api_port);
    opts.guest_forward_port = args.guest_forward;
    for port in [args.sandboxd_port, args.api_port] {
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            bail!("127.0.0.1:{port} is taken (another `cargo xtask run` or sandboxd?): pick other ports with --sandboxd-port/--api-port");
        }
    }
    let mut vm = ApplianceVm::start(&opts)?;
    let accel = match vm.accel {
        vmm::Accel::Kvm => "KVM",
        vmm::Accel::Tcg => "TCG (software emulation: booting takes minutes)",
    };
    let hints = format!(
        "run: image {} ({}), accelerator {accel}\n\
         run: console log {} (streamed below); QEMU: {}\n\
         run: when the supervisor is up:\n\
         run:   curl -s 127.0.0.1:{sp}/healthz ; curl -s 127.0.0.1:{sp}/v1/pools     # sandboxd\n\
         run:   curl -s -H \"Authorization: Bearer $(cat {tok})\" 127.0.0.1:{ap}/v1/status   # supervisor\n\
         run: Ctrl-C stops the machine{keep}{fwd}",
        built.manifest.version,
        built.disk.display(),
        vm.console.display(),
        vm.command_line(),
        sp = args.sandboxd_port,
        ap = args.api_port,
        tok = token_file.display(),
        keep = if args.keep { " (its disk is kept: --keep)" } else { "" },
        fwd = match args.guest_forward {
            Some(p) => format!("\nrun: the appliance reaches this host's 127.0.0.1:{p} as 10.0.2.100:{p}"),
            None => String::new(),
        },
    );
    eprintln!("{hints}");

    // Ctrl-C reaches QEMU (same process group) and stops it; we only wait for that.
    let stop = Arc::new(AtomicBool::new(false));
    // SAFETY: installing SIG_IGN for SIGINT in this process; QEMU was spawned before, so it keeps
    // the default disposition and exits on Ctrl-C.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    let follower = {
        let stop = Arc::clone(&stop);
        let console = vm.console.clone();
        let hints = hints.clone();
        std::thread::spawn(move || follow(&console, &stop, &hints))
    };
    let status = vm.wait()?;
    stop.store(true, Ordering::Relaxed);
    let _ = follower.join();
    eprintln!("run: QEMU exited ({status}); console log {}", vm.console.display());
    Ok(())
}

/// Streams the console file to stdout until `stop`; repeats the hints once the supervisor starts.
fn follow(console: &Path, stop: &AtomicBool, hints: &str) {
    let mut pos = 0u64;
    let mut pending = String::new();
    let mut hinted = false;
    while !stop.load(Ordering::Relaxed) {
        if let Ok(mut f) = fs::File::open(console) {
            if f.seek(SeekFrom::Start(pos)).is_ok() {
                let mut buf = Vec::new();
                if let Ok(n) = f.read_to_end(&mut buf) {
                    pos += n as u64;
                    pending.push_str(&String::from_utf8_lossy(&buf));
                }
            }
        }
        while let Some(i) = pending.find('\n') {
            let line: String = pending.drain(..=i).collect();
            print!("{line}");
            if !hinted && line.contains(STARTED_SUPERVISOR) {
                hinted = true;
                eprintln!("{hints}");
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The config disk: `dir`'s files (or none), plus what the host needs to reach the
/// supervisor: `supervisor.api_listen` on 7780 with a bearer token (generated once), unless the
/// given config.toml sets its own `api_listen`.
fn config_files(dir: Option<&Path>, token_file: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut files = match dir {
        Some(dir) => read_dir_files(dir)?,
        None => BTreeMap::new(),
    };
    let mut config: toml::Table = match files.get("config.toml") {
        Some(bytes) => toml::from_str(std::str::from_utf8(bytes).context("config.toml is not UTF-8")?)
            .context("config.toml of --config-dir is not valid TOML")?,
        None => toml::Table::new(),
    };
    let supervisor = config
        .entry("supervisor")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .context("config.toml: `supervisor` must be a table")?;
    if supervisor.contains_key("api_listen") {
        return Ok(files);
    }
    supervisor.insert("api_listen".into(), toml::Value::String("0.0.0.0:7780".into()));
    supervisor.insert("api_token_file".into(), toml::Value::String("api-token".into()));
    if !token_file.is_file() {
        let token: [u8; 24] = rand::random();
        if let Some(dir) = token_file.parent() {
            fs::create_dir_all(dir)?;
        }
        fs::write(token_file, format!("{}\n", hex::encode(token)))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(token_file, fs::Permissions::from_mode(0o600))?;
    }
    let token = fs::read(token_file).with_context(|| format!("reading {}", token_file.display()))?;
    let text = format!(
        "# Written by `cargo xtask run`: the supervisor API for the host (forwarded to 127.0.0.1).\n{}",
        toml::to_string(&config).context("writing config.toml")?
    );
    files.insert("config.toml".into(), text.into_bytes());
    files.insert("api-token".into(), token);
    Ok(files)
}

/// Every regular file directly in `dir` (by name).
fn read_dir_files(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_file() {
            out.insert(e.file_name().to_string_lossy().into_owned(), fs::read(e.path())?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_is_added_to_a_given_config_unless_it_sets_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = dir.path().join("token");
        fs::write(dir.path().join("config.toml"), "[cluster]\nendpoint = \"https://10.0.2.100:16443\"\n").expect("w");
        fs::write(dir.path().join("bootstrap-token"), "abcdef.0123456789abcdef\n").expect("w");
        let files = config_files(Some(dir.path()), &token).expect("files");
        let config: toml::Table =
            toml::from_str(std::str::from_utf8(&files["config.toml"]).expect("utf8")).expect("toml");
        assert_eq!(config["supervisor"]["api_listen"].as_str(), Some("0.0.0.0:7780"));
        assert_eq!(config["cluster"]["endpoint"].as_str(), Some("https://10.0.2.100:16443"));
        assert_eq!(files["api-token"], fs::read(&token).expect("token"));
        assert!(files.contains_key("bootstrap-token"));

        fs::write(dir.path().join("config.toml"), "[supervisor]\napi_listen = \"0.0.0.0:9\"\n").expect("w");
        let files = config_files(Some(dir.path()), &token).expect("files");
        assert_eq!(files["config.toml"], b"[supervisor]\napi_listen = \"0.0.0.0:9\"\n");
        assert!(!files.contains_key("api-token"));

        let files = config_files(None, &token).expect("default");
        assert!(std::str::from_utf8(&files["config.toml"]).expect("utf8").contains("api_token_file = \"api-token\""));
    }
}

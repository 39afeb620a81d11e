//! `cargo xtask run [--board qemu-x86_64]`: builds the host image (cached) and boots it in the
//! QEMU appliance machine ([`test_infra::appliance_vm`]) in the foreground, with sandboxd on
//! 127.0.0.1:7777 and the supervisor API on 127.0.0.1:7780. The console streams to stdout
//! (and to a log file); Ctrl-C stops QEMU.
//!
//! The machine gets a config disk (vfat, label `CHRYSALIS`) holding `--config-dir`'s files, its
//! `config.toml` completed (unless it sets its own) with the supervisor's remote API on 7780 and a
//! token generated once in `$CHRYSALIS_CACHE/appliance-run/api-token`.
//!
//! The box is secure by default: on first boot it mints sandboxd's root token and a TLS
//! certificate, and prints the certificate's SHA-256 fingerprint on its console. When that line
//! appears, this command pins the fingerprint, reads sandboxd's token through the remote API
//! (`GET /v1/tokens/sandboxd`, what `chrysalis token show sandboxd` calls) and the certificate
//! from sandboxd's TLS handshake, writes them next to the API token (`sandboxd-token`,
//! `box.pem`, `fingerprint`) and prints how to use them: `chrysalis` with `--api-fingerprint`,
//! curl with `--cacert`, and the SDK with `api_token=` and an `ssl_context`.

use crate::flags::RunArgs;
use crate::{image, paths, prereqs};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use test_infra::appliance_vm::{fingerprint_in, ApplianceVm, Options};

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
         run: the box mints sandboxd's token and a TLS certificate on first boot and prints the\n\
         run: certificate's fingerprint on its console (\"TLS certificate SHA-256 fingerprint …\"); this\n\
         run: command then fetches the token and the certificate into {dir} and shows how to use them.\n\
         run: Ctrl-C stops the machine{keep}{fwd}",
        built.manifest.version,
        built.disk.display(),
        vm.console.display(),
        vm.command_line(),
        dir = token_file.parent().map(|d| d.display().to_string()).unwrap_or_default(),
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
    let box_access = BoxAccess {
        dir: token_file.parent().map(Path::to_path_buf).unwrap_or_default(),
        api_token: token_file.clone(),
        api_port: args.api_port,
        sandboxd_port: args.sandboxd_port,
    };
    let follower = {
        let stop = Arc::clone(&stop);
        let console = vm.console.clone();
        let hints = hints.clone();
        std::thread::spawn(move || follow(&console, &stop, &hints, box_access))
    };
    let status = vm.wait()?;
    stop.store(true, Ordering::Relaxed);
    let _ = follower.join();
    eprintln!("run: QEMU exited ({status}); console log {}", vm.console.display());
    Ok(())
}

/// Where the host keeps what it needs to reach the box.
#[derive(Debug, Clone)]
struct BoxAccess {
    dir: PathBuf,
    api_token: PathBuf,
    api_port: u16,
    sandboxd_port: u16,
}

/// `der` as a PEM certificate.
fn pem(der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b64.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).unwrap_or_default()).collect();
    format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", lines.join("\n"))
}

/// Writes a file readable by its owner only (born 0600, replaced atomically, in a 0700 dir).
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    foundation::write_secret(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// With the fingerprint from the console pinned: sandboxd's token through the remote API and
/// sandboxd's certificate from its handshake, written into `a.dir`; returns the how-to.
fn fetch_access(a: &BoxAccess, fingerprint: &str) -> Result<String> {
    let tls = httpd::tls::client_config(&httpd::tls::Trust::Fingerprint(fingerprint.into()), httpd::tls::ALPN_HTTP1)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let token = fs::read_to_string(&a.api_token).ok().map(|t| t.trim().to_string());
    let client = supervisor::client::Client::new(format!("https://127.0.0.1:{}", a.api_port).parse()?, token)
        .with_tls(tls.clone());
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    let sandboxd_token = loop {
        match rt.block_on(client.token("sandboxd")) {
            Ok(t) => break t.token,
            Err(e) if std::time::Instant::now() > deadline => return Err(e).context("GET /v1/tokens/sandboxd"),
            Err(_) => std::thread::sleep(Duration::from_secs(3)),
        }
    };
    let cert = rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", a.sandboxd_port)).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        let conn = tokio_rustls::TlsConnector::from(tls).connect(name, tcp).await?;
        let der = conn.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| c.to_vec());
        der.context("sandboxd sent no certificate")
    })?;
    let (tok, pem_file, fp_file) = (a.dir.join("sandboxd-token"), a.dir.join("box.pem"), a.dir.join("fingerprint"));
    write_private(&tok, format!("{sandboxd_token}\n").as_bytes())?;
    fs::write(&pem_file, pem(&cert))?;
    fs::write(&fp_file, format!("{fingerprint}\n"))?;
    Ok(format!(
        "run: the box's certificate: SHA-256 {fingerprint} (from its console; pinned for what follows)\n\
         run: wrote {tok} (sandboxd's root token, via the remote API), {pem} (its certificate), {fpf}\n\
         run: the supervisor API (chrysalis: `cargo build -p chrysalis`, target/debug/chrysalis):\n\
         run:   chrysalis --api https://127.0.0.1:{ap} --api-token-file {api} --api-fingerprint {fingerprint} status\n\
         run:   chrysalis --api https://127.0.0.1:{ap} --api-token-file {api} --api-fingerprint $(cat {fpf}) token show sandboxd\n\
         run: sandboxd (HTTPS, node routes need the token):\n\
         run:   curl --cacert {pem} https://127.0.0.1:{sp}/healthz\n\
         run:   curl --cacert {pem} -H \"Authorization: Bearer $(cat {tok})\" https://127.0.0.1:{sp}/v1/info\n\
         run: the SDK (pip install cocoonstack-sandbox==0.1.19):\n\
         run:   python3 -c 'import ssl; from cocoonsandbox import Client; c = Client(\"https://127.0.0.1:{sp}\", api_token=open(\"{tok}\").read().strip(), ssl_context=ssl.create_default_context(cafile=\"{pem}\")); sb = c.new(\"ghcr.io/cocoonstack/sandbox/rt:24.04\", ttl_seconds=600); print(sb.exec(\"sh\", \"-c\", \"echo $((40 + 2))\")); sb.close()'",
        tok = tok.display(),
        pem = pem_file.display(),
        fpf = fp_file.display(),
        api = a.api_token.display(),
        ap = a.api_port,
        sp = a.sandboxd_port,
    ))
}

/// Streams the console file to stdout until `stop`; repeats the hints once the supervisor starts,
/// and fetches the box's credentials once it prints its fingerprint.
fn follow(console: &Path, stop: &AtomicBool, hints: &str, access: BoxAccess) {
    let mut pos = 0u64;
    let mut pending = String::new();
    let mut hinted = false;
    let mut fetching = false;
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
            if let Some(fp) = fingerprint_in(&line).filter(|_| !fetching) {
                fetching = true;
                let access = access.clone();
                std::thread::spawn(move || match fetch_access(&access, &fp) {
                    Ok(howto) => eprintln!("{howto}"),
                    Err(e) => eprintln!(
                        "run: could not fetch sandboxd's token and certificate ({e:#}); by hand: chrysalis --api \
                         https://127.0.0.1:{} --api-token-file <token> --api-fingerprint {fp} token show sandboxd",
                        access.api_port
                    ),
                });
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
        write_private(token_file, format!("{}\n", hex::encode(token)).as_bytes())?;
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

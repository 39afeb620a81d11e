//! The appliance verbs: `run` (the supervisor), and `status`, `logs`, `token`, `update`,
//! `reboot`, `config` over the supervisor crate. Thin: flags in, library call, text or JSON out.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result};
use supervisor::client::Client;
use supervisor::config::{self, Issue, Settings, ValidateEnv};
use supervisor::health::Health;
use supervisor::update::UpdateStatus;

use crate::flags::{ApiArgs, ClientArgs, ConfigCmd, LogsArgs, RunArgs, TokenCmd, UpdateCmd};
use crate::output::print_table;

/// Where the image describes itself (board, version).
const IMAGE_JSON: &str = "/usr/share/chrysalis/image.json";

/// The update side the supervisor runs with: the A/B updater when this kernel booted from a
/// slot, else "updates unavailable" (a development host).
fn update_control() -> Arc<dyn supervisor::UpdateControl> {
    match supervisor::ab::AbUpdates::for_appliance(std::path::Path::new(IMAGE_JSON)) {
        Some(ab) => Arc::new(ab),
        None => Arc::new(supervisor::NoUpdates),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")
}

fn client(a: &ApiArgs) -> Result<Client> {
    use supervisor::http::Endpoint;
    let ep: Endpoint = a.api.parse().with_context(|| format!("--api {}", a.api))?;
    let https = matches!(ep, Endpoint::Https(_));
    let trust = match (&a.api_fingerprint, &a.api_ca_file) {
        (Some(f), _) => Some(httpd::tls::Trust::Fingerprint(f.clone())),
        (None, Some(p)) => Some(httpd::tls::Trust::File(p.clone())),
        (None, None) => None,
    };
    let c = Client::with_token_file(ep, a.api_token_file.as_deref())?;
    match (https, trust) {
        (true, Some(t)) => {
            let tls = httpd::tls::client_config(&t, httpd::tls::ALPN_HTTP1).context("--api-fingerprint / --api-ca-file")?;
            Ok(c.with_tls(tls))
        }
        (true, None) => anyhow::bail!(
            "--api {} is HTTPS: give --api-fingerprint SHA256 (shown by `chrysalis status` on the box, and on its console at \
             start) or --api-ca-file FILE (the box's certificate or its CA)",
            a.api
        ),
        (false, Some(_)) => anyhow::bail!("--api-fingerprint / --api-ca-file need an https:// --api"),
        (false, None) => Ok(c),
    }
}

fn print_json(v: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// `chrysalis run`.
pub fn run(a: RunArgs) -> Result<()> {
    supervisor::init_logging();
    let mut o = supervisor::RunOptions::new(update_control());
    o.sources = a.sources.paths();
    o.hostname = a.sources.hostname.clone();
    o.state_dir = a.state_dir;
    o.api_socket = a.api_socket;
    o.run_dir = a.run_dir;
    o.bin_dir = a.bin_dir;
    o.catalog = a.catalog;
    o.shutdown_timeout = Duration::from_secs(a.shutdown_timeout);
    o.reboot_command = a.reboot_command.map(|c| c.split_whitespace().map(str::to_string).collect());
    o.exit_on_config_error = a.exit_on_config_error;
    let exit = runtime()?.block_on(supervisor::run(o))?;
    tracing::info!(?exit, "supervisor stopped");
    Ok(())
}

fn ago(unix: u64) -> String {
    let now = std::time::SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    humantime::format_duration(Duration::from_secs(now.saturating_sub(unix))).to_string()
}

fn update_line(u: &UpdateStatus) -> String {
    let mut s = u.state.as_str().to_string();
    if let Some(slot) = &u.slot {
        s.push_str(&format!(", slot {slot}"));
    }
    if let Some(v) = &u.version {
        s.push_str(&format!(", version {v}"));
    }
    if let Some(g) = u.generation {
        s.push_str(&format!(", generation {g}"));
    }
    match (u.security_version, u.security_floor) {
        (Some(v), Some(f)) => s.push_str(&format!(", security version {v} (floor {f})")),
        (Some(v), None) => s.push_str(&format!(", security version {v} (floor not recorded yet)")),
        (None, Some(f)) => s.push_str(&format!(", security floor {f}")),
        (None, None) => {}
    }
    if let Some(p) = &u.progress {
        let total = p.total.map(|t| format!("/{t}")).unwrap_or_default();
        s.push_str(&format!(", {} {}{total} bytes", p.phase, p.done));
    }
    if let Some(m) = &u.message {
        s.push_str(&format!(": {m}"));
    }
    s
}

fn print_issues(issues: &[Issue]) {
    for i in issues {
        eprintln!("error: {i}");
    }
}

/// KiB as MiB with one decimal.
fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn print_health(h: &Health) {
    let mut rows = vec![vec!["SERVICE", "STATE", "PID", "RSS", "RESTARTS", "UP", "LAST EXIT"]
        .into_iter()
        .map(String::from)
        .collect()];
    for s in &h.services {
        let state = match s.restart_in_secs {
            Some(t) => format!("{:?} (in {t:.0}s)", s.state).to_lowercase(),
            None => format!("{:?}", s.state).to_lowercase(),
        };
        rows.push(vec![
            s.name.clone(),
            state,
            s.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            s.rss_kib.map(mib).unwrap_or_else(|| "-".into()),
            s.restarts.to_string(),
            s.since_unix.filter(|_| s.pid.is_some()).map(ago).unwrap_or_else(|| "-".into()),
            s.last_exit.as_ref().map(|e| e.text.clone()).unwrap_or_else(|| "-".into()),
        ]);
    }
    print_table(&rows);
    if !h.nodes.is_empty() {
        println!();
        let mut rows = vec![vec!["NODE", "SERVICE", "READY", "LEASE", "NOTE"].into_iter().map(String::from).collect()];
        for n in &h.nodes {
            rows.push(vec![
                n.name.clone(),
                n.service.clone(),
                if n.ready { "yes" } else { "no" }.into(),
                if n.lease_fresh { "fresh" } else { "stale" }.into(),
                n.error.clone().unwrap_or_default(),
            ]);
        }
        print_table(&rows);
    }
    if !h.pools.is_empty() || h.pools_error.is_some() {
        println!();
        let mut rows = vec![vec!["POOL", "SIZE", "NET", "WARM", "TARGET"].into_iter().map(String::from).collect()];
        for p in &h.pools {
            rows.push(vec![
                p.template.clone(),
                p.size.clone(),
                p.net.clone(),
                p.warm.to_string(),
                p.target.to_string(),
            ]);
        }
        print_table(&rows);
        if let Some(e) = &h.pools_error {
            println!("pools: {e}");
        }
    }
}

/// `chrysalis status`.
pub fn status(a: ClientArgs) -> Result<()> {
    let c = client(&a.api)?;
    let st = runtime()?.block_on(c.status())?;
    if a.out.json {
        return print_json(&st);
    }
    print_issues(&st.config_errors);
    let h = &st.health;
    let health = if h.healthy() {
        "healthy"
    } else if h.ready {
        "ready"
    } else {
        "not ready"
    };
    println!(
        "supervisor  {health} (up {}, RSS {}, v{}, state {})",
        humantime::format_duration(Duration::from_secs(st.supervisor.uptime_secs)),
        st.supervisor.rss_kib.map(mib).unwrap_or_else(|| "-".into()),
        st.supervisor.version,
        st.supervisor.state_dir
    );
    println!("update      {}", update_line(&st.update));
    match h.api_reachable {
        Some(true) => println!("cluster     API server reachable"),
        Some(false) => println!("cluster     API server unreachable"),
        None => println!("cluster     none configured (sandboxd alone)"),
    }
    if h.sandboxd_answers == Some(false) {
        println!("sandboxd    not answering");
    }
    if let Some(hv) = &h.hypervisor {
        println!("vms         {hv}");
    }
    for t in &st.tls {
        let origin = if t.minted { "self-signed, minted by the box" } else { "configured" };
        println!("tls         SHA-256 {} ({origin}; serves {})", t.fingerprint, t.surfaces.join(", "));
    }
    if st.tls.is_empty() {
        println!("tls         none (every TCP surface listens on loopback)");
    }
    println!();
    print_health(h);
    Ok(())
}

/// `chrysalis logs`.
pub fn logs(a: LogsArgs) -> Result<()> {
    let c = client(&a.client.api)?;
    let lines = runtime()?.block_on(c.logs(&a.service, a.tail))?;
    if a.client.out.json {
        return print_json(&lines);
    }
    for l in lines {
        let ts = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(l.ts_ms));
        println!("{ts} {:<10} {}", l.stream.as_str(), l.line);
    }
    Ok(())
}

/// `chrysalis update …`.
pub fn update(cmd: UpdateCmd) -> Result<()> {
    let rt = runtime()?;
    match cmd {
        UpdateCmd::Apply { bundle, client: a } => {
            let c = client(&a.api)?;
            let o = rt.block_on(c.update_apply(&bundle)).with_context(|| format!("applying {}", bundle.display()))?;
            if a.out.json {
                return print_json(&o);
            }
            println!("{}", o.message);
            println!("update: {}", update_line(&o.status));
            if o.reboot {
                println!("rebooting into the new slot");
            }
        }
        UpdateCmd::Status(a) => {
            let u = rt.block_on(client(&a.api)?.update_status())?;
            if a.out.json {
                return print_json(&u);
            }
            println!("{}", update_line(&u));
        }
        UpdateCmd::Rollback(a) => {
            let o = rt.block_on(client(&a.api)?.update_rollback())?;
            if a.out.json {
                return print_json(&o);
            }
            println!("{}", o.message);
            if o.reboot {
                println!("rebooting into the other slot");
            }
        }
    }
    Ok(())
}

/// `chrysalis token …`.
pub fn token(cmd: TokenCmd) -> Result<()> {
    let TokenCmd::Show { name, client: a } = cmd;
    let t = runtime()?.block_on(client(&a.api)?.token(&name))?;
    if a.out.json {
        return print_json(&t);
    }
    println!("{}", t.token);
    Ok(())
}

/// `chrysalis reboot`.
pub fn reboot(a: ClientArgs) -> Result<()> {
    runtime()?.block_on(client(&a.api)?.reboot())?;
    if a.out.json {
        return print_json(&serde_json::json!({"rebooting": true}));
    }
    println!("rebooting");
    Ok(())
}

fn summary(s: &Settings) -> String {
    let mut parts = Vec::new();
    if s.config.sandboxd.enabled {
        parts.push(format!("sandboxd on {} ({} pools)", s.sandboxd_listen, s.config.sandboxd.pools.len()));
    }
    if s.vk_sandbox {
        parts.push(format!("vk-sandbox as node {}", s.vk_sandbox_name()));
    }
    if s.vk_cocoon {
        parts.push(format!("vk-cocoon as node {}", s.vk_cocoon_name()));
    }
    if parts.is_empty() {
        parts.push("no services".into());
    }
    parts.join(", ")
}

/// `chrysalis config …`; returns the exit code (1 on errors).
pub fn config(cmd: ConfigCmd) -> Result<ExitCode> {
    let (files, sources, json) = match cmd {
        ConfigCmd::Default => {
            print!("{}", config::DEFAULT_TOML);
            return Ok(ExitCode::SUCCESS);
        }
        ConfigCmd::Check { files, sources, out } => (files, sources, out.json),
    };
    let result = if files.is_empty() {
        supervisor::load_settings(&sources.paths(), sources.hostname.as_deref())
    } else {
        let env =
            ValidateEnv { hostname: sources.hostname.clone().unwrap_or_else(config::hostname), check_files: true };
        config::load_files(&files).and_then(|l| l.validate(&env))
    };
    match result {
        Ok(s) => {
            if json {
                print_json(&serde_json::json!({"ok": true, "errors": [], "settings": s}))?;
            } else {
                println!("configuration OK: {}", summary(&s));
                for r in &s.sources {
                    println!("  {} ({})", r.path.display(), r.status);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let issues = e.to_issues();
            if json {
                print_json(&serde_json::json!({"ok": false, "errors": issues}))?;
            } else {
                print_issues(&issues);
                eprintln!(
                    "chrysalis: {} configuration error{}",
                    issues.len(),
                    if issues.len() == 1 { "" } else { "s" }
                );
            }
            Ok(ExitCode::from(1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use supervisor::update::UpdateState;

    #[test]
    fn update_line_shows_the_security_floor_and_why_an_apply_was_refused() {
        let mut u = UpdateStatus {
            state: UpdateState::Failed,
            slot: Some("b".into()),
            version: Some("0.2.0".into()),
            generation: Some(2),
            security_version: Some(2),
            security_floor: Some(2),
            message: Some("the bundle's security_version 1 is lower than this box's security floor 2".into()),
            ..UpdateStatus::unavailable("")
        };
        let line = update_line(&u);
        assert_eq!(
            line,
            "failed, slot b, version 0.2.0, generation 2, security version 2 (floor 2): the bundle's \
             security_version 1 is lower than this box's security floor 2"
        );
        u.security_floor = None;
        assert!(update_line(&u).contains("security version 2 (floor not recorded yet)"));
    }
}

//! Validation: [`Config::validate`] fills the defaults that depend on other keys (which
//! virtual nodes run, their names) and checks every rule, table by table, reporting all
//! problems at once; the result is the [`Settings`] the supervisor runs with.

use std::net::SocketAddr;

use serde::Serialize;

use super::error::{ConfigError, Source};
use super::layers::{Loaded, Provenance, SourceReport};
use super::model::{ClusterConfig, CocoonConfig, Config, SandboxdConfig, SandboxdNetwork, SupervisorConfig};
use super::rules::{check_endpoint, valid_label_value, valid_node_name, valid_tls_name, Check};

/// The validated, resolved settings the supervisor runs with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Settings {
    /// The merged model with defaults filled in (`enabled`, node names).
    pub config: Config,
    /// `supervisor.api_listen`, parsed.
    pub api_listen: Option<SocketAddr>,
    /// `supervisor.metrics_listen`, parsed.
    pub metrics_listen: Option<SocketAddr>,
    /// `sandboxd.listen`, parsed.
    pub sandboxd_listen: SocketAddr,
    /// Whether vk-sandbox runs.
    pub vk_sandbox: bool,
    /// Whether vk-cocoon runs.
    pub vk_cocoon: bool,
    /// sandboxd's `network` section, when any `[sandboxd] vm_*` key is set.
    pub sandboxd_network: Option<SandboxdNetwork>,
    /// What was read.
    pub sources: Vec<SourceReport>,
}

impl Settings {
    /// The vk-sandbox node name (set by validation).
    pub fn vk_sandbox_name(&self) -> &str {
        self.config.vk_sandbox.node_name.as_deref().unwrap_or_default()
    }

    /// The vk-cocoon node name (set by validation).
    pub fn vk_cocoon_name(&self) -> &str {
        self.config.vk_cocoon.node_name.as_deref().unwrap_or_default()
    }
}

/// What validation may look at besides the config.
#[derive(Debug, Clone)]
pub struct ValidateEnv {
    /// For the default node names.
    pub hostname: String,
    /// Check that `*_file` secrets are readable, non-empty and well-formed.
    pub check_files: bool,
}

impl ValidateEnv {
    /// This host's name, file checks on.
    pub fn host() -> Self {
        ValidateEnv { hostname: hostname(), check_files: true }
    }
}

/// This host's name (`uname -n`), lowercased.
pub fn hostname() -> String {
    rustix::system::uname().nodename().to_string_lossy().to_ascii_lowercase()
}

impl Config {
    /// Applies the defaults that depend on other keys and checks every rule; all problems are
    /// reported at once.
    pub fn validate(&self, prov: &Provenance, env: &ValidateEnv) -> Result<Settings, ConfigError> {
        let mut c = Check { prov, issues: Vec::new() };
        let mut cfg = self.clone();
        let (api_listen, metrics_listen) = supervisor(&mut c, &cfg.supervisor, env);
        let (sandboxd_listen, sandboxd_network) = sandboxd(&mut c, &cfg.sandboxd, env);
        if let Some(cl) = &cfg.cluster {
            cluster(&mut c, cl, env);
        }
        let (vk_sandbox, vk_cocoon) = virtual_nodes(&mut c, &mut cfg, env);
        if vk_cocoon {
            cocoon(&mut c, &cfg.vk_cocoon);
        }
        if let Some(net) = sandboxd_network.as_ref().filter(|_| vk_cocoon && cfg.sandboxd.enabled) {
            c.apart_from_vk_cocoon(net);
        }
        if vk_cocoon && !valid_label_value(&cfg.vk_cocoon.pool) {
            c.fail(
                "vk_cocoon.pool",
                format!("{:?} is not a label value", cfg.vk_cocoon.pool),
                "use at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
            );
        }

        // [update]
        if cfg.update.health_deadline_secs == 0 {
            c.fail(
                "update.health_deadline_secs",
                "0 would revert every update at once",
                "give the seconds a trial boot has to become healthy (600 under TCG)",
            );
        }

        match (c.issues.is_empty(), sandboxd_listen) {
            (true, Some(sandboxd_listen)) => Ok(Settings {
                config: cfg,
                api_listen,
                metrics_listen,
                sandboxd_listen,
                vk_sandbox,
                vk_cocoon,
                sandboxd_network,
                sources: Vec::new(),
            }),
            _ => Err(ConfigError::Invalid(c.issues)),
        }
    }
}

impl Loaded {
    /// Validates (see [`Config::validate`]).
    pub fn validate(self, env: &ValidateEnv) -> Result<Settings, ConfigError> {
        let mut s = self.config.validate(&self.provenance, env)?;
        s.sources = self.sources;
        Ok(s)
    }
}

/// `[supervisor]`: the API socket and listeners, their tokens, the box's TLS pair and names;
/// returns `api_listen` and `metrics_listen`, parsed.
fn supervisor(c: &mut Check<'_>, s: &SupervisorConfig, env: &ValidateEnv) -> (Option<SocketAddr>, Option<SocketAddr>) {
    c.absolute("supervisor.api_socket", &s.api_socket);
    c.absolute("supervisor.state_dir", &s.state_dir);
    let api_listen = s.api_listen.as_deref().and_then(|v| c.addr("supervisor.api_listen", v, "0.0.0.0:7780"));
    if s.api_listen.is_some() && s.api_token_file.is_none() {
        c.fail(
            "supervisor.api_listen",
            "a remote API without a token would let anyone on the network update or reboot the box",
            "set supervisor.api_token_file to a file holding a bearer token (or remove api_listen)",
        );
    }
    if let Some(p) = &s.api_token_file {
        c.secret("supervisor.api_token_file", p, env, "a bearer token (e.g. `openssl rand -hex 32`)");
    }
    let metrics_listen =
        s.metrics_listen.as_deref().and_then(|v| c.addr("supervisor.metrics_listen", v, "0.0.0.0:9100"));
    if metrics_listen.is_some_and(|a| !a.ip().is_loopback()) && s.metrics_token_file.is_none() {
        c.fail(
            "supervisor.metrics_listen",
            "metrics beyond loopback without a token would show the box's state to anyone on the network",
            "set supervisor.metrics_token_file to a file holding a bearer token for the scraper \
             (Prometheus: authorization.credentials_file), or listen on 127.0.0.1",
        );
    }
    if let Some(p) = &s.metrics_token_file {
        c.secret("supervisor.metrics_token_file", p, env, "a bearer token (e.g. `openssl rand -hex 32`)");
    }
    c.tls_pair("supervisor", s.tls_cert_file.as_deref(), s.tls_key_file.as_deref(), env);
    for (i, n) in s.tls_names.iter().enumerate() {
        if !valid_tls_name(n) {
            c.fail(
                &format!("supervisor.tls_names[{i}]"),
                format!("{n:?} is not a DNS name or an IP address"),
                "give names like \"box1.example.com\" or addresses like \"10.0.0.5\"",
            );
        }
    }
    (api_listen, metrics_listen)
}

/// `[sandboxd]`: listener, token, TLS pair, budgets, pools and the VM network; returns
/// `listen`, parsed, and the `network` section.
fn sandboxd(
    c: &mut Check<'_>,
    sb: &SandboxdConfig,
    env: &ValidateEnv,
) -> (Option<SocketAddr>, Option<SandboxdNetwork>) {
    let sandboxd_listen = c.addr("sandboxd.listen", &sb.listen, "0.0.0.0:7777");
    if let Some(p) = &sb.api_token_file {
        c.token("sandboxd.api_token_file", p, env);
    }
    c.tls_pair("sandboxd", sb.tls_cert_file.as_deref(), sb.tls_key_file.as_deref(), env);
    for (key, v) in [
        ("max_vms", sb.max_vms),
        ("max_memory_mib", sb.max_memory_mib),
        ("max_disk_mib", sb.max_disk_mib),
        ("max_lifetime_secs", sb.max_lifetime_secs),
    ] {
        if v == Some(0) {
            c.fail(
                &format!("sandboxd.{key}"),
                "0 would refuse every claim",
                format!("remove sandboxd.{key} (sandboxd then picks its default) or give a positive number"),
            );
        }
    }
    if let Some(p) = &sb.catalog {
        c.absolute("sandboxd.catalog", p);
    }
    if sb.refill_concurrency > 256 {
        c.fail(
            "sandboxd.refill_concurrency",
            format!("{} is above 256", sb.refill_concurrency),
            "use 0 (automatic) to 256",
        );
    }
    if sb.boot_timeout_secs == 0 {
        c.fail(
            "sandboxd.boot_timeout_secs",
            "0 would fail every boot",
            "give the seconds a cold boot may take (600 under TCG)",
        );
    }
    pools(c, sb);
    (sandboxd_listen, c.sandboxd_network(sb))
}

/// `[[sandboxd.pools]]`: known template, size and lane, no two pools alike.
fn pools(c: &mut Check<'_>, sb: &SandboxdConfig) {
    let mut seen: Vec<(&str, &str, &str)> = Vec::new();
    for (i, p) in sb.pools.iter().enumerate() {
        let k = |f: &str| format!("sandboxd.pools[{i}].{f}");
        if !vmm::catalog::valid_template(&p.template) {
            c.fail(
                &k("template"),
                format!("{:?} is not a template name", p.template),
                "use a catalog template or alias such as \"base\" (letters, digits, . _ : / -; at most 63)",
            );
        }
        if p.size.parse::<vmm::SizeClass>().is_err() {
            let sizes: Vec<&str> = vmm::SizeClass::ALL.iter().map(|s| s.as_str()).collect();
            c.fail(&k("size"), format!("{:?} is not a size class", p.size), format!("use one of {}", sizes.join(", ")));
        }
        match p.net.as_str() {
            "none" => {}
            "egress" if sb.vm_uplink.is_some() => {}
            "egress" => c.fail(
                &k("net"),
                "egress needs sandboxd.vm_uplink (the interface VM egress leaves by), which is not set",
                "set sandboxd.vm_uplink (e.g. \"eno1\") or use net = \"none\"",
            ),
            other => c.fail(&k("net"), format!("{other:?} is not a network lane"), "use net = \"none\" or \"egress\""),
        }
        let key = (p.template.as_str(), p.size.as_str(), p.net.as_str());
        if seen.contains(&key) {
            c.fail(
                &format!("sandboxd.pools[{i}]"),
                format!("a second pool for template {:?}, size {:?}, net {:?}", p.template, p.size, p.net),
                "merge the two entries into one and set its warm count",
            );
        }
        seen.push(key);
    }
}

/// `[cluster]`: the endpoint, the pinned CA hashes and the bootstrap token, the last two as
/// `join` parses them.
fn cluster(c: &mut Check<'_>, cl: &ClusterConfig, env: &ValidateEnv) {
    if let Err(problem) = check_endpoint(&cl.endpoint) {
        c.fail("cluster.endpoint", problem, "give the API server as https://host:port, e.g. https://10.0.2.100:6443");
    }
    if cl.ca_cert_hashes.is_empty() {
        c.fail(
            "cluster.ca_cert_hashes",
            "is empty: an unpinned cluster CA is never trusted",
            "add the sha256:<hex> value printed by kubeadm token create --print-join-command",
        );
    }
    for (i, h) in cl.ca_cert_hashes.iter().enumerate() {
        if h.parse::<join::CaHash>().is_err() {
            c.fail(
                &format!("cluster.ca_cert_hashes[{i}]"),
                format!("{h:?} is not sha256:<64 hex>"),
                "copy the value printed by kubeadm token create --print-join-command",
            );
        }
    }
    let key = "cluster.bootstrap_token_file";
    if let Some(t) = c.secret(key, &cl.bootstrap_token_file, env, "the bootstrap token (abcdef.0123456789abcdef)") {
        if t.parse::<join::BootstrapToken>().is_err() {
            c.fail(
                key,
                format!(
                    "{} does not hold a token of the form abcdef.0123456789abcdef",
                    cl.bootstrap_token_file.display()
                ),
                "write the token printed by kubeadm token create (one line, nothing else)",
            );
        }
    }
}

/// `[vk_sandbox]` / `[vk_cocoon]`: which virtual nodes run (default: with a cluster) and their
/// names (default: from the hostname), written into `cfg`; returns (vk-sandbox, vk-cocoon).
fn virtual_nodes(c: &mut Check<'_>, cfg: &mut Config, env: &ValidateEnv) -> (bool, bool) {
    let cluster = cfg.cluster.is_some();
    let vk_sandbox = cfg.vk_sandbox.enabled.unwrap_or(cluster);
    let vk_cocoon = cfg.vk_cocoon.enabled.unwrap_or(cluster);
    for (svc, on) in [("vk_sandbox", vk_sandbox), ("vk_cocoon", vk_cocoon)] {
        if on && !cluster {
            c.fail(
                &format!("{svc}.enabled"),
                "a virtual node needs a cluster to join, and there is no [cluster] table",
                format!("add [cluster] (endpoint, ca_cert_hashes, bootstrap_token_file) or set {svc}.enabled = false"),
            );
        }
    }
    if vk_sandbox && !cfg.sandboxd.enabled {
        c.fail(
            "vk_sandbox.enabled",
            "vk-sandbox serves Pods from sandboxd, which is disabled",
            "set sandboxd.enabled = true or vk_sandbox.enabled = false",
        );
    }
    let host = env.hostname.trim_end_matches('.').to_ascii_lowercase();
    let host = host.as_str();
    cfg.vk_sandbox.enabled = Some(vk_sandbox);
    cfg.vk_cocoon.enabled = Some(vk_cocoon);
    let sandbox_name = cfg.vk_sandbox.node_name.get_or_insert_with(|| format!("{host}-sandbox")).clone();
    let cocoon_name = cfg.vk_cocoon.node_name.get_or_insert_with(|| format!("{host}-cocoon")).clone();
    for (key, name, on) in
        [("vk_sandbox.node_name", &sandbox_name, vk_sandbox), ("vk_cocoon.node_name", &cocoon_name, vk_cocoon)]
    {
        if on && !valid_node_name(name) {
            let origin = if c.prov.source_of(key) == Source::Default {
                format!(" (derived from the hostname {host:?})")
            } else {
                String::new()
            };
            c.fail(
                key,
                format!("{name:?}{origin} is not a valid node name"),
                format!("set {key} to lowercase letters, digits, '-' and '.' (at most 63 per label)"),
            );
        }
    }
    if vk_sandbox && vk_cocoon && sandbox_name == cocoon_name {
        c.fail(
            "vk_cocoon.node_name",
            format!("{cocoon_name:?} is also vk_sandbox's name"),
            "give each virtual node its own name",
        );
    }
    (vk_sandbox, vk_cocoon)
}

/// `[vk_cocoon]` when it runs: sharing groups, the legacy owner and the VM filter keys.
fn cocoon(c: &mut Check<'_>, cocoon: &CocoonConfig) {
    let mut bad: Vec<String> = Vec::new();
    for group in &cocoon.shared_namespaces {
        let distinct: std::collections::BTreeSet<&String> = group.iter().collect();
        if distinct.len() < 2 {
            bad.push(format!("{group:?} has fewer than two different namespaces"));
        }
        bad.extend(
            group.iter().filter(|n| !images::valid_namespace(n)).map(|n| format!("{n:?} is not a namespace name")),
        );
    }
    if !bad.is_empty() {
        c.fail(
            "vk_cocoon.shared_namespaces",
            bad.join("; "),
            "list groups of at least two namespace names (1-63 of a-z, 0-9 and '-'), \
             e.g. [[\"golden\", \"team-a\"]]; pods of one group may use each other's VMs and snapshots",
        );
    }
    let allow = cocoon.vm_host_allow.join(",");
    if let Err(e) = vmnet::filter::parse_host_allow(&allow) {
        c.fail(
            "vk_cocoon.vm_host_allow",
            e.to_string(),
            "list host services as \"tcp/PORT\" or \"udp/PORT\", e.g. [\"udp/53\"], or leave it empty (VMs reach no host service)",
        );
    }
    if let Some(up) = &cocoon.vm_uplink {
        let policy = vmnet::FilterPolicy { uplink: Some(up.clone()), ..Default::default() };
        if let Err(e) = policy.validate() {
            c.fail(
                "vk_cocoon.vm_uplink",
                e.to_string(),
                "name the network interface egress VMs leave by (e.g. \"eno1\"), or remove the key (no VM has a route out)",
            );
        }
    }
    if let Err(e) = vmnet::filter::parse_refuse(&cocoon.vm_refuse.join(",")) {
        c.fail(
            "vk_cocoon.vm_refuse",
            e.to_string(),
            "list IPv4 networks as \"a.b.c.d/len\" (or single addresses), e.g. [\"203.0.113.0/24\"]",
        );
    }
    if let Some(ns) = cocoon.legacy_namespace.as_deref().filter(|n| !images::valid_namespace(n)) {
        c.fail(
            "vk_cocoon.legacy_namespace",
            format!("{ns:?} is not a namespace name"),
            "name the namespace that owns VMs and snapshots recorded without one (1-63 of a-z, 0-9 and '-')",
        );
    }
}

//! The child table: which services run, with which program, flags, environment and generated
//! files, derived from validated [`Settings`]. The providers' flags and environment are typed
//! sets (`services/providers.rs`); sandboxd's config is a [`sandboxd_api::Config`].
//!
//! | service | program | configured by |
//! |---|---|---|
//! | `sandboxd` | `<bin>/sandboxd --config <run>/sandboxd.json` | a [`sandboxd_api::Config`] generated here (`data_dir = <state>/sandboxd`, catalog, pools, budget, the root token file, the TLS pair when it serves TLS, `network` from the `vm_*` keys when any is set) |
//! | `vk-sandbox` | `<bin>/vk-sandbox` | flags: node name, sandboxd URL (`https://` with `--sandboxd-ca-file` = sandboxd's certificate when it serves TLS) and root token file, `--state-path <state>/vk-sandbox/claims.json`, join flags |
//! | `vk-cocoon` | `<bin>/vk-cocoon` | join flags; env `VK_NODE_NAME`, `VK_NODE_POOL`, `COCOON_ROOT_DIR=<state>/vk-cocoon`, `CHRYSALIS_IMAGES=<state>/images` |
//!
//! Join flags (both nodes): `--join-server <endpoint> --join-api-server <endpoint>
//! --join-token-file <file> --join-ca-hash <h>… --credentials-dir <state>/<svc>/pki`.
//! Every child gets `CHRYSALIS_STATE=<state>` and `NO_COLOR=1`, and never the supervisor's
//! `NOTIFY_SOCKET` / `WATCHDOG_*` / `LISTEN_*` (they belong to the supervisor alone).
//!
//! Generated files name secrets (the token file, the TLS key): they are written 0600 in a
//! directory made 0700 ([`foundation::write_secret`]); each service's directories are 0700.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use crate::config::Settings;
pub use crate::layout::{Layout, ServiceName};
use crate::secrets::Secrets;

mod providers;

use providers::{JoinFlags, VkCocoonEnv, VkSandboxFlags};

/// Environment variables a child must not inherit.
pub const SCRUBBED_ENV: [&str; 6] =
    ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"];

/// Why a service's files could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    /// A directory or generated file could not be written.
    #[error("writing {}", .path.display())]
    Write {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A generated file could not be rendered (a path that is not UTF-8).
    #[error("rendering {}", .path.display())]
    Render {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// A file the supervisor writes before starting a service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedFile {
    /// Where.
    pub path: PathBuf,
    /// What.
    pub contents: Contents,
}

/// What a generated file holds, typed until it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contents {
    /// sandboxd's config, written as pretty JSON.
    SandboxdConfig(Box<sandboxd_api::Config>),
}

impl Contents {
    /// The bytes written.
    pub fn render(&self) -> Result<Vec<u8>, serde_json::Error> {
        match self {
            Contents::SandboxdConfig(c) => {
                let mut bytes = serde_json::to_vec_pretty(c)?;
                bytes.push(b'\n');
                Ok(bytes)
            }
        }
    }
}

/// How to run one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    /// Which.
    pub name: ServiceName,
    /// The binary.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment (on top of the supervisor's, minus [`SCRUBBED_ENV`]).
    pub env: Vec<(String, String)>,
    /// Directories to create first (each made 0700; missing parents 0755).
    pub dirs: Vec<PathBuf>,
    /// Files to write first (0600 in a 0700 directory, atomically).
    pub files: Vec<GeneratedFile>,
}

impl ServiceSpec {
    /// Creates the directories and writes the generated files.
    pub fn prepare(&self) -> Result<(), ServicesError> {
        for d in &self.dirs {
            foundation::private_dir(d).map_err(|source| ServicesError::Write { path: d.clone(), source })?;
        }
        for f in &self.files {
            let bytes = f.contents.render().map_err(|source| ServicesError::Render { path: f.path.clone(), source })?;
            foundation::write_secret(&f.path, &bytes)
                .map_err(|source| ServicesError::Write { path: f.path.clone(), source })?;
        }
        Ok(())
    }
}

/// The address a local client uses to reach a listen address (`0.0.0.0` → `127.0.0.1`).
pub fn local_addr(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

/// sandboxd's generated config: always a root token (configured or minted), the TLS pair when
/// it serves TLS, the budget keys when set, the `network` section (from
/// [`crate::config::SandboxdNetwork`]) when a `[sandboxd] vm_*` key is set; every other key at
/// sandboxd's default.
pub fn sandboxd_config(settings: &Settings, layout: &Layout, secrets: &Secrets) -> sandboxd_api::Config {
    let sb = &settings.config.sandboxd;
    let tls = secrets.sandboxd_tls.as_ref();
    sandboxd_api::Config {
        listen: settings.sandboxd_listen,
        data_dir: layout.state_dir.join("sandboxd"),
        api_token_file: Some(secrets.sandboxd_token_file.clone()),
        tls_cert_file: tls.map(|t| t.cert.clone()),
        tls_key_file: tls.map(|t| t.key.clone()),
        advertise_addr: sb.advertise_addr.clone(),
        pools: sb
            .pools
            .iter()
            .map(|p| sandboxd_api::PoolConfig {
                net: Some(p.net.clone()),
                size: Some(p.size.clone()),
                ..sandboxd_api::PoolConfig::warm(p.template.as_str(), p.warm)
            })
            .collect(),
        network: settings.sandboxd_network.as_ref().map(|n| sandboxd_api::NetworkConfig {
            bridge: Some(n.bridge.clone()),
            cidr: Some(n.cidr.to_string()),
            uplink: n.uplink.clone(),
            refuse: n.refuse.clone(),
            netns: None,
        }),
        refill_concurrency: sb.refill_concurrency,
        boot_timeout_secs: sb.boot_timeout_secs,
        catalog: Some(sb.catalog.clone().unwrap_or_else(|| layout.default_catalog.clone())),
        max_vms: sb.max_vms.map(|v| usize::try_from(v).unwrap_or(usize::MAX)),
        max_memory_mib: sb.max_memory_mib,
        max_disk_mib: sb.max_disk_mib,
        max_lifetime_secs: sb.max_lifetime_secs.unwrap_or(sandboxd_api::config::DEFAULT_MAX_LIFETIME_SECS),
        ..sandboxd_api::Config::default()
    }
}

/// The URL a local client (vk-sandbox, the health probe) reaches sandboxd at.
pub fn sandboxd_url(settings: &Settings, secrets: &Secrets) -> String {
    let scheme = if secrets.sandboxd_tls.is_some() { "https" } else { "http" };
    format!("{scheme}://{}", local_addr(settings.sandboxd_listen))
}

fn join_flags<'a>(settings: &'a Settings, layout: &Layout, svc: ServiceName) -> JoinFlags<'a> {
    JoinFlags { cluster: settings.config.cluster.as_ref(), credentials_dir: layout.pki_dir(svc) }
}

/// The enabled services, in start order.
pub fn plan(settings: &Settings, layout: &Layout, secrets: &Secrets) -> Vec<ServiceSpec> {
    let state = layout.state_dir.display().to_string();
    let common = || vec![("CHRYSALIS_STATE".to_string(), state.clone()), ("NO_COLOR".to_string(), "1".to_string())];
    let mut out = Vec::new();
    if settings.config.sandboxd.enabled {
        let cfg_path = layout.run_dir.join("sandboxd.json");
        let config = Box::new(sandboxd_config(settings, layout, secrets));
        out.push(ServiceSpec {
            name: ServiceName::Sandboxd,
            program: layout.bin_dir.join("sandboxd"),
            args: vec!["--config".into(), cfg_path.display().to_string()],
            env: common(),
            dirs: vec![layout.state_dir.join("sandboxd")],
            files: vec![GeneratedFile { path: cfg_path, contents: Contents::SandboxdConfig(config) }],
        });
    }
    if settings.vk_sandbox {
        let svc = ServiceName::VkSandbox;
        let dir = layout.state_dir.join(svc.as_str());
        let args = VkSandboxFlags {
            node_name: settings.vk_sandbox_name(),
            sandboxd_url: sandboxd_url(settings, secrets),
            state_path: dir.join("claims.json"),
            sandboxd_token_file: &secrets.sandboxd_token_file,
            sandboxd_ca_file: secrets.sandboxd_tls.as_ref().map(|t| t.cert.as_path()),
            join: join_flags(settings, layout, svc),
        }
        .args();
        out.push(ServiceSpec {
            name: svc,
            program: layout.bin_dir.join(svc.as_str()),
            args,
            env: common(),
            dirs: vec![dir, layout.pki_dir(svc)],
            files: Vec::new(),
        });
    }
    if settings.vk_cocoon {
        let svc = ServiceName::VkCocoon;
        let cocoon = &settings.config.vk_cocoon;
        let mut env = common();
        env.extend(
            VkCocoonEnv {
                node_name: settings.vk_cocoon_name(),
                node_pool: &cocoon.pool,
                root_dir: layout.state_dir.join(svc.as_str()),
                images: layout.state_dir.join("images"),
                shared_namespaces: cocoon.shared_namespaces_env(),
                legacy_namespace: cocoon.legacy_namespace.as_deref(),
                host_allow: &cocoon.vm_host_allow,
                uplink: cocoon.vm_uplink.as_deref(),
                refuse: &cocoon.vm_refuse,
            }
            .vars(),
        );
        out.push(ServiceSpec {
            name: svc,
            program: layout.bin_dir.join(svc.as_str()),
            args: join_flags(settings, layout, svc).args(),
            env,
            dirs: vec![layout.state_dir.join(svc.as_str()), layout.pki_dir(svc), layout.state_dir.join("images")],
            files: Vec::new(),
        });
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use crate::config::{self, ValidateEnv};
    use std::path::Path;

    const HASH: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn settings(text: &str) -> Settings {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        config::load_files(&[p]).unwrap().validate(&ValidateEnv { hostname: "box".into(), check_files: false }).unwrap()
    }

    fn layout() -> Layout {
        Layout {
            state_dir: "/state".into(),
            run_dir: "/run/c".into(),
            bin_dir: "/bin".into(),
            default_catalog: "/cat.json".into(),
        }
    }

    fn plain() -> Secrets {
        Secrets::plain("/state/secrets/sandboxd-token")
    }

    fn plan(s: &Settings, l: &Layout) -> Vec<ServiceSpec> {
        super::plan(s, l, &plain())
    }

    /// The config as written to `sandboxd.json`.
    fn written(spec: &ServiceSpec) -> serde_json::Value {
        serde_json::from_slice(&spec.files[0].contents.render().unwrap()).unwrap()
    }

    fn json(c: &sandboxd_api::Config) -> serde_json::Value {
        serde_json::to_value(c).unwrap()
    }

    fn flag<'a>(args: &'a [String], name: &str) -> Vec<&'a str> {
        args.windows(2).filter(|w| w[0] == name).map(|w| w[1].as_str()).collect()
    }

    #[test]
    fn no_cluster_runs_sandboxd_alone() {
        let s = settings("");
        let plan = plan(&s, &layout());
        assert_eq!(plan.len(), 1);
        let sb = &plan[0];
        assert_eq!(sb.name, ServiceName::Sandboxd);
        assert_eq!(sb.program, PathBuf::from("/bin/sandboxd"));
        assert_eq!(sb.args, ["--config", "/run/c/sandboxd.json"]);
        assert!(sb.env.contains(&("CHRYSALIS_STATE".into(), "/state".into())));
        let json = written(sb);
        assert_eq!(json["data_dir"], "/state/sandboxd");
        assert_eq!(json["catalog"], "/cat.json");
        assert_eq!(json["listen"], "0.0.0.0:7777");
        assert_eq!(json["api_token_file"], "/state/secrets/sandboxd-token", "sandboxd always gets a token");
        assert!(json.get("tls_cert_file").is_none() && json.get("max_vms").is_none());
        assert!(json.get("network").is_none(), "no vm_* key: sandboxd VMs have no network");
    }

    #[test]
    fn sandboxd_json_carries_the_vm_network() {
        let s = settings(
            "[sandboxd]\nvm_uplink = \"eno1\"\nvm_refuse = [\"203.0.113.0/24\", \"198.51.100.7\"]\n\
             [[sandboxd.pools]]\ntemplate = \"rt\"\nnet = \"egress\"\nwarm = 2\n",
        );
        let j = json(&sandboxd_config(&s, &layout(), &plain()));
        assert_eq!(
            j["network"],
            serde_json::json!({"bridge": "chrysalis1", "cidr": "10.89.0.0/24", "uplink": "eno1",
                               "refuse": ["203.0.113.0/24", "198.51.100.7"]})
        );
        assert_eq!(j["pools"][0]["net"], "egress");
        let s = settings("[sandboxd]\nvm_bridge = \"sbx0\"\nvm_cidr = \"10.90.0.0/16\"\n");
        let j = json(&sandboxd_config(&s, &layout(), &plain()));
        assert_eq!(j["network"], serde_json::json!({"bridge": "sbx0", "cidr": "10.90.0.0/16"}));
        let plan = plan(&s, &layout());
        assert_eq!(written(&plan[0])["network"], j["network"]);
    }

    #[test]
    fn sandboxd_json_carries_pools_token_and_catalog() {
        let s = settings(
            "[sandboxd]\nlisten = \"127.0.0.1:7000\"\napi_token_file = \"/t\"\ncatalog = \"/c.json\"\nrefill_concurrency = 2\n\
             [[sandboxd.pools]]\ntemplate = \"base\"\nwarm = 2\n",
        );
        let j = json(&sandboxd_config(&s, &layout(), &Secrets::plain("/t")));
        assert_eq!(j["pools"], serde_json::json!([{"template": "base", "size": "small", "net": "none", "warm": 2}]));
        assert_eq!(j["api_token_file"], "/t");
        assert_eq!(j["catalog"], "/c.json");
        assert_eq!(j["refill_concurrency"], 2);
        assert_eq!(j["listen"], "127.0.0.1:7000");
    }

    #[test]
    fn tls_and_budget_reach_sandboxd_and_vk_sandbox() {
        let s = settings(&format!(
            "[sandboxd]\nmax_vms = 8\nmax_memory_mib = 4096\nmax_disk_mib = 9000\nmax_lifetime_secs = 3600\n[cluster]\nendpoint = \"https://a:1\"\n\
             ca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n"
        ));
        let cert = crate::secrets::CertFiles {
            cert: "/state/tls/cert.pem".into(),
            key: "/state/tls/key.pem".into(),
            fingerprint: "AB".into(),
            minted: true,
        };
        let secrets = Secrets { sandboxd_tls: Some(cert.clone()), api_tls: Some(cert), ..plain() };
        let j = json(&sandboxd_config(&s, &layout(), &secrets));
        assert_eq!(j["tls_cert_file"], "/state/tls/cert.pem");
        assert_eq!(j["tls_key_file"], "/state/tls/key.pem");
        assert_eq!(j["api_token_file"], "/state/secrets/sandboxd-token");
        assert_eq!((j["max_vms"].as_u64(), j["max_memory_mib"].as_u64()), (Some(8), Some(4096)));
        assert_eq!(j["max_disk_mib"].as_u64(), Some(9000));
        assert_eq!(j["max_lifetime_secs"], 3600);
        let plan = super::plan(&s, &layout(), &secrets);
        let vs = &plan[1];
        assert_eq!(flag(&vs.args, "--sandboxd-url"), ["https://127.0.0.1:7777"]);
        assert_eq!(flag(&vs.args, "--sandboxd-ca-file"), ["/state/tls/cert.pem"]);
        assert_eq!(flag(&vs.args, "--sandboxd-token-file"), ["/state/secrets/sandboxd-token"]);
    }

    #[test]
    fn a_cluster_adds_both_nodes_with_join_flags() {
        let s = settings(&format!(
            "[sandboxd]\napi_token_file = \"/tok\"\n[cluster]\nendpoint = \"https://10.0.2.100:16443\"\n\
             ca_cert_hashes = [\"{HASH}\", \"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n[vk_cocoon]\npool = \"gpu\"\n"
        ));
        let plan = plan(&s, &layout());
        let names: Vec<ServiceName> = plan.iter().map(|p| p.name).collect();
        assert_eq!(names, ServiceName::ALL);
        let vs = &plan[1];
        assert_eq!(flag(&vs.args, "--node-name"), ["box-sandbox"]);
        assert_eq!(flag(&vs.args, "--sandboxd-url"), ["http://127.0.0.1:7777"]);
        assert_eq!(flag(&vs.args, "--sandboxd-token-file"), ["/state/secrets/sandboxd-token"]);
        assert!(flag(&vs.args, "--sandboxd-ca-file").is_empty(), "plain HTTP needs no CA");
        assert_eq!(flag(&vs.args, "--state-path"), ["/state/vk-sandbox/claims.json"]);
        for p in &plan[1..] {
            assert_eq!(flag(&p.args, "--join-server"), ["https://10.0.2.100:16443"]);
            assert_eq!(flag(&p.args, "--join-api-server"), ["https://10.0.2.100:16443"]);
            assert_eq!(flag(&p.args, "--join-token-file"), ["/boot"]);
            assert_eq!(flag(&p.args, "--join-ca-hash"), [HASH, HASH]);
            assert_eq!(flag(&p.args, "--credentials-dir"), [format!("/state/{}/pki", p.name)]);
        }
        let vc = &plan[2];
        let env = |k: &str| vc.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(env("VK_NODE_NAME"), Some("box-cocoon"));
        assert_eq!(env("VK_NODE_POOL"), Some("gpu"));
        assert_eq!(env("COCOON_ROOT_DIR"), Some("/state/vk-cocoon"));
        assert_eq!(env("CHRYSALIS_IMAGES"), Some("/state/images"));
        assert_eq!(env("VK_SHARED_NAMESPACES"), None, "no namespace shares by default");
        assert_eq!(env("VK_LEGACY_NAMESPACE"), None);
        for k in ["VK_NET_HOST_ALLOW", "VK_NET_UPLINK", "VK_NET_REFUSE"] {
            assert_eq!(env(k), None, "{k}: VMs reach nothing by default");
        }
    }

    #[test]
    fn vk_cocoon_gets_the_vm_network_filter() {
        let s = settings(&format!(
            "[cluster]\nendpoint = \"https://a:1\"\nca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n\
             [sandboxd]\napi_token_file = \"/tok\"\n[vk_cocoon]\n\
             vm_host_allow = [\"udp/53\", \"tcp/8053\"]\nvm_uplink = \"eno1\"\nvm_refuse = [\"203.0.113.0/24\", \"198.51.100.7\"]\n"
        ));
        let plan = plan(&s, &layout());
        let vc = plan.iter().find(|p| p.name == ServiceName::VkCocoon).expect("vk-cocoon");
        let env = |k: &str| vc.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(env("VK_NET_HOST_ALLOW"), Some("udp/53,tcp/8053"));
        assert_eq!(env("VK_NET_UPLINK"), Some("eno1"));
        assert_eq!(env("VK_NET_REFUSE"), Some("203.0.113.0/24,198.51.100.7"));
    }

    #[test]
    fn vk_cocoon_gets_the_namespace_sharing_groups() {
        let s = settings(&format!(
            "[cluster]\nendpoint = \"https://a:1\"\nca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n\
             [sandboxd]\napi_token_file = \"/tok\"\n[vk_cocoon]\n\
             shared_namespaces = [[\"golden\", \"team-a\"], [\"ci\", \"ci-tools\", \"ci-2\"]]\nlegacy_namespace = \"agents\"\n"
        ));
        let plan = plan(&s, &layout());
        let vc = plan.iter().find(|p| p.name == ServiceName::VkCocoon).expect("vk-cocoon");
        let env = |k: &str| vc.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(env("VK_SHARED_NAMESPACES"), Some("golden,team-a;ci,ci-tools,ci-2"));
        assert_eq!(env("VK_LEGACY_NAMESPACE"), Some("agents"));
    }

    #[test]
    fn disabled_services_are_left_out() {
        let s = settings(&format!(
            "[sandboxd]\nenabled = false\n[vk_sandbox]\nenabled = false\n[cluster]\nendpoint = \"https://a:1\"\n\
             ca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n"
        ));
        let names: Vec<ServiceName> = plan(&s, &layout()).iter().map(|p| p.name).collect();
        assert_eq!(names, [ServiceName::VkCocoon]);
    }

    #[test]
    fn prepare_writes_private_files() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let l = Layout { state_dir: dir.path().join("s"), run_dir: dir.path().join("r"), ..layout() };
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let s = settings(&format!(
            "[cluster]\nendpoint = \"https://a:1\"\nca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"/boot\"\n"
        ));
        let specs = plan(&s, &l);
        for spec in &specs {
            spec.prepare().unwrap();
        }
        let f = dir.path().join("r/sandboxd.json");
        assert_eq!(mode(&f), 0o600, "the generated config names the token file");
        assert_eq!(mode(&dir.path().join("r")), 0o700);
        for d in ["s/sandboxd", "s/vk-sandbox", "s/vk-sandbox/pki", "s/vk-cocoon", "s/vk-cocoon/pki"] {
            assert_eq!(mode(&dir.path().join(d)), 0o700, "{d}");
        }
        let j: serde_json::Value = serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap();
        assert_eq!(j["data_dir"], serde_json::json!(dir.path().join("s/sandboxd")));
    }

    #[test]
    fn local_addresses() {
        assert_eq!(local_addr("0.0.0.0:7777".parse().unwrap()).to_string(), "127.0.0.1:7777");
        assert_eq!(local_addr("[::]:1".parse().unwrap()).to_string(), "[::1]:1");
        assert_eq!(local_addr("10.0.0.5:7".parse().unwrap()).to_string(), "10.0.0.5:7");
        assert_eq!(ServiceName::parse("vk-cocoon"), Some(ServiceName::VkCocoon));
        assert_eq!(ServiceName::parse("vk_cocoon"), None);
    }
}

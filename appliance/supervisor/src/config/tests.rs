//! One test per configuration rule.

use std::path::{Path, PathBuf};

use super::rules::check_endpoint;
use super::*;

const HASH: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn env() -> ValidateEnv {
    ValidateEnv { hostname: "edge1".into(), check_files: true }
}

/// Writes `files` (name → contents) into a temp dir, loads the named layers in order.
struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        Fixture { dir: tempfile::tempdir().unwrap() }
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    fn paths(&self) -> SourcePaths {
        let d = self.dir.path();
        SourcePaths {
            baked: d.join("baked/config.toml"),
            esp: d.join("esp/chrysalis/config.toml"),
            config_disk: d.join("disk/config.toml"),
            cmdline: Some(d.join("cmdline")),
        }
    }

    fn cluster(&self, at: &str) -> String {
        self.write(&format!("{at}/bootstrap-token"), "abcdef.0123456789abcdef\n");
        format!(
            "[cluster]\nendpoint = \"https://10.0.2.100:16443\"\nca_cert_hashes = [\"{HASH}\"]\nbootstrap_token_file = \"bootstrap-token\"\n"
        )
    }
}

fn issues(r: Result<Settings, ConfigError>) -> Vec<Issue> {
    match r {
        Err(ConfigError::Invalid(v)) => v,
        other => panic!("expected validation issues, got {other:?}"),
    }
}

fn only_issue(r: Result<Settings, ConfigError>, key: &str) -> Issue {
    let v = issues(r);
    assert_eq!(v.len(), 1, "{v:#?}");
    assert_eq!(v[0].key, key, "{v:#?}");
    v[0].clone()
}

fn check(text: &str) -> Result<Settings, ConfigError> {
    let f = Fixture::new();
    let p = f.write("c.toml", text);
    load_files(&[p])?.validate(&ValidateEnv { check_files: false, ..env() })
}

#[test]
fn nothing_configured_means_sandboxd_alone_with_defaults() {
    let f = Fixture::new();
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    assert!(s.config.sandboxd.enabled);
    assert!(!s.vk_sandbox && !s.vk_cocoon);
    assert!(s.config.cluster.is_none());
    assert_eq!(s.sandboxd_listen.to_string(), "0.0.0.0:7777");
    assert_eq!(s.config.supervisor.state_dir, PathBuf::from("/var/lib/chrysalis"));
    assert_eq!(s.config.supervisor.api_socket, PathBuf::from("/run/chrysalis/api.sock"));
    assert_eq!(s.config.update.offline, OfflinePolicy::CommitLocal);
    assert_eq!(s.sources.iter().filter(|r| r.status == "missing").count(), 4);
}

#[test]
fn the_documented_default_file_equals_the_built_in_defaults() {
    let f = Fixture::new();
    let p = f.write("d.toml", DEFAULT_TOML);
    let from_file = load_files(&[p]).unwrap().config;
    assert_eq!(from_file, Config::default());
}

#[test]
fn the_design_example_parses() {
    let f = Fixture::new();
    f.write("esp/api-token", "t0k3n\n");
    let root = f.write("esp/sandboxd-token", "0123456789abcdef0123456789abcdef\n");
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    f.write("esp/metrics-token", "scrape\n");
    let cluster = f.cluster("esp");
    f.write(
        "esp/chrysalis/config.toml",
        &format!(
            r#"[supervisor]
api_socket = "/run/chrysalis/api.sock"
api_listen = "0.0.0.0:7780"
api_token_file = "../api-token"
metrics_listen = "0.0.0.0:9100"
metrics_token_file = "../metrics-token"
state_dir = "/var/lib/chrysalis"
[sandboxd]
enabled = true
listen = "0.0.0.0:7777"
api_token_file = "../sandboxd-token"
refill_concurrency = 1
boot_timeout_secs = 600
[[sandboxd.pools]]
template = "base"
size = "small"
net = "none"
warm = 1
{}
[vk_sandbox]
enabled = true
[vk_cocoon]
enabled = true
pool = "default"
[update]
health_deadline_secs = 600
offline = "commit-local"
"#,
            cluster.replace("\"bootstrap-token\"", "\"../bootstrap-token\"")
        ),
    );
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    assert_eq!(s.api_listen.unwrap().port(), 7780);
    assert_eq!(s.metrics_listen.unwrap().port(), 9100);
    assert!(s.vk_sandbox && s.vk_cocoon);
    assert_eq!(s.vk_sandbox_name(), "edge1-sandbox");
    assert_eq!(s.vk_cocoon_name(), "edge1-cocoon");
    assert_eq!(s.config.sandboxd.pools.len(), 1);
}

#[test]
fn layers_merge_per_key_and_later_wins() {
    let f = Fixture::new();
    f.write(
        "baked/config.toml",
        "[sandboxd]\nlisten = \"0.0.0.0:7777\"\nrefill_concurrency = 2\n[[sandboxd.pools]]\ntemplate = \"base\"\nwarm = 3\n",
    );
    f.write("esp/chrysalis/config.toml", "[sandboxd]\nrefill_concurrency = 4\n");
    f.write("disk/config.toml", "[sandboxd]\nboot_timeout_secs = 90\n[[sandboxd.pools]]\ntemplate = \"rt\"\n");
    f.write("cmdline", "BOOT_IMAGE=/vmlinuz ro chrysalis.set=sandboxd.listen=\"127.0.0.1:9999\" quiet\n");
    let l = load(&f.paths()).unwrap();
    let s = l.clone().validate(&env()).unwrap();
    assert_eq!(s.sandboxd_listen.to_string(), "127.0.0.1:9999", "the command line wins");
    assert_eq!(s.config.sandboxd.refill_concurrency, 4, "the ESP overrides the baked value");
    assert_eq!(s.config.sandboxd.boot_timeout_secs, 90, "the disk adds a key, keeping the others");
    let pools: Vec<&str> = s.config.sandboxd.pools.iter().map(|p| p.template.as_str()).collect();
    assert_eq!(pools, ["rt"], "arrays are replaced, not appended");
    assert_eq!(s.config.sandboxd.pools[0].warm, 1, "pool defaults");
    // Provenance.
    assert!(matches!(l.provenance.source_of("sandboxd.listen"), Source::Cmdline { .. }));
    assert_eq!(l.provenance.source_of("sandboxd.refill_concurrency"), Source::File { path: f.paths().esp });
    assert_eq!(l.provenance.source_of("sandboxd.pools[0].warm"), Source::File { path: f.paths().config_disk });
    assert_eq!(l.provenance.source_of("update.offline"), Source::Default);
}

#[test]
fn cmdline_values_keys_and_errors() {
    let p = Path::new("/proc/cmdline");
    let l = parse_cmdline(
        p,
        "a=b chrysalis.set=vk_cocoon.pool=gpu chrysalis.set=sandboxd.warm=[1, 2] chrysalis.set=x.y=\"a b\" \"chrysalis.set=u.v=3\"",
    )
    .unwrap();
    assert_eq!(l.table["vk_cocoon"]["pool"].as_str(), Some("gpu"), "a bare word is a string");
    assert_eq!(l.table["x"]["y"].as_str(), Some("a b"), "quoted values keep their spaces");
    assert_eq!(l.table["u"]["v"].as_integer(), Some(3), "a fully quoted argument");
    assert_eq!(l.sources.len(), 4);
    assert_eq!(cmdline_args("a \"b c\" d"), ["a", "\"b c\"", "d"]);
    for bad in
        ["chrysalis.set=novalue", "chrysalis.set=a..b=1", "chrysalis.set=a b=1", "chrysalis.set=x.token_file=\"rel\""]
    {
        assert!(matches!(parse_cmdline(p, bad), Err(ConfigError::Cmdline { .. })), "{bad}");
    }
    let e = parse_cmdline(p, "chrysalis.set=a=1 chrysalis.set=a.b=2").unwrap_err();
    assert!(e.to_string().contains("already set"), "{e}");
}

#[test]
fn cmdline_errors_name_the_argument() {
    let f = Fixture::new();
    f.write("cmdline", "chrysalis.set=sandboxd.listen=7777\n");
    let i = only_issue(load(&f.paths()).and_then(|l| l.validate(&env())), "sandboxd.listen");
    assert!(i.to_string().contains("kernel command line (chrysalis.set=sandboxd.listen=7777)"), "{i}");
    f.write("cmdline", "chrysalis.set=sandboxd.refill_concurrency=\"many\"\n");
    let i = only_issue(load(&f.paths()).and_then(|l| l.validate(&env())), "sandboxd.refill_concurrency");
    assert!(matches!(i.source, Source::Cmdline { .. }), "{i:?}");
}

#[test]
fn relative_secret_files_resolve_against_their_file() {
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis");
    f.write("esp/chrysalis/config.toml", &cluster);
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    let cl = s.config.cluster.unwrap();
    assert_eq!(cl.bootstrap_token_file, f.dir.path().join("esp/chrysalis/bootstrap-token"));
}

#[test]
fn unknown_keys_name_key_and_source() {
    let f = Fixture::new();
    let p = f.write("esp/chrysalis/config.toml", "[sandboxd]\n[[sandboxd.pools]]\ntemplate = \"base\"\nwram = 1\n");
    let i = only_issue(load(&f.paths()).and_then(|l| l.validate(&env())), "sandboxd.pools[0].wram");
    assert_eq!(i.source, Source::File { path: p.clone() });
    assert!(i.fix.contains("warm"), "lists the known keys: {i}");
    f.write("esp/chrysalis/config.toml", "");
    let p2 = f.write("disk/config.toml", "[supervisor]\nstate_directory = \"/x\"\n");
    let i = only_issue(load(&f.paths()).and_then(|l| l.validate(&env())), "supervisor.state_directory");
    assert_eq!(i.source, Source::File { path: p2 });
    std::fs::remove_file(f.dir.path().join("disk/config.toml")).unwrap();
    f.write("esp/chrysalis/config.toml", "[clustre]\n");
    let i = only_issue(load(&f.paths()).and_then(|l| l.validate(&env())), "clustre");
    assert_eq!(i.source, Source::File { path: p });
}

#[test]
fn wrong_types_and_missing_keys() {
    let i = only_issue(check("[sandboxd]\nenabled = \"yes\"\n"), "sandboxd.enabled");
    assert!(i.problem.contains("invalid type"), "{i}");
    let i = only_issue(
        check("[cluster]\nendpoint = \"https://a:1\"\nca_cert_hashes = []\n"),
        "cluster.bootstrap_token_file",
    );
    assert!(i.problem.contains("required"), "{i}");
    assert!(matches!(i.source, Source::File { .. }), "{i:?}");
    only_issue(check("[update]\noffline = \"panic\"\n"), "update.offline");
}

#[test]
fn syntax_errors_name_the_file() {
    let f = Fixture::new();
    let p = f.write("esp/chrysalis/config.toml", "[sandboxd\n");
    let e = load(&f.paths()).unwrap_err();
    assert!(matches!(&e, ConfigError::Syntax { path, .. } if *path == p), "{e:?}");
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn unreadable_layer_is_an_error_missing_is_not() {
    let f = Fixture::new();
    std::fs::create_dir_all(f.dir.path().join("esp/chrysalis/config.toml")).unwrap(); // a directory: EISDIR
    assert!(matches!(load(&f.paths()), Err(ConfigError::Read { .. })));
    assert!(matches!(load_files(&[f.dir.path().join("nope.toml")]), Err(ConfigError::Read { .. })));
}

#[test]
fn ca_hash_rule_prints_the_documented_message() {
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis").replace(HASH, "sha256:zz");
    let p = f.write("esp/chrysalis/config.toml", &cluster);
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.ca_cert_hashes[0]");
    assert_eq!(
        i.to_string(),
        format!(
            "cluster.ca_cert_hashes[0] in {}: \"sha256:zz\" is not sha256:<64 hex>; copy the value printed by kubeadm token create --print-join-command",
            p.display()
        )
    );
    let cluster = f.cluster("esp/chrysalis").replace(&format!("[\"{HASH}\"]"), "[]");
    f.write("esp/chrysalis/config.toml", &cluster);
    only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.ca_cert_hashes");
}

#[test]
fn endpoint_rule() {
    for (ep, ok) in [
        ("https://10.0.2.100:16443", true),
        ("https://k8s.example.com", true),
        ("https://[fd00::1]:6443", true),
        ("https://k8s:6443/", true),
        ("http://10.0.2.100:6443", false),
        ("https://", false),
        ("https://host:0", false),
        ("https://host:port", false),
        ("https://host:6443/api", false),
        ("https://[fd00::1", false),
    ] {
        assert_eq!(check_endpoint(ep).is_ok(), ok, "{ep}");
    }
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis").replace("https://10.0.2.100:16443", "10.0.2.100:16443");
    f.write("esp/chrysalis/config.toml", &cluster);
    only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.endpoint");
}

#[test]
fn bootstrap_token_file_must_exist_and_hold_a_token() {
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis");
    f.write("esp/chrysalis/config.toml", &cluster);
    f.write("esp/chrysalis/bootstrap-token", "not-a-token\n");
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.bootstrap_token_file");
    assert!(
        i.problem.contains("abcdef.0123456789abcdef") && !i.problem.contains("not-a-token"),
        "never echo the secret: {i}"
    );
    f.write("esp/chrysalis/bootstrap-token", "\n");
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.bootstrap_token_file");
    assert!(i.problem.contains("empty"), "{i}");
    std::fs::remove_file(f.dir.path().join("esp/chrysalis/bootstrap-token")).unwrap();
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.bootstrap_token_file");
    assert!(i.problem.contains("cannot be read"), "{i}");
    // Without file checks (e.g. checking a config for another box), only the shape is checked.
    load(&f.paths()).unwrap().validate(&ValidateEnv { check_files: false, ..env() }).unwrap();
    // The shape is join's: what the configuration accepts, the virtual nodes' join accepts.
    for bad in ["ABCDEF.0123456789abcdef", "abcdef0123456789abcdef"] {
        f.write("esp/chrysalis/bootstrap-token", &format!("{bad}\n"));
        only_issue(load(&f.paths()).unwrap().validate(&env()), "cluster.bootstrap_token_file");
    }
}

#[test]
fn listen_addresses_and_paths() {
    only_issue(check("[sandboxd]\nlisten = \":7777\"\n"), "sandboxd.listen");
    only_issue(check("[supervisor]\nmetrics_listen = \"localhost:9100\"\n"), "supervisor.metrics_listen");
    only_issue(check("[supervisor]\nstate_dir = \"var/lib\"\n"), "supervisor.state_dir");
    only_issue(check("[supervisor]\napi_socket = \"api.sock\"\n"), "supervisor.api_socket");
    only_issue(check("[sandboxd]\ncatalog = \"catalog.json\"\n"), "sandboxd.catalog");
}

#[test]
fn remote_api_needs_a_token_file() {
    let i = only_issue(check("[supervisor]\napi_listen = \"0.0.0.0:7780\"\n"), "supervisor.api_listen");
    assert!(i.fix.contains("api_token_file"), "{i}");
    let f = Fixture::new();
    f.write("esp/chrysalis/config.toml", "[supervisor]\napi_listen = \"0.0.0.0:7780\"\napi_token_file = \"tok\"\n");
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "supervisor.api_token_file");
    assert!(i.problem.contains(&f.dir.path().join("esp/chrysalis/tok").display().to_string()), "{i}");
    f.write("esp/chrysalis/tok", "secret\n");
    load(&f.paths()).unwrap().validate(&env()).unwrap();
}

#[test]
fn pool_rules() {
    let i = only_issue(check("[[sandboxd.pools]]\ntemplate = \"-bad\"\n"), "sandboxd.pools[0].template");
    assert!(i.fix.contains("base"), "{i}");
    only_issue(check("[[sandboxd.pools]]\ntemplate = \"base\"\nsize = \"huge\"\n"), "sandboxd.pools[0].size");
    let i = only_issue(check("[[sandboxd.pools]]\ntemplate = \"base\"\nnet = \"egress\"\n"), "sandboxd.pools[0].net");
    assert!(i.problem.contains("sandboxd.vm_uplink") && i.fix.contains("sandboxd.vm_uplink"), "{i}");
    let s =
        check("[sandboxd]\nvm_uplink = \"eno1\"\n[[sandboxd.pools]]\ntemplate = \"base\"\nnet = \"egress\"\n").unwrap();
    assert_eq!(s.config.sandboxd.pools[0].net, "egress");
    only_issue(check("[[sandboxd.pools]]\ntemplate = \"base\"\nnet = \"wifi\"\n"), "sandboxd.pools[0].net");
    only_issue(
        check("[[sandboxd.pools]]\ntemplate = \"base\"\n[[sandboxd.pools]]\ntemplate = \"base\"\nsize = \"small\"\n"),
        "sandboxd.pools[1]",
    );
    only_issue(check("[[sandboxd.pools]]\ntemplate = \"base\"\nwarm = -1\n"), "sandboxd.pools[0].warm");
    let s =
        check("[[sandboxd.pools]]\ntemplate = \"base\"\n[[sandboxd.pools]]\ntemplate = \"base\"\nsize = \"large\"\n")
            .unwrap();
    assert_eq!(s.config.sandboxd.pools[1].size, "large");
}

#[test]
fn sandboxd_vm_network_keys() {
    // None set: no network section.
    assert_eq!(check("").unwrap().sandboxd_network, None);
    // Set: the section, with sandboxd's bridge and range unless given.
    let s = check("[sandboxd]\nvm_uplink = \"eno1\"\nvm_refuse = [\"203.0.113.0/24\", \"198.51.100.7\"]\n").unwrap();
    let n = s.sandboxd_network.unwrap();
    assert_eq!((n.bridge.as_str(), n.cidr.to_string()), (SANDBOXD_VM_BRIDGE, SANDBOXD_VM_CIDR.to_string()));
    assert_eq!(n.uplink.as_deref(), Some("eno1"));
    assert_eq!(n.refuse, ["203.0.113.0/24", "198.51.100.7"]);
    let n = check("[sandboxd]\nvm_bridge = \"sbx0\"\nvm_cidr = \"10.90.0.0/16\"\n").unwrap().sandboxd_network.unwrap();
    assert_eq!((n.bridge.as_str(), n.cidr.to_string(), n.uplink), ("sbx0", "10.90.0.0/16".to_string(), None));

    for (key, bad, problem, fix) in [
        ("vm_uplink", "\"a/b\"", "a/b", "interface"),
        ("vm_uplink", "\"\"", "", "interface"),
        ("vm_uplink", "\"sb-x\"", "sb-", "interface"),
        ("vm_refuse", "[\"example.com\"]", "example.com", "a.b.c.d/len"),
        ("vm_bridge", "\"a-bridge-name-too-long\"", "not an interface name", "chrysalis1"),
        ("vm_cidr", "\"10.89.0.0\"", "not an IPv4 range", "10.89.0.0/24"),
        ("vm_cidr", "\"10.89.0.5/24\"", "did you mean 10.89.0.0/24", "no host bits"),
        ("vm_cidr", "\"10.89.0.0/31\"", "too small", "/30 or larger"),
    ] {
        let i = only_issue(check(&format!("[sandboxd]\n{key} = {bad}\n")), &format!("sandboxd.{key}"));
        assert!(i.problem.contains(problem) && i.fix.contains(fix), "{key} = {bad}: {i}");
    }

    // Apart from vk-cocoon's chrysalis0 / 10.88.0.0/24 when it runs.
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis");
    let with = |sandboxd: &str, rest: &str| {
        f.write("esp/chrysalis/config.toml", &format!("{cluster}[sandboxd]\n{sandboxd}{rest}"));
        load(&f.paths()).unwrap().validate(&env())
    };
    let i = only_issue(with("vm_bridge = \"chrysalis0\"\n", ""), "sandboxd.vm_bridge");
    assert!(i.problem.contains("vk_cocoon.enabled") && i.fix.contains("vk_cocoon.enabled = false"), "{i}");
    assert!(i.fix.contains("chrysalis1"), "{i}");
    for cidr in ["10.88.0.0/24", "10.88.0.128/25", "10.0.0.0/8"] {
        let i = only_issue(with(&format!("vm_cidr = \"{cidr}\"\n"), ""), "sandboxd.vm_cidr");
        assert!(i.problem.contains("10.88.0.0/24") && i.problem.contains("vk_cocoon.enabled"), "{i}");
        assert!(i.fix.contains("vk_cocoon.enabled = false"), "{i}");
    }
    let v = issues(with("vm_bridge = \"chrysalis0\"\nvm_cidr = \"10.88.0.0/16\"\n", ""));
    let keys: Vec<&str> = v.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["sandboxd.vm_bridge", "sandboxd.vm_cidr"]);
    // The defaults and a neighbouring range are apart; without vk-cocoon anything goes.
    let s = with("vm_uplink = \"eno1\"\n", "").unwrap();
    assert!(s.vk_cocoon && s.sandboxd_network.is_some());
    with("vm_cidr = \"10.88.1.0/24\"\n", "").unwrap();
    with("vm_bridge = \"chrysalis0\"\nvm_cidr = \"10.88.0.0/24\"\n", "[vk_cocoon]\nenabled = false\n").unwrap();
}

#[test]
fn sandboxd_numbers() {
    only_issue(check("[sandboxd]\nrefill_concurrency = 257\n"), "sandboxd.refill_concurrency");
    only_issue(check("[sandboxd]\nboot_timeout_secs = 0\n"), "sandboxd.boot_timeout_secs");
    only_issue(check("[update]\nhealth_deadline_secs = 0\n"), "update.health_deadline_secs");
}

#[test]
fn virtual_nodes_need_a_cluster_and_sandboxd() {
    let i = only_issue(check("[vk_sandbox]\nenabled = true\n"), "vk_sandbox.enabled");
    assert!(i.fix.contains("[cluster]"), "{i}");
    only_issue(check("[vk_cocoon]\nenabled = true\n"), "vk_cocoon.enabled");
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis");
    f.write("esp/chrysalis/config.toml", &format!("[sandboxd]\nenabled = false\n{cluster}"));
    only_issue(load(&f.paths()).unwrap().validate(&env()), "vk_sandbox.enabled");
    f.write(
        "esp/chrysalis/config.toml",
        &format!("[sandboxd]\nenabled = false\n[vk_sandbox]\nenabled = false\n{cluster}"),
    );
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    assert!(!s.vk_sandbox && s.vk_cocoon);
}

#[test]
fn node_names_default_from_the_hostname_and_are_checked() {
    let f = Fixture::new();
    let cluster = f.cluster("esp/chrysalis");
    f.write("esp/chrysalis/config.toml", &cluster);
    let odd = ValidateEnv { hostname: "Edge_1".into(), check_files: true };
    let v = issues(load(&f.paths()).unwrap().validate(&odd));
    let keys: Vec<&str> = v.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["vk_sandbox.node_name", "vk_cocoon.node_name"]);
    assert!(v[0].problem.contains("\"edge_1-sandbox\" (derived from the hostname \"edge_1\")"), "{}", v[0]);
    f.write(
        "esp/chrysalis/config.toml",
        &format!("{cluster}[vk_sandbox]\nnode_name = \"a\"\n[vk_cocoon]\nnode_name = \"a\"\n"),
    );
    only_issue(load(&f.paths()).unwrap().validate(&env()), "vk_cocoon.node_name");
    f.write("esp/chrysalis/config.toml", &format!("{cluster}[vk_cocoon]\npool = \"-x\"\n"));
    only_issue(load(&f.paths()).unwrap().validate(&env()), "vk_cocoon.pool");
    for bad in ["[[\"team-a\"]]", "[[\"a\", \"a\"]]", "[[\"a\", \"Team_B\"]]"] {
        f.write("esp/chrysalis/config.toml", &format!("{cluster}[vk_cocoon]\nshared_namespaces = {bad}\n"));
        let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "vk_cocoon.shared_namespaces");
        assert!(i.fix.contains("golden"), "{i}");
    }
    f.write("esp/chrysalis/config.toml", &format!("{cluster}[vk_cocoon]\nlegacy_namespace = \"Default\"\n"));
    only_issue(load(&f.paths()).unwrap().validate(&env()), "vk_cocoon.legacy_namespace");
    f.write(
        "esp/chrysalis/config.toml",
        &format!(
            "{cluster}[vk_cocoon]\nshared_namespaces = [[\"golden\", \"team-a\"]]\nlegacy_namespace = \"agents\"\n"
        ),
    );
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    assert_eq!(s.config.vk_cocoon.shared_namespaces_env().as_deref(), Some("golden,team-a"));
    for (key, bad, fix) in [
        ("vm_host_allow", "[\"53\"]", "tcp/PORT"),
        ("vm_host_allow", "[\"tcp/0\"]", "tcp/PORT"),
        ("vm_uplink", "\"a/b\"", "interface"),
        ("vm_refuse", "[\"example.com\"]", "a.b.c.d/len"),
    ] {
        f.write("esp/chrysalis/config.toml", &format!("{cluster}[vk_cocoon]\n{key} = {bad}\n"));
        let i = only_issue(load(&f.paths()).unwrap().validate(&env()), &format!("vk_cocoon.{key}"));
        assert!(i.fix.contains(fix), "{i}");
    }
    f.write(
        "esp/chrysalis/config.toml",
        &format!(
            "{cluster}[vk_cocoon]\nvm_host_allow = [\"udp/53\"]\nvm_uplink = \"eno1\"\nvm_refuse = [\"203.0.113.0/24\"]\n"
        ),
    );
    let s = load(&f.paths()).unwrap().validate(&env()).unwrap();
    assert_eq!(s.config.vk_cocoon.vm_uplink.as_deref(), Some("eno1"));
    assert!(
        images::valid_namespace("team-a")
            && !images::valid_namespace("a.b")
            && !images::valid_namespace(&"a".repeat(64))
    );
    assert!(valid_node_name("edge-1.example") && !valid_node_name("Edge") && !valid_node_name("a..b"));
    assert!(!valid_node_name(&"a".repeat(64)));
}

#[test]
fn all_problems_are_reported_at_once() {
    let v = issues(check("[sandboxd]\nlisten = \"x\"\nboot_timeout_secs = 0\n[update]\nhealth_deadline_secs = 0\n"));
    let keys: Vec<&str> = v.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["sandboxd.listen", "sandboxd.boot_timeout_secs", "update.health_deadline_secs"]);
    let e = ConfigError::Invalid(v);
    assert!(e.to_string().starts_with("3 configuration errors:\n  sandboxd.listen in "), "{e}");
}

#[test]
fn metrics_beyond_loopback_need_their_own_token() {
    let i = only_issue(check("[supervisor]\nmetrics_listen = \"0.0.0.0:9100\"\n"), "supervisor.metrics_listen");
    assert!(i.fix.contains("metrics_token_file"), "{i}");
    check("[supervisor]\nmetrics_listen = \"127.0.0.1:9100\"\n").unwrap();
    check("[supervisor]\nmetrics_listen = \"0.0.0.0:9100\"\nmetrics_token_file = \"/m\"\n").unwrap();
    let f = Fixture::new();
    f.write(
        "esp/chrysalis/config.toml",
        "[supervisor]\nmetrics_listen = \"0.0.0.0:9100\"\nmetrics_token_file = \"m\"\n",
    );
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "supervisor.metrics_token_file");
    assert!(i.problem.contains("cannot be read"), "{i}");
}

#[test]
fn tls_pairs_come_whole_and_must_load() {
    let i = only_issue(check("[supervisor]\ntls_cert_file = \"/c\"\n"), "supervisor.tls_cert_file");
    assert!(i.problem.contains("without supervisor.tls_key_file"), "{i}");
    let i = only_issue(check("[sandboxd]\ntls_key_file = \"/k\"\n"), "sandboxd.tls_key_file");
    assert!(i.fix.contains("sandboxd.tls_cert_file"), "{i}");
    check("[supervisor]\ntls_cert_file = \"/c\"\ntls_key_file = \"/k\"\n").unwrap();
    // With file checks: a pair that does not load names the key.
    let f = Fixture::new();
    let (c, k) = (f.dir.path().join("esp/chrysalis/box.crt"), f.dir.path().join("esp/chrysalis/box.key"));
    std::fs::create_dir_all(c.parent().unwrap()).unwrap();
    httpd::tls::ensure_self_signed(&c, &k, &["box".into()]).unwrap();
    f.write("esp/chrysalis/config.toml", "[supervisor]\ntls_cert_file = \"box.crt\"\ntls_key_file = \"box.key\"\n");
    load(&f.paths()).unwrap().validate(&env()).unwrap();
    f.write("esp/chrysalis/box.key", "not a key\n");
    let i = only_issue(load(&f.paths()).unwrap().validate(&env()), "supervisor.tls_cert_file");
    assert!(i.problem.contains("not a usable certificate and key"), "{i}");
}

#[test]
fn tls_names_and_budgets() {
    check("[supervisor]\ntls_names = [\"box1.example.com\", \"10.0.0.5\", \"::1\", \"*.edge.example\"]\n").unwrap();
    only_issue(check("[supervisor]\ntls_names = [\"ok\", \"not a name\"]\n"), "supervisor.tls_names[1]");
    only_issue(check("[supervisor]\ntls_names = [\"-bad.example\"]\n"), "supervisor.tls_names[0]");
    for k in ["max_vms", "max_memory_mib", "max_disk_mib", "max_lifetime_secs"] {
        only_issue(check(&format!("[sandboxd]\n{k} = 0\n")), &format!("sandboxd.{k}"));
    }
    let s = check("[sandboxd]\nmax_vms = 4\nmax_memory_mib = 8192\nmax_disk_mib = 9000\nmax_lifetime_secs = 3600\n")
        .unwrap();
    let sb = &s.config.sandboxd;
    assert_eq!(
        (sb.max_vms, sb.max_memory_mib, sb.max_disk_mib, sb.max_lifetime_secs),
        (Some(4), Some(8192), Some(9000), Some(3600))
    );
}

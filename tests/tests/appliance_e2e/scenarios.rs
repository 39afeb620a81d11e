//! The appliance scenarios and the boxes they share (see the suite's doc).
//!
//! Box 1 lives through the first six scenarios in order: first boot (join, both nodes Ready,
//! secure by default: sandboxd's minted token and the minted certificate, the seed's sandboxd
//! example), a tampered bundle refused, a bundle that never becomes healthy rolled back to A by
//! itself, a good bundle committed on B (raising the security floor, same certificate after the
//! upgrade), the first version's bundle replayed and refused as a downgrade (no reboot), then a
//! clean power-off and a walk of its state partition read off the disk (every secret 0600 in a
//! 0700 directory). Box 2 is a fresh disk for the power cut in the middle of writing the
//! inactive slot.
//!
//! The host trusts a box the way an operator does: it reads the certificate's SHA-256
//! fingerprint off the box's console (the out-of-band channel) and pins it for every HTTPS call,
//! to the supervisor API and to sandboxd.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use supervisor::client::{Client, ClientError};
use supervisor::http::{self as sup_http, Endpoint};
use supervisor::update::{UpdateState, UpdateStatus};
use test_infra::appliance_vm::{ApplianceVm, JoinedBox, Options as VmOptions};
use test_infra::cluster::{Cluster, Options as ClusterOptions, APPLIANCE_API_ADDR};
use test_infra::ensure;
use test_infra::suite::{poll, poll_every, Outcome};

/// The apiserver port of this suite's cluster (others: 16443 xtask, 25443 supervisor_e2e, 26443
/// cluster_e2e, 27443 join, 28443 vnode, 29443 vk_sandbox_e2e, 31443 vk_cocoon_e2e). Each suite's
/// seven ports stay below the kernel's ephemeral range (32768 and up): the suites run side by
/// side, and an ephemeral port taken by a client would make a cluster fail to start.
const PORT: u16 = 23443;
/// Node names the boxes register (each box: its own pair).
const SANDBOX_NODE: &str = "box-sandbox";
const COCOON_NODE: &str = "box-cocoon";
/// Power-on → supervisor API answering, under TCG with OVMF.
const BOOT: Duration = Duration::from_secs(600);
/// Supervisor answering → nodes Ready and the pool (one `base` VM under nested TCG) warm.
const HEALTHY: Duration = Duration::from_secs(900);
/// The trial's health deadline in the box's config: long enough for a healthy trial boot under
/// nested TCG, short enough that the failing bundle reverts in reasonable time.
const HEALTH_DEADLINE_SECS: u64 = 900;
/// The deadline the never-healthy bundle sets on its kernel command line
/// (`chrysalis.set=update.health_deadline_secs=150`, made by `cargo xtask test`).
const NEVER_HEALTHY_DEADLINE: Duration = Duration::from_secs(150);
/// The API token of the boxes' remote API (forwarded to a loopback port).
const API_TOKEN: &str = "appliance-e2e-api-token";
/// A clean power-off (ACPI, systemd stopping everything) under TCG.
const POWER_OFF: Duration = Duration::from_secs(180);

/// The built image and its bundles (`cargo xtask test` builds them first; see the suite doc).
struct Built {
    disk: PathBuf,
    good: PathBuf,
    never_healthy: PathBuf,
    /// The first version's bundle: one security_version below `good`.
    old: PathBuf,
}

fn built() -> Result<Built, String> {
    let dir = std::env::var_os("CHRYSALIS_APPLIANCE_TEST_DIR")
        .map(PathBuf::from)
        .ok_or("CHRYSALIS_APPLIANCE_TEST_DIR is not set (cargo xtask test builds the image and bundles and sets it)")?;
    let b = Built {
        disk: dir.join("disk.raw"),
        good: dir.join("good.chrysalis-bundle"),
        never_healthy: dir.join("never-healthy.chrysalis-bundle"),
        old: dir.join("old.chrysalis-bundle"),
    };
    for p in [&b.disk, &b.good, &b.never_healthy, &b.old] {
        ensure!(p.is_file(), "{} is missing", p.display());
    }
    Ok(b)
}

/// One appliance machine and a client for its remote API.
struct Box {
    vm: ApplianceVm,
    opts: VmOptions,
    /// Its certificate's fingerprint, read off its console at first boot.
    fingerprint: String,
    client: Client,
}

pub struct Env {
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
    dir: PathBuf,
    cluster: Cluster,
    cluster_opts: ClusterOptions,
    built: Built,
    box1: Option<Box>,
}

static ENV: Mutex<Option<Env>> = Mutex::new(None);

fn env_up() -> Result<Env, String> {
    let built = built()?;
    let guard = tempfile::Builder::new().prefix("appl").tempdir_in("/tmp").map_err(|e| e.to_string())?;
    let dir = guard.path().to_path_buf();
    let cluster_opts = ClusterOptions { state_dir: dir.join("cluster"), port: PORT, ..ClusterOptions::default() };
    let cluster = Cluster::up_with(&cluster_opts).map_err(|e| format!("cluster up: {e}"))?;
    for (provider, node) in [("vk-sandbox", SANDBOX_NODE), ("vk-cocoon", COCOON_NODE)] {
        cluster.bind_node(provider, node).map_err(|e| format!("binding {node}'s RBAC: {e}"))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Env { rt, _dir: guard, dir, cluster, cluster_opts, built, box1: None })
}

/// Runs one scenario, bringing the environment up on first use.
pub fn run(name: &str) -> Result<(), String> {
    let mut guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        *guard = Some(env_up()?);
    }
    let Some(env) = guard.as_mut() else { return Err("no environment".into()) };
    let result = match name {
        "first_boot_joins_the_cluster_and_serves_the_seed_sandbox" => first_boot(env),
        "a_tampered_bundle_is_refused" => tampered(env),
        "a_bundle_that_never_becomes_healthy_rolls_back_to_a" => never_healthy(env),
        "upgrade_a_to_b_commits_and_keeps_the_node_identities" => upgrade(env),
        "a_lower_security_version_replayed_after_the_upgrade_is_refused" => downgrade(env),
        "every_secret_on_the_state_partition_is_0600_in_a_0700_dir" => secrets_at_rest(env),
        "a_power_cut_while_writing_the_inactive_slot_leaves_a_booting" => power_cut(env),
        other => Err(format!("unknown scenario {other}")),
    };
    result.map_err(|e| {
        let tail = env.box1.as_ref().map(|b| test_infra::tail(&b.vm.console_text(), 60)).unwrap_or_default();
        format!("{e}\n---- box console (last lines) ----\n{tail}")
    })
}

/// Stops every box and the cluster.
pub fn teardown() -> Result<(), String> {
    let mut guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(mut env) = guard.take() {
        if let Some(mut b) = env.box1.take() {
            let _ = b.vm.kill();
        }
        Cluster::down_with(&env.cluster_opts).map_err(|e| format!("cluster down: {e}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Boxes

impl Env {
    /// The config disk of a box (see [`JoinedBox`]).
    fn config_files(&self) -> BTreeMap<String, Vec<u8>> {
        JoinedBox {
            endpoint: format!("https://{APPLIANCE_API_ADDR}:{PORT}"),
            ca_hash: &self.cluster.ca_hash,
            bootstrap_token: &self.cluster.token,
            sandbox_node: SANDBOX_NODE,
            cocoon_node: COCOON_NODE,
            api_token: API_TOKEN,
            health_deadline_secs: HEALTH_DEADLINE_SECS,
        }
        .config_files()
    }

    /// Powers on a fresh box (a new overlay on the built disk) and waits for its supervisor to
    /// print the fingerprint of the certificate it minted.
    fn new_box(&self, name: &str) -> Result<Box, String> {
        let mut opts = VmOptions::new(&self.built.disk, self.dir.join(name));
        opts.config_files = Some(self.config_files());
        opts.guest_forward_port = Some(PORT);
        let mut vm = ApplianceVm::start(&opts).map_err(|e| format!("starting {name}: {e:#}"))?;
        eprintln!("appliance_e2e: {name} runs under {} (console {})", vm.accel, vm.console.display());
        let fingerprint = vm.wait_for_fingerprint(BOOT).map_err(|e| format!("{name}'s fingerprint: {e:#}"))?;
        eprintln!("appliance_e2e: {name}'s certificate: SHA-256 {fingerprint} (from its console)");
        let client = client_for(&vm, &fingerprint)?;
        Ok(Box { vm, opts, fingerprint, client })
    }

    fn box1(&mut self) -> Result<&mut Box, String> {
        if self.box1.is_none() {
            self.box1 = Some(self.new_box("box1")?);
        }
        self.box1.as_mut().ok_or_else(|| "no box".to_string())
    }

    fn kubectl_json(&self, args: &[&str]) -> Result<Value, String> {
        let out = self.cluster.kubectl().args(args).args(["-o", "json"]).output().map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    }

    fn kubectl_ok(&self, args: &[&str]) -> Result<String, String> {
        let out = self.cluster.kubectl().args(args).output().map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Both virtual nodes Ready in the cluster.
    fn wait_nodes_ready(&self, within: Duration) -> Result<(), String> {
        for node in [SANDBOX_NODE, COCOON_NODE] {
            poll(&format!("node {node} Ready"), within, || {
                let Ok(n) = self.kubectl_json(&["get", "node", node]) else { return Ok(None) };
                let ready = n["status"]["conditions"]
                    .as_array()
                    .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"));
                Ok(ready.then_some(()))
            })?;
        }
        Ok(())
    }
}

/// A TLS client configuration pinning `fingerprint`.
fn pinned(fingerprint: &str) -> Result<sup_http::TlsClient, String> {
    httpd::tls::client_config(&httpd::tls::Trust::Fingerprint(fingerprint.into()), httpd::tls::ALPN_HTTP1)
        .map_err(|e| format!("pinning {fingerprint}: {e}"))
}

/// The remote API over HTTPS, the box's certificate pinned.
fn client_for(vm: &ApplianceVm, fingerprint: &str) -> Result<Client, String> {
    let endpoint: Endpoint =
        format!("https://127.0.0.1:{}", vm.api_port).parse().map_err(|e| format!("API endpoint: {e}"))?;
    Ok(Client::new(endpoint, Some(API_TOKEN.to_string())).with_tls(pinned(fingerprint)?))
}

/// One request to the box's sandboxd (forwarded port) over HTTPS with the fingerprint pinned.
fn sandboxd_get(
    rt: &tokio::runtime::Runtime,
    vm: &ApplianceVm,
    fingerprint: &str,
    path: &str,
    token: Option<&str>,
) -> Result<sup_http::Response, String> {
    let ep = Endpoint::Https(format!("127.0.0.1:{}", vm.sandboxd_port));
    let tls = pinned(fingerprint)?;
    rt.block_on(sup_http::send(
        &ep,
        Some(&tls),
        hyper::Method::GET,
        path,
        token,
        sup_http::empty(),
        Duration::from_secs(10),
    ))
    .map_err(|e| supervisor::error_chain(&e))
}

/// Runs the `chrysalis` binary (built beside this suite) with `args`.
fn chrysalis(args: &[&str]) -> Result<std::process::Output, String> {
    let bin = test_infra::suite::sibling_bin("chrysalis").map_err(|e| e.to_string())?;
    std::process::Command::new(bin).args(args).env_remove("CHRYSALIS_API").output().map_err(|e| e.to_string())
}

impl Box {
    /// Waits for the supervisor API to answer after a (re)boot and returns the update status.
    fn wait_api(&self, rt: &tokio::runtime::Runtime, within: Duration) -> Result<UpdateStatus, String> {
        poll("the supervisor API", within, || Ok(rt.block_on(self.client.update_status()).ok()))
    }

    /// Polls the update status every 3 s until `want` holds; `what` names the wait, and the
    /// timeout error carries the last status read.
    fn wait_status(
        &self,
        rt: &tokio::runtime::Runtime,
        what: &str,
        within: Duration,
        want: impl Fn(&UpdateStatus) -> bool,
    ) -> Result<UpdateStatus, String> {
        poll_every(what, within, Duration::from_secs(3), || match rt.block_on(self.client.update_status()) {
            Ok(s) if want(&s) => Ok(Some(s)),
            Ok(s) => Err(format!("; last status {s:?}")),
            Err(_) => Ok(None),
        })
    }

    /// Waits until the running slot is `slot`, committed, and nothing is being applied or armed:
    /// `confirmed`, or `failed` after a refused bundle (a refusal changes nothing on the box, so
    /// the next apply is allowed).
    fn wait_settled(&self, rt: &tokio::runtime::Runtime, slot: &str, within: Duration) -> Result<UpdateStatus, String> {
        self.wait_status(rt, &format!("slot {slot} committed and idle"), within, |s| {
            s.slot.as_deref() == Some(slot)
                && s.detail["confirmed"] == Value::Bool(true)
                && matches!(s.state, UpdateState::Confirmed | UpdateState::Failed)
        })
    }

    /// Waits until the running slot is `slot` and in `state`.
    fn wait_slot(
        &self,
        rt: &tokio::runtime::Runtime,
        slot: &str,
        state: UpdateState,
        within: Duration,
    ) -> Result<UpdateStatus, String> {
        self.wait_status(rt, &format!("slot {slot} in state {}", state.as_str()), within, |s| {
            s.slot.as_deref() == Some(slot) && s.state == state
        })
    }

    fn apply(&self, rt: &tokio::runtime::Runtime, bundle: &Path) -> Result<supervisor::update::UpdateOutcome, String> {
        rt.block_on(self.client.update_apply(bundle)).map_err(|e| format!("{e}"))
    }

    fn reboot(&self, rt: &tokio::runtime::Runtime) -> Result<(), String> {
        // The connection may drop while the box goes down.
        let _ = rt.block_on(self.client.reboot());
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios

fn first_boot(env: &mut Env) -> Outcome {
    env.box1()?;
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("no box")?;
    b.wait_api(rt, BOOT)?;
    let st = b.wait_slot(rt, "a", UpdateState::Confirmed, BOOT)?;
    ensure!(st.generation == Some(1), "a fresh image runs generation 1, got {:?}", st.generation);
    // The supervisor reports ready, then both nodes join and turn Ready.
    poll("the supervisor ready", HEALTHY, || {
        Ok(rt.block_on(b.client.status()).ok().filter(|s| s.health.ready).map(|_| ()))
    })?;
    env.wait_nodes_ready(HEALTHY)?;
    secure_by_default(env)?;
    // The seed's sandboxd example, verbatim, runs on the box's vk-sandbox node.
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("seed/examples/sandboxd-example.yaml");
    env.kubectl_ok(&["apply", "-f", &seed.display().to_string()])?;
    let pod = poll("the seed's Pod Running on the box", HEALTHY, || {
        let Ok(p) = env.kubectl_json(&["get", "pod", "sandboxd-example"]) else { return Ok(None) };
        Ok((p["status"]["phase"] == "Running").then_some(p))
    })?;
    ensure!(pod["spec"]["nodeName"] == SANDBOX_NODE, "the Pod landed on {}", pod["spec"]["nodeName"]);
    ensure!(
        pod["metadata"]["annotations"]["sandbox.cocoonstack.io/claim-id"].as_str().is_some_and(|c| !c.is_empty()),
        "no claim-id on the Pod: {}",
        pod["metadata"]["annotations"]
    );
    env.kubectl_ok(&["delete", "sandbox", "sandboxd-example", "--wait=false"])?;
    Ok(())
}

/// The first boot's security: the minted certificate (console fingerprint = `chrysalis status`),
/// sandboxd's minted root token through the remote API (401 without the API token), sandboxd
/// over HTTPS from the host (401 without its token, 200 with it, the pinned certificate), and no
/// plain HTTP on the network.
fn secure_by_default(env: &Env) -> Outcome {
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("no box")?;
    let fp = b.fingerprint.as_str();
    // `chrysalis status` over the remote API, pinned: the same fingerprint, minted, on both surfaces.
    let api_token = env.dir.join("api-token");
    std::fs::write(&api_token, format!("{API_TOKEN}\n")).map_err(|e| e.to_string())?;
    let https = format!("https://127.0.0.1:{}", b.vm.api_port);
    let tok = api_token.display().to_string();
    let remote = ["--api", https.as_str(), "--api-token-file", tok.as_str(), "--api-fingerprint", fp];
    let o = chrysalis(&[&["status", "--json"][..], &remote[..]].concat())?;
    ensure!(o.status.success(), "chrysalis status: {}", String::from_utf8_lossy(&o.stderr));
    let st: Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    let tls = st["tls"].as_array().cloned().unwrap_or_default();
    ensure!(tls.len() == 1 && tls[0]["fingerprint"] == fp && tls[0]["minted"] == true, "status tls: {}", st["tls"]);
    ensure!(tls[0]["surfaces"] == serde_json::json!(["api", "sandboxd"]), "served by: {}", tls[0]["surfaces"]);
    let o = chrysalis(&[&["status"][..], &remote[..]].concat())?;
    let human = String::from_utf8_lossy(&o.stdout);
    ensure!(human.contains(&format!("tls         SHA-256 {fp}")), "chrysalis status does not print it:\n{human}");
    // sandboxd's root token, minted on first boot, through the remote API.
    let o = chrysalis(&[&["token", "show", "sandboxd"][..], &remote[..]].concat())?;
    ensure!(o.status.success(), "chrysalis token show sandboxd: {}", String::from_utf8_lossy(&o.stderr));
    let token = String::from_utf8_lossy(&o.stdout).trim().to_string();
    ensure!(
        token.len() == 64 && token.bytes().all(|c| c.is_ascii_hexdigit()),
        "not a minted token: {} chars",
        token.len()
    );
    let anon = Client::new(format!("https://127.0.0.1:{}", b.vm.api_port).parse().map_err(|e| format!("{e}"))?, None)
        .with_tls(pinned(fp)?);
    match rt.block_on(anon.token("sandboxd")) {
        Err(ClientError::Api { status, .. }) if status == 401 => {}
        other => return Err(format!("the token route without the API token: {other:?}")),
    }
    let config = rt.block_on(b.client.config()).map_err(|e| e.to_string())?.to_string();
    ensure!(!config.contains(&token), "GET /v1/config shows sandboxd's token");
    // sandboxd from the host: HTTPS with the pinned certificate; 401 without the token, 200 with it.
    poll("sandboxd /healthz over HTTPS from the host", BOOT, || {
        Ok(sandboxd_get(rt, &b.vm, fp, "/healthz", None).ok().filter(|r| r.status.is_success()).map(|_| ()))
    })?;
    let r = sandboxd_get(rt, &b.vm, fp, "/v1/info", None)?;
    ensure!(r.status == 401, "GET /v1/info without the token: {}", r.status);
    let r = sandboxd_get(rt, &b.vm, fp, "/v1/info", Some("0".repeat(64).as_str()))?;
    ensure!(r.status == 401, "GET /v1/info with a wrong token: {}", r.status);
    let r = sandboxd_get(rt, &b.vm, fp, "/v1/info", Some(&token))?;
    ensure!(r.status == 200, "GET /v1/info with the minted token: {} {}", r.status, String::from_utf8_lossy(&r.body));
    // A certificate other than the pinned one is refused; plain HTTP gets no answer.
    let other = "00".repeat(32);
    ensure!(sandboxd_get(rt, &b.vm, &other, "/healthz", None).is_err(), "a wrong pin was accepted");
    let plain = rt.block_on(sup_http::send(
        &Endpoint::Tcp(format!("127.0.0.1:{}", b.vm.sandboxd_port)),
        None,
        hyper::Method::GET,
        "/healthz",
        None,
        sup_http::empty(),
        Duration::from_secs(10),
    ));
    ensure!(!plain.as_ref().is_ok_and(|r| r.status.is_success()), "sandboxd answered plain HTTP: {plain:?}");
    Ok(())
}

fn tampered(env: &mut Env) -> Outcome {
    let tampered = env.dir.join("tampered.chrysalis-bundle");
    std::fs::copy(&env.built.good, &tampered).map_err(|e| e.to_string())?;
    flip_byte_near_end(&tampered)?;
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("box1 did not boot (first scenario failed)")?;
    let before = b.wait_api(rt, BOOT)?;
    let err = match b.apply(rt, &tampered) {
        Ok(o) => return Err(format!("a tampered bundle was accepted: {o:?}")),
        Err(e) => e,
    };
    ensure!(
        err.contains("tamper") || err.contains("sha256") || err.contains("refused"),
        "refusal does not say why: {err}"
    );
    let after = b.wait_api(rt, BOOT)?;
    ensure!(
        after.slot == before.slot && after.state == UpdateState::Failed,
        "after the refused bundle the box should say `failed` on the same slot: {after:?}"
    );
    ensure!(
        after.message.as_deref().is_some_and(|m| m.contains("sha256")),
        "the status does not say why the bundle was refused: {after:?}"
    );
    ensure!(
        after.detail["other"]["state"] == "empty" && after.detail["confirmed"] == Value::Bool(true),
        "the refused bundle armed something or unconfirmed the running slot: {after:?}"
    );
    Ok(())
}

/// Flips one byte of the last member (the root image) of a bundle.
fn flip_byte_near_end(path: &Path) -> Outcome {
    let mut bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    // The tar ends with two zero blocks (and padding); flip a byte well inside the root image.
    let at = bytes.len().saturating_sub(64 * 1024);
    ensure!(at > 0, "bundle too small");
    bytes[at] ^= 0xff;
    std::fs::write(path, bytes).map_err(|e| e.to_string())
}

fn never_healthy(env: &mut Env) -> Outcome {
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("box1 did not boot (first scenario failed)")?;
    b.wait_settled(rt, "a", BOOT)?;
    let out = b.apply(rt, &env.built.never_healthy)?;
    ensure!(out.status.state == UpdateState::Armed, "after apply: {:?}", out.status);
    b.reboot(rt)?;
    // B boots on trial, never gets healthy, and the box goes back to A by itself.
    b.wait_slot(rt, "b", UpdateState::Trial, BOOT)?;
    let back = b.wait_slot(rt, "a", UpdateState::Confirmed, NEVER_HEALTHY_DEADLINE + BOOT * 2)?;
    ensure!(back.generation == Some(1), "back on A but generation {:?}", back.generation);
    let detail = back.detail.to_string();
    ensure!(detail.contains("bad") || detail.contains("fail"), "the failed trial is not reported: {detail}");
    Ok(())
}

fn upgrade(env: &mut Env) -> Outcome {
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("box1 did not boot (first scenario failed)")?;
    b.wait_settled(rt, "a", BOOT)?;
    let csrs_before = env.kubectl_json(&["get", "csr"])?["items"].as_array().map(Vec::len).unwrap_or(0);
    let out = b.apply(rt, &env.built.good)?;
    ensure!(out.status.state == UpdateState::Armed, "after apply: {:?}", out.status);
    let b = env.box1.as_mut().ok_or("no box")?;
    b.vm.mark_console();
    b.reboot(rt)?;
    // The certificate lives on the state partition: slot B serves the same one.
    let fp = b.vm.wait_for_fingerprint(BOOT).map_err(|e| format!("B's fingerprint: {e:#}"))?;
    ensure!(fp == b.fingerprint, "the upgrade changed the certificate: {fp} after, {} before", b.fingerprint);
    let b = env.box1.as_ref().ok_or("no box")?;
    b.wait_slot(rt, "b", UpdateState::Trial, BOOT)?;
    let st = b.wait_slot(rt, "b", UpdateState::Confirmed, Duration::from_secs(HEALTH_DEADLINE_SECS) + BOOT)?;
    ensure!(st.generation.is_some_and(|g| g >= 2), "committed B runs generation {:?}", st.generation);
    // The commit raised the security floor to B's level (A's + 1, see `cargo xtask test`).
    ensure!(
        st.security_version.is_some() && st.security_floor == st.security_version,
        "after committing B the floor should be B's security_version: {st:?}"
    );
    env.wait_nodes_ready(HEALTHY)?;
    // Credentials live on the state partition: the upgraded box needed no new certificate.
    let csrs_after = env.kubectl_json(&["get", "csr"])?["items"].as_array().map(Vec::len).unwrap_or(0);
    ensure!(csrs_after == csrs_before, "the upgrade re-bootstrapped: {csrs_before} CSRs before, {csrs_after} after");
    Ok(())
}

/// After the upgrade: the first version's bundle (one security_version below the floor B's
/// commit set) is refused before anything is written; the box keeps running committed B, same
/// generation, services healthy.
fn downgrade(env: &mut Env) -> Outcome {
    let rt = &env.rt;
    let b = env.box1.as_ref().ok_or("box1 did not boot (first scenario failed)")?;
    let before = b.wait_settled(rt, "b", BOOT)?;
    let floor = before.security_floor.ok_or_else(|| format!("no security floor recorded: {before:?}"))?;
    ensure!(floor >= 1, "floor {floor}: the upgrade should have raised it above the first version's");
    let (bundle_level, floor_text) = (format!("security_version {}", floor - 1), format!("floor {floor}"));
    match rt.block_on(b.client.update_apply(&env.built.old)) {
        Ok(o) => return Err(format!("a lower security_version was accepted: {o:?}")),
        Err(ClientError::Api { status, kind, message }) => ensure!(
            status.as_u16() == 422
                && kind == "downgrade_refused"
                && message.contains(&bundle_level)
                && message.contains(&floor_text),
            "the refusal is not a 422 downgrade_refused naming {bundle_level:?} and {floor_text:?}: \
             {status} {kind}: {message}"
        ),
        Err(e) => return Err(format!("applying the old bundle failed otherwise: {e}")),
    }
    let after = b.wait_api(rt, BOOT)?;
    ensure!(
        after.slot.as_deref() == Some("b") && after.state == UpdateState::Failed,
        "after the refused downgrade the box should say `failed` on B: {after:?}"
    );
    ensure!(
        after.message.as_deref().is_some_and(|m| m.contains(&bundle_level) && m.contains(&floor_text)),
        "update status does not say why the bundle was refused: {after:?}"
    );
    ensure!(
        after.generation == before.generation
            && after.security_floor == Some(floor)
            && after.detail["confirmed"] == Value::Bool(true),
        "the refusal changed the running slot or the floor: before {before:?}, after {after:?}"
    );
    ensure!(
        after.detail["other"] == before.detail["other"] && after.detail["other"]["state"] == "good",
        "the refusal touched slot A: before {}, after {}",
        before.detail["other"],
        after.detail["other"]
    );
    // The services never noticed: the supervisor is healthy and both nodes stay Ready.
    poll("the supervisor healthy after the refusal", HEALTHY, || {
        Ok(rt.block_on(b.client.status()).ok().filter(|s| s.health.healthy()).map(|_| ()))
    })?;
    env.wait_nodes_ready(HEALTHY)?;
    Ok(())
}

/// Box 1 powered off cleanly; its state partition read off its disk: every secret the box wrote
/// (the minted token and key, sandboxd's journal, vk-sandbox's claims, both nodes' credentials,
/// the service logs) is 0600 in a 0700 directory.
fn secrets_at_rest(env: &mut Env) -> Outcome {
    let b = env.box1.as_mut().ok_or("box1 did not boot (first scenario failed)")?;
    b.vm.power_off(POWER_OFF).map_err(|e| format!("power off: {e:#}"))?;
    let disk = b.vm.disk();
    let entries = test_infra::secrets::state_partition(&disk, "chrysalis-state", &env.dir.join("state-walk"))
        .map_err(|e| format!("reading the state partition: {e:#}"))?;
    let required = [
        "secrets/sandboxd-token",
        "tls/key.pem",
        "sandboxd/claims.json",
        "vk-sandbox/claims.json",
        "vk-sandbox/pki/kubeconfig",
        "vk-sandbox/pki/kubelet-client-current.pem",
        "vk-cocoon/pki/kubeconfig",
        "vk-cocoon/pki/kubelet-client-current.pem",
        "logs/sandboxd.log",
    ];
    let checked = test_infra::secrets::check(&entries, &required).map_err(|e| format!("{e:#}"))?;
    eprintln!("appliance_e2e: {} secrets on the state partition checked: {}", checked.len(), checked.join(", "));
    env.box1 = None;
    Ok(())
}

fn power_cut(env: &mut Env) -> Outcome {
    let mut b = env.new_box("box2")?;
    let rt = &env.rt;
    b.wait_slot(rt, "a", UpdateState::Confirmed, BOOT)?;
    // Start the apply on another thread and cut the power once the root image is being written.
    let bundle = env.built.good.clone();
    let client = client_for(&b.vm, &b.fingerprint)?;
    let handle = rt.handle().clone();
    let apply = std::thread::spawn(move || handle.block_on(client.update_apply(&bundle)).map_err(|e| e.to_string()));
    poll("the root image being written", BOOT, || {
        let s = rt.block_on(b.client.update_status()).ok();
        Ok(s.and_then(|s| s.progress).filter(|p| p.phase.contains("root") && p.done > 0).map(|_| ()))
    })?;
    b.vm.kill().map_err(|e| format!("power cut: {e:#}"))?;
    let _ = apply.join();
    // Power back on: the same disk, A boots, nothing is armed.
    b.opts.keep_disk = true;
    b.vm = ApplianceVm::start(&b.opts).map_err(|e| format!("power on: {e:#}"))?;
    let fp = b.vm.wait_for_fingerprint(BOOT).map_err(|e| format!("fingerprint after the power cut: {e:#}"))?;
    ensure!(fp == b.fingerprint, "the power cut changed the certificate: {fp}");
    b.client = client_for(&b.vm, &b.fingerprint)?;
    let st = b.wait_slot(rt, "a", UpdateState::Confirmed, BOOT)?;
    ensure!(st.generation == Some(1), "after the power cut: {st:?}");
    let detail = st.detail.to_string();
    ensure!(!detail.contains("armed"), "a half-written slot is armed: {detail}");
    let _ = b.vm.kill();
    Ok(())
}

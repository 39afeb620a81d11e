//! What the two virtual-node end-to-end suites (`vk_sandbox_e2e`, `vk_cocoon_e2e`) and the
//! environments behind them share.
//!
//! * [`Suite`] and [`main`]: a suite's scenarios, by name, and the custom harness that runs
//!   them (libtest-mimic). One environment serves every scenario, so the scenarios are reported
//!   one by one as ordinary tests and run one at a time; the environment is brought up by the
//!   first, each scenario gets a namespace of its own (`tNN-<name>`, emptied after it), and the
//!   environment is torn down once at the end (an error there fails the run). Without the
//!   `cluster` and `e2e` features every scenario is reported as ignored, the reason printed once.
//! * [`VirtualNode`]: what both environments are built around — the test control plane, the
//!   provider binary as a child process, and the kubectl helpers the scenarios use.
//! * [`Outcome`], [`ensure!`](crate::ensure), [`poll`], [`condition`], [`annotation`],
//!   [`sibling_bin`], [`toleration`], [`merged`]: what scenarios are written with.

use std::ops::DerefMut;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

use crate::cluster::{Cluster, Options};
use crate::provider_process::ProviderProcess;

/// What a scenario returns: `Err` carries the failure report.
pub type Outcome = Result<(), String>;

/// Fails the scenario (returns `Err(format!(…))`) unless `$cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(::std::format!($($fmt)+));
        }
    };
}

/// One scenario: runs against the suite's environment in the namespace it is given.
pub type Scenario<E> = fn(&mut E, &str) -> Outcome;

/// What a suite is made of.
pub struct SuiteSpec<E: 'static> {
    /// The test binary's name (it prefixes what the harness prints).
    pub name: &'static str,
    /// What the scenarios need besides the features (printed when they are skipped).
    pub needs: &'static str,
    /// Brings the environment up (for the first scenario).
    pub up: fn() -> Result<E, String>,
    /// Stops it after the last scenario; an error (what survived) fails the run.
    pub down: fn(E) -> Outcome,
    /// The kinds `kubectl delete <kinds> --all` removes from a scenario's namespace after it
    /// (best effort, `--wait=false`).
    pub cleanup: &'static str,
    /// Every scenario, by name (the names `cargo test` filters on).
    pub scenarios: &'static [(&'static str, Scenario<E>)],
}

/// A suite and the one environment its scenarios share (a `static`: the harness runs each
/// scenario from a closure of its own).
pub struct Suite<E: 'static> {
    spec: SuiteSpec<E>,
    env: Mutex<Option<E>>,
    started: AtomicUsize,
}

impl<E: DerefMut<Target = VirtualNode>> Suite<E> {
    pub const fn new(spec: SuiteSpec<E>) -> Suite<E> {
        Suite { spec, env: Mutex::new(None), started: AtomicUsize::new(0) }
    }

    /// Runs scenario `name`: brings the environment up on first use, (re)starts the provider,
    /// creates the scenario's namespace, runs it there and empties the namespace. A failure
    /// carries the provider's log tail.
    fn run(&self, name: &str, scenario: Scenario<E>) -> Outcome {
        let mut guard = self.env.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some((self.spec.up)()?);
        }
        let Some(env) = guard.as_mut() else { return Err("no environment".into()) };
        env.provider.ensure_running()?;
        let n = self.started.fetch_add(1, Ordering::SeqCst);
        let short: String = name.replace('_', "-").chars().take(40).collect();
        let ns = format!("t{n:02}-{}", short.trim_end_matches('-'));
        env.kubectl_ok(&["create", "namespace", &ns])?;
        let result = scenario(env, &ns);
        let _ = env.kubectl(&["delete", self.spec.cleanup, "--all", "-n", &ns, "--wait=false"]);
        result.map_err(|e| format!("{e}\n{}", env.provider.log_tail(80)))
    }

    /// Stops the environment, if one was brought up.
    fn teardown(&self) -> Outcome {
        let mut guard = self.env.lock().unwrap_or_else(|p| p.into_inner());
        guard.take().map_or(Ok(()), self.spec.down)
    }
}

/// Runs `suite` under libtest-mimic (the arguments are `cargo test`'s): every scenario a test,
/// then the teardown. Without the `cluster` and `e2e` features nothing runs: every scenario is
/// ignored and `<suite>: skipped: needs <needs> (…)` is printed once.
pub fn main<E: DerefMut<Target = VirtualNode> + Send>(suite: &'static Suite<E>) -> ExitCode {
    let enabled = cfg!(all(feature = "cluster", feature = "e2e"));
    let spec = &suite.spec;
    let args = Arguments::from_args();
    let trials: Vec<Trial> = spec
        .scenarios
        .iter()
        .map(|&(name, scenario)| {
            if enabled {
                Trial::test(name, move || suite.run(name, scenario).map_err(Failed::from))
            } else {
                Trial::test(name, || Ok(())).with_ignored_flag(true)
            }
        })
        .collect();
    if !enabled {
        eprintln!(
            "{}: skipped: needs {} (features chrysalis-tests/cluster and chrysalis-tests/e2e; `cargo xtask test` \
             enables both)",
            spec.name, spec.needs
        );
    }
    let conclusion = libtest_mimic::run(&args, trials);
    if enabled {
        if let Err(e) = suite.teardown() {
            eprintln!("{}: teardown left something behind: {e}", spec.name);
            return ExitCode::FAILURE;
        }
    }
    conclusion.exit_code()
}

/// A virtual node on the test control plane: the cluster (on its own port and state
/// directory), the provider binary as a restartable child, and kubectl as admin.
pub struct VirtualNode {
    pub opts: Options,
    pub cluster: Cluster,
    pub provider: ProviderProcess,
    pub node_name: String,
    /// How long the Node may take to be Ready.
    pub ready_within: Duration,
}

impl VirtualNode {
    /// Starts the cluster under `dir/cluster` on `port`, with metrics-server when
    /// `metrics_server` (the suites check `kubectl top` on their nodes; the benchmarks leave it
    /// off, so its scrapes do not land inside their timings).
    pub fn cluster_up(dir: &Path, port: u16, metrics_server: bool) -> Result<(Options, Cluster), String> {
        let opts = Options { state_dir: dir.join("cluster"), port, metrics_server, ..Options::default() };
        let cluster = Cluster::up_with(&opts).map_err(|e| format!("cluster up: {e}"))?;
        Ok((opts, cluster))
    }

    /// The provider flags that join `cluster` with its bootstrap token (written to
    /// `dir/bootstrap-token`) and pinned CA hash, keeping the credentials in `dir/vk/pki`.
    pub fn join_args(cluster: &Cluster, dir: &Path) -> Result<Vec<String>, String> {
        let token_file = dir.join("bootstrap-token");
        std::fs::write(&token_file, &cluster.token).map_err(|e| e.to_string())?;
        Ok(vec![
            "--join-server".into(),
            cluster.endpoint.clone(),
            "--join-token-file".into(),
            token_file.display().to_string(),
            "--join-ca-hash".into(),
            cluster.ca_hash.clone(),
            "--credentials-dir".into(),
            dir.join("vk/pki").display().to_string(),
        ])
    }

    /// Stops the provider (SIGTERM), then the cluster.
    pub fn stop(&mut self) -> Result<(), String> {
        self.provider.stop();
        Cluster::down_with(&self.opts).map(drop).map_err(|e| format!("cluster down: {e}"))
    }

    pub fn kubectl(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        self.cluster.kubectl().args(args).output()
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String, String> {
        self.cluster.kubectl_ok(args)
    }

    /// The provider's kubelet port as `host:port` (vk-sandbox's `--listen-addr`, vk-cocoon's
    /// `VK_KUBELET_PORT` on 127.0.0.1).
    pub fn kubelet_addr(&self) -> Result<String, String> {
        if let Some(a) = self.provider.setting("--listen-addr", "VK_LISTEN_ADDR") {
            return Ok(if a.starts_with(':') { format!("127.0.0.1{a}") } else { a });
        }
        let port = self.provider.setting("", "VK_KUBELET_PORT").ok_or("the provider has no kubelet port setting")?;
        Ok(format!("127.0.0.1:{port}"))
    }

    /// `GET path` on the kubelet port as the API server's kubelet client (its certificate, as
    /// the API server itself calls a kubelet): (status, body).
    pub fn kubelet_get(&self, path: &str) -> Result<(u16, String), String> {
        let pki = self.cluster.state_dir.join("pki");
        let (cert, key) = (pki.join("apiserver-kubelet-client.crt"), pki.join("apiserver-kubelet-client.key"));
        // -k: the endpoint's certificate is self-signed (the API server does not verify it either).
        let out = std::process::Command::new("curl")
            .args(["-sk", "--max-time", "20", "-w", "\n%{http_code}", "--cert"])
            .arg(&cert)
            .arg("--key")
            .arg(&key)
            .arg(format!("https://{}{path}", self.kubelet_addr()?))
            .output()
            .map_err(|e| format!("curl: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').ok_or(format!("curl printed no status: {text:?}"))?;
        let code = code.trim().parse().map_err(|_| format!("curl printed no status: {text:?}"))?;
        Ok((code, body.to_owned()))
    }

    /// `kubectl get … -o json`, `None` when it does not exist.
    pub fn get(&self, args: &[&str]) -> Result<Option<Value>, String> {
        self.cluster.get_json(args)
    }

    /// `kubectl apply` of a JSON object (or List) into `ns`.
    pub fn apply(&self, ns: &str, object: &Value) -> Result<(), String> {
        self.cluster.apply_json(ns, object)
    }

    /// Waits (up to [`VirtualNode::ready_within`]) for the Node to be Ready.
    pub fn wait_node_ready(&self) -> Result<Value, String> {
        poll(&format!("node {} Ready", self.node_name), self.ready_within, || {
            let node = self.get(&["node", &self.node_name])?;
            Ok(node.filter(|n| condition(n, "Ready").is_some_and(|c| c["status"] == "True")))
        })
    }

    pub fn pod(&self, ns: &str, name: &str) -> Result<Option<Value>, String> {
        self.get(&["pod", name, "-n", ns])
    }

    /// Waits up to `within` for the pod to satisfy `f`.
    pub fn wait_pod(
        &self,
        ns: &str,
        name: &str,
        what: &str,
        within: Duration,
        f: impl Fn(&Value) -> bool,
    ) -> Result<Value, String> {
        poll(&format!("pod {ns}/{name} {what}"), within, || Ok(self.pod(ns, name)?.filter(|p| f(p))))
    }

    /// Events about `pod` as (type, reason, message).
    pub fn events(&self, ns: &str, pod: &str) -> Result<Vec<(String, String, String)>, String> {
        self.cluster.events(ns, pod)
    }

    /// Waits up to `within` for the pod to be `phase` with reason `ProviderFailed` and a status
    /// message naming every one of `needles`, then (up to 30 s) for a Warning
    /// `ProviderCreateFailed` event carrying them too.
    pub fn wait_provider_failed(
        &self,
        ns: &str,
        name: &str,
        phase: &str,
        within: Duration,
        needles: &[&str],
    ) -> Outcome {
        let pod = self.wait_pod(ns, name, &format!("{phase} ProviderFailed"), within, |p| {
            p["status"]["phase"] == phase && p["status"]["reason"] == "ProviderFailed"
        })?;
        let msg = pod["status"]["message"].as_str().unwrap_or_default();
        for needle in needles {
            crate::ensure!(msg.contains(needle), "status message {msg:?} does not mention {needle:?}");
        }
        let events = poll("a ProviderCreateFailed event", Duration::from_secs(30), || {
            let ev = self.events(ns, name)?;
            Ok(ev.iter().any(|(t, r, _)| t == "Warning" && r == "ProviderCreateFailed").then_some(ev))
        })?;
        crate::ensure!(
            events.iter().any(|(_, r, m)| r == "ProviderCreateFailed" && needles.iter().all(|n| m.contains(n))),
            "events do not carry the error: {events:?}"
        );
        Ok(())
    }
}

/// Implements `Deref`/`DerefMut` from an environment to its [`VirtualNode`] field, so the
/// node's fields and helpers read as the environment's own (`env.cluster`, `env.apply(…)`).
macro_rules! derefs_to_virtual_node {
    ($env:ty, $field:ident) => {
        impl std::ops::Deref for $env {
            type Target = $crate::suite::VirtualNode;
            fn deref(&self) -> &$crate::suite::VirtualNode {
                &self.$field
            }
        }
        impl std::ops::DerefMut for $env {
            fn deref_mut(&mut self) -> &mut $crate::suite::VirtualNode {
                &mut self.$field
            }
        }
    };
}
pub(crate) use derefs_to_virtual_node;

/// A binary of the target directory this test executable was built into
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`; `cargo xtask test` builds them first).
pub fn sibling_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // target/<profile>/deps/<test>-<hash> → target/<profile>/<name>
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join(name)).ok_or("odd test path")?;
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} is not built: run `cargo build -p {name}` first (cargo xtask test does)", bin.display()))
    }
}

/// Polls `f` every 200 ms until it yields a value or `timeout` passes.
pub fn poll<T>(what: &str, timeout: Duration, f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    poll_every(what, timeout, Duration::from_millis(200), f)
}

/// [`poll`] every `interval`: for slow targets that each look costs (a box under TCG). An
/// `Err` from `f` does not stop the polling; the last one ends the timeout message.
pub fn poll_every<T>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let until = Instant::now() + timeout;
    let mut last_err = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = e,
        }
        if Instant::now() >= until {
            return Err(format!("timed out after {timeout:?} waiting for {what} {last_err}"));
        }
        std::thread::sleep(interval);
    }
}

/// The status condition of type `kind` of a Kubernetes object.
pub fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == kind)
}

/// Annotation `key` of a Kubernetes object.
pub fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj["metadata"]["annotations"][key].as_str()
}

/// The toleration of the `virtual-kubelet.io/provider` NoSchedule taint both virtual nodes carry.
pub fn toleration() -> Value {
    serde_json::json!({"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"})
}

/// `base` (an object) with every key of `extra` set, or removed where `extra` holds null.
pub fn merged(mut base: Value, extra: &Value) -> Value {
    if let (Some(b), Some(extra)) = (base.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            if v.is_null() {
                b.remove(k);
            } else {
                b.insert(k.clone(), v.clone());
            }
        }
    }
    base
}

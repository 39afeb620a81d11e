//! The supervisor with the real services (issue #6): `chrysalis run` on this host supervising
//! the real `sandboxd` (a pool of one `base` VM under QEMU), `vk-sandbox` and `vk-cocoon`, both
//! joined to the real control plane (`test_infra::cluster`) with the bootstrap token. vk-cocoon's
//! bridge lives in a network namespace the test creates (`VK_NETNS`, passed through the
//! supervisor's environment), so nothing it sets up touches the host's network.
//!
//! What it shows: `kill -9` of each child is recovered (a new process, the node Ready again, the
//! pool back at target) and no claimed VM is lost (its QEMU process is the same one throughout);
//! a stopped supervisor leaves the VMs running. sandboxd runs with the root token the supervisor
//! minted (read through `chrysalis token show sandboxd`'s route on the Unix socket; without it a
//! claim is refused), on loopback in plain HTTP as a supervisor run by hand does; and every secret
//! the box wrote, in the state directory and the runtime directory, is 0600 in a 0700 directory
//! (`test_infra::secrets`). A bad configuration naming its key is covered by
//! `appliance/supervisor/tests/supervise.rs`.

#[cfg(all(feature = "e2e", feature = "cluster"))]
mod real {
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use foundation::KUBECONFIG_FILE;
    use sandboxd_api::{ClaimRequest, Grant};
    use supervisor::client::Client;
    use supervisor::http::Endpoint;
    use test_infra::cluster::{Cluster, Options};
    use test_infra::netns::Netns;
    use test_infra::suite::{poll, sibling_bin};

    /// A sandboxd body as a curl `-d` argument.
    fn json<T: serde::Serialize>(body: &T) -> String {
        serde_json::to_string(body).expect("json")
    }

    const PORT: u16 = 25443;
    const SANDBOX_NODE: &str = "sup-sandbox";
    const COCOON_NODE: &str = "sup-cocoon";
    const WAIT: Duration = Duration::from_secs(300);

    struct Run {
        child: Child,
        client: Client,
        rt: tokio::runtime::Runtime,
        state: PathBuf,
        cluster: Options,
        // Dropped after the cluster is stopped (fields drop in order, after `Drop::drop`).
        _netns: Netns,
        sandboxd: u16,
    }

    impl Drop for Run {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            for pid in test_infra::qemu_processes_under(&self.state) {
                // SAFETY: kill(2) on QEMU pids found under our own state directory.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            for svc in ["sandboxd", "vk-sandbox", "vk-cocoon"] {
                let _ =
                    Command::new("pkill").args(["-9", "-f", &format!("{}.*{}", svc, self.state.display())]).status();
            }
            let _ = Cluster::down_with(&self.cluster);
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(17777)
    }

    fn start(dir: &Path) -> Run {
        // A guard: deleted however start() ends, a panic included.
        let netns = Netns::create(&format!("sup-e2e-{}", std::process::id())).unwrap_or_else(|e| panic!("{e}"));
        let opts = Options { state_dir: dir.join("cluster"), port: PORT, ..Options::default() };
        let cluster = Cluster::up_with(&opts).unwrap_or_else(|e| panic!("cluster up: {e}"));
        for (provider, node) in [("vk-sandbox", SANDBOX_NODE), ("vk-cocoon", COCOON_NODE)] {
            cluster.bind_node(provider, node).unwrap_or_else(|e| panic!("binding {node}'s RBAC: {e}"));
        }
        let state = dir.join("state");
        let sandboxd = free_port();
        std::fs::write(dir.join("bootstrap-token"), format!("{}\n", cluster.token)).expect("token");
        let config = format!(
            r#"[sandboxd]
listen = "127.0.0.1:{sandboxd}"
refill_concurrency = 1
boot_timeout_secs = 300

[[sandboxd.pools]]
template = "base"
size = "small"
net = "none"
warm = 1

[cluster]
endpoint = "{endpoint}"
ca_cert_hashes = ["{hash}"]
bootstrap_token_file = "bootstrap-token"

[vk_sandbox]
node_name = "{SANDBOX_NODE}"

[vk_cocoon]
node_name = "{COCOON_NODE}"
"#,
            endpoint = cluster.endpoint,
            hash = cluster.ca_hash,
        );
        let cfg = dir.join("config.toml");
        std::fs::write(&cfg, config).expect("config");
        let bin = sibling_bin("chrysalis").unwrap_or_else(|e| panic!("{e}"));
        let bin_dir = bin.parent().expect("bin dir").to_path_buf();
        let catalog = test_infra::cluster::cache_dir().join("images/catalog.json");
        let api = dir.join("api.sock");
        let log = std::fs::File::create(dir.join("supervisor.log")).expect("log");
        let child = Command::new(&bin)
            .arg("run")
            .args(["--config-baked", &cfg.display().to_string()])
            .args(["--config-esp", "/nonexistent/esp.toml", "--config-disk", "/nonexistent/disk.toml", "--no-cmdline"])
            .args(["--state-dir", &state.display().to_string(), "--run-dir", &dir.join("run").display().to_string()])
            .args(["--api-socket", &api.display().to_string(), "--bin-dir", &bin_dir.display().to_string()])
            .args(["--catalog", &catalog.display().to_string()])
            .env("VK_NETNS", netns.name())
            .env("CHRYSALIS_STATE", &state)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("chrysalis run");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let client = Client::new(Endpoint::Unix(api), None);
        Run { child, client, rt, state, cluster: opts, _netns: netns, sandboxd }
    }

    impl Run {
        fn status(&self) -> Option<supervisor::state::Status> {
            self.rt.block_on(self.client.status()).ok()
        }

        /// Ready, both nodes Ready, the pool at target.
        fn wait_healthy(&self, what: &str) -> supervisor::state::Status {
            poll(what, WAIT, || {
                Ok(self.status().filter(|s| {
                    s.health.ready
                        && s.health.nodes.len() == 2
                        && s.health.nodes.iter().all(|n| n.ready)
                        && s.health.pools_at_target()
                }))
            })
            .unwrap_or_else(|e| panic!("{e}\n{}", self.log()))
        }

        fn pid_of(s: &supervisor::state::Status, svc: &str) -> u32 {
            s.health
                .services
                .iter()
                .find(|x| x.name == svc)
                .and_then(|x| x.pid)
                .unwrap_or_else(|| panic!("no pid for {svc}"))
        }

        fn log(&self) -> String {
            let text =
                std::fs::read_to_string(self.state.parent().expect("dir").join("supervisor.log")).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(60)..].join("\n")
        }

        /// sandboxd's root token, as `chrysalis token show sandboxd` reads it (the Unix socket).
        fn token(&self) -> String {
            self.rt.block_on(self.client.token("sandboxd")).expect("GET /v1/tokens/sandboxd").token
        }

        fn claim(&self) -> Grant {
            // Without the root token sandboxd refuses the claim.
            let out = Command::new("curl")
                .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "30", "-X", "POST"])
                .args(["-H", "content-type: application/json", "-d", &json(&ClaimRequest::new("base"))])
                .arg(format!("http://127.0.0.1:{}/v1/claim", self.sandboxd))
                .output()
                .expect("curl");
            assert_eq!(String::from_utf8_lossy(&out.stdout), "401", "an anonymous claim was not refused");
            let out = Command::new("curl")
                .args(["-fsS", "--max-time", "120", "-X", "POST", "-H", "content-type: application/json"])
                .args(["-H", &format!("authorization: Bearer {}", self.token())])
                .args(["-d", &json(&ClaimRequest { ttl_seconds: Some(900), ..ClaimRequest::new("base") })])
                .arg(format!("http://127.0.0.1:{}/v1/claim", self.sandboxd))
                .output()
                .expect("curl");
            assert!(out.status.success(), "claim: {}", String::from_utf8_lossy(&out.stderr));
            serde_json::from_slice(&out.stdout).expect("claim json")
        }
    }

    #[test]
    fn kill_9_of_each_service_is_recovered_with_no_vm_lost() {
        let dir = tempfile::Builder::new().prefix("sup").tempdir_in("/tmp").expect("tempdir");
        let run = start(dir.path());
        let before = run.wait_healthy("supervisor ready, both nodes Ready, the pool warm");
        // `chrysalis status` names the hypervisor sandboxd chose (QEMU here: no cloud-hypervisor).
        let hv = before.health.hypervisor.as_deref().unwrap_or_default();
        assert!(hv == "qemu (tcg)" || hv == "qemu (kvm)", "hypervisor {hv:?}");
        // The pool's one warm VM is the one the claim gets: its QEMU must survive everything below.
        let claimed: Vec<u32> = test_infra::qemu_processes_under(&run.state);
        assert_eq!(claimed.len(), 1, "one warm VM expected under {}", run.state.display());
        let claim = run.claim();
        let id = claim.id;
        let mut previous = before;
        for svc in ["sandboxd", "vk-sandbox", "vk-cocoon"] {
            let pid = Run::pid_of(&previous, svc);
            // SAFETY: kill(2) on the service pid the supervisor reported.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0, "kill -9 {svc} ({pid})");
            let now = poll(&format!("{svc} restarted"), WAIT, || {
                Ok(run.status().filter(|s| {
                    s.health
                        .services
                        .iter()
                        .any(|x| x.name == svc && x.pid.is_some_and(|p| p != pid) && x.restarts >= 1)
                }))
            })
            .unwrap_or_else(|e| panic!("{e}\n{}", run.log()));
            let _ = now;
            previous = run.wait_healthy(&format!("healthy again after kill -9 of {svc}"));
            for other in ["sandboxd", "vk-sandbox", "vk-cocoon"].iter().filter(|o| **o != svc) {
                let restarts = previous.health.services.iter().find(|x| x.name == *other).map(|x| x.restarts);
                assert!(restarts.is_some(), "{other} missing from the status");
            }
        }
        // No VM lost: the claim is still listed and its QEMU is the same process.
        let alive: Vec<u32> = test_infra::qemu_processes_under(&run.state);
        let out = Command::new("curl")
            .args(["-fsS", "--max-time", "30", "-H", &format!("authorization: Bearer {}", run.token())])
            .arg(format!("http://127.0.0.1:{}/v1/sandboxes", run.sandboxd))
            .output()
            .expect("curl");
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(listed.contains(&id), "claim {id} is gone after the kills: {listed}");
        assert!(alive.contains(&claimed[0]), "the claimed VM's QEMU {} is gone: now {alive:?}", claimed[0]);
        // A stopped supervisor leaves the VMs running (the services re-adopt them).
        let mut run = run;
        // SAFETY: SIGTERM to our child.
        unsafe { libc::kill(run.child.id() as i32, libc::SIGTERM) };
        let exited = run.child.wait().expect("wait");
        assert!(exited.success(), "supervisor exit: {exited}\n{}", run.log());
        let after: Vec<u32> = test_infra::qemu_processes_under(&run.state);
        assert!(after.contains(&claimed[0]), "the claimed VM died with the supervisor: {after:?}");

        // Every secret the box wrote: 0600 in a 0700 directory.
        use test_infra::secrets::{check, walk_host};
        let required = [
            "secrets/sandboxd-token",
            "sandboxd/claims.json",
            "vk-sandbox/claims.json",
            &format!("vk-sandbox/pki/{KUBECONFIG_FILE}"),
            "vk-sandbox/pki/kubelet-client-current.pem",
            &format!("vk-cocoon/pki/{KUBECONFIG_FILE}"),
            "vk-cocoon/pki/kubelet-client-current.pem",
            "logs/sandboxd.log",
        ];
        let checked =
            check(&walk_host(&run.state).expect("walk the state"), &required).unwrap_or_else(|e| panic!("{e:#}"));
        let run_dir = run.state.parent().expect("dir").join("run");
        check(&walk_host(&run_dir).expect("walk the run dir"), &["sandboxd.json"]).unwrap_or_else(|e| panic!("{e:#}"));
        println!("    {} secrets checked: {}", checked.len(), checked.join(", "));
    }
}

#[cfg(not(all(feature = "e2e", feature = "cluster")))]
#[test]
#[ignore = "needs QEMU, the built guest images, the control plane and root (features chrysalis-tests/e2e and cluster; cargo xtask test enables them)"]
fn kill_9_of_each_service_is_recovered_with_no_vm_lost() {}

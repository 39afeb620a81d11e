//! The scenarios and the one environment they share (see the suite's doc).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use test_infra::ensure;
use test_infra::kubelet_streams::{self, Target};
use test_infra::suite::{annotation, condition, merged, poll, sibling_bin, toleration, Outcome, Suite, SuiteSpec};
use test_infra::vk_cocoon::{CocoonEnv, CocoonSpec};

/// The apiserver port of this suite's cluster (others: 16443 xtask, 26443 cluster_e2e, 27443
/// join, 28443 vnode, 29443 vk_sandbox_e2e).
const PORT: u16 = 31443;
const NODE: &str = "vk-cocoon-e2e";
/// How long a Pod may take to be Running on a freshly booted VM (TCG boots are slow).
const VM_RUNNING: Duration = Duration::from_secs(300);
/// How long a Pod may take to reach a state that needs no VM.
const QUICK: Duration = Duration::from_secs(90);
/// The image the scenarios boot where the seed does not dictate one (initrd only: short boots).
const BASE: &str = "base";

const NAME: &str = "vm.cocoonstack.io/name";
const ID: &str = "vm.cocoonstack.io/id";
const IP: &str = "vm.cocoonstack.io/ip";
const LIFECYCLE: &str = "vm.cocoonstack.io/lifecycle-state";

type Env = CocoonEnv;

/// The suite (`vk_cocoon_e2e.rs` runs it). Deleting a scenario's Sandboxes and Pods makes their
/// VMs go; every QEMU is killed at teardown.
pub static SUITE: Suite<Env> = Suite::new(SuiteSpec {
    name: "vk_cocoon_e2e",
    needs: "the real control plane, QEMU and root",
    up: env_up,
    down,
    cleanup: "sandboxes,pods",
    scenarios: &[
        ("seed_cocoon_example_runs_with_its_vm_ip_and_serves_tcp", seed_example),
        ("a_100_character_vm_name_runs_cloud_hypervisor_on_qemu_and_a_second_sandbox_adopts_it", same_vm_name),
        ("clone_boots_from_the_snapshot_a_policy_always_delete_saved", clone_from_snapshot),
        ("unmanaged_pod_with_id_and_ip_is_tracked_without_a_vm", unmanaged),
        ("missing_vm_name_is_pending_with_event_and_failed_under_restart_never", missing_name),
        ("windows_guest_is_refused_with_a_typed_error", windows),
        ("provider_kill9_leaves_vms_running_and_the_restart_readopts_them", kill9),
        ("readiness_follows_the_probe_port", readiness),
        ("a_vm_that_dies_is_restarted_then_its_pod_replaced_when_it_dies_again_or_vanishes", vm_deaths),
        ("another_namespace_cannot_adopt_clone_or_reuse_the_vm_or_its_snapshot", other_namespace),
        ("a_cocoonhibernation_hibernates_then_wakes_a_vm_with_its_state_and_ip_and_fork_from_clones_it", hibernation),
        ("kubectl_logs_exec_attach_port_forward_and_top_on_a_cocoon_pod", kubectl_streams),
        ("kubectl_bad_inputs_fail_closed_on_a_cocoon_pod", kubectl_bad_inputs),
        ("snapshot_gc_removes_an_unreferenced_snapshot_keeps_a_referenced_one_and_metrics_are_scraped", snapshot_gc),
    ],
});

fn env_up() -> Result<Env, String> {
    CocoonEnv::up(CocoonSpec { port: PORT, node_name: NODE, provider_bin: sibling_bin("vk-cocoon")? })
}

/// Stops everything the scenarios started; an error lists what survived.
fn down(env: Env) -> Outcome {
    let left = env.down();
    if left.is_empty() {
        Ok(())
    } else {
        Err(left.join("; "))
    }
}

// ---------------------------------------------------------------------------------------------
// Objects

fn pod_spec(extra: Value) -> Value {
    let spec = json!({
        "nodeSelector": {"cocoonstack.io/pool": "default"},
        "tolerations": [toleration()],
        "containers": [{"name": "agent", "image": BASE}],
    });
    merged(spec, &extra)
}

/// A Sandbox shaped like the seed's cocoon example.
fn sandbox(name: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"podTemplate": {"metadata": {"annotations": annotations}, "spec": pod_spec(json!({}))}},
    })
}

/// A bare Pod for this node.
fn pod(name: &str, annotations: Value, extra: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": pod_spec(extra),
    })
}

/// A managed `run` of `image` named `vm`, with a snapshot policy.
fn run_vm(vm: &str, image: &str, policy: &str) -> Value {
    json!({
        NAME: vm,
        "cocoonset.cocoonstack.io/managed": "true",
        "cocoonset.cocoonstack.io/mode": "run",
        "cocoonset.cocoonstack.io/image": image,
        "cocoonset.cocoonstack.io/snapshot-policy": policy,
    })
}

/// The id vk-cocoon derives from a short, valid VM name.
fn vm_id(name: &str) -> String {
    format!("vc-{name}")
}

fn running(env: &Env, ns: &str, name: &str) -> Result<Value, String> {
    env.wait_pod(ns, name, "Running", VM_RUNNING, |p| p["status"]["phase"] == "Running")
}

fn ready(env: &Env, ns: &str, name: &str, within: Duration) -> Result<Value, String> {
    env.wait_pod(ns, name, "Ready", within, |p| {
        p["status"]["phase"] == "Running" && condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
}

/// A managed pod's VM as the API and the node see it: (id, ip), after checking they agree.
fn vm_of(env: &Env, pod: &Value, vm_name: &str) -> Result<(String, String), String> {
    let id = annotation(pod, ID).ok_or("no vm.cocoonstack.io/id annotation")?.to_string();
    if vm_name.len() <= 37 {
        ensure!(id == vm_id(vm_name), "id {id}, expected {}", vm_id(vm_name));
    } else {
        // A long name: a short stable id (a readable head and a hash), the full name kept.
        ensure!(id.starts_with("vc-") && id.len() <= 40, "id {id} of a long VM name");
        ensure!(annotation(pod, NAME) == Some(vm_name), "the pod's VM name changed: {:?}", annotation(pod, NAME));
    }
    let ip = annotation(pod, IP).ok_or("no vm.cocoonstack.io/ip annotation")?.to_string();
    ensure!(pod["status"]["podIP"] == ip.as_str(), "podIP {} != vm ip {ip}", pod["status"]["podIP"]);
    ensure!(ip.starts_with("10.88.0."), "ip {ip} is outside VK_VM_CIDR's default 10.88.0.0/24");
    let lease = env.lease(&id).ok_or(format!("no lease for {id}"))?;
    ensure!(lease["ip"] == ip.as_str(), "lease {lease} does not hold {ip}");
    let n = env.instances(&id).len();
    ensure!(n == 1, "VM {id} has {n} live QEMU instances, want 1");
    ensure!(env.has_record(&id), "vk-cocoon has no record of {id}");
    Ok((id, ip))
}

/// Writes a TCP service into the guest (every connection gets `hello-from-<contents of
/// /tmp/who>`) with busybox `nc` and starts it detached.
fn serve_busybox(env: &Env, id: &str, who: &str, port: u16) -> Outcome {
    env.guest_sh(
        id,
        &format!(
            "echo {who} > /tmp/who && printf '#!/bin/sh\\necho hello-from-$(cat /tmp/who)\\n' > /tmp/reply.sh \
             && chmod +x /tmp/reply.sh"
        ),
    )?;
    env.guest_spawn(id, &["nc", "-ll", "-p", &port.to_string(), "-e", "/tmp/reply.sh"])
}

// ---------------------------------------------------------------------------------------------
// Scenarios

/// Starts a Python TCP service in an rt guest answering `reply` to every connection on `port`.
fn serve_python(env: &Env, id: &str, reply: &str, port: u16) -> Outcome {
    let server = format!(
        "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('0.0.0.0', {port}))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.sendall(b'{reply}\\n')\n    c.close()\n"
    );
    env.guest_sh(id, &format!("cat > /tmp/srv.py <<'PY'\n{server}PY\n"))?;
    env.guest_spawn(id, &["sh", "-c", "exec python3 /tmp/srv.py > /tmp/srv.log 2>&1"])
}

fn seed_example(env: &mut Env, ns: &str) -> Outcome {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("seed/examples/cocoon-example.yaml");
    env.kubectl_ok(&["apply", "-n", ns, "-f", &seed.display().to_string()])?;
    let pod = running(env, ns, "cocoon-example")?;
    ensure!(pod["spec"]["nodeName"] == NODE, "bound to {}", pod["spec"]["nodeName"]);
    let (id, ip) = vm_of(env, &pod, "sandbox-default-cocoon-example")?;
    ensure!(annotation(&pod, LIFECYCLE) == Some("ready"), "lifecycle-state {:?}", annotation(&pod, LIFECYCLE));
    ready(env, ns, "cocoon-example", Duration::from_secs(60))?;
    // The image is ubuntu-dev-base (rt): a Debian userland with python3.
    let os = env.guest_sh(&id, "cat /etc/os-release")?;
    ensure!(os.contains("Debian"), "the guest is not the rt image: {os}");
    serve_python(env, &id, "hello-from-cocoon-example", 8080)?;
    let got = env
        .tcp_from_netns(&ip, 8080, Duration::from_secs(60))
        .map_err(|e| format!("{e}; server log: {:?}", env.guest_sh(&id, "cat /tmp/srv.log")))?;
    ensure!(got.trim() == "hello-from-cocoon-example", "the guest answered {got:?}");
    // The Sandbox is Ready once the provider pushed a Ready pod.
    poll("Sandbox Ready", QUICK, || {
        let s = env.get(&["sandbox", "cocoon-example", "-n", ns])?;
        Ok(s.filter(|s| condition(s, "Ready").is_some_and(|c| c["status"] == "True")))
    })?;
    Ok(())
}

fn same_vm_name(env: &mut Env, ns: &str) -> Outcome {
    // A 100-character VM name, as upstream's naming conventions make them.
    let mut name = format!("vk-{ns}-shared-vm-");
    while name.len() < 100 {
        name.push('x');
    }
    name.truncate(100);
    let name = name.as_str();
    // The first Pod names the backend cocoon-common writes into every CocoonSet Pod
    // (`Backend.Default()`, cloud-hypervisor): this QEMU node serves it, and says so.
    let mut first_vm = run_vm(name, BASE, "never");
    first_vm["vm.cocoonstack.io/backend"] = json!("cloud-hypervisor");
    env.apply(ns, &sandbox("first", first_vm))?;
    let first = running(env, ns, "first")?;
    let events = env.events(ns, "first")?;
    ensure!(
        events.iter().any(|(t, r, m)| t == "Normal"
            && r == "BackendSubstituted"
            && m.contains("backend cloud-hypervisor was asked for; the VM runs under qemu")),
        "no BackendSubstituted event on the first pod: {events:?}"
    );
    let (id, ip) = vm_of(env, &first, name)?;
    let pid = env.instances(&id).first().map(|v| v.pid).ok_or("no instance")?;
    // The seed's constraint, shown: a second Pod carrying the same VM name adopts the first
    // one's VM instead of booting its own (provider.rs "Two Pods, one VM name").
    env.apply(ns, &sandbox("second", run_vm(name, BASE, "never")))?;
    let second = running(env, ns, "second")?;
    ensure!(
        annotation(&second, ID) == Some(id.as_str()) && annotation(&second, IP) == Some(ip.as_str()),
        "the second pod did not adopt VM {id} ({ip}): id {:?} ip {:?}",
        annotation(&second, ID),
        annotation(&second, IP)
    );
    ensure!(second["status"]["podIP"] == ip.as_str(), "second podIP {}", second["status"]["podIP"]);
    let events = env.events(ns, "second")?;
    ensure!(
        events.iter().any(|(t, r, m)| t == "Warning" && r == "VMNameShared" && m.contains(&format!("{ns}/first"))),
        "no VMNameShared warning on the second pod: {events:?}"
    );
    // Still exactly one VM of that name: the first one's QEMU, untouched.
    let inst = env.instances(&id);
    ensure!(inst.len() == 1 && inst[0].pid == pid, "instances of {id}: {inst:?}, want the one QEMU {pid}");
    let first = env.pod(ns, "first")?.ok_or("first pod gone")?;
    ensure!(first["status"]["phase"] == "Running", "first pod: {}", first["status"]);
    Ok(())
}

fn clone_from_snapshot(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &sandbox("src", run_vm("snap-src", BASE, "always")))?;
    let src = running(env, ns, "src")?;
    let (src_id, src_ip) = vm_of(env, &src, "snap-src")?;
    serve_busybox(env, &src_id, "parent", 8080)?;
    let got = env.tcp_from_netns(&src_ip, 8080, Duration::from_secs(60))?;
    ensure!(got.trim() == "hello-from-parent", "the source answered {got:?}");
    // Deleting it with snapshot-policy always saves snap-src:latest, then removes the VM.
    env.kubectl_ok(&["delete", "sandbox", "src", "-n", ns, "--wait=true", "--timeout=240s"])?;
    poll("snap-src:latest saved and the source VM removed", Duration::from_secs(240), || {
        let store = env.store()?;
        let saved = match store.lookup("snap-src:latest") {
            Ok(d) => store.manifest(&d).map_err(|e| e.to_string())?.kind() == images::Kind::Snapshot,
            Err(_) => false,
        };
        let gone = env.instances(&src_id).is_empty() && !env.has_record(&src_id) && env.lease(&src_id).is_none();
        Ok((saved && gone).then_some(()))
    })?;
    // A clone of it: its own VM, lease and address; the guest (with the parent's nc still
    // running from the memory image) is re-addressed and answers on the clone's IP.
    let mut a = run_vm("snap-dst", "snap-src", "never");
    a["cocoonset.cocoonstack.io/mode"] = json!("clone");
    env.apply(ns, &sandbox("dst", a))?;
    let dst = running(env, ns, "dst")?;
    let (dst_id, dst_ip) = vm_of(env, &dst, "snap-dst")?;
    ensure!(annotation(&dst, LIFECYCLE) == Some("ready"), "clone lifecycle-state {:?}", annotation(&dst, LIFECYCLE));
    let events = env.events(ns, "dst")?;
    ensure!(events.iter().any(|(_, r, _)| r == "PostCloneSucceeded"), "no PostCloneSucceeded event: {events:?}");
    let addr = env.guest_sh(&dst_id, "ip -4 addr show dev eth0")?;
    ensure!(addr.contains(&format!("{dst_ip}/24")), "the clone's eth0 is not re-addressed: {addr}");
    let who = env.guest_sh(&dst_id, "cat /tmp/who")?;
    ensure!(who.trim() == "parent", "the clone does not carry the parent's memory/disk state: /tmp/who = {who:?}");
    env.guest_sh(&dst_id, "echo clone > /tmp/who")?;
    let got = env.tcp_from_netns(&dst_ip, 8080, Duration::from_secs(60))?;
    ensure!(got.trim() == "hello-from-clone", "the clone answered {got:?} on {dst_ip}");
    ready(env, ns, "dst", Duration::from_secs(60))?;
    Ok(())
}

/// A `CocoonHibernation` (the CRD `appliance/vk-cocoon/manifests` ships) asks for `desire` of
/// Pod `pod`.
fn hibernation_object(pod: &str, desire: &str) -> Value {
    json!({
        "apiVersion": "cocoonset.cocoonstack.io/v1",
        "kind": "CocoonHibernation",
        "metadata": {"name": format!("{pod}-sleep")},
        "spec": {"podRef": {"name": pod}, "desire": desire},
    })
}

/// Waits for the `CocoonHibernation` of `pod` to show `phase`.
fn hibernation_phase(env: &Env, ns: &str, pod: &str, phase: &str) -> Outcome {
    let name = format!("{pod}-sleep");
    poll(&format!("CocoonHibernation {ns}/{name} {phase}"), VM_RUNNING, || {
        let o = env.get(&["cocoonhibernations.cocoonset.cocoonstack.io", &name, "-n", ns])?;
        Ok(o.filter(|o| o["status"]["phase"] == phase).map(|_| ()))
    })
}

/// An rt VM whose `storage: 3Gi` sizes its writable disk (the image's is 2 GiB). Hibernate
/// through a `CocoonHibernation`: the VM is saved as `<name>:hibernate` and stopped (no QEMU),
/// the Pod is Pending with `lifecycle-state: hibernated`, its lease kept. Wake: the VM is back
/// under its id with its address, its memory (a listening server) and its disk (a file). Then a
/// `fork-from` Pod clones the running VM (`fork-<name>`), with its own address.
fn hibernation(env: &mut Env, ns: &str) -> Outcome {
    let mut a = run_vm("sleeper", "ubuntu-dev-base", "never");
    a["cocoonset.cocoonstack.io/storage"] = json!("3Gi");
    env.apply(ns, &pod("sleeper", a, json!({})))?;
    let p = running(env, ns, "sleeper")?;
    let (id, ip) = vm_of(env, &p, "sleeper")?;
    let sectors = env.guest_sh(&id, "cat /sys/block/vdb/size")?;
    ensure!(sectors.trim() == (3u64 << 30 >> 9).to_string(), "storage 3Gi gave /dev/vdb {sectors:?} sectors");
    env.guest_sh(&id, "echo before-sleep > /root/kept && sync")?;
    serve_python(env, &id, "hello-from-before-sleep", 8080)?;
    env.tcp_from_netns(&ip, 8080, Duration::from_secs(60))?;
    env.apply(ns, &hibernation_object("sleeper", "Hibernate"))?;
    hibernation_phase(env, ns, "sleeper", "Hibernated")?;
    let p = env.wait_pod(ns, "sleeper", "hibernated", QUICK, |p| annotation(p, LIFECYCLE) == Some("hibernated"))?;
    ensure!(p["status"]["phase"] == "Pending", "a hibernated Pod is Pending: {}", p["status"]);
    ensure!(annotation(&p, IP) == Some(ip.as_str()), "the address annotation changed: {:?}", annotation(&p, IP));
    ensure!(env.instances(&id).is_empty(), "a hibernated VM still runs {} QEMU", env.instances(&id).len());
    let lease = env.lease(&id).ok_or("the lease went with the VM")?;
    ensure!(lease["ip"] == ip.as_str(), "the kept lease holds {lease}, not {ip}");
    let store = env.store()?;
    ensure!(store.lookup("sleeper:hibernate").is_ok(), "no sleeper:hibernate in the image library");

    env.apply(ns, &hibernation_object("sleeper", "Wake"))?;
    hibernation_phase(env, ns, "sleeper", "Active")?;
    let p = ready(env, ns, "sleeper", VM_RUNNING)?;
    ensure!(vm_of(env, &p, "sleeper")? == (id.clone(), ip.clone()), "the woken VM has another id or address");
    let got = env.tcp_from_netns(&ip, 8080, Duration::from_secs(60))?;
    ensure!(got.trim() == "hello-from-before-sleep", "the woken VM answered {got:?}");
    let kept = env.guest_sh(&id, "cat /root/kept")?;
    ensure!(kept.trim() == "before-sleep", "the woken VM's disk lost /root/kept: {kept:?}");
    ensure!(env.store()?.lookup("sleeper:hibernate").is_err(), "the wake keeps sleeper:hibernate");
    let reasons: Vec<String> = env.events(ns, "sleeper")?.into_iter().map(|(_, r, _)| r).collect();
    ensure!(reasons.iter().any(|r| r == "Hibernated") && reasons.iter().any(|r| r == "Woken"), "events: {reasons:?}");
    ensure!(annotation(&p, "vm.cocoonstack.io/lifecycle-state-message").is_none(), "an empty message is removed");

    let mut fork = run_vm("sleeper-fork", "ubuntu-dev-base", "never");
    fork["cocoonset.cocoonstack.io/mode"] = json!("clone");
    fork["vm.cocoonstack.io/fork-from"] = json!("sleeper");
    env.apply(ns, &pod("fork", fork, json!({})))?;
    let f = running(env, ns, "fork")?;
    let (fork_id, fork_ip) = vm_of(env, &f, "sleeper-fork")?;
    ensure!(fork_ip != ip, "the fork shares its source's address {ip}");
    let kept = env.guest_sh(&fork_id, "cat /root/kept")?;
    ensure!(kept.trim() == "before-sleep", "the fork does not carry its source's disk: {kept:?}");
    ensure!(!env.instances(&id).is_empty(), "forking stopped the source");
    env.kubectl_ok(&["delete", "cocoonhibernations.cocoonset.cocoonstack.io", "sleeper-sleep", "-n", ns])?;
    Ok(())
}

fn unmanaged(env: &mut Env, ns: &str) -> Outcome {
    let a = json!({NAME: "ext-vm", ID: "ext-0001", IP: "10.88.0.250"});
    env.apply(ns, &pod("ext", a, json!({})))?;
    let p = env.wait_pod(ns, "ext", "Running", QUICK, |p| p["status"]["phase"] == "Running")?;
    ensure!(p["status"]["podIP"] == "10.88.0.250", "podIP {}", p["status"]["podIP"]);
    ready(env, ns, "ext", QUICK)?;
    let p = env.pod(ns, "ext")?.ok_or("pod gone")?;
    ensure!(annotation(&p, ID) == Some("ext-0001"), "the pre-assigned id changed: {:?}", annotation(&p, ID));
    ensure!(annotation(&p, LIFECYCLE).is_none(), "vk-cocoon wrote lifecycle state on an unmanaged pod");
    for id in [vm_id("ext-vm"), "ext-0001".to_string()] {
        ensure!(env.instances(&id).is_empty() && !env.has_record(&id), "a VM {id} was created for an unmanaged pod");
        ensure!(env.lease(&id).is_none(), "a lease was taken for {id}");
    }
    Ok(())
}

fn missing_name(env: &mut Env, ns: &str) -> Outcome {
    let mut a = run_vm("unused", BASE, "never");
    if let Some(m) = a.as_object_mut() {
        m.remove(NAME);
    }
    env.apply(ns, &pod("noname", a.clone(), json!({})))?;
    env.apply(ns, &pod("noname-never", a, json!({"restartPolicy": "Never"})))?;
    env.wait_provider_failed(ns, "noname", "Pending", QUICK, &["vm.cocoonstack.io/name is missing"])?;
    env.wait_provider_failed(ns, "noname-never", "Failed", QUICK, &["vm.cocoonstack.io/name is missing"])?;
    // Failed is terminal.
    std::thread::sleep(Duration::from_secs(3));
    let p = env.pod(ns, "noname-never")?.ok_or("pod gone")?;
    ensure!(p["status"]["phase"] == "Failed", "a Failed pod changed: {}", p["status"]);
    ensure!(env.instances(&vm_id("unused")).is_empty(), "a VM was booted without a name");
    Ok(())
}

fn windows(env: &mut Env, ns: &str) -> Outcome {
    let mut a = run_vm("win-vm", BASE, "never");
    a["cocoonset.cocoonstack.io/os"] = json!("windows");
    env.apply(ns, &pod("win", a, json!({})))?;
    env.wait_provider_failed(ns, "win", "Pending", QUICK, &["guest OS windows", "unsupported on this node"])?;
    let id = vm_id("win-vm");
    ensure!(env.instances(&id).is_empty() && !env.has_record(&id), "a VM was booted for a windows pod");
    Ok(())
}

fn kill9(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &sandbox("survivor", run_vm("survivor", BASE, "never")))?;
    let pod = running(env, ns, "survivor")?;
    let (id, ip) = vm_of(env, &pod, "survivor")?;
    ready(env, ns, "survivor", Duration::from_secs(60))?;
    let pid = env.instances(&id).first().map(|v| v.pid).ok_or("no instance")?;
    serve_busybox(env, &id, "survivor", 8080)?;
    let starts = env.provider.starts();
    env.provider.kill9();
    // The VM keeps running without its provider, and keeps serving.
    std::thread::sleep(Duration::from_secs(2));
    let inst = env.instances(&id);
    ensure!(inst.len() == 1 && inst[0].pid == pid, "after kill -9 the VM's QEMU {pid} is gone: {inst:?}");
    let got = env.tcp_from_netns(&ip, 8080, Duration::from_secs(30))?;
    ensure!(got.trim() == "hello-from-survivor", "the orphaned guest answered {got:?}");
    env.provider.ensure_running()?;
    ensure!(env.provider.starts() == starts + 1, "the provider was not restarted");
    env.wait_node_ready()?;
    let events = poll("a ResumedAfterRestart event", QUICK, || {
        let ev = env.events(ns, "survivor")?;
        Ok(ev.iter().any(|(_, r, _)| r == "ResumedAfterRestart").then_some(ev))
    })?;
    ensure!(events.iter().any(|(_, r, m)| r == "ResumedAfterRestart" && m.contains(&id)), "events: {events:?}");
    let p = ready(env, ns, "survivor", QUICK)?;
    ensure!(annotation(&p, ID) == Some(id.as_str()), "id changed to {:?}", annotation(&p, ID));
    ensure!(p["status"]["podIP"] == ip.as_str(), "podIP changed to {}", p["status"]["podIP"]);
    let inst = env.instances(&id);
    ensure!(inst.len() == 1 && inst[0].pid == pid, "the restart did not re-adopt QEMU {pid}: {inst:?}");
    // The re-adopted VM's agent is reachable through the new provider's bridge.
    let who = env.guest_sh(&id, "cat /tmp/who")?;
    ensure!(who.trim() == "survivor", "guest state after re-adoption: {who:?}");
    Ok(())
}

/// Kills QEMU process `pid` (the VM "dies on its own").
fn kill_qemu(pid: u32) -> Outcome {
    let pid = i32::try_from(pid).map_err(|_| format!("pid {pid} out of range"))?;
    // SAFETY: kill(2) on a pid we read from the VM's live record; no memory is involved.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        return Err(format!("kill -9 {pid}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn ready_status(p: &Value) -> bool {
    condition(p, "Ready").is_some_and(|c| c["status"] == "True")
}

fn readiness(env: &mut Env, ns: &str) -> Outcome {
    let mut ann = run_vm("probed", BASE, "never");
    ann["vm.cocoonstack.io/probe-port"] = json!("8080");
    env.apply(ns, &sandbox("probed", ann))?;
    let pod = running(env, ns, "probed")?;
    let (id, ip) = vm_of(env, &pod, "probed")?;
    // Nothing listens on the probe port yet: Running, never Ready.
    std::thread::sleep(Duration::from_secs(5));
    let p = env.pod(ns, "probed")?.ok_or("the pod vanished")?;
    ensure!(!ready_status(&p), "Ready with nothing on the probe port: {}", p["status"]);
    // A server on the port turns it Ready.
    serve_busybox(env, &id, "probed", 8080)?;
    ready(env, ns, "probed", QUICK)?;
    ensure!(
        env.tcp_from_netns(&ip, 8080, QUICK)?.trim() == "hello-from-probed",
        "the probe port serves something else"
    );
    // Three failed probes (5 s apart) flip it back and the change is pushed.
    let ps = env.guest_sh(&id, "killall -9 nc; sleep 1; ps")?;
    env.wait_pod(ns, "probed", "Ready=False after the server stopped", QUICK, |p| {
        p["status"]["phase"] == "Running" && !ready_status(p)
    })
    .map_err(|e| format!("{e}\nguest processes after killing the server:\n{ps}"))?;
    Ok(())
}

fn vm_deaths(env: &mut Env, ns: &str) -> Outcome {
    // 1. Dies once: started again with the same id and address (Normal VMRestarted).
    env.apply(ns, &sandbox("mortal", run_vm("mortal", BASE, "never")))?;
    let pod = running(env, ns, "mortal")?;
    let (id, ip) = vm_of(env, &pod, "mortal")?;
    ready(env, ns, "mortal", QUICK)?;
    let first = env.instances(&id).first().map(|v| v.pid).ok_or("no instance")?;
    kill_qemu(first)?;
    poll("a VMRestarted event", QUICK, || {
        let ev = env.events(ns, "mortal")?;
        Ok(ev.iter().any(|(t, r, m)| t == "Normal" && r == "VMRestarted" && m.contains(&id)).then_some(()))
    })?;
    let second = poll("a new QEMU for the VM", VM_RUNNING, || {
        Ok(env.instances(&id).first().map(|v| v.pid).filter(|p| *p != first))
    })?;
    let p = ready(env, ns, "mortal", VM_RUNNING)?;
    ensure!(p["status"]["podIP"] == ip.as_str(), "the restarted VM moved from {ip} to {}", p["status"]["podIP"]);
    ensure!(annotation(&p, ID) == Some(id.as_str()), "id changed to {:?}", annotation(&p, ID));
    // 2. Dies again within the 30 s cooldown: removed, Warning RestartCooldown, and the Pod
    // deleted as upstream does, so the Sandbox controller makes a new one on a new VM.
    let old_uid = p["metadata"]["uid"].as_str().unwrap_or_default().to_string();
    kill_qemu(second)?;
    evicted_then_replaced(env, ns, "mortal", "RestartCooldown", &old_uid, &[first, second])?;

    // 3. Vanishes (its hypervisor and every record of it removed behind the node's back): VMGone,
    // and the same.
    env.apply(ns, &sandbox("vanishing", run_vm("vanishing", BASE, "never")))?;
    let pod = running(env, ns, "vanishing")?;
    let old_uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_string();
    let (id, _) = vm_of(env, &pod, "vanishing")?;
    let inst = env.instances(&id);
    let vm = inst.first().ok_or("no instance")?;
    kill_qemu(vm.pid)?;
    let _ = std::fs::remove_dir_all(&vm.dir);
    std::fs::remove_file(env.root.join("cocoon").join(format!("{id}.json")))
        .map_err(|e| format!("removing the record of {id}: {e}"))?;
    evicted_then_replaced(env, ns, "vanishing", "VMGone", &old_uid, &[vm.pid])
}

/// The Pod `name` (UID `old_uid`) was evicted with a Warning `reason`; its Sandbox made a new
/// Pod, which runs on a new VM (none of the `old` QEMU pids).
fn evicted_then_replaced(env: &Env, ns: &str, name: &str, reason: &str, old_uid: &str, old: &[u32]) -> Outcome {
    poll(&format!("a {reason} warning"), QUICK, || {
        let ev = env.events(ns, name)?;
        Ok(ev.iter().any(|(t, r, _)| t == "Warning" && r == reason).then_some(()))
    })?;
    let p = env.wait_pod(ns, name, "a new pod Running", VM_RUNNING, |p| {
        p["metadata"]["uid"] != old_uid && p["status"]["phase"] == "Running"
    })?;
    let (id, _) = vm_of(env, &p, name)?;
    let now = env.instances(&id);
    ensure!(now.len() == 1 && !old.contains(&now[0].pid), "the new pod's VM {id}: {now:?}, old QEMUs {old:?}");
    Ok(())
}

fn other_namespace(env: &mut Env, ns: &str) -> Outcome {
    // A second namespace that does not contain the first one's name (the refusals must not
    // name the owner, so no message may contain `ns`).
    let other = format!("x{}", ns.get(1..).unwrap_or_default());
    env.kubectl_ok(&["create", "namespace", &other])?;
    let result = cross_namespace(env, ns, &other);
    let _ = env.kubectl(&["delete", "namespace", &other, "--wait=false"]);
    result
}

/// vk-cocoon's namespace rule (`namespaces.rs`), with nothing shared (`VK_SHARED_NAMESPACES`
/// unset): a Pod of `other` can neither adopt `ns`'s VM by naming it, nor delete it by
/// deleting itself, nor clone the snapshot its deletion saved, nor boot a VM under its name.
fn cross_namespace(env: &mut Env, ns: &str, other: &str) -> Outcome {
    env.apply(ns, &sandbox("owner", run_vm("ns-owned", BASE, "always")))?;
    let owner = running(env, ns, "owner")?;
    let (id, _) = vm_of(env, &owner, "ns-owned")?;
    let pid = env.instances(&id).first().map(|v| v.pid).ok_or("no instance")?;
    let rec = std::fs::read(env.root.join("cocoon").join(format!("{id}.json"))).map_err(|e| e.to_string())?;
    let rec: Value = serde_json::from_slice(&rec).map_err(|e| e.to_string())?;
    ensure!(rec["namespace"] == ns, "the VM record does not name its namespace {ns}: {rec}");
    let refused = |env: &Env, name: &str, needle: &str| -> Outcome {
        env.wait_provider_failed(other, name, "Pending", QUICK, &[needle, "own namespace", "VK_SHARED_NAMESPACES"])?;
        let events = poll("a NamespaceRefused event", QUICK, || {
            let ev = env.events(other, name)?;
            Ok(ev.iter().any(|(t, r, _)| t == "Warning" && r == "NamespaceRefused").then_some(ev))
        })?;
        ensure!(
            !events.iter().any(|(_, _, m)| m.contains(ns)),
            "an event names the owner's namespace {ns}: {events:?}"
        );
        env.wait_pod(other, name, "lifecycle-state failed", QUICK, |p| annotation(p, LIFECYCLE) == Some("failed"))?;
        Ok(())
    };

    // 1. Naming the live VM does not adopt it (within one namespace it would: same_vm_name).
    env.apply(other, &pod("intruder", run_vm("ns-owned", BASE, "never"), json!({})))?;
    refused(env, "intruder", "VM ns-owned belongs to another namespace")?;
    // 2. Deleting the refused pod leaves the VM alone.
    env.kubectl_ok(&["delete", "pod", "intruder", "-n", other, "--wait=true", "--timeout=60s"])?;
    let inst = env.instances(&id);
    ensure!(inst.len() == 1 && inst[0].pid == pid, "the owner's QEMU {pid} was touched: {inst:?}");
    let p = ready(env, ns, "owner", QUICK)?;
    ensure!(annotation(&p, ID) == Some(id.as_str()), "the owner's id changed to {:?}", annotation(&p, ID));

    // 3. The owner's deletion saves ns-owned:latest, recorded as ns's.
    env.kubectl_ok(&["delete", "sandbox", "owner", "-n", ns, "--wait=true", "--timeout=240s"])?;
    poll("ns-owned:latest saved as the namespace's and the VM removed", Duration::from_secs(240), || {
        let store = env.store()?;
        let owner = match store.lookup("ns-owned:latest") {
            Ok(d) => store.manifest(&d).map_err(|e| e.to_string())?.namespace().map(str::to_owned),
            Err(_) => None,
        };
        let gone = env.instances(&id).is_empty() && !env.has_record(&id);
        Ok((owner.as_deref() == Some(ns) && gone).then_some(()))
    })?;

    // 4. Another namespace cannot clone it, 5. nor boot a VM under its name.
    let mut clone = run_vm("x-clone", "ns-owned", "never");
    clone["cocoonset.cocoonstack.io/mode"] = json!("clone");
    env.apply(other, &pod("cloner", clone, json!({})))?;
    refused(env, "cloner", "snapshot ns-owned:latest belongs to another namespace")?;
    env.apply(other, &pod("squatter", run_vm("ns-owned", BASE, "never"), json!({})))?;
    refused(env, "squatter", "the name ns-owned")?;
    for vm in ["x-clone", "ns-owned"] {
        let id = vm_id(vm);
        ensure!(env.instances(&id).is_empty() && !env.has_record(&id), "a VM {id} was created for another namespace");
    }
    let store = env.store()?;
    let d = store.lookup("ns-owned:latest").map_err(|e| format!("the snapshot is gone: {e}"))?;
    ensure!(store.manifest(&d).map_err(|e| e.to_string())?.namespace() == Some(ns), "the snapshot changed owner");
    env.kubectl_ok(&["delete", "pods", "--all", "-n", other, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

/// Issue #15: what a user's first commands on a cocoon Pod do, through the real API server
/// (`test_infra::kubelet_streams`); `kubectl logs -f` ends when the Pod goes.
fn kubectl_streams(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &pod("streams", run_vm("streams-vm", BASE, "never"), json!({})))?;
    running(env, ns, "streams")?;
    let target = Target { ns, pod: "streams", container: "agent" };
    kubelet_streams::all_checks(env, &target)?;
    let (follow, _lines) = kubelet_streams::follow_start(env, &target)?;
    env.kubectl_ok(&["delete", "pod", "streams", "-n", ns, "--wait=true", "--timeout=120s"])?;
    kubelet_streams::follow_ends(follow)
}

/// Issue #15, bad input: an unknown Pod or container (404 on the kubelet port), a Pod whose VM
/// cannot be made (exec and logs fail at once), the per-Pod stream cap (429), a log far over the
/// console cap, and a VM that dies under an exec and a `logs -f` (both end, no stream leaks).
fn kubectl_bad_inputs(env: &mut Env, ns: &str) -> Outcome {
    env.apply(ns, &pod("bad-target", run_vm("bad-target-vm", BASE, "never"), json!({})))?;
    let mut nameless = run_vm("unused", BASE, "never");
    if let Some(m) = nameless.as_object_mut() {
        m.remove(NAME);
    }
    env.apply(ns, &pod("bad-pending", nameless, json!({})))?;
    running(env, ns, "bad-target")?;
    env.wait_provider_failed(ns, "bad-pending", "Pending", QUICK, &["vm.cocoonstack.io/name is missing"])?;
    let id = vm_id("bad-target-vm");
    let kill_vm = || -> Outcome {
        let pid = env.instances(&id).first().map(|v| v.pid).ok_or(format!("no QEMU for {id}"))?;
        kill_qemu(pid)
    };
    let target = Target { ns, pod: "bad-target", container: "agent" };
    kubelet_streams::bad_input_checks(
        env,
        &kubelet_streams::BadInputs { target, pending: "bad-pending", kill_vm: &kill_vm },
    )
}

/// Deletes Pod `name` (snapshot-policy `always`) and waits for `<vm>:latest` to be saved and
/// the VM to be gone.
fn delete_saving(env: &Env, ns: &str, name: &str, vm: &str) -> Outcome {
    env.kubectl_ok(&["delete", "pod", name, "-n", ns, "--wait=true", "--timeout=240s"])?;
    let snapshot = format!("{vm}:latest");
    poll(&format!("{snapshot} saved and VM {vm} removed"), Duration::from_secs(240), || {
        let store = env.store()?;
        let saved = match store.lookup(&snapshot) {
            Ok(d) => store.manifest(&d).map_err(|e| e.to_string())?.kind() == images::Kind::Snapshot,
            Err(_) => false,
        };
        Ok((saved && env.instances(&vm_id(vm)).is_empty()).then_some(()))
    })
}

/// The value of the sample line starting with `series ` in a scrape.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Issue #18: the snapshot GC (here every 3 s, retention 40 s) removes a snapshot vk-cocoon
/// saved once it is old and nothing refers to it, keeps one a running Pod clones from however
/// old, and the provider's metrics are scraped on `VK_METRICS_ADDR`.
fn snapshot_gc(env: &mut Env, ns: &str) -> Outcome {
    const RETENTION: Duration = Duration::from_secs(40);
    // Unreferenced: gc-old's deletion saves gc-old:latest, and no Pod names it afterwards.
    env.apply(ns, &pod("gc-old", run_vm("gc-old", BASE, "always"), json!({})))?;
    running(env, ns, "gc-old")?;
    delete_saving(env, ns, "gc-old", "gc-old")?;
    // Referenced: gc-src:latest, which the running gc-keeper cloned.
    env.apply(ns, &pod("gc-src", run_vm("gc-src", BASE, "always"), json!({})))?;
    running(env, ns, "gc-src")?;
    delete_saving(env, ns, "gc-src", "gc-src")?;
    let src_saved = std::time::Instant::now();
    let mut keeper = run_vm("gc-keeper", "gc-src", "never");
    keeper["cocoonset.cocoonstack.io/mode"] = json!("clone");
    env.apply(ns, &pod("gc-keeper", keeper, json!({})))?;
    running(env, ns, "gc-keeper")?;

    poll("gc-old:latest removed by the snapshot GC", Duration::from_secs(120), || {
        Ok(env.store()?.lookup("gc-old:latest").is_err().then_some(()))
    })?;
    // Past the retention plus a few passes, gc-src:latest is still there: gc-keeper names it.
    let past = RETENTION + Duration::from_secs(10);
    if let Some(left) = past.checked_sub(src_saved.elapsed()) {
        std::thread::sleep(left);
    }
    let store = env.store()?;
    ensure!(store.lookup("gc-src:latest").is_ok(), "the GC removed gc-src:latest, which gc-keeper clones");
    ensure!(store.lookup("base:latest").is_ok(), "the GC removed the image base");
    let p = ready(env, ns, "gc-keeper", QUICK)?;
    ensure!(p["status"]["phase"] == "Running", "gc-keeper: {}", p["status"]);

    let scrape = env.metrics()?;
    let removed = sample(&scrape, "cocoon_vk_snapshot_gc_removed_total").unwrap_or(0.0);
    ensure!(removed >= 1.0, "cocoon_vk_snapshot_gc_removed_total {removed}:\n{scrape}");
    for series in [
        "cocoon_vk_image_library_bytes{kind=\"image\"}",
        "cocoon_vk_image_library_bytes{kind=\"snapshot\"}",
        "cocoon_vk_pod_lifecycle_total{op=\"create\",result=\"success\"}",
        "cocoon_vk_pod_lifecycle_total{op=\"delete\",result=\"success\"}",
        "cocoon_vk_snapshot_save_total{result=\"success\"}",
        "cocoon_vk_snapshot_gc_runs_total{result=\"success\"}",
        "cocoon_vk_vm_boot_duration_seconds_count{mode=\"clone\",backend=\"qemu\"}",
        "cocoon_vk_vm_table_size",
    ] {
        ensure!(sample(&scrape, series).is_some_and(|v| v > 0.0), "no positive {series} in\n{scrape}");
    }
    Ok(())
}

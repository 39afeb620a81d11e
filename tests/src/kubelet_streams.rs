//! `kubectl logs`, `exec`, `attach` and `port-forward` on a sandbox Pod, as a user runs them
//! (issue #15): the pinned `kubectl`, through the real API server, which proxies the WebSocket
//! upgrades to the node's kubelet port. Both virtual-node suites (vk-sandbox, vk-cocoon) run
//! these checks against one of their Running Pods; the Pod's image must have busybox (`base`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::ensure;
use crate::suite::{poll, poll_every, Outcome, VirtualNode};

/// How long one streaming command may take (TCG guests are slow to fork).
const STEP: Duration = Duration::from_secs(60);

/// A Pod of the suite and the container `kubectl` names.
pub struct Target<'a> {
    pub ns: &'a str,
    pub pod: &'a str,
    pub container: &'a str,
}

impl Target<'_> {
    fn args<'b>(&'b self, verb: &'b str, extra: &[&'b str]) -> Vec<&'b str> {
        let mut a = vec![verb, "-n", self.ns, self.pod, "-c", self.container];
        a.extend_from_slice(extra);
        a
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `kubectl exec pod -c c -- argv…` with no stdin; the whole output.
fn exec(node: &VirtualNode, t: &Target, argv: &[&str]) -> Result<Output, String> {
    let mut args = t.args("exec", &["--"]);
    args.extend_from_slice(argv);
    node.kubectl(&args).map_err(|e| format!("kubectl exec: {e}"))
}

/// Runs `argv` in the Pod and expects exit 0; its stdout.
fn exec_ok(node: &VirtualNode, t: &Target, argv: &[&str]) -> Result<String, String> {
    let out = exec(node, t, argv)?;
    ensure!(out.status.success(), "kubectl exec {argv:?}: {}", text(&out));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl exec`: output, stderr apart from stdout, exit codes, stdin piped through `cat`
/// (10 MiB, byte-exact), an unknown container.
pub fn exec_checks(node: &VirtualNode, t: &Target) -> Outcome {
    ensure!(exec_ok(node, t, &["echo", "hello"])? == "hello\n", "echo through kubectl exec");
    let out = exec(node, t, &["sh", "-c", "echo out; echo err >&2"])?;
    ensure!(out.status.success(), "{}", text(&out));
    ensure!(out.stdout == b"out\n" && out.stderr == b"err\n", "stdout and stderr kept apart: {}", text(&out));
    let out = exec(node, t, &["sh", "-c", "exit 3"])?;
    ensure!(out.status.code() == Some(3), "`sh -c 'exit 3'` must make kubectl exit 3: {}", text(&out));

    // 10 MiB of random bytes through `cat`, byte-exact.
    let data: Vec<u8> = (0..10 << 20).map(|_| rand::random::<u8>()).collect();
    let mut child = node
        .cluster
        .kubectl()
        .args(t.args("exec", &["-i", "--", "cat"]))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("kubectl exec -i: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let writer = {
        let data = data.clone();
        std::thread::spawn(move || stdin.write_all(&data))
    };
    let out = wait_with_timeout(child, Duration::from_secs(300))?;
    writer.join().map_err(|_| "stdin writer panicked")?.map_err(|e| format!("writing stdin: {e}"))?;
    ensure!(
        out.status.success(),
        "kubectl exec -i cat: exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        Sha256::digest(&out.stdout) == Sha256::digest(&data),
        "10 MiB through cat came back different: {} bytes of {}",
        out.stdout.len(),
        data.len()
    );

    let out = node.kubectl(&["exec", "-n", t.ns, t.pod, "-c", "nosuch", "--", "true"]).map_err(|e| e.to_string())?;
    ensure!(!out.status.success(), "exec into an unknown container succeeded");
    ensure!(String::from_utf8_lossy(&out.stderr).contains("nosuch"), "the error names the container: {}", text(&out));
    Ok(())
}

/// `kubectl logs`: the console (a line the guest writes to /dev/console shows), `--tail`,
/// `--timestamps`, `--limit-bytes`, `--previous` refused, `-f` sees a new line.
pub fn logs_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let mark = format!("chrysalis-log-mark-{}", rand::random::<u32>());
    exec_ok(node, t, &["sh", "-c", &format!("echo {mark} > /dev/console")])?;
    let logs = poll("the mark in kubectl logs", STEP, || {
        let out = node.kubectl(&t.args("logs", &[])).map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "kubectl logs: {}", text(&out));
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(s.contains(&mark).then_some(s))
    })?;
    ensure!(logs.lines().count() > 1, "the console has more than the mark: {logs}");

    let tail = node.kubectl_ok(&t.args("logs", &["--tail=1"]))?;
    ensure!(tail.lines().count() == 1, "--tail=1 gave {} lines: {tail:?}", tail.lines().count());
    let stamped = node.kubectl_ok(&t.args("logs", &["--tail=2", "--timestamps"]))?;
    for line in stamped.lines() {
        let stamp = line.split(' ').next().unwrap_or_default();
        ensure!(stamp.len() >= 20 && stamp.ends_with('Z') && stamp.contains('T'), "no RFC 3339 stamp on {line:?}");
    }
    let limited = node.kubectl(&t.args("logs", &["--limit-bytes=10"])).map_err(|e| e.to_string())?;
    ensure!(limited.status.success() && limited.stdout.len() == 10, "--limit-bytes=10: {}", text(&limited));
    let since = node.kubectl_ok(&t.args("logs", &["--since=1h"]))?;
    ensure!(since.contains(&mark), "--since=1h lost the mark");

    let previous = node.kubectl(&t.args("logs", &["--previous"])).map_err(|e| e.to_string())?;
    ensure!(!previous.status.success(), "--previous succeeded on a VM");
    ensure!(String::from_utf8_lossy(&previous.stderr).contains("previous"), "--previous: {}", text(&previous));

    // -f: a line written after it started arrives.
    let (mut follow, lines) = spawn_lines(node, &t.args("logs", &["-f", "--tail=0"]))?;
    let late = format!("chrysalis-follow-mark-{}", rand::random::<u32>());
    let seen = (|| -> Result<bool, String> {
        let until = Instant::now() + STEP;
        // kubectl may not follow yet when the line is written (`--tail=0` then skips it): the
        // mark is written again every few seconds until one arrives.
        while Instant::now() < until {
            exec_ok(node, t, &["sh", "-c", &format!("echo {late} > /dev/console")])?;
            let round = (Instant::now() + Duration::from_secs(3)).min(until);
            while let Some(left) = round.checked_duration_since(Instant::now()) {
                match lines.recv_timeout(left) {
                    Ok(line) if line.contains(&late) => return Ok(true),
                    Ok(_) => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(false),
                }
            }
        }
        Ok(false)
    })();
    let _ = follow.kill();
    let _ = follow.wait();
    ensure!(seen?, "kubectl logs -f did not show a line written while it followed");
    Ok(())
}

/// Starts `kubectl logs -f` and returns it with its lines; the caller deletes the Pod and
/// calls [`follow_ends`].
pub fn follow_start(node: &VirtualNode, t: &Target) -> Result<(Child, mpsc::Receiver<String>), String> {
    spawn_lines(node, &t.args("logs", &["-f", "--tail=1"]))
}

/// `kubectl logs -f` ends by itself once its Pod is gone.
pub fn follow_ends(mut child: Child) -> Outcome {
    wait_status(&mut child, STEP).map(drop)
}

/// `kubectl exec -it` under a pseudo-terminal: `stty size` in the guest sees the terminal's
/// size, then the new size after a resize.
pub fn exec_tty_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let (master, slave) = open_pty(30, 100)?;
    let mut child = node
        .cluster
        .kubectl()
        .args(t.args("exec", &["-it", "--", "sh"]))
        .stdin(Stdio::from(slave.try_clone().map_err(|e| e.to_string())?))
        .stdout(Stdio::from(slave.try_clone().map_err(|e| e.to_string())?))
        .stderr(Stdio::from(slave))
        .spawn()
        .map_err(|e| format!("kubectl exec -it: {e}"))?;
    let out = pty_reader(master.try_clone().map_err(|e| e.to_string())?);
    let mut input = std::fs::File::from(master.try_clone().map_err(|e| e.to_string())?);
    let result = (|| -> Outcome {
        input.write_all(b"stty size\n").map_err(|e| e.to_string())?;
        wait_for(&out, "30 100", STEP)?;
        rustix::termios::tcsetwinsize(master.as_fd(), winsize(40, 120)).map_err(|e| e.to_string())?;
        // kubectl reads the new size on SIGWINCH (the kernel sends it only to a terminal's
        // foreground group; kubectl is not in one here, so it is sent by hand).
        let pid = rustix::process::Pid::from_raw(child.id() as i32).ok_or("pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::WINCH).map_err(|e| e.to_string())?;
        let until = Instant::now() + STEP;
        loop {
            input.write_all(b"stty size\n").map_err(|e| e.to_string())?;
            if wait_for(&out, "40 120", Duration::from_secs(3)).is_ok() {
                break;
            }
            ensure!(Instant::now() < until, "stty size never saw the resize to 40x120");
        }
        input.write_all(b"exit 7\n").map_err(|e| e.to_string())?;
        Ok(())
    })();
    if result.is_err() {
        let _ = child.kill();
    }
    let status = wait_status(&mut child, STEP)?;
    result?;
    ensure!(status.code() == Some(7), "kubectl exec -it: `exit 7` gave {:?}", status.code());
    Ok(())
}

/// `kubectl port-forward` to a busybox httpd in the guest: a real HTTP request and its body.
pub fn port_forward_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let body = format!("chrysalis-port-forward-{}", rand::random::<u32>());
    exec_ok(
        node,
        t,
        &[
            "sh",
            "-c",
            &format!("mkdir -p /tmp/www && echo {body} > /tmp/www/index.html && busybox httpd -p 8080 -h /tmp/www"),
        ],
    )?;
    let mut pf = node
        .cluster
        .kubectl()
        .args(["port-forward", "-n", t.ns, &format!("pod/{}", t.pod), ":8080"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("kubectl port-forward: {e}"))?;
    let lines = reader_lines(pf.stdout.take().ok_or("no stdout")?);
    let result = (|| -> Outcome {
        // "Forwarding from 127.0.0.1:41235 -> 8080"
        let line = lines.recv_timeout(STEP).map_err(|_| "kubectl port-forward printed no address")?;
        let port = forwarded_port(&line).ok_or(format!("no local port in {line:?}"))?;
        for _ in 0..2 {
            let got = http_get(port)?;
            ensure!(got.starts_with("HTTP/1") && got.contains(&body), "HTTP through port-forward: {got:?}");
        }
        Ok(())
    })();
    let _ = pf.kill();
    let _ = pf.wait();
    result
}

/// `kubectl attach`: the live console on stdout; `-i` is refused with a message.
pub fn attach_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let (mut attach, lines) = spawn_lines(node, &t.args("attach", &[]))?;
    let mark = format!("chrysalis-attach-mark-{}", rand::random::<u32>());
    let seen = (|| -> Result<bool, String> {
        let until = Instant::now() + STEP;
        // Give the attach a moment to be established, then write until it shows.
        while Instant::now() < until {
            exec_ok(node, t, &["sh", "-c", &format!("echo {mark} > /dev/console")])?;
            if let Ok(line) = lines.recv_timeout(Duration::from_secs(2)) {
                if line.contains(&mark) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    })();
    let _ = attach.kill();
    let _ = attach.wait();
    ensure!(seen?, "kubectl attach did not show the console");
    let out = node.kubectl(&t.args("attach", &["-i"])).map_err(|e| e.to_string())?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("exec -it"),
        "attach -i: {}",
        text(&out)
    );
    Ok(())
}

/// `kubectl top pod` and `kubectl top node` through metrics-server (the cluster runs it):
/// numbers for the Pod's VM and for the node, scraped from the node's `/metrics/resource`.
pub fn top_checks(node: &VirtualNode, t: &Target) -> Outcome {
    // metrics-server scrapes every 10 s and needs two samples for a CPU rate.
    let within = Duration::from_secs(120);
    let pod = poll_every("kubectl top pod", within, Duration::from_secs(3), || {
        let out = node.kubectl(&["top", "pod", t.pod, "-n", t.ns, "--no-headers"]).map_err(|e| e.to_string())?;
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok((out.status.success() && s.starts_with(t.pod)).then_some(s))
    })?;
    let cols: Vec<&str> = pod.split_whitespace().collect();
    ensure!(cols.len() >= 3 && cols[1].ends_with('m') && cols[2].ends_with("Mi"), "kubectl top pod: {pod:?}");
    let top_node = poll_every("kubectl top node", within, Duration::from_secs(3), || {
        let out = node.kubectl(&["top", "node", &node.node_name, "--no-headers"]).map_err(|e| e.to_string())?;
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok((out.status.success() && s.starts_with(node.node_name.as_str())).then_some(s))
    })?;
    ensure!(top_node.contains('m') && top_node.contains("Mi"), "kubectl top node: {top_node:?}");
    Ok(())
}

/// Every check, in an order that leaves the Pod as it found it (an httpd keeps running).
pub fn all_checks(node: &VirtualNode, t: &Target) -> Outcome {
    exec_checks(node, t)?;
    logs_checks(node, t)?;
    exec_tty_checks(node, t)?;
    attach_checks(node, t)?;
    port_forward_checks(node, t)?;
    top_checks(node, t)
}

// ---------------------------------------------------------------------------------------------

/// The local port in `kubectl port-forward`'s first line ("Forwarding from 127.0.0.1:41235 -> 8080").
pub fn forwarded_port(line: &str) -> Option<u16> {
    line.split("127.0.0.1:").nth(1)?.split(' ').next()?.parse().ok()
}

fn http_get(port: u16) -> Result<String, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect :{port}: {e}"))?;
    s.set_read_timeout(Some(STEP)).map_err(|e| e.to_string())?;
    s.write_all(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n").map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    s.read_to_end(&mut got).map_err(|e| format!("reading the reply: {e}"))?;
    Ok(String::from_utf8_lossy(&got).into_owned())
}

/// `kubectl args…` running in the background, its stdout as lines (stderr dropped).
fn spawn_lines(node: &VirtualNode, args: &[&str]) -> Result<(Child, mpsc::Receiver<String>), String> {
    let mut child = node
        .cluster
        .kubectl()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("kubectl {}: {e}", args.first().unwrap_or(&"")))?;
    let lines = reader_lines(child.stdout.take().ok_or("no stdout")?);
    Ok((child, lines))
}

fn reader_lines(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The pty's output as it arrives, in chunks.
fn pty_reader(master: OwnedFd) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(master);
        let mut buf = [0u8; 4096];
        loop {
            match f.read(&mut buf) {
                Ok(n) if n > 0 && tx.send(buf[..n].to_vec()).is_ok() => {}
                _ => break,
            }
        }
    });
    rx
}

fn wait_for(out: &mpsc::Receiver<Vec<u8>>, needle: &str, within: Duration) -> Outcome {
    let until = Instant::now() + within;
    let mut seen = Vec::new();
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match out.recv_timeout(left) {
            Ok(chunk) => {
                seen.extend_from_slice(&chunk);
                if String::from_utf8_lossy(&seen).contains(needle) {
                    return Ok(());
                }
            }
            Err(_) => break,
        }
    }
    Err(format!("{needle:?} not seen on the terminal; it showed {:?}", String::from_utf8_lossy(&seen)))
}

fn winsize(rows: u16, cols: u16) -> rustix::termios::Winsize {
    rustix::termios::Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 }
}

/// A pseudo-terminal of `rows` x `cols`: (master, slave).
fn open_pty(rows: u16, cols: u16) -> Result<(OwnedFd, OwnedFd), String> {
    use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).map_err(|e| format!("openpt: {e}"))?;
    grantpt(&master).map_err(|e| format!("grantpt: {e}"))?;
    unlockpt(&master).map_err(|e| format!("unlockpt: {e}"))?;
    let name = ptsname(&master, Vec::new()).map_err(|e| format!("ptsname: {e}"))?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| format!("open {name:?}: {e}"))?;
    rustix::termios::tcsetwinsize(&slave, winsize(rows, cols)).map_err(|e| e.to_string())?;
    Ok((master, slave))
}

fn wait_status(child: &mut Child, within: Duration) -> Result<std::process::ExitStatus, String> {
    let until = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            return Ok(s);
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("kubectl did not end within {within:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for `child` (its stdout and stderr piped), killing it after `within`: its output and
/// whether it was killed.
fn wait_bounded(mut child: Child, within: Duration) -> Result<(Output, bool), String> {
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let read = |s: Option<&mut dyn Read>| {
        let mut v = Vec::new();
        if let Some(s) = s {
            let _ = s.read_to_end(&mut v);
        }
        v
    };
    let out_t = std::thread::spawn(move || read(stdout.as_mut().map(|s| s as &mut dyn Read)));
    let err_t = std::thread::spawn(move || read(stderr.as_mut().map(|s| s as &mut dyn Read)));
    let until = Instant::now() + within;
    let (status, killed) = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break (s, false);
        }
        if Instant::now() > until {
            let _ = child.kill();
            break (child.wait().map_err(|e| e.to_string())?, true);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_t.join().map_err(|_| "stdout reader panicked")?;
    let stderr = err_t.join().map_err(|_| "stderr reader panicked")?;
    Ok((Output { status, stdout, stderr }, killed))
}

/// Waits for `child` (its stdout and stderr piped), killing it after `within`.
fn wait_with_timeout(mut child: Child, within: Duration) -> Result<Output, String> {
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.read_to_end(&mut v);
        }
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.read_to_end(&mut v);
        }
        v
    });
    let status = wait_status(&mut child, within)?;
    let stdout = out_t.join().map_err(|_| "stdout reader panicked")?;
    let stderr = err_t.join().map_err(|_| "stderr reader panicked")?;
    Ok(Output { status, stdout, stderr })
}

// ---------------------------------------------------------------------------------------------
// Bad input (issue #15 item 5)

/// What the bad-input checks need besides a Running Pod.
pub struct BadInputs<'a> {
    /// A Running Pod of the node; its VM is killed by the last check.
    pub target: Target<'a>,
    /// A Pod bound to the node that is not Running (its VM cannot be made).
    pub pending: &'a str,
    /// Kills the target's VM (its hypervisor process), as if it died on its own.
    pub kill_vm: &'a dyn Fn() -> Outcome,
}

/// How fast a refusal must come back (a hang is a failure).
const FAST: Duration = Duration::from_secs(20);
/// How long a stream may take to end once its VM is gone.
const ENDS: Duration = Duration::from_secs(60);

/// Every bad-input check, in an order that leaves the target's VM for last (it is killed).
pub fn bad_input_checks(node: &VirtualNode, b: &BadInputs) -> Outcome {
    unknown_pod_checks(node, &b.target)?;
    not_running_checks(node, b.target.ns, b.pending)?;
    per_pod_cap_checks(node, &b.target)?;
    huge_log_checks(node, &b.target)?;
    vm_death_checks(node, &b.target, b.kill_vm)
}

/// The node's `vnode_stream_sessions_open` gauge, read from its `/metrics`.
pub fn open_streams(node: &VirtualNode) -> Result<u64, String> {
    let (code, body) = node.kubelet_get("/metrics")?;
    ensure!(code == 200, "GET /metrics: {code} {body}");
    body.lines()
        .find_map(|l| l.strip_prefix("vnode_stream_sessions_open "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(format!("no vnode_stream_sessions_open in /metrics:\n{body}"))
}

fn wait_open_streams(node: &VirtualNode, want: u64, within: Duration) -> Outcome {
    let mut last = None;
    poll(&format!("{want} open streams on the node"), within, || {
        let n = open_streams(node)?;
        last = Some(n);
        Ok((n == want).then_some(()))
    })
    .map_err(|e| format!("{e} (last read: {last:?})"))
}

/// An unknown Pod or container, on the node's own kubelet port (what the API server sends it):
/// 404 with a message naming it, for logs and exec.
pub fn unknown_pod_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let ns = t.ns;
    for path in [
        format!("/containerLogs/{ns}/nosuch-pod/{}", t.container),
        format!("/exec/{ns}/nosuch-pod/{}?command=true&stdout=1", t.container),
        format!("/attach/{ns}/nosuch-pod/{}?stdout=1", t.container),
        format!("/portForward/{ns}/nosuch-pod"),
        format!("/containerLogs/{ns}/{}/nosuch-container", t.pod),
        format!("/exec/{ns}/{}/nosuch-container?command=true&stdout=1", t.pod),
    ] {
        let (code, body) = node.kubelet_get(&path)?;
        ensure!(code == 404, "GET {path}: {code} {body:?}, want 404");
        ensure!(body.contains("nosuch-"), "GET {path}: the 404 does not name what is missing: {body:?}");
    }
    // And through the API server, a container typo in logs.
    let out = node.kubectl(&["logs", "-n", ns, t.pod, "-c", "nosuch"]).map_err(|e| e.to_string())?;
    ensure!(!out.status.success(), "kubectl logs -c nosuch succeeded");
    ensure!(String::from_utf8_lossy(&out.stderr).contains("nosuch"), "kubectl logs -c nosuch: {}", text(&out));
    Ok(())
}

/// `kubectl exec` and `kubectl logs` on a Pod bound to the node that is not Running fail at
/// once, saying it is not Running (with the Pod's status reason). `kubectl logs -f` prints that
/// error at once too, then keeps retrying every second by its own design (as it does against a
/// kubelet's "waiting to start"), so it is stopped after the message shows.
pub fn not_running_checks(node: &VirtualNode, ns: &str, pending: &str) -> Outcome {
    let container = "agent";
    for args in [
        vec!["exec", "-n", ns, pending, "-c", container, "--", "true"],
        vec!["exec", "-i", "-n", ns, pending, "-c", container, "--", "cat"],
        vec!["logs", "-n", ns, pending, "-c", container],
        vec!["logs", "-f", "-n", ns, pending, "-c", container],
        vec!["attach", "-n", ns, pending, "-c", container],
    ] {
        let started = Instant::now();
        let child = node
            .cluster
            .kubectl()
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("kubectl {args:?}: {e}"))?;
        let follow = args.contains(&"-f");
        let (out, timed_out) = wait_bounded(child, if follow { Duration::from_secs(5) } else { FAST })?;
        let took = started.elapsed();
        ensure!(follow || !timed_out, "kubectl {args:?} on a Pending Pod did not end within {FAST:?}: {}", text(&out));
        ensure!(!out.status.success(), "kubectl {args:?} on a Pending Pod succeeded: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains("not Running") || err.contains("is waiting to start") || err.contains("Pending"),
            "kubectl {args:?} on a Pending Pod: no clear message: {}",
            text(&out)
        );
        let first = err.lines().next().unwrap_or_default();
        eprintln!("kubectl {} on a Pending Pod: {took:?} (killed: {timed_out}): {first}", args.join(" "));
    }
    Ok(())
}

/// The per-Pod cap (the provider's `--max-streams-per-pod` / `VK_MAX_STREAMS_PER_POD`): that
/// many `kubectl exec` sessions run; the next is refused with 429 "too many"; once they end, the
/// slots are free (an exec works, the gauge is back to 0).
pub fn per_pod_cap_checks(node: &VirtualNode, t: &Target) -> Outcome {
    let cap: usize = node
        .provider
        .setting("--max-streams-per-pod", "VK_MAX_STREAMS_PER_POD")
        .ok_or("the suite must set the per-Pod stream cap low")?
        .parse()
        .map_err(|e| format!("the per-Pod stream cap: {e}"))?;
    wait_open_streams(node, 0, FAST)?;
    let mut held = Vec::new();
    let result = (|| -> Outcome {
        for i in 0..cap {
            let mark = format!("held-{i}");
            let (child, lines) =
                spawn_lines(node, &t.args("exec", &["--", "sh", "-c", &format!("echo {mark}; sleep 600")]))?;
            held.push(child);
            let line = lines.recv_timeout(STEP).map_err(|_| format!("exec {i} of {cap} printed nothing"))?;
            ensure!(line == mark, "exec {i} of {cap} printed {line:?}");
        }
        ensure!(open_streams(node)? == cap as u64, "{cap} execs, gauge {}", open_streams(node)?);
        let started = Instant::now();
        let out = exec(node, t, &["true"])?;
        ensure!(!out.status.success(), "exec number {} on a Pod capped at {cap} succeeded", cap + 1);
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains("open streaming sessions") && err.contains(&format!("already has {cap}")),
            "the exec over the cap does not say why: {}",
            text(&out)
        );
        ensure!(started.elapsed() < FAST, "the refusal took {:?}", started.elapsed());
        eprintln!("exec over the per-Pod cap of {cap}: {}", err.trim());
        Ok(())
    })();
    for mut c in held {
        let _ = c.kill();
        let _ = c.wait();
    }
    result?;
    wait_open_streams(node, 0, ENDS)?;
    ensure!(exec_ok(node, t, &["echo", "freed"])? == "freed\n", "an exec after the cap was reached");
    Ok(())
}

/// The console cap, KiB, of the suites' nodes (sandboxd's `console_log_kib`, vk-cocoon's
/// `VK_CONSOLE_LOG_KIB`): small, so [`huge_log_checks`] passes it by writing little.
pub const SUITE_CONSOLE_KIB: u64 = 64;

/// A log much larger than the console cap: `--limit-bytes` gives exactly that many bytes, a
/// whole `kubectl logs` is bounded by the cap, and the provider's memory stays bounded.
pub fn huge_log_checks(node: &VirtualNode, t: &Target) -> Outcome {
    // The suites' console cap (on disk, stamps included, 31 bytes a line, in two halves; after
    // a rotation between a half and all of it is kept). Small, so that the guest writes three
    // times it quickly under TCG.
    const CAP: usize = (SUITE_CONSOLE_KIB * 1024) as usize;
    const LINES: usize = 3 * CAP / 100;
    const RSS_GROWTH: u64 = 64 << 20;
    let pid = node.provider.pid().ok_or("the provider is not running")?;
    let rss = || -> Result<u64, String> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or("no VmRSS".into())
    };
    let before = rss()?;
    // Three caps of 100-byte lines on the console (busybox: no `yes | head -c` needed).
    let started = Instant::now();
    let end = format!("chrysalis-huge-end-{}", rand::random::<u32>());
    exec_ok(
        node,
        t,
        &[
            "sh",
            "-c",
            &format!(
                "l=$(printf '%099d' 0); i=0; while [ $i -lt {LINES} ]; do echo $l; i=$((i+1)); done > /dev/console; \
                 echo {end} > /dev/console"
            ),
        ],
    )?;
    let wrote = started.elapsed();
    let all = poll("the end of the huge log", STEP, || {
        let out = node.kubectl(&t.args("logs", &[])).map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "kubectl logs: {}", text(&out));
        Ok(String::from_utf8_lossy(&out.stdout).contains(&end).then_some(out.stdout))
    })?;
    ensure!(all.len() <= CAP, "a whole kubectl logs gave {} bytes, more than the console keeps ({CAP})", all.len());
    ensure!(
        all.len() >= CAP / 4,
        "a whole kubectl logs gave only {} bytes after {} KiB were written",
        all.len(),
        3 * CAP / 1024
    );
    // Each under what is surely kept: at least CAP / 4 (checked above).
    for n in [1usize, 4096, CAP / 4] {
        let out = node.kubectl(&t.args("logs", &[&format!("--limit-bytes={n}")])).map_err(|e| e.to_string())?;
        ensure!(out.status.success(), "--limit-bytes={n}: {}", text(&out));
        ensure!(out.stdout.len() == n, "--limit-bytes={n} gave {} bytes", out.stdout.len());
    }
    // A limit over what is kept gives what is kept.
    let out = node.kubectl(&t.args("logs", &[&format!("--limit-bytes={}", 4 * CAP)])).map_err(|e| e.to_string())?;
    ensure!(out.status.success() && out.stdout.len() <= CAP, "--limit-bytes=4Mi: {} bytes", out.stdout.len());
    let after = rss()?;
    ensure!(
        after <= before + RSS_GROWTH,
        "the provider's RSS grew from {before} to {after} bytes serving a huge log (bound: +{RSS_GROWTH})"
    );
    eprintln!(
        "huge log: {} KiB written in {wrote:?}; kubectl logs {} bytes; provider RSS {} -> {} KiB",
        3 * CAP / 1024,
        all.len(),
        before / 1024,
        after / 1024
    );
    Ok(())
}

/// A VM that dies under a `kubectl exec` and a `kubectl logs -f`: both end within [`ENDS`], the
/// exec with an error, and the node's open streams go back to 0.
pub fn vm_death_checks(node: &VirtualNode, t: &Target, kill_vm: &dyn Fn() -> Outcome) -> Outcome {
    wait_open_streams(node, 0, FAST)?;
    let (mut exec_child, exec_lines) = spawn_lines(node, &t.args("exec", &["--", "sh", "-c", "echo up; sleep 600"]))?;
    let (mut follow, _lines) = spawn_lines(node, &t.args("logs", &["-f", "--tail=1"]))?;
    let result = (|| -> Outcome {
        let line = exec_lines.recv_timeout(STEP).map_err(|_| "the exec printed nothing")?;
        ensure!(line == "up", "the exec printed {line:?}");
        wait_open_streams(node, 2, STEP)?;
        kill_vm()?;
        let killed = Instant::now();
        let exec_status = wait_status(&mut exec_child, ENDS).map_err(|e| format!("exec on a dead VM: {e}"))?;
        let follow_status = wait_status(&mut follow, ENDS).map_err(|e| format!("logs -f on a dead VM: {e}"))?;
        eprintln!("VM killed: exec ended {exec_status} , logs -f ended {follow_status}, within {:?}", killed.elapsed());
        ensure!(!exec_status.success(), "kubectl exec on a VM that died exited 0");
        wait_open_streams(node, 0, ENDS)
    })();
    for c in [&mut exec_child, &mut follow] {
        let _ = c.kill();
        let _ = c.wait();
    }
    result
}

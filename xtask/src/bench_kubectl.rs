//! `cargo xtask bench vnode`, the kubectl part (issue #15): on one Running sandbox Pod of the
//! vk-sandbox node,
//! - `kubectl exec -- true` round trips (the whole command: kubectl starts, the API server
//!   proxies its WebSocket to the node's kubelet port, the node dials the VM's agent through
//!   sandboxd, `true` runs, the exit status comes back), beside the same `true` through the
//!   public Python SDK against sandboxd (one client, its connection kept alive);
//! - `kubectl port-forward` throughput: one HTTP download from a busybox httpd in the VM.

use crate::bench::{ms, percentile, Figure};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use test_infra::vk_sandbox::NodeEnv;

/// Size of the file `kubectl port-forward` carries.
const PULL_MIB: usize = 32;
/// The guest port the httpd serves on.
const HTTPD_PORT: u16 = 8090;

/// The SDK side: `runs` `sb.exec("true")` on one claimed sandbox; prints one duration (seconds)
/// per line.
const SDK_SCRIPT: &str = r#"
import sys, time
from cocoonsandbox import APIError, Client
addr, token, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = Client(addr, api_token=token, timeout=60)
until = time.monotonic() + 120
while True:
    try:
        sb = client.new("base", ttl_seconds=600, claim_ref="bench-kubectl")
        break
    except APIError as e:  # 429 while the pool refills
        if e.status != 429 or time.monotonic() > until:
            raise
        time.sleep(0.2)
with sb:
    sb.exec("true")
    for _ in range(runs):
        t0 = time.perf_counter()
        sb.exec("true")
        print(time.perf_counter() - t0, flush=True)
"#;

/// Runs the figures on the Pod `pod` (container `agent`) in `ns`, which must be Running.
pub fn measure(env: &NodeEnv, figures: &mut Vec<Figure>, ns: &str, pod: &str, runs: usize) -> Result<()> {
    let kubectl_exec = |argv: &[&str]| -> Result<std::process::Output> {
        let mut args = vec!["exec", "-n", ns, pod, "-c", "agent", "--"];
        args.extend_from_slice(argv);
        env.kubectl(&args).context("running kubectl exec")
    };
    // One untimed run first (kubectl's discovery cache, the node's first agent dial).
    let first = kubectl_exec(&["true"])?;
    if !first.status.success() {
        bail!("kubectl exec -- true: {}", String::from_utf8_lossy(&first.stderr));
    }
    let mut lat = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        let out = kubectl_exec(&["true"])?;
        lat.push(t0.elapsed());
        if !out.status.success() {
            bail!("kubectl exec -- true: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    lat.sort();
    figures.push(Figure {
        name: format!("kubectl exec -- true, whole command (n={runs}) p50"),
        value: ms(percentile(&lat, 0.5)),
        target: "(report; beside the SDK below: the difference is kubectl's start, the API server hop and TLS)",
    });

    let sdk = sdk_exec(env, runs)?;
    figures.push(Figure {
        name: format!("the same `true` through the Python SDK (n={runs}) p50"),
        value: ms(percentile(&sdk, 0.5)),
        target: "(report; SDK 0.1.19 straight to sandboxd, connection kept alive)",
    });

    let (bytes, took) = port_forward_pull(env, ns, pod, &kubectl_exec)?;
    figures.push(Figure {
        name: format!("kubectl port-forward, one {PULL_MIB} MiB HTTP download"),
        value: format!("{:.1} MiB/s", bytes as f64 / (1 << 20) as f64 / took.as_secs_f64().max(1e-9)),
        target: "(report; API server WebSocket → SPDY → agent port stream)",
    });
    Ok(())
}

/// The SDK's round trips, sorted.
fn sdk_exec(env: &NodeEnv, runs: usize) -> Result<Vec<Duration>> {
    let python = crate::python::ensure_sdk_venv()?;
    let out = Command::new(python)
        .args(["-c", SDK_SCRIPT, &env.sandboxd.addr, test_infra::sandboxd::TOKEN, &runs.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("running the SDK script")?;
    if !out.status.success() {
        bail!("the SDK exec script failed ({})", out.status);
    }
    let mut lat: Vec<Duration> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .collect();
    if lat.len() != runs {
        bail!("the SDK script printed {} durations, not {runs}", lat.len());
    }
    lat.sort();
    Ok(lat)
}

/// Serves a file of [`PULL_MIB`] MiB from the guest and downloads it once through
/// `kubectl port-forward`: (body bytes, time from the request to the last byte).
fn port_forward_pull(
    env: &NodeEnv,
    ns: &str,
    pod: &str,
    kubectl_exec: &dyn Fn(&[&str]) -> Result<std::process::Output>,
) -> Result<(usize, Duration)> {
    let serve = format!(
        "mkdir -p /tmp/pf && dd if=/dev/zero of=/tmp/pf/blob bs=1048576 count={PULL_MIB} 2>/dev/null && busybox httpd -p {HTTPD_PORT} -h /tmp/pf"
    );
    let out = kubectl_exec(&["sh", "-c", &serve])?;
    if !out.status.success() {
        bail!("starting the guest httpd: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut pf = env
        .cluster
        .kubectl()
        .args(["port-forward", "-n", ns, &format!("pod/{pod}"), &format!(":{HTTPD_PORT}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("kubectl port-forward")?;
    let stderr = pf.stderr.take();
    let result = (|| {
        // "Forwarding from 127.0.0.1:41235 -> 8090"
        // kubectl writes a line per connection: its stdout is drained to the end (a closed pipe
        // would kill it mid-transfer).
        let mut lines = BufReader::new(pf.stdout.take().context("no stdout")?).lines();
        let line = lines.next().context("kubectl port-forward printed nothing")??;
        std::thread::spawn(move || lines.for_each(drop));
        let port =
            test_infra::kubelet_streams::forwarded_port(&line).ok_or_else(|| anyhow!("no local port in {line:?}"))?;
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(300)))?;
        let t0 = Instant::now();
        s.write_all(b"GET /blob HTTP/1.0\r\nHost: x\r\n\r\n")?;
        let mut got = Vec::with_capacity((PULL_MIB << 20) + 4096);
        if let Err(e) = s.read_to_end(&mut got) {
            bail!("after {} bytes in {:?}: {e}", got.len(), t0.elapsed());
        }
        let took = t0.elapsed();
        let body = got.windows(4).position(|w| w == b"\r\n\r\n").map(|i| got.len() - i - 4).unwrap_or(0);
        if body != PULL_MIB << 20 {
            bail!("port-forward carried {body} body bytes, not {}", PULL_MIB << 20);
        }
        Ok((body, took))
    })();
    let _ = pf.kill();
    let _ = pf.wait();
    result.with_context(|| {
        let mut said = String::new();
        if let Some(mut e) = stderr {
            let _ = e.read_to_string(&mut said);
        }
        format!("kubectl port-forward said: {}", said.trim())
    })
}

//! `GET /metrics/resource`: the node's, Pods' and containers' CPU and memory in the Prometheus
//! text format (version 0.0.4), the names, labels and millisecond sample timestamps a kubelet
//! writes (`pkg/kubelet/metrics/collectors/resource_metrics.go` in kubernetes v1.37) and
//! metrics-server v0.8 reads (`pkg/scraper/client/resource/decode.go`: it keys on the
//! families' names and the `container`, `pod` and `namespace` labels, takes CPU in seconds and
//! drops a container whose CPU or memory is 0).
//!
//! Written by hand rather than with `prometheus-client`, which cannot put a timestamp on a
//! sample; every label value goes through [`escape`]. Families come sorted by name, as a Go
//! registry gathers them.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use super::summary::NodeSample;
use super::usage::PodUsage;

/// The content type the text is served with.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value with `\`, `"` and newlines escaped.
pub fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn millis(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

fn seconds(nanos: u64) -> f64 {
    nanos as f64 / 1e9
}

/// One family: its help, type and samples (`labels`, value, timestamp).
struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    samples: Vec<(String, f64, Option<SystemTime>)>,
}

impl Family {
    fn new(name: &'static str, help: &'static str, kind: &'static str) -> Self {
        Family { name, help, kind, samples: Vec::new() }
    }

    fn write(&self, out: &mut String) {
        if self.samples.is_empty() {
            return;
        }
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        for (labels, value, at) in &self.samples {
            let _ = write!(out, "{}{labels} {value}", self.name);
            match at {
                Some(t) => {
                    let _ = writeln!(out, " {}", millis(*t));
                }
                None => out.push('\n'),
            }
        }
    }
}

fn container_labels(u: &PodUsage) -> String {
    format!(
        "{{container=\"{}\",namespace=\"{}\",pod=\"{}\"}}",
        escape(&u.container),
        escape(&u.pod.namespace),
        escape(&u.pod.name)
    )
}

fn pod_labels(u: &PodUsage) -> String {
    format!("{{namespace=\"{}\",pod=\"{}\"}}", escape(&u.pod.namespace), escape(&u.pod.name))
}

/// The text for `node` (absent when it could not be read) and `pods`; `failed` (part of the
/// scrape could not be read) sets `scrape_error` and `resource_scrape_error` to 1.
pub fn encode(node: Option<&NodeSample>, pods: &[PodUsage], failed: bool) -> String {
    let mut c_cpu = Family::new(
        "container_cpu_usage_seconds_total",
        "[STABLE] Cumulative cpu time consumed by the container in core-seconds",
        "counter",
    );
    let mut c_mem = Family::new(
        "container_memory_working_set_bytes",
        "[STABLE] Current working set of the container in bytes",
        "gauge",
    );
    let mut c_start = Family::new(
        "container_start_time_seconds",
        "[STABLE] Start time of the container since unix epoch in seconds",
        "gauge",
    );
    let mut n_cpu = Family::new(
        "node_cpu_usage_seconds_total",
        "[STABLE] Cumulative cpu time consumed by the node in core-seconds",
        "counter",
    );
    let mut n_mem =
        Family::new("node_memory_working_set_bytes", "[STABLE] Current working set of the node in bytes", "gauge");
    let mut p_cpu = Family::new(
        "pod_cpu_usage_seconds_total",
        "[STABLE] Cumulative cpu time consumed by the pod in core-seconds",
        "counter",
    );
    let mut p_mem =
        Family::new("pod_memory_working_set_bytes", "[STABLE] Current working set of the pod in bytes", "gauge");
    let error = if failed { 1.0 } else { 0.0 };
    let mut r_err = Family::new(
        "resource_scrape_error",
        "[STABLE] 1 if there was an error while getting container metrics, 0 otherwise",
        "gauge",
    );
    r_err.samples.push((String::new(), error, None));
    let mut s_err = Family::new(
        "scrape_error",
        "[ALPHA] 1 if there was an error while getting container metrics, 0 otherwise",
        "gauge",
    );
    s_err.samples.push((String::new(), error, None));

    if let Some(n) = node {
        n_cpu.samples.push((String::new(), seconds(n.cpu_usage_nanos), Some(n.at)));
        n_mem.samples.push((String::new(), n.memory_working_set_bytes as f64, Some(n.at)));
    }
    // Pods in order, each once, its containers summed (a VM is one container today).
    let mut pod_rows: Vec<(String, u64, u64, SystemTime)> = Vec::new();
    for u in pods {
        let labels = container_labels(u);
        if let Some(start) = u.started_at.filter(|t| millis(*t) > 0) {
            let secs = start.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
            c_start.samples.push((labels.clone(), secs, None));
        }
        c_cpu.samples.push((labels.clone(), seconds(u.cpu_usage_nanos), Some(u.measured_at)));
        c_mem.samples.push((labels, u.memory_working_set_bytes as f64, Some(u.measured_at)));
        let key = pod_labels(u);
        match pod_rows.iter_mut().find(|r| r.0 == key) {
            Some(r) => {
                r.1 = r.1.saturating_add(u.cpu_usage_nanos);
                r.2 = r.2.saturating_add(u.memory_working_set_bytes);
                r.3 = r.3.max(u.measured_at);
            }
            None => pod_rows.push((key, u.cpu_usage_nanos, u.memory_working_set_bytes, u.measured_at)),
        }
    }
    for (labels, cpu, mem, at) in pod_rows {
        p_cpu.samples.push((labels.clone(), seconds(cpu), Some(at)));
        p_mem.samples.push((labels, mem as f64, Some(at)));
    }
    let mut out = String::new();
    for f in [&c_cpu, &c_mem, &c_start, &n_cpu, &n_mem, &p_cpu, &p_mem, &r_err, &s_err] {
        f.write(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::PodKey;
    use std::time::Duration;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn the_text_metrics_server_reads() {
        let node = NodeSample {
            name: "vk-1".into(),
            boot_time: None,
            at: at(1_700_000_010_250),
            cpu_usage_nanos: 1_234_500_000_000,
            memory_working_set_bytes: 3 << 30,
            memory_usage_bytes: 4 << 30,
            memory_available_bytes: 1 << 30,
        };
        let pods = [PodUsage {
            pod: PodKey::new("team-a", "web"),
            uid: "u-1".into(),
            container: "main".into(),
            cpu_usage_nanos: 2_500_000_000,
            memory_working_set_bytes: 536_870_912,
            measured_at: at(1_700_000_010_123),
            started_at: Some(at(1_700_000_000_000)),
        }];
        let golden = "\
# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the container in core-seconds
# TYPE container_cpu_usage_seconds_total counter
container_cpu_usage_seconds_total{container=\"main\",namespace=\"team-a\",pod=\"web\"} 2.5 1700000010123
# HELP container_memory_working_set_bytes [STABLE] Current working set of the container in bytes
# TYPE container_memory_working_set_bytes gauge
container_memory_working_set_bytes{container=\"main\",namespace=\"team-a\",pod=\"web\"} 536870912 1700000010123
# HELP container_start_time_seconds [STABLE] Start time of the container since unix epoch in seconds
# TYPE container_start_time_seconds gauge
container_start_time_seconds{container=\"main\",namespace=\"team-a\",pod=\"web\"} 1700000000
# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the node in core-seconds
# TYPE node_cpu_usage_seconds_total counter
node_cpu_usage_seconds_total 1234.5 1700000010250
# HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes
# TYPE node_memory_working_set_bytes gauge
node_memory_working_set_bytes 3221225472 1700000010250
# HELP pod_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the pod in core-seconds
# TYPE pod_cpu_usage_seconds_total counter
pod_cpu_usage_seconds_total{namespace=\"team-a\",pod=\"web\"} 2.5 1700000010123
# HELP pod_memory_working_set_bytes [STABLE] Current working set of the pod in bytes
# TYPE pod_memory_working_set_bytes gauge
pod_memory_working_set_bytes{namespace=\"team-a\",pod=\"web\"} 536870912 1700000010123
# HELP resource_scrape_error [STABLE] 1 if there was an error while getting container metrics, 0 otherwise
# TYPE resource_scrape_error gauge
resource_scrape_error 0
# HELP scrape_error [ALPHA] 1 if there was an error while getting container metrics, 0 otherwise
# TYPE scrape_error gauge
scrape_error 0
";
        assert_eq!(encode(Some(&node), &pods, false), golden);
    }

    #[test]
    fn no_node_reading_is_a_scrape_error_and_labels_are_escaped() {
        let pods = [PodUsage {
            pod: PodKey::new("ns", "we\"ird\\na\nme"),
            uid: "u".into(),
            container: "c".into(),
            cpu_usage_nanos: 1,
            memory_working_set_bytes: 1,
            measured_at: at(5),
            started_at: None,
        }];
        let text = encode(None, &pods, true);
        assert!(text.contains("\nscrape_error 1\n") && text.contains("\nresource_scrape_error 1\n"), "{text}");
        assert!(!text.contains("node_cpu_usage_seconds_total"), "{text}");
        assert!(!text.contains("container_start_time_seconds"), "no start time, no sample: {text}");
        assert!(text.contains(r#"pod="we\"ird\\na\nme""#), "{text}");
    }
}

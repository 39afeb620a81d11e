//! `GET /stats/summary` as the kubelet's Summary API shapes it (`k8s.io/kubelet/pkg/apis/stats/v1alpha1`,
//! `types.go`), CPU and memory only (what `only_cpu_and_memory=true` asks for, and all a VM
//! has to say), and the usage rate the API reports beside the cumulative CPU time.
//!
//! `usageNanoCores` needs two samples: the [`Rates`] keep the previous one per node and per
//! container, so the first read of a Pod has no rate (the field is omitted, as the kubelet
//! omits what it does not know). Entries for Pods no longer reported are dropped at each read,
//! so the table never outgrows the node's Pods.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::usage::PodUsage;
use crate::provider::PodKey;

/// The whole answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The node.
    pub node: NodeStats,
    /// One entry per Pod the provider measured.
    pub pods: Vec<PodStats>,
}

/// `NodeStats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStats {
    /// The node's name.
    pub node_name: String,
    /// When the node booted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// CPU.
    pub cpu: CpuStats,
    /// Memory.
    pub memory: MemoryStats,
}

/// `PodReference`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodReference {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// UID.
    pub uid: String,
}

/// `PodStats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStats {
    /// Which Pod.
    pub pod_ref: PodReference,
    /// When its VM started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// Its containers (one per VM).
    pub containers: Vec<ContainerStats>,
    /// The Pod's CPU: its containers' summed.
    pub cpu: CpuStats,
    /// The Pod's memory: its containers' summed.
    pub memory: MemoryStats,
}

/// `ContainerStats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStats {
    /// The container's name in the Pod spec.
    pub name: String,
    /// When it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// CPU.
    pub cpu: CpuStats,
    /// Memory.
    pub memory: MemoryStats,
}

/// `CPUStats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuStats {
    /// When measured, RFC 3339.
    pub time: String,
    /// The rate since the previous sample, billionths of a core.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage_nano_cores: Option<u64>,
    /// Cumulative CPU time, core-nanoseconds.
    pub usage_core_nano_seconds: u64,
}

/// `MemoryStats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStats {
    /// When measured, RFC 3339.
    pub time: String,
    /// Memory the kernel cannot drop at once, bytes.
    pub working_set_bytes: u64,
    /// All memory in use, bytes (node only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage_bytes: Option<u64>,
    /// Memory still available, bytes (node only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
}

/// RFC 3339 to the second, as `metav1.Time` marshals.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The rate between two cumulative samples, billionths of a core; `None` when time did not
/// move forward or the counter went back (a restarted VM).
pub fn nano_cores(prev: (u64, SystemTime), now: (u64, SystemTime)) -> Option<u64> {
    let elapsed = now.1.duration_since(prev.1).ok().filter(|d| !d.is_zero())?;
    let used = now.0.checked_sub(prev.0)?;
    let rate = u128::from(used) * 1_000_000_000 / elapsed.as_nanos();
    Some(u64::try_from(rate).unwrap_or(u64::MAX))
}

/// Which counter a previous sample belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Series {
    Node,
    Container { pod: PodKey, uid: String, container: String },
}

/// Samples closer together than this keep the older one as the base, so two reads in quick
/// succession do not turn a counter's coarse steps into a wild rate.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The previous CPU sample of the node and of each container.
#[derive(Debug, Default)]
pub struct Rates {
    prev: HashMap<Series, (u64, SystemTime)>,
}

impl Rates {
    /// The rate of `series` at `now`, recording `now` as the next base.
    fn rate(&mut self, series: Series, now: (u64, SystemTime)) -> Option<u64> {
        let prev = self.prev.get(&series).copied();
        let rate = prev.and_then(|p| nano_cores(p, now));
        let stale = prev.is_none_or(|p| now.1.duration_since(p.1).is_ok_and(|d| d >= MIN_INTERVAL) || rate.is_none());
        if stale {
            self.prev.insert(series, now);
        }
        rate
    }

    /// Builds the Summary from the node's and the Pods' samples.
    pub fn summary(&mut self, node: NodeSample, pods: &[PodUsage]) -> Summary {
        let node_rate = self.rate(Series::Node, (node.cpu_usage_nanos, node.at));
        let at = rfc3339(node.at);
        let node_stats = NodeStats {
            node_name: node.name,
            start_time: node.boot_time.map(rfc3339),
            cpu: CpuStats {
                time: at.clone(),
                usage_nano_cores: node_rate,
                usage_core_nano_seconds: node.cpu_usage_nanos,
            },
            memory: MemoryStats {
                time: at,
                working_set_bytes: node.memory_working_set_bytes,
                usage_bytes: Some(node.memory_usage_bytes),
                available_bytes: Some(node.memory_available_bytes),
            },
        };
        let mut keep = vec![Series::Node];
        let mut out: Vec<PodStats> = Vec::new();
        for u in pods {
            let series = Series::Container { pod: u.pod.clone(), uid: u.uid.clone(), container: u.container.clone() };
            keep.push(series.clone());
            let rate = self.rate(series, (u.cpu_usage_nanos, u.measured_at));
            let time = rfc3339(u.measured_at);
            let container = ContainerStats {
                name: u.container.clone(),
                start_time: u.started_at.map(rfc3339),
                cpu: CpuStats {
                    time: time.clone(),
                    usage_nano_cores: rate,
                    usage_core_nano_seconds: u.cpu_usage_nanos,
                },
                memory: MemoryStats {
                    time,
                    working_set_bytes: u.memory_working_set_bytes,
                    usage_bytes: None,
                    available_bytes: None,
                },
            };
            match out.iter_mut().find(|p| p.pod_ref.uid == u.uid && p.pod_ref.name == u.pod.name) {
                Some(p) => {
                    p.cpu.usage_core_nano_seconds = p.cpu.usage_core_nano_seconds.saturating_add(u.cpu_usage_nanos);
                    p.cpu.usage_nano_cores = p.cpu.usage_nano_cores.zip(rate).map(|(a, b)| a.saturating_add(b));
                    p.memory.working_set_bytes = p.memory.working_set_bytes.saturating_add(u.memory_working_set_bytes);
                    p.containers.push(container);
                }
                None => out.push(PodStats {
                    pod_ref: PodReference {
                        name: u.pod.name.clone(),
                        namespace: u.pod.namespace.clone(),
                        uid: u.uid.clone(),
                    },
                    start_time: u.started_at.map(rfc3339),
                    cpu: container.cpu.clone(),
                    memory: container.memory.clone(),
                    containers: vec![container],
                }),
            }
        }
        self.prev.retain(|k, _| keep.contains(k));
        Summary { node: node_stats, pods: out }
    }
}

/// The node's sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSample {
    /// The node's name.
    pub name: String,
    /// When it booted.
    pub boot_time: Option<SystemTime>,
    /// When measured.
    pub at: SystemTime,
    /// Cumulative CPU time, nanoseconds.
    pub cpu_usage_nanos: u64,
    /// Working set, bytes.
    pub memory_working_set_bytes: u64,
    /// In use, bytes.
    pub memory_usage_bytes: u64,
    /// Available, bytes.
    pub memory_available_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn node(secs: u64, cpu: u64) -> NodeSample {
        NodeSample {
            name: "vk-1".into(),
            boot_time: Some(at(1_700_000_000)),
            at: at(secs),
            cpu_usage_nanos: cpu,
            memory_working_set_bytes: 3 << 30,
            memory_usage_bytes: 4 << 30,
            memory_available_bytes: 12 << 30,
        }
    }

    fn pod(secs: u64, cpu: u64) -> PodUsage {
        PodUsage {
            pod: PodKey::new("ns", "web"),
            uid: "u-1".into(),
            container: "main".into(),
            cpu_usage_nanos: cpu,
            memory_working_set_bytes: 512 << 20,
            measured_at: at(secs),
            started_at: Some(at(1_700_000_100)),
        }
    }

    #[test]
    fn nano_cores_from_two_samples() {
        assert_eq!(nano_cores((0, at(10)), (500_000_000, at(11))), Some(500_000_000), "half a core");
        assert_eq!(nano_cores((0, at(10)), (4_000_000_000, at(12))), Some(2_000_000_000), "two cores");
        assert_eq!(nano_cores((5, at(10)), (5, at(10))), None, "no time passed");
        assert_eq!(nano_cores((9, at(10)), (5, at(11))), None, "the counter went back");
        assert_eq!(nano_cores((0, at(11)), (5, at(10))), None, "time went back");
        assert_eq!(nano_cores((0, at(0)), (u64::MAX, at(0) + Duration::from_nanos(1))), Some(u64::MAX), "saturates");
    }

    #[test]
    fn the_summary_has_the_kubelets_shape() {
        let mut rates = Rates::default();
        let first = rates.summary(node(1_700_001_000, 10_000_000_000), &[pod(1_700_001_000, 1_000_000_000)]);
        assert_eq!(first.pods[0].cpu.usage_nano_cores, None, "one sample has no rate");
        let s = rates.summary(node(1_700_001_010, 30_000_000_000), &[pod(1_700_001_010, 6_000_000_000)]);
        let golden = r#"{
  "node": {
    "nodeName": "vk-1",
    "startTime": "2023-11-14T22:13:20Z",
    "cpu": {
      "time": "2023-11-14T22:30:10Z",
      "usageNanoCores": 2000000000,
      "usageCoreNanoSeconds": 30000000000
    },
    "memory": {
      "time": "2023-11-14T22:30:10Z",
      "workingSetBytes": 3221225472,
      "usageBytes": 4294967296,
      "availableBytes": 12884901888
    }
  },
  "pods": [
    {
      "podRef": {
        "name": "web",
        "namespace": "ns",
        "uid": "u-1"
      },
      "startTime": "2023-11-14T22:15:00Z",
      "containers": [
        {
          "name": "main",
          "startTime": "2023-11-14T22:15:00Z",
          "cpu": {
            "time": "2023-11-14T22:30:10Z",
            "usageNanoCores": 500000000,
            "usageCoreNanoSeconds": 6000000000
          },
          "memory": {
            "time": "2023-11-14T22:30:10Z",
            "workingSetBytes": 536870912
          }
        }
      ],
      "cpu": {
        "time": "2023-11-14T22:30:10Z",
        "usageNanoCores": 500000000,
        "usageCoreNanoSeconds": 6000000000
      },
      "memory": {
        "time": "2023-11-14T22:30:10Z",
        "workingSetBytes": 536870912
      }
    }
  ]
}"#;
        assert_eq!(serde_json::to_string_pretty(&s).expect("json"), golden);
        let back: Summary = serde_json::from_str(golden).expect("decodes");
        assert_eq!(back, s);
    }

    #[test]
    fn samples_of_gone_pods_are_dropped_and_close_reads_keep_the_older_base() {
        let mut rates = Rates::default();
        rates.summary(node(100, 0), &[pod(100, 0)]);
        assert_eq!(rates.prev.len(), 2);
        // 0.5 s later: a rate against the base at 100, which stays the base.
        let mut p = pod(100, 250_000_000);
        p.measured_at = at(100) + Duration::from_millis(500);
        let s = rates.summary(node(100, 0), &[p]);
        assert_eq!(s.pods[0].cpu.usage_nano_cores, Some(500_000_000));
        assert_eq!(
            rates.prev.get(&Series::Container {
                pod: PodKey::new("ns", "web"),
                uid: "u-1".into(),
                container: "main".into()
            }),
            Some(&(0, at(100)))
        );
        rates.summary(node(102, 0), &[]);
        assert_eq!(rates.prev.len(), 1, "only the node's sample is left");
    }
}

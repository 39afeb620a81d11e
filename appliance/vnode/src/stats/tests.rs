use super::*;
use crate::provider::PodKey;
use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt as _;

struct FakePods(Vec<PodUsage>);

#[async_trait::async_trait]
impl PodMetrics for FakePods {
    async fn pod_usage(&self) -> Vec<PodUsage> {
        self.0.clone()
    }
}

struct SlowPods;

#[async_trait::async_trait]
impl PodMetrics for SlowPods {
    async fn pod_usage(&self) -> Vec<PodUsage> {
        tokio::time::sleep(POD_USAGE_TIMEOUT * 2).await;
        Vec::new()
    }
}

fn fake_proc() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join("stat"), "cpu  100 0 100 1000 0 0 0 0 0 0\nbtime 1700000000\n").expect("stat");
    std::fs::write(
        tmp.path().join("meminfo"),
        "MemTotal: 8000 kB\nMemFree: 2000 kB\nMemAvailable: 5000 kB\nInactive(file): 1000 kB\n",
    )
    .expect("meminfo");
    tmp
}

fn usage(cpu: u64) -> PodUsage {
    PodUsage {
        pod: PodKey::new("ns", "web"),
        uid: "u-1".into(),
        container: "main".into(),
        cpu_usage_nanos: cpu,
        memory_working_set_bytes: 64 << 20,
        measured_at: SystemTime::now(),
        started_at: Some(UNIX_EPOCH + Duration::from_secs(1_700_000_100)),
    }
}

async fn get(router: &Router, path: &str) -> (u16, String, String) {
    let resp = router.clone().oneshot(Request::get(path).body(Body::empty()).expect("request")).await.expect("call");
    let status = resp.status().as_u16();
    let ctype = resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body");
    (status, ctype, String::from_utf8_lossy(&body).into_owned())
}

fn router_with(proc_dir: &std::path::Path, pods: Option<Arc<dyn PodMetrics>>) -> (Router, Arc<RuntimeMetrics>) {
    let runtime = Arc::new(RuntimeMetrics::default());
    let config = StatsConfig { pod_metrics: pods, runtime: runtime.clone() };
    (routes(Arc::new(Stats::with_procfs("vk-1", config, Procfs::at(proc_dir)))), runtime)
}

#[tokio::test]
async fn the_summary_carries_the_node_and_the_providers_pods() {
    let proc_dir = fake_proc();
    let (router, _) = router_with(proc_dir.path(), Some(Arc::new(FakePods(vec![usage(5_000_000_000)]))));
    let (status, ctype, body) = get(&router, "/stats/summary?only_cpu_and_memory=true").await;
    assert_eq!((status, ctype.as_str()), (200, "application/json"), "{body}");
    let s: summary::Summary = serde_json::from_str(&body).expect("summary");
    assert_eq!(s.node.node_name, "vk-1");
    assert_eq!(s.node.start_time.as_deref(), Some("2023-11-14T22:13:20Z"));
    assert_eq!(s.node.cpu.usage_core_nano_seconds, 2_000_000_000);
    assert_eq!(s.node.memory.working_set_bytes, 5000 * 1024);
    assert_eq!(s.node.memory.available_bytes, Some(5000 * 1024));
    assert_eq!(s.pods.len(), 1);
    assert_eq!(
        s.pods[0].pod_ref,
        summary::PodReference { name: "web".into(), namespace: "ns".into(), uid: "u-1".into() }
    );
    assert_eq!(s.pods[0].containers[0].name, "main");
    assert_eq!(s.pods[0].memory.working_set_bytes, 64 << 20);
}

#[tokio::test]
async fn no_proc_is_a_500_for_the_summary_and_a_scrape_error_for_resource_metrics() {
    let (router, _) = router_with(std::path::Path::new("/nonexistent/proc"), None);
    let (status, _, body) = get(&router, "/stats/summary").await;
    assert_eq!(status, 500);
    assert!(body.contains("/nonexistent/proc/stat"), "{body}");
    let (status, ctype, body) = get(&router, "/metrics/resource").await;
    assert_eq!((status, ctype.as_str()), (200, resource::CONTENT_TYPE));
    assert!(body.contains("\nscrape_error 1\n"), "{body}");
}

#[tokio::test]
async fn resource_metrics_name_each_container() {
    let proc_dir = fake_proc();
    let (router, _) = router_with(proc_dir.path(), Some(Arc::new(FakePods(vec![usage(2_500_000_000)]))));
    let (status, _, body) = get(&router, "/metrics/resource").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("container_cpu_usage_seconds_total{container=\"main\",namespace=\"ns\",pod=\"web\"} 2.5 "),
        "{body}"
    );
    assert!(body.contains("\nnode_cpu_usage_seconds_total 2 "), "{body}");
    assert!(body.contains("\nscrape_error 0\n"), "{body}");
}

#[tokio::test(start_paused = true)]
async fn a_provider_that_takes_too_long_is_left_out() {
    let proc_dir = fake_proc();
    let (router, _) = router_with(proc_dir.path(), Some(Arc::new(SlowPods)));
    let (status, _, body) = get(&router, "/metrics/resource").await;
    assert_eq!(status, 200);
    assert!(body.contains("\nscrape_error 1\n") && body.contains("node_memory_working_set_bytes"), "{body}");
}

#[tokio::test]
async fn the_runtimes_metrics_on_both_routers() {
    let proc_dir = fake_proc();
    let (router, runtime) = router_with(proc_dir.path(), None);
    runtime.provider_error("update");
    let (status, ctype, body) = get(&router, "/metrics").await;
    assert_eq!((status, ctype.as_str()), (200, runtime::CONTENT_TYPE));
    assert!(body.contains("vnode_provider_errors_total{operation=\"update\"} 1"), "{body}");
    let (status, _, plain) = get(&metrics_router(runtime), "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(plain, body);
}

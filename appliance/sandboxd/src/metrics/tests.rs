//! `/metrics` text: every family with its labels, and valid exposition as a scraper reads it.

use std::collections::HashMap;

use super::*;
use crate::limits::UNLIMITED_DISK_MIB;
use crate::pool::PoolKey;

fn scrape() -> String {
    let m = Arc::new(Metrics::default());
    inc(&m.claims_warm);
    inc(&m.claims_no_capacity);
    inc(&m.claims_no_capacity);
    inc(&m.relays_idle_closed);
    inc(&m.relays_idle_closed);
    inc(&m.refill_clone);
    m.claim_duration.observe(Duration::from_micros(80));
    m.claim_duration.observe(Duration::from_millis(3));
    let pool = PoolInfo {
        key: PoolKey::parse("base", None, None).expect("key").into(),
        warm: 2,
        refilling: 1,
        target: 3,
        golden: true,
        at_capacity: true,
        at_capacity_reason: Some("budget".into()),
    };
    let g = Gauges {
        pools: vec![pool],
        claimed: 1,
        draining: false,
        budget: Budget { max_vms: 4, max_memory_mib: 4096, max_disk_mib: UNLIMITED_DISK_MIB },
        used: Usage { vms: 3, memory_mib: 1536, disk_mib: 0 },
        http: HttpConns { open: 5, refused: 0, timed_out: 1 },
    };
    m.render(g).expect("render")
}

#[test]
fn every_family_is_present_with_its_labels() {
    let text = scrape();
    for line in [
        "sandboxd_claims_total{result=\"granted\",tier=\"warm\"} 1",
        "sandboxd_claims_total{result=\"no_capacity\",tier=\"\"} 2",
        "sandboxd_claims_total{result=\"draining\",tier=\"\"} 0",
        "sandboxd_claims_total{result=\"error\",tier=\"\"} 0",
        "sandboxd_claim_duration_seconds_count 2",
        "sandboxd_claim_duration_seconds_bucket{le=\"0.005\"} 2",
        "sandboxd_claim_duration_seconds_bucket{le=\"+Inf\"} 2",
        "sandboxd_releases_total 0",
        "sandboxd_refills_total{tier=\"clone\"} 1",
        "sandboxd_refills_total{tier=\"cold\"} 0",
        "sandboxd_golden_builds_total{result=\"failed\"} 0",
        "sandboxd_vm_destroys_total{result=\"ok\"} 0",
        "sandboxd_relays_total{kind=\"exec\"} 0",
        "sandboxd_relays_refused_total{kind=\"agent\"} 0",
        "sandboxd_relays_idle_closed_total 2",
        "sandboxd_clone_reseed_failures_total 0",
        "sandboxd_network_failures_total 0",
        "sandboxd_refill_budget_blocked_total 0",
        "sandboxd_auth_failures_total 0",
        "sandboxd_http_connections_timed_out_total 1",
        "sandboxd_pool_warm{template=\"base\",net=\"none\",size=\"small\"} 2",
        "sandboxd_pool_target{template=\"base\",net=\"none\",size=\"small\"} 3",
        "sandboxd_pool_refilling{template=\"base\",net=\"none\",size=\"small\"} 1",
        "sandboxd_pool_at_capacity{template=\"base\",net=\"none\",size=\"small\"} 1",
        "sandboxd_claimed 1",
        "sandboxd_draining 0",
        "sandboxd_budget_max_vms 4",
        "sandboxd_budget_vms 3",
        "sandboxd_budget_memory_mib 1536",
        "sandboxd_budget_max_disk_mib 9223372036854775807",
        "sandboxd_http_connections_open 5",
        "# TYPE sandboxd_claims counter",
        "# TYPE sandboxd_claim_duration_seconds histogram",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    // The first bucket holds the 80 µs claim only if it is above 50 µs: it is not.
    let first = text.lines().find(|l| l.starts_with("sandboxd_claim_duration_seconds_bucket{")).expect("a bucket");
    assert!(first.ends_with(" 0"), "{first}");
    assert_valid(&text);
}

#[test]
fn no_pools_still_renders_valid_text() {
    let m = Arc::new(Metrics::default());
    let g = Gauges {
        pools: Vec::new(),
        claimed: 0,
        draining: true,
        budget: Budget { max_vms: 1, max_memory_mib: 512, max_disk_mib: 1 },
        used: Usage::default(),
        http: HttpConns::default(),
    };
    let text = m.render(g).expect("render");
    assert!(text.lines().any(|l| l == "sandboxd_draining 1"), "{text}");
    assert!(!text.contains("sandboxd_pool_warm{"), "{text}");
    assert_valid(&text);
}

/// Checks the text as a Prometheus scraper reads it: every sample is `name{labels} value`
/// with a valid name, well-formed quoted labels and a number; every sample belongs to a family
/// a `# TYPE` line declared before it (a counter's samples end in `_total`, a histogram's in
/// `_bucket`, `_sum` or `_count`); no family is declared twice; the text ends with `# EOF`.
fn assert_valid(text: &str) {
    let mut types: HashMap<&str, &str> = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE <name> <type>");
            assert!(valid_name(name), "{line}");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(types.insert(name, kind).is_none(), "{name} declared twice");
            continue;
        }
        if line.starts_with("# HELP ") || line == "# EOF" {
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
        let (series, value) = line.rsplit_once(' ').expect("a sample: <series> <value>");
        assert!(value == "+Inf" || value.parse::<f64>().is_ok(), "value of {line:?}");
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, Some(l.strip_suffix('}').expect("labels end with }"))),
            None => (series, None),
        };
        assert!(valid_name(name), "{line}");
        if let Some(l) = labels {
            assert_labels(l, line);
        }
        let family = [("_total", "counter"), ("_bucket", "histogram"), ("_sum", "histogram"), ("_count", "histogram")]
            .iter()
            .find_map(|(suffix, kind)| name.strip_suffix(suffix).filter(|f| types.get(f) == Some(kind)))
            .or_else(|| (types.get(name) == Some(&"gauge")).then_some(name));
        assert!(family.is_some(), "{name} belongs to no family declared before it");
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `k="v",k="v"`: names valid, values quoted with `\\`, `\"` and `\n` escapes only.
fn assert_labels(mut l: &str, line: &str) {
    while !l.is_empty() {
        let (key, rest) = l.split_once("=\"").unwrap_or_else(|| panic!("label without =\" in {line}"));
        assert!(valid_name(key), "label name {key:?} in {line}");
        let mut end = None;
        let mut escaped = false;
        for (i, c) in rest.char_indices() {
            match (escaped, c) {
                (true, '\\' | '"' | 'n') => escaped = false,
                (true, _) => panic!("bad escape in {line}"),
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                (false, _) => {}
            }
        }
        let end = end.unwrap_or_else(|| panic!("unterminated label value in {line}"));
        l = &rest[end + 1..];
        l = l.strip_prefix(',').unwrap_or(l);
    }
}

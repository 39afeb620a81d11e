//! Provider tests against the in-process fake sandboxd, a fake owner lookup and the notifier's
//! receiving end: no API server.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::sync::mpsc::UnboundedReceiver;
use vnode::{PodKey, PodNotifier, Provider};

use super::*;
use crate::annotations::{CLAIM_ID, RUNTIME, TEMPLATE, TTL_SECONDS};
use crate::authority::{Lookup, OwnerLookup, OwnerState};
use crate::sandboxd::SandboxdClient;
use crate::state::{self, OwnerRef};
use crate::test_utils::{ClaimMode, FakeSandboxd};

/// Answers owner reads from a table (by owner name); unknown names answer `default`.
struct FakeOwners {
    answers: Mutex<BTreeMap<String, Lookup>>,
    default: Mutex<Lookup>,
    calls: Mutex<usize>,
}

impl FakeOwners {
    fn new(default: Lookup) -> Arc<FakeOwners> {
        Arc::new(FakeOwners { answers: Mutex::default(), default: Mutex::new(default), calls: Mutex::new(0) })
    }
    fn set(&self, name: &str, l: Lookup) {
        self.answers.lock().unwrap().insert(name.into(), l);
    }
    fn calls(&self) -> usize {
        *self.calls.lock().unwrap()
    }
}

#[async_trait::async_trait]
impl OwnerLookup for FakeOwners {
    async fn lookup(&self, _namespace: &str, owner: &OwnerRef) -> Lookup {
        *self.calls.lock().unwrap() += 1;
        let answers = self.answers.lock().unwrap();
        answers.get(&owner.name).cloned().unwrap_or_else(|| self.default.lock().unwrap().clone())
    }
}

fn alive(uid: &str) -> Lookup {
    Lookup::Found(OwnerState { uid: uid.into(), ..OwnerState::default() })
}

struct Rig {
    fake: FakeSandboxd,
    owners: Arc<FakeOwners>,
    provider: Arc<SandboxProvider>,
    pushes: UnboundedReceiver<Pod>,
    dir: tempfile::TempDir,
}

impl Rig {
    async fn new() -> Rig {
        Rig::tuned(|_| {}).await
    }

    async fn tuned(tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        let fake = FakeSandboxd::start(Some("node-token")).await;
        let dir = tempfile::tempdir().unwrap();
        Rig::with(fake, dir, tune).await
    }

    async fn with(fake: FakeSandboxd, dir: tempfile::TempDir, tune: impl FnOnce(&mut ProviderConfig)) -> Rig {
        let owners = FakeOwners::new(Lookup::Failed("unset".into()));
        let client = SandboxdClient::new(&fake.url(), Some("node-token".into())).unwrap();
        let mut cfg = ProviderConfig::new(dir.path().join("state/claims.json"), "127.0.0.9".into());
        tune(&mut cfg);
        let provider = Arc::new(SandboxProvider::new(client, owners.clone(), cfg).unwrap());
        let (n, pushes) = PodNotifier::channel();
        provider.notify_pods(n);
        Rig { fake, owners, provider, pushes, dir }
    }

    fn state_path(&self) -> std::path::PathBuf {
        self.dir.path().join("state/claims.json")
    }

    fn state(&self) -> state::StateFile {
        state::load(&self.state_path()).unwrap()
    }

    fn pushed(&mut self) -> Option<Pod> {
        self.pushes.try_recv().ok()
    }
}

fn pod(name: &str, uid: &str, owner_uid: Option<&str>) -> Pod {
    let mut p = Pod {
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                image: Some("rt:24.04".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    p.metadata.namespace = Some("ns".into());
    p.metadata.name = Some(name.into());
    p.metadata.uid = Some(uid.into());
    p.metadata.annotations = Some(BTreeMap::from([(TEMPLATE.to_owned(), "rt:24.04".to_owned())]));
    if let Some(ou) = owner_uid {
        p.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "agents.x-k8s.io/v1beta1".into(),
            kind: "Sandbox".into(),
            name: name.into(),
            uid: ou.into(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
    }
    p
}

fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

#[tokio::test]
async fn create_claims_persists_and_pushes_running() {
    let mut r = Rig::new().await;
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    assert!(r.fake.holds(&id));
    let body = r.fake.last_claim_body().unwrap();
    assert_eq!(body["claim_ref"], "ns/a");
    assert_eq!(body["ttl_seconds"], 86_400);
    assert_eq!(body["template"], "rt:24.04");
    // Durable with the token, the pod UID and the owner.
    let st = r.state();
    let row = &st.claims["ns/a"];
    assert_eq!((row.id.as_str(), row.pod_uid.as_str()), (id.as_str(), "uid-a"));
    assert_eq!(row.token, r.fake.claim(&id).unwrap().token);
    assert_eq!(row.address, "10.1.2.3:7777");
    assert!(row.claimed_at.is_some() && row.deadline.is_some());
    assert_eq!(row.owner.as_ref().unwrap().uid, "own-a");
    // Running, pushed with the claim id and without the token.
    let pushed = r.pushed().unwrap();
    assert_eq!(phase(&pushed), "Running");
    assert_eq!(pushed.metadata.annotations.as_ref().unwrap()[CLAIM_ID], id);
    let s = pushed.status.as_ref().unwrap();
    assert_eq!(s.pod_ip.as_deref(), Some("10.1.2.3"));
    assert_eq!(s.host_ip.as_deref(), Some("10.1.2.3"));
    assert_eq!(s.start_time.as_ref().unwrap().0, row.claimed_at.unwrap());
    assert_eq!(s.container_statuses.as_ref().unwrap()[0].image_id, format!("sandboxd://{id}"));
    assert!(!serde_json::to_string(&pushed).unwrap().contains(&row.token), "the token reached the Pod");
    // GetPod serves the provider's copy.
    let got = r.provider.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert_eq!(phase(&got), "Running");
    assert_eq!(r.provider.get_pods().len(), 1);
}

#[tokio::test]
async fn empty_owner_addr_reports_the_advertise_host() {
    let mut r = Rig::new().await;
    r.fake.set_owner_addr("");
    r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    let pushed = r.pushed().unwrap();
    assert_eq!(pushed.status.unwrap().pod_ip.as_deref(), Some("127.0.0.9"));
}

#[tokio::test]
async fn bad_annotations_and_no_capacity_fail_without_a_claim() {
    let mut r = Rig::new().await;
    let mut p = pod("a", "uid-a", None);
    p.metadata.annotations.as_mut().unwrap().insert(RUNTIME.into(), "kata".into());
    let e = r.provider.create_pod(&p).await.unwrap_err().to_string();
    assert!(e.contains("this node serves runtime sandboxd only"), "{e}");
    let mut p = pod("a", "uid-a", None);
    p.metadata.annotations = None;
    let e = r.provider.create_pod(&p).await.unwrap_err().to_string();
    assert!(e.contains("sandbox.cocoonstack.io/template is missing"), "{e}");
    let mut p = pod("a", "uid-a", None);
    p.metadata.annotations.as_mut().unwrap().insert(TTL_SECONDS.into(), "-3".into());
    assert!(r.provider.create_pod(&p).await.unwrap_err().to_string().contains(TTL_SECONDS));
    assert_eq!(r.fake.claim_count(), 0);
    r.fake.set_claim_mode(ClaimMode::TooMany);
    let e = r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap_err().to_string();
    assert!(e.contains("no warm capacity") && e.contains("ns/a"), "{e}");
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
    assert!(r.state().claims.is_empty());
    assert!(r.pushed().is_none());
}

#[tokio::test]
async fn deleting_a_bare_pod_releases_its_vm() {
    let mut r = Rig::new().await;
    let p = pod("a", "uid-a", None);
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    r.provider.delete_pod(&p).await.unwrap();
    assert!(!r.fake.holds(&id));
    assert!(r.provider.claim_id("ns/a").is_none());
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
    assert!(r.state().claims.is_empty());
    assert_eq!(r.owners.calls(), 0, "a bare pod needs no owner read");
    let _ = r.pushed();
}

#[tokio::test]
async fn preserve_then_a_same_name_replacement_adopts_in_place() {
    let mut r = Rig::new().await;
    r.owners.set("a", alive("own-a"));
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    let _ = r.pushed();
    r.provider.delete_pod(&p).await.unwrap();
    assert!(r.fake.holds(&id), "pod deletion destroyed the VM of a live owner");
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none(), "the pod entry stayed");
    assert_eq!(r.state().claims["ns/a"].id, id, "the claim was not kept");
    // Replacement: same name, new UID, same owner → same VM, no second claim.
    let claims_before = r.fake.claim_count();
    let p2 = pod("a", "uid-a2", Some("own-a"));
    r.provider.create_pod(&p2).await.unwrap();
    assert_eq!(r.fake.claim_count(), claims_before);
    assert_eq!(r.provider.claim_id("ns/a").unwrap(), id);
    assert_eq!(r.state().claims["ns/a"].pod_uid, "uid-a2");
    let pushed = r.pushed().unwrap();
    assert_eq!(phase(&pushed), "Running");
    assert_eq!(pushed.metadata.annotations.as_ref().unwrap()[CLAIM_ID], id);
    // A late delete of the old generation is stale now.
    r.provider.delete_pod(&p).await.unwrap();
    assert!(r.fake.holds(&id));
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_some());
}

#[tokio::test]
async fn delete_verdict_rows_drive_release_or_preserve() {
    let cases: Vec<(Lookup, bool)> = vec![
        (Lookup::NotFound { details_name: "a".into() }, true),
        (Lookup::Found(OwnerState { uid: "own-a".into(), deleting: true, sandbox_expired: false }), true),
        (alive("someone-else"), true),
        (Lookup::Found(OwnerState { uid: "own-a".into(), deleting: false, sandbox_expired: true }), true),
        (Lookup::NotFound { details_name: String::new() }, false),
        (Lookup::Failed("connection refused".into()), false),
        (Lookup::NoClient, false),
        (alive("own-a"), false),
    ];
    for (lookup, releases) in cases {
        let r = Rig::new().await;
        let p = pod("a", "uid-a", Some("own-a"));
        r.provider.create_pod(&p).await.unwrap();
        let id = r.provider.claim_id("ns/a").unwrap();
        r.owners.set("a", lookup.clone());
        r.provider.delete_pod(&p).await.unwrap();
        assert_eq!(!r.fake.holds(&id), releases, "{lookup:?}");
        assert_eq!(r.provider.claim_id("ns/a").is_none(), releases, "{lookup:?}");
        assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
    }
}

#[tokio::test]
async fn stale_uid_updates_and_deletes_are_ignored() {
    let r = Rig::new().await;
    let p = pod("a", "uid-a", None);
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    let stale = pod("a", "uid-old", None);
    r.provider.delete_pod(&stale).await.unwrap();
    assert!(r.fake.holds(&id));
    let mut upd = stale.clone();
    upd.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "y".to_owned())]));
    r.provider.update_pod(&upd).await.unwrap();
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).unwrap().metadata.labels.is_none());
    // A current update is stored, keeping the reported status.
    let mut cur = p.clone();
    cur.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "y".to_owned())]));
    r.provider.update_pod(&cur).await.unwrap();
    let got = r.provider.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert_eq!(got.metadata.labels.as_ref().unwrap()["x"], "y");
    assert_eq!(phase(&got), "Running");
    assert_eq!(r.fake.claim_count(), 1, "an update claimed again");
}

#[tokio::test]
async fn a_failed_release_on_delete_keeps_everything_and_errors() {
    let r = Rig::new().await;
    let p = pod("a", "uid-a", None);
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    r.fake.set_release_fails(true);
    let e = r.provider.delete_pod(&p).await.unwrap_err().to_string();
    assert!(e.contains("releasing claim") && e.contains("HTTP 500"), "{e}");
    assert!(r.fake.holds(&id));
    assert_eq!(r.provider.claim_id("ns/a").unwrap(), id);
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_some());
    assert_eq!(r.state().claims["ns/a"].id, id);
    r.fake.set_release_fails(false);
    r.provider.delete_pod(&p).await.unwrap();
    assert!(!r.fake.holds(&id));
    // Release of an id sandboxd no longer knows (404) is converged.
    let p2 = pod("b", "uid-b", None);
    r.provider.create_pod(&p2).await.unwrap();
    let id2 = r.provider.claim_id("ns/b").unwrap();
    r.fake.reap(&id2);
    r.provider.delete_pod(&p2).await.unwrap();
    assert!(r.provider.claim_id("ns/b").is_none());
}

/// Writes a state file with two rows: `ns/live` (held by the fake) and `ns/gone` (not).
fn seed_state(path: &std::path::Path, fake: &FakeSandboxd) -> String {
    let live_id = "sb_00000000000000aa".to_owned();
    let deadline = Timestamp::now() + SignedDuration::from_hours(1);
    fake.insert(&live_id, "tok-live", Some("ns/live"), deadline);
    let row = |id: &str, token: &str| state::ClaimRecord {
        id: id.into(),
        token: token.into(),
        address: "10.1.2.3:7777".into(),
        pod_uid: "uid-old".into(),
        claimed_at: Some(Timestamp::now()),
        deadline: Some(deadline),
        owner: None,
    };
    let mut st = state::StateFile::default();
    st.claims.insert("ns/live".into(), row(&live_id, "tok-live"));
    st.claims.insert("ns/gone".into(), row("sb_00000000000000bb", "tok-gone"));
    state::prepare_dir(path).unwrap();
    state::write(path, &st).unwrap();
    live_id
}

#[tokio::test]
async fn loaded_rows_are_quarantined_until_a_listing_vouches_for_them() {
    let fake = FakeSandboxd::start(Some("node-token")).await;
    let dir = tempfile::tempdir().unwrap();
    let live_id = seed_state(&dir.path().join("state/claims.json"), &fake);
    let mut r = Rig::with(fake, dir, |_| {}).await;
    assert!(r.provider.is_quarantined("ns/live") && r.provider.is_quarantined("ns/gone"));
    assert!(r.provider.get_pods().is_empty(), "a quarantined row is Running");
    // A failed list fails the create: never claim over a possibly live VM.
    r.fake.set_list_fails(true);
    let e = r.provider.create_pod(&pod("live", "uid-new", None)).await.unwrap_err().to_string();
    assert!(e.contains("not yet verified"), "{e}");
    assert_eq!(r.fake.claim_count(), 0);
    // The verification loop's pass keeps every row on a failed list (never read as empty).
    assert!(r.provider.verify_quarantine().await.is_err());
    assert_eq!(r.state().claims.len(), 2);
    assert!(r.provider.is_quarantined("ns/gone"));
    // Listing works: the live row is adopted (no new claim), the unlisted one dropped.
    r.fake.set_list_fails(false);
    r.provider.create_pod(&pod("live", "uid-new", None)).await.unwrap();
    assert_eq!(r.fake.claim_count(), 0);
    assert_eq!(r.provider.claim_id("ns/live").unwrap(), live_id);
    assert!(r.provider.claim_id("ns/gone").is_none());
    let st = r.state();
    assert_eq!(st.claims.keys().collect::<Vec<_>>(), ["ns/live"]);
    assert_eq!(st.claims["ns/live"].pod_uid, "uid-new");
    assert_eq!(phase(&r.pushed().unwrap()), "Running");
}

#[tokio::test]
async fn the_verify_loop_runs_until_clean() {
    let fake = FakeSandboxd::start(Some("node-token")).await;
    let dir = tempfile::tempdir().unwrap();
    seed_state(&dir.path().join("state/claims.json"), &fake);
    fake.set_list_fails(true);
    let owners = FakeOwners::new(Lookup::NoClient);
    let client = SandboxdClient::new(&fake.url(), Some("node-token".into())).unwrap();
    let mut cfg = ProviderConfig::new(dir.path().join("state/claims.json"), String::new());
    cfg.verify_interval = Duration::from_millis(20);
    let provider = Arc::new(SandboxProvider::new(client, owners, cfg).unwrap());
    let _loops = provider.spawn_loops();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(provider.is_quarantined("ns/live"), "a failed list settled a row");
    assert!(fake.list_count() >= 2, "the loop did not retry");
    fake.set_list_fails(false);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!provider.is_quarantined("ns/live"));
    assert!(provider.claim_id("ns/gone").is_none());
    let lists = fake.list_count();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fake.list_count(), lists, "verification kept listing after it was clean");
}

/// Makes the state file unwritable even for root: a non-empty directory where the file goes.
fn block_state(r: &Rig) {
    let p = r.state_path();
    std::fs::remove_file(&p).unwrap();
    std::fs::create_dir(&p).unwrap();
    std::fs::write(p.join("blocker"), b"x").unwrap();
}

fn unblock_state(r: &Rig) {
    std::fs::remove_dir_all(r.state_path()).unwrap();
}

#[tokio::test]
async fn a_persist_failure_releases_the_claim() {
    let mut r = Rig::new().await;
    block_state(&r);
    let e = r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap_err().to_string();
    assert!(e.contains("could not be recorded, so it was released"), "{e}");
    assert!(r.fake.live().is_empty(), "the unrecorded claim leaked");
    assert!(r.provider.get_pod(&PodKey::new("ns", "a")).is_none());
    assert!(r.pushed().is_none(), "Running was pushed for an unrecorded claim");
}

#[tokio::test]
async fn persist_and_release_failures_keep_the_credential_until_an_update_returns_it() {
    let mut r = Rig::new().await;
    block_state(&r);
    r.fake.set_release_fails(true);
    let p = pod("a", "uid-a", None);
    let e = r.provider.create_pod(&p).await.unwrap_err().to_string();
    assert!(e.contains("releasing it failed"), "{e}");
    let stranded = r.provider.claim_id("ns/a").unwrap();
    assert!(r.fake.holds(&stranded));
    assert_eq!(phase(&r.provider.get_pod(&PodKey::new("ns", "a")).unwrap()), "Pending");
    // An update re-runs the create: the stranded claim must go first, and that still fails.
    let e = r.provider.update_pod(&p).await.unwrap_err().to_string();
    assert!(e.contains("only in memory"), "{e}");
    assert_eq!(r.fake.claim_count(), 1, "claimed over a stranded claim");
    // Both fixed: the update returns the stranded VM and claims afresh.
    r.fake.set_release_fails(false);
    unblock_state(&r);
    r.provider.update_pod(&p).await.unwrap();
    assert!(!r.fake.holds(&stranded));
    let id = r.provider.claim_id("ns/a").unwrap();
    assert_ne!(id, stranded);
    assert_eq!(r.state().claims["ns/a"].id, id);
    assert_eq!(phase(&r.pushed().unwrap()), "Running");
}

#[tokio::test]
async fn lease_watch_fails_the_pod_only_after_a_listing_confirms_the_claim_gone() {
    let mut r = Rig::new().await;
    let p = pod("a", "uid-a", None);
    r.provider.create_pod(&p).await.unwrap();
    let _ = r.pushed();
    let id = r.provider.claim_id("ns/a").unwrap();
    let past: Timestamp = "2020-01-01T00:00:00Z".parse().unwrap();
    r.provider.set_deadline("ns/a", past);
    // List error: deferred.
    r.fake.set_list_fails(true);
    r.provider.lease_check().await;
    assert!(r.pushed().is_none());
    assert!(r.provider.claim_id("ns/a").is_some());
    // Still listed: the deadline is refreshed, nothing pushed.
    r.fake.set_list_fails(false);
    r.provider.lease_check().await;
    assert!(r.pushed().is_none());
    assert_eq!(r.state().claims["ns/a"].deadline, r.fake.claim(&id).map(|c| c.deadline));
    // Gone: Failed, SandboxLeaseExpired, containers Terminated exit 1 at the deadline.
    r.provider.set_deadline("ns/a", past);
    r.fake.reap(&id);
    r.provider.lease_check().await;
    let failed = r.pushed().unwrap();
    let s = failed.status.as_ref().unwrap();
    assert_eq!(s.phase.as_deref(), Some("Failed"));
    assert_eq!(s.reason.as_deref(), Some("SandboxLeaseExpired"));
    let t = s.container_statuses.as_ref().unwrap()[0].state.as_ref().unwrap().terminated.clone().unwrap();
    assert_eq!(t.exit_code, 1);
    assert_eq!(t.finished_at.unwrap().0, past);
    assert!(r.provider.claim_id("ns/a").is_none());
    assert_eq!(phase(&r.provider.get_pod(&PodKey::new("ns", "a")).unwrap()), "Failed");
    assert!(r.state().claims.is_empty());
    // Deleting the failed pod just forgets it.
    r.provider.delete_pod(&p).await.unwrap();
    assert!(r.provider.get_pods().is_empty());
}

#[tokio::test]
async fn a_past_cached_deadline_is_settled_before_reuse() {
    let r = Rig::new().await;
    r.owners.set("a", alive("own-a"));
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    r.provider.delete_pod(&p).await.unwrap(); // preserved
    r.provider.set_deadline("ns/a", "2020-01-01T00:00:00Z".parse().unwrap());
    let p2 = pod("a", "uid-a2", Some("own-a"));
    r.fake.set_list_fails(true);
    let e = r.provider.create_pod(&p2).await.unwrap_err().to_string();
    assert!(e.contains("past its cached deadline"), "{e}");
    r.fake.set_list_fails(false);
    // Still listed: refreshed and adopted.
    r.provider.create_pod(&p2).await.unwrap();
    assert_eq!(r.provider.claim_id("ns/a").unwrap(), id);
    assert_eq!(r.fake.claim_count(), 1);
    // Gone: dropped and claimed afresh.
    r.provider.delete_pod(&p2).await.unwrap(); // preserved again
    r.provider.set_deadline("ns/a", "2020-01-01T00:00:00Z".parse().unwrap());
    r.fake.reap(&id);
    r.provider.create_pod(&pod("a", "uid-a3", Some("own-a"))).await.unwrap();
    assert_ne!(r.provider.claim_id("ns/a").unwrap(), id);
    assert_eq!(r.fake.claim_count(), 2);
}

#[tokio::test]
async fn owner_recheck_releases_once_the_owner_is_gone_with_backoff_meanwhile() {
    let r = Rig::tuned(|c| {
        c.recheck_base = Duration::from_millis(400);
        c.recheck_max = Duration::from_millis(1000);
    })
    .await;
    r.owners.set("a", alive("own-a"));
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    r.provider.delete_pod(&p).await.unwrap();
    assert_eq!(r.provider.owner_of("ns/a").unwrap().uid, "own-a");
    let calls = r.owners.calls();
    r.provider.recheck_owners().await; // first pass: preserved, next after the base delay
    assert_eq!(r.owners.calls(), calls + 1);
    r.provider.recheck_owners().await; // not due yet: no read
    assert_eq!(r.owners.calls(), calls + 1);
    tokio::time::sleep(Duration::from_millis(450)).await;
    r.provider.recheck_owners().await; // due: read, preserved, the delay doubles to 800 ms
    assert_eq!(r.owners.calls(), calls + 2);
    tokio::time::sleep(Duration::from_millis(450)).await;
    r.provider.recheck_owners().await; // 450 ms < 800 ms: not due
    assert_eq!(r.owners.calls(), calls + 2);
    assert!(r.fake.holds(&id));
    // Owner gone: released at the next due pass.
    r.owners.set("a", Lookup::NotFound { details_name: "a".into() });
    tokio::time::sleep(Duration::from_millis(400)).await;
    r.provider.recheck_owners().await;
    assert!(!r.fake.holds(&id), "the preserved VM of a gone owner was not released");
    assert!(r.provider.claim_id("ns/a").is_none());
    assert!(r.state().claims.is_empty());
    assert_eq!(r.provider.releasing_len(), 0);
}

#[tokio::test]
async fn queued_releases_survive_a_failure_and_drain_later() {
    let r = Rig::new().await;
    r.owners.set("a", alive("own-a"));
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let id = r.provider.claim_id("ns/a").unwrap();
    r.provider.delete_pod(&p).await.unwrap();
    r.owners.set("a", Lookup::NotFound { details_name: "a".into() });
    r.fake.set_release_fails(true);
    r.provider.recheck_owners().await;
    assert_eq!(r.provider.releasing_len(), 1);
    assert_eq!(r.state().releasing.len(), 1, "the queued release is not durable");
    assert!(r.fake.holds(&id));
    r.fake.set_release_fails(false);
    r.provider.recheck_owners().await;
    assert!(!r.fake.holds(&id));
    assert!(r.state().releasing.is_empty());
}

#[tokio::test]
async fn a_claim_of_a_replaced_owner_is_released_not_adopted() {
    let r = Rig::new().await;
    r.owners.set("a", alive("own-a"));
    let p = pod("a", "uid-a", Some("own-a"));
    r.provider.create_pod(&p).await.unwrap();
    let old = r.provider.claim_id("ns/a").unwrap();
    r.provider.delete_pod(&p).await.unwrap(); // preserved for own-a
                                              // The Sandbox was recreated under the same name: the recorded owner (own-a) is replaced.
    r.owners.set("a", alive("own-b"));
    r.provider.create_pod(&pod("a", "uid-b", Some("own-b"))).await.unwrap();
    let new = r.provider.claim_id("ns/a").unwrap();
    assert_ne!(new, old);
    assert!(!r.fake.holds(&old), "the replaced owner's VM was not released");
    assert!(r.fake.holds(&new));
    // A stranger (bare pod) may not take over a claim whose owner is alive: the create fails.
    r.owners.set("a", alive("own-b"));
    r.provider.delete_pod(&pod("a", "uid-b", Some("own-b"))).await.unwrap(); // preserved for own-b
    let e = r.provider.create_pod(&pod("a", "uid-c", None)).await.unwrap_err().to_string();
    assert!(e.contains("may not be adopted"), "{e}");
    assert!(r.fake.holds(&new));
}

#[tokio::test]
async fn orphan_scan_only_logs() {
    let r = Rig::new().await;
    r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    let far = Timestamp::now() + SignedDuration::from_hours(1);
    r.fake.insert("sb_00000000000000ff", "t", None, far);
    r.fake.insert("sb_00000000000000fe", "t", Some("other/x"), far);
    r.provider.orphan_scan().await;
    assert_eq!(r.fake.live().len(), 3, "the orphan scan released something");
    assert!(r.fake.releases().is_empty());
}

#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_taken_back_not_duplicated() {
    let mut r = Rig::new().await;
    // As if an earlier process died between sandboxd's grant and its own persist (twice).
    let newer = Timestamp::now() + SignedDuration::from_hours(2);
    let older = Timestamp::now() + SignedDuration::from_hours(1);
    r.fake.insert("sb_000000000000a001", "tok-old", Some("ns/a"), older);
    r.fake.insert("sb_000000000000a002", "tok-new", Some("ns/a"), newer);
    r.fake.insert("sb_000000000000b001", "tok-b", Some("ns/b"), newer);
    // A failed listing fails the create (no claim over a possibly lost one).
    r.fake.set_list_fails(true);
    let e = r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap_err().to_string();
    assert!(e.contains("answer was lost"), "{e}");
    r.fake.set_list_fails(false);
    r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    assert_eq!(r.fake.claim_count(), 0, "claimed a duplicate");
    assert_eq!(r.provider.claim_id("ns/a").unwrap(), "sb_000000000000a002");
    assert!(!r.fake.holds("sb_000000000000a001"), "the older duplicate was not released");
    assert!(r.fake.holds("sb_000000000000b001"), "another pod's claim was touched");
    let st = r.state();
    assert_eq!((st.claims["ns/a"].id.as_str(), st.claims["ns/a"].token.as_str()), ("sb_000000000000a002", "tok-new"));
    let pushed = r.pushed().unwrap();
    assert_eq!(phase(&pushed), "Running");
    assert_eq!(pushed.status.unwrap().pod_ip.as_deref(), Some("127.0.0.9"), "no owner_addr: the advertise host");
    // Deleting the (bare) pod releases the recovered claim with the recovered token.
    r.provider.delete_pod(&pod("a", "uid-a", None)).await.unwrap();
    assert!(!r.fake.holds("sb_000000000000a002"));
}

#[tokio::test]
async fn a_clean_create_lists_nothing_and_a_lost_answer_is_taken_back() {
    let mut r = Rig::new().await;
    // The start-up scan (one listing) makes later clean creates list nothing.
    r.provider.scan_lost().await.unwrap();
    let lists = r.fake.list_count();
    for name in ["a", "b", "c"] {
        r.provider.create_pod(&pod(name, &format!("uid-{name}"), None)).await.unwrap();
    }
    assert_eq!(r.fake.list_count(), lists, "a clean create listed");
    assert_eq!(r.fake.claim_count(), 3);
    // A definite refusal leaves nothing to look for.
    r.fake.set_claim_mode(ClaimMode::TooMany);
    r.provider.create_pod(&pod("d", "uid-d", None)).await.unwrap_err();
    r.fake.set_claim_mode(ClaimMode::Grant);
    r.provider.create_pod(&pod("d", "uid-d", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), lists, "a refused claim made the next create list");
    // A grant whose answer is lost: the next create of that key lists and takes it back.
    r.fake.set_claim_mode(ClaimMode::LoseAnswer);
    r.provider.create_pod(&pod("e", "uid-e", None)).await.unwrap_err();
    let granted = r.fake.live().len();
    r.fake.set_claim_mode(ClaimMode::Grant);
    r.provider.create_pod(&pod("e", "uid-e", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), lists + 1, "the key with a lost answer did not list");
    assert_eq!(r.fake.live().len(), granted, "claimed a duplicate instead of taking the lost claim back");
    assert!(r.fake.holds(&r.provider.claim_id("ns/e").unwrap()));
    // And it is clean again afterwards.
    r.provider.delete_pod(&pod("e", "uid-e", None)).await.unwrap();
    r.provider.create_pod(&pod("e", "uid-e2", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), lists + 1);
    while r.pushed().is_some() {}
}

#[tokio::test]
async fn a_create_before_the_start_up_scan_scans_and_a_stray_of_another_key_is_marked() {
    let r = Rig::new().await;
    let far = Timestamp::now() + SignedDuration::from_hours(1);
    r.fake.insert("sb_000000000000b001", "tok-b", Some("ns/b"), far);
    // No scan yet: this create scans everything (one listing) and so learns of ns/b's claim.
    r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), 1);
    r.provider.create_pod(&pod("c", "uid-c", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), 1, "a clean key listed after the scan");
    r.provider.create_pod(&pod("b", "uid-b", None)).await.unwrap();
    assert_eq!(r.fake.list_count(), 2, "the key the scan marked did not list");
    assert_eq!(r.provider.claim_id("ns/b").unwrap(), "sb_000000000000b001", "not taken back");
}

#[tokio::test]
async fn without_a_root_token_a_lost_claim_is_left_to_its_lease() {
    let fake = FakeSandboxd::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let owners = FakeOwners::new(Lookup::NoClient);
    let client = SandboxdClient::new(&fake.url(), None).unwrap();
    let provider =
        SandboxProvider::new(client, owners, ProviderConfig::new(dir.path().join("c.json"), String::new())).unwrap();
    fake.insert("sb_000000000000a001", "tok", Some("ns/a"), Timestamp::now() + SignedDuration::from_hours(1));
    provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    assert_eq!(fake.claim_count(), 1);
    assert_ne!(provider.claim_id("ns/a").unwrap(), "sb_000000000000a001");
    assert!(fake.holds("sb_000000000000a001"));
}

/// Test access to the table.
impl SandboxProvider {
    fn owner_of(&self, key: &str) -> Option<crate::state::OwnerRef> {
        self.lock().claims.get(key).and_then(|c| c.owner.clone())
    }
    fn set_deadline(&self, key: &str, d: Timestamp) {
        if let Some(c) = self.lock().claims.get_mut(key) {
            c.deadline = Some(d);
        }
    }
    fn releasing_len(&self) -> usize {
        self.lock().releasing.len()
    }
}

#[tokio::test]
async fn pod_usage_comes_from_sandboxds_measured_stats() {
    use vnode::PodMetrics as _;
    let r = Rig::new().await;
    r.provider.create_pod(&pod("a", "uid-a", None)).await.unwrap();
    r.provider.create_pod(&pod("b", "uid-b", None)).await.unwrap();
    assert!(r.provider.pod_usage().await.is_empty(), "sandboxd measured nothing: no Pod");
    let id = r.provider.claim_id("ns/a").unwrap();
    r.fake.set_usage(&id, 7_000_000_000, 200 << 20);
    let got = r.provider.pod_usage().await;
    assert_eq!(got.len(), 1, "{got:?}");
    let u = &got[0];
    assert_eq!((u.pod.clone(), u.uid.as_str(), u.container.as_str()), (PodKey::new("ns", "a"), "uid-a", "agent"));
    assert_eq!((u.cpu_usage_nanos, u.memory_working_set_bytes), (7_000_000_000, 200 << 20));
    assert_eq!(u.measured_at, humantime::parse_rfc3339("2030-01-01T00:00:10Z").unwrap());
    assert!(u.started_at.is_some(), "the claim time");
}

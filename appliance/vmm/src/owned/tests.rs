//! Tests of the ownership layer on a minimal in-memory driver.
#![allow(clippy::unwrap_used)] // in a test, a panic is the failure report

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::*;
use crate::driver::{AfterSnapshot, Backend, BootSpec, Snapshot};
use crate::Accel;

/// A driver holding listed VMs in memory: `list` fails while `fail_list`, `attach` of an id in
/// `fail_attach` fails, `kill` forgets the VM.
#[derive(Default)]
struct MemDriver {
    vms: Mutex<BTreeMap<VmId, Vm>>,
    fail_list: bool,
    fail_attach: HashSet<VmId>,
    attached: Mutex<Vec<VmId>>,
}

fn spec(name: &str) -> BootSpec {
    crate::test_utils::boot_spec(name)
}

fn vm(id: &str, state: VmState) -> Vm {
    crate::test_utils::vm(Path::new("/vms"), id, state)
}

fn id(s: &str) -> VmId {
    VmId::new(s).unwrap()
}

impl MemDriver {
    fn with(vms: &[(&str, VmState)]) -> MemDriver {
        let d = MemDriver::default();
        for (i, s) in vms {
            d.vms.lock().unwrap().insert(id(i), vm(i, *s));
        }
        d
    }
    fn ids(&self) -> Vec<String> {
        self.vms.lock().unwrap().keys().map(|k| k.to_string()).collect()
    }
}

fn unsupported() -> DriverError {
    DriverError::Unsupported { backend: Backend::Qemu, what: "not in this fake".into() }
}

#[async_trait]
impl Driver for MemDriver {
    fn backend(&self) -> Backend {
        Backend::Qemu
    }
    fn accel(&self) -> Accel {
        Accel::Tcg
    }
    async fn boot(&self, _: &BootSpec) -> Result<Vm, DriverError> {
        Err(unsupported())
    }
    async fn pause(&self, _: &Vm) -> Result<(), DriverError> {
        Err(unsupported())
    }
    async fn resume(&self, _: &Vm) -> Result<(), DriverError> {
        Err(unsupported())
    }
    async fn snapshot(&self, _: &Vm, _: &Path, _: AfterSnapshot) -> Result<Snapshot, DriverError> {
        Err(unsupported())
    }
    async fn restore(&self, _: &Snapshot, _: &VmId) -> Result<Vm, DriverError> {
        Err(unsupported())
    }
    async fn shutdown(&self, vm: &Vm, _: Duration) -> Result<(), DriverError> {
        self.kill(vm).await
    }
    async fn kill(&self, vm: &Vm) -> Result<(), DriverError> {
        self.vms.lock().unwrap().remove(&vm.id);
        Ok(())
    }
    async fn list(&self) -> Result<Vec<Vm>, DriverError> {
        if self.fail_list {
            return Err(unsupported());
        }
        Ok(self.vms.lock().unwrap().values().cloned().collect())
    }
    async fn attach(&self, id: &VmId) -> Result<Vm, DriverError> {
        if self.fail_attach.contains(id) {
            return Err(unsupported());
        }
        self.attached.lock().unwrap().push(id.clone());
        let mut v = self.vms.lock().unwrap().get(id).cloned().ok_or_else(unsupported)?;
        v.pid = 2; // what attaching returns, not the listed record
        Ok(v)
    }
}

const SBX: Ownership = Ownership::new("sbx-");
const VC: Ownership = Ownership::new("vc-");

#[test]
fn instance_ids_map_back_to_their_owner() {
    for owner in ["vc-a", "vc-sandbox-default-cocoon-example", "vc-x-0123456789"] {
        let inst = VmId::generate(owner);
        assert_eq!(VC.owner_of(inst.as_str()), Some(owner), "{inst}");
        assert!(VC.is_instance(&inst, owner, None));
    }
    assert_eq!(VC.owner_of("base-0a1b2c3d"), None, "not ours");
    assert_eq!(VC.owner_of("vc-x-0a1b2c3"), None, "7 hex");
    assert_eq!(VC.owner_of("vc-x-0A1B2C3D"), None, "upper case");
    assert_eq!(SBX.owner_of("vc-x-0a1b2c3d"), None, "another service's");
    assert!(SBX.owns("sbx-gb-0123-00000001") && !SBX.owns("base-00000001"));
    // The current instance and the owner's own id are instances too, whatever their form.
    assert!(VC.is_instance(&id("vc-a"), "vc-a", None));
    assert!(VC.is_instance(&id("other"), "vc-a", Some(&id("other"))));
    assert!(!VC.is_instance(&id("vc-b-0a1b2c3d"), "vc-a", None));
}

#[tokio::test]
async fn a_failed_listing_is_an_error_never_empty() {
    let d = MemDriver { fail_list: true, ..MemDriver::with(&[("sbx-a-00000001", VmState::Running)]) };
    assert!(Listing::of(&d).await.is_err());
}

#[tokio::test]
async fn instances_and_orphans_of_a_listing() {
    let d = MemDriver::with(&[
        ("vc-a-0a1b2c3d", VmState::Running),
        ("vc-a-11111111", VmState::Creating),
        ("vc-b-22222222", VmState::Running),
        ("base-33333333", VmState::Running),
    ]);
    let l = Listing::of(&d).await.unwrap();
    let inst: Vec<&str> = VC.instances(&l, "vc-a", None).iter().map(|v| v.id.as_str()).collect();
    assert_eq!(inst, ["vc-a-0a1b2c3d", "vc-a-11111111"]);
    assert_eq!(l.get(&id("vc-b-22222222")).map(|v| v.state), Some(VmState::Running));
    // vc-a has a record; vc-b and the foreign VM do not — only vc-b is an orphan of ours.
    let orphans: Vec<&str> =
        VC.orphans(&l, |v| VC.is_instance(&v.id, "vc-a", None)).iter().map(|v| v.id.as_str()).collect();
    assert_eq!(orphans, ["vc-b-22222222"]);
}

#[tokio::test]
async fn the_sweep_destroys_only_unnamed_vms_of_the_prefix() {
    let d = MemDriver::with(&[
        ("sbx-claimed-00000001", VmState::Running),
        ("sbx-warm-00000002", VmState::Running),
        ("sbx-left-00000003", VmState::Running),
        ("sbx-half-00000004", VmState::Creating),
        ("base-00000005", VmState::Running),
    ]);
    let l = Listing::of(&d).await.unwrap();
    let named: HashSet<VmId> = [id("sbx-claimed-00000001"), id("sbx-warm-00000002")].into();
    let swept = SBX.sweep(&l, |v| named.contains(&v.id), &Kill(&d)).await;
    assert_eq!(swept, [id("sbx-half-00000004"), id("sbx-left-00000003")]);
    assert_eq!(d.ids(), ["base-00000005", "sbx-claimed-00000001", "sbx-warm-00000002"]);
}

#[tokio::test]
async fn adopt_attaches_the_live_reports_the_gone_and_the_half_created() {
    let mut d = MemDriver::with(&[
        ("sbx-a-00000001", VmState::Running),
        ("sbx-b-00000002", VmState::Running),
        ("sbx-c-00000003", VmState::Creating),
    ]);
    d.fail_attach.insert(id("sbx-b-00000002"));
    let l = Listing::of(&d).await.unwrap();
    let wanted = vec![
        ("a", id("sbx-a-00000001")),
        ("b", id("sbx-b-00000002")),
        ("c", id("sbx-c-00000003")),
        ("d", id("sbx-d-00000004")),
    ];
    let got = adopt(&d, &l, wanted).await;
    let attached: Vec<(&str, &str, u32)> = got.attached.iter().map(|(k, v)| (*k, v.id.as_str(), v.pid)).collect();
    assert_eq!(attached, [("a", "sbx-a-00000001", 2), ("b", "sbx-b-00000002", 0)], "a failed attach keeps the listed");
    assert_eq!(*d.attached.lock().unwrap(), [id("sbx-a-00000001")]);
    assert_eq!(got.half_created.iter().map(|(k, _)| *k).collect::<Vec<_>>(), ["c"]);
    assert_eq!(got.gone, [("d", id("sbx-d-00000004"))]);
}

/// A service's own record fields, as vk-cocoon keeps them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Meta {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    source: String,
}

fn meta(name: &str) -> Meta {
    Meta { name: name.into(), namespace: Some("ns".into()), source: "run x".into() }
}

#[test]
fn records_claim_exclusively_complete_list_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let store: RecordStore<Meta> = RecordStore::open(dir.path().join("cocoon")).unwrap();
    let a = id("vc-a");
    let rec = store.claim(&a, meta("a")).unwrap();
    assert_eq!((rec.state, rec.vmm_id.as_ref()), (RecordState::Creating, None));
    assert!(matches!(store.claim(&a, meta("a2")), Err(RecordStoreError::InUse { id }) if id == a));
    assert_eq!(store.load("vc-a").unwrap().unwrap().meta.name, "a", "the first claim stays");
    let inst = VmId::generate("vc-a");
    let done = store.complete(&a, &inst, spec("vc-a")).unwrap();
    assert_eq!((done.state, done.vmm_id.as_ref()), (RecordState::Created, Some(&inst)));
    assert_eq!(store.load("vc-a").unwrap(), Some(done));
    assert!(matches!(store.complete(&id("vc-b"), &inst, spec("b")), Err(RecordStoreError::Missing { .. })));
    store.claim(&id("vc-b"), meta("b")).unwrap();
    // A temporary file of an interrupted write is no record.
    std::fs::write(store.dir().join(".vc-c.json.0123.tmp"), b"{").unwrap();
    let mut names: Vec<String> = store.list().unwrap().into_iter().map(|r| r.meta.name).collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
    store.delete("vc-a").unwrap();
    store.delete("vc-a").unwrap();
    assert_eq!(store.load("vc-a").unwrap(), None);
    std::fs::write(store.dir().join("vc-d.json"), b"{").unwrap();
    assert!(
        matches!(store.list(), Err(RecordStoreError::Record(crate::record::RecordError::Parse { .. }))),
        "a corrupt record is never skipped"
    );
}

#[test]
fn records_read_the_flat_json_written_before_the_store() {
    // `<root>/cocoon/<id>.json` as vk-cocoon wrote it: the metadata sits beside the common fields.
    let old =
        r#"{"id":"vc-a","name":"a","hypervisor":"qemu","state":"created","source":"run x","created_at_epoch_secs":1}"#;
    let rec: OwnedRecord<Meta> = serde_json::from_str(old).unwrap();
    assert_eq!(rec.meta, Meta { name: "a".into(), namespace: None, source: "run x".into() });
    assert_eq!((rec.state, &rec.vmm_id, &rec.spec, rec.created_at_epoch_secs), (RecordState::Created, &None, &None, 1));
    let v = serde_json::to_value(OwnedRecord { meta: meta("a"), ..rec }).unwrap();
    assert_eq!((v["name"].as_str(), v["namespace"].as_str(), v["id"].as_str()), (Some("a"), Some("ns"), Some("vc-a")));
}

//! Journal tests: replay rules, torn writes, failed appends, compaction, and `kill -9` of a
//! writer process at random moments.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, Write as _};
use std::sync::Mutex;

use super::*;

/// A claim table reduced to what the journal reads: records and the queued lines (the
/// daemon's table is `claims::ClaimTable`).
#[derive(Debug, Default)]
struct Table {
    rows: BTreeMap<String, ClaimRecord>,
    log: Pending,
}

impl Table {
    fn restore(gen: u64, records: Vec<ClaimRecord>) -> Self {
        Table { rows: records.into_iter().map(|r| (r.id.clone(), r)).collect(), log: Pending::at(gen) }
    }

    fn insert(&mut self, r: ClaimRecord) -> u64 {
        self.rows.insert(r.id.clone(), r.clone());
        self.log.push(LogOp::Grant(r))
    }

    fn set_deadline(&mut self, id: &str, deadline_unix_ms: u64) -> Option<u64> {
        self.rows.get_mut(id)?.deadline_unix_ms = deadline_unix_ms;
        Some(self.log.push(LogOp::Renew { id: id.into(), deadline_unix_ms }))
    }

    fn remove(&mut self, id: &str) -> Option<(ClaimRecord, u64)> {
        let r = self.rows.remove(id)?;
        Some((r, self.log.push(LogOp::Release { id: id.into() })))
    }
}

impl ClaimLog for Table {
    fn take_pending(&mut self) -> (u64, Vec<LogEntry>) {
        self.log.take()
    }

    fn snapshot(&self) -> (u64, Vec<ClaimRecord>) {
        (self.log.gen(), self.rows.values().cloned().collect())
    }
}

fn rec(id: &str, deadline: u64) -> ClaimRecord {
    ClaimRecord {
        id: id.into(),
        token: "t".repeat(32),
        vm: VmId::new("sbx-aa-00000001").expect("id"),
        key: PoolKey::parse("base", None, None).expect("key"),
        deadline_unix_ms: deadline,
        claimed_at_unix_ms: 1,
        claim_ref: Some("ref".into()),
        from_checkpoint: None,
        hibernate_snap: None,
        pending_snap: None,
        volumes: Vec::new(),
    }
}

fn grant(t: &Mutex<Table>, id: &str, deadline: u64) -> u64 {
    lock(t).insert(rec(id, deadline))
}

fn ids(l: &Loaded) -> Vec<&str> {
    l.claims.iter().map(|r| r.id.as_str()).collect()
}

fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).expect("ls").map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn appends_replay_and_group_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), true).expect("open");
    assert_eq!(j.recover().expect("empty"), Loaded::default());
    let t = Mutex::new(Table::default());
    let g1 = grant(&t, "sb_1", 10);
    let g2 = grant(&t, "sb_2", 10);
    j.commit_claims(g2, &t).expect("commit");
    let log = dir.path().join(CLAIMS_LOG);
    let len = std::fs::metadata(&log).expect("log").len();
    // Generation 1 went out with generation 2: nothing is written again.
    j.commit_claims(g1, &t).expect("already on disk");
    assert_eq!(std::fs::metadata(&log).expect("log").len(), len);
    let g = lock(&t).set_deadline("sb_2", 99).expect("renew");
    j.commit_claims(g, &t).expect("commit");
    let (_, g) = lock(&t).remove("sb_1").expect("release");
    j.commit_claims(g, &t).expect("commit");
    let text = std::fs::read_to_string(&log).expect("log");
    assert_eq!(text.lines().count(), 4, "one line per mutation: {text}");
    let l = read_claims(dir.path()).expect("read");
    assert_eq!((l.seq, l.claims.clone(), l.torn), (4, vec![rec("sb_2", 99)], 0));
    assert_eq!(l.claims, lock(&t).snapshot().1);
    // Start-up compacts into the snapshot and drops the log.
    let j2 = Journal::open(dir.path(), true).expect("reopen");
    assert_eq!(j2.recover().expect("recover"), l);
    assert_eq!(names(dir.path()), set(&[CLAIMS_FILE]));
    assert_eq!(read_claims(dir.path()).expect("read"), l);
}

#[test]
fn lines_the_snapshot_covers_are_not_replayed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open");
    j.recover().expect("recover");
    let t = Mutex::new(Table::default());
    let g = grant(&t, "sb_a", 1);
    j.commit_claims(g, &t).expect("commit");
    let old_log = std::fs::read(dir.path().join(CLAIMS_LOG)).expect("log");
    let g = lock(&t).set_deadline("sb_a", 2).expect("renew");
    j.commit_claims(g, &t).expect("commit");
    Journal::open(dir.path(), false).expect("reopen").recover().expect("compact");
    // A crash between writing the snapshot and deleting the log leaves old lines behind:
    // replaying the grant (seq 1) over the snapshot (seq 2) would undo the renew.
    std::fs::write(dir.path().join(CLAIMS_LOG), &old_log).expect("restore old log");
    let l = read_claims(dir.path()).expect("read");
    assert_eq!((l.seq, l.claims), (2, vec![rec("sb_a", 2)]));
}

#[test]
fn a_torn_final_line_is_ignored_and_garbage_inside_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open");
    let t = Mutex::new(Table::default());
    let g = grant(&t, "sb_1", 5);
    j.commit_claims(g, &t).expect("commit");
    let log = dir.path().join(CLAIMS_LOG);
    let full = std::fs::read(&log).expect("log");
    // A second grant cut short by a crash: never acknowledged, so ignored.
    let g = grant(&t, "sb_2", 5);
    let torn: Vec<u8> = {
        let (_, pending) = lock(&t).take_pending();
        assert_eq!(pending.len(), 1);
        let line = serde_json::to_vec(&pending[0]).expect("encode");
        line[..line.len() - 7].to_vec()
    };
    assert_eq!(g, 2);
    std::fs::write(&log, [full.as_slice(), torn.as_slice()].concat()).expect("tear");
    let l = read_claims(dir.path()).expect("a torn tail is not an error");
    assert_eq!((ids(&l), l.torn), (vec!["sb_1"], 1));
    // Recovery drops the torn bytes for good.
    let j2 = Journal::open(dir.path(), false).expect("reopen");
    assert_eq!(ids(&j2.recover().expect("recover")), vec!["sb_1"]);
    assert!(!log.exists());
    // A complete line that does not parse is not a torn write: refuse to guess.
    std::fs::write(&log, [torn.as_slice(), b"\n", full.as_slice()].concat()).expect("corrupt");
    assert!(matches!(read_claims(dir.path()), Err(JournalError::LogLine { line: 1, .. })));
    assert!(Journal::open(dir.path(), false).expect("reopen").recover().is_err());
    // Same for a corrupt snapshot.
    std::fs::remove_file(&log).expect("rm");
    std::fs::write(dir.path().join(CLAIMS_FILE), b"{\"claims\":[").expect("write");
    assert!(matches!(read_claims(dir.path()), Err(JournalError::Parse { .. })));
}

#[test]
fn a_failed_append_is_reported_and_the_next_commit_compacts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open");
    let t = Mutex::new(Table::default());
    let g = grant(&t, "sb_1", 5);
    j.commit_claims(g, &t).expect("commit");
    // A directory where the log must be makes the append fail.
    let log = dir.path().join(CLAIMS_LOG);
    std::fs::remove_file(&log).expect("rm");
    std::fs::create_dir(&log).expect("block");
    let g = grant(&t, "sb_2", 5);
    assert!(matches!(j.commit_claims(g, &t), Err(JournalError::Io { .. })));
    // The caller rolls the grant back; the rollback is journaled by the next commit.
    let (_, g) = lock(&t).remove("sb_2").expect("rollback");
    std::fs::remove_dir(&log).expect("unblock");
    let g3 = grant(&t, "sb_3", 5);
    assert!(g3 > g);
    j.commit_claims(g3, &t).expect("compacts inline");
    assert_eq!(names(dir.path()), set(&[CLAIMS_FILE]), "the dirty log was replaced by a snapshot");
    assert_eq!(ids(&read_claims(dir.path()).expect("read")), vec!["sb_1", "sb_3"]);
    // Appends resume after the snapshot.
    let (_, g) = lock(&t).remove("sb_1").expect("release");
    j.commit_claims(g, &t).expect("append");
    assert!(log.is_file());
    assert_eq!(ids(&read_claims(dir.path()).expect("read")), vec!["sb_3"]);
}

#[test]
fn background_compaction_keeps_every_mutation_under_concurrent_commits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open").with_compaction_bounds(4096, 1 << 30);
    j.recover().expect("recover");
    let t = Mutex::new(Table::default());
    let compactions = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2)
            .map(|w| {
                let (j, t, compactions) = (&j, &t, &compactions);
                s.spawn(move || {
                    for i in 0..400 {
                        // Let the compactor catch up at two points, so compactions happen while
                        // commits are still coming (a loaded machine may otherwise finish the
                        // writers first).
                        if i == 130 || i == 260 {
                            let want = if i == 130 { 1 } else { 2 };
                            let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
                            while compactions.load(std::sync::atomic::Ordering::Relaxed) < want
                                && std::time::Instant::now() < until
                            {
                                std::thread::yield_now();
                            }
                        }
                        let id = format!("sb_{w}_{i:04}");
                        let g = grant(t, &id, i);
                        j.commit_claims(g, t).expect("grant");
                        if i % 3 == 0 {
                            let g = lock(t).set_deadline(&id, 1000 + i).expect("renew");
                            j.commit_claims(g, t).expect("renew");
                        }
                        if i % 2 == 0 {
                            let (_, g) = lock(t).remove(&id).expect("release");
                            j.commit_claims(g, t).expect("release");
                        }
                    }
                })
            })
            .collect();
        while writers.iter().any(|w| !w.is_finished()) {
            if j.compact_if_large(&t).expect("compact") {
                compactions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    assert!(compactions.into_inner() >= 2, "the log must have been compacted while writing");
    assert!(!dir.path().join(CLAIMS_LOG_SEALED).exists());
    let l = read_claims(dir.path()).expect("read");
    assert_eq!(l.claims, lock(&t).snapshot().1, "snapshot + log replay = the table");
    assert_eq!(l.claims.len(), 400);
    assert_eq!(l.claims.iter().filter(|r| r.deadline_unix_ms >= 1000).count(), 67 * 2);
}

#[test]
fn a_failed_snapshot_keeps_the_sealed_log_until_a_compaction_succeeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open").with_compaction_bounds(64, 1 << 30);
    let t = Mutex::new(Table::default());
    let g = grant(&t, "sb_1", 5);
    j.commit_claims(g, &t).expect("commit");
    // A directory in place of the snapshot makes its rename fail.
    std::fs::create_dir_all(dir.path().join(CLAIMS_FILE).join("x")).expect("block");
    assert!(j.compact_if_large(&t).is_err());
    assert!(dir.path().join(CLAIMS_LOG_SEALED).is_file(), "the sealed log is the only copy");
    let g = grant(&t, "sb_2", 5);
    j.commit_claims(g, &t).expect("appends to a new log");
    assert!(dir.path().join(CLAIMS_LOG).is_file() && dir.path().join(CLAIMS_LOG_SEALED).is_file());
    std::fs::remove_dir_all(dir.path().join(CLAIMS_FILE)).expect("unblock");
    assert!(j.compact_if_large(&t).expect("retry"), "a sealed log is compacted whatever its size");
    assert!(!dir.path().join(CLAIMS_LOG_SEALED).exists());
    assert_eq!(ids(&read_claims(dir.path()).expect("read")), vec!["sb_1", "sb_2"]);
}

#[test]
fn pools_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path(), false).expect("open");
    assert_eq!(j.load_pools().expect("none"), None);
    let p = vec![PoolConfig {
        template: "base".into(),
        net: None,
        size: Some("medium".into()),
        warm: Some(2),
        warm_max: None,
        idle_hibernate_seconds: None,
        archive_after_seconds: None,
        archive_delete_after_seconds: None,
    }];
    j.write_pools(&p).expect("write");
    assert_eq!(j.load_pools().expect("load"), Some(p));
    assert_eq!(names(dir.path()), set(&[POOLS_FILE]), "no temp file left behind");
}

/// Env var that turns [`kill9_child`] into the writer process of [`kill9_loses_no_acknowledged_mutation`].
const CHILD_ENV: &str = "SANDBOXD_JOURNAL_KILL9_CHILD";

/// The writer process: grants, renews and releases in a loop, compacting often, printing one
/// `ack` line after each commit returns. It is not a test of its own: ignored, and run with
/// `--ignored` by its parent.
#[test]
#[ignore = "the child process of kill9_loses_no_acknowledged_mutation, which runs it"]
fn kill9_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        panic!("kill9_child runs only as the child of kill9_loses_no_acknowledged_mutation ({CHILD_ENV} unset)");
    };
    let j = Journal::open(Path::new(&dir), false).expect("open").with_compaction_bounds(2048, 16 << 10);
    let loaded = j.recover().expect("recover");
    let t = Mutex::new(Table::restore(loaded.seq, loaded.claims));
    let run = format!("{:08x}", rand::random::<u32>());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let started = std::time::Instant::now();
    let mut out = std::io::stdout();
    let mut ack = |line: String| writeln!(out, "{line}").and_then(|()| out.flush()).is_ok();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                j.compact_if_large(&t).expect("compact");
                std::thread::yield_now();
            }
        });
        // Bounded, so an orphaned child (parent gone: stdout closed) ends on its own.
        for i in 0u64..1_000_000 {
            if started.elapsed() > std::time::Duration::from_secs(60) {
                break;
            }
            let id = format!("sb_{run}{i:08x}");
            let g = grant(&t, &id, i);
            j.commit_claims(g, &t).expect("grant");
            if !ack(format!("ack grant {id} {i}")) {
                break;
            }
            if i % 3 == 1 {
                let g = lock(&t).set_deadline(&id, i + 7).expect("renew");
                j.commit_claims(g, &t).expect("renew");
                if !ack(format!("ack renew {id} {}", i + 7)) {
                    break;
                }
            }
            if i % 4 == 2 {
                let (_, g) = lock(&t).remove(&id).expect("release");
                j.commit_claims(g, &t).expect("release");
                if !ack(format!("ack release {id} 0")) {
                    break;
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}

/// Records one `ack <op> <id> <deadline>` line of the child; false for other output.
fn record(line: &str, acked: &mut BTreeMap<String, Option<u64>>) -> bool {
    // libtest prints `test … ... ` without a newline before the child's first line.
    let Some(at) = line.find("ack ") else { return false };
    let f: Vec<&str> = line[at..].split(' ').collect();
    if let ["ack", op, id, n] = f[..] {
        let n: u64 = n.parse().expect("number");
        acked.insert(id.to_string(), if op == "release" { None } else { Some(n) });
        return true;
    }
    false
}

#[test]
fn kill9_loses_no_acknowledged_mutation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test binary");
    // id → Some(deadline) if live, None if released, as acknowledged so far.
    let mut acked: BTreeMap<String, Option<u64>> = BTreeMap::new();
    for round in 0..6 {
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "journal::tests::kill9_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("piped");
        let mut lines = std::io::BufReader::new(stdout).lines();
        let kill_after = 20 + rand::random::<u32>() % 600;
        let mut seen = 0;
        while seen < kill_after {
            let line = lines.next().expect("child ended early").expect("read");
            if record(&line, &mut acked) {
                seen += 1;
            }
        }
        std::thread::sleep(std::time::Duration::from_micros(u64::from(rand::random::<u32>() % 3000)));
        child.kill().expect("SIGKILL");
        // Lines the child printed before it died were acknowledged too.
        for line in lines {
            let line = line.expect("read");
            record(&line, &mut acked);
        }
        child.wait().expect("reap");
        let l = read_claims(dir.path()).unwrap_or_else(|e| panic!("round {round}: journal unreadable: {e:?}"));
        let on_disk: BTreeMap<&str, u64> = l.claims.iter().map(|r| (r.id.as_str(), r.deadline_unix_ms)).collect();
        let mut in_flight = 0;
        for (id, want) in &acked {
            let got = on_disk.get(id.as_str()).copied();
            if got != *want {
                // Only the one mutation in flight at the kill may be ahead of its ack:
                // a renew or release of the newest id.
                in_flight += 1;
                assert!(want.is_some(), "round {round}: released {id} is back: {got:?}");
                assert!(in_flight <= 1, "round {round}: {id}: acknowledged {want:?}, journal has {got:?}");
            }
        }
        let unacked: Vec<(&str, u64)> =
            on_disk.iter().filter(|(id, _)| !acked.contains_key(**id)).map(|(id, d)| (*id, *d)).collect();
        assert!(in_flight + unacked.len() <= 1, "round {round}: more than one unacknowledged change: {unacked:?}");
        // What the in-flight mutation did is the truth the next child starts from.
        let truth: BTreeMap<String, Option<u64>> =
            acked.keys().map(|id| (id.clone(), on_disk.get(id.as_str()).copied())).collect();
        acked = truth;
        acked.extend(unacked.into_iter().map(|(id, d)| (id.to_string(), Some(d))));
        println!(
            "round {round}: killed after {kill_after} acks; {} live claims on disk, torn {}",
            on_disk.len(),
            l.torn
        );
    }
}

//! The process table shared by every connection: one record per process started by
//! `exec` (foreground or detached) or `pty_open`, with its state, its output ring
//! (detached only) and a change signal that `attach` follows.
//!
//! Lifetimes: a foreground or pty record is removed as soon as its `exit` was produced; a
//! detached record is kept [`DETACHED_RETENTION`] after the process exited (its ring stays
//! readable by `logs`/`attach`), then removed. Signals are refused once a record is marked
//! exited, so a recycled pid is never signalled through a stale record (the window between
//! the kernel reaping the child and the record being marked is a few instructions).

use crate::sys;
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use wire::{ProcInfo, ProcState};

/// Bytes of output a detached process's ring keeps.
pub const RING_BYTES: usize = 256 * 1024;
/// How long a detached record stays after its process exited.
pub const DETACHED_RETENTION: Duration = Duration::from_secs(5 * 60);

/// Which stream a chunk of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What started a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcKind {
    Foreground,
    Detached,
    Pty,
}

/// One chunk of a ring, numbered so a follower knows what it has seen.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub seq: u64,
    pub stream: Stream,
    pub data: Arc<[u8]>,
}

#[derive(Debug, Default)]
struct Ring {
    chunks: VecDeque<Chunk>,
    bytes: usize,
    next_seq: u64,
}

impl Ring {
    fn push(&mut self, stream: Stream, data: &[u8], cap: usize) {
        if cap == 0 || data.is_empty() {
            return;
        }
        let data = if data.len() > cap { &data[data.len() - cap..] } else { data };
        self.bytes += data.len();
        self.chunks.push_back(Chunk { seq: self.next_seq, stream, data: data.into() });
        self.next_seq += 1;
        while self.bytes > cap {
            let Some(front) = self.chunks.front_mut() else { break };
            let excess = self.bytes - cap;
            if front.data.len() <= excess {
                self.bytes -= front.data.len();
                self.chunks.pop_front();
            } else {
                front.data = front.data[excess..].into();
                self.bytes -= excess;
            }
        }
    }
}

#[derive(Debug, Default)]
struct RecState {
    exit: Option<i32>,
    ring: Ring,
    removed: bool,
}

/// A snapshot for a follower: the chunks at or after a sequence number, and the end state.
#[derive(Debug)]
pub struct Since {
    pub chunks: Vec<Chunk>,
    pub next: u64,
    pub exit: Option<i32>,
    pub removed: bool,
}

/// One tracked process.
#[derive(Debug)]
pub struct ProcRecord {
    pub pid: u32,
    pub argv: Vec<String>,
    pub kind: ProcKind,
    pub started_at_epoch_secs: u64,
    /// The pty master of a `pty_open` shell (for `pty_resize`).
    pub pty: Option<Arc<OwnedFd>>,
    ring_cap: usize,
    state: Mutex<RecState>,
    changed: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a panic elsewhere while holding it; the data (plain
    // counters and buffers) stays consistent, so keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ProcRecord {
    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Appends output to the ring (detached records only; others keep none).
    pub fn push_output(&self, stream: Stream, data: &[u8]) {
        lock(&self.state).ring.push(stream, data, self.ring_cap);
        self.notify();
    }

    /// Marks the process exited with `code`.
    pub fn set_exit(&self, code: i32) {
        lock(&self.state).exit = Some(code);
        self.notify();
    }

    pub fn exit_code(&self) -> Option<i32> {
        lock(&self.state).exit
    }

    /// Sends `sig` to the process group unless the process already exited (a no-op then).
    pub fn signal(&self, sig: Signal) -> Result<(), nix::Error> {
        let state = lock(&self.state);
        if state.exit.is_some() {
            return Ok(());
        }
        match sys::signal_group(self.pid, sig) {
            Err(nix::Error::ESRCH) => Ok(()),
            other => other,
        }
    }

    /// A change receiver; subscribe before reading with [`since`](Self::since) so no change
    /// is missed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Output chunks numbered `seq` or later (older ones may have left the ring) and the end state.
    pub fn since(&self, seq: u64) -> Since {
        let state = lock(&self.state);
        let chunks: Vec<Chunk> = state.ring.chunks.iter().filter(|c| c.seq >= seq).cloned().collect();
        Since { chunks, next: state.ring.next_seq, exit: state.exit, removed: state.removed }
    }

    pub fn info(&self) -> ProcInfo {
        let exit = self.exit_code();
        ProcInfo {
            pid: self.pid,
            argv: self.argv.clone(),
            detached: self.kind == ProcKind::Detached,
            state: if exit.is_some() { ProcState::Exited } else { ProcState::Running },
            exit_code: exit,
            started_at_epoch_secs: self.started_at_epoch_secs,
        }
    }
}

/// Every tracked process, by pid.
#[derive(Debug, Default)]
pub struct ProcTable {
    procs: Mutex<BTreeMap<u32, Arc<ProcRecord>>>,
}

impl ProcTable {
    /// Registers a freshly spawned process.
    pub fn insert(&self, pid: u32, argv: Vec<String>, kind: ProcKind, pty: Option<Arc<OwnedFd>>) -> Arc<ProcRecord> {
        let (changed, _) = watch::channel(0);
        let rec = Arc::new(ProcRecord {
            pid,
            argv,
            kind,
            started_at_epoch_secs: sys::epoch_secs(),
            pty,
            ring_cap: if kind == ProcKind::Detached { RING_BYTES } else { 0 },
            state: Mutex::new(RecState::default()),
            changed,
        });
        if let Some(old) = lock(&self.procs).insert(pid, Arc::clone(&rec)) {
            // The pid was recycled while an exited record was still retained.
            old.mark_removed();
        }
        rec
    }

    pub fn get(&self, pid: u32) -> Option<Arc<ProcRecord>> {
        lock(&self.procs).get(&pid).cloned()
    }

    /// Removes `rec` (if it is still the record of its pid) and wakes its followers.
    pub fn remove(&self, rec: &Arc<ProcRecord>) {
        let mut procs = lock(&self.procs);
        if procs.get(&rec.pid).is_some_and(|r| Arc::ptr_eq(r, rec)) {
            procs.remove(&rec.pid);
        }
        drop(procs);
        rec.mark_removed();
    }

    /// Rows for `ps`, sorted by pid.
    pub fn list(&self) -> Vec<ProcInfo> {
        let recs: Vec<Arc<ProcRecord>> = lock(&self.procs).values().cloned().collect();
        recs.iter().map(|r| r.info()).collect()
    }

    /// Processes still running.
    pub fn running(&self) -> u64 {
        let recs: Vec<Arc<ProcRecord>> = lock(&self.procs).values().cloned().collect();
        recs.iter().filter(|r| r.exit_code().is_none()).count() as u64
    }
}

impl ProcRecord {
    fn mark_removed(&self) {
        lock(&self.state).removed = true;
        self.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest_bytes() {
        let mut ring = Ring::default();
        ring.push(Stream::Stdout, b"aaaa", 6);
        ring.push(Stream::Stderr, b"bbbb", 6);
        assert_eq!(ring.bytes, 6);
        let all: Vec<u8> = ring.chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
        assert_eq!(all, b"aabbbb");
        ring.push(Stream::Stdout, b"0123456789", 6);
        let all: Vec<u8> = ring.chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
        assert_eq!(all, b"456789");
        assert_eq!(ring.next_seq, 3);
    }

    #[test]
    fn exited_records_ignore_signals_and_list_sorted() {
        let table = ProcTable::default();
        let b = table.insert(4_000_000, vec!["b".into()], ProcKind::Detached, None);
        let _a = table.insert(3_999_999, vec!["a".into()], ProcKind::Foreground, None);
        b.set_exit(0);
        assert_eq!(b.signal(Signal::SIGKILL), Ok(()));
        let rows = table.list();
        assert_eq!(rows.iter().map(|r| r.pid).collect::<Vec<_>>(), vec![3_999_999, 4_000_000]);
        assert_eq!(rows[1].exit_code, Some(0));
        assert_eq!(table.running(), 1);
        table.remove(&b);
        assert!(table.get(4_000_000).is_none());
        assert!(b.since(0).removed);
    }
}

//! The per-claim slots: [`ClaimCaps`] bounds the concurrent `/agent` relays, `/ports` relays
//! and `/exec` calls of one claim; [`ClaimSlots`] hands out [`SlotGuard`]s that free their slot
//! when dropped (the relay or exec ended). Each guard carries a byte clock ([`Activity`]): the
//! relay touches it, the relay idle timeout and automatic hibernation read it
//! ([`ClaimSlots::activity`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Concurrent uses of one claim, each capped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimCaps {
    /// `/agent` relays (`max_agent_relays_per_claim`).
    pub agent_relays: usize,
    /// `/ports` relays (`max_port_relays_per_claim`).
    pub port_relays: usize,
    /// `/exec` calls (`max_execs_per_claim`).
    pub execs: usize,
}

impl Default for ClaimCaps {
    fn default() -> Self {
        use sandboxd_api::config::{
            DEFAULT_AGENT_RELAYS_PER_CLAIM, DEFAULT_EXECS_PER_CLAIM, DEFAULT_PORT_RELAYS_PER_CLAIM,
        };
        ClaimCaps {
            agent_relays: DEFAULT_AGENT_RELAYS_PER_CLAIM,
            port_relays: DEFAULT_PORT_RELAYS_PER_CLAIM,
            execs: DEFAULT_EXECS_PER_CLAIM,
        }
    }
}

/// A per-claim use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// `GET …/agent`.
    Agent,
    /// `GET …/ports/{port}`.
    Port,
    /// `POST …/exec`.
    Exec,
}

impl Use {
    fn index(self) -> usize {
        match self {
            Use::Agent => 0,
            Use::Port => 1,
            Use::Exec => 2,
        }
    }

    /// The config key of this cap.
    pub fn key(self) -> &'static str {
        match self {
            Use::Agent => "max_agent_relays_per_claim",
            Use::Port => "max_port_relays_per_claim",
            Use::Exec => "max_execs_per_claim",
        }
    }

    /// What it is, for messages.
    pub fn what(self) -> &'static str {
        match self {
            Use::Agent => "/agent relays",
            Use::Port => "/ports relays",
            Use::Exec => "/exec calls",
        }
    }
}

/// A claim is at one of its caps.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("too many concurrent {} for this sandbox: {cap} already open ({key} = {cap})", use_.what(), key = use_.key())]
pub struct CapError {
    /// Which use.
    pub use_: Use,
    /// The cap.
    pub cap: usize,
}

/// The per-claim counters behind [`ClaimCaps`], and when each claim's last use ended (the
/// idle clock of automatic hibernation).
#[derive(Debug, Default)]
pub struct ClaimSlots {
    caps: Option<ClaimCaps>,
    open: Mutex<SlotState>,
}

#[derive(Debug, Default)]
struct SlotState {
    open: HashMap<String, [usize; 3]>,
    /// The byte clocks of each claim's open relays.
    relays: HashMap<String, Vec<Arc<Activity>>>,
    last_ended: HashMap<String, Instant>,
}

/// Whether a claim is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimUse {
    /// An exec is open (it may run quietly for long).
    Busy,
    /// Nothing moved since then: the last byte through an open relay, else the end of the
    /// last use.
    IdleSince(Instant),
    /// Never used (since this process started).
    Unused,
}

/// When a relay last moved a byte (either way).
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    /// A clock started now.
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity { start: Instant::now(), last_ms: AtomicU64::new(0) })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A byte moved.
    pub fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// When the last byte moved (the start when none did).
    pub fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Resolves once nothing moved for `limit`.
    pub async fn idle(&self, limit: Duration) {
        let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        loop {
            let quiet = self.now_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed));
            if quiet >= limit_ms {
                return;
            }
            tokio::time::sleep(Duration::from_millis(limit_ms - quiet)).await;
        }
    }
}

impl ClaimSlots {
    /// Counters enforcing `caps`.
    pub fn new(caps: ClaimCaps) -> Arc<ClaimSlots> {
        Arc::new(ClaimSlots { caps: Some(caps), open: Mutex::new(SlotState::default()) })
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether claim `id` is in use, or since when nothing moved.
    pub fn activity(&self, id: &str) -> ClaimUse {
        let s = self.lock();
        if s.open.get(id).is_some_and(|row| row[Use::Exec.index()] > 0) {
            return ClaimUse::Busy;
        }
        let relays = s.relays.get(id).and_then(|r| r.iter().map(|a| a.last()).max());
        match (relays, s.last_ended.get(id).copied()) {
            (Some(r), Some(e)) => ClaimUse::IdleSince(r.max(e)),
            (Some(t), None) | (None, Some(t)) => ClaimUse::IdleSince(t),
            (None, None) => ClaimUse::Unused,
        }
    }

    /// Forgets an ended claim.
    pub fn forget(&self, id: &str) {
        self.lock().last_ended.remove(id);
    }

    /// Takes one `use_` slot of claim `id`, or refuses at the cap. The slot is freed when the
    /// guard is dropped.
    pub fn acquire(self: &Arc<Self>, id: &str, use_: Use) -> Result<SlotGuard, CapError> {
        let caps = self.caps.unwrap_or_default();
        let cap = match use_ {
            Use::Agent => caps.agent_relays,
            Use::Port => caps.port_relays,
            Use::Exec => caps.execs,
        };
        let mut state = self.lock();
        let row = state.open.entry(id.to_string()).or_default();
        if row[use_.index()] >= cap {
            return Err(CapError { use_, cap });
        }
        row[use_.index()] += 1;
        let activity = Activity::new();
        if use_ != Use::Exec {
            state.relays.entry(id.to_string()).or_default().push(Arc::clone(&activity));
        }
        Ok(SlotGuard { slots: Arc::clone(self), id: id.to_string(), use_, activity })
    }

    /// Open uses of claim `id` (agent, port, exec).
    pub fn open(&self, id: &str) -> [usize; 3] {
        self.lock().open.get(id).copied().unwrap_or_default()
    }
}

/// One open use of a claim; dropping it frees the slot.
#[derive(Debug)]
pub struct SlotGuard {
    slots: Arc<ClaimSlots>,
    id: String,
    use_: Use,
    activity: Arc<Activity>,
}

impl SlotGuard {
    /// The byte clock of this use (a relay touches it; the idle checks read it).
    pub fn activity(&self) -> Arc<Activity> {
        Arc::clone(&self.activity)
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut state = self.slots.lock();
        if let Some(relays) = state.relays.get_mut(&self.id) {
            relays.retain(|a| !Arc::ptr_eq(a, &self.activity));
            if relays.is_empty() {
                state.relays.remove(&self.id);
            }
        }
        if let Some(row) = state.open.get_mut(&self.id) {
            row[self.use_.index()] = row[self.use_.index()].saturating_sub(1);
            if row.iter().all(|n| *n == 0) {
                state.open.remove(&self.id);
                state.last_ended.insert(self.id.clone(), Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_idle_since_its_last_byte_and_busy_while_it_execs() {
        let slots = ClaimSlots::new(ClaimCaps::default());
        assert_eq!(slots.activity("a"), ClaimUse::Unused);
        let relay = slots.acquire("a", Use::Agent).expect("slot");
        let ClaimUse::IdleSince(opened) = slots.activity("a") else { panic!("an open, silent relay is idle") };
        std::thread::sleep(Duration::from_millis(20));
        relay.activity().touch();
        let ClaimUse::IdleSince(moved) = slots.activity("a") else { panic!("idle since the byte") };
        assert!(moved > opened);
        let exec = slots.acquire("a", Use::Exec).expect("slot");
        assert_eq!(slots.activity("a"), ClaimUse::Busy, "a running exec keeps it busy");
        drop(exec);
        drop(relay);
        let ClaimUse::IdleSince(ended) = slots.activity("a") else { panic!("idle since the last use") };
        assert!(ended >= moved);
        slots.forget("a");
        assert_eq!(slots.activity("a"), ClaimUse::Unused);
    }

    #[test]
    fn claim_slots_cap_and_free() {
        let s = ClaimSlots::new(ClaimCaps { agent_relays: 2, port_relays: 1, execs: 1 });
        let a1 = s.acquire("sb_1", Use::Agent).expect("1");
        let _a2 = s.acquire("sb_1", Use::Agent).expect("2");
        let e = s.acquire("sb_1", Use::Agent).expect_err("cap");
        assert_eq!(
            e.to_string(),
            "too many concurrent /agent relays for this sandbox: 2 already open (max_agent_relays_per_claim = 2)"
        );
        // Other claims and other uses are separate.
        let _b = s.acquire("sb_2", Use::Agent).expect("other claim");
        let _p = s.acquire("sb_1", Use::Port).expect("port");
        assert!(s.acquire("sb_1", Use::Port).is_err());
        drop(a1);
        let _a3 = s.acquire("sb_1", Use::Agent).expect("freed");
        assert_eq!(s.open("sb_1"), [2, 1, 0]);
    }
}

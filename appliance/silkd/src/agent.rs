//! The state every connection shares: the process table, the shell sessions, and the
//! start time `info` reports uptime from.

use crate::procs::ProcTable;
use crate::sessions::{SessionTable, IDLE_TTL};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often idle sessions are looked for.
const SESSION_REAP_EVERY: Duration = Duration::from_secs(60);

/// One silkd's shared state.
#[derive(Debug)]
pub struct Agent {
    started: Instant,
    pub procs: ProcTable,
    pub sessions: SessionTable,
}

impl Agent {
    /// Fresh state; call [`Agent::spawn_housekeeping`] once inside a runtime.
    pub fn new() -> Arc<Self> {
        Arc::new(Self { started: Instant::now(), procs: ProcTable::default(), sessions: SessionTable::default() })
    }

    /// Starts the background reaper of idle sessions (it ends when the agent is dropped).
    pub fn spawn_housekeeping(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SESSION_REAP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(agent) = weak.upgrade() else { return };
                let reaped = agent.sessions.reap_idle(IDLE_TTL);
                if reaped > 0 {
                    tracing::info!(reaped, "reaped idle sessions");
                }
            }
        });
    }

    pub fn uptime_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }
}

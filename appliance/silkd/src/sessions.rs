//! The shell sessions every connection shares ([`SessionTable`]); the ops that create, use and
//! remove them are in [`crate::ops::session`].

use crate::sys;
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// Sessions with no command for this long are reaped.
pub const IDLE_TTL: Duration = Duration::from_secs(30 * 60);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data stays consistent across a panic elsewhere; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct SessionIo {
    pub(crate) stdin: ChildStdin,
    pub(crate) stdout: ChildStdout,
    pub(crate) child: Child,
}

/// One persistent shell.
pub struct Session {
    pub id: String,
    pub pid: u32,
    pub(crate) io: tokio::sync::Mutex<SessionIo>,
    pub(crate) last_used: Mutex<Instant>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("id", &self.id).field("pid", &self.pid).finish()
    }
}

impl Session {
    pub(crate) fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }

    pub(crate) fn kill(&self) {
        if let Err(err) = sys::signal_group(self.pid, Signal::SIGKILL) {
            tracing::debug!(id = %self.id, %err, "session already gone");
        }
    }
}

/// Every live session, by id.
#[derive(Debug, Default)]
pub struct SessionTable {
    pub(crate) map: Mutex<BTreeMap<String, Arc<Session>>>,
}

impl SessionTable {
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        lock(&self.map).get(id).cloned()
    }

    pub fn ids(&self) -> Vec<String> {
        lock(&self.map).keys().cloned().collect()
    }

    /// Removes and kills a session; `false` if there was none.
    pub fn remove(&self, id: &str) -> bool {
        let removed = lock(&self.map).remove(id);
        match removed {
            Some(s) => {
                s.kill();
                true
            }
            None => false,
        }
    }

    pub(crate) fn remove_exact(&self, session: &Arc<Session>) {
        let mut map = lock(&self.map);
        if map.get(&session.id).is_some_and(|s| Arc::ptr_eq(s, session)) {
            map.remove(&session.id);
        }
    }

    /// Kills sessions idle for longer than `ttl` (one running a command is never idle).
    pub fn reap_idle(&self, ttl: Duration) -> usize {
        let mut map = lock(&self.map);
        let idle: Vec<String> = map
            .iter()
            .filter(|(_, s)| s.io.try_lock().is_ok() && lock(&s.last_used).elapsed() > ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &idle {
            if let Some(s) = map.remove(id) {
                s.kill();
            }
        }
        idle.len()
    }
}

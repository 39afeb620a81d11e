//! systemd readiness protocol (`sd_notify`): `READY=1` once, `STATUS=` on changes,
//! `WATCHDOG=1` from the main loop. Everything is a no-op without `NOTIFY_SOCKET`, so a dev run
//! in a terminal behaves the same minus the messages.
//!
//! The watchdog is kicked by the main loop itself (not a helper task) at half of
//! `WATCHDOG_USEC`: if the loop stalls, the pings stop and systemd's `WatchdogSec=` restarts
//! the supervisor.

use std::time::Duration;

/// Why a notification could not be sent (logged, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// Writing to `NOTIFY_SOCKET` failed.
    #[error("sending {what} to $NOTIFY_SOCKET")]
    Send {
        /// The message kind.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The supervisor's side of the protocol.
#[derive(Debug)]
pub struct Notifier {
    active: bool,
    watchdog: Option<Duration>,
    ready_sent: bool,
    last_status: Option<String>,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET` and `WATCHDOG_USEC` / `WATCHDOG_PID` (the variables stay set; the
    /// children never inherit them, see [`crate::services::SCRUBBED_ENV`]).
    pub fn from_env() -> Self {
        let active = std::env::var_os("NOTIFY_SOCKET").is_some_and(|v| !v.is_empty());
        // sd_watchdog_enabled(3): WATCHDOG_USEC set and, when WATCHDOG_PID is set, naming us.
        let usec = std::env::var("WATCHDOG_USEC").ok().and_then(|v| v.trim().parse::<u64>().ok()).filter(|u| *u > 0);
        let for_us = match std::env::var("WATCHDOG_PID") {
            Ok(p) => p.trim().parse::<u32>().ok() == Some(std::process::id()),
            Err(_) => true,
        };
        let watchdog = usec.filter(|_| active && for_us).map(Duration::from_micros);
        Notifier { active, watchdog, ready_sent: false, last_status: None }
    }

    /// Whether a service manager listens.
    pub fn active(&self) -> bool {
        self.active
    }

    /// How often the main loop must call [`Notifier::watchdog`] (half of `WATCHDOG_USEC`).
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.map(|d| (d / 2).max(Duration::from_millis(10)))
    }

    /// Whether `READY=1` was sent.
    pub fn is_ready(&self) -> bool {
        self.ready_sent
    }

    fn send(&self, what: &'static str, states: &[sd_notify::NotifyState]) {
        if !self.active {
            return;
        }
        if let Err(source) = sd_notify::notify(false, states) {
            let e = NotifyError::Send { what, source };
            tracing::warn!(error = %crate::error_chain(&e), "sd_notify failed");
        }
    }

    /// Sends `READY=1` (once) with a status line.
    pub fn ready(&mut self, status: &str) {
        if self.ready_sent {
            return;
        }
        self.ready_sent = true;
        self.last_status = Some(status.to_string());
        self.send("READY", &[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(status)]);
    }

    /// Sends `STATUS=<text>` when it differs from the last one.
    pub fn status(&mut self, text: &str) {
        if self.last_status.as_deref() == Some(text) {
            return;
        }
        self.last_status = Some(text.to_string());
        self.send("STATUS", &[sd_notify::NotifyState::Status(text)]);
    }

    /// Sends `WATCHDOG=1` (when the watchdog is enabled).
    pub fn watchdog(&self) {
        if self.watchdog.is_some() {
            self.send("WATCHDOG", &[sd_notify::NotifyState::Watchdog]);
        }
    }

    /// Sends `STOPPING=1`.
    pub fn stopping(&mut self, status: &str) {
        self.last_status = Some(status.to_string());
        self.send("STOPPING", &[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status(status)]);
    }
}

//! One line per step on the console (`guest-init: [  0.123] message`), never failing.
//!
//! PID 1's stdout/stderr are the kernel console (`/dev/console`, ttyS0). Write errors are
//! ignored: losing a log line must never take the guest down.

use std::io::Write;

/// Seconds since boot (CLOCK_MONOTONIC), for boot-time measurements in the console log.
pub fn uptime() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes into it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Writes one console line.
pub fn line(msg: &str) {
    let text = format!("guest-init: [{:8.3}] {msg}\n", uptime());
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

/// `console::say!("...", args)` — formats and writes one console line.
macro_rules! say {
    ($($arg:tt)*) => { $crate::console::line(&format!($($arg)*)) };
}
pub(crate) use say;

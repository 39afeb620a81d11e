//! `set_clock`: the host's wall-clock time into the guest.
//!
//! A VM restored from a snapshot, or resumed after waiting paused in a pool, runs on with the
//! clock it had when it stopped: minutes or days behind. Before the host hands such a VM to a
//! user it sends its own time here, and the realtime clock is stepped to it
//! (`clock_settime(CLOCK_REALTIME)`, which needs `CAP_SYS_TIME`: silkd has it).

use crate::error::OpError;
use crate::rpc::Rpc;
use nix::sys::time::TimeSpec;
use nix::time::ClockId;
use std::time::Duration;
use wire::{Response, SET_CLOCK_MIN_UNIX_SECS};

/// Checks a `set_clock` time: not before [`SET_CLOCK_MIN_UNIX_SECS`].
pub fn check(unix_ns: u64) -> Result<Duration, OpError> {
    let at = Duration::from_nanos(unix_ns);
    if at.as_secs() < SET_CLOCK_MIN_UNIX_SECS {
        return Err(OpError::bad_request(format!(
            "set_clock: {unix_ns} ns since the epoch is before {SET_CLOCK_MIN_UNIX_SECS} s (2024-01-01): \
             the host's clock is wrong; fix it (NTP) and the guest keeps its own until then"
        )));
    }
    Ok(at)
}

/// Steps the realtime clock to `unix_ns`, then answers `done`.
pub async fn set_clock(rpc: &mut Rpc, unix_ns: u64) -> Result<(), OpError> {
    let at = check(unix_ns)?;
    nix::time::clock_settime(ClockId::CLOCK_REALTIME, TimeSpec::from_duration(at))
        .map_err(|e| OpError::internal(format!("set_clock: clock_settime: {e}")))?;
    rpc.send(Response::Done).await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    // The op itself steps the clock of the machine it runs on, so only the check runs here;
    // the guest side is covered end to end (sandboxd's e2e reads a resumed guest's `date`).
    #[test]
    fn times_before_2024_are_bad_requests() {
        assert!(matches!(check(0), Err(e) if e.kind == wire::ErrorKind::BadRequest));
        assert!(check((SET_CLOCK_MIN_UNIX_SECS - 1) * 1_000_000_000).is_err());
        let now = 1_765_000_000_123_456_789;
        assert_eq!(check(now).unwrap(), Duration::from_nanos(now));
    }
}

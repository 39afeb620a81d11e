//! The guest's own view of its memory, for `GET /v1/sandboxes/{id}/stats`: `MemTotal −
//! MemAvailable` of the guest's `/proc/meminfo`, read through silkd (`fs_read`).
//!
//! The guest controls every byte of the answer: the read is bounded in time
//! ([`READ_TIMEOUT`]) and size ([`MAX_MEMINFO`]), the parse never panics, and the result is
//! clamped to the size class's memory (a lying guest can only misreport itself).

use std::time::Duration;

use silkd_client::{AgentConn, ClientError};
use thiserror::Error;
use vmm::{Driver, DriverError, Vm, AGENT_PORT};

/// How long the whole read may take (connect included).
pub const READ_TIMEOUT: Duration = Duration::from_secs(3);
/// The most of `/proc/meminfo` read (a real one is about 1.5 KiB).
pub const MAX_MEMINFO: usize = 16 * 1024;

/// Why the guest's memory could not be read.
#[derive(Debug, Error)]
pub enum GuestMemoryError {
    /// The agent could not be reached.
    #[error("connecting to the agent")]
    Connect(#[source] DriverError),
    /// The read failed (including an answer over [`MAX_MEMINFO`]).
    #[error("reading /proc/meminfo")]
    Read(#[source] ClientError),
    /// No answer within [`READ_TIMEOUT`].
    #[error("no answer within {READ_TIMEOUT:?}")]
    Timeout,
    /// The answer has no usable `MemTotal` / `MemAvailable`.
    #[error("/proc/meminfo has no usable MemTotal and MemAvailable")]
    Unparsable,
}

/// Bytes in use inside the guest, at most `limit`.
pub async fn used_bytes(driver: &dyn Driver, vm: &Vm, limit: u64) -> Result<u64, GuestMemoryError> {
    let read = async {
        let stream = driver.connect(vm, AGENT_PORT).await.map_err(GuestMemoryError::Connect)?;
        let mut conn = AgentConn::new(stream).with_output_cap(MAX_MEMINFO);
        conn.download(&wire::Request::FsRead { path: "/proc/meminfo".into() }).await.map_err(GuestMemoryError::Read)
    };
    let text = tokio::time::timeout(READ_TIMEOUT, read).await.map_err(|_| GuestMemoryError::Timeout)??;
    let used = parse_used(&String::from_utf8_lossy(&text)).ok_or(GuestMemoryError::Unparsable)?;
    Ok(used.min(limit))
}

/// `MemTotal − MemAvailable` in bytes (the kernel writes both in kB).
pub fn parse_used(meminfo: &str) -> Option<u64> {
    let m = foundation::procfs::parse_meminfo(meminfo).ok()?;
    m.memory_total_bytes.checked_sub(m.memory_available_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn used_is_total_minus_available_and_bad_input_is_none() {
        let real = "MemTotal:         498012 kB\nMemFree:          431220 kB\nMemAvailable:     440100 kB\n\
                    Inactive(file):    12000 kB\n";
        assert_eq!(parse_used(real), Some((498_012 - 440_100) * 1024));
        for bad in [
            "",
            "MemTotal: 10 kB\n",
            "MemTotal: 10 kB\nMemAvailable: 20 kB\n",
            "MemTotal: x kB\nMemAvailable: 1 kB\n",
            "MemTotal: 99999999999999999999 kB\nMemAvailable: 1 kB\n",
            "MemTotal: 18446744073709551615 kB\nMemAvailable: 1 kB\n",
            "MemTotalX: 10 kB\nMemAvailable: 1 kB\n",
        ] {
            assert_eq!(parse_used(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_guest_flooding_its_meminfo_stops_at_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = crate::test_utils::FakeDriver::new(dir.path());
        let vm = d.boot(&crate::test_utils::fake_spec("mem")).await.expect("boot");
        let set = |text: Vec<u8>| *d.procs_of(&vm.id).meminfo.lock().expect("lock") = Some(text);
        // One byte over the cap, and far over it: refused, never buffered whole.
        for n in [MAX_MEMINFO + 1, 64 * MAX_MEMINFO] {
            set(vec![b'x'; n]);
            let e = used_bytes(d.as_ref(), &vm, u64::MAX).await.expect_err("over the cap");
            assert!(matches!(e, GuestMemoryError::Read(_)), "{n} bytes: {e:?}");
        }
        // At the cap a real answer still parses; the result is clamped to the size class.
        let mut text = b"MemTotal: 1000 kB\nMemFree: 200 kB\nMemAvailable: 250 kB\nInactive(file): 10 kB\n".to_vec();
        text.resize(MAX_MEMINFO, b'\n');
        set(text);
        assert_eq!(used_bytes(d.as_ref(), &vm, u64::MAX).await.expect("read"), 750 * 1024);
        assert_eq!(used_bytes(d.as_ref(), &vm, 4096).await.expect("clamped"), 4096);
    }
}

//! `reseed`: the host's randomness into the guest kernel's entropy pool.
//!
//! A clone of a snapshot resumes with its parent's kernel RNG state; before the host hands a
//! clone out it sends fresh bytes here. They are mixed in with `RNDADDENTROPY` (credited, so
//! the pool counts them) and the CRNG is then forced to reseed with `RNDRESEEDCRNG`, so the
//! very next `getrandom` and `/dev/urandom` read differ between clones. Both ioctls need
//! `CAP_SYS_ADMIN`, which silkd (the guest's init-adjacent agent) has.

use crate::error::OpError;
use crate::rpc::Rpc;
use std::os::fd::AsRawFd;
use wire::{Response, RESEED_MAX_BYTES};

/// `struct rand_pool_info` with room for the largest reseed.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; RESEED_MAX_BYTES],
}

// RNDADDENTROPY = _IOW('R', 0x03, int[2]); RNDRESEEDCRNG = _IO('R', 0x07) (linux/random.h).
nix::ioctl_write_ptr_bad!(
    rnd_add_entropy,
    nix::request_code_write!(b'R', 0x03, 2 * size_of::<libc::c_int>()),
    RandPoolInfo
);
nix::ioctl_none!(rnd_reseed_crng, b'R', 0x07);

/// Checks the size of a reseed: 1..=[`RESEED_MAX_BYTES`] bytes.
pub fn check(data: &[u8]) -> Result<(), OpError> {
    if data.is_empty() || data.len() > RESEED_MAX_BYTES {
        return Err(OpError::bad_request(format!(
            "reseed: data must be 1 to {RESEED_MAX_BYTES} bytes, got {}",
            data.len()
        )));
    }
    Ok(())
}

/// Mixes `data` into the kernel pool and forces a CRNG reseed, then answers `done`.
pub async fn reseed(rpc: &mut Rpc, data: Vec<u8>) -> Result<(), OpError> {
    check(&data)?;
    tokio::task::spawn_blocking(move || mix(&data)).await.map_err(|e| OpError::internal(format!("reseed: {e}")))??;
    rpc.send(Response::Done).await?;
    Ok(())
}

fn mix(data: &[u8]) -> Result<(), OpError> {
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| OpError::io("reseed: /dev/urandom", &e))?;
    let mut info = RandPoolInfo {
        entropy_count: (data.len() * 8) as libc::c_int,
        buf_size: data.len() as libc::c_int,
        buf: [0; RESEED_MAX_BYTES],
    };
    info.buf[..data.len()].copy_from_slice(data);
    // SAFETY: `info` is a valid rand_pool_info whose buf holds buf_size bytes; the kernel reads
    // no more than that.
    unsafe { rnd_add_entropy(dev.as_raw_fd(), &info) }
        .map_err(|e| OpError::internal(format!("reseed: RNDADDENTROPY: {e}")))?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    unsafe { rnd_reseed_crng(dev.as_raw_fd()) }
        .map_err(|e| OpError::internal(format!("reseed: RNDRESEEDCRNG: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_outside_one_to_256_are_bad_requests() {
        assert!(check(&[]).is_err());
        assert!(check(&[0; RESEED_MAX_BYTES + 1]).is_err());
        assert!(matches!(check(&[0; RESEED_MAX_BYTES + 1]), Err(e) if e.kind == wire::ErrorKind::BadRequest));
        assert!(check(&[7]).is_ok());
        assert!(check(&[7; RESEED_MAX_BYTES]).is_ok());
    }

    #[test]
    fn the_ioctls_are_accepted_by_a_real_kernel() {
        // Adding entropy and reseeding are harmless on the test host; they need CAP_SYS_ADMIN.
        match mix(&[0x5a; 64]) {
            Ok(()) => {}
            Err(e) if e.message.contains("EPERM") => foundation::testing::skip(&format!("no CAP_SYS_ADMIN here ({e})")),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn the_ioctl_header_matches_the_kernel_struct() {
        // rand_pool_info is two ints then the buffer.
        assert_eq!(std::mem::offset_of!(RandPoolInfo, buf), 2 * size_of::<libc::c_int>());
    }
}

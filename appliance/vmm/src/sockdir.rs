//! Short socket paths for VM directories with long paths.
//!
//! A Unix socket path must fit `sun_path` (107 bytes plus the NUL), and a VM directory such as
//! `/root/.cache/chrysalis/vk-cocoon/<node>/vms/vc-<long pod-derived name>-<suffix>` does not
//! leave room for `agent-serial.sock`. When it would not fit, the VM's sockets are addressed
//! through a symbolic link `$TMPDIR/chrysalis-vm-<16 hex of sha256(dir)>` → the VM directory:
//! the sockets still live in the VM directory (bind and connect resolve the link), only the
//! string handed to QEMU and to `connect` is short. The link name is a function of the
//! directory, so a restarted driver finds (or re-creates) the same link.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::driver::DriverError;

/// The longest socket file name the QEMU driver puts in a VM directory, with its `/`.
const LONGEST_NAME: usize = "/agent-serial.sock".len();
/// The longest path `sun_path` holds.
const SUN_PATH_MAX: usize = 107;

/// The link used for `dir` when its own path is too long.
fn link_for(dir: &Path) -> PathBuf {
    let digest = Sha256::digest(dir.as_os_str().as_encoded_bytes());
    std::env::temp_dir().join(format!("chrysalis-vm-{}", &hex::encode(digest)[..16]))
}

/// The directory through which the sockets of the VM in `dir` are addressed: `dir` itself when
/// short enough, else the link (created, or re-pointed if something else sits there).
pub fn socket_dir(dir: &Path) -> Result<PathBuf, DriverError> {
    if dir.as_os_str().len() + LONGEST_NAME <= SUN_PATH_MAX {
        return Ok(dir.to_path_buf());
    }
    let link = link_for(dir);
    if link.as_os_str().len() + LONGEST_NAME > SUN_PATH_MAX {
        return Err(DriverError::Invalid(format!(
            "the VM directory {} and the temporary directory {} are both too long for Unix socket paths",
            dir.display(),
            std::env::temp_dir().display()
        )));
    }
    match std::fs::read_link(&link) {
        Ok(target) if target == dir => return Ok(link),
        Ok(_) => std::fs::remove_file(&link).map_err(|e| DriverError::io(format!("removing {}", link.display()), e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(DriverError::io(format!("reading the link {}", link.display()), e)),
    }
    std::os::unix::fs::symlink(dir, &link)
        .map_err(|e| DriverError::io(format!("linking {} to {}", link.display(), dir.display()), e))?;
    Ok(link)
}

/// Removes the link of `dir`, if it has one pointing at it (best effort: a leftover link is
/// harmless and re-pointed when its name is needed again).
pub fn release(dir: &Path) {
    let link = link_for(dir);
    if std::fs::read_link(&link).is_ok_and(|t| t == dir) {
        let _ = std::fs::remove_file(&link);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_directories_are_used_as_they_are() {
        let d = Path::new("/var/lib/chrysalis/vms/sbx-1");
        assert_eq!(socket_dir(d).expect("short"), d);
    }

    #[test]
    fn long_directories_get_a_stable_link_that_resolves_to_them() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("x".repeat(60)).join("vc-sandbox-default-cocoon-example-5fe26a89");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let via = socket_dir(&dir).expect("link");
        assert!(via.join("agent-serial.sock").as_os_str().len() <= SUN_PATH_MAX);
        assert_eq!(std::fs::canonicalize(&via).expect("resolve"), std::fs::canonicalize(&dir).expect("dir"));
        assert_eq!(socket_dir(&dir).expect("again"), via, "the same link every time");
        // A socket bound through the link lives in the VM directory.
        let l = std::os::unix::net::UnixListener::bind(via.join("agent-serial.sock")).expect("bind");
        assert!(dir.join("agent-serial.sock").exists());
        drop(l);
        release(&dir);
        assert!(std::fs::symlink_metadata(&via).is_err(), "released");
    }
}

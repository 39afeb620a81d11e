//! Where things live: the project root, and the build cache outside the repository.

use std::path::{Path, PathBuf};

/// The workspace root (the parent of `xtask/`).
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// `$CHRYSALIS_CACHE`, else `$XDG_CACHE_HOME/chrysalis`, else `~/.cache/chrysalis`: the one
/// rule `vmm` uses to find the image catalog, so what xtask builds is what the drivers read.
pub fn cache_dir() -> PathBuf {
    vmm::catalog::cache_dir().unwrap_or_else(|_| PathBuf::from("/root/.cache/chrysalis"))
}
/// The cargo target directory shared by every xtask build (outside the repository).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| project_root().join("target"))
}

/// Takes an exclusive `flock` on `path` (created if missing), waiting for another xtask
/// holding it; the lock lasts as long as the returned file is open.
pub fn lock_file(path: &Path) -> anyhow::Result<std::fs::File> {
    use anyhow::Context;
    use std::os::fd::AsRawFd;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening lock {}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        eprintln!("xtask: waiting for another build holding {}", path.display());
        // SAFETY: as above.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("locking {}", path.display()));
        }
    }
    Ok(file)
}

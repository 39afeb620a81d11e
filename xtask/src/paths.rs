//! Where things live: the project root, and the build cache outside the repository.

use std::path::{Path, PathBuf};

/// The workspace root (the parent of `xtask/`).
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// `$CHRYSALIS_CACHE`, else `$XDG_CACHE_HOME/chrysalis`, else `~/.cache/chrysalis`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CHRYSALIS_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("chrysalis");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("chrysalis")
}

/// The cargo target directory shared by every xtask build (outside the repository).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_root().join("target"))
}

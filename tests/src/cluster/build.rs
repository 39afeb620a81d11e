//! Builds the control-plane binaries from their pinned Go modules, cached by content under
//! `$CHRYSALIS_CACHE/cluster/bin/<component>-<version>-<key>/`.
//!
//! The key hashes the wrapper module's go.mod and go.sum, the component's lock entry, the
//! build flags and `go env GOVERSION`, so an unchanged input never rebuilds. Go's own caches
//! (GOMODCACHE, GOCACHE) stay at their default locations. Builds run under `nice -n 19`;
//! `CHRYSALIS_GO_BUILD_JOBS` caps `go build -p` (default: Go's, the number of CPUs).

use super::lock::{Component, Lock};
use super::ClusterError;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Bumped when the way binaries are built changes, so old cache entries are not reused.
const BUILD_RECIPE: &str = "go build -trimpath -ldflags=-s -w; v1";

/// Where each built binary is, by name (`etcd`, `kube-apiserver`, `kubectl`, ...).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub paths: BTreeMap<String, PathBuf>,
}

impl Binaries {
    /// The path of binary `name`; `up` only asks for names the lock declares.
    pub fn get(&self, name: &str) -> Result<&Path, ClusterError> {
        self.paths.get(name).map(PathBuf::as_path).ok_or_else(|| ClusterError::Build {
            component: name.to_owned(),
            detail: "not declared in tests/cluster/cluster.toml".into(),
        })
    }
}

/// Builds (or finds cached) every binary of the lock under `bin_root`.
pub fn ensure_all(lock: &Lock, bin_root: &Path) -> Result<Binaries, ClusterError> {
    ensure(lock, bin_root, |_| true)
}

/// Builds (or finds cached) the binaries of the components `wanted` picks, so a cluster
/// never builds what it will not run.
pub fn ensure(lock: &Lock, bin_root: &Path, wanted: impl Fn(&Component) -> bool) -> Result<Binaries, ClusterError> {
    let go_version = go_version()?;
    let mut paths = BTreeMap::new();
    for component in lock.components.iter().filter(|c| wanted(c)) {
        let dir = ensure_component(component, bin_root, &go_version)?;
        for b in &component.binaries {
            paths.insert(b.name.clone(), dir.join(&b.name));
        }
    }
    Ok(Binaries { paths })
}

/// The cache directory for `component`: `<name>-<version>-<first 12 hex of the key>`.
pub fn component_dir(component: &Component, bin_root: &Path, go_version: &str) -> Result<PathBuf, ClusterError> {
    let mut h = Sha256::new();
    for file in ["go.mod", "go.sum"] {
        let path = component.module_dir().join(file);
        let bytes = std::fs::read(&path)
            .map_err(|source| ClusterError::Io { what: format!("reading {}", path.display()), source })?;
        h.update(file.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    // Serialising a plain struct of strings cannot fail.
    h.update(serde_json::to_vec(component).unwrap_or_default());
    h.update(BUILD_RECIPE.as_bytes());
    h.update(go_version.as_bytes());
    let key = hex::encode(h.finalize());
    Ok(bin_root.join(format!("{}-{}-{}", component.name, component.version, &key[..12])))
}

fn ensure_component(component: &Component, bin_root: &Path, go_version: &str) -> Result<PathBuf, ClusterError> {
    let dir = component_dir(component, bin_root, go_version)?;
    if component.binaries.iter().all(|b| dir.join(&b.name).is_file()) {
        return Ok(dir);
    }
    let tmp = bin_root.join(format!(".tmp-{}-{}", component.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|source| ClusterError::Io { what: format!("creating {}", tmp.display()), source })?;
    for b in &component.binaries {
        let started = Instant::now();
        eprintln!(
            "cluster: building {} from {}@{} (cached after the first build)",
            b.name, component.upstream, component.version
        );
        let mut ldflags = String::from("-s -w");
        for var in &component.version_ldflags {
            ldflags.push_str(&format!(" -X {var}={}", component.version));
        }
        let mut cmd = Command::new("nice");
        cmd.args(["-n", "19", "go", "build"]);
        if let Ok(jobs) = std::env::var("CHRYSALIS_GO_BUILD_JOBS") {
            cmd.args(["-p", jobs.as_str()]);
        }
        cmd.args(["-trimpath", "-ldflags", ldflags.as_str(), "-o"])
            .arg(tmp.join(&b.name))
            .arg(&b.package)
            .current_dir(component.module_dir())
            .env("GOFLAGS", "-mod=readonly -buildvcs=false");
        let out = cmd
            .output()
            .map_err(|source| ClusterError::Io { what: "running `go build` (is Go installed?)".into(), source })?;
        if !out.status.success() {
            return Err(ClusterError::Build {
                component: b.name.clone(),
                detail: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        eprintln!("cluster: built {} in {:.0?}", b.name, started.elapsed());
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|source| ClusterError::Io {
        what: format!("moving {} to {}", tmp.display(), dir.display()),
        source,
    })?;
    Ok(dir)
}

/// `go env GOVERSION`.
pub fn go_version() -> Result<String, ClusterError> {
    let out = Command::new("go")
        .args(["env", "GOVERSION"])
        .output()
        .map_err(|source| ClusterError::Io { what: "running `go env GOVERSION` (is Go installed?)".into(), source })?;
    if !out.status.success() {
        return Err(ClusterError::Build {
            component: "go".into(),
            detail: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The directory of `component`'s upstream module source in the Go module cache
/// (`go mod download -json <upstream>@<version>`, run in the wrapper module so go.sum verifies it).
pub fn module_source_dir(component: &Component) -> Result<PathBuf, ClusterError> {
    let out = Command::new("go")
        .args(["mod", "download", "-json"])
        .arg(format!("{}@{}", component.upstream, component.version))
        .current_dir(component.module_dir())
        .env("GOFLAGS", "-mod=readonly")
        .output()
        .map_err(|source| ClusterError::Io { what: "running `go mod download`".into(), source })?;
    let parsed: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| ClusterError::Build {
        component: component.name.clone(),
        detail: format!("`go mod download -json` printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stderr)),
    })?;
    match parsed.get("Dir").and_then(|d| d.as_str()) {
        Some(dir) if out.status.success() => Ok(PathBuf::from(dir)),
        _ => Err(ClusterError::Build {
            component: component.name.clone(),
            detail: format!("`go mod download` failed: {parsed}"),
        }),
    }
}

//! The version lock `tests/cluster/cluster.toml`: which Go module builds which binary at
//! which version, and the check that it agrees with each wrapper module's go.mod.

use super::ClusterError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `tests/cluster/cluster.toml`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    #[serde(rename = "component")]
    pub components: Vec<Component>,
}

/// One upstream Go module built from a wrapper module under `tests/cluster/<module>/`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Component {
    pub name: String,
    /// Directory of the wrapper module, relative to `tests/cluster/`.
    pub module: String,
    /// The upstream module path, required at `version` by the wrapper's go.mod.
    pub upstream: String,
    pub version: String,
    /// Go variables set to `version` with `-ldflags -X`.
    #[serde(default)]
    pub version_ldflags: Vec<String>,
    pub binaries: Vec<Binary>,
    /// CRD directory inside the upstream module source, applied by `up`.
    #[serde(default)]
    pub crds: Option<String>,
}

/// One program of a component.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binary {
    pub name: String,
    pub package: String,
}

/// `tests/cluster/` in the source tree.
pub fn cluster_src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster")
}

impl Lock {
    /// Reads and checks `tests/cluster/cluster.toml`.
    pub fn load() -> Result<Lock, ClusterError> {
        let path = cluster_src_dir().join("cluster.toml");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| ClusterError::Io { what: format!("reading {}", path.display()), source })?;
        let lock: Lock = toml::from_str(&text)
            .map_err(|source| ClusterError::Lock { path: path.clone(), detail: source.to_string() })?;
        lock.check_go_mods()?;
        Ok(lock)
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Result<&Component, ClusterError> {
        self.components.iter().find(|c| c.name == name).ok_or_else(|| ClusterError::Lock {
            path: cluster_src_dir().join("cluster.toml"),
            detail: format!("no component named {name}"),
        })
    }

    /// Every component's go.mod requires its upstream at exactly the locked version.
    fn check_go_mods(&self) -> Result<(), ClusterError> {
        for c in &self.components {
            let go_mod = c.module_dir().join("go.mod");
            let text = std::fs::read_to_string(&go_mod)
                .map_err(|source| ClusterError::Io { what: format!("reading {}", go_mod.display()), source })?;
            let found = required_version(&text, &c.upstream);
            if found.as_deref() != Some(c.version.as_str()) {
                return Err(ClusterError::Lock {
                    path: go_mod,
                    detail: format!("requires {} at {:?} but cluster.toml locks {}", c.upstream, found, c.version),
                });
            }
        }
        Ok(())
    }
}

impl Component {
    /// The wrapper module's directory.
    pub fn module_dir(&self) -> PathBuf {
        cluster_src_dir().join(&self.module)
    }
}

/// The version `go.mod` text requires `module` at (a `require` line, single or in a block).
fn required_version(go_mod: &str, module: &str) -> Option<String> {
    let mut in_block = false;
    for line in go_mod.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let rest = if in_block {
            if line == ")" {
                in_block = false;
                continue;
            }
            line
        } else if line == "require (" {
            in_block = true;
            continue;
        } else if let Some(rest) = line.strip_prefix("require ") {
            rest.trim()
        } else {
            continue;
        };
        let mut words = rest.split_whitespace();
        if words.next() == Some(module) {
            return words.next().map(str::to_owned);
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn lock_agrees_with_every_go_mod() {
        let lock = Lock::load().expect("tests/cluster/cluster.toml and the go.mod files agree");
        let names: Vec<_> = lock.components.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["etcd", "kubernetes", "agent-sandbox", "metrics-server"]);
        let k8s = lock.component("kubernetes").unwrap();
        let minor: u32 = k8s.version.trim_start_matches("v1.").split('.').next().unwrap().parse().unwrap();
        assert!(minor >= 33, "Kubernetes must be 1.33 or newer, locked {}", k8s.version);
        assert!(lock.component("agent-sandbox").unwrap().crds.is_some());
    }

    #[test]
    fn staging_replaces_match_the_kubernetes_release() {
        // k8s.io/kubernetes requires its staging modules at v0.0.0; every one must be
        // replaced by the published v0.<minor>.<patch>, or the build mixes releases.
        let lock = Lock::load().unwrap();
        let k8s = lock.component("kubernetes").unwrap();
        let staging = k8s.version.replacen("v1.", "v0.", 1);
        let go_mod = std::fs::read_to_string(k8s.module_dir().join("go.mod")).unwrap();
        let replaces: Vec<_> = go_mod.lines().filter(|l| l.contains(" => k8s.io/")).collect();
        assert!(replaces.len() >= 25, "expected every staging module replaced, found {}", replaces.len());
        for line in replaces {
            assert!(line.trim_end().ends_with(&staging), "{line} is not at {staging}");
        }
    }

    #[test]
    fn required_version_reads_single_lines_and_blocks() {
        let text = "module x\n\nrequire a/b v1.2.3\n\nrequire (\n\tc/d v0.1.0 // indirect\n\te/f v2.0.0\n)\n";
        assert_eq!(required_version(text, "a/b").as_deref(), Some("v1.2.3"));
        assert_eq!(required_version(text, "c/d").as_deref(), Some("v0.1.0"));
        assert_eq!(required_version(text, "e/f").as_deref(), Some("v2.0.0"));
        assert_eq!(required_version(text, "g/h"), None);
    }
}

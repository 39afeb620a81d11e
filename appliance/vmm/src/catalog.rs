//! The built-image catalog `$CHRYSALIS_CACHE/images/catalog.json`, written by `cargo xtask vm-image`.
//!
//! Schema (this type is the schema):
//! `{"templates": {"base": {"kernel": "/abs/vmlinux", "initrd": "/abs/initrd.cpio.gz", "rootfs": null,
//! "overlay_base": null, "cmdline": "…", "digest": "sha256:…"}}, "aliases": {"ubuntu-dev-base": "rt"}}`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Whether `t` can name a template (a catalog name or alias, or an image reference):
/// `^[a-zA-Z0-9][a-zA-Z0-9._:/-]{0,62}$`. sandboxd's pool keys and the supervisor's
/// configuration check use this one rule.
pub fn valid_template(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[1..].iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'/' | b'-'))
}

/// Errors loading the catalog or resolving a template name.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// No template and no alias by that name.
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    /// An alias names a template the catalog does not hold.
    #[error("alias {alias:?} points to missing template {target:?}")]
    DanglingAlias {
        /// The alias.
        alias: String,
        /// Its target.
        target: String,
    },
    /// The catalog file could not be read.
    #[error("reading catalog {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The catalog file is not valid catalog JSON.
    #[error("parsing catalog {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A short name (`name:tag`) is the last segment of aliases that point to different
    /// templates.
    #[error("template name {name:?} is ambiguous: it is short for {targets:?}; use the full reference")]
    Ambiguous {
        /// The short name asked for.
        name: String,
        /// The templates it could mean.
        targets: Vec<String>,
    },
    /// Neither `CHRYSALIS_CACHE`, `XDG_CACHE_HOME` nor `HOME` is set.
    #[error("cannot locate the cache dir: none of CHRYSALIS_CACHE, XDG_CACHE_HOME, HOME is set")]
    NoCacheDir,
}

/// One built template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// Uncompressed PVH `vmlinux`.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Read-only erofs root disk, if any.
    #[serde(default)]
    pub rootfs: Option<PathBuf>,
    /// Empty ext4 image for per-VM overlays, if any.
    #[serde(default)]
    pub overlay_base: Option<PathBuf>,
    /// Extra kernel arguments.
    #[serde(default)]
    pub cmdline: String,
    /// Content digest of the build inputs, `sha256:…`.
    #[serde(default)]
    pub digest: String,
}

/// The catalog: templates by name plus aliases (image references) to template names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Catalog {
    /// Templates by name.
    #[serde(default)]
    pub templates: BTreeMap<String, Template>,
    /// Alias → template name.
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
}

/// `$CHRYSALIS_CACHE`, else `$XDG_CACHE_HOME/chrysalis`, else `~/.cache/chrysalis`.
pub fn cache_dir() -> Result<PathBuf, CatalogError> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("CHRYSALIS_CACHE") {
        return Ok(p);
    }
    if let Some(p) = var("XDG_CACHE_HOME") {
        return Ok(p.join("chrysalis"));
    }
    var("HOME").map(|h| h.join(".cache").join("chrysalis")).ok_or(CatalogError::NoCacheDir)
}

impl Catalog {
    /// `<cache_dir>/images/catalog.json`.
    pub fn default_path() -> Result<PathBuf, CatalogError> {
        Ok(cache_dir()?.join("images").join("catalog.json"))
    }

    /// Loads the catalog from its default path.
    pub fn load_default() -> Result<Self, CatalogError> {
        Self::load(&Self::default_path()?)
    }

    /// Loads a catalog file.
    pub fn load(path: &Path) -> Result<Self, CatalogError> {
        let bytes = std::fs::read(path).map_err(|source| CatalogError::Read { path: path.to_path_buf(), source })?;
        serde_json::from_slice(&bytes).map_err(|source| CatalogError::Parse { path: path.to_path_buf(), source })
    }

    /// Resolves a template name, an alias, or a short name to `(template name, template)`, in
    /// that order of precedence. A short name is the last `/` segment of an alias
    /// (`rt:24.04` for `ghcr.io/cocoonstack/sandbox/rt:24.04`), as the SDK and its adapters
    /// write them; a name that contains `/` is never taken as short. A short name shared by
    /// aliases of different templates is [`CatalogError::Ambiguous`].
    pub fn resolve<'a>(&'a self, name: &str) -> Result<(&'a str, &'a Template), CatalogError> {
        if let Some((k, t)) = self.templates.get_key_value(name) {
            return Ok((k.as_str(), t));
        }
        let (alias, target) = match self.aliases.get_key_value(name) {
            Some(hit) => hit,
            None => self.short_alias(name)?,
        };
        self.templates
            .get_key_value(target)
            .map(|(k, t)| (k.as_str(), t))
            .ok_or_else(|| CatalogError::DanglingAlias { alias: alias.clone(), target: target.clone() })
    }

    /// The one alias whose last segment is `name` (several spellings of one target count once).
    fn short_alias(&self, name: &str) -> Result<(&String, &String), CatalogError> {
        let unknown = || CatalogError::UnknownTemplate(name.to_string());
        if name.is_empty() || name.contains('/') {
            return Err(unknown());
        }
        let hits: Vec<(&String, &String)> =
            self.aliases.iter().filter(|(a, _)| a.rsplit_once('/').is_some_and(|(_, last)| last == name)).collect();
        let mut targets: Vec<String> = hits.iter().map(|(_, t)| (*t).clone()).collect();
        targets.sort();
        targets.dedup();
        match targets.len() {
            0 => Err(unknown()),
            1 => Ok(hits[0]),
            _ => Err(CatalogError::Ambiguous { name: name.to_string(), targets }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"templates": {
        "base": {"kernel": "/c/vmlinux", "initrd": "/c/initrd.cpio.gz", "rootfs": null,
                 "overlay_base": null, "cmdline": "quiet", "digest": "sha256:aa"},
        "rt": {"kernel": "/c/vmlinux", "initrd": "/c/rt.cpio.gz", "rootfs": "/c/rootfs.erofs",
               "overlay_base": "/c/overlay-empty.ext4", "cmdline": "chrysalis.rootfs=/dev/vda", "digest": "sha256:bb"}},
        "aliases": {"ghcr.io/cocoonstack/sandbox/rt:24.04": "rt", "ubuntu-dev-base": "rt", "gone": "nope"}}"#;

    #[test]
    fn parses_and_resolves_aliases() {
        let c: Catalog = serde_json::from_str(SAMPLE).expect("sample parses");
        let (n, t) = c.resolve("base").expect("base");
        assert_eq!(n, "base");
        assert_eq!(t.rootfs, None);
        let (n, t) = c.resolve("ghcr.io/cocoonstack/sandbox/rt:24.04").expect("alias");
        assert_eq!(n, "rt");
        assert_eq!(t.rootfs.as_deref(), Some(Path::new("/c/rootfs.erofs")));
        assert!(matches!(c.resolve("nginx"), Err(CatalogError::UnknownTemplate(s)) if s == "nginx"));
        assert!(matches!(c.resolve("gone"), Err(CatalogError::DanglingAlias { .. })));
    }

    #[test]
    fn short_names_resolve_to_their_alias_target() {
        let mut c: Catalog = serde_json::from_str(SAMPLE).expect("sample parses");
        assert_eq!(c.resolve("rt:24.04").expect("short name").0, "rt");
        // Only the last segment is short; a partial path or another tag is unknown.
        for name in ["sandbox/rt:24.04", "rt:23.10", "rt:24", ""] {
            assert!(matches!(c.resolve(name), Err(CatalogError::UnknownTemplate(_))), "{name}");
        }
        // Two spellings of one target are not ambiguous; two targets are.
        c.aliases.insert("docker.io/library/rt:24.04".into(), "rt".into());
        assert_eq!(c.resolve("rt:24.04").expect("same target").0, "rt");
        c.aliases.insert("quay.io/other/rt:24.04".into(), "base".into());
        match c.resolve("rt:24.04") {
            Err(CatalogError::Ambiguous { name, targets }) => {
                assert_eq!(name, "rt:24.04");
                assert_eq!(targets, ["base", "rt"]);
            }
            other => panic!("expected ambiguous, got {other:?}"),
        }
        // The full reference still resolves.
        assert_eq!(c.resolve("quay.io/other/rt:24.04").expect("full").0, "base");
        // A template name wins over a short name of the same spelling.
        c.aliases.insert("ghcr.io/x/base".into(), "rt".into());
        assert_eq!(c.resolve("base").expect("template").0, "base");
    }

    #[test]
    fn round_trips_and_load_errors_are_typed() {
        let c: Catalog = serde_json::from_str(SAMPLE).expect("sample parses");
        let back: Catalog = serde_json::from_str(&serde_json::to_string(&c).expect("ser")).expect("de");
        assert_eq!(c, back);
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("catalog.json");
        assert!(matches!(Catalog::load(&p), Err(CatalogError::Read { .. })));
        std::fs::write(&p, "{\"templates\": 3}").expect("write");
        assert!(matches!(Catalog::load(&p), Err(CatalogError::Parse { .. })));
        std::fs::write(&p, SAMPLE).expect("write");
        assert_eq!(Catalog::load(&p).expect("load"), c);
    }

    #[test]
    fn boot_spec_from_template() {
        let c: Catalog = serde_json::from_str(SAMPLE).expect("sample parses");
        let s = crate::BootSpec::from_template(&c, "ubuntu-dev-base", crate::SizeClass::Medium).expect("spec");
        assert_eq!(s.name, "rt");
        assert_eq!(s.overlay_base.as_deref(), Some(Path::new("/c/overlay-empty.ext4")));
        assert_eq!(s.cmdline, "chrysalis.rootfs=/dev/vda");
        assert!(matches!(
            crate::BootSpec::from_template(&c, "x", crate::SizeClass::Small),
            Err(CatalogError::UnknownTemplate(_))
        ));
    }
}

//! The committed image catalog (`vm-images/catalog.toml` + `templates/<name>/template.toml`)
//! and the built-image catalog it produces (`$CHRYSALIS_CACHE/images/catalog.json`, read by
//! `vmm::catalog::Catalog`; the field names here must stay identical).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// `vm-images/catalog.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sources {
    /// Template name → description; each has a folder `vm-images/templates/<name>/`.
    pub templates: BTreeMap<String, TemplateEntry>,
    /// Alias → template name.
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateEntry {
    pub description: String,
}

impl Sources {
    pub fn load(path: &Path) -> Result<Sources> {
        let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let sources: Sources = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        for (alias, target) in &sources.aliases {
            if !sources.templates.contains_key(target) {
                bail!("{}: alias {alias:?} points at unknown template {target:?}", path.display());
            }
        }
        Ok(sources)
    }

    /// Resolves a template name or alias.
    pub fn resolve<'a>(&'a self, name: &'a str) -> Result<&'a str> {
        if self.templates.contains_key(name) {
            return Ok(name);
        }
        if let Some(target) = self.aliases.get(name) {
            return Ok(target);
        }
        let known: Vec<&str> = self.templates.keys().chain(self.aliases.keys()).map(String::as_str).collect();
        bail!("unknown template {name:?}; known: {}", known.join(", "))
    }
}

/// `vm-images/templates/<name>/template.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub description: String,
    /// Put busybox-static (with its applet links) into the initramfs.
    #[serde(default)]
    pub busybox: bool,
    /// Extra kernel command line for this template.
    #[serde(default)]
    pub cmdline: String,
    /// Timestamp for every file of the image (reproducible builds).
    pub source_date_epoch: u64,
    /// A read-only Debian root disk (and a writable overlay disk); absent = initramfs only.
    pub rootfs: Option<RootfsSpec>,
}

#[derive(Debug, Deserialize, Serialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RootfsSpec {
    /// Debian suite for mmdebstrap (`bookworm`).
    pub suite: String,
    /// mmdebstrap variant (`minbase`).
    pub variant: String,
    /// Packages on top of the variant.
    pub packages: Vec<String>,
    /// Size of the empty ext4 overlay image, MiB (sparse).
    pub overlay_size_mib: u64,
}

impl Template {
    pub fn load(dir: &Path) -> Result<Template> {
        let path = dir.join("template.toml");
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// One built template in `catalog.json` (same fields as `vmm::catalog::Template`).
#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, Eq)]
pub struct BuiltTemplate {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: Option<PathBuf>,
    pub overlay_base: Option<PathBuf>,
    pub cmdline: String,
    pub digest: String,
}

/// `catalog.json` (same fields as `vmm::catalog::Catalog`).
#[derive(Debug, Serialize, Deserialize, Default)]
pub struct BuiltCatalog {
    #[serde(default)]
    pub templates: BTreeMap<String, BuiltTemplate>,
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
}

/// Records `built` in `catalog.json` (temp file + rename), keeping the other templates and
/// publishing the aliases of every template that is built.
pub fn register(catalog_json: &Path, sources: &Sources, name: &str, built: BuiltTemplate) -> Result<()> {
    let mut catalog: BuiltCatalog = match fs::read(catalog_json) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            eprintln!("vm-image: {} is unreadable ({e}); starting a fresh catalog", catalog_json.display());
            BuiltCatalog::default()
        }),
        Err(_) => BuiltCatalog::default(),
    };
    catalog.templates.insert(name.to_string(), built);
    catalog.templates.retain(|n, _| sources.templates.contains_key(n));
    catalog.aliases = sources
        .aliases
        .iter()
        .filter(|(_, target)| catalog.templates.contains_key(*target))
        .map(|(a, t)| (a.clone(), t.clone()))
        .collect();
    let dir = catalog_json.parent().context("catalog path has no parent")?;
    fs::create_dir_all(dir)?;
    foundation::write_atomic(catalog_json, &serde_json::to_vec_pretty(&catalog)?, foundation::PUBLIC_FILE)
        .with_context(|| format!("replacing {}", catalog_json.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources() -> Sources {
        toml::from_str(
            r#"
            [templates.base]
            description = "b"
            [templates.rt]
            description = "r"
            [aliases]
            "ubuntu-dev-base" = "rt"
            "#,
        )
        .expect("valid toml")
    }

    #[test]
    fn resolves_names_and_aliases() {
        let s = sources();
        assert_eq!(s.resolve("base").ok(), Some("base"));
        assert_eq!(s.resolve("ubuntu-dev-base").ok(), Some("rt"));
        assert!(s.resolve("nope").is_err());
    }

    #[test]
    fn register_writes_the_vmm_schema_and_only_aliases_of_built_templates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let json = dir.path().join("images/catalog.json");
        let built = BuiltTemplate {
            kernel: "/k".into(),
            initrd: "/i".into(),
            rootfs: None,
            overlay_base: None,
            cmdline: String::new(),
            digest: "sha256:00".into(),
        };
        register(&json, &sources(), "base", built.clone()).expect("register base");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&json).expect("read")).expect("json");
        assert_eq!(v["templates"]["base"]["kernel"], "/k");
        assert!(v["templates"]["base"]["rootfs"].is_null());
        assert_eq!(v["aliases"], serde_json::json!({}));
        register(&json, &sources(), "rt", BuiltTemplate { rootfs: Some("/r".into()), ..built }).expect("register rt");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&json).expect("read")).expect("json");
        assert_eq!(v["templates"]["base"]["initrd"], "/i");
        assert_eq!(v["templates"]["rt"]["rootfs"], "/r");
        assert_eq!(v["aliases"]["ubuntu-dev-base"], "rt");
    }

    #[test]
    fn committed_catalog_and_templates_parse() {
        let root = crate::paths::project_root().join("vm-images");
        let s = Sources::load(&root.join("catalog.toml")).expect("vm-images/catalog.toml");
        assert!(s.templates.contains_key("base") && s.templates.contains_key("rt"));
        assert_eq!(s.resolve("ghcr.io/cocoonstack/sandbox/rt:24.04").ok(), Some("rt"));
        for name in s.templates.keys() {
            let t = Template::load(&root.join("templates").join(name)).expect("template.toml");
            // A root disk needs the cmdline keys that make guest-init mount it, and vice versa.
            assert_eq!(t.rootfs.is_some(), t.cmdline.contains("chrysalis.rootfs=/dev/vda"), "{name}");
        }
    }
}

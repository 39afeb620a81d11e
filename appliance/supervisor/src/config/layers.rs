//! The layers: where they are read from ([`SourcePaths`]), how a file or the kernel command
//! line becomes a [`Layer`], how layers merge with [`Provenance`] (who set each key), and how
//! the merged table decodes into the model ([`from_layers`]), a decode error naming its key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, Issue, Source};
use super::model::Config;

/// Layer 1: the image's baked default.
pub const BAKED_PATH: &str = "/usr/share/chrysalis/config.toml";
/// Layer 2: the box config on the ESP.
pub const ESP_PATH: &str = "/efi/chrysalis/config.toml";
/// Layer 3: the config partition (filesystem label `CHRYSALIS`).
pub const CONFIG_DISK_PATH: &str = "/run/chrysalis/config-disk/config.toml";
/// Layer 4: the kernel command line.
pub const CMDLINE_PATH: &str = "/proc/cmdline";
/// The kernel argument that sets one key.
pub const CMDLINE_PREFIX: &str = "chrysalis.set=";

/// Where the four layers are read from (tests and `chrysalis run` flags override them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcePaths {
    /// Layer 1.
    pub baked: PathBuf,
    /// Layer 2.
    pub esp: PathBuf,
    /// Layer 3.
    pub config_disk: PathBuf,
    /// Layer 4 (a file holding a kernel command line); `None` skips it.
    pub cmdline: Option<PathBuf>,
}

impl Default for SourcePaths {
    fn default() -> Self {
        SourcePaths {
            baked: BAKED_PATH.into(),
            esp: ESP_PATH.into(),
            config_disk: CONFIG_DISK_PATH.into(),
            cmdline: Some(CMDLINE_PATH.into()),
        }
    }
}

// ------------------------------------------------------------------------------ provenance

/// Which layer set each key (dotted paths without array indexes; arrays are atomic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance(BTreeMap<String, Source>);

impl Provenance {
    /// The source of `key` (`a.b[0].c` style): the longest recorded prefix, else the default.
    pub fn source_of(&self, key: &str) -> Source {
        let segs: Vec<&str> = key_segments(key);
        for n in (1..=segs.len()).rev() {
            if let Some(s) = self.0.get(&segs[..n].join(".")) {
                return s.clone();
            }
        }
        Source::Default
    }

    /// The source of any key under `prefix` (the last layer that touched the table), else
    /// the default; for errors about a table as a whole ("missing field").
    pub fn source_within(&self, prefix: &str) -> Source {
        let p = key_segments(prefix).join(".");
        let direct = self.source_of(&p);
        if direct != Source::Default {
            return direct;
        }
        let under = format!("{p}.");
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(&under))
            .map(|(_, s)| s)
            .next_back()
            .cloned()
            .unwrap_or(Source::Default)
    }

    fn record(&mut self, path: &str, v: &toml::Value, source: &Source) {
        let under = format!("{path}.");
        self.0.retain(|k, _| !k.starts_with(&under));
        self.0.insert(path.to_string(), source.clone());
        if let toml::Value::Table(t) = v {
            for (k, child) in t {
                self.record(&format!("{path}.{k}"), child, source);
            }
        }
    }
}

/// `a.b[0].c` → `["a", "b", "c"]`.
fn key_segments(key: &str) -> Vec<&str> {
    key.split('.').map(|s| s.split('[').next().unwrap_or(s)).filter(|s| !s.is_empty()).collect()
}

// ---------------------------------------------------------------------------------- layers

/// One parsed layer.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Where it came from (for a command line: one entry per argument, see [`Layer::sources`]).
    pub source: Source,
    /// Its keys; `*_file` paths already resolved.
    pub table: toml::Table,
    /// Per-argument sources of a command-line layer (key path → argument).
    pub sources: Vec<(String, Source)>,
}

/// What was read from where (for `GET /v1/config` and `chrysalis config check`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceReport {
    /// The file.
    pub path: PathBuf,
    /// `loaded`, `missing` or (command line) the number of `chrysalis.set=` arguments.
    pub status: String,
}

/// Reads one layer file; `Ok(None)` when it does not exist.
pub fn read_layer(path: &Path) -> Result<Option<Layer>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ConfigError::Read { path: path.to_path_buf(), source }),
    };
    parse_layer(path, &text).map(Some)
}

/// Parses layer text read from `path` (relative `*_file` values resolve against its directory).
pub fn parse_layer(path: &Path, text: &str) -> Result<Layer, ConfigError> {
    let mut table: toml::Table = toml::from_str(text)
        .map_err(|e| ConfigError::Syntax { path: path.to_path_buf(), message: e.to_string().trim().to_string() })?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    resolve_files(&mut table, &base);
    Ok(Layer { source: Source::File { path: path.to_path_buf() }, table, sources: Vec::new() })
}

/// Makes relative `*_file` string values absolute against `base`.
fn resolve_files(table: &mut toml::Table, base: &Path) {
    for (k, v) in table.iter_mut() {
        match v {
            toml::Value::Table(t) => resolve_files(t, base),
            toml::Value::String(s) if k.ends_with("_file") && !s.is_empty() && Path::new(s.as_str()).is_relative() => {
                *s = base.join(s.as_str()).to_string_lossy().into_owned();
            }
            _ => {}
        }
    }
}

/// Splits a kernel command line into arguments (whitespace outside double quotes).
pub fn cmdline_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Parses the `chrysalis.set=` arguments of a kernel command line read from `path`.
pub fn parse_cmdline(path: &Path, line: &str) -> Result<Layer, ConfigError> {
    let mut table = toml::Table::new();
    let mut sources = Vec::new();
    for raw in cmdline_args(line) {
        let arg = match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
            Some(inner) if inner.starts_with(CMDLINE_PREFIX) => inner.to_string(),
            _ => raw,
        };
        let Some(rest) = arg.strip_prefix(CMDLINE_PREFIX) else { continue };
        let bad = |problem: &str| ConfigError::Cmdline { arg: arg.clone(), problem: problem.to_string() };
        let (key, value) = rest.split_once('=').ok_or_else(|| bad("no '=' between the key and the value"))?;
        let segs: Vec<&str> = key.split('.').collect();
        if !segs.iter().all(|s| valid_segment(s)) {
            return Err(bad(&format!("{key:?} is not a dotted key of letters, digits, '_' and '-'")));
        }
        let value = parse_value(value);
        if let toml::Value::String(s) = &value {
            if segs.last().is_some_and(|l| l.ends_with("_file")) && Path::new(s).is_relative() {
                return Err(bad("a *_file path on the kernel command line must be absolute"));
            }
        }
        let mut t = &mut table;
        for seg in &segs[..segs.len() - 1] {
            let entry = t.entry(seg.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            t = match entry {
                toml::Value::Table(inner) => inner,
                _ => return Err(bad(&format!("{seg:?} was already set to a value, not a table"))),
            };
        }
        // Split above always yields at least one segment, all validated non-empty.
        let last = segs.last().copied().unwrap_or_default();
        t.insert(last.to_string(), value);
        sources.push((key.to_string(), Source::Cmdline { path: path.to_path_buf(), arg: arg.clone() }));
    }
    Ok(Layer { source: Source::Cmdline { path: path.to_path_buf(), arg: String::new() }, table, sources })
}

/// A TOML value, or the text as a string when it is not one.
fn parse_value(text: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(text.to_string())),
        Err(_) => toml::Value::String(text.to_string()),
    }
}

/// Merges `layer` into `base` (tables per key, everything else replaced), recording sources.
pub fn merge(base: &mut toml::Table, prov: &mut Provenance, layer: &Layer) {
    merge_table(base, prov, "", &layer.table, &layer.source, &layer.sources);
}

fn merge_table(
    base: &mut toml::Table,
    prov: &mut Provenance,
    prefix: &str,
    over: &toml::Table,
    source: &Source,
    per_key: &[(String, Source)],
) {
    for (k, v) in over {
        let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => {
                merge_table(b, prov, &path, o, source, per_key);
            }
            _ => {
                prov.record(&path, v, source);
                // A command-line value is attributed to the argument that set it.
                let under = format!("{path}.");
                for (key, s) in per_key.iter().filter(|(key, _)| *key == path || key.starts_with(&under)) {
                    prov.0.insert(key.clone(), s.clone());
                }
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

// ------------------------------------------------------------------------------- loading

/// A loaded, merged configuration (not yet validated).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The typed model.
    pub config: Config,
    /// Who set what.
    pub provenance: Provenance,
    /// What was read.
    pub sources: Vec<SourceReport>,
}

/// Reads the four layers and merges them (see the module doc).
pub fn load(paths: &SourcePaths) -> Result<Loaded, ConfigError> {
    let mut layers = Vec::new();
    let mut sources = Vec::new();
    for p in [&paths.baked, &paths.esp, &paths.config_disk] {
        match read_layer(p)? {
            Some(l) => {
                layers.push(l);
                sources.push(SourceReport { path: p.clone(), status: "loaded".into() });
            }
            None => sources.push(SourceReport { path: p.clone(), status: "missing".into() }),
        }
    }
    if let Some(p) = &paths.cmdline {
        match std::fs::read_to_string(p) {
            Ok(line) => {
                let l = parse_cmdline(p, &line)?;
                sources.push(SourceReport { path: p.clone(), status: format!("{} chrysalis.set", l.sources.len()) });
                layers.push(l);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                sources.push(SourceReport { path: p.clone(), status: "missing".into() })
            }
            Err(source) => return Err(ConfigError::Read { path: p.clone(), source }),
        }
    }
    let mut loaded = from_layers(&layers)?;
    loaded.sources = sources;
    Ok(loaded)
}

/// Reads exactly these files as layers, in order (later wins); each must exist.
pub fn load_files(files: &[PathBuf]) -> Result<Loaded, ConfigError> {
    let mut layers = Vec::new();
    for p in files {
        let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        layers.push(parse_layer(p, &text)?);
    }
    let mut loaded = from_layers(&layers)?;
    loaded.sources = files.iter().map(|p| SourceReport { path: p.clone(), status: "loaded".into() }).collect();
    Ok(loaded)
}

/// Merges parsed layers and decodes the typed model; decode errors name the key and source.
pub fn from_layers(layers: &[Layer]) -> Result<Loaded, ConfigError> {
    let mut merged = toml::Table::new();
    let mut prov = Provenance::default();
    for l in layers {
        merge(&mut merged, &mut prov, l);
    }
    let config: Config = serde_path_to_error::deserialize(toml::Value::Table(merged)).map_err(|e| {
        let (key, plain) = path_key(e.path());
        let inner = e.into_inner();
        ConfigError::Invalid(vec![decode_issue(&key, &plain, &inner.to_string(), &prov)])
    })?;
    Ok(Loaded { config, provenance: prov, sources: Vec::new() })
}

/// `(display key with indexes, key without the unknown tail)` of a decode error path.
fn path_key(path: &serde_path_to_error::Path) -> (String, String) {
    let mut key = String::new();
    for seg in path.iter() {
        match seg {
            serde_path_to_error::Segment::Seq { index } => key.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key: k } => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(k);
            }
            serde_path_to_error::Segment::Enum { variant } => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(variant);
            }
            serde_path_to_error::Segment::Unknown => {}
        }
    }
    (key.clone(), key)
}

fn decode_issue(key: &str, plain: &str, msg: &str, prov: &Provenance) -> Issue {
    // serde's own words, minus TOML's span decoration.
    let msg = msg.lines().next().unwrap_or(msg).trim().to_string();
    if let Some(field) = between(&msg, "unknown field `", "`") {
        let full = if key.ends_with(field) {
            key.to_string()
        } else if key.is_empty() {
            field.to_string()
        } else {
            format!("{key}.{field}")
        };
        let expected = msg.split_once(", expected ").map(|(_, e)| format!(" (known keys: {e})")).unwrap_or_default();
        return Issue {
            key: full.clone(),
            source: prov.source_of(&full),
            problem: "unknown key".into(),
            fix: format!("remove it or correct its spelling{expected}"),
        };
    }
    if let Some(field) = between(&msg, "missing field `", "`") {
        let full = if key.is_empty() { field.to_string() } else { format!("{key}.{field}") };
        return Issue {
            key: full,
            source: prov.source_within(plain),
            problem: "is required but not set".into(),
            fix: format!("add `{field} = …` to the [{key}] table (see the configuration reference)"),
        };
    }
    Issue {
        key: if key.is_empty() { "(top level)".into() } else { key.to_string() },
        source: prov.source_of(plain),
        problem: msg,
        fix: "give a value of the documented type (see the configuration reference)".into(),
    }
}

fn between<'a>(s: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let rest = &s[s.find(start)? + start.len()..];
    Some(&rest[..rest.find(end)?])
}

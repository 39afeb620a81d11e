//! The kernel command line: rendering a slot's line, and reading which slot booted.
//!
//! A slot's line (the `options` of its boot entry) binds the dm-verity root hash to the entry:
//! ```text
//! dm-mod.create="chrysalis-root,,,ro,0 <data_sectors> verity 1 PARTUUID=<u> PARTUUID=<u> 4096 4096 <data_blocks> <hash_start> sha256 <root_hash> <salt>"
//! dm-mod.waitfor=PARTUUID=<u> root=/dev/dm-0 rootfstype=erofs ro
//! chrysalis.slot=<s> chrysalis.version=<v> chrysalis.generation=<g> chrysalis.security_version=<n>
//! panic=10 <board args>
//! ```
//! (one line). The image build renders slot A's line with the same function, so a fresh
//! image and an updated slot boot with identical command lines. `chrysalis.security_version=`
//! copies the manifest's, so the ESP says which level each slot holds (status, and the rollback
//! rule: no rollback below the floor); the running system takes its own from its verified root
//! (`image.json`), not from here.
//!
//! Parsing follows the kernel's rules: parameters are separated by spaces, and double quotes
//! protect spaces inside a value (`dm-mod.create="…"`).

use std::path::PathBuf;

use crate::manifest::{Manifest, VERITY_BLOCK};
use crate::slots::Slot;

/// Errors reading the booted slot from the command line.
#[derive(Debug, thiserror::Error)]
pub enum CmdlineError {
    /// The command line could not be read.
    #[error("reading the kernel command line from {}", path.display())]
    Read {
        /// The file (`/proc/cmdline`).
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No `chrysalis.slot=`: this system was not booted from a Chrysalis slot entry.
    #[error("the kernel command line has no chrysalis.slot= (not booted from a Chrysalis boot entry)")]
    NoSlot,
    /// A `chrysalis.slot=` other than `a` or `b`.
    #[error("chrysalis.slot={0} is not a slot (expected a or b)")]
    BadSlot(String),
    /// A `chrysalis.generation=` that is not a number.
    #[error("chrysalis.generation={0} is not a number")]
    BadGeneration(String),
}

/// Where the running kernel's command line comes from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CmdlineSource {
    /// A file holding it (`/proc/cmdline`).
    File(PathBuf),
    /// A fixed string (tests).
    Literal(String),
}

impl Default for CmdlineSource {
    fn default() -> Self {
        CmdlineSource::File(PathBuf::from("/proc/cmdline"))
    }
}

impl CmdlineSource {
    /// The command line text.
    pub fn read(&self) -> Result<String, CmdlineError> {
        match self {
            CmdlineSource::File(path) => {
                std::fs::read_to_string(path).map_err(|source| CmdlineError::Read { path: path.clone(), source })
            }
            CmdlineSource::Literal(text) => Ok(text.clone()),
        }
    }
}

/// What the command line says about the running system.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BootInfo {
    /// The slot that booted.
    pub slot: Slot,
    /// `chrysalis.version=`, when present.
    pub version: Option<String>,
    /// `chrysalis.generation=`, when present.
    pub generation: Option<u64>,
}

impl BootInfo {
    /// Reads `chrysalis.slot=`, `chrysalis.version=` and `chrysalis.generation=`; the last
    /// occurrence of each wins, as for the kernel's own parameters.
    pub fn parse(cmdline: &str) -> Result<BootInfo, CmdlineError> {
        let slot = match param(cmdline, "chrysalis.slot") {
            None => return Err(CmdlineError::NoSlot),
            Some(v) => v.parse::<Slot>().map_err(|_| CmdlineError::BadSlot(v))?,
        };
        let generation = match param(cmdline, "chrysalis.generation") {
            None => None,
            Some(v) => Some(v.parse::<u64>().map_err(|_| CmdlineError::BadGeneration(v))?),
        };
        Ok(BootInfo { slot, version: param(cmdline, "chrysalis.version"), generation })
    }
}

/// The full command line of `slot`'s boot entry: the verity root, the slot markers, `panic=10`
/// and the manifest's board arguments.
///
/// `partuuid` is the slot partition's PARTUUID (lower case), `generation` the entry's
/// generation (the fresh image's slot A entry is generation 1).
pub fn slot_cmdline(slot: Slot, partuuid: &str, generation: u64, manifest: &Manifest) -> String {
    let verity = &manifest.root.verity;
    let data_sectors = verity.data_blocks.saturating_mul(VERITY_BLOCK / 512);
    let hash_start = verity.hash_offset / VERITY_BLOCK;
    let salt = if verity.salt.is_empty() { "-" } else { verity.salt.as_str() };
    let mut line = format!(
        "dm-mod.create=\"chrysalis-root,,,ro,0 {data_sectors} verity 1 PARTUUID={u} PARTUUID={u} \
         {bs} {bs} {blocks} {hash_start} sha256 {root_hash} {salt}\" \
         dm-mod.waitfor=PARTUUID={u} root=/dev/dm-0 rootfstype=erofs ro \
         chrysalis.slot={slot} chrysalis.version={version} chrysalis.generation={generation} \
         chrysalis.security_version={security_version} panic=10",
        u = partuuid,
        bs = VERITY_BLOCK,
        blocks = verity.data_blocks,
        root_hash = verity.root_hash,
        version = manifest.version,
        security_version = manifest.security_version,
    );
    let board = manifest.cmdline.trim();
    if !board.is_empty() {
        line.push(' ');
        line.push_str(board);
    }
    line
}

/// Splits a command line into raw parameters (quotes kept), as the kernel does.
pub fn tokens(cmdline: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = None;
    let mut quoted = false;
    for (i, c) in cmdline.char_indices() {
        if c == '"' {
            quoted = !quoted;
        }
        if c.is_whitespace() && !quoted {
            if let Some(s) = start.take() {
                out.push(&cmdline[s..i]);
            }
        } else if start.is_none() {
            start = Some(i);
        }
    }
    if let Some(s) = start {
        out.push(&cmdline[s..]);
    }
    out
}

/// The key and (unquoted) value of one raw parameter.
pub fn split_param(token: &str) -> (&str, Option<String>) {
    let token = token.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(token);
    match token.split_once('=') {
        Some((key, value)) => (key, Some(value.replace('"', ""))),
        None => (token, None),
    }
}

/// The value of the last `key=` parameter.
pub fn param(cmdline: &str, key: &str) -> Option<String> {
    tokens(cmdline).into_iter().rev().find_map(|t| match split_param(t) {
        (k, Some(v)) if k == key => Some(v),
        _ => None,
    })
}

/// `cmdline` with every `key=…` parameter replaced by `key=value` (appended when absent).
pub fn set_param(cmdline: &str, key: &str, value: &str) -> String {
    let mut found = false;
    let mut out: Vec<String> = Vec::new();
    for token in tokens(cmdline) {
        if split_param(token).0 == key {
            if !found {
                out.push(format!("{key}={value}"));
                found = true;
            }
        } else {
            out.push(token.to_string());
        }
    }
    if !found {
        out.push(format!("{key}={value}"));
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::tests::sample;

    #[test]
    fn renders_the_designed_line() {
        let m = sample();
        let u = "0b4ac8a5-7d5a-4b8c-9c1e-3f2a1b0c9d8e";
        let line = slot_cmdline(Slot::B, u, 7, &m);
        let want = format!(
            "dm-mod.create=\"chrysalis-root,,,ro,0 16 verity 1 PARTUUID={u} PARTUUID={u} 4096 4096 2 2 sha256 {} {}\" \
             dm-mod.waitfor=PARTUUID={u} root=/dev/dm-0 rootfstype=erofs ro \
             chrysalis.slot=b chrysalis.version=0.2.0 chrysalis.generation=7 chrysalis.security_version=3 \
             panic=10 console=ttyS0,115200",
            "33".repeat(32),
            "44".repeat(32),
        );
        assert_eq!(line, want);
        let mut no_salt = m.clone();
        no_salt.root.verity.salt.clear();
        no_salt.cmdline.clear();
        let line = slot_cmdline(Slot::A, u, 1, &no_salt);
        assert!(line.contains(" sha256 3333"), "{line}");
        assert!(line.contains("33 -\" dm-mod.waitfor"), "{line}");
        assert!(line.ends_with("panic=10"), "{line}");
    }

    #[test]
    fn parses_a_rendered_line() {
        let line = slot_cmdline(Slot::B, "u-1", 42, &sample());
        let toks = tokens(&line);
        assert!(toks[0].starts_with("dm-mod.create=\"chrysalis-root,,,ro,0 16 verity"), "{toks:?}");
        assert_eq!(toks[1], "dm-mod.waitfor=PARTUUID=u-1");
        let info = BootInfo::parse(&line).expect("boot info");
        assert_eq!(info, BootInfo { slot: Slot::B, version: Some("0.2.0".into()), generation: Some(42) });
        assert!(param(&line, "dm-mod.create").expect("dm").starts_with("chrysalis-root,,,ro,0 16 verity 1"));
        let moved = set_param(&line, "chrysalis.generation", "43");
        assert_eq!(BootInfo::parse(&moved).expect("info").generation, Some(43));
        assert_eq!(tokens(&moved).len(), toks.len());
        assert!(moved.starts_with("dm-mod.create=\"chrysalis-root"));
    }

    #[test]
    fn boot_info_errors() {
        assert!(matches!(BootInfo::parse("quiet root=/dev/sda"), Err(CmdlineError::NoSlot)));
        assert!(matches!(BootInfo::parse("chrysalis.slot=c"), Err(CmdlineError::BadSlot(s)) if s == "c"));
        assert!(matches!(
            BootInfo::parse("chrysalis.slot=a chrysalis.generation=x"),
            Err(CmdlineError::BadGeneration(_))
        ));
        let info = BootInfo::parse("chrysalis.slot=b chrysalis.slot=a\n").expect("last wins");
        assert_eq!(info.slot, Slot::A);
        assert_eq!(info.generation, None);
        assert_eq!(set_param("a=1", "b", "2"), "a=1 b=2");
    }
}

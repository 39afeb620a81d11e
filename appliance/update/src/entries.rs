//! systemd-boot entries on the ESP (Boot Loader Specification type #1), with boot counting in
//! the file name.
//!
//! Each slot has at most one entry in `/loader/entries/`:
//!
//! | file | meaning |
//! |---|---|
//! | `chrysalis-a.conf` | committed (no counter): a good entry |
//! | `chrysalis-b+1.conf` | armed trial: one try left |
//! | `chrysalis-b+0-1.conf` | trial in progress or failed: systemd-boot renamed `+1` before booting it; 0 tries left sorts it last |
//!
//! The body names the slot's kernel and command line and carries the entry's **generation**
//! as `version`; with the shared `sort-key chrysalis`, systemd-boot boots the good entry with
//! the highest generation ([`boot_order`] reimplements its ordering so tests can check what a
//! given ESP would boot).
//!
//! Every change is atomic on vfat: write `<name>.tmp` (ignored by systemd-boot, which only
//! loads `*.conf`), fsync, rename, fsync the directory.

use std::cmp::Ordering;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::slots::Slot;

/// The `sort-key` of every Chrysalis entry.
pub const SORT_KEY: &str = "chrysalis";

/// Errors reading or changing boot entries.
#[derive(Debug, thiserror::Error)]
pub enum EntriesError {
    /// A file or directory operation on the ESP failed.
    #[error("{what} {}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A rename on the ESP failed.
    #[error("renaming {} to {}", from.display(), to.display())]
    Rename {
        /// The old path.
        from: PathBuf,
        /// The new path.
        to: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// systemd-boot's boot counter: `+LEFT-DONE` in the file name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// Tries left; 0 makes the entry "bad" (sorted last).
    pub left: u64,
    /// Tries done.
    pub done: u64,
}

/// Splits a loader entry file name into its id stem and counter, as systemd-boot does:
/// `None` when the name is not `*.conf` (case-insensitive); a malformed counter is no counter.
pub fn split_counter(file_name: &str) -> Option<(&str, Option<Counter>)> {
    let split = file_name.len().checked_sub(5)?;
    if !file_name.is_char_boundary(split) || !file_name[split..].eq_ignore_ascii_case(".conf") {
        return None;
    }
    let stem = &file_name[..split];
    let Some((base, counter)) = stem.rsplit_once('+') else { return Some((stem, None)) };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let parsed = match counter.split_once('-') {
        None if digits(counter) => counter.parse().ok().map(|left| Counter { left, done: 0 }),
        Some((l, d)) if digits(l) && digits(d) => match (l.parse(), d.parse()) {
            (Ok(left), Ok(done)) => Some(Counter { left, done }),
            _ => None,
        },
        _ => None,
    };
    match parsed {
        Some(c) => Some((base, Some(c))),
        None => Some((stem, None)),
    }
}

/// The file name of a Chrysalis entry: its slot and counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryName {
    /// The slot it boots.
    pub slot: Slot,
    /// Its boot counter; `None` = committed.
    pub counter: Option<Counter>,
}

impl EntryName {
    /// `chrysalis-<slot>.conf`.
    pub fn plain(slot: Slot) -> EntryName {
        EntryName { slot, counter: None }
    }

    /// `chrysalis-<slot>+1.conf`: a one-shot trial.
    pub fn armed(slot: Slot) -> EntryName {
        EntryName { slot, counter: Some(Counter { left: 1, done: 0 }) }
    }

    /// Parses `chrysalis-<a|b>[+LEFT[-DONE]].conf`.
    pub fn parse(file_name: &str) -> Option<EntryName> {
        let (stem, counter) = split_counter(file_name)?;
        let slot = match stem.strip_prefix("chrysalis-")? {
            "a" => Slot::A,
            "b" => Slot::B,
            _ => return None,
        };
        Some(EntryName { slot, counter })
    }

    /// The file name.
    pub fn file_name(&self) -> String {
        match self.counter {
            None => format!("chrysalis-{}.conf", self.slot),
            Some(Counter { left, done: 0 }) => format!("chrysalis-{}+{left}.conf", self.slot),
            Some(Counter { left, done }) => format!("chrysalis-{}+{left}-{done}.conf", self.slot),
        }
    }

    /// No counter: the entry is committed.
    pub fn is_committed(&self) -> bool {
        self.counter.is_none()
    }

    /// A counter with tries left: armed, not yet booted.
    pub fn is_armed(&self) -> bool {
        self.counter.is_some_and(|c| c.left > 0)
    }

    /// A counter with no tries left: being tried now, or failed.
    pub fn is_bad(&self) -> bool {
        self.counter.is_some_and(|c| c.left == 0)
    }
}

/// The body of a loader entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootEntry {
    /// `title`.
    pub title: Option<String>,
    /// `sort-key`.
    pub sort_key: Option<String>,
    /// `version` (for Chrysalis entries: the generation).
    pub version: Option<String>,
    /// `machine-id`.
    pub machine_id: Option<String>,
    /// `linux` (path on the ESP).
    pub linux: Option<String>,
    /// `efi` (path on the ESP).
    pub efi: Option<String>,
    /// `options` (several lines are joined with a space, as systemd-boot does).
    pub options: String,
    /// Other keys, in order.
    pub other: Vec<(String, String)>,
}

impl BootEntry {
    /// The entry of `slot`: its kernel, `options` = the slot's command line, and the
    /// generation as `version`.
    pub fn for_slot(slot: Slot, version: &str, generation: u64, options: &str) -> BootEntry {
        BootEntry {
            title: Some(format!("Chrysalis {version} (slot {slot})")),
            sort_key: Some(SORT_KEY.to_string()),
            version: Some(generation.to_string()),
            linux: Some(kernel_loader_path(slot)),
            options: options.to_string(),
            ..BootEntry::default()
        }
    }

    /// Parses an entry body like systemd-boot: `key value` lines, `#` comments, surrounding
    /// double quotes of a value removed.
    pub fn parse(text: &str) -> BootEntry {
        let mut entry = BootEntry::default();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = match line.split_once([' ', '\t']) {
                Some((k, v)) => (k, v.trim()),
                None => (line, ""),
            };
            let value = if value.len() >= 2 && value.starts_with('"') && value.ends_with('"') {
                &value[1..value.len() - 1]
            } else {
                value
            };
            let value = value.to_string();
            match key {
                "title" => entry.title = Some(value),
                "sort-key" => entry.sort_key = Some(value),
                "version" => entry.version = Some(value),
                "machine-id" => entry.machine_id = Some(value),
                "linux" => entry.linux = Some(value),
                "efi" => entry.efi = Some(value),
                "options" => {
                    if !entry.options.is_empty() {
                        entry.options.push(' ');
                    }
                    entry.options.push_str(&value);
                }
                _ => entry.other.push((key.to_string(), value)),
            }
        }
        entry
    }

    /// The entry body text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                out.push_str(k);
                out.push(' ');
                out.push_str(v);
                out.push('\n');
            }
        };
        line("title", &self.title);
        line("sort-key", &self.sort_key);
        line("version", &self.version);
        line("machine-id", &self.machine_id);
        line("linux", &self.linux);
        line("efi", &self.efi);
        for (k, v) in &self.other {
            out.push_str(&format!("{k} {v}\n"));
        }
        if !self.options.is_empty() {
            out.push_str("options ");
            out.push_str(&self.options);
            out.push('\n');
        }
        out
    }

    /// The generation (`version` as a number).
    pub fn generation(&self) -> Option<u64> {
        self.version.as_deref().and_then(|v| v.trim().parse().ok())
    }

    /// `chrysalis.version=` from the options.
    pub fn chrysalis_version(&self) -> Option<String> {
        crate::cmdline::param(&self.options, "chrysalis.version")
    }

    /// `chrysalis.security_version=` of the options (`None` when absent or not a number).
    pub fn security_version(&self) -> Option<u64> {
        crate::cmdline::param(&self.options, "chrysalis.security_version").and_then(|v| v.parse().ok())
    }
}

/// `/chrysalis/<slot>/vmlinuz`: the kernel path as the boot entry names it.
pub fn kernel_loader_path(slot: Slot) -> String {
    format!("/chrysalis/{slot}/vmlinuz")
}

/// One loader entry file as systemd-boot sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryFile {
    /// The file name.
    pub file_name: String,
    /// Its counter.
    pub counter: Option<Counter>,
    /// Its body.
    pub entry: BootEntry,
}

/// A Chrysalis entry (`chrysalis-<slot>…conf`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotEntry {
    /// The file name.
    pub file_name: String,
    /// Slot and counter.
    pub name: EntryName,
    /// Its body.
    pub entry: BootEntry,
}

impl SlotEntry {
    /// The generation (0 when the body has none).
    pub fn generation(&self) -> u64 {
        self.entry.generation().unwrap_or(0)
    }
}

/// The ESP as far as boot entries and slot kernels go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Esp {
    root: PathBuf,
}

impl Esp {
    /// The ESP mounted at `root` (`/efi`).
    pub fn new(root: impl Into<PathBuf>) -> Esp {
        Esp { root: root.into() }
    }

    /// Its mount point.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<esp>/loader/entries`.
    pub fn entries_dir(&self) -> PathBuf {
        self.root.join("loader").join("entries")
    }

    /// `<esp>/chrysalis/<slot>/vmlinuz`.
    pub fn kernel_path(&self, slot: Slot) -> PathBuf {
        self.root.join("chrysalis").join(slot.as_str()).join("vmlinuz")
    }

    /// Every entry systemd-boot would consider: `*.conf` files not starting with `.` or
    /// `auto-`. A missing entries directory is an empty list.
    pub fn list(&self) -> Result<Vec<EntryFile>, EntriesError> {
        let dir = self.entries_dir();
        let listing = match fs::read_dir(&dir) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(EntriesError::Io { path: dir, what: "listing", source }),
        };
        let mut out = Vec::new();
        for item in listing {
            let item = item.map_err(|source| EntriesError::Io { path: dir.clone(), what: "listing", source })?;
            let Some(file_name) = item.file_name().to_str().map(str::to_string) else { continue };
            if file_name.starts_with('.') || file_name.starts_with("auto-") {
                continue;
            }
            let Some((_, counter)) = split_counter(&file_name) else { continue };
            let path = item.path();
            if path.is_dir() {
                continue;
            }
            let bytes = fs::read(&path).map_err(|source| EntriesError::Io { path, what: "reading", source })?;
            out.push(EntryFile { file_name, counter, entry: BootEntry::parse(&String::from_utf8_lossy(&bytes)) });
        }
        out.sort_by(|a, b| a.file_name.cmp(&b.file_name));
        Ok(out)
    }

    /// The Chrysalis entries only.
    pub fn slot_entries(&self) -> Result<Vec<SlotEntry>, EntriesError> {
        Ok(self
            .list()?
            .into_iter()
            .filter_map(|f| {
                let name = EntryName::parse(&f.file_name)?;
                Some(SlotEntry { file_name: f.file_name, name, entry: f.entry })
            })
            .collect())
    }

    /// The file names systemd-boot would offer, default first (see [`boot_order`]); entries
    /// whose `linux`/`efi` file is missing are left out, as systemd-boot does.
    pub fn boot_order(&self) -> Result<Vec<String>, EntriesError> {
        let files = self.list()?;
        let present: Vec<EntryFile> = files
            .into_iter()
            .filter(|f| {
                let loader = f.entry.linux.as_deref().or(f.entry.efi.as_deref());
                loader.is_some_and(|l| self.root.join(l.trim_start_matches(['/', '\\']).replace('\\', "/")).is_file())
            })
            .collect();
        Ok(boot_order(&present))
    }

    /// Writes `entry` as `name` atomically (creating the entries directory if needed).
    pub fn write(&self, name: &EntryName, entry: &BootEntry) -> Result<(), EntriesError> {
        let dir = self.entries_dir();
        fs::create_dir_all(&dir).map_err(|source| EntriesError::Io { path: dir.clone(), what: "creating", source })?;
        let path = dir.join(name.file_name());
        crate::atomic::write_file(&path, entry.render().as_bytes()).map_err(|source| EntriesError::Io {
            path,
            what: "writing",
            source,
        })
    }

    /// Renames the entry file `from` to `to` (atomic; fsyncs the directory).
    pub fn rename(&self, from: &str, to: &EntryName) -> Result<(), EntriesError> {
        let dir = self.entries_dir();
        let (from, to) = (dir.join(from), dir.join(to.file_name()));
        if from == to {
            return Ok(());
        }
        crate::atomic::rename(&from, &to).map_err(|source| EntriesError::Rename { from, to, source })
    }

    /// Removes the entry file `file_name` (no fsync; see [`Esp::sync`]).
    pub fn remove(&self, file_name: &str) -> Result<bool, EntriesError> {
        let path = self.entries_dir().join(file_name);
        crate::atomic::remove(&path).map_err(|source| EntriesError::Io { path, what: "removing", source })
    }

    /// Removes every entry of `slot` (and leftover temporary files of it), then fsyncs the
    /// directory. Returns the removed file names.
    pub fn remove_slot(&self, slot: Slot) -> Result<Vec<String>, EntriesError> {
        let dir = self.entries_dir();
        let listing = match fs::read_dir(&dir) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(EntriesError::Io { path: dir, what: "listing", source }),
        };
        let mut removed = Vec::new();
        for item in listing {
            let item = item.map_err(|source| EntriesError::Io { path: dir.clone(), what: "listing", source })?;
            let Some(file_name) = item.file_name().to_str().map(str::to_string) else { continue };
            // Temporary files: `<name>.tmp` (streamed) and `.<name>.<random>.tmp` (whole files).
            let base = match file_name.strip_suffix(".tmp") {
                Some(t) => t.strip_prefix('.').and_then(|t| t.rsplit_once('.')).map_or(t, |(name, _)| name),
                None => &file_name,
            };
            if EntryName::parse(base).is_some_and(|n| n.slot == slot) && self.remove(&file_name)? {
                removed.push(file_name);
            }
        }
        self.sync()?;
        Ok(removed)
    }

    /// fsyncs the entries directory.
    pub fn sync(&self) -> Result<(), EntriesError> {
        let dir = self.entries_dir();
        match crate::atomic::sync_dir(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other.map_err(|source| EntriesError::Io { path: dir, what: "syncing", source }),
        }
    }
}

/// The entry of the running `slot`: the one with the booted generation (a committed one
/// first), else its newest.
pub fn mine(entries: &[SlotEntry], slot: Slot, booted_generation: Option<u64>) -> Option<&SlotEntry> {
    let own = || entries.iter().filter(move |e| e.name.slot == slot);
    let rank = |e: &&SlotEntry| (e.generation(), e.name.is_committed());
    if let Some(g) = booted_generation {
        if let Some(e) = own().filter(|e| e.generation() == g).max_by_key(rank) {
            return Some(e);
        }
    }
    own().max_by_key(rank)
}

/// The newest entry of `slot`, if any.
pub fn newest(entries: &[SlotEntry], slot: Slot) -> Option<&SlotEntry> {
    entries.iter().filter(|e| e.name.slot == slot).max_by_key(|e| (e.generation(), e.name.is_committed()))
}

/// The generation a new entry gets: one more than every entry and the booted generation.
pub fn next_generation(entries: &[SlotEntry], booted_generation: Option<u64>) -> u64 {
    entries.iter().map(SlotEntry::generation).chain(booted_generation).max().unwrap_or(0) + 1
}

/// The order systemd-boot (v252, Debian bookworm) puts `entries` in; the first one boots
/// when `loader.conf` names no `default` and no `LoaderEntryDefault`/`LoaderEntryOneShot`
/// EFI variable is set.
///
/// From `config_entry_compare` in `src/boot/efi/boot.c`: entries with 0 tries left last;
/// entries with a `sort-key` before those without; then `sort-key` ascending, `machine-id`
/// ascending, `version` **descending** (by `strverscmp_improved`); then the lower-cased file
/// name descending; then more tries left first, then fewer tries done first. The sort is
/// stable.
pub fn boot_order(entries: &[EntryFile]) -> Vec<String> {
    let mut sorted: Vec<&EntryFile> = entries.iter().collect();
    sorted.sort_by(|a, b| compare_entries(a, b));
    sorted.into_iter().map(|e| e.file_name.clone()).collect()
}

fn compare_entries(a: &EntryFile, b: &EntryFile) -> Ordering {
    let bad = |e: &EntryFile| e.counter.is_some_and(|c| c.left == 0);
    let order = bad(a).cmp(&bad(b));
    if order != Ordering::Equal {
        return order;
    }
    let (ka, kb) = (a.entry.sort_key.as_deref(), b.entry.sort_key.as_deref());
    let order = ka.is_none().cmp(&kb.is_none());
    if order != Ordering::Equal {
        return order;
    }
    if let (Some(ka), Some(kb)) = (ka, kb) {
        let order = ka.as_bytes().cmp(kb.as_bytes());
        if order != Ordering::Equal {
            return order;
        }
        let order = a.entry.machine_id.as_deref().cmp(&b.entry.machine_id.as_deref());
        if order != Ordering::Equal {
            return order;
        }
        let order = strverscmp_improved(a.entry.version.as_deref(), b.entry.version.as_deref()).reverse();
        if order != Ordering::Equal {
            return order;
        }
    }
    let (ia, ib) = (a.file_name.to_ascii_lowercase(), b.file_name.to_ascii_lowercase());
    let order = strverscmp_improved(Some(&ia), Some(&ib)).reverse();
    if order != Ordering::Equal {
        return order;
    }
    match (a.counter, b.counter) {
        (Some(ca), Some(cb)) => ca.left.cmp(&cb.left).reverse().then(ca.done.cmp(&cb.done)),
        _ => Ordering::Equal,
    }
}

/// systemd's `strverscmp_improved`: version comparison treating `.`, `-`, `^` and `~` as
/// separators (`~` sorts before anything, even the end), numbers numerically, and a `None`
/// before anything.
pub fn strverscmp_improved(a: Option<&str>, b: Option<&str>) -> Ordering {
    let (a, b) = match (a, b) {
        (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => (a.as_bytes(), b.as_bytes()),
        // `isempty(a) || isempty(b)`: strcmp_ptr, where NULL sorts first.
        (a, b) => return a.map(str::as_bytes).cmp(&b.map(str::as_bytes)),
    };
    let at = |s: &[u8], i: usize| s.get(i).copied().unwrap_or(0);
    let valid = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'~' | b'-' | b'^' | b'.');
    let (mut i, mut j) = (0usize, 0usize);
    loop {
        while at(a, i) != 0 && !valid(at(a, i)) {
            i += 1;
        }
        while at(b, j) != 0 && !valid(at(b, j)) {
            j += 1;
        }
        if at(a, i) == b'~' || at(b, j) == b'~' {
            let order = (at(a, i) != b'~').cmp(&(at(b, j) != b'~'));
            if order != Ordering::Equal {
                return order;
            }
            i += 1;
            j += 1;
        }
        if at(a, i) == 0 || at(b, j) == 0 {
            return at(a, i).cmp(&at(b, j));
        }
        for sep in [b'-', b'^', b'.'] {
            if at(a, i) == sep || at(b, j) == sep {
                let order = (at(a, i) != sep).cmp(&(at(b, j) != sep));
                if order != Ordering::Equal {
                    return order;
                }
                i += 1;
                j += 1;
            }
        }
        if at(a, i).is_ascii_digit() || at(b, j).is_ascii_digit() {
            let (mut ea, mut eb) = (i, j);
            while at(a, ea).is_ascii_digit() {
                ea += 1;
            }
            while at(b, eb).is_ascii_digit() {
                eb += 1;
            }
            let order = (i != ea).cmp(&(j != eb));
            if order != Ordering::Equal {
                return order;
            }
            while at(a, i) == b'0' {
                i += 1;
            }
            while at(b, j) == b'0' {
                j += 1;
            }
            // Zeros are digits, so `i <= ea` and `j <= eb` still hold.
            let (sa, sb) = (i.min(ea), j.min(eb));
            let order = (ea - sa).cmp(&(eb - sb));
            if order != Ordering::Equal {
                return order;
            }
            let order = a[sa..ea].cmp(&b[sb..eb]);
            if order != Ordering::Equal {
                return order;
            }
            i = ea;
            j = eb;
        } else {
            let (mut ea, mut eb) = (i, j);
            while at(a, ea).is_ascii_alphabetic() {
                ea += 1;
            }
            while at(b, eb).is_ascii_alphabetic() {
                eb += 1;
            }
            let n = (ea - i).min(eb - j);
            let order = a[i..i + n].cmp(&b[j..j + n]);
            if order != Ordering::Equal {
                return order;
            }
            let order = (ea - i).cmp(&(eb - j));
            if order != Ordering::Equal {
                return order;
            }
            i = ea;
            j = eb;
        }
    }
}

#[cfg(test)]
mod tests;

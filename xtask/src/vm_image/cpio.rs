//! A deterministic `newc` cpio writer for the initramfs: entries sorted by path, parents
//! created implicitly, fixed mtime, sequential inode numbers. Written here (not with
//! `cpio(1)`) so device nodes such as `/dev/console` need no root and the output is reproducible.

use std::collections::BTreeMap;
use std::io::{self, Write};

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

/// One archive member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    /// Permission bits (e.g. 0o755).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
}

/// An initramfs under construction, keyed by relative path (`bin/sh`, no leading slash).
#[derive(Debug, Default)]
pub struct Archive {
    entries: BTreeMap<String, Entry>,
}

fn normalize(path: &str) -> String {
    path.trim_start_matches("./").trim_matches('/').to_string()
}

impl Archive {
    /// Adds (or replaces) an entry; missing parent directories are added as root-owned 0755.
    pub fn add(&mut self, path: &str, kind: Kind, perm: u32, uid: u32, gid: u32) {
        let path = normalize(path);
        if path.is_empty() {
            return;
        }
        let mut parent = String::new();
        for comp in path.split('/').take(path.split('/').count() - 1) {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(comp);
            self.entries.entry(parent.clone()).or_insert(Entry { kind: Kind::Dir, perm: 0o755, uid: 0, gid: 0 });
        }
        self.entries.insert(path, Entry { kind, perm, uid, gid });
    }

    pub fn dir(&mut self, path: &str, perm: u32) {
        self.add(path, Kind::Dir, perm, 0, 0);
    }

    pub fn file(&mut self, path: &str, data: Vec<u8>, perm: u32) {
        self.add(path, Kind::File(data), perm, 0, 0);
    }

    pub fn symlink(&mut self, path: &str, target: &str) {
        self.add(path, Kind::Symlink(target.to_string()), 0o777, 0, 0);
    }

    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains_key(&normalize(path))
    }

    /// Writes the archive in `newc` format, every mtime set to `mtime`.
    pub fn write<W: Write>(&self, out: &mut W, mtime: u64) -> io::Result<()> {
        for (ino, (path, e)) in (1u32..).zip(&self.entries) {
            let (mode, data, rdev): (u32, &[u8], (u32, u32)) = match &e.kind {
                Kind::Dir => (0o040000, &[], (0, 0)),
                Kind::File(d) => (0o100000, d, (0, 0)),
                Kind::Symlink(t) => (0o120000, t.as_bytes(), (0, 0)),
                Kind::CharDev { major, minor } => (0o020000, &[], (*major, *minor)),
            };
            let nlink = if matches!(e.kind, Kind::Dir) { 2 } else { 1 };
            write_member(out, ino, mode | (e.perm & 0o7777), e.uid, e.gid, nlink, mtime, path, data, rdev)?;
        }
        write_member(out, 0, 0, 0, 0, 1, 0, "TRAILER!!!", &[], (0, 0))
    }
}

fn pad<W: Write>(out: &mut W, len: usize) -> io::Result<()> {
    let n = (4 - len % 4) % 4;
    out.write_all(&[0u8; 3][..n])
}

#[allow(clippy::too_many_arguments)]
fn write_member<W: Write>(
    out: &mut W,
    ino: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u32,
    mtime: u64,
    name: &str,
    data: &[u8],
    rdev: (u32, u32),
) -> io::Result<()> {
    let header = format!(
        "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
        0,
        0,
        rdev.0,
        rdev.1,
        0,
        mtime = mtime as u32,
        size = data.len(),
        namesize = name.len() + 1,
    );
    out.write_all(header.as_bytes())?;
    out.write_all(name.as_bytes())?;
    out.write_all(&[0])?;
    pad(out, header.len() + name.len() + 1)?;
    out.write_all(data)?;
    pad(out, data.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout_parents_and_alignment() {
        let mut a = Archive::default();
        a.file("/sbin/silkd", b"abc".to_vec(), 0o755);
        a.add("dev/console", Kind::CharDev { major: 5, minor: 1 }, 0o600, 0, 0);
        let mut out = Vec::new();
        a.write(&mut out, 7).expect("writing to a Vec cannot fail");
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        // dev, dev/console, sbin, sbin/silkd, trailer — in that order.
        let names: Vec<usize> = ["dev\0", "dev/console\0", "sbin\0", "sbin/silkd\0", "TRAILER!!!\0"]
            .iter()
            .map(|n| text.find(n).unwrap_or(usize::MAX))
            .collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "{names:?}");
        // First header: directory `dev`, mode 040755, mtime 7.
        assert_eq!(&out[0..6], b"070701");
        assert_eq!(&out[14..22], b"000041ed");
        assert_eq!(&out[46..54], b"00000007");
        // The console's rdev major/minor.
        let console = text.find("dev/console\0").expect("console entry") - 110;
        assert_eq!(&out[console + 14..console + 22], b"00002180");
        assert_eq!(&out[console + 78..console + 86], b"00000005");
        assert_eq!(&out[console + 86..console + 94], b"00000001");
        // File data follows the 4-aligned name.
        let silkd = text.find("sbin/silkd\0").expect("silkd entry");
        let data_at = (silkd + 11).div_ceil(4) * 4;
        assert_eq!(&out[data_at..data_at + 3], b"abc");
    }

    #[test]
    fn output_is_deterministic() {
        let build = |order: &[&str]| {
            let mut a = Archive::default();
            for p in order {
                a.file(p, p.as_bytes().to_vec(), 0o644);
            }
            let mut out = Vec::new();
            a.write(&mut out, 0).expect("writing to a Vec cannot fail");
            out
        };
        assert_eq!(build(&["a/b", "c", "a/a"]), build(&["c", "a/a", "a/b"]));
    }
}

//! "Every secret the box writes is 0600 in a 0700 directory", checked on a directory tree: on
//! this host ([`walk_host`], the supervisor suites) or inside a box's state partition read off
//! its powered-off disk ([`state_partition`]: the qcow2 converted to raw, the partition cut out
//! by its GPT label, the ext4 journal replayed on the copy with `e2fsck`, then listed with
//! `debugfs`). Nothing on the box itself is added for it: no debug route, no shell.
//!
//! A file is a secret by its name ([`is_secret`]): tokens, keys, kubeconfigs and kubelet
//! client identities, the claims state and journals (they hold sandbox tokens), the generated
//! configs that name secret files, and the supervisor's service logs.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// One file or directory, `path` relative to the walked root (`a/b`, "" for the root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    /// Permission bits (`0o600`).
    pub mode: u32,
    pub dir: bool,
}

/// Whether the file at `rel` (relative path) holds or names a secret.
pub fn is_secret(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    let lower = name.to_ascii_lowercase();
    (lower.contains("token") || lower.contains("secret") || (lower.contains("key") && !lower.ends_with(".pub")))
        || lower == foundation::KUBECONFIG_FILE
        || lower.starts_with("kubelet-client")
        || lower.starts_with("claims.")
        || lower == "sandboxd.json"
        || rel.starts_with("secrets/")
        || rel.starts_with("logs/")
}

/// Checks every secret in `entries` (0600, its directory 0700) and that each of `required`
/// exists as a file; returns the secrets checked, or every violation found.
pub fn check(entries: &[Entry], required: &[&str]) -> Result<Vec<String>> {
    let dirs: BTreeMap<&str, u32> = entries.iter().filter(|e| e.dir).map(|e| (e.path.as_str(), e.mode)).collect();
    let mut bad = Vec::new();
    let mut checked = Vec::new();
    for e in entries.iter().filter(|e| !e.dir && is_secret(&e.path)) {
        let parent = e.path.rsplit_once('/').map(|(p, _)| p).unwrap_or("");
        if e.mode != 0o600 {
            bad.push(format!("{} is {:o}, not 600", e.path, e.mode));
        }
        match dirs.get(parent) {
            Some(0o700) => {}
            Some(m) => bad.push(format!("{} is in {}/, which is {m:o}, not 700", e.path, parent)),
            None => bad.push(format!("{}: its directory was not listed", e.path)),
        }
        checked.push(e.path.clone());
    }
    for r in required {
        if !entries.iter().any(|e| !e.dir && e.path == *r) {
            bad.push(format!("{r} is missing"));
        }
    }
    if !bad.is_empty() {
        bail!("secrets with the wrong modes:\n  {}\n(checked: {})", bad.join("\n  "), checked.join(", "));
    }
    Ok(checked)
}

/// Every file and directory under `root` on this host (symlinks and sockets skipped).
pub fn walk_host(root: &Path) -> Result<Vec<Entry>> {
    use std::os::unix::fs::PermissionsExt as _;
    fn walk(root: &Path, rel: &str, out: &mut Vec<Entry>) -> Result<()> {
        let dir = if rel.is_empty() { root.to_path_buf() } else { root.join(rel) };
        for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let e = e?;
            let meta = e.path().symlink_metadata()?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            let mode = meta.permissions().mode() & 0o7777;
            if meta.is_dir() {
                out.push(Entry { path: path.clone(), mode, dir: true });
                walk(root, &path, out)?;
            } else if meta.is_file() {
                out.push(Entry { path, mode, dir: false });
            }
        }
        Ok(())
    }
    let meta = std::fs::metadata(root).with_context(|| format!("{}", root.display()))?;
    let mut out = vec![Entry { path: String::new(), mode: meta.permissions().mode() & 0o7777, dir: true }];
    walk(root, "", &mut out)?;
    Ok(out)
}

fn run(cmd: &mut Command, what: &str) -> Result<std::process::Output> {
    let out = cmd.output().with_context(|| format!("{what}: running {cmd:?}"))?;
    Ok(out)
}

fn run_ok(cmd: &mut Command, what: &str) -> Result<Vec<u8>> {
    let out = run(cmd, what)?;
    if !out.status.success() {
        bail!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// The entries of the ext4 partition labelled `label` on a powered-off machine's `disk`
/// (qcow2), listed from a copy made in `work` (removed afterwards).
pub fn state_partition(disk: &Path, label: &str, work: &Path) -> Result<Vec<Entry>> {
    std::fs::create_dir_all(work)?;
    let raw = work.join("disk.raw");
    let part = work.join("state.ext4");
    let result = (|| {
        run_ok(
            Command::new("qemu-img").args(["convert", "-f", "qcow2", "-O", "raw"]).arg(disk).arg(&raw),
            "qemu-img convert",
        )?;
        let table: serde_json::Value =
            serde_json::from_slice(&run_ok(Command::new("sfdisk").arg("--json").arg(&raw), "sfdisk --json")?)?;
        let p = table["partitiontable"]["partitions"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == label))
            .with_context(|| format!("no partition labelled {label} on {}", disk.display()))?;
        let sector = table["partitiontable"]["sectorsize"].as_u64().unwrap_or(512);
        let (start, size) = (
            p["start"].as_u64().context("partition start")? * sector,
            p["size"].as_u64().context("partition size")? * sector,
        );
        run_ok(
            Command::new("dd")
                .arg(format!("if={}", raw.display()))
                .arg(format!("of={}", part.display()))
                .args(["bs=4M", "iflag=skip_bytes,count_bytes", "conv=sparse", "status=none"])
                .arg(format!("skip={start}"))
                .arg(format!("count={size}")),
            "dd",
        )?;
        let _ = std::fs::remove_file(&raw);
        // A power cut leaves the journal to replay: do it on the copy (0: clean, 1/2: fixed).
        let fsck = run(Command::new("e2fsck").args(["-f", "-y"]).arg(&part), "e2fsck")?;
        if !matches!(fsck.status.code(), Some(0..=2)) {
            bail!("e2fsck of the state partition failed ({}): {}", fsck.status, String::from_utf8_lossy(&fsck.stdout));
        }
        list_ext4(&part)
    })();
    let _ = std::fs::remove_file(&raw);
    let _ = std::fs::remove_file(&part);
    result
}

/// Every file and directory of an ext4 image (`debugfs -R "ls -p DIR"`, one directory at a time).
pub fn list_ext4(image: &Path) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    let mut todo = vec![String::new()];
    while let Some(rel) = todo.pop() {
        let stdout = run_ok(Command::new("debugfs").arg("-R").arg(format!("ls -p /{rel}")).arg(image), "debugfs ls")?;
        // `/inode/mode/uid/gid/name/size/`, mode in octal (040700, 0100600).
        for line in String::from_utf8_lossy(&stdout).lines() {
            let f: Vec<&str> = line.split('/').collect();
            if f.len() < 7 || f[5] == "." || f[5] == ".." {
                continue;
            }
            let mode = u32::from_str_radix(f[2], 8).with_context(|| format!("debugfs line {line:?}"))?;
            let path = if rel.is_empty() { f[5].to_string() } else { format!("{rel}/{}", f[5]) };
            match mode & 0o170000 {
                0o040000 => {
                    out.push(Entry { path: path.clone(), mode: mode & 0o7777, dir: true });
                    todo.push(path);
                }
                0o100000 => out.push(Entry { path, mode: mode & 0o7777, dir: false }),
                _ => {}
            }
        }
        if rel.is_empty() {
            // The root's own mode, from its `.` entry.
            let root = String::from_utf8_lossy(&stdout)
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split('/').collect();
                    (f.len() >= 7 && f[5] == ".").then(|| u32::from_str_radix(f[2], 8).ok()).flatten()
                })
                .unwrap_or(0o755);
            out.push(Entry { path: String::new(), mode: root & 0o7777, dir: true });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(path: &str, mode: u32, dir: bool) -> Entry {
        Entry { path: path.into(), mode, dir }
    }

    #[test]
    fn secrets_by_name_and_the_rule() {
        for s in
            ["secrets/sandboxd-token", "tls/key.pem", "vk-sandbox/claims.json", "sandboxd/claims.log", "x/kubeconfig"]
        {
            assert!(is_secret(s), "{s}");
        }
        for s in ["tls/cert.pem", "update/last-attempt.json", "images/refs.json", "keys/dev.pub", "sandboxd/pools.json"]
        {
            assert!(!is_secret(s), "{s}");
        }
        let ok = [e("", 0o755, true), e("secrets", 0o700, true), e("secrets/sandboxd-token", 0o600, false)];
        assert_eq!(check(&ok, &["secrets/sandboxd-token"]).expect("clean"), ["secrets/sandboxd-token"]);
        let loose = [e("", 0o755, true), e("tls", 0o755, true), e("tls/key.pem", 0o644, false)];
        let msg = check(&loose, &["secrets/sandboxd-token"]).expect_err("loose").to_string();
        assert!(msg.contains("tls/key.pem is 644") && msg.contains("which is 755"), "{msg}");
        assert!(msg.contains("secrets/sandboxd-token is missing"), "{msg}");
    }

    #[test]
    fn an_ext4_image_is_listed_with_its_modes() {
        // mkfs.ext4 -d builds the image from a directory, rootless.
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("secrets")).expect("mkdir");
        std::fs::write(src.join("secrets/t"), "x").expect("w");
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(src.join("secrets"), std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::fs::set_permissions(src.join("secrets/t"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let img = dir.path().join("fs.ext4");
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-d"])
            .arg(&src)
            .arg(&img)
            .arg("8M")
            .output()
            .expect("mkfs.ext4 (e2fsprogs) is required");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let entries = list_ext4(&img).expect("list");
        assert!(entries.contains(&e("secrets", 0o700, true)), "{entries:?}");
        assert!(entries.contains(&e("secrets/t", 0o600, false)), "{entries:?}");
        assert_eq!(walk_host(&src).expect("walk").iter().filter(|x| x.path == "secrets/t").count(), 1);
    }
}

//! The declarative inputs of a host image: `boards/<board>/board.toml` (kernel fragments,
//! console/command line, extra and firmware packages, partition sizes, shipped VM templates)
//! and `rootfs/packages.toml` (the Debian host OS every board shares).

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// `boards/<board>/board.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Board {
    /// One line for humans.
    pub description: String,
    pub kernel: BoardKernel,
    pub packages: BoardPackages,
    pub partitions: Partitions,
    pub vm_images: VmImages,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoardKernel {
    /// Config fragments relative to the project root, merged in order after `tinyconfig`.
    pub fragments: Vec<PathBuf>,
    /// The board's part of the kernel command line (console, ...).
    pub cmdline: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoardPackages {
    /// Debian packages on top of `rootfs/packages.toml`.
    #[serde(default)]
    pub extra: Vec<String>,
    /// Firmware packages (non-free-firmware) for the board's devices.
    #[serde(default)]
    pub firmware: Vec<String>,
}

/// Partition sizes in MiB.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub struct Partitions {
    pub esp_mib: u64,
    /// Each of the two root slots.
    pub root_mib: u64,
    pub state_mib: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmImages {
    /// Templates of vm-images/catalog.toml shipped in the image.
    pub templates: Vec<String>,
    /// Image names → shipped template (the board's catalog aliases).
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
}

impl Board {
    /// Loads and checks `boards/<name>/board.toml`.
    pub fn load(root: &Path, name: &str) -> Result<Board> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            bail!("invalid board name {name:?}");
        }
        let path = root.join("boards").join(name).join("board.toml");
        if !path.is_file() {
            let known: Vec<String> = fs::read_dir(root.join("boards"))
                .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            bail!("unknown board {name:?} (no {}); known: {}", path.display(), known.join(", "));
        }
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let board: Board = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        board.check().with_context(|| format!("checking {}", path.display()))?;
        Ok(board)
    }

    fn check(&self) -> Result<()> {
        if self.kernel.fragments.is_empty() {
            bail!("kernel.fragments is empty: name at least rootfs/kernel/host-base.config");
        }
        let p = self.partitions;
        if p.esp_mib < 64 {
            bail!("partitions.esp_mib = {} is too small for FAT32 with two kernels: use at least 64", p.esp_mib);
        }
        if p.root_mib == 0 || p.state_mib == 0 {
            bail!("partitions.root_mib and partitions.state_mib must be > 0");
        }
        if self.vm_images.templates.is_empty() {
            bail!("vm_images.templates is empty: ship at least `base`");
        }
        for (alias, target) in &self.vm_images.aliases {
            if !self.vm_images.templates.contains(target) {
                bail!("vm_images.aliases.{alias:?} = {target:?} is not one of vm_images.templates");
            }
        }
        Ok(())
    }
}

/// `rootfs/packages.toml`: the Debian host OS.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostOs {
    /// Debian suite (`bookworm`).
    pub suite: String,
    /// mmdebstrap variant (`minbase`).
    pub variant: String,
    /// Archive components (`main`, `non-free-firmware`, ...).
    pub components: Vec<String>,
    /// Timestamp of the Debian base (mmdebstrap's SOURCE_DATE_EPOCH): bump it with the list.
    pub source_date_epoch: u64,
    /// Packages on top of the variant.
    pub packages: Vec<String>,
    /// Packages purged after installation, with their now-unneeded dependencies.
    #[serde(default)]
    pub purge: Vec<String>,
    /// dpkg `path-exclude=` globs (docs, man pages, locales).
    pub path_exclude: Vec<String>,
    /// dpkg `path-include=` globs re-including parts of the excludes (copyright files).
    #[serde(default)]
    pub path_include: Vec<String>,
    /// Paths (relative to the root) removed from the tree after installation.
    #[serde(default)]
    pub remove: Vec<String>,
    /// systemd units masked in the image (`ln -s /dev/null /etc/systemd/system/<unit>`).
    #[serde(default)]
    pub mask: Vec<String>,
    /// systemd units enabled in the image (`systemctl enable`, offline).
    #[serde(default)]
    pub enable: Vec<String>,
}

impl HostOs {
    pub fn load(root: &Path) -> Result<HostOs> {
        let path = root.join("rootfs/packages.toml");
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_boards_and_rootfs_parse() {
        let root = crate::paths::project_root();
        for name in ["qemu-x86_64", "x86_64-efi"] {
            let board = Board::load(&root, name).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            for f in &board.kernel.fragments {
                assert!(root.join(f).is_file(), "{name}: fragment {} missing", f.display());
            }
        }
        let qemu = Board::load(&root, "qemu-x86_64").expect("parsed above");
        assert_eq!(qemu.vm_images.templates, vec!["base"]);
        assert_eq!(
            qemu.vm_images.aliases.get("ghcr.io/cocoonstack/sandbox/rt:24.04").map(String::as_str),
            Some("base")
        );
        let host = HostOs::load(&root).expect("rootfs/packages.toml parses");
        assert!(host.packages.iter().any(|p| p == "systemd"));
    }

    #[test]
    fn bad_boards_are_refused_with_the_key() {
        let text = r#"
            description = "x"
            [kernel]
            fragments = ["a"]
            cmdline = ""
            [packages]
            [partitions]
            esp_mib = 128
            root_mib = 10
            state_mib = 10
            [vm_images]
            templates = ["base"]
            [vm_images.aliases]
            "img" = "rt"
        "#;
        let board: Board = toml::from_str(text).expect("syntax is fine");
        let err = board.check().expect_err("alias to a template not shipped");
        assert!(err.to_string().contains("vm_images.aliases"), "{err}");
        assert!(Board::load(&crate::paths::project_root(), "../etc").is_err());
    }
}

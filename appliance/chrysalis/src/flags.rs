//! The command line: one subcommand enum per verb group (`image`, `snapshot`; the supervisor
//! verbs of issue #6 join [`Command`] later).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Chrysalis host tool.
#[derive(Debug, Parser)]
#[command(name = "chrysalis", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// The image library's root directory.
    #[arg(long, global = true, env = "CHRYSALIS_IMAGES", value_name = "DIR", default_value_os_t = images::default_root())]
    pub store: PathBuf,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Verb groups.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Manage VM images in the local library.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Save, list and remove VM snapshots in the local library.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
}

/// Where the QEMU driver keeps its VMs.
#[derive(Debug, Clone, Args)]
pub struct VmStateDir {
    /// The VM driver's state directory (VM records are `<DIR>/vms/<id>/vm.json`).
    #[arg(long, env = "CHRYSALIS_VM_STATE_DIR", value_name = "DIR", default_value_os_t = default_vm_state_dir())]
    pub vm_state_dir: PathBuf,
}

/// `$CHRYSALIS_STATE/vms`.
pub fn default_vm_state_dir() -> PathBuf {
    vmm::record::default_state_dir().join("vms")
}

/// `chrysalis image …`
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Import an image: a built catalog template (or alias), or the files of a directory.
    ///
    /// From the catalog (`cargo xtask vm-image` builds it): `chrysalis image import rt --name
    /// ubuntu-dev-base`. From a directory: `--dir DIR` takes `vmlinux`, `initrd.cpio.gz` (or
    /// `initrd`), and if present `rootfs.erofs`, `overlay-empty.ext4` and `cmdline`; a build
    /// `manifest.json` in DIR (`cargo xtask vm-image` output) supplies the kernel and command
    /// line those files lack; `--kernel` / `--cmdline` win over both.
    Import(ImportArgs),
    /// List images.
    List(ListArgs),
    /// Remove image names (blobs stay until `gc`).
    Rm {
        /// `repo[:tag]` names.
        #[arg(required = true, value_name = "REF")]
        refs: Vec<String>,
    },
    /// Give an image or snapshot another name.
    Tag {
        /// Existing `repo[:tag]` or `sha256:…` digest.
        source: String,
        /// New `repo[:tag]`.
        target: String,
    },
    /// Show what a name resolves to (manifest and file paths) as JSON.
    Inspect {
        /// `repo[:tag]` or `sha256:…` digest.
        reference: String,
    },
    /// Re-hash blobs: those a name needs, or every blob of the library.
    Verify {
        /// `repo[:tag]` or digest; omitted: everything.
        reference: Option<String>,
    },
    /// Remove blobs no name, no named snapshot and no live VM (under --vm-state-dir) uses.
    Gc(GcArgs),
}

/// `chrysalis image import`
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("from").required(true).args(["template", "dir"]))]
pub struct ImportArgs {
    /// Catalog template name or alias (e.g. `rt`, `base`, `ubuntu-dev-base`).
    pub template: Option<String>,
    /// Import the files of this directory instead of a catalog template.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Name to store it under, `repo[:tag]` (bare `repo` = `repo:latest`). Default: the template name given.
    #[arg(long, value_name = "REF", required_unless_present = "template")]
    pub name: Option<String>,
    /// Catalog file (default `$CHRYSALIS_CACHE/images/catalog.json`).
    #[arg(long, value_name = "FILE", conflicts_with = "dir")]
    pub catalog: Option<PathBuf>,
    /// With --dir: the kernel file.
    #[arg(long, value_name = "FILE", conflicts_with = "template")]
    pub kernel: Option<PathBuf>,
    /// With --dir: the extra kernel command line.
    #[arg(long, value_name = "ARGS", conflicts_with = "template")]
    pub cmdline: Option<String>,
}

/// Listing flags.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON (an array of entries) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `chrysalis image gc`
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Also keep this digest (and what it references); repeatable.
    #[arg(long, value_name = "DIGEST")]
    pub keep: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub vms: VmStateDir,
}

/// `chrysalis snapshot …`
#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a running QEMU VM (it keeps running) into the library.
    Save {
        /// The VM id (its directory name under `<vm-state-dir>/vms/`).
        vm_id: String,
        /// Name to store it under, `repo[:tag]`.
        name: String,
        #[command(flatten)]
        vms: VmStateDir,
    },
    /// List snapshots.
    List(ListArgs),
    /// Remove snapshot names (blobs stay until `chrysalis image gc`).
    Rm {
        /// `repo[:tag]` names.
        #[arg(required = true, value_name = "REF")]
        refs: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn import_needs_a_source_and_a_name_for_dirs() {
        assert!(Cli::try_parse_from(["chrysalis", "image", "import"]).is_err());
        assert!(Cli::try_parse_from(["chrysalis", "image", "import", "--dir", "/x"]).is_err(), "--dir needs --name");
        assert!(Cli::try_parse_from(["chrysalis", "image", "import", "rt", "--dir", "/x", "--name", "a"]).is_err());
        assert!(Cli::try_parse_from(["chrysalis", "image", "import", "rt"]).is_ok());
        assert!(Cli::try_parse_from(["chrysalis", "image", "import", "--dir", "/x", "--name", "a"]).is_ok());
        assert!(Cli::try_parse_from(["chrysalis", "image", "import", "rt", "--kernel", "/k"]).is_err());
    }
}

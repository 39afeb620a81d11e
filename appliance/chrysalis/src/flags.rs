//! The command line: one subcommand enum per verb group: the local image library (`image`,
//! `snapshot`) and the appliance (`run`, `status`, `logs`, `update`, `reboot`, `config`).
//! The global `--store` is used by `image` and `snapshot` only.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Chrysalis host tool: the appliance supervisor and its control verbs, and the local VM
/// image library.
#[derive(Debug, Parser)]
#[command(
    name = "chrysalis",
    version,
    about,
    long_about = "Chrysalis host tool.\n\n\
        On the appliance, `chrysalis run` is the supervisor (systemd's chrysalis.service) that runs \
        sandboxd, vk-sandbox and vk-cocoon; `status`, `logs`, `token`, `update`, `reboot` talk to it \
        over its API (unix:/run/chrysalis/api.sock on the box; from elsewhere --api https://host:7780 \
        with --api-token-file and --api-fingerprint or --api-ca-file), and `config check` validates \
        the configuration. `image` and `snapshot` manage the local VM image library.",
    propagate_version = true
)]
pub struct Cli {
    /// The image library's root directory (`image` and `snapshot` verbs only).
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
    /// Run the appliance supervisor (the main process of chrysalis.service).
    ///
    /// Reads the layered configuration (baked /usr/share/chrysalis/config.toml, then
    /// /efi/chrysalis/config.toml, then /run/chrysalis/config-disk/config.toml, then
    /// `chrysalis.set=<key>=<value>` kernel arguments), starts sandboxd and, with a [cluster],
    /// vk-sandbox and vk-cocoon, restarts them with backoff, serves the API on the Unix socket
    /// and reports READY/STATUS/WATCHDOG to systemd. SIGTERM stops the services and leaves the
    /// VMs running. A configuration error starts no service; it is logged and shown by
    /// `chrysalis status` (or ends the process with --exit-on-config-error). Logs are JSON on
    /// stderr unless it is a terminal (CHRYSALIS_LOG_FORMAT=json|text, RUST_LOG).
    Run(RunArgs),
    /// Show the appliance: services, virtual nodes, warm pools, slot and health.
    Status(ClientArgs),
    /// Show a service's recent output (sandboxd, vk-sandbox, vk-cocoon).
    Logs(LogsArgs),
    /// A/B system updates: apply a signed bundle, show the update state, roll back.
    #[command(subcommand)]
    Update(UpdateCmd),
    /// Stop the services and reboot the box (VMs do not survive a reboot).
    Reboot(ClientArgs),
    /// Tokens the box keeps (sandboxd's root token).
    #[command(subcommand)]
    Token(TokenCmd),
    /// The appliance configuration.
    #[command(subcommand)]
    Config(ConfigCmd),
}

/// Where the configuration layers are read from (`run`, `config check`).
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Layer 1: the image's baked configuration.
    #[arg(long, value_name = "FILE", default_value = supervisor::config::BAKED_PATH)]
    pub config_baked: PathBuf,
    /// Layer 2: the configuration on the ESP.
    #[arg(long, value_name = "FILE", default_value = supervisor::config::ESP_PATH)]
    pub config_esp: PathBuf,
    /// Layer 3: the configuration on the config partition (label CHRYSALIS).
    #[arg(long, value_name = "FILE", default_value = supervisor::config::CONFIG_DISK_PATH)]
    pub config_disk: PathBuf,
    /// Layer 4: a file holding the kernel command line (`chrysalis.set=` arguments).
    #[arg(long, value_name = "FILE", default_value = supervisor::config::CMDLINE_PATH)]
    pub cmdline: PathBuf,
    /// Ignore the kernel command line.
    #[arg(long)]
    pub no_cmdline: bool,
    /// Base of the default node names (<hostname>-sandbox, <hostname>-cocoon) instead of the host name.
    #[arg(long, value_name = "NAME")]
    pub hostname: Option<String>,
}

impl SourceArgs {
    /// The four layers.
    pub fn paths(&self) -> supervisor::config::SourcePaths {
        supervisor::config::SourcePaths {
            baked: self.config_baked.clone(),
            esp: self.config_esp.clone(),
            config_disk: self.config_disk.clone(),
            cmdline: (!self.no_cmdline).then(|| self.cmdline.clone()),
        }
    }
}

/// `chrysalis run`
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub sources: SourceArgs,
    /// State directory, overriding supervisor.state_dir.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// API socket, overriding supervisor.api_socket.
    #[arg(long, value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// Runtime directory (generated service configs, pid files).
    #[arg(long, value_name = "DIR", default_value = supervisor::RUN_DIR)]
    pub run_dir: PathBuf,
    /// Where the sandboxd, vk-sandbox and vk-cocoon binaries are.
    #[arg(long, value_name = "DIR", default_value = supervisor::BIN_DIR)]
    pub bin_dir: PathBuf,
    /// Guest image catalog when sandboxd.catalog is unset.
    #[arg(long, value_name = "FILE", default_value = supervisor::config::DEFAULT_CATALOG)]
    pub catalog: PathBuf,
    /// Command run to reboot (split on spaces). Default: `systemctl reboot` under systemd; without
    /// NOTIFY_SOCKET and without this flag, reboots are refused.
    #[arg(long, value_name = "CMD")]
    pub reboot_command: Option<String>,
    /// Seconds the services get to stop on SIGTERM before SIGKILL (to their process groups only).
    #[arg(long, value_name = "SECS", default_value_t = 20)]
    pub shutdown_timeout: u64,
    /// Exit with status 1 on a configuration error instead of staying up without services.
    #[arg(long)]
    pub exit_on_config_error: bool,
}

/// Output format.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How to reach the supervisor API.
#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    /// The supervisor API: unix:PATH on the box, https://host:port from elsewhere
    /// (supervisor.api_listen; http:// only when it listens on loopback).
    #[arg(long, env = "CHRYSALIS_API", value_name = "ENDPOINT", default_value = "unix:/run/chrysalis/api.sock")]
    pub api: String,
    /// File holding the bearer token of a remote API (supervisor.api_token_file).
    #[arg(long, env = "CHRYSALIS_API_TOKEN_FILE", value_name = "FILE")]
    pub api_token_file: Option<PathBuf>,
    /// For https://: the SHA-256 fingerprint of the box's certificate (AB:CD:… or hex), as
    /// `chrysalis status` shows it on the box and its console prints it at start.
    #[arg(long, env = "CHRYSALIS_API_FINGERPRINT", value_name = "SHA256", conflicts_with = "api_ca_file")]
    pub api_fingerprint: Option<String>,
    /// For https://: a PEM file to trust, the box's certificate itself or the CA that issued it
    /// (supervisor.tls_cert_file).
    #[arg(long, env = "CHRYSALIS_API_CA_FILE", value_name = "FILE")]
    pub api_ca_file: Option<PathBuf>,
}

/// API + output flags.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    #[command(flatten)]
    pub api: ApiArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// `chrysalis logs`
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// sandboxd, vk-sandbox or vk-cocoon.
    pub service: String,
    /// How many of the last lines (at most 2000 are kept in memory; older ones are in
    /// <state>/logs/<service>.log).
    #[arg(long, short = 'n', value_name = "N", default_value_t = 200)]
    pub tail: usize,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `chrysalis update …`
#[derive(Debug, Subcommand)]
pub enum UpdateCmd {
    /// Write a signed bundle (*.chrysalis-bundle) to the inactive slot, verify it and arm a
    /// one-shot trial boot; the new slot is committed only when the box becomes healthy.
    Apply {
        /// The bundle file.
        bundle: PathBuf,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the running slot, version and update state (trial, armed, applying …).
    Status(ClientArgs),
    /// Arm the other slot and reboot into it.
    Rollback(ClientArgs),
}

/// `chrysalis token …`
#[derive(Debug, Subcommand)]
pub enum TokenCmd {
    /// Print a token the box keeps: `sandboxd` is sandboxd's root token (minted on first boot
    /// unless sandboxd.api_token_file is set). Prints the token alone, so
    /// `chrysalis token show sandboxd > sandboxd-token` makes a token file for the SDK
    /// (`Client(…, api_token=…)`) or for curl (`Authorization: Bearer …`).
    Show {
        /// Which token: sandboxd.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// `chrysalis config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCmd {
    /// Validate the configuration as `chrysalis run` would (all layers), or only the given
    /// files (layered in order, later wins). Each error names the key, where it was set and the
    /// fix. Exit status 1 when there are errors.
    Check {
        /// Files to check instead of the layers (relative *_file paths resolve against each file).
        files: Vec<PathBuf>,
        #[command(flatten)]
        sources: SourceArgs,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Print the built-in default configuration (every key, documented).
    Default,
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
        /// The Kubernetes namespace that owns it: vk-cocoon lets only Pods of this namespace
        /// (or of one sharing with it through VK_SHARED_NAMESPACES) clone, overwrite or drop it.
        /// Without it, the snapshot belongs to vk-cocoon's VK_LEGACY_NAMESPACE (default).
        #[arg(long, value_name = "NAMESPACE")]
        namespace: Option<String>,
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
    fn appliance_verbs_parse() {
        let c = Cli::try_parse_from(["chrysalis", "logs", "sandboxd", "--tail", "5", "--json"]).expect("logs");
        let Command::Logs(l) = c.command else { panic!("not logs") };
        assert_eq!((l.service.as_str(), l.tail, l.client.out.json), ("sandboxd", 5, true));
        assert_eq!(l.client.api.api, "unix:/run/chrysalis/api.sock");
        assert!(Cli::try_parse_from(["chrysalis", "update", "apply"]).is_err(), "apply needs a bundle");
        assert!(Cli::try_parse_from(["chrysalis", "update", "apply", "b.bundle", "--api", "http://h:7780"]).is_ok());
        assert!(Cli::try_parse_from(["chrysalis", "config", "check", "a.toml", "b.toml", "--json"]).is_ok());
        let c = Cli::try_parse_from([
            "chrysalis",
            "token",
            "show",
            "sandboxd",
            "--api",
            "https://h:7780",
            "--api-fingerprint",
            "AB",
        ])
        .expect("token show");
        let Command::Token(TokenCmd::Show { name, client }) = c.command else { panic!("not token show") };
        assert_eq!((name.as_str(), client.api.api_fingerprint.as_deref()), ("sandboxd", Some("AB")));
        assert!(
            Cli::try_parse_from(["chrysalis", "status", "--api-fingerprint", "AB", "--api-ca-file", "/c"]).is_err(),
            "one trust at a time"
        );
        let c = Cli::try_parse_from(["chrysalis", "run", "--state-dir", "/s", "--no-cmdline"]).expect("run");
        let Command::Run(r) = c.command else { panic!("not run") };
        assert_eq!(r.sources.paths().cmdline, None);
        assert_eq!(r.sources.paths().baked, PathBuf::from("/usr/share/chrysalis/config.toml"));
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

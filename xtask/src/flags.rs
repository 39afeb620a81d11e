//! The `cargo xtask` command line.

use clap::{Args, Parser, Subcommand};

/// Build, run, test and benchmark Chrysalis. Every step installs what it needs
/// (apt packages, Rust targets) and caches its outputs under $CHRYSALIS_CACHE
/// (default ~/.cache/chrysalis), outside the repository.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", version)]
pub struct Xtask {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Install the host prerequisites (apt packages, Rust targets) that are missing.
    Prereqs,
    /// Build the microVM guest kernel (Debian linux-source + vm-images/kernel/guest.config);
    /// cached, rebuilt only when the fragment or the source changes. Prints the vmlinux path.
    GuestKernel(GuestKernelArgs),
    /// Build a guest image template (see vm-images/catalog.toml) and register it in the
    /// local catalog ($CHRYSALIS_CACHE/images/catalog.json).
    VmImage(VmImageArgs),
    /// Run the whole test suite as CI does: prerequisites, guest images, unit, integration
    /// and end-to-end tests (real QEMU VMs), and a bounded fuzz run. Ends with
    /// `N passed, N failed, N skipped`.
    Test(TestArgs),
    /// Build and run sandboxd standalone (port 7777) with warm pools for
    /// `ghcr.io/cocoonstack/sandbox/rt:24.04` and `base` (appliance/sandboxd/examples/standalone.json).
    Sandboxd(SandboxdArgs),
    /// Join the local test cluster (`cargo xtask cluster up`) as the vk-sandbox virtual node:
    /// runs sandboxd (the `sandboxd` command's pools, port 7777) and vk-sandbox joined with the
    /// cluster's bootstrap token and pinned CA hash. Then `kubectl get nodes` shows it Ready and
    /// the seed's sandboxd example runs on it. Ctrl-C stops both; claims and VMs are kept.
    VkSandbox(VkSandboxArgs),
    /// Join the local test cluster as the vk-cocoon virtual node: imports the built `rt` image
    /// as `ubuntu-dev-base` (and `base`) into the node's image library, then runs vk-cocoon joined
    /// with the cluster's bootstrap token. VMs get addresses on the bridge `chrysalis0`
    /// (10.88.0.0/24), reachable from this host. Ctrl-C stops the provider; VMs keep running.
    VkCocoon(VkCocoonArgs),
    /// Build the flashable A/B host image of a board (boards/<board>/board.toml + rootfs/):
    /// GPT disk with ESP (systemd-boot), root slots A/B (erofs + dm-verity) and a state
    /// partition, rootless and reproducible, under $CHRYSALIS_CACHE/appliance/<board>/.
    /// Name the update keys the image trusts: `--update-keys DIR` (release public keys) or
    /// `--dev-keys` (this machine's development pair; never for boxes you ship).
    Image(ImageArgs),
    /// Write a built image to a block device, with a confirmation and a read-back check.
    Flash(FlashArgs),
    /// Build the image (cached; trusting this machine's development update keys, as with
    /// `cargo xtask image --dev-keys`) and boot it in QEMU (UEFI, TCG or KVM) in the
    /// foreground: sandboxd on 127.0.0.1:7777, the supervisor API on 127.0.0.1:7780. Ctrl-C
    /// stops it.
    Run(RunArgs),
    /// Make a signed update bundle (`*.chrysalis-bundle`: manifest.json, manifest.sig, vmlinuz,
    /// root.img) from the last image built for the board. Name the signing key: `--key FILE`
    /// (a release key; run this on the signing host) or `--dev-keys` (this machine's
    /// development pair). Prints its path; `chrysalis update apply <bundle>` installs it.
    Bundle(BundleArgs),
    /// Make a new update-signing key pair: FILE (the ed25519 seed, 0600, in a 0700 directory)
    /// and FILE.pub (the public key for `cargo xtask image --update-keys DIR`). Run it on the
    /// machine that will sign (offline or HSM host), never on a build machine. Never replaces
    /// an existing file.
    Keygen(KeygenArgs),
    /// Boot microVMs by hand.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Measure speed and memory, printing each figure beside its target or anchor.
    Bench(BenchArgs),
    /// Fuzz the silkd frame decoder for a bounded time (cargo-fuzz on the stable toolchain).
    Fuzz(FuzzArgs),
    /// A real Kubernetes control plane on 127.0.0.1 for tests and demos (etcd, apiserver,
    /// controller-manager, scheduler, the agent-sandbox controller), built from the Go
    /// modules pinned in tests/cluster/cluster.toml. State in $CHRYSALIS_CACHE/cluster/state.
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(Debug, Args)]
pub struct GuestKernelArgs {
    /// Rebuild even when a cached kernel for the same inputs exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct ImageArgs {
    /// The board (a folder of boards/).
    #[arg(long, default_value = "qemu-x86_64")]
    pub board: String,
    /// The image version (os-release IMAGE_VERSION, boot entry, bundles). Default: the
    /// workspace version and the git commit (`0.1.0-g1a2b3c4`). Another version of the same
    /// tree only re-packs the root (the Debian tree, kernel and binaries are cached).
    #[arg(long)]
    pub version: Option<String>,
    /// The public update keys the image trusts: every DIR/*.pub (64 hex characters and a
    /// newline each, e.g. from `cargo xtask keygen`). Boxes running the image accept bundles
    /// signed by these keys only. DIR must not hold signing keys (*.key).
    #[arg(long, value_name = "DIR", conflicts_with = "dev_keys")]
    pub update_keys: Option<std::path::PathBuf>,
    /// Trust this machine's development key pair ($CHRYSALIS_CACHE/keys/update-signing.key,
    /// generated on first use) instead: for development and tests only.
    #[arg(long)]
    pub dev_keys: bool,
    /// Ship this cloud-hypervisor binary as /usr/bin/cloud-hypervisor (a static x86_64 build,
    /// e.g. upstream's `cloud-hypervisor-static` release asset; none comes from the package
    /// registries). On a box with working KVM, sandboxd's and vk-cocoon's `auto` hypervisor
    /// then choose it over QEMU.
    #[arg(long, value_name = "PATH")]
    pub cloud_hypervisor: Option<std::path::PathBuf>,
    /// The image's security_version (anti-rollback level: boxes refuse bundles below the
    /// highest level they committed). Default: the number in rootfs/security-version.
    #[arg(long, value_name = "N")]
    pub security_version: Option<u64>,
    /// Only build the board's host kernel (prints its path).
    #[arg(long)]
    pub kernel_only: bool,
    /// Re-run mmdebstrap and rebuild the kernel even when cached.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct FlashArgs {
    /// The raw disk image (e.g. $CHRYSALIS_CACHE/appliance/<board>/current/disk.raw).
    #[arg(long)]
    pub image: std::path::PathBuf,
    /// The target block device (/dev/sdX, /dev/nvme0n1). Its whole content is replaced.
    #[arg(long)]
    pub device: std::path::PathBuf,
    /// Do not ask for confirmation.
    #[arg(long)]
    pub yes: bool,
    /// Accept a regular file as the target (tests).
    #[arg(long)]
    pub allow_file: bool,
}

#[derive(Debug, Args)]
pub struct BundleArgs {
    /// The board (a folder of boards/); the bundle is `compatible` with `chrysalis-<board>`.
    #[arg(long, default_value = "qemu-x86_64")]
    pub board: String,
    /// The image build's output directory (root.img, vmlinuz, manifest.json).
    /// Default: $CHRYSALIS_CACHE/appliance/<board>/current.
    #[arg(long)]
    pub image_dir: Option<std::path::PathBuf>,
    /// The signing key: a file of 64 hex characters (the ed25519 seed) and a newline, mode
    /// 0600 (refused when group or others can read it), made by `cargo xtask keygen`. Boxes
    /// accept the bundle only if their image trusts its public half (--update-keys).
    #[arg(long, value_name = "FILE", conflicts_with = "dev_keys")]
    pub key: Option<std::path::PathBuf>,
    /// Sign with this machine's development key pair ($CHRYSALIS_CACHE/keys/update-signing.key,
    /// generated on first use): only images built with --dev-keys accept it.
    #[arg(long)]
    pub dev_keys: bool,
    /// The bundle's security_version. From an image directory: the image's own (baked into its
    /// root; a different N is refused). With --root/--kernel/--verity-json: default the number
    /// in rootfs/security-version.
    #[arg(long, value_name = "N")]
    pub security_version: Option<u64>,
    /// Where to write the bundle. Default:
    /// $CHRYSALIS_CACHE/bundles/chrysalis-<board>-<version>[-x<hash>].chrysalis-bundle.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Kernel arguments appended to the board's (signed into the manifest), e.g.
    /// `chrysalis.fault=never-healthy` for a bundle that must roll back.
    #[arg(long, allow_hyphen_values = true)]
    pub cmdline_extra: Option<String>,
    /// The version (default: the image's). With --root/--kernel/--verity-json: required.
    #[arg(long)]
    pub version: Option<String>,
    /// Without a built image: the root image (erofs + dm-verity hash tree).
    #[arg(long)]
    pub root: Option<std::path::PathBuf>,
    /// Without a built image: the kernel (EFI-stub bzImage).
    #[arg(long)]
    pub kernel: Option<std::path::PathBuf>,
    /// Without a built image: `{"root_hash","salt","data_blocks","hash_offset"}` of the root.
    #[arg(long)]
    pub verity_json: Option<std::path::PathBuf>,
    /// Without a built image: the build id (default: the version).
    #[arg(long)]
    pub build_id: Option<String>,
}

#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// The signing key file to create (its public half goes to FILE.pub).
    #[arg(long, value_name = "FILE")]
    pub out: std::path::PathBuf,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The board to build and boot.
    #[arg(long, default_value = "qemu-x86_64")]
    pub board: String,
    /// Host port forwarded to sandboxd (7777 in the appliance), on 127.0.0.1.
    #[arg(long, default_value_t = 7777)]
    pub sandboxd_port: u16,
    /// Host port forwarded to the supervisor API (7780 in the appliance), on 127.0.0.1.
    #[arg(long, default_value_t = 7780)]
    pub api_port: u16,
    /// A directory whose files go onto a config disk (vfat, label CHRYSALIS), e.g. a
    /// config.toml. Default: a generated one enabling the remote API with a fresh token.
    #[arg(long)]
    pub config_dir: Option<std::path::PathBuf>,
    /// Keep the VM's state (qcow2 overlay, OVMF vars) between runs instead of a fresh disk.
    #[arg(long)]
    pub keep: bool,
    /// Make the host's 127.0.0.1:PORT reachable in the appliance as 10.0.2.100:PORT (e.g. the
    /// test cluster's API server, `cargo xtask cluster up`: 16443).
    #[arg(long, value_name = "PORT")]
    pub guest_forward: Option<u16>,
}

#[derive(Debug, Args)]
pub struct VmImageArgs {
    /// Template or alias to build (`base`, `rt`, `ghcr.io/cocoonstack/sandbox/rt:24.04`, ...).
    /// With `--all`, every template of the catalog.
    #[arg(required_unless_present = "all")]
    pub template: Option<String>,
    /// Build every template in vm-images/catalog.toml.
    #[arg(long)]
    pub all: bool,
    /// Rebuild even when a cached image for the same inputs exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct TestArgs {
    /// Only run tests whose name contains this string (the fuzz run still happens).
    pub filter: Option<String>,
    /// Skip the bounded fuzz run.
    #[arg(long)]
    pub no_fuzz: bool,
    /// How long the bounded fuzz run lasts.
    #[arg(long, default_value_t = 30)]
    pub fuzz_seconds: u64,
}

#[derive(Debug, Args)]
pub struct FuzzArgs {
    /// How long to fuzz, in seconds.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
}

#[derive(Debug, Subcommand)]
pub enum VmCmd {
    /// Boot one VM from a template, run a command in it through silkd (or open an
    /// interactive shell over a pty when no command is given), then shut it down.
    /// Exits with the command's exit code.
    Run(VmRunArgs),
}

#[derive(Debug, Args)]
pub struct VmRunArgs {
    /// Template or alias to boot (`base`, `rt`, `ghcr.io/cocoonstack/sandbox/rt:24.04`, …).
    #[arg(default_value = "base")]
    pub template: String,
    /// Size class: small (1 vCPU/512M), medium (2/1G), large (4/4G), xlarge (4/8G), 2xlarge (8/16G).
    #[arg(long, default_value = "small")]
    pub size: String,
    /// Feed this process's stdin to the command.
    #[arg(long)]
    pub stdin: bool,
    /// The command to run in the guest (after `--`).
    #[arg(last = true)]
    pub cmd: Vec<String>,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which benchmarks: `vm` (boot, clone, agent RPC, fs_pull, QEMU RSS, boot and clone with the
    /// jail on and off, a VM cgroup leaf's kernel memory), `sandboxd`
    /// (claim latency, claims/s, refill rate, sandboxd RSS), `vnode` (Sandbox → Pod Running
    /// through the real control plane and the vk-sandbox node; `kubectl exec -- true` beside the
    /// SDK's exec, `kubectl port-forward` throughput; a burst of Sandboxes), `cocoon`
    /// (a Pod bound to the vk-cocoon node → Running, `run` and `clone`), `appliance` (the host
    /// image's size, power-on → supervisor ready → nodes Ready, idle RSS of the supervisor and
    /// its services; builds and boots the host image), `branch` (fork of 4, checkpoint, claim
    /// from a checkpoint, with the real sandboxd and `rt` VMs), `density` (PSS and host CPU per
    /// idle warm VM, warm VMs that fit in 8 GiB, claim latency with paused warm VMs and the
    /// resume alone), or `all`.
    #[arg(value_enum, default_value = "all")]
    pub what: BenchWhat,
    /// Claims held when sandboxd's RSS is measured.
    #[arg(long, default_value_t = 32)]
    pub rss_claims: u64,
    /// Boots (and clones) per template to take the median of.
    #[arg(long, default_value_t = 3)]
    pub boots: usize,
    /// Agent RPC round trips to time.
    #[arg(long, default_value_t = 2000)]
    pub rpcs: usize,
    /// Size of the file `fs_pull` streams, in MiB.
    #[arg(long, default_value_t = 64)]
    pub pull_mib: u64,
    /// `cocoon`: Pods per mode (run, clone) to take the median of.
    #[arg(long, default_value_t = 3)]
    pub cocoon_pods: usize,
    /// `vnode`: Sandboxes created one after another to time Sandbox → Pod Running.
    #[arg(long, default_value_t = 30)]
    pub sandboxes: usize,
    /// `vnode`: Sandboxes created at once for the burst figure (the warm pool is sized to it;
    /// lowered, and said so, when the machine lacks the memory for that many idle VMs).
    #[arg(long, default_value_t = 100)]
    pub burst: usize,
    /// `vnode`: `kubectl exec -- true` round trips (and as many through the SDK) to take the
    /// median of.
    #[arg(long, default_value_t = 50)]
    pub execs: usize,
    /// `branch`: forks, checkpoints and claims from a checkpoint to take the median of.
    #[arg(long, default_value_t = 5)]
    pub branch_runs: usize,
    /// `density`: warm `base` VMs in the pool whose memory and CPU are measured.
    #[arg(long, default_value_t = 20)]
    pub density_vms: u64,
    /// `density`: claims timed against the paused warm VMs.
    #[arg(long, default_value_t = 10)]
    pub density_claims: u64,
    /// `appliance`: the board whose image is measured.
    #[arg(long, default_value = "qemu-x86_64")]
    pub board: String,
    /// `appliance`: seconds the healthy box idles before its RSS is read.
    #[arg(long, default_value_t = 30)]
    pub idle_secs: u64,
}

#[derive(Debug, Args)]
pub struct SandboxdArgs {
    /// Listen address. The default is loopback, where sandboxd runs open (no token) for
    /// development; any other address needs `api_token_file` in the config (sandboxd refuses
    /// to start otherwise and says how to fix it).
    #[arg(long, default_value = "127.0.0.1:7777")]
    pub listen: String,
    /// Config file (default: appliance/sandboxd/examples/standalone.json).
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Data directory: claims journal, pools.json, golden snapshots, VM state
    /// (default: $CHRYSALIS_CACHE/sandboxd).
    #[arg(long)]
    pub data_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum BenchWhat {
    All,
    Density,
    Vm,
    Sandboxd,
    Vnode,
    Cocoon,
    Appliance,
    Branch,
}

#[derive(Debug, Subcommand)]
pub enum ClusterCmd {
    /// Build (cached) and start the cluster, or find it running; print the endpoint, admin
    /// kubeconfig, bootstrap token and CA public-key hash.
    Up(ClusterArgs),
    /// Stop everything `up` started.
    Down(ClusterArgs),
    /// What runs, the endpoint, and whether the apiserver is ready.
    Status(ClusterArgs),
    /// Run the pinned kubectl as the cluster admin: `cargo xtask cluster kubectl -- get nodes`.
    Kubectl(KubectlArgs),
}

#[derive(Debug, Args)]
pub struct KubectlArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// kubectl's arguments (after `--`).
    #[arg(last = true)]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct VkSandboxArgs {
    /// The virtual node's name.
    #[arg(long, default_value = "vk-sandboxd")]
    pub node_name: String,
    /// The kubelet HTTPS port of the virtual node.
    #[arg(long, default_value_t = 10260)]
    pub kubelet_port: u16,
    /// Where sandboxd listens.
    #[arg(long, default_value = "127.0.0.1:7777")]
    pub sandboxd_listen: String,
    /// The cluster's apiserver port (as given to `cargo xtask cluster up --port`).
    #[arg(long, env = "CHRYSALIS_CLUSTER_PORT", default_value_t = test_infra::cluster::DEFAULT_PORT)]
    pub port: u16,
}

#[derive(Debug, Args)]
pub struct VkCocoonArgs {
    /// The virtual node's name.
    #[arg(long, default_value = "cocoon-pool")]
    pub node_name: String,
    /// The kubelet HTTPS port of the virtual node.
    #[arg(long, default_value_t = 10250)]
    pub kubelet_port: u16,
    /// The cluster's apiserver port (as given to `cargo xtask cluster up --port`).
    #[arg(long, env = "CHRYSALIS_CLUSTER_PORT", default_value_t = test_infra::cluster::DEFAULT_PORT)]
    pub port: u16,
}

#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// The apiserver port on 127.0.0.1; etcd, controller-manager, scheduler and the
    /// agent-sandbox controller take the next six.
    #[arg(long, env = "CHRYSALIS_CLUSTER_PORT", default_value_t = 16443)]
    pub port: u16,
}

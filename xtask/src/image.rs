//! `cargo xtask image --board <board>`: the flashable A/B host image.
//!
//! Inputs: `boards/<board>/board.toml` ([`board`]), `rootfs/` (Debian package list, overlay,
//! kernel base fragment, `security-version`), our release binaries, the guest VM images and the
//! trusted update keys, named explicitly (`--update-keys DIR` or `--dev-keys`; see
//! [`crate::keys`]).
//! Steps, each timed:
//! 1. the Debian base (mmdebstrap, cached tarball);
//! 2. the board's host kernel (Debian linux-source-6.1, EFI-stub `bzImage`, all built in);
//! 3. release binaries built for size (`--profile appliance`: chrysalis, sandboxd, vk-sandbox,
//!    vk-cocoon; glibc only);
//! 4. the shipped VM templates (`cargo xtask vm-image` machinery);
//! 5. systemd-boot (`systemd-bootx64.efi` from Debian's `systemd-boot-efi`, downloaded, not
//!    installed), then the root tree ([`tree`], cached);
//! 6. the version files, erofs + dm-verity, the ESP and the GPT disk ([`assemble`]).
//!
//! Outputs in `$CHRYSALIS_CACHE/appliance/<board>/<key>/` (`current` links the last one):
//! `disk.raw` (the flashable disk), `root.img` (erofs + hash tree, for bundles), `vmlinuz`,
//! `manifest.json` ([`Manifest`]: sizes, sha256s, verity parameters, `security_version`,
//! trusted keys, layout, packages) and `update-keys/` (a copy of the public keys the root
//! trusts: `cargo xtask bundle` checks its signature against them).
//! Everything is rootless (no loop devices, no mounts) and reproducible: timestamps from
//! `SOURCE_DATE_EPOCH` (git commit time unless set), ids from seeds.

pub mod assemble;
pub mod board;
mod tree;

use crate::{flags, guest_kernel, keys, paths, prereqs, vm_image};
use anyhow::{bail, Context, Result};
use assemble::{EspFile, Layout, RootImage, Seed};
use keys::UpdateKeys;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Bump when the image layout produced here changes.
const IMAGE_FORMAT: &str = "chrysalis-host-image-v1";
/// The binaries the image runs, as (cargo package, binary).
const BINARIES: &[(&str, &str)] =
    &[("chrysalis", "chrysalis"), ("sandboxd", "sandboxd"), ("vk-sandbox", "vk-sandbox"), ("vk-cocoon", "vk-cocoon")];
/// Built images kept per board (older ones are deleted; upgrade tests need two versions).
const KEEP_BUILDS: usize = 4;
/// Takes the binaries from this directory instead of building them (stand-ins, custom builds).
const PREBUILT_ENV: &str = "CHRYSALIS_IMAGE_BINS";
/// Overrides the image's SOURCE_DATE_EPOCH (default: the git commit time).
const EPOCH_ENV: &str = "SOURCE_DATE_EPOCH";
/// The repository's security_version (`--security-version` overrides it).
pub const SECURITY_VERSION_FILE: &str = "rootfs/security-version";
/// Where a built image keeps a copy of the public keys its root trusts.
pub const UPDATE_KEYS_DIR: &str = "update-keys";

/// `manifest.json` of a built image (`cargo xtask bundle` reads it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub board: String,
    /// `chrysalis-<board>`: bundles must name the same.
    pub compatible: String,
    pub version: String,
    pub build_id: String,
    /// The anti-rollback level baked into the root (`image.json`) and the slot-A entry;
    /// bundles of this image carry it.
    pub security_version: u64,
    /// The public keys the root trusts: file name → hex key.
    pub update_keys: BTreeMap<String, String>,
    pub source_date_epoch: u64,
    pub disk: FileInfo,
    pub kernel: FileInfo,
    pub root: RootImage,
    /// The board's part of the kernel command line.
    pub cmdline: String,
    /// The full command line of the slot-A entry of the fresh disk.
    pub slot_a_cmdline: String,
    pub layout: Layout,
    pub systemd_boot: Package,
    /// Debian packages of the root (the SBOM), sorted by name.
    pub packages: Vec<Package>,
    /// Our binaries in /usr/bin: name → sha256 of the installed (stripped) file.
    pub binaries: BTreeMap<String, String>,
    /// Shipped VM templates: name → digest.
    pub vm_templates: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileInfo {
    pub sha256: String,
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Package {
    pub name: String,
    pub version: String,
}

/// A built image.
#[derive(Debug, Clone)]
// `cargo xtask bundle` takes root.img and vmlinuz from here.
#[allow(dead_code)]
pub struct Built {
    pub dir: PathBuf,
    pub disk: PathBuf,
    pub root_img: PathBuf,
    pub vmlinuz: PathBuf,
    pub manifest: Manifest,
}

pub fn run(args: &flags::ImageArgs) -> Result<()> {
    if args.kernel_only {
        let root = paths::project_root();
        let board = board::Board::load(&root, &args.board)?;
        let kernel = host_kernel(&args.board, &board, args.force)?;
        println!("{}", kernel.display());
        return Ok(());
    }
    let keys = keys::update_keys(args.update_keys.as_deref(), args.dev_keys, "cargo xtask image")?;
    let built = build(&BuildOptions {
        board: &args.board,
        version: args.version.as_deref(),
        security_version: args.security_version,
        keys: &keys,
        force: args.force,
        cloud_hypervisor: args.cloud_hypervisor.as_deref(),
    })?;
    println!("{}", built.disk.display());
    Ok(())
}

/// What [`build`] builds.
#[derive(Debug, Clone)]
pub struct BuildOptions<'a> {
    /// The board (a folder of `boards/`).
    pub board: &'a str,
    /// The version (default: workspace version + git).
    pub version: Option<&'a str>,
    /// The security_version (default: [`repository_security_version`]).
    pub security_version: Option<u64>,
    /// The public keys the image trusts.
    pub keys: &'a UpdateKeys,
    /// Rebuild cached steps.
    pub force: bool,
    /// A cloud-hypervisor binary to ship as `/usr/bin/cloud-hypervisor`.
    pub cloud_hypervisor: Option<&'a Path>,
}

impl<'a> BuildOptions<'a> {
    /// The board's default image trusting this machine's dev keys (`cargo xtask run`, `test`,
    /// `bench appliance`: development only).
    pub fn dev(board: &'a str) -> BuildOptions<'a> {
        BuildOptions {
            board,
            version: None,
            security_version: None,
            keys: &UpdateKeys::Dev,
            force: false,
            cloud_hypervisor: None,
        }
    }
}

/// The security_version kept in the repository (`rootfs/security-version`: one number; `#`
/// comments and blank lines ignored).
pub fn repository_security_version() -> Result<u64> {
    let path = paths::project_root().join(SECURITY_VERSION_FILE);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    parse_security_version(&text).with_context(|| format!("{}", path.display()))
}

fn parse_security_version(text: &str) -> Result<u64> {
    let mut numbers = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
    let (Some(first), None) = (numbers.next(), numbers.next()) else {
        bail!("expected exactly one number (the security_version) besides # comments");
    };
    first.parse().with_context(|| format!("{first:?} is not a non-negative integer"))
}

/// Builds (or finds) the image described by `o`.
pub fn build(o: &BuildOptions<'_>) -> Result<Built> {
    let (board_name, version, force) = (o.board, o.version, o.force);
    let started = Instant::now();
    let root = paths::project_root();
    let board = board::Board::load(&root, board_name)?;
    let host = board::HostOs::load(&root)?;
    prereqs::ensure_apt(&[
        "mmdebstrap",
        "erofs-utils",
        "cryptsetup-bin",
        "dosfstools",
        "mtools",
        "fdisk",
        "binutils",
        "qemu-utils",
    ])?;
    let version = match version {
        Some(v) => v.to_string(),
        None => default_version(),
    };
    if version.is_empty()
        || version.len() > 64
        || !version.chars().all(|c| c.is_ascii_alphanumeric() || "._+~-".contains(c))
    {
        bail!("--version {version:?}: use at most 64 letters, digits and `._+~-`");
    }
    let security_version = match o.security_version {
        Some(v) => v,
        None => repository_security_version()?,
    };
    let update_keys = keys::public_keys(o.keys)?;
    let epoch = source_date_epoch()?;
    eprintln!(
        "image: board {board_name} ({}), version {version}, security_version {security_version}, SOURCE_DATE_EPOCH {epoch}",
        board.description
    );
    match o.keys {
        UpdateKeys::Dev => eprintln!(
            "image: trusting this machine's DEV update key ({}): for development and tests only",
            keys::dev_key_path().display()
        ),
        UpdateKeys::Dir(dir) => eprintln!(
            "image: trusting the update keys of {}: {}",
            dir.display(),
            update_keys.iter().map(|k| k.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    }

    let (tarball, tarball_key) = step("[1/6] Debian base (mmdebstrap)", || tree::debootstrap(&host, &board, force))?;
    let kernel = step("[2/6] host kernel", || host_kernel(board_name, &board, force))?;
    let mut binaries = step("[3/6] release binaries", build_binaries)?;
    if let Some(ch) = o.cloud_hypervisor {
        check_cloud_hypervisor(ch)?;
        eprintln!("image: shipping {} as /usr/bin/{CLOUD_HYPERVISOR}", ch.display());
        binaries.insert(CLOUD_HYPERVISOR.into(), ch.to_path_buf());
    }
    let templates = step("[4/6] VM images", || vm_templates(&board))?;
    let sdboot = step("[5/6] systemd-boot", systemd_boot)?;

    let board_dir = paths::cache_dir().join("appliance").join(board_name);
    fs::create_dir_all(&board_dir)?;
    let _lock = paths::lock_file(&board_dir.join(".lock"))?;
    let inputs =
        tree::TreeInputs { board: &board, binaries: &binaries, templates: &templates, update_keys: &update_keys };
    let tree = step("[5/6] root tree", || {
        tree::prepare(&board_dir, &tarball, &tarball_key, &root.join("rootfs/overlay"), &inputs)
    })?;

    let board_toml = fs::read(root.join("boards").join(board_name).join("board.toml"))?;
    let build_id = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for part in [
            IMAGE_FORMAT.as_bytes(),
            tree.key.as_bytes(),
            version.as_bytes(),
            format!("security_version {security_version}").as_bytes(),
            epoch.to_string().as_bytes(),
            assemble::file_sha256(&kernel)?.as_bytes(),
            sdboot.sha256.as_bytes(),
            &board_toml,
        ] {
            h.update(part);
            h.update(b"\n");
        }
        hex::encode(h.finalize())[..16].to_string()
    };
    let out = board_dir.join(&build_id);
    if !force {
        if let Ok(m) = fs::read(out.join("manifest.json"))
            .map_err(anyhow::Error::from)
            .and_then(|b| serde_json::from_slice::<Manifest>(&b).map_err(anyhow::Error::from))
        {
            set_current(&board_dir, &build_id)?;
            eprintln!("image: cached {}", out.display());
            let built = built_at(&out, m);
            report(&built);
            return Ok(built);
        }
    }

    let tmp = board_dir.join(format!(".{build_id}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let seed = Seed::new(board_name);
    let layout = Layout::new(&seed, board.partitions.esp_mib, board.partitions.root_mib, board.partitions.state_mib);

    tree::stamp_version(&tree, board_name, &version, &build_id, security_version)?;
    let root_img = tmp.join("root.img");
    let root_image = step("[6/6] erofs + dm-verity root", || assemble::make_root(&tree.root, &root_img, epoch, &seed))?;
    let slot_bytes = board.partitions.root_mib * 1024 * 1024;
    if root_image.size * 2 > slot_bytes {
        bail!(
            "the root image is {} MiB but a root slot is {} MiB: slots must hold twice the image \
             (raise partitions.root_mib in boards/{board_name}/board.toml to at least {})",
            root_image.size >> 20,
            board.partitions.root_mib,
            (root_image.size * 2).div_ceil(1024 * 1024)
        );
    }

    // The boot entry comes from the update crate, so a fresh image and an update write the
    // same command line and entry format.
    let kernel_info = FileInfo { sha256: assemble::file_sha256(&kernel)?, size: fs::metadata(&kernel)?.len() };
    let bundle_manifest = update::manifest::Manifest {
        format: update::manifest::FORMAT,
        compatible: update::manifest::Manifest::compatible_for_board(board_name),
        version: version.clone(),
        build_id: build_id.clone(),
        security_version,
        kernel: update::manifest::Blob { sha256: kernel_info.sha256.clone(), size: kernel_info.size },
        root: update::manifest::RootImage {
            sha256: root_image.sha256.clone(),
            size: root_image.size,
            verity: update::manifest::Verity {
                root_hash: root_image.verity.root_hash.clone(),
                salt: root_image.verity.salt.clone(),
                data_blocks: root_image.verity.data_blocks,
                hash_offset: root_image.verity.hash_offset,
            },
        },
        cmdline: board.kernel.cmdline.clone(),
    };
    bundle_manifest.validate().context("the image's manifest would not make a valid bundle")?;
    let partuuid = &layout.partition(assemble::LABEL_ROOT_A).context("layout has root A")?.uuid;
    let cmdline = update::slot_cmdline(update::Slot::A, partuuid, 1, &bundle_manifest);
    let entry = update::entries::BootEntry::for_slot(update::Slot::A, &version, 1, &cmdline).render();
    let entry_name = update::entries::EntryName::plain(update::Slot::A).file_name();
    let vmlinuz = tmp.join("vmlinuz");
    fs::copy(&kernel, &vmlinuz)?;
    let staging = tmp.join("esp-files");
    fs::create_dir_all(&staging)?;
    fs::write(staging.join("loader.conf"), assemble::LOADER_CONF)?;
    fs::write(staging.join(&entry_name), entry)?;
    let files = [
        EspFile { path: "EFI/BOOT/BOOTX64.EFI".into(), source: sdboot.efi.clone() },
        EspFile { path: "loader/loader.conf".into(), source: staging.join("loader.conf") },
        EspFile { path: format!("loader/entries/{entry_name}"), source: staging.join(&entry_name) },
        EspFile {
            path: update::entries::kernel_loader_path(update::Slot::A)[1..].to_string(),
            source: vmlinuz.clone(),
        },
    ];
    let esp_img = tmp.join("esp.img");
    step("[6/6] ESP (FAT32, systemd-boot)", || {
        assemble::make_esp(&esp_img, board.partitions.esp_mib, &files, epoch, &seed, &tmp)
    })?;
    let disk = tmp.join("disk.raw");
    step("[6/6] GPT disk", || {
        assemble::make_disk(&disk, &layout, &[(assemble::LABEL_ESP, &esp_img), (assemble::LABEL_ROOT_A, &root_img)])
    })?;
    fs::remove_file(&esp_img)?;
    let _ = fs::remove_dir_all(&staging);

    let mut installed = BTreeMap::new();
    for name in binaries.keys() {
        installed.insert(name.clone(), assemble::file_sha256(&tree.root.join("usr/bin").join(name))?);
    }
    let manifest = Manifest {
        format: 1,
        board: board_name.to_string(),
        compatible: format!("chrysalis-{board_name}"),
        version: version.clone(),
        build_id: build_id.clone(),
        security_version,
        update_keys: update_keys.iter().map(|k| (k.name.clone(), k.text.trim().to_string())).collect(),
        source_date_epoch: epoch,
        disk: FileInfo { sha256: assemble::file_sha256(&disk)?, size: fs::metadata(&disk)?.len() },
        kernel: kernel_info,
        root: root_image,
        cmdline: board.kernel.cmdline.clone(),
        slot_a_cmdline: cmdline,
        layout,
        systemd_boot: Package { name: "systemd-boot-efi".into(), version: sdboot.version.clone() },
        packages: tree.packages.iter().map(|(n, v)| Package { name: n.clone(), version: v.clone() }).collect(),
        binaries: installed,
        vm_templates: templates.iter().map(|(n, t)| (n.clone(), t.digest.clone())).collect(),
    };
    let keys_copy = tmp.join(UPDATE_KEYS_DIR);
    fs::create_dir_all(&keys_copy)?;
    for key in &update_keys {
        foundation::write_atomic(&keys_copy.join(&key.name), key.text.as_bytes(), foundation::PUBLIC_FILE)?;
    }
    fs::write(tmp.join("manifest.json"), format!("{}\n", serde_json::to_string_pretty(&manifest)?))?;
    let _ = fs::remove_dir_all(&out);
    fs::rename(&tmp, &out).with_context(|| format!("installing {}", out.display()))?;
    set_current(&board_dir, &build_id)?;
    prune(&board_dir, KEEP_BUILDS)?;
    let built = built_at(&out, manifest);
    eprintln!("image: built {} in {}s", out.display(), started.elapsed().as_secs());
    report(&built);
    Ok(built)
}

fn built_at(dir: &Path, manifest: Manifest) -> Built {
    Built {
        dir: dir.to_path_buf(),
        disk: dir.join("disk.raw"),
        root_img: dir.join("root.img"),
        vmlinuz: dir.join("vmlinuz"),
        manifest,
    }
}

/// Bytes a (sparse) file occupies on disk; 0 when it cannot be read.
pub fn allocated_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// Prints the sizes the issue asks for.
fn report(b: &Built) {
    let m = &b.manifest;
    eprintln!(
        "image: disk.raw {} MiB ({} MiB allocated; ESP {} MiB, 2 root slots of {} MiB, state {} MiB)",
        m.disk.size >> 20,
        allocated_bytes(&b.disk) >> 20,
        m.layout.partitions[0].size >> 20,
        m.layout.partitions[1].size >> 20,
        m.layout.partitions[3].size >> 20
    );
    eprintln!(
        "image: version {}, security_version {}, trusted update keys: {}",
        m.version,
        m.security_version,
        m.update_keys.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    eprintln!(
        "image: root.img {:.1} MiB (erofs {:.1} MiB + verity), kernel {:.1} MiB, {} Debian packages",
        m.root.size as f64 / 1048576.0,
        m.root.verity.hash_offset as f64 / 1048576.0,
        m.kernel.size as f64 / 1048576.0,
        m.packages.len()
    );
    eprintln!("image: {} (+ root.img, vmlinuz, manifest.json)", b.dir.display());
}

/// Runs one timed step, with a spinner on a terminal.
fn step<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    eprintln!("image: {what} ...");
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        // Visible only between the step's own messages: it ticks the elapsed time.
        spinner.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        spinner.set_style(
            indicatif::ProgressStyle::with_template("  {spinner} {msg} {elapsed}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        spinner.set_message(what.to_string());
        spinner.enable_steady_tick(Duration::from_millis(200));
    }
    let result = f();
    spinner.finish_and_clear();
    match &result {
        Ok(_) => eprintln!("image: {what} done ({:.1}s)", started.elapsed().as_secs_f64()),
        Err(_) => eprintln!("image: {what} FAILED after {:.1}s", started.elapsed().as_secs_f64()),
    }
    result
}

/// The board's kernel: its fragments on tinyconfig, an EFI-stub bzImage.
fn host_kernel(board_name: &str, board: &board::Board, force: bool) -> Result<PathBuf> {
    let spec = guest_kernel::KernelSpec {
        label: format!("image: host kernel ({board_name})"),
        fragments: board.kernel.fragments.clone(),
        target: guest_kernel::KernelTarget::BzImage,
        current_link: format!("host-{board_name}"),
    };
    guest_kernel::build(&spec, force)
}

/// `cargo build --profile appliance` of our binaries (or `$CHRYSALIS_IMAGE_BINS`): release
/// optimised for size (LTO, one codegen unit, stripped), since a process's resident memory is
/// mostly its binary's mapped text.
/// The name cloud-hypervisor is shipped under (`/usr/bin`), where the `auto` hypervisor
/// choice looks for it (`PATH`).
const CLOUD_HYPERVISOR: &str = "cloud-hypervisor";

/// Checks that `path` is a regular executable ELF file before it goes into an image.
fn check_cloud_hypervisor(path: &Path) -> Result<()> {
    use std::io::Read as _;
    use std::os::unix::fs::PermissionsExt as _;
    let what = || format!("--cloud-hypervisor {}", path.display());
    let meta = fs::metadata(path).with_context(what)?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        bail!("{}: not an executable file (chmod +x a static cloud-hypervisor build)", what());
    }
    let mut magic = [0u8; 4];
    fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).with_context(what)?;
    if &magic != b"\x7fELF" {
        bail!("{}: not an ELF binary (expected a static x86_64 cloud-hypervisor build)", what());
    }
    Ok(())
}

fn build_binaries() -> Result<BTreeMap<String, PathBuf>> {
    let dir = match std::env::var_os(PREBUILT_ENV) {
        Some(dir) => {
            eprintln!("image: WARNING: taking the binaries from ${PREBUILT_ENV}={}", Path::new(&dir).display());
            PathBuf::from(dir)
        }
        None => {
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cmd.args(["build", "--profile", "appliance"]);
            for (package, _) in BINARIES {
                cmd.args(["-p", package]);
            }
            eprintln!("image: {cmd:?}");
            let status = cmd.status().context("running cargo build")?;
            if !status.success() {
                bail!(
                    "building the appliance binaries failed ({status}); set {PREBUILT_ENV}=<dir> to use prebuilt ones"
                );
            }
            paths::target_dir().join("appliance")
        }
    };
    let mut out = BTreeMap::new();
    for (_, bin) in BINARIES {
        let path = dir.join(bin);
        if !path.is_file() {
            bail!("{} is missing", path.display());
        }
        out.insert(bin.to_string(), path);
    }
    Ok(out)
}

/// Builds the board's VM templates and returns their catalog entries.
fn vm_templates(board: &board::Board) -> Result<BTreeMap<String, vm_image::catalog::BuiltTemplate>> {
    for t in &board.vm_images.templates {
        vm_image::run(&flags::VmImageArgs { template: Some(t.clone()), all: false, force: false })?;
    }
    let path = paths::cache_dir().join("images/catalog.json");
    let catalog: vm_image::catalog::BuiltCatalog =
        serde_json::from_slice(&fs::read(&path).with_context(|| format!("reading {}", path.display()))?)
            .with_context(|| format!("parsing {}", path.display()))?;
    let mut out = BTreeMap::new();
    for t in &board.vm_images.templates {
        let built = catalog.templates.get(t).with_context(|| format!("{} has no template {t}", path.display()))?;
        out.insert(t.clone(), built.clone());
    }
    Ok(out)
}

/// systemd-boot's EFI binary.
struct SystemdBoot {
    efi: PathBuf,
    version: String,
    sha256: String,
}

/// `systemd-bootx64.efi` from the `systemd-boot-efi` package of the host's apt sources:
/// `apt-get download` + `dpkg-deb -x` (nothing installed), cached per package version.
fn systemd_boot() -> Result<SystemdBoot> {
    const PKG: &str = "systemd-boot-efi";
    let candidate = || -> Result<String> {
        let out = Command::new("apt-cache").args(["policy", PKG]).output().context("running apt-cache")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.trim().strip_prefix("Candidate:").map(|v| v.trim().to_string()))
            .filter(|v| v != "(none)")
            .unwrap_or_default())
    };
    let mut version = candidate()?;
    if version.is_empty() {
        let status = Command::new("apt-get").args(["update", "-q"]).status().context("running apt-get update")?;
        if !status.success() {
            bail!("apt-get update failed ({status})");
        }
        version = candidate()?;
        if version.is_empty() {
            bail!("apt knows no {PKG} package (is a Debian bookworm source configured?)");
        }
    }
    let dir = paths::cache_dir().join("appliance/systemd-boot").join(version.replace([':', '/'], "_"));
    let efi = dir.join("systemd-bootx64.efi");
    if !efi.is_file() {
        let work = dir.join("download");
        let _ = fs::remove_dir_all(&work);
        fs::create_dir_all(&work)?;
        let status = Command::new("apt-get")
            .args(["download", "-q", &format!("{PKG}={version}")])
            .current_dir(&work)
            .status()
            .context("running apt-get download")?;
        if !status.success() {
            bail!("apt-get download {PKG}={version} failed ({status})");
        }
        let deb = fs::read_dir(&work)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .context("apt-get download left no .deb")?;
        let x = work.join("x");
        let status = Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&x).status().context("running dpkg-deb")?;
        if !status.success() {
            bail!("dpkg-deb -x {} failed ({status})", deb.display());
        }
        fs::copy(x.join("usr/lib/systemd/boot/efi/systemd-bootx64.efi"), &efi)
            .context("the package has no usr/lib/systemd/boot/efi/systemd-bootx64.efi")?;
        let _ = fs::remove_dir_all(&work);
    }
    let sha256 = assemble::file_sha256(&efi)?;
    Ok(SystemdBoot { efi, version, sha256 })
}

/// `<workspace version>-g<commit>` (or `-dev` outside git).
fn default_version() -> String {
    let base = env!("CARGO_PKG_VERSION");
    let out = Command::new("git").args(["rev-parse", "--short=8", "HEAD"]).current_dir(paths::project_root()).output();
    match out {
        Ok(o) if o.status.success() => format!("{base}-g{}", String::from_utf8_lossy(&o.stdout).trim()),
        _ => format!("{base}-dev"),
    }
}

/// `$SOURCE_DATE_EPOCH`, else the commit time of HEAD.
fn source_date_epoch() -> Result<u64> {
    if let Ok(v) = std::env::var(EPOCH_ENV) {
        return v.trim().parse().with_context(|| format!("{EPOCH_ENV}={v:?} is not a number of seconds"));
    }
    let out = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(paths::project_root())
        .output()
        .context("running git log")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse().with_context(|| format!("no git commit time ({text:?}); set {EPOCH_ENV}"))
}

/// Deletes all but the `keep` most recent image directories of a board (by manifest mtime);
/// the `current` one always stays.
fn prune(board_dir: &Path, keep: usize) -> Result<()> {
    let current = fs::read_link(board_dir.join("current")).ok();
    let mut builds: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(board_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("manifest.json").is_file())
        .filter_map(|p| Some((fs::metadata(p.join("manifest.json")).ok()?.modified().ok()?, p)))
        .collect();
    builds.sort_by_key(|b| std::cmp::Reverse(b.0));
    for (_, dir) in builds.into_iter().skip(keep) {
        if current.as_deref().is_some_and(|c| dir.file_name() == Some(c.as_os_str())) {
            continue;
        }
        eprintln!("image: pruning the old build {}", dir.display());
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(())
}

/// Points `<board_dir>/current` at `key`.
fn set_current(board_dir: &Path, key: &str) -> Result<()> {
    let tmp = board_dir.join(".current.tmp");
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(key, &tmp)?;
    fs::rename(&tmp, board_dir.join("current"))?;
    Ok(())
}

/// The last image built for `board` (`$CHRYSALIS_CACHE/appliance/<board>/current`), if any.
#[allow(dead_code)] // `cargo xtask bundle` and the tests
pub fn current(board: &str) -> Option<Built> {
    let dir = paths::cache_dir().join("appliance").join(board).join("current");
    let manifest: Manifest = serde_json::from_slice(&fs::read(dir.join("manifest.json")).ok()?).ok()?;
    let dir = fs::canonicalize(&dir).ok()?;
    Some(built_at(&dir, manifest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_cmdline_sets_up_the_verity_root_the_image_writes() {
        let m = update::manifest::Manifest {
            format: update::manifest::FORMAT,
            compatible: "chrysalis-qemu-x86_64".into(),
            version: "1.2".into(),
            build_id: "b".into(),
            security_version: 4,
            kernel: update::manifest::Blob { sha256: "00".repeat(32), size: 1 },
            root: update::manifest::RootImage {
                sha256: "00".repeat(32),
                size: 10 * 4096 + 4096,
                verity: update::manifest::Verity {
                    root_hash: "ab".repeat(32),
                    salt: "cd".repeat(32),
                    data_blocks: 10,
                    hash_offset: 10 * 4096,
                },
            },
            cmdline: "console=ttyS0".into(),
        };
        let c = update::slot_cmdline(update::Slot::A, "u-1", 1, &m);
        let want = format!(
            "dm-mod.create=\"chrysalis-root,,,ro,0 80 verity 1 PARTUUID=u-1 PARTUUID=u-1 4096 4096 10 10 sha256 {} {}\"",
            "ab".repeat(32),
            "cd".repeat(32)
        );
        assert!(c.starts_with(&want), "{c}");
        assert!(c.contains(" root=/dev/dm-0 rootfstype=erofs ro chrysalis.slot=a chrysalis.version=1.2"), "{c}");
        assert!(c.contains(" chrysalis.generation=1 chrysalis.security_version=4 panic=10"), "{c}");
        assert!(c.ends_with("panic=10 console=ttyS0"), "{c}");
    }

    #[test]
    fn the_repository_security_version_is_one_number() {
        assert_eq!(parse_security_version("# comment\n\n 3 \n# more\n").expect("parse"), 3);
        assert!(parse_security_version("# nothing\n").is_err());
        assert!(parse_security_version("1\n2\n").is_err());
        assert!(parse_security_version("-1\n").is_err());
        let v = repository_security_version().expect("rootfs/security-version");
        assert!(v >= 1, "the repository's security_version is {v}");
    }

    /// The real root: packs the cached root tree of the last `cargo xtask image` twice and
    /// compares the bytes (the synthetic test in `assemble` covers ESP and GPT in seconds).
    #[test]
    #[cfg_attr(
        not(feature = "appliance-image"),
        ignore = "needs a built appliance image (cargo xtask image): feature xtask/appliance-image"
    )]
    fn cached_root_tree_packs_reproducibly() {
        let board = "qemu-x86_64";
        let board_dir = paths::cache_dir().join("appliance").join(board);
        let Some(built) = current(board) else {
            panic!("no image built yet (cargo xtask image)");
        };
        if let Some(tool) = assemble::missing_tool() {
            panic!("{tool} is not installed");
        }
        let _lock = paths::lock_file(&board_dir.join(".lock")).expect("board lock");
        let tree = fs::read_dir(&board_dir).expect("board dir").filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("tree-")) && p.join(".ready").is_file()
        });
        let Some(tree) = tree else {
            panic!("no cached tree in {}", board_dir.display());
        };
        let out = tempfile::tempdir().expect("tempdir");
        let seed = Seed::new(board);
        let epoch = built.manifest.source_date_epoch;
        let a = assemble::make_root(&tree.join("root"), &out.path().join("a.img"), epoch, &seed).expect("first");
        std::thread::sleep(Duration::from_millis(1100));
        let b = assemble::make_root(&tree.join("root"), &out.path().join("b.img"), epoch, &seed).expect("second");
        assert_eq!(a.sha256, b.sha256, "two packs of the same tree differ");
        assert_eq!(a.verity, b.verity);
    }

    #[test]
    fn only_an_executable_elf_is_shipped_as_cloud_hypervisor() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("ch.sh");
        fs::write(&script, "#!/bin/sh\n").expect("write");
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
        let e = check_cloud_hypervisor(&script).expect_err("a script").to_string();
        assert!(e.contains("not an ELF"), "{e}");
        let elf = dir.path().join("ch");
        fs::copy("/bin/true", &elf).expect("copy");
        fs::set_permissions(&elf, fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(check_cloud_hypervisor(&elf).expect_err("not executable").to_string().contains("chmod +x"));
        fs::set_permissions(&elf, fs::Permissions::from_mode(0o755)).expect("chmod");
        check_cloud_hypervisor(&elf).expect("an executable ELF");
        assert!(check_cloud_hypervisor(&dir.path().join("missing")).is_err());
    }
}

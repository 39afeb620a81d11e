//! `cargo xtask`: every build, run, test and bench entry point of Chrysalis.
//!
//! Layout follows rust-analyzer's xtask: `flags.rs` declares the CLI, one module per task,
//! `main` moves to the project root and dispatches. Build caches live outside the repository
//! (see [`paths`]) so a warm machine is fast and a fresh clone stays clean.

mod bench;
mod bench_appliance;
mod bench_branch;
mod bench_cocoon;
mod bench_density;
mod bench_jail;
mod bench_kubectl;
mod bench_sandboxd;
mod bench_vnode;
mod bundle;
mod cluster;
mod flags;
mod flash;
mod fuzz;
mod guest_kernel;
mod image;
mod keys;
mod paths;
mod prereqs;
mod python;
mod run_appliance;
mod sandboxd;
mod suites;
mod test;
mod vk_cocoon;
mod vk_sandbox;
mod vm_image;
mod vm_run;

use anyhow::Result;
use clap::Parser;

fn main() -> Result<()> {
    let flags = flags::Xtask::parse();
    // kube (bench, cluster clients) uses rustls: pick its ring provider once.
    let _ = rustls::crypto::ring::default_provider().install_default();
    std::env::set_current_dir(paths::project_root())?;
    match flags.cmd {
        flags::Cmd::Prereqs => prereqs::ensure_all(),
        flags::Cmd::GuestKernel(args) => guest_kernel::run(&args).map(|path| {
            println!("{}", path.display());
        }),
        flags::Cmd::VmImage(args) => vm_image::run(&args),
        flags::Cmd::Test(args) => test::run(&args),
        flags::Cmd::Fuzz(args) => fuzz::run(&args),
        flags::Cmd::Bench(args) => bench::run(&args),
        flags::Cmd::Sandboxd(args) => sandboxd::run(&args),
        flags::Cmd::Image(args) => image::run(&args).map(|_| ()),
        flags::Cmd::Flash(args) => flash::run(&args),
        flags::Cmd::Run(args) => run_appliance::run(&args),
        flags::Cmd::Bundle(args) => bundle::run(&args),
        flags::Cmd::Keygen(args) => keys::keygen(&args.out),
        flags::Cmd::Vm(flags::VmCmd::Run(args)) => vm_run::run(&args),
        flags::Cmd::Cluster(cmd) => cluster::run(&cmd),
        flags::Cmd::VkSandbox(args) => vk_sandbox::run(&args),
        flags::Cmd::VkCocoon(args) => vk_cocoon::run(&args),
    }
}

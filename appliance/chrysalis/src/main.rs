//! `chrysalis`: the host CLI. Today the local image library (`chrysalis image …`,
//! `chrysalis snapshot …`, on the `images` crate); the supervisor verbs (issue #6) join the
//! same [`flags::Command`] enum.
//!
//! Errors print as one chain (`chrysalis: a: b: c`) and exit with status 1; logs go to stderr
//! (`RUST_LOG`, default `warn`).

mod flags;
mod image;
mod output;
mod snapshot;

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use flags::{Cli, Command};

fn run(cli: Cli) -> Result<()> {
    let store = images::Store::open(&cli.store)
        .with_context(|| format!("opening the image library at {}", cli.store.display()))?;
    match cli.command {
        Command::Image(cmd) => image::run(&store, cmd),
        Command::Snapshot(cmd) => snapshot::run(&store, cmd),
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .try_init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chrysalis: {e:#}");
            ExitCode::from(1)
        }
    }
}

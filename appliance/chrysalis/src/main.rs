//! `chrysalis`: the host CLI. The appliance verbs (`run` = the supervisor, `status`, `logs`,
//! `token`, `update`, `reboot`, `config`, in [`appliance`] over the `supervisor` crate) and the local
//! image library (`chrysalis image …`, `chrysalis snapshot …`, on the `images` crate).
//!
//! Errors print as one chain (`chrysalis: a: b: c`) and exit with status 1; logs go to stderr
//! (`RUST_LOG`, default `warn`; `run` logs at `info`, JSON unless stderr is a terminal).

#![forbid(unsafe_code)]

mod appliance;
mod flags;
mod image;
mod output;
mod snapshot;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use flags::{Cli, Command};

fn library(root: &Path) -> Result<images::Store> {
    images::Store::open(root).with_context(|| format!("opening the image library at {}", root.display()))
}

fn run(cli: Cli) -> Result<ExitCode> {
    let Cli { store, command } = cli;
    match command {
        Command::Image(cmd) => image::run(&library(&store)?, cmd)?,
        Command::Snapshot(cmd) => snapshot::run(&library(&store)?, cmd)?,
        Command::Run(a) => appliance::run(a)?,
        Command::Status(a) => appliance::status(a)?,
        Command::Logs(a) => appliance::logs(a)?,
        Command::Update(cmd) => appliance::update(cmd)?,
        Command::Reboot(a) => appliance::reboot(a)?,
        Command::Token(cmd) => appliance::token(cmd)?,
        Command::Config(cmd) => return appliance::config(cmd),
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run(_)) {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_writer(std::io::stderr)
            .try_init();
    }
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("chrysalis: {e:#}");
            ExitCode::from(1)
        }
    }
}

//! `silkd [--listen vsock:2048|unix:/path|mux:auto ...]`: the guest agent binary. Without
//! `--listen` it serves the guest defaults (vsock when present, and the agent mux).

use clap::Parser;
use silkd::listen::{self, Listen};
use silkd::Agent;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(name = "silkd", version, about = "The Chrysalis guest agent")]
struct Flags {
    /// Where to listen (repeatable): vsock:<port>, unix:<path>, mux:auto or mux:<device>.
    #[arg(long = "listen", value_name = "SPEC")]
    listen: Vec<Listen>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SILKD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let flags = Flags::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(%err, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(flags))
}

async fn run(flags: Flags) -> ExitCode {
    let listens = if flags.listen.is_empty() { listen::guest_defaults() } else { flags.listen };
    if listens.is_empty() {
        tracing::error!("nothing to listen on: no /dev/vsock and no agent virtio port (use --listen)");
        return ExitCode::FAILURE;
    }
    let agent = Agent::new();
    agent.spawn_housekeeping();
    tracing::info!(version = env!("CARGO_PKG_VERSION"), listen = ?listens.iter().map(ToString::to_string).collect::<Vec<_>>(), "silkd starting");
    let mut tasks = tokio::task::JoinSet::new();
    for l in listens {
        let agent = agent.clone();
        tasks.spawn(async move {
            let what = l.to_string();
            let result = listen::run(l, agent).await;
            (what, result)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((what, Err(err))) => tracing::error!(listener = %what, %err, "listener stopped"),
            Ok((what, Ok(()))) => tracing::warn!(listener = %what, "listener ended"),
            Err(err) => tracing::error!(%err, "listener task failed"),
        }
    }
    tracing::error!("no listener left");
    ExitCode::FAILURE
}

//! `cargo xtask fuzz`: a bounded `cargo fuzz` run of the silkd frame decoder.
//!
//! cargo-fuzz needs nightly-only compiler flags; we run it on the stable toolchain with
//! `RUSTC_BOOTSTRAP=1` rather than requiring a second toolchain.

use crate::flags::FuzzArgs;
use anyhow::{bail, Context, Result};
use std::process::Command;

const FUZZ_DIR: &str = "appliance/wire/fuzz";

fn ensure_cargo_fuzz() -> Result<()> {
    let have = Command::new("cargo").args(["fuzz", "--version"]).output().map(|o| o.status.success()).unwrap_or(false);
    if have {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz (once)");
    let status = Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]).status()?;
    if !status.success() {
        bail!("cargo install cargo-fuzz failed");
    }
    Ok(())
}

pub fn run(args: &FuzzArgs) -> Result<()> {
    ensure_cargo_fuzz()?;
    let corpus = crate::paths::cache_dir().join("fuzz/decode");
    std::fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    // Seed the corpus with the fixture frames.
    for entry in std::fs::read_dir("appliance/wire/fixtures/v1")? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, corpus.join(name))?;
        }
    }
    eprintln!("xtask: fuzzing the wire decoder for {} s", args.seconds);
    let status = Command::new("cargo")
        .args(["fuzz", "run", "--fuzz-dir", FUZZ_DIR, "--target-dir"])
        .arg(crate::paths::cache_dir().join("fuzz-target"))
        .arg("decode")
        .arg(&corpus)
        .args(["--", &format!("-max_total_time={}", args.seconds), "-max_len=65536", "-rss_limit_mb=4096"])
        .env("RUSTC_BOOTSTRAP", "1")
        .status()
        .context("running cargo fuzz")?;
    if !status.success() {
        bail!("the decoder fuzz run found a failure (see the artifact path above)");
    }
    println!("fuzz: decoder ran {} s without a failure", args.seconds);
    Ok(())
}

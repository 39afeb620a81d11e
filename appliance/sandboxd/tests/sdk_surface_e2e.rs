#![cfg(feature = "e2e")]
//! The SDK's surface beyond the core verbs (issue #16), end to end: the real `sandboxd` binary,
//! real QEMU VMs, and the unmodified public SDK with its LangChain and OpenAI Agents adapters
//! (`tests/sdk/surface.py`), each with its default settings.
//!
//! One sandboxd with a `base` pool and an `rt` pool (the adapters' default `rt:24.04` is the
//! short name of the catalog's `ghcr.io/cocoonstack/sandbox/rt:24.04`, an alias of `rt`).
//!
//! Needs the built-image catalog, `qemu-system-x86_64` and `CHRYSALIS_PYTHON` (the SDK venv with
//! the adapters); `cargo xtask test` provides all three.

use std::path::Path;
use std::time::Duration;

use sandboxd_api::PoolConfig;
use test_infra::sandboxd::{Harness, TOKEN};

/// How long the surface script may take.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(900);

#[test]
fn sdk_surface_and_adapters_with_their_defaults() {
    let python = std::env::var_os("CHRYSALIS_PYTHON").unwrap_or_else(|| {
        panic!(
            "CHRYSALIS_PYTHON is unset: point it at a python with tests/python-requirements.txt installed \
             (cargo xtask test does)"
        )
    });
    let h = Harness::new(
        Path::new(env!("CARGO_BIN_EXE_sandboxd")),
        vec![PoolConfig::warm("base", 1), PoolConfig::warm("rt", 1)],
    );
    h.wait_full("base");
    h.wait_full("rt");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/surface.py");
    h.run_python(&python, &script, &[h.addr.clone(), TOKEN.to_string()], "surface", SCRIPT_TIMEOUT, "sdk surface ok");
    assert!(h.sandbox_ids().is_empty(), "claims left behind");
    h.finish();
}

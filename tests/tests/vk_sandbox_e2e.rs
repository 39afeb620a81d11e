//! vk-sandbox end to end (issue #4): the real control plane (`test_infra::cluster`), the
//! upstream agent-sandbox controller, a real `sandboxd` with QEMU VMs, and the real
//! `vk-sandbox` binary joined with the bootstrap token. Every scenario drives Kubernetes objects
//! with the pinned kubectl and checks both sides: the API (Pods, events, Nodes, Leases) and
//! sandboxd's own listing of claims.
//!
//! One environment (cluster + sandboxd + provider) serves every scenario, so this suite uses a
//! custom harness (libtest-mimic): scenarios are reported one by one as ordinary tests, run one
//! at a time, each in its own namespace, and the environment is torn down once at the end (no
//! daemon, QEMU or VM is left). Without the `cluster` and `e2e` features every scenario is
//! reported as ignored with the reason.
//!
//! Needs the binaries `sandboxd` and `vk-sandbox` built into the same target directory
//! (`cargo xtask test` builds them first), the built-image catalog and QEMU.
//!
//! The harness is `test_infra::suite`; the scenarios and their names are in `scenarios.rs`.

#[path = "vk_sandbox_e2e/scenarios.rs"]
mod scenarios;

fn main() -> std::process::ExitCode {
    test_infra::suite::main(&scenarios::SUITE)
}

//! vk-cocoon end to end (issue #5): the real control plane (`test_infra::cluster`), the
//! upstream agent-sandbox controller, and the real `vk-cocoon` binary joined with the bootstrap
//! token, booting and cloning real QEMU microVMs with a TAP and an address each — all of it in
//! a network namespace the suite creates (`vkc-e2e-<pid>`), so no VM packet leaves it. Every
//! scenario drives Kubernetes objects with the pinned kubectl and checks both sides: the API
//! (Pods, annotations, events) and the node (QEMU processes, vk-cocoon's VM records, leases,
//! the image library, TCP from inside the netns to a port served in the guest).
//!
//! One environment (cluster + netns + image library + provider) serves every scenario, so this
//! suite uses a custom harness (libtest-mimic): scenarios are reported one by one as ordinary
//! tests, run one at a time, each in its own namespace, and the environment is torn down once
//! at the end — provider stopped, cluster down, every QEMU killed, the netns deleted; anything
//! left fails the run. Without the `cluster` and `e2e` features every scenario is reported as
//! ignored with the reason.
//!
//! Needs the `vk-cocoon` binary built into the same target directory (`cargo build -p
//! vk-cocoon --bins`), the built-image catalog (`rt` and `base`), QEMU and root (netns, TAPs).
//!
//! The harness is `test_infra::suite`; the scenarios and their names are in `scenarios.rs`.

#[path = "vk_cocoon_e2e/scenarios.rs"]
mod scenarios;

fn main() -> std::process::ExitCode {
    test_infra::suite::main(&scenarios::SUITE)
}

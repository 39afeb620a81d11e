//! The appliance end to end (issue #6): the host image built by `cargo xtask image --board
//! qemu-x86_64`, booted by OVMF + systemd-boot in QEMU (`test_infra::appliance_vm`; TCG here, so
//! the box's own microVMs run under nested emulation: one `base` VM in the pool), joined to the
//! real control plane (`test_infra::cluster`, reached from the box as `10.0.2.100` through
//! QEMU's user networking; nothing leaves loopback), and upgraded with signed bundles made by
//! `cargo xtask bundle`: a good one, one whose supervisor never becomes healthy (the bundle's
//! boot entry carries `chrysalis.fault=never-healthy` and shortens its own trial deadline with
//! `chrysalis.set=update.health_deadline_secs=150`), a tampered copy, and a bundle of the first
//! version (one `security_version` lower), replayed once the upgrade is committed: a downgrade,
//! refused.
//!
//! Scenarios run in order on shared boxes (custom harness, like the other end-to-end suites)
//! and everything is torn down at the end. Without the `appliance` feature, or without
//! `CHRYSALIS_APPLIANCE_TEST_DIR` (set by `cargo xtask test` after building the image and the
//! bundles), every scenario is reported as ignored with the reason.

use libtest_mimic::{Arguments, Failed, Trial};

#[cfg(feature = "appliance")]
#[path = "appliance_e2e/scenarios.rs"]
mod scenarios;

/// Every scenario, in the order they run (the names `cargo test` filters on).
const SCENARIOS: &[&str] = &[
    "first_boot_joins_the_cluster_and_serves_the_seed_sandbox",
    "a_tampered_bundle_is_refused",
    "a_bundle_that_never_becomes_healthy_rolls_back_to_a",
    "upgrade_a_to_b_commits_and_keeps_the_node_identities",
    "a_lower_security_version_replayed_after_the_upgrade_is_refused",
    "every_secret_on_the_state_partition_is_0600_in_a_0700_dir",
    "a_power_cut_while_writing_the_inactive_slot_leaves_a_booting",
];

fn main() -> std::process::ExitCode {
    let mut args = Arguments::from_args();
    // The scenarios share box 1 and run in the order above, one at a time.
    args.test_threads = Some(1);
    let trials: Vec<Trial> = SCENARIOS.iter().map(|name| trial(name)).collect();
    let conclusion = libtest_mimic::run(&args, trials);
    #[cfg(feature = "appliance")]
    if let Err(e) = scenarios::teardown() {
        eprintln!("appliance_e2e: teardown left something behind: {e}");
        return std::process::ExitCode::FAILURE;
    }
    conclusion.exit_code()
}

#[cfg(feature = "appliance")]
fn trial(name: &'static str) -> Trial {
    Trial::test(name, move || scenarios::run(name).map_err(Failed::from))
}

#[cfg(not(feature = "appliance"))]
fn trial(name: &'static str) -> Trial {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "appliance_e2e: skipped: needs the built appliance image and bundles, QEMU with OVMF and the control \
             plane (feature chrysalis-tests/appliance; `cargo xtask test` builds them and enables it)"
        )
    });
    let _ = Failed::without_message;
    Trial::test(name, || Ok(())).with_ignored_flag(true)
}

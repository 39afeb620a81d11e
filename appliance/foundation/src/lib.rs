//! The foundation every Chrysalis crate stands on: the small pieces of plumbing that must be
//! written once and right.
//!
//! - [`atomic`]: replace a file crash-safely (temp file born with its final mode, fsync, rename,
//!   directory fsync). Secrets are born 0600: there is no window in which they are readable.
//! - [`private_dir`]: create (or tighten) a directory to 0700, the home of every secret.
//! - [`error_chain`]: an error and its `source()` chain on one line, `a: b: c`.
//! - [`token`]: read a bearer-token file under the one rule (owner-only, 32+ characters).
//! - [`quantity`]: Kubernetes resource quantities (`500m`, `1.5Gi`, `1e9`) → exact integers.
//! - [`procfs`]: the node's and a process's CPU time and memory from `/proc` (`kubectl top`).
//! - [`tool`]: run an external tool to completion, with its exit status and stderr in the error.
//! - [`KUBECONFIG_FILE`]: the name of a virtual node's kubeconfig in its credentials directory
//!   (join writes it; the supervisor's health probe and the tests read it).
//! - `testing` (feature `testing`, dev-dependencies only): how a test that cannot run here
//!   says so and is counted as skipped.
//!
//! The file functions return plain [`std::io::Error`]s; callers wrap them with the path and the
//! step in their own module error. [`procfs`], [`quantity`] and [`tool`] have typed errors of their own.

#![forbid(unsafe_code)]

pub mod atomic;
mod error_chain;
pub mod procfs;
pub mod quantity;
#[cfg(feature = "testing")]
pub mod testing;
pub mod token;
pub mod tool;

pub use atomic::{
    private_dir, sync_file_and_dir, write_atomic, write_new, write_secret, write_secret_unsynced, FileMode,
    PRIVATE_DIR, PUBLIC_FILE, SECRET_FILE,
};
pub use error_chain::error_chain;
pub use token::{read_token_file, TokenFileError, MIN_TOKEN_LEN};
pub use tool::ToolError;

/// The file name of a virtual node's kubeconfig in its credentials directory
/// (`--credentials-dir`, the supervisor's `<state>/<svc>/pki`): `join` writes it, the
/// supervisor's health probe and the test harness read it.
pub const KUBECONFIG_FILE: &str = "kubeconfig";

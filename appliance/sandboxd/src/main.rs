//! The `sandboxd` binary.
fn main() {}

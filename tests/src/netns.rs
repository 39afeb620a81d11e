//! A network namespace a suite owns: made fresh and deleted on every path out, a panic
//! included (the node suites run VMs, TAPs and bridges in one).

use std::path::Path;
use std::process::Command;

/// `ip netns add`ed on [`Netns::create`], `ip netns del`eted by [`Netns::delete`] or on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    deleted: bool,
}

impl Netns {
    /// Creates `name` with its loopback up; a stale namespace of that name (a crashed earlier
    /// run of the same pid) is deleted first.
    pub fn create(name: &str) -> Result<Netns, String> {
        if exists(name) {
            ip(&["netns", "del", name])?;
        }
        ip(&["netns", "add", name])?;
        let ns = Netns { name: name.to_string(), deleted: false };
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Its name (`VK_NETNS`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Deletes it and checks it is gone (idempotent).
    pub fn delete(&mut self) -> Result<(), String> {
        if std::mem::replace(&mut self.deleted, true) {
            return Ok(());
        }
        let result = ip(&["netns", "del", &self.name]);
        if exists(&self.name) {
            return Err(format!("netns {} still exists ({result:?})", self.name));
        }
        result
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.delete();
    }
}

/// Whether `/run/netns/<name>` exists.
pub fn exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if !out.status.success() {
        return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

//! Warm capacity as extended resources on the Node, for the unmodified scheduler: one resource
//! per pool, `sandbox.cocoonstack.io/warm-<template>-<net>-<size>` ([`resource_name`]), equal to
//! the pool's warm VMs plus the pool's VMs held by Pods of this node that request it
//! ([`warm_resources`]). The scheduler subtracts the requests of the Pods bound here, so what
//! it sees free is the warm VMs: a Pod asking for one unit lands only where its pool is warm.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use sandboxd_api::{Info, Key};
use sha2::{Digest, Sha256};

use crate::provider::HeldClaim;
use crate::sandboxd::SandboxRow;

/// The domain and prefix of every warm-capacity resource.
pub const RESOURCE_PREFIX: &str = "sandbox.cocoonstack.io/warm-";

/// The domain part of [`RESOURCE_PREFIX`].
const DOMAIN: &str = "sandbox.cocoonstack.io/";

/// The longest name after the domain's `/` (a qualified name's name part).
const NAME_MAX: usize = 63;

/// A key with sandboxd's defaults for an empty `net` (`none`) or `size` (`small`).
fn normalized(key: &Key) -> (&str, &str, &str) {
    let net = if key.net.is_empty() { "none" } else { key.net.as_str() };
    let size = if key.size.is_empty() { "small" } else { key.size.as_str() };
    (key.template.as_str(), net, size)
}

/// The extended resource of pool `key`: `sandbox.cocoonstack.io/warm-<template>-<net>-<size>`
/// (e.g. `sandbox.cocoonstack.io/warm-base-none-small`). Characters a resource name may not hold
/// (`:` and `/` of an image-style template) become `-`. A name longer than 63 characters after
/// the `/` is cut to 54 and ends in `-` and the first 8 hex digits of sandboxd's pool key hash
/// (SHA-256 of `template|net|size`), so it stays unique.
pub fn resource_name(key: &Key) -> String {
    let (template, net, size) = normalized(key);
    let raw = format!("warm-{template}-{net}-{size}");
    let mut name: String =
        raw.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' }).collect();
    if name.len() > NAME_MAX {
        let digest = Sha256::digest(format!("{template}|{net}|{size}").as_bytes());
        let hash: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        name.truncate(NAME_MAX - 1 - hash.len());
        let kept = name.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).len();
        name.truncate(kept);
        name = format!("{name}-{hash}");
    }
    format!("{DOMAIN}{name}")
}

/// The warm-capacity resources `pod` asks for (in any container's requests or limits).
pub fn requested(pod: &Pod) -> BTreeSet<String> {
    let Some(spec) = &pod.spec else { return BTreeSet::new() };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.requests.iter().chain(r.limits.iter()).flat_map(|m| m.keys()))
        .filter(|k| k.starts_with(RESOURCE_PREFIX))
        .cloned()
        .collect()
}

/// Per pool: its warm VMs (`/v1/info`) plus the listed sandboxes of the pool held by a claim of
/// this provider whose Pod requests the pool's resource (the scheduler subtracts that Pod's
/// request). A claim without its Pod (preserved for a replacement), or whose Pod requests
/// nothing or another pool, adds nothing. Pools that share a name after the character
/// replacement add up. A draining sandboxd takes no claim: every pool counts 0.
pub fn warm_resources(info: &Info, rows: &[SandboxRow], held: &[HeldClaim]) -> BTreeMap<String, Quantity> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for pool in &info.pools {
        let n = counts.entry(resource_name(&pool.key)).or_default();
        *n = n.saturating_add(pool.warm);
    }
    let asked: BTreeMap<&str, BTreeSet<String>> =
        held.iter().filter_map(|h| Some((h.id.as_str(), requested(h.pod.as_ref()?)))).collect();
    for row in rows {
        let name = resource_name(&row.key);
        if asked.get(row.id.as_str()).is_some_and(|names| names.contains(&name)) {
            let n = counts.entry(name).or_default();
            *n = n.saturating_add(1);
        }
    }
    let resources = counts.into_iter().map(|(k, n)| (k, Quantity(n.to_string()))).collect();
    if info.draining {
        return zeroed(&resources);
    }
    resources
}

/// `resources` with every count 0 (what the Node shows once sandboxd has not answered for a
/// stale-after window: nothing may be placed here on old news).
pub fn zeroed(resources: &BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
    resources.keys().map(|k| (k.clone(), Quantity("0".into()))).collect()
}

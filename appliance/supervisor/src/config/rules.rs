//! The rules the validation applies: [`Check`] collects [`Issue`]s (key, source, problem,
//! fix) and holds the checks shared by several keys (addresses, paths, TLS pairs, secret
//! files, sandboxd's network); the name predicates and the endpoint rule are pure functions.

use std::net::SocketAddr;
use std::path::Path;

use super::error::Issue;
use super::layers::Provenance;
use super::model::{
    SandboxdConfig, SandboxdNetwork, SANDBOXD_TAP_PREFIX, SANDBOXD_VM_BRIDGE, SANDBOXD_VM_CIDR, VK_COCOON_VM_BRIDGE,
    VK_COCOON_VM_CIDR,
};
use super::validate::ValidateEnv;

/// The issues found so far, each attributed to the layer that set its key.
pub(super) struct Check<'a> {
    pub(super) prov: &'a Provenance,
    pub(super) issues: Vec<Issue>,
}

impl Check<'_> {
    pub(super) fn fail(&mut self, key: &str, problem: impl Into<String>, fix: impl Into<String>) {
        self.issues.push(Issue {
            key: key.to_string(),
            source: self.prov.source_of(key),
            problem: problem.into(),
            fix: fix.into(),
        });
    }

    /// Checks the `[sandboxd] vm_*` keys; the `network` section when any is set (and all are valid).
    pub(super) fn sandboxd_network(&mut self, sb: &SandboxdConfig) -> Option<SandboxdNetwork> {
        let mut ok = true;
        if let Some(up) = &sb.vm_uplink {
            let policy = vmnet::FilterPolicy { uplink: Some(up.clone()), ..Default::default() };
            let problem = match policy.validate() {
                Err(e) => Some(e.to_string()),
                Ok(()) if up.starts_with(SANDBOXD_TAP_PREFIX) => {
                    Some(format!("{up:?} starts with {SANDBOXD_TAP_PREFIX:?}, the prefix of sandboxd's own VM ports"))
                }
                Ok(()) => None,
            };
            if let Some(problem) = problem {
                ok = false;
                self.fail(
                    "sandboxd.vm_uplink",
                    problem,
                    "name the network interface egress VMs leave by (e.g. \"eno1\"), or remove the key (no sandbox has a route out)",
                );
            }
        }
        if let Err(e) = vmnet::filter::parse_refuse(&sb.vm_refuse.join(",")) {
            ok = false;
            self.fail(
                "sandboxd.vm_refuse",
                e.to_string(),
                "list IPv4 networks as \"a.b.c.d/len\" (or single addresses), e.g. [\"203.0.113.0/24\"]",
            );
        }
        let bridge = sb.vm_bridge.clone().unwrap_or_else(|| SANDBOXD_VM_BRIDGE.to_string());
        if !vmnet::config::valid_ifname(&bridge) {
            ok = false;
            self.fail(
                "sandboxd.vm_bridge",
                format!("{bridge:?} is not an interface name (1-15 characters, no '/', ':', ',', quotes or spaces)"),
                format!(
                    "name the bridge of sandboxd's VMs, e.g. {SANDBOXD_VM_BRIDGE:?}, or remove the key (that default)"
                ),
            );
        }
        let cidr_text = sb.vm_cidr.as_deref().unwrap_or(SANDBOXD_VM_CIDR);
        let fix = format!(
            "give an IPv4 range a.b.c.d/len with no host bits, a /30 or larger, e.g. {SANDBOXD_VM_CIDR:?} \
             (its first host is the gateway), or remove the key (that default)"
        );
        let cidr = match cidr_text.parse::<vmnet::Ipv4Net>() {
            Err(_) => {
                self.fail("sandboxd.vm_cidr", format!("{cidr_text:?} is not an IPv4 range"), fix);
                None
            }
            Ok(n) if n != n.trunc() => {
                self.fail("sandboxd.vm_cidr", format!("{n} has host bits set (did you mean {}?)", n.trunc()), fix);
                None
            }
            Ok(n) if n.prefix_len() > 30 => {
                self.fail(
                    "sandboxd.vm_cidr",
                    format!("{n} is too small: a gateway and at least one VM need a /30 or larger"),
                    fix,
                );
                None
            }
            Ok(n) => Some(n),
        };
        let cidr = cidr?;
        (ok && sb.network_configured()).then(|| SandboxdNetwork {
            bridge,
            cidr,
            uplink: sb.vm_uplink.clone(),
            refuse: sb.vm_refuse.clone(),
        })
    }

    /// sandboxd's bridge and range must not be vk-cocoon's (both run on this box).
    pub(super) fn apart_from_vk_cocoon(&mut self, net: &SandboxdNetwork) {
        if net.bridge == VK_COCOON_VM_BRIDGE {
            self.fail(
                "sandboxd.vm_bridge",
                format!(
                    "{:?} is vk-cocoon's VM bridge, and vk_cocoon.enabled is true: the two networks would share \
                     one bridge",
                    net.bridge
                ),
                format!(
                    "give sandboxd its own bridge, e.g. {SANDBOXD_VM_BRIDGE:?} (or remove sandboxd.vm_bridge), \
                     or set vk_cocoon.enabled = false"
                ),
            );
        }
        // A constant that parses.
        #[allow(clippy::unwrap_used)]
        let theirs: vmnet::Ipv4Net = VK_COCOON_VM_CIDR.parse().unwrap();
        if net.cidr.contains(&theirs.network()) || theirs.contains(&net.cidr.network()) {
            self.fail(
                "sandboxd.vm_cidr",
                format!(
                    "{} overlaps {theirs}, vk-cocoon's VM range, and vk_cocoon.enabled is true: addresses would \
                     collide",
                    net.cidr
                ),
                format!(
                    "give sandboxd a range apart from {theirs}, e.g. {SANDBOXD_VM_CIDR:?} (or remove sandboxd.vm_cidr), \
                     or set vk_cocoon.enabled = false"
                ),
            );
        }
    }

    pub(super) fn addr(&mut self, key: &str, v: &str, example: &str) -> Option<SocketAddr> {
        match v.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                self.fail(key, format!("{v:?} is not an ip:port address"), format!("write it like {example:?}"));
                None
            }
        }
    }

    pub(super) fn absolute(&mut self, key: &str, p: &Path) {
        if !p.is_absolute() {
            self.fail(
                key,
                format!("{:?} is not an absolute path", p.display().to_string()),
                "give a path starting with /",
            );
        }
    }

    /// `<table>.tls_cert_file` and `tls_key_file`: both or neither; each readable.
    pub(super) fn tls_pair(&mut self, table: &str, cert: Option<&Path>, key: Option<&Path>, env: &ValidateEnv) {
        match (cert, key) {
            (None, None) => {}
            (Some(_), None) | (None, Some(_)) => {
                let (set, missing) =
                    if cert.is_some() { ("tls_cert_file", "tls_key_file") } else { ("tls_key_file", "tls_cert_file") };
                self.fail(
                    &format!("{table}.{set}"),
                    format!("is set without {table}.{missing}"),
                    format!("set both {table}.tls_cert_file and {table}.tls_key_file (PEM), or neither"),
                );
            }
            (Some(c), Some(k)) => {
                let cert_ok =
                    self.secret(&format!("{table}.tls_cert_file"), c, env, "the certificate chain (PEM, leaf first)");
                let key_ok =
                    self.secret(&format!("{table}.tls_key_file"), k, env, "the certificate's private key (PEM)");
                if cert_ok.is_some() && key_ok.is_some() {
                    if let Err(e) = httpd::tls::server_config_from_files(c, k, httpd::tls::ALPN_HTTP1) {
                        self.fail(
                            &format!("{table}.tls_cert_file"),
                            format!("{} and {} are not a usable certificate and key: {e}", c.display(), k.display()),
                            "give a PEM certificate chain (leaf first) and the PEM private key of its leaf",
                        );
                    }
                }
            }
        }
    }

    /// A bearer-token file under sandboxd's rule ([`foundation::read_token_file`]: owner-only,
    /// at least 32 characters), so the check refuses what sandboxd would refuse at start.
    pub(super) fn token(&mut self, key: &str, p: &Path, env: &ValidateEnv) {
        if !env.check_files {
            return;
        }
        if let Err(e) = foundation::read_token_file(p) {
            self.fail(
                key,
                format!("{}: {e}", p.display()),
                "give a file readable by its owner only holding a random token of at least 32 characters \
                 (or leave the key unset: the supervisor mints one)",
            );
        }
    }

    /// A secret file: readable and non-empty; returns its trimmed contents.
    pub(super) fn secret(&mut self, key: &str, p: &Path, env: &ValidateEnv, what: &str) -> Option<String> {
        if !env.check_files {
            return None;
        }
        match std::fs::read_to_string(p) {
            Ok(s) if s.trim().is_empty() => {
                self.fail(key, format!("{} is empty", p.display()), format!("write {what} into it"));
                None
            }
            Ok(s) => Some(s.trim().to_string()),
            Err(e) => {
                self.fail(
                    key,
                    format!("{} cannot be read ({e})", p.display()),
                    format!("create it with {what} (a relative path is relative to the file that sets the key)"),
                );
                None
            }
        }
    }
}

/// A name a certificate may carry: an IP address, or a DNS name (labels of letters, digits and
/// `-`, optionally a leading `*.`).
pub fn valid_tls_name(n: &str) -> bool {
    if n.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let n = n.strip_prefix("*.").unwrap_or(n);
    !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// A Kubernetes node name: an RFC 1123 subdomain (lowercase alphanumerics, `-`, `.`; ≤ 253;
/// labels ≤ 63, starting and ending alphanumeric).
pub fn valid_node_name(n: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && alnum(b[0])
                && alnum(b[b.len() - 1])
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// A Kubernetes label value (≤ 63; alphanumeric at both ends; `-_.` inside).
pub fn valid_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// `https://host[:port]` with nothing after the authority.
pub(super) fn check_endpoint(e: &str) -> Result<(), String> {
    let Some(rest) = e.strip_prefix("https://") else {
        return Err(format!("{e:?} does not start with https://"));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains('?') || authority.contains('@') {
        return Err(format!("{e:?} is not https://host:port (no path, no user)"));
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((h, "")) => (h, None),
            Some((h, p)) => (h, Some(p.strip_prefix(':').unwrap_or("x"))),
            None => ("", None),
        },
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    if host.is_empty() || port.is_some_and(|p| p.parse::<u16>().map_or(true, |n| n == 0)) {
        return Err(format!("{e:?} has no valid host[:port]"));
    }
    Ok(())
}

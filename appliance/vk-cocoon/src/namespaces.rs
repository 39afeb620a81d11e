//! Namespace scoping of VMs and snapshots: which Pods may adopt, clone or delete what.
//!
//! # Rule
//! Every VM and every snapshot vk-cocoon makes records the Kubernetes namespace that owns it
//! (the VM's record `<root>/cocoon/<id>.json`; the snapshot's manifest in the image library).
//! A Pod may adopt a VM, clone a snapshot, overwrite or drop a snapshot, or delete a VM only
//! when the owner is its own namespace, or when the node's configuration puts both namespaces
//! in one sharing group ([`VK_SHARED_NAMESPACES`], default: none). Everything else is refused
//! with Warning `NamespaceRefused` on the Pod, naming this rule and the key that allows
//! sharing, but *not* the other namespace (a tenant learns only that the name is taken; the
//! node's log names the owner for the operator).
//!
//! Names stay unique on the node (one VM per name, one snapshot per `repo:tag`): a name a
//! namespace owns — through a VM, or through the `<name>:latest` snapshot its deletion saved —
//! is refused to every other namespace instead of being shadowed by a second VM. Give VMs
//! names that carry their namespace (the seed's example does: `sandbox-default-…`).
//!
//! # Records without a namespace
//! VMs and snapshots written before namespaces were recorded (and snapshots saved by
//! `chrysalis snapshot save` without `--namespace`) belong to [`VK_LEGACY_NAMESPACE`]
//! (`default` unless set). Why not "anyone's": that would leave every pre-upgrade VM adoptable
//! and deletable by any namespace, the hole this closes. Why `default`: it is the namespace
//! Kubernetes gives objects that name none, and where the seed's example lives; a node whose
//! cocoon Pods lived elsewhere sets `VK_LEGACY_NAMESPACE` to that namespace, or shares
//! `default` with it for the migration. The start-up reconcile never destroys a VM some Pod
//! references, whatever its namespace, so an upgrade loses no VM: a refused Pod's VM waits.

use std::collections::BTreeSet;

/// The variable naming the namespaces that share VMs and snapshots.
pub const VK_SHARED_NAMESPACES: &str = "VK_SHARED_NAMESPACES";
/// The variable naming the owner of records that carry no namespace.
pub const VK_LEGACY_NAMESPACE: &str = "VK_LEGACY_NAMESPACE";
/// The owner of records without a namespace when [`VK_LEGACY_NAMESPACE`] is unset.
pub const DEFAULT_LEGACY_NAMESPACE: &str = "default";

/// A sharing variable that cannot be used (it becomes a `ConfigError::Invalid` of the node's
/// configuration, with the same message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {why}")]
pub struct NamespaceConfigError {
    pub var: &'static str,
    pub value: String,
    pub why: &'static str,
}

/// Who may use whose VMs and snapshots (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespacePolicy {
    /// Groups of namespaces that share with each other (each ≥ 2 namespaces).
    groups: Vec<BTreeSet<String>>,
    /// The owner of records without a namespace.
    legacy: String,
}

impl Default for NamespacePolicy {
    fn default() -> Self {
        NamespacePolicy::isolated()
    }
}

impl NamespacePolicy {
    /// No sharing; unrecorded owners are `default`.
    pub fn isolated() -> NamespacePolicy {
        NamespacePolicy { groups: Vec::new(), legacy: DEFAULT_LEGACY_NAMESPACE.to_owned() }
    }

    /// From the values of [`VK_SHARED_NAMESPACES`] (`a,b;c,d,e`: groups separated by `;`,
    /// namespaces by `,`; each group shares within itself) and [`VK_LEGACY_NAMESPACE`].
    /// `None` or blank = unset.
    pub fn parse(shared: Option<&str>, legacy: Option<&str>) -> Result<NamespacePolicy, NamespaceConfigError> {
        let mut groups = Vec::new();
        if let Some(v) = shared.map(str::trim).filter(|v| !v.is_empty()) {
            let bad = |why: &'static str| NamespaceConfigError { var: VK_SHARED_NAMESPACES, value: v.to_owned(), why };
            for group in v.split(';').map(str::trim).filter(|g| !g.is_empty()) {
                let members: BTreeSet<String> = group.split(',').map(|m| m.trim().to_owned()).collect();
                if members.iter().any(|m| !images::valid_namespace(m)) {
                    return Err(bad(
                        "every entry must be a namespace name (1-63 of [a-z0-9-]); groups are separated by ';', \
                         namespaces by ',' (e.g. golden,team-a;ci,ci-tools)",
                    ));
                }
                if members.len() < 2 {
                    return Err(bad("a sharing group needs at least two different namespaces"));
                }
                groups.push(members);
            }
        }
        let legacy = match legacy.map(str::trim).filter(|v| !v.is_empty()) {
            None => DEFAULT_LEGACY_NAMESPACE.to_owned(),
            Some(v) if images::valid_namespace(v) => v.to_owned(),
            Some(v) => {
                return Err(NamespaceConfigError {
                    var: VK_LEGACY_NAMESPACE,
                    value: v.to_owned(),
                    why: "is not a namespace name (1-63 of [a-z0-9-])",
                })
            }
        };
        Ok(NamespacePolicy { groups, legacy })
    }

    /// The namespace owning a record that says `recorded` (`None`: the legacy owner).
    pub fn owner<'a>(&'a self, recorded: Option<&'a str>) -> &'a str {
        recorded.unwrap_or(&self.legacy)
    }

    /// Whether a Pod of `pod_ns` may use what `recorded` owns.
    pub fn permits(&self, pod_ns: &str, recorded: Option<&str>) -> bool {
        let owner = self.owner(recorded);
        owner == pod_ns || self.groups.iter().any(|g| g.contains(owner) && g.contains(pod_ns))
    }

    /// The sharing groups.
    pub fn groups(&self) -> &[BTreeSet<String>] {
        &self.groups
    }

    /// The owner of records without a namespace.
    pub fn legacy(&self) -> &str {
        &self.legacy
    }
}

/// What a refused Pod tried to do with something of another namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Take over a live VM (same name, or its id on the Pod).
    Adopt,
    /// Restore a snapshot.
    Clone,
    /// Boot a VM under a name another namespace holds (a VM or a `<name>:latest` snapshot).
    Name,
    /// Save over a snapshot.
    Overwrite,
    /// Remove a VM.
    Delete,
}

impl Use {
    /// The verb the refusal shows.
    pub fn verb(self) -> &'static str {
        match self {
            Use::Adopt => "adopt",
            Use::Clone => "clone",
            Use::Name => "reuse the name of",
            Use::Overwrite => "overwrite",
            Use::Delete => "delete",
        }
    }

    /// What the refused Pod (or its author) can do about it.
    pub fn fix(self) -> &'static str {
        match self {
            Use::Adopt | Use::Name => {
                "give the pod a vm.cocoonstack.io/name of its own (e.g. one that carries the namespace), or have                  the node's operator list both namespaces in one VK_SHARED_NAMESPACES group"
            }
            Use::Clone => {
                "clone a snapshot of this namespace, or have the node's operator list both namespaces in one                  VK_SHARED_NAMESPACES group"
            }
            Use::Overwrite => {
                "set cocoonset.cocoonstack.io/snapshot-policy: never on the pod to delete its VM without a                  snapshot, or have the node's operator list both namespaces in one VK_SHARED_NAMESPACES group"
            }
            Use::Delete => {
                "the VM is left running; only a pod of its own namespace (or one sharing with it through                  VK_SHARED_NAMESPACES) can delete it"
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn isolated_by_default_and_unrecorded_means_default() {
        let p = NamespacePolicy::parse(None, None).unwrap();
        assert_eq!(p, NamespacePolicy::isolated());
        assert!(p.permits("a", Some("a")));
        assert!(!p.permits("a", Some("b")));
        assert!(p.permits("default", None), "an old record belongs to default");
        assert!(!p.permits("a", None), "and to no other namespace");
        assert_eq!(p.owner(None), "default");
        assert_eq!(NamespacePolicy::parse(Some("  "), Some("")).unwrap(), NamespacePolicy::isolated());
    }

    #[test]
    fn groups_share_within_themselves_only() {
        let p = NamespacePolicy::parse(Some(" golden, team-a ;ci,ci-tools,ci-2;"), Some("agents")).unwrap();
        assert_eq!(p.groups().len(), 2);
        assert!(p.permits("team-a", Some("golden")) && p.permits("golden", Some("team-a")));
        assert!(p.permits("ci-2", Some("ci")));
        assert!(!p.permits("team-a", Some("ci")), "no sharing across groups");
        assert!(!p.permits("team-b", Some("golden")), "an unlisted namespace shares nothing");
        assert!(p.permits("agents", None) && !p.permits("default", None), "VK_LEGACY_NAMESPACE");
        let p = NamespacePolicy::parse(Some("default,team-a"), None).unwrap();
        assert!(p.permits("team-a", None), "sharing default is the migration path for old records");
    }

    #[test]
    fn errors_name_the_variable() {
        for v in ["a", "a,a", "a,B", "a,,b", "a;b,c", "a,-b", "a/b,c"] {
            let e = NamespacePolicy::parse(Some(v), None).unwrap_err();
            assert!(e.to_string().starts_with("VK_SHARED_NAMESPACES="), "{v}: {e}");
        }
        let e = NamespacePolicy::parse(None, Some("Default")).unwrap_err();
        assert!(e.to_string().starts_with("VK_LEGACY_NAMESPACE="), "{e}");
    }
}

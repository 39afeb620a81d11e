//! The node Lease `kube-node-lease/<node>` (`coordination.k8s.io/v1`): holder = node name,
//! owned by the Node (ownerRef with its UID), `leaseDurationSeconds` 40, `renewTime` bumped
//! every 10 s. Renewals pause while the API ping fails and never stop the runtime.

use crate::error::{is_conflict, is_not_found};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::PostParams;
use kube::Api;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The namespace of node Leases.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";

/// The ownerRef pointing at the Node.
pub fn owner(node: &str, node_uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.into(),
        uid: node_uid.into(),
        ..Default::default()
    }
}

/// Sets holder, duration, renew time and owner on `lease` (keeping everything else).
pub fn refresh(lease: &mut Lease, node: &str, node_uid: &str, duration: Duration, now: MicroTime) {
    lease.metadata.name = Some(node.into());
    lease.metadata.namespace = Some(LEASE_NAMESPACE.into());
    if !node_uid.is_empty() {
        lease.metadata.owner_references = Some(vec![owner(node, node_uid)]);
    }
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some(node.into());
    spec.lease_duration_seconds = Some(i32::try_from(duration.as_secs()).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
}

/// A fresh Lease for `node`.
pub fn build(node: &str, node_uid: &str, duration: Duration, now: MicroTime) -> Lease {
    let mut lease = Lease { metadata: ObjectMeta::default(), spec: None };
    refresh(&mut lease, node, node_uid, duration, now);
    lease
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Keeps the Lease renewed until `cancel`.
pub(crate) struct LeaseKeeper {
    pub api: Api<Lease>,
    pub node: String,
    pub uid: watch::Receiver<String>,
    pub duration: Duration,
    pub renew: Duration,
}

impl LeaseKeeper {
    pub(crate) fn new(
        client: kube::Client,
        node: String,
        uid: watch::Receiver<String>,
        duration: Duration,
        renew: Duration,
    ) -> Self {
        LeaseKeeper { api: Api::namespaced(client, LEASE_NAMESPACE), node, uid, duration, renew }
    }

    /// One renewal: create the Lease if missing, else replace it with a new renew time.
    /// `current` caches the last written Lease (its resourceVersion); it is dropped on a
    /// conflict so the next round re-reads.
    pub(crate) async fn renew_once(&self, current: &mut Option<Lease>) -> Result<(), kube::Error> {
        let uid = self.uid.borrow().clone();
        let mut lease = match current.take() {
            Some(l) => l,
            None => match self.api.get_opt(&self.node).await? {
                Some(l) => l,
                None => {
                    let created =
                        self.api.create(&PostParams::default(), &build(&self.node, &uid, self.duration, now())).await?;
                    info!(node = %self.node, "created the node Lease");
                    *current = Some(created);
                    return Ok(());
                }
            },
        };
        refresh(&mut lease, &self.node, &uid, self.duration, now());
        match self.api.replace(&self.node, &PostParams::default(), &lease).await {
            Ok(l) => {
                debug!(node = %self.node, "renewed the node Lease");
                *current = Some(l);
                Ok(())
            }
            Err(e) => {
                if !(is_conflict(&e) || is_not_found(&e)) {
                    // Keep the cached copy: a transient error does not mean it changed.
                    *current = Some(lease);
                }
                Err(e)
            }
        }
    }

    pub(crate) async fn run(self, mut health: watch::Receiver<bool>, cancel: CancellationToken) {
        let mut current = None;
        let mut failing = false;
        loop {
            if *health.borrow_and_update() && !self.uid.borrow().is_empty() {
                match self.renew_once(&mut current).await {
                    Ok(()) if failing => {
                        info!(node = %self.node, "node Lease renewals work again");
                        failing = false;
                    }
                    Ok(()) => {}
                    Err(e) if !failing => {
                        warn!(node = %self.node, error = %e, "renewing the node Lease failed (retrying)");
                        failing = true;
                    }
                    Err(e) => debug!(node = %self.node, error = %e, "node Lease renewal still failing"),
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.renew) => {}
                // Renew right away when the API server comes back.
                changed = health.changed() => if changed.is_err() { return },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn a_lease_is_held_by_and_owned_by_the_node() {
        let t = MicroTime(Timestamp::UNIX_EPOCH);
        let l = build("vk-a", "uid-1", Duration::from_secs(40), t.clone());
        assert_eq!(l.metadata.name.as_deref(), Some("vk-a"));
        assert_eq!(l.metadata.namespace.as_deref(), Some("kube-node-lease"));
        let spec = l.spec.as_ref().expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("vk-a"));
        assert_eq!(spec.lease_duration_seconds, Some(40));
        assert_eq!(spec.renew_time, Some(t));
        let o = &l.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (o.kind.as_str(), o.name.as_str(), o.uid.as_str(), o.api_version.as_str()),
            ("Node", "vk-a", "uid-1", "v1")
        );
    }

    #[test]
    fn refresh_keeps_the_resource_version_and_moves_the_renew_time() {
        let mut l = build("vk-a", "uid-1", Duration::from_secs(40), MicroTime(Timestamp::UNIX_EPOCH));
        l.metadata.resource_version = Some("42".into());
        let later = MicroTime(Timestamp::UNIX_EPOCH + k8s_openapi::jiff::SignedDuration::from_secs(10));
        refresh(&mut l, "vk-a", "uid-2", Duration::from_secs(40), later.clone());
        assert_eq!(l.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(l.spec.as_ref().and_then(|s| s.renew_time.clone()), Some(later));
        assert_eq!(
            l.metadata.owner_references.as_ref().expect("owner")[0].uid,
            "uid-2",
            "follows a re-registered Node"
        );
    }
}

//! The virtual-kubelet node runtime (`docs/virtual-node.md` §1): everything a virtual
//! node does that does not depend on what backs its Pods. A provider (vk-sandbox, vk-cocoon)
//! implements [`Provider`]; [`run`] registers the Node, keeps its Lease and status fresh,
//! runs the pod controller (informer on `spec.nodeName`, rate-limited per-pod queues, the
//! create/update/delete/force-delete rules), pushes the provider's status changes and serves
//! the kubelet HTTPS endpoint.
//!
//! Modules: [`config`] (what callers pass), [`node`] (the Node object, pure), `registration`
//! (create/patch the Node, status loop), [`lease`], `ping`, [`queue`] (the work queue),
//! [`sync`] (the sync rules, pure), `controller` (informer + workers), [`status`] (provider
//! pushes → `pods/status`), [`events`], [`kubelet`] + [`tls`] (HTTPS) + [`auth`] (who may use
//! it: client certificates against the cluster CA, `TokenReview`, `SubjectAccessReview`), [`error`];
//! [`session`] (a provider binary's join flags, API client and renewal-restart loop);
//! [`pod_status`] (the Pod status shapes providers push, pure); [`kit`] (the provider kit: the
//! locked pod table, the notifier, background loops, error reporting); [`host_ip`] (the node IP a
//! provider publishes); [`streams`] (what a provider serves logs, exec, attach and port-forward with);
//! [`stats`] (`kubectl top`: `/stats/summary`, `/metrics/resource`, and the runtime's own `/metrics`; [`stats::PodMetrics`]
//! is what a provider measures).

#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
mod controller;
pub mod error;
pub mod events;
pub mod host_ip;
pub mod kit;
pub mod kubelet;
pub mod lease;
pub mod node;
mod ping;
pub mod pod_status;
pub mod provider;
pub mod queue;
mod registration;
pub mod session;
pub mod stats;
pub mod status;
pub mod streams;
pub mod sync;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod tls;

pub use config::{NodeConfig, NodeHandle, RuntimeConfig};
pub use error::VnodeError;
pub use provider::{error_chain, PodKey, PodNotifier, Provider, ProviderError};
pub use stats::{PodMetrics, PodUsage, StatsConfig};
pub use streams::{PodStreams, StreamError};

use controller::Controller;
use registration::Registrar;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

/// Runs the virtual node until `shutdown` resolves; `streams` serves the kubelet port's logs,
/// exec, attach and port-forward.
///
/// Returns `Ok(())` after a clean stop (workers finish the item they hold, within
/// `cfg.shutdown_grace`; the Node, its Lease and the Pods are left as they are), or a
/// [`VnodeError`] when the node cannot start: an invalid configuration (e.g. a label
/// NodeRestriction refuses), an unusable kubelet port, or the API server refusing the Node
/// (403 names NodeRestriction). An unreachable API server is not fatal: registration is
/// retried, and once running the runtime pauses Lease/status writes until it answers again.
///
/// The Node is registered NotReady first, then marked `Ready` (`KubeletReady`) once the pod
/// controller has listed the node's pods, removed provider pods the API does not have, and
/// queued every pod.
pub async fn run(
    client: kube::Client,
    node: NodeConfig,
    cfg: RuntimeConfig,
    provider: Arc<dyn Provider>,
    streams: Arc<dyn PodStreams>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), VnodeError> {
    let span = tracing::info_span!("vnode", node = %node.name);
    run_inner(client, node, cfg, provider, streams, shutdown).instrument(span).await
}

fn validate(node: &NodeConfig) -> Result<(), VnodeError> {
    if node.name.is_empty() {
        return Err(VnodeError::Config("the node name is empty".into()));
    }
    let refused: Vec<&str> = node::labels(node)
        .into_keys()
        .filter(|k| node::label_refused_by_node_restriction(k))
        .map(|k| node.labels.get_key_value(&k).map(|(k, _)| k.as_str()).unwrap_or("?"))
        .collect();
    if !refused.is_empty() {
        return Err(VnodeError::Config(format!(
            "NodeRestriction refuses these labels when a node registers itself: {}; drop them or have an admin apply them",
            refused.join(", ")
        )));
    }
    Ok(())
}

/// Everything `run` started, so that a stop can end it.
struct Running {
    cancel: CancellationToken,
    tasks: JoinSet<()>,
    workers: JoinSet<()>,
    controller: Option<Arc<Controller>>,
    grace: Duration,
}

impl Running {
    async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(c) = &self.controller {
            c.shutdown_queues();
        }
        let deadline = tokio::time::Instant::now() + self.grace;
        for set in [&mut self.workers, &mut self.tasks] {
            while tokio::time::timeout_at(deadline, set.join_next()).await.is_ok_and(|r| r.is_some()) {}
            if !set.is_empty() {
                warn!(left = set.len(), "tasks did not stop within the grace period; aborting them");
                set.abort_all();
            }
        }
        info!("stopped");
    }
}

async fn run_inner(
    client: kube::Client,
    node: NodeConfig,
    cfg: RuntimeConfig,
    provider: Arc<dyn Provider>,
    streams: Arc<dyn PodStreams>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), VnodeError> {
    validate(&node)?;
    let mut shutdown = std::pin::pin!(shutdown);
    let client_ca = auth::x509::ClientCa::new(&cfg.client_ca).map_err(VnodeError::ClientCa)?;
    if !client_ca.is_configured() {
        warn!("no client CA: the kubelet endpoint accepts bearer tokens only (client certificates get 401)");
    }
    let (tls, _) = tls::server_config(
        cfg.tls_cert.as_deref(),
        cfg.tls_key.as_deref(),
        &node.name,
        node.internal_ip.map(|ip| ip.to_string()).as_deref(),
        client_ca.tls_verifier(),
    )
    .map_err(VnodeError::KubeletTls)?;
    let listener = kubelet::bind(cfg.listen_addr).await?;
    if let Err(e) = httpd::raise_nofile_limit() {
        warn!(error = %e, "cannot raise the open-file limit; the kubelet connection cap may not be reachable");
    }
    info!(addr = %cfg.listen_addr, max_connections = cfg.kubelet_limits.max_connections, "kubelet endpoint listening");
    let reviewer = Arc::new(auth::review::KubeReviewer::new(client.clone(), cfg.kubelet_auth.review_timeout));
    let kubelet_auth = Arc::new(auth::KubeletAuth::new(&node.name, client_ca, reviewer, cfg.kubelet_auth.clone()));
    let mut run = Running {
        cancel: CancellationToken::new(),
        tasks: JoinSet::new(),
        workers: JoinSet::new(),
        controller: None,
        grace: cfg.shutdown_grace,
    };
    let cancel = run.cancel.clone();
    // The informer's cache of the Pods bound here: the pod controller fills it (3.), the
    // kubelet port answers from it about a Pod the provider does not track.
    let (store, writer) = kube::runtime::reflector::store();
    run.tasks.spawn(
        kubelet::serve(
            listener,
            tls,
            kubelet::router(
                provider.clone(),
                streams::Bound::new(streams, store.clone()),
                cfg.stream_limits,
                Arc::new(stats::Stats::new(&node.name, cfg.stats.clone())),
                kubelet_auth,
            ),
            cfg.kubelet_limits,
            Arc::new(httpd::ConnStats::default()),
            cancel.clone(),
        )
        .in_current_span(),
    );

    // 1. The Node (NotReady until the pod controller is up).
    let registrar = Arc::new(Registrar::new(client.clone(), node.clone()));
    let registered = tokio::select! {
        _ = &mut shutdown => None,
        r = registrar.register_until_done(&cancel) => match r {
            Ok(n) => n,
            Err(e) => {
                run.stop().await;
                return Err(e);
            }
        },
    };
    if registered.is_none() {
        run.stop().await;
        return Ok(());
    }

    // 2. Liveness: ping, Lease, status.
    let (healthy_tx, healthy) = watch::channel(true);
    run.tasks.spawn(
        ping::ping_loop(client.clone(), node.name.clone(), cfg.ping_interval, healthy_tx, cancel.clone())
            .in_current_span(),
    );
    let keeper = lease::LeaseKeeper::new(
        client.clone(),
        node.name.clone(),
        registrar.uid(),
        cfg.lease_duration,
        cfg.lease_renew,
    );
    run.tasks.spawn(keeper.run(healthy.clone(), cancel.clone()).in_current_span());
    run.tasks
        .spawn(registrar.clone().status_loop(cfg.status_interval, healthy.clone(), cancel.clone()).in_current_span());

    // 3. The pod controller.
    let recorder = events::Recorder::new(client.clone(), node.name.clone(), cfg.disable_pod_events);
    let bucket = queue::bucket_spec(cfg.kube_api_qps, cfg.kube_api_burst);
    let controller = Arc::new(Controller::new(
        node.name.clone(),
        client.clone(),
        provider.clone(),
        store.clone(),
        recorder,
        bucket,
        cfg.stats.runtime.clone(),
    ));
    run.controller = Some(controller.clone());
    let (notifier, pushes) = PodNotifier::channel();
    provider.notify_pods(notifier);
    run.tasks.spawn(
        status::dispatch(pushes, store, controller.pushes.clone(), controller.status_q.clone(), cancel.clone())
            .in_current_span(),
    );
    let (first_tx, first_rx) = oneshot::channel();
    run.tasks.spawn(controller.clone().informer(writer, first_tx, cancel.clone()).in_current_span());

    // 4. First complete list → start-up reconcile → workers → Ready.
    let synced = tokio::select! {
        _ = &mut shutdown => false,
        r = first_rx => r.is_ok(),
    };
    if !synced {
        run.stop().await;
        return Ok(());
    }
    info!("the pod informer has synced");
    let reconciled = tokio::select! {
        _ = &mut shutdown => false,
        _ = controller.reconcile_startup() => true,
    };
    if !reconciled {
        run.stop().await;
        return Ok(());
    }
    controller.spawn_workers(cfg.workers, &mut run.workers);
    run.tasks.spawn(controller.clone().resync_loop(cfg.resync, cancel.clone()).in_current_span());
    registrar.set_ready();
    info!(workers = cfg.workers.max(1), "the pod controller is running; the node is Ready");

    shutdown.await;
    info!("stopping");
    run.stop().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn restricted_labels_are_refused_before_touching_the_api() {
        let mut n = NodeConfig { name: "vk".into(), ..Default::default() };
        assert!(validate(&n).is_ok());
        n.labels = BTreeMap::from([("kubernetes.io/role".into(), "agent".into()), ("type".into(), "x".into())]);
        let e = validate(&n).expect_err("refused").to_string();
        assert!(e.contains("kubernetes.io/role") && e.contains("NodeRestriction"), "{e}");
        assert!(validate(&NodeConfig::default()).is_err(), "an empty name is refused");
    }
}

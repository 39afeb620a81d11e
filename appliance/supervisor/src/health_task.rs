//! The health task (start-up step 7): a [`Prober`] built from the validated settings and the
//! secrets, then a loop that asks sandboxd `/healthz` every second and, every
//! [`RunOptions::health_interval`](crate::RunOptions::health_interval), probes the pools and the
//! virtual nodes, publishes the snapshot in [`Shared`] and hands it to
//! [`UpdateControl::on_health`] (the A/B commit gate). A reboot the gate asks for goes to the
//! main loop as an [`api::Command::Reboot`]: only the main loop stops services.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::Settings;
use crate::health::{self, Prober};
use crate::secrets::Secrets;
use crate::services::{self, Layout, ServiceName};
use crate::state::Shared;
use crate::{api, error_chain, http, read_secret, GateVerdict, UpdateControl};

/// How often sandboxd's `/healthz` is asked (the READY condition reads it).
const ANSWERS_EVERY: Duration = Duration::from_secs(1);

/// The prober of a supervisor running `settings` with `secrets`: sandboxd when
/// `sandboxd_enabled` (over TLS trusting exactly its certificate when it serves TLS), each
/// enabled virtual node with its own credentials, the cluster's endpoint. Without settings or
/// secrets (a broken configuration) it probes nothing.
pub(crate) fn prober(
    settings: Option<&Settings>,
    secrets: Option<&Secrets>,
    layout: &Layout,
    sandboxd_enabled: bool,
) -> Prober {
    let (Some(s), Some(sec)) = (settings, secrets) else {
        return Prober::new(None, None, Vec::new(), None);
    };
    let addr = services::local_addr(s.sandboxd_listen).to_string();
    let sandboxd = sandboxd_enabled.then_some(match sec.sandboxd_tls {
        Some(_) => http::Endpoint::Https(addr),
        None => http::Endpoint::Tcp(addr),
    });
    let token = read_secret(&sec.sandboxd_token_file);
    let mut nodes = Vec::new();
    if s.vk_sandbox {
        nodes.push(health::NodeTarget {
            service: ServiceName::VkSandbox,
            name: s.vk_sandbox_name().into(),
            pki_dir: layout.pki_dir(ServiceName::VkSandbox),
        });
    }
    if s.vk_cocoon {
        nodes.push(health::NodeTarget {
            service: ServiceName::VkCocoon,
            name: s.vk_cocoon_name().into(),
            pki_dir: layout.pki_dir(ServiceName::VkCocoon),
        });
    }
    let p = Prober::new(sandboxd, token, nodes, s.config.cluster.as_ref().map(|c| c.endpoint.clone()));
    match &sec.sandboxd_tls {
        // Trusts exactly sandboxd's certificate (it need not name 127.0.0.1).
        Some(c) => match httpd::tls::client_config(&httpd::tls::Trust::File(c.cert.clone()), httpd::tls::ALPN_HTTP1) {
            Ok(tls) => p.with_sandboxd_tls(tls),
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "sandboxd's certificate cannot be trusted; its health is unknown");
                p
            }
        },
        None => p,
    }
}

/// Probes forever (see the module doc); the full probe runs at most once per `every`.
pub(crate) async fn run(
    shared: Arc<Shared>,
    prober: Arc<Prober>,
    update: Arc<dyn UpdateControl>,
    commands: mpsc::Sender<api::Command>,
    every: Duration,
) {
    let mut last_full: Option<tokio::time::Instant> = None;
    loop {
        let answers = prober.sandboxd_answers().await;
        shared.update_health(|h| h.sandboxd_answers = answers);
        if last_full.is_none_or(|t| t.elapsed() >= every) {
            last_full = Some(tokio::time::Instant::now());
            full_probe(&shared, &prober).await;
            if let GateVerdict::Reboot { reason } = update.on_health(&shared.health()).await {
                let (reply, rx) = tokio::sync::oneshot::channel();
                if commands.send(api::Command::Reboot { reason: reason.clone(), reply }).await.is_ok() {
                    if let Ok(Err(e)) = rx.await {
                        tracing::error!(reason, error = %e, "the update gate asked for a reboot that was refused");
                    }
                }
            }
        }
        tokio::time::sleep(ANSWERS_EVERY).await;
    }
}

/// Pools and nodes, probed together, published as one snapshot.
async fn full_probe(shared: &Shared, prober: &Prober) {
    let (pools, (nodes, reachable)) = tokio::join!(prober.pools(), prober.nodes());
    shared.update_health(|h| {
        match pools {
            Ok((p, hypervisor)) => {
                h.pools = p;
                h.pools_error = None;
                h.hypervisor = hypervisor;
            }
            Err(e) => h.pools_error = Some(e),
        }
        h.nodes = nodes;
        h.api_reachable = reachable;
        h.checked_at =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    });
}

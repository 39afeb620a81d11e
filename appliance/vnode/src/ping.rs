//! The API server liveness ping (`GET /version`, like virtual-kubelet's every 10 s). Its
//! result is a `watch` flag: while it is `false` the Lease and the Node status are not
//! written. Transitions are logged once each; nothing here ever gives up.

use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// One ping: the API server answered `/version` within `timeout`.
pub(crate) async fn ping(client: &kube::Client, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, client.apiserver_version()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Pings every `interval` (first one right away) and publishes the result on `healthy`.
pub(crate) async fn ping_loop(
    client: kube::Client,
    node: String,
    interval: Duration,
    healthy: watch::Sender<bool>,
    cancel: CancellationToken,
) {
    let timeout = interval.clamp(Duration::from_secs(1), Duration::from_secs(5));
    loop {
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = ping(&client, timeout) => r,
        };
        let was = *healthy.borrow();
        let ok = result.is_ok();
        match result {
            Ok(()) if !was => info!(node = %node, "the API server answers again; resuming Lease and status updates"),
            Err(e) if was => warn!(
                node = %node,
                error = %e,
                "the API server does not answer; pausing Lease and status updates until it does"
            ),
            _ => {}
        }
        healthy.send_if_modified(|h| {
            let changed = *h != ok;
            *h = ok;
            changed
        });
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

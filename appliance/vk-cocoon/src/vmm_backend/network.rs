//! A VM's network through `vmnet`: its lease and TAP ([`VmmBackend::network_for`], the NIC from
//! `vmnet::Network::nic_spec`), the undo of a failed create, the guest re-addressing of a clone
//! (`configure_network`: `guest-init net-config` through the agent), TCP probes inside
//! `VK_NETNS`, and the release of a lease.

use std::time::Duration;

use silkd_client::{AgentConn, ExecOptions};
use vmm::AGENT_PORT;
use vmnet::{Lease, VmPolicy};

use super::{failed, VmmBackend, VmmBackendError, AGENT_CALL};
use crate::backend::BackendError;

/// What a `guest-init net-config` exec may print (stdout + stderr) before it is cut off: a
/// guest that streams endless output gets a typed error, never our memory.
const NET_CONFIG_OUTPUT_CAP: usize = 64 * 1024;

impl VmmBackend {
    /// Takes a lease and its TAP for `id`, with `policy` (`None`: the lease's own, for a VM
    /// that already has one).
    pub(super) async fn network_for(&self, id: &str, policy: Option<&VmPolicy>) -> Result<Lease, BackendError> {
        let lease = match policy {
            Some(p) => self.net.allocate_with(id, p),
            None => self.net.allocate(id),
        }
        .map_err(|e| failed("leasing an address for", id.to_owned(), e))?;
        self.net.create_tap(&lease).await.map_err(|e| failed("creating the TAP of", id.to_owned(), e))?;
        Ok(lease)
    }

    /// Undoes a failed create: TAP, lease (unless `keep_lease`: a wake's guest carries its
    /// address), record (best effort; logged).
    pub(super) async fn undo_create(&self, id: &str, keep_lease: bool) {
        if let Ok(Some(lease)) = self.net.lookup(id) {
            if let Err(e) = self.net.delete_tap(&lease.tap).await {
                tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: deleting the TAP failed");
            }
        }
        if keep_lease {
            tracing::info!(vm = id, "undo: the lease is kept (the restored guest carries its address)");
        } else if let Err(e) = self.net.release(id) {
            tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: releasing the lease failed");
        }
        if let Err(e) = self.delete_record(id) {
            tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "undo: deleting the record failed");
        }
    }

    /// `configure_network`: re-addresses the guest of `id` with its own lease.
    pub(super) async fn readdress(&self, id: &str) -> Result<(), BackendError> {
        let lease = self
            .net
            .lookup(id)
            .map_err(|e| failed("reading the lease of", id.to_owned(), e))?
            .ok_or_else(|| BackendError::NotFound { what: format!("the address lease of VM {id}") })?;
        let vm = self.live_vm(id).await?;
        let argv = self.net.net_config_argv(&lease);
        let args: Vec<&str> = argv.iter().map(String::as_str).collect();
        let op = "configuring the guest network of";
        let exchange = async {
            let stream = self.driver.connect(&vm, AGENT_PORT).await.map_err(|e| failed(op, id.to_owned(), e))?;
            net_config_exec(stream, &args).await.map_err(|e| failed(op, id.to_owned(), VmmBackendError::Agent(e)))
        };
        let out = tokio::time::timeout(AGENT_CALL, exchange).await.map_err(|_| {
            failed(op, id.to_owned(), VmmBackendError::Timeout { what: "net-config", after: AGENT_CALL })
        })??;
        if out.code != 0 {
            return Err(failed(
                op,
                id.to_owned(),
                VmmBackendError::Exit {
                    argv: argv.join(" "),
                    code: out.code,
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                },
            ));
        }
        tracing::info!(vm = id, ip = %lease.ip, "guest network configured");
        Ok(())
    }

    /// `network_hint`: the `net-config` line a clone's guest needs.
    pub(super) fn hint(&self, id: &str) -> Option<String> {
        let lease = self.net.lookup(id).ok().flatten()?;
        Some(self.net.net_config_argv(&lease).join(" "))
    }

    /// `probe_tcp`: a connect to `ip:port`, from inside `VK_NETNS` when set.
    pub(super) async fn tcp_probe(&self, ip: &str, port: u16, timeout: Duration) -> bool {
        let Some(ns) = self.net.config().netns.clone() else {
            return crate::backend::tcp_probe(ip, port, timeout).await;
        };
        // The bridge and the VMs live in `VK_NETNS`: connect from a thread inside it.
        let ip = ip.to_owned();
        let connected =
            vmnet::netns::run_in(
                Some(&ns),
                move || async move { Ok(crate::backend::tcp_probe(&ip, port, timeout).await) },
            )
            .await;
        connected.unwrap_or_else(|e| {
            tracing::warn!(netns = %ns, error = %vnode::provider::error_chain(&e), "TCP probe: cannot enter the VM network namespace");
            false
        })
    }

    /// `release_ip`: drops the lease of `id` and any TAP left with it.
    pub(super) async fn release_lease(&self, id: &str) -> Result<(), BackendError> {
        if let Some(lease) = self.net.release(id).map_err(|e| failed("releasing the lease of", id.to_owned(), e))? {
            // remove() deleted it already; a TAP left by an interrupted remove goes too.
            if let Err(e) = self.net.delete_tap(&lease.tap).await {
                tracing::warn!(vm = id, error = %crate::provider::error_chain(&e), "deleting a leftover TAP failed");
            }
            tracing::info!(vm = id, ip = %lease.ip, "lease released");
        }
        Ok(())
    }
}

/// Runs the `guest-init net-config` argv over an agent stream, keeping at most
/// [`NET_CONFIG_OUTPUT_CAP`] bytes of its output.
async fn net_config_exec<S>(stream: S, argv: &[&str]) -> Result<silkd_client::ExecOutput, silkd_client::ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    AgentConn::new(stream).with_output_cap(NET_CONFIG_OUTPUT_CAP).exec(argv, ExecOptions::default(), b"").await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_net_config_streaming_endless_output_hits_the_cap() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use wire::codec::{encode_response, FrameSplitter};
        let (ours, mut guest) = tokio::io::duplex(64 * 1024);
        // A hostile guest agent: whatever the request, `started` and then stdout forever.
        tokio::spawn(async move {
            let mut splitter = FrameSplitter::new();
            let mut buf = vec![0; 4096];
            while splitter.next_frame().is_none() {
                match guest.read(&mut buf).await {
                    Ok(n) if n > 0 => splitter.push(&buf[..n]),
                    _ => return,
                }
            }
            let (mut rd, mut wr) = tokio::io::split(guest);
            tokio::spawn(async move { while rd.read(&mut buf).await.is_ok_and(|n| n > 0) {} });
            let started = encode_response(&wire::Response::Started { pid: 1 }).unwrap();
            let chunk = encode_response(&wire::Response::Stdout { data: wire::Bytes64(vec![b'y'; 4096]) }).unwrap();
            if wr.write_all(&started).await.is_err() {
                return;
            }
            while wr.write_all(&chunk).await.is_ok() {}
        });
        let got = net_config_exec(ours, &["/.chrysalis/guest-init", "net-config"]).await;
        assert!(
            matches!(
                got,
                Err(silkd_client::ClientError::OutputTooLarge(silkd_client::OutputTooLarge {
                    cap: NET_CONFIG_OUTPUT_CAP
                }))
            ),
            "{got:?}"
        );
    }
}

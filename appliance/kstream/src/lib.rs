//! The protocols of a kubelet's streaming routes (`docs/virtual-node.md` §1.3), as spoken by
//! the API server when it proxies `kubectl exec`, `attach`, `port-forward` and `logs` to a node
//! that declares the `ExtendWebSocketsToKubelet` feature:
//!
//! - [`channel`]: the WebSocket channel protocol of exec and attach (`v5.channel.k8s.io`,
//!   `v4.channel.k8s.io`): one channel byte per message, the error channel's `Status`, the
//!   resize channel's terminal sizes;
//! - [`spdy`]: SPDY/3.1 framing and a server session (streams, flow of data, header
//!   compression), the carrier of port-forward;
//! - [`portforward`]: the port-forward protocol (`portforward.k8s.io`) on a SPDY session: data
//!   and error stream pairs per request, each dialled to a port of the Pod;
//! - [`logs`]: the container-log query (`follow`, `tailLines`, `sinceSeconds`, `sinceTime`,
//!   `timestamps`, `limitBytes`, `previous`) and the filter that applies it to timestamped lines.
//!
//! Nothing here does HTTP or knows a Pod: the caller upgrades the connection, resolves the Pod
//! and hands this crate byte streams.
#![forbid(unsafe_code)]

pub mod channel;
pub mod logs;
pub mod portforward;
pub mod spdy;

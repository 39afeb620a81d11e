//! The one HTTP server of the box. sandboxd, the supervisor's TCP API and metrics, and the
//! kubelet port of both virtual nodes serve their axum routers through [`serve`], so every
//! network surface gets the same limits:
//!
//! - a **connection cap** ([`Limits::max_connections`]): past it a new connection is closed at
//!   once (counted in [`ConnStats::refused`]), so the accept queue never fills and a flood of
//!   idle sockets costs a bounded amount;
//! - a **request-head timeout** ([`Limits::header_timeout`]): a client that does not finish its
//!   request head in time (slowloris), or an idle keep-alive connection that sends no next
//!   request, is closed;
//! - a **TLS handshake timeout** ([`Limits::handshake_timeout`]);
//! - a **body deadline** for handlers that read bodies ([`read_body`]: a size cap and a total
//!   time, not a per-frame one, so a trickling body is cut off too);
//! - HTTP/1.1 upgrades (the sandboxd relays, kubelet streaming), over plain TCP or TLS.
//!
//! Each request carries [`Peer`] (the remote address and, over TLS with client
//! authentication, the client certificate chain it presented) as an extension.
//!
//! [`tls`] builds server configurations from PEM files, mints self-signed certificates and
//! prints their fingerprints; [`raise_nofile_limit`] lifts the soft descriptor limit to the
//! hard one at start-up.

#![forbid(unsafe_code)]

mod body;
mod server;
pub mod tls;

pub use body::{read_body, BodyError};
pub use server::{raise_nofile_limit, serve, ConnStats, Limits, Peer, Protocol, ServeOptions};

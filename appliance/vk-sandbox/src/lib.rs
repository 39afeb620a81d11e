//! The vk-sandbox provider (`docs/virtual-node.md` §2): Pods bound to this virtual node
//! become claims on the node's sandboxd warm pool.
//!
//! Code map: [`annotations`] (the Pod contract's inputs), [`sandboxd`] (the HTTP client),
//! [`state`] (the claims state file), [`authority`] (the delete verdict), [`status`] (pushed
//! status shapes), [`provider`] ([`SandboxProvider`], the `vnode::Provider`: its table, the
//! `create`, `delete` and `loops` modules, on `vnode::kit`), [`inventory`] (the fleet:
//! `NodeInventory`, warm capacity on the Node, the peer report to sandboxd).
//!
//! Architecture invariant: no VM is released on ambiguity — only on a positive owner verdict
//! or a listing that confirms absence.

#![forbid(unsafe_code)]

pub mod annotations;
pub mod authority;
pub mod inventory;
pub mod provider;
pub mod sandboxd;
pub mod state;
pub mod status;

#[cfg(test)]
mod test_utils;

pub use provider::{ProviderConfig, SandboxProvider, SandboxProviderError};

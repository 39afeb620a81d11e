//! Link operations over rtnetlink: look up, create the bridge with its address, enslave a port
//! (learning off, its VM's MAC pinned) and bring it up, delete. Run these inside [`crate::netns::run_in`] so the netlink socket belongs
//! to the right namespace.

use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::packet_route::neighbour::{NeighbourFlags, NeighbourState};
use rtnetlink::{Handle, LinkBridge, LinkBridgePort, LinkUnspec};

use crate::VmnetError;

/// What we need to know about one link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `IFLA_INFO_KIND` (`bridge`, `tun`, …), if it has one.
    pub kind: Option<String>,
    /// The bridge (or other controller) it is enslaved to.
    pub controller: Option<u32>,
    /// `IFF_UP` is set.
    pub up: bool,
}

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> VmnetError {
    let what = what.into();
    move |source| VmnetError::Netlink { what, source }
}

fn errno_is(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

/// A netlink connection in the calling thread's namespace; its driver task runs on the current
/// tokio runtime.
pub fn connect() -> Result<Handle, VmnetError> {
    let (conn, handle, _) = rtnetlink::new_connection().map_err(VmnetError::NetlinkSocket)?;
    tokio::spawn(conn);
    Ok(handle)
}

fn parse(msg: &LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        name: String::new(),
        kind: None,
        controller: None,
        up: msg.header.flags.contains(LinkFlags::Up),
    };
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Controller(c) => link.controller = Some(*c),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(match k {
                            InfoKind::Bridge => "bridge".to_string(),
                            InfoKind::Tun => "tun".to_string(),
                            other => other.to_string(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    link
}

/// The link called `name`, if there is one.
pub async fn get(h: &Handle, name: &str) -> Result<Option<Link>, VmnetError> {
    let mut s = h.link().get().match_name(name.to_string()).execute();
    match s.try_next().await {
        Ok(Some(msg)) => Ok(Some(parse(&msg))),
        Ok(None) => Ok(None),
        Err(e) if errno_is(&e, libc::ENODEV) => Ok(None),
        Err(e) => Err(nl(format!("looking up link {name}"))(e)),
    }
}

async fn set_up(h: &Handle, link: &Link) -> Result<(), VmnetError> {
    if link.up {
        return Ok(());
    }
    h.link()
        .set(LinkUnspec::new_with_index(link.index).up().build())
        .execute()
        .await
        .map_err(nl(format!("setting {} up", link.name)))
}

/// Creates bridge `name` if missing, makes sure it holds `addr/prefix_len` and is up. An existing
/// link of that name that is not a bridge is an error. Returns the bridge.
pub async fn ensure_bridge(h: &Handle, name: &str, addr: Ipv4Addr, prefix_len: u8) -> Result<Link, VmnetError> {
    let link = match get(h, name).await? {
        Some(l) => l,
        None => {
            match h.link().add(LinkBridge::new(name).up().build()).execute().await {
                Ok(()) => tracing::info!(bridge = name, "bridge created"),
                Err(e) if errno_is(&e, libc::EEXIST) => {}
                Err(e) => return Err(nl(format!("creating bridge {name}"))(e)),
            }
            get(h, name).await?.ok_or_else(|| VmnetError::Config(format!("bridge {name} vanished after creation")))?
        }
    };
    if link.kind.as_deref() != Some("bridge") {
        return Err(VmnetError::Config(format!(
            "link {name} exists but is a {} device, not a bridge",
            link.kind.as_deref().unwrap_or("plain")
        )));
    }
    let has_addr = h
        .address()
        .get()
        .set_link_index_filter(link.index)
        .execute()
        .try_filter(|m| {
            let hit = m.header.prefix_len == prefix_len
                && m.attributes.iter().any(|a| matches!(a, AddressAttribute::Local(IpAddr::V4(a)) | AddressAttribute::Address(IpAddr::V4(a)) if *a == addr));
            futures::future::ready(hit)
        })
        .try_next()
        .await
        .map_err(nl(format!("listing the addresses of {name}")))?
        .is_some();
    if !has_addr {
        match h.address().add(link.index, IpAddr::V4(addr), prefix_len).execute().await {
            Ok(()) => tracing::info!(bridge = name, %addr, prefix_len, "bridge address added"),
            Err(e) if errno_is(&e, libc::EEXIST) => {}
            Err(e) => return Err(nl(format!("adding {addr}/{prefix_len} to {name}"))(e)),
        }
    }
    set_up(h, &link).await?;
    Ok(link)
}

/// Enslaves `port` to the bridge with index `bridge` (if it is not already), turns MAC learning
/// off on that bridge port, sets its `isolated` flag (an isolated port never exchanges frames
/// with another isolated port), and pins `mac` to it with a static FDB entry (`bridge fdb replace
/// <mac> dev <port> master static`), then brings it up.
///
/// Why no learning: a clone resumes with its parent's MAC until it is re-addressed; a frame it
/// sends meanwhile would move the parent's MAC to the clone's port in a learning bridge and cut
/// the parent off until it transmits again. With every VM MAC pinned, a port never takes over
/// another VM's traffic; frames to unknown MACs are still flooded.
pub async fn attach_pinned_up(
    h: &Handle,
    port: &str,
    bridge: u32,
    mac: [u8; 6],
    isolated: bool,
) -> Result<(), VmnetError> {
    let link = get(h, port).await?.ok_or_else(|| VmnetError::Config(format!("link {port} does not exist")))?;
    if link.controller != Some(bridge) {
        h.link()
            .set(LinkUnspec::new_with_index(link.index).controller(bridge).build())
            .execute()
            .await
            .map_err(nl(format!("attaching {port} to the bridge")))?;
    }
    h.link()
        .set_port(LinkBridgePort::new(link.index).learning(false).isolated(isolated).build())
        .execute()
        .await
        .map_err(nl(format!("turning learning off (isolated {isolated}) on bridge port {port}")))?;
    h.neighbours()
        .add_bridge(link.index, &mac)
        .state(NeighbourState::Noarp)
        .flags(NeighbourFlags::Controller)
        .replace()
        .execute()
        .await
        .map_err(nl(format!("pinning the VM's MAC to {port}")))?;
    h.link()
        .set(LinkUnspec::new_with_index(link.index).up().build())
        .execute()
        .await
        .map_err(nl(format!("setting {port} up")))
}

/// Deletes link `name` if it exists and is of kind `kind`; returns whether it was deleted. A link
/// of another kind is an error (we never delete what we did not make).
pub async fn delete(h: &Handle, name: &str, kind: &str) -> Result<bool, VmnetError> {
    let Some(link) = get(h, name).await? else { return Ok(false) };
    if link.kind.as_deref() != Some(kind) {
        return Err(VmnetError::Config(format!(
            "refusing to delete {name}: it is a {} device, not {kind}",
            link.kind.as_deref().unwrap_or("plain")
        )));
    }
    match h.link().del(link.index).execute().await {
        Ok(()) => Ok(true),
        Err(e) if errno_is(&e, libc::ENODEV) => Ok(false),
        Err(e) => Err(nl(format!("deleting {name}"))(e)),
    }
}

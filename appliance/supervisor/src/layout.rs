//! The services' names ([`ServiceName`]) and where things live on this box ([`Layout`]: state,
//! run and binary directories), below everything else of the supervisor.

use std::path::PathBuf;

use serde::Serialize;

/// The supervised services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ServiceName {
    /// The warm-pool daemon.
    #[serde(rename = "sandboxd")]
    Sandboxd,
    /// The sandbox virtual node.
    #[serde(rename = "vk-sandbox")]
    VkSandbox,
    /// The VM-per-Pod virtual node.
    #[serde(rename = "vk-cocoon")]
    VkCocoon,
}

impl ServiceName {
    /// All services, in start order.
    pub const ALL: [ServiceName; 3] = [ServiceName::Sandboxd, ServiceName::VkSandbox, ServiceName::VkCocoon];

    /// `sandboxd`, `vk-sandbox`, `vk-cocoon` (also the binary, log and state directory name).
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceName::Sandboxd => "sandboxd",
            ServiceName::VkSandbox => "vk-sandbox",
            ServiceName::VkCocoon => "vk-cocoon",
        }
    }

    /// Parses [`ServiceName::as_str`].
    pub fn parse(s: &str) -> Option<ServiceName> {
        ServiceName::ALL.into_iter().find(|n| n.as_str() == s)
    }
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where things live on this box (the defaults are the appliance's; tests override them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The state partition (`supervisor.state_dir`).
    pub state_dir: PathBuf,
    /// Runtime files (`/run/chrysalis`): generated configs, pid files.
    pub run_dir: PathBuf,
    /// Where the service binaries are (`/usr/bin`).
    pub bin_dir: PathBuf,
    /// The guest catalog when `sandboxd.catalog` is unset.
    pub default_catalog: PathBuf,
}

impl Layout {
    /// `<state>/logs`.
    pub fn logs_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }

    /// `<state>/<svc>/pki`: a virtual node's credentials (its kubeconfig is
    /// [`foundation::KUBECONFIG_FILE`] there).
    pub fn pki_dir(&self, svc: ServiceName) -> PathBuf {
        self.state_dir.join(svc.as_str()).join("pki")
    }

    /// `<run>/services/<svc>.pid`.
    pub fn pid_file(&self, svc: ServiceName) -> PathBuf {
        self.run_dir.join("services").join(format!("{svc}.pid"))
    }
}

//! Volumes (`docs/sandboxd.md` §5.1), in SDK 0.1.19's desired-state view: `GET /v1/volumes`
//! (the node's catalog), `GET/PUT/PATCH /v1/sandboxes/{id}/volumes`, and the `volumes` of a
//! claim body, grant and listing row.

use serde::{Deserialize, Serialize};

/// One volume a sandbox wants or holds: a catalog name, where the guest mounts it, and its
/// mode (`rw`, or read-only when absent or `ro`). Read from a bare name too (`"datasets"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "SpecWire")]
pub struct VolumeSpec {
    /// The catalog volume.
    pub name: String,
    /// The guest mount point (absolute). Absent: `/mnt/<name>`, unless the claim asked for
    /// attach-only, when the disk is only linked at `/dev/volumes/<name>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount: Option<String>,
    /// `rw` for a writable, exclusive hold; absent or `ro` for a shared read-only one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

/// What a client may send for a volume: its name alone, or the mapping.
#[derive(Deserialize)]
#[serde(untagged)]
enum SpecWire {
    Name(String),
    Full {
        #[serde(default)]
        name: String,
        #[serde(default)]
        mount: Option<String>,
        #[serde(default)]
        mode: Option<String>,
    },
}

impl From<SpecWire> for VolumeSpec {
    fn from(w: SpecWire) -> Self {
        match w {
            SpecWire::Name(name) => VolumeSpec::named(name),
            SpecWire::Full { name, mount, mode } => VolumeSpec { name, mount, mode },
        }
    }
}

impl VolumeSpec {
    /// A read-only volume at its default mount point.
    pub fn named(name: impl Into<String>) -> Self {
        VolumeSpec { name: name.into(), ..VolumeSpec::default() }
    }

    /// Held read-write.
    pub fn rw(&self) -> bool {
        self.mode.as_deref() == Some("rw")
    }
}

/// Where one held volume stands.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VolumeState {
    /// The volume.
    pub name: String,
    /// `attached`, `pending` (wanted, not attached: see `error`) or `detaching`.
    pub state: String,
    /// Why it is not attached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The answer of every `…/volumes` call, errors included: the desired set, the applied set,
/// one state per volume. This node converges within the request, so `converging` is false
/// once it answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxVolumes {
    /// What the last request asked for.
    pub volumes_want: Vec<VolumeSpec>,
    /// What the guest holds now.
    pub volumes: Vec<VolumeSpec>,
    /// Per volume of either set.
    pub states: Vec<VolumeState>,
    /// Whether work is still under way.
    pub converging: bool,
    /// Why the request was refused, on an error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `PUT …/volumes`: the whole desired set (`[]` detaches everything).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumesPut {
    /// The desired set.
    pub volumes: Vec<VolumeSpec>,
}

/// `PATCH …/volumes`: additions and removals by name; absent lists change nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VolumesPatch {
    /// Volumes to add.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add: Option<Vec<VolumeSpec>>,
    /// Names to remove.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remove: Option<Vec<String>>,
}

/// One catalog volume of `GET /v1/volumes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CatalogVolume {
    /// Its name.
    pub name: String,
    /// Size of its image, bytes.
    pub size_bytes: u64,
    /// How many sandboxes hold it.
    pub holders: u32,
    /// Held read-write by one of them (no other may take it then).
    pub held_rw: bool,
}

/// `GET /v1/volumes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VolumeCatalog {
    /// Sorted by name.
    pub volumes: Vec<CatalogVolume>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_shapes() {
        // What SDK 0.1.19 sends: a name, or a mapping with mount and mode.
        let v: VolumeSpec =
            serde_json::from_value(serde_json::json!({"name": "d", "mount": "/data", "mode": "rw"})).expect("spec");
        assert!(v.rw());
        let bare: Vec<VolumeSpec> = serde_json::from_value(serde_json::json!(["d", {"name": "e"}])).expect("bare");
        assert_eq!(bare, vec![VolumeSpec::named("d"), VolumeSpec::named("e")]);
        assert_eq!(serde_json::to_value(VolumeSpec::named("d")).expect("json"), serde_json::json!({"name": "d"}));
        let p: VolumesPatch = serde_json::from_value(serde_json::json!({"remove": ["d"]})).expect("patch");
        assert_eq!(p.add, None);
        // What the SDK checks before it trusts a view.
        let view = serde_json::to_value(SandboxVolumes::default()).expect("json");
        for k in ["volumes_want", "volumes", "states"] {
            assert!(view[k].is_array(), "{k}");
        }
        assert_eq!(view["converging"], false);
        assert!(view.get("error").is_none());
    }
}

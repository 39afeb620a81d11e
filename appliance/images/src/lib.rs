//! The local image library: a content-addressed store of VM images and snapshots, named
//! `repo[:tag]` (a bare `repo` is `repo:latest`).
//!
//! - [`Store`]: open a root, [`Store::import_image`] / [`Store::import_catalog_template`],
//!   [`Store::save_snapshot`], [`Store::resolve`] to boot or restore, [`Store::list`],
//!   [`Store::remove`] (untag; [`Store::remove_if`] only while the name still names a digest), [`Store::gc`], [`Store::verify`];
//! - [`reference`]: the validated [`Reference`] and [`Digest`] names;
//! - [`manifest`]: the image and snapshot manifests (JSON blobs);
//! - `blobs`, `refs`, `lock`: content-addressed files, the name table, the flock discipline;
//! - `snapshot`, `gc`: snapshot ingest / materialisation, and collection.
//!
//! The API is synchronous (it hashes and copies files): async callers wrap calls in
//! `tokio::task::spawn_blocking`.
//!
//! Invariants: a blob never changes after it is written (mode 0444, replaced never; restore
//! reads materialised hard links only); a name changes only under `.lock`; `gc` removes
//! nothing a name, a named snapshot's base image or an `in_use` digest reaches, and nothing an
//! unfinished write holds (`.gc.lock`).

#![forbid(unsafe_code)]

mod blobs;
pub mod error;
mod gc;
mod lock;
pub mod manifest;
pub mod reference;
mod refs;
mod snapshot;
mod store;

#[cfg(test)]
mod tests;

pub use error::ImageError;
pub use gc::GcReport;
pub use manifest::{ImageManifest, Kind, Manifest, SnapshotManifest};
pub use reference::{Digest, Reference};
pub use snapshot::{valid_namespace, Scratch};
pub use store::{default_root, Entry, ImageSource, Resolved, ResolvedImage, ResolvedSnapshot, Store, MATERIALISED_DIR};

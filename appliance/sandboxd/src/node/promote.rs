//! Promoted templates (`docs/sandboxd.md` §5.2): `POST …/{id}/promote {token, template}` keeps
//! a claimed sandbox's memory and disk as a template ([`crate::promoted`]) that a pool can keep
//! warm (`PUT /v1/pools`: its clones start from it) and that a claim can require
//! (`require_promoted`); `DELETE /v1/templates` removes one that no pool uses.

use super::branch::BranchError;
use super::Node;
use crate::claims::Claim;
use crate::pool::PoolKey;
use crate::promoted::Promoted;

/// Why a promote or a template delete failed.
#[derive(Debug, thiserror::Error)]
pub enum PromoteError {
    /// Not a valid template name.
    #[error("invalid template name {0:?}")]
    Name(String),
    /// The name is the catalog's (a template or an alias).
    #[error("template {0:?} is a name of the image catalog; promote under another name")]
    CatalogName(String),
    /// A pool keeps the template warm: it cannot be replaced or deleted.
    #[error("template {0:?} is kept warm by a pool; remove the pool (PUT /v1/pools) first")]
    Pooled(String),
    /// No such promoted template.
    #[error("no promoted template {0:?}")]
    NotFound(String),
    /// The sandbox cannot be snapshotted (hibernated, egress, draining) or the snapshot failed.
    #[error(transparent)]
    Branch(#[from] BranchError),
    /// Writing the template failed.
    #[error("writing the template")]
    Io(#[source] std::io::Error),
}

impl Node {
    /// Promotes `claim` to template `name`; the caller checked its token.
    pub async fn promote(&self, claim: &Claim, name: &str) -> Result<Promoted, PromoteError> {
        PoolKey::parse(name, None, None).map_err(|_| PromoteError::Name(name.to_string()))?;
        if self.refill.catalog.resolve(name).is_ok() {
            return Err(PromoteError::CatalogName(name.to_string()));
        }
        if self.pooled(name) {
            return Err(PromoteError::Pooled(name.to_string()));
        }
        self.branchable(claim)?;
        let _g = self.snapshots.lock().await;
        let staging = self.promoted.staging();
        self.snapshot_into(claim, &staging).await?;
        let rec = Promoted {
            name: name.to_string(),
            key: claim.rec.key.clone().into(),
            content_digest: String::new(),
            sandbox_id: claim.rec.id.clone(),
        };
        let snapped = self.promoted.install(&staging, rec).map_err(PromoteError::Io);
        if snapped.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        let rec = snapped?;
        crate::metrics::inc(&self.metrics.promotions);
        tracing::info!(claim = %claim.rec.id, template = %name, digest = %rec.content_digest, "promoted");
        Ok(rec)
    }

    /// Deletes promoted template `name` (`409` while a pool keeps it warm).
    pub fn delete_template(&self, name: &str) -> Result<(), PromoteError> {
        if self.pooled(name) {
            return Err(PromoteError::Pooled(name.to_string()));
        }
        match self.promoted.remove(name) {
            Ok(true) => {
                tracing::info!(template = %name, "promoted template deleted");
                Ok(())
            }
            Ok(false) => Err(PromoteError::NotFound(name.to_string())),
            Err(e) => Err(PromoteError::Io(e)),
        }
    }

    /// Whether `name` is a promoted template.
    pub fn is_promoted(&self, name: &str) -> bool {
        self.promoted.get(name).is_some()
    }

    /// Whether a pool keeps template `name` warm.
    fn pooled(&self, name: &str) -> bool {
        self.pools().iter().any(|p| p.key.template() == name)
    }
}

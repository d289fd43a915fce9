//! Where the admin plane reads adapter artifacts from: directories, and
//! the object stores it may fetch `s3://` artifacts from.

use std::path::PathBuf;
use std::sync::Arc;

use lorafleet_artifact::roots::ArtifactRoots;

use crate::admin::artifact_roots;
use crate::flag_error::FlagError;

#[derive(Debug, Clone, Default, clap::Args)]
pub struct ArtifactFlags {
    /// Directory holding adapter artifacts; registration reads and digests
    /// artifacts here. Repeatable.
    #[arg(long, env = "LORAFLEET_ARTIFACT_ROOT", value_delimiter = ',')]
    pub artifact_root: Vec<PathBuf>,
    #[command(flatten)]
    pub stores: lorafleet_store::StoreFlags,
}

impl ArtifactFlags {
    /// The roots (None: registration from files is off) and the stores.
    pub fn validate(
        &self,
    ) -> Result<(Option<Arc<ArtifactRoots>>, lorafleet_store::ObjectStores), FlagError> {
        let roots = artifact_roots(&self.artifact_root)?;
        let stores = self
            .stores
            .stores(Default::default())
            .map_err(|e| FlagError::new(e.flag(), e.to_string()))?;
        Ok((roots, stores))
    }
}

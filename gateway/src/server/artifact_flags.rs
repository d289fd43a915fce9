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
    /// An object store adapter artifacts may be registered from,
    /// NAME=s3://bucket/prefix; repeatable, the same list as the workers'.
    /// Credentials come from the AWS chain.
    #[arg(
        long = "artifact-store",
        env = "LORAFLEET_ARTIFACT_STORES",
        value_delimiter = ','
    )]
    pub artifact_stores: Vec<lorafleet_store::StoreSpec>,
    /// An S3-compatible server's URL for the stores (default: AWS, or
    /// AWS_ENDPOINT_URL).
    #[arg(long, env = "LORAFLEET_ARTIFACT_STORE_ENDPOINT")]
    pub artifact_store_endpoint: Option<String>,
}

impl ArtifactFlags {
    /// The roots (None: registration from files is off) and the stores.
    pub fn validate(
        &self,
    ) -> Result<(Option<Arc<ArtifactRoots>>, lorafleet_store::ObjectStores), FlagError> {
        let roots = artifact_roots(&self.artifact_root)?;
        let stores = lorafleet_store::ObjectStores::new(
            &self.artifact_stores,
            lorafleet_store::FetchOptions {
                endpoint: self.artifact_store_endpoint.clone(),
                ..Default::default()
            },
        )
        .map_err(|e| FlagError::new("--artifact-store", e))?;
        Ok((roots, stores))
    }
}
